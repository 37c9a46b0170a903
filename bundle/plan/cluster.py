"""The devices and links a plan runs on: a cluster file, or this machine as measured.

A cluster file (YAML; see ``clusters/``)::

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

A cluster of several device types names them under ``device_types`` (each as ``device`` above,
plus ``cpu: 0.4`` beside ``speed: measure`` for a CPU process given that fraction of one CPU, an
emulated slower device) and lists each node's devices in local-index order::

    device_types:
      A100: {name: A100 SXM4 40 GB, memory_gib: 40, speed: {...}}
      V100: {name: Tesla V100 SXM2 32 GB, memory_gib: 32, speed: {...}}
    nodes:
      - {A100: 8}
      - {V100: 8}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from bundle.config.yaml_input import load_yaml
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
class DeviceType:
    """One kind of device of a mixed cluster."""

    key: str  # its name in the cluster file ("A100")
    name: str
    memory_bytes: float
    speed: Speed | None  # None: measure the model on this machine
    cpu: float | None = None  # fraction of one CPU a process of this type gets (emulation)
    # How much slower than ``cpu`` such a process computes beside its neighbours (measured:
    # bundle/plan/shares.py; 1.0 where not measured).
    penalty: float = 1.0

    def check_precision(self, precision: str) -> None:
        if self.speed is not None and precision not in self.speed.peak_flops:
            have = ", ".join(sorted(self.speed.peak_flops))
            raise ConfigError(
                "--precision", precision, f"{self.name} computes in {have} (cluster file)"
            )


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
    # A mixed cluster: its device types, and per node the type (key) of each local device.
    types: tuple[DeviceType, ...] = ()
    kinds: tuple[tuple[str, ...], ...] = ()

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def mixed(self) -> bool:
        return bool(self.kinds)

    def device_type(self, key: str) -> DeviceType:
        return next(t for t in self.types if t.key == key)

    def kind_of(self, node: int, device: int) -> str:
        """The type key of a node's local device ("" on a cluster of one device type)."""
        return self.kinds[node][device] if self.kinds else ""

    def check_precision(self, precision: str) -> None:
        for t in self.types:
            t.check_precision(precision)
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

    def speed(self, device: Mapping[str, Any], at: str = "device.") -> Speed | None:
        if device.get("speed") == "measure":
            return None
        sec = self.section(device, "speed", at)
        peaks = self.section(sec, "peak_tflops", f"{at}speed.")
        unknown = sorted(set(peaks) - set(PRECISIONS))
        if unknown or not peaks:
            raise self.fail(
                f"{at}speed.peak_tflops", dict(peaks), f"give one or more of {list(PRECISIONS)}"
            )
        efficiency = self.number(sec, "efficiency", f"{at}speed.")
        if efficiency > 1:
            raise self.fail(f"{at}speed.efficiency", efficiency, "must be a fraction in (0, 1]")
        return Speed(
            peak_flops={p: self.number(peaks, p, f"{at}speed.peak_tflops.") * 1e12 for p in peaks},
            memory_bandwidth=self.number(sec, "memory_bandwidth_gbs", f"{at}speed.") * 1e9,
            efficiency=efficiency,
            kernel_latency=self.number(sec, "kernel_latency_us", f"{at}speed.", zero=True) * 1e-6,
        )

    def device_type(self, key: Any, doc: Any) -> DeviceType:
        at = f"device_types.{key}."
        if not isinstance(key, str) or not key:
            raise self.fail("device_types", key, "names must be non-empty strings")
        if not isinstance(doc, Mapping):
            raise self.fail(at[:-1], doc, "must be a mapping (see clusters/*.yaml)")
        unknown = sorted(set(doc) - _TYPE_KEYS)
        if unknown:
            raise self.fail(
                at + unknown[0], doc[unknown[0]], f"is not a key; allowed: {sorted(_TYPE_KEYS)}"
            )
        speed = self.speed(doc, at)
        cpu = None
        if "cpu" in doc:
            cpu = self.number(doc, "cpu", at)
            if speed is not None or cpu > 1:
                raise self.fail(at + "cpu", cpu, "a fraction in (0, 1] beside 'speed: measure'")
        return DeviceType(
            key=key,
            name=self.text(doc, "name", at),
            memory_bytes=self.number(doc, "memory_gib", at) * 2**30,
            speed=speed,
            cpu=cpu,
        )

    def node_kinds(
        self, nodes: Any, types: Mapping[str, DeviceType]
    ) -> tuple[tuple[str, ...], ...]:
        if not isinstance(nodes, list) or not nodes:
            raise self.fail("nodes", nodes, "must list each node's devices, e.g. - {A100: 8}")
        out = []
        for n, node in enumerate(nodes):
            if not isinstance(node, Mapping) or not node:
                raise self.fail(f"nodes[{n}]", node, "must map device types to counts")
            kinds: list[str] = []
            for key, count in node.items():
                if key not in types:
                    raise self.fail(
                        f"nodes[{n}].{key}", count, f"is not a device type; have {sorted(types)}"
                    )
                if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                    raise self.fail(f"nodes[{n}].{key}", count, "must be an integer >= 1")
                kinds += [key] * count
            out.append(tuple(kinds))
        if len({len(k) for k in out}) > 1:
            counts = [len(k) for k in out]
            raise self.fail("nodes", counts, "every node must have the same number of devices")
        return tuple(out)


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
_MIXED_KEYS = {"name", "nodes", "device_types", "intra_node", "inter_node"}
_TYPE_KEYS = {"name", "memory_gib", "speed", "cpu"}


def load_cluster(path: str) -> Cluster:
    """Read and check a cluster file; a missing, negative or unknown key is a ConfigError."""
    r = _Reader(path)
    try:
        doc = load_yaml(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            "--cluster", path, f"must be a readable YAML file ({exc.strerror})"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError("--cluster", path, f"must be valid YAML ({exc})") from exc
    if not isinstance(doc, Mapping):
        raise ConfigError("--cluster", path, "must hold a mapping (see clusters/*.yaml)")
    if "device_types" in doc:
        return _load_mixed(r, doc)
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise r.fail(unknown[0], doc[unknown[0]], f"is not a key; allowed: {sorted(_KEYS)}")
    device = r.section(doc, "device")
    # The counts may be left out: the file describes the kind of node and its links, and
    # plan.py's --nodes / --gpus-per-node ask how many (``counted``).
    return Cluster(
        name=r.text(doc, "name"),
        nodes=r.count(doc, "nodes") if "nodes" in doc else 1,
        devices_per_node=r.count(doc, "devices_per_node") if "devices_per_node" in doc else 0,
        device_name=r.text(device, "name", "device."),
        memory_bytes=r.number(device, "memory_gib", "device.") * 2**30,
        speed=r.speed(device),
        intra=r.link(doc, "intra_node"),
        inter=r.link(doc, "inter_node"),
    )


def counted(cluster: Cluster, nodes: int | None, per_node: int | None) -> tuple[Cluster, str]:
    """A uniform cluster widened to the asked-for counts where they exceed its file's, and a note
    saying so ('' when nothing changed). A mixed cluster lists its nodes: returned as it is."""
    if cluster.mixed:
        return cluster, ""
    if per_node is None and cluster.devices_per_node == 0:
        raise ConfigError(
            "--gpus-per-node", None, f"the cluster '{cluster.name}' gives no devices_per_node"
        )
    # Fewer than the file lists is a part of it, planned as today; more widens it, with a note.
    nodes = max(cluster.nodes, nodes or 0)
    per_node = max(cluster.devices_per_node, per_node or 0)
    if (nodes, per_node) == (cluster.nodes, cluster.devices_per_node):
        return cluster, ""
    asked = [f"--nodes {nodes}"] if nodes != cluster.nodes else []
    asked += [f"--gpus-per-node {per_node}"] if per_node != cluster.devices_per_node else []
    was = f"{cluster.nodes} node(s) of {cluster.devices_per_node or '(not given)'}"
    note = (
        f"{' and '.join(asked)} in place of {was} that the cluster '{cluster.name}' gives: its "
        f"{cluster.device_name} and links stand for every node"
    )
    return replace(cluster, nodes=nodes, devices_per_node=per_node), note


def _load_mixed(r: _Reader, doc: Mapping[str, Any]) -> Cluster:
    """A cluster file with ``device_types`` and a list of nodes."""
    unknown = sorted(set(doc) - _MIXED_KEYS)
    if unknown:
        raise r.fail(unknown[0], doc[unknown[0]], f"is not a key; allowed: {sorted(_MIXED_KEYS)}")
    sec = r.section(doc, "device_types")
    types = {key: r.device_type(key, value) for key, value in sec.items()}
    if not types:
        raise r.fail("device_types", dict(sec), "must name one or more device types")
    kinds = r.node_kinds(doc.get("nodes"), types)
    used = [types[k] for k in dict.fromkeys(k for node in kinds for k in node)]
    speeds = [t.speed for t in used]
    return Cluster(
        name=r.text(doc, "name"),
        nodes=len(kinds),
        devices_per_node=len(kinds[0]),
        device_name=" + ".join(t.name for t in used),
        memory_bytes=min(t.memory_bytes for t in used),
        # The first type's speed stands for the cluster where one figure is asked for.
        speed=speeds[0] if all(s is not None for s in speeds) else None,
        intra=r.link(doc, "intra_node"),
        inter=r.link(doc, "inter_node"),
        types=tuple(used),
        kinds=kinds,
    )
