"""The devices and links a plan runs on: a cluster file, or this machine as measured.

A cluster file (YAML; ``clusters/`` ships two)::

    name: 4 x 4 V100 PCIe, 10 Gb/s Ethernet
    nodes: 4
    devices_per_node: 4
    device:
      name: Tesla V100 PCIe 32 GB
      memory_gib: 32
      speed:                      # or: speed: measure (time the model on this machine)
        peak_tflops: {fp32: 14, fp16: 112}   # a precision left out is one the device lacks
        memory_bandwidth_gbs: 900
        efficiency: 0.5           # fraction of peak FLOP/s and bandwidth a kernel reaches
        kernel_latency_us: 5      # floor of one kernel's time
    intra_node: {bandwidth_gbs: 15.75, latency_us: 10}
    inter_node: {bandwidth_gbs: 1.25, latency_us: 50}

Bandwidths are bytes per second in one direction of one link between two devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bundle.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s


@dataclass(frozen=True)
class Speed:
    """A device's speed for the roofline estimate of a block: per operator, the slowest of its
    FLOPs at the dtype's peak, its bytes at the memory bandwidth (both derated by
    ``efficiency``) and one kernel's latency."""

    peak_flops: Mapping[str, float]  # per precision
    memory_bandwidth: float  # bytes/s
    efficiency: float
    kernel_latency: float  # s


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device_name: str
    memory_bytes: float  # per device
    speed: Speed | None  # None: measure the model on this machine
    intra: Link
    inter: Link
    # Measured collective throughput where it differs from point-to-point (gloo on loopback).
    collective: Link | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def check_precision(self, precision: str) -> None:
        if self.speed is not None and precision not in self.speed.peak_flops:
            have = ", ".join(sorted(self.speed.peak_flops))
            raise ConfigError(
                "--precision", precision, f"{self.device_name} computes in {have} (cluster file)"
            )


class _Reader:
    """Reads one cluster file's keys; every problem is one ConfigError naming the key."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"--cluster {self.path}: key {key}", value, allowed)

    def section(self, doc: Mapping[str, Any], key: str, prefix: str = "") -> Mapping[str, Any]:
        value = doc.get(key) if isinstance(doc, Mapping) else None
        if not isinstance(value, Mapping):
            raise self.fail(prefix + key, value, "must be a mapping (see clusters/*.yaml)")
        return value

    def number(
        self, doc: Mapping[str, Any], key: str, prefix: str = "", *, zero: bool = False
    ) -> float:
        value = doc.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not isinstance(value, (int, float)) or not ok or value < 0 or (value == 0 and not zero):
            bound = ">= 0" if zero else "> 0"
            raise self.fail(prefix + key, value, f"must be a number {bound}")
        return float(value)

    def count(self, doc: Mapping[str, Any], key: str) -> int:
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.fail(key, value, "must be an integer >= 1")
        return value

    def text(self, doc: Mapping[str, Any], key: str, prefix: str = "") -> str:
        value = doc.get(key)
        if not isinstance(value, str) or not value:
            raise self.fail(prefix + key, value, "must be a non-empty string")
        return value

    def link(self, doc: Mapping[str, Any], key: str) -> Link:
        sec = self.section(doc, key)
        return Link(
            self.number(sec, "bandwidth_gbs", f"{key}.") * 1e9,
            self.number(sec, "latency_us", f"{key}.", zero=True) * 1e-6,
        )

    def speed(self, device: Mapping[str, Any]) -> Speed | None:
        if device.get("speed") == "measure":
            return None
        sec = self.section(device, "speed", "device.")
        peaks = self.section(sec, "peak_tflops", "device.speed.")
        unknown = sorted(set(peaks) - set(PRECISIONS))
        if unknown or not peaks:
            raise self.fail(
                "device.speed.peak_tflops", dict(peaks), f"give one or more of {list(PRECISIONS)}"
            )
        efficiency = self.number(sec, "efficiency", "device.speed.")
        if efficiency > 1:
            raise self.fail("device.speed.efficiency", efficiency, "must be a fraction in (0, 1]")
        return Speed(
            peak_flops={
                p: self.number(peaks, p, "device.speed.peak_tflops.") * 1e12 for p in peaks
            },
            memory_bandwidth=self.number(sec, "memory_bandwidth_gbs", "device.speed.") * 1e9,
            efficiency=efficiency,
            kernel_latency=self.number(sec, "kernel_latency_us", "device.speed.", zero=True) * 1e-6,
        )


# What a plan assumes of a device and its links when none is measured or given: several nodes
# or torchrun (every process must plan alike), plan.py asked for GPUs without --cluster, and the
# links of a GPU profiled here (gloo on loopback says nothing of NVLink or InfiniBand).
# Per kind: speed, link within a node, link between nodes.
NOMINAL = {
    "cpu": (
        Speed({"fp32": 50e9, "bf16": 100e9, "fp16": 50e9}, 10e9, 1.0, 5e-6),
        Link(2e9, 100e-6),
        Link(1.25e9, 50e-6),
    ),
    "cuda": (  # a data-centre GPU; NVLink within a node, 100 Gb/s InfiniBand between nodes
        Speed({"fp32": 100e12, "bf16": 200e12, "fp16": 200e12}, 1.5e12, 0.5, 5e-6),
        Link(100e9, 5e-6),
        Link(12.5e9, 10e-6),
    ),
}


def nominal(
    kind: str, nodes: int, devices_per_node: int, *, memory_bytes: float = float("inf")
) -> Cluster:
    """``nodes`` x ``devices_per_node`` of the nominal ``kind`` device (``NOMINAL``)."""
    speed, intra, inter = NOMINAL[kind]
    return Cluster(
        name=f"nominal {kind}",
        nodes=nodes,
        devices_per_node=devices_per_node,
        device_name=f"nominal {kind}",
        memory_bytes=memory_bytes,
        speed=speed,
        intra=intra,
        inter=inter,
    )


def describe_nominal(kind: str) -> str:
    """The nominal figures in words, for the line that says a plan assumed them."""
    speed, intra, inter = NOMINAL[kind]
    peaks = ", ".join(f"{p} {f / 1e12:g}" for p, f in speed.peak_flops.items())
    return (
        f"nominal {kind} device (peak TFLOP/s {peaks}; memory bandwidth"
        f" {speed.memory_bandwidth / 1e9:g} GB/s; {intra.bandwidth / 1e9:g} GB/s within a node,"
        f" {inter.bandwidth / 1e9:g} GB/s between nodes)"
    )


_KEYS = {"name", "nodes", "devices_per_node", "device", "intra_node", "inter_node"}


def load_cluster(path: str) -> Cluster:
    """Read and check a cluster file; a missing, negative or unknown key is a ConfigError."""
    r = _Reader(path)
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            "--cluster", path, f"must be a readable YAML file ({exc.strerror})"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError("--cluster", path, f"must be valid YAML ({exc})") from exc
    if not isinstance(doc, Mapping):
        raise ConfigError("--cluster", path, "must hold a mapping (see clusters/*.yaml)")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise r.fail(unknown[0], doc[unknown[0]], f"is not a key; allowed: {sorted(_KEYS)}")
    device = r.section(doc, "device")
    return Cluster(
        name=r.text(doc, "name"),
        nodes=r.count(doc, "nodes"),
        devices_per_node=r.count(doc, "devices_per_node"),
        device_name=r.text(device, "name", "device."),
        memory_bytes=r.number(device, "memory_gib", "device.") * 2**30,
        speed=r.speed(device),
        intra=r.link(doc, "intra_node"),
        inter=r.link(doc, "inter_node"),
    )
