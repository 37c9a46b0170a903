"""Device checks and placement of bundle/runtime/devices.py, with the CUDA device count faked (no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from bundle.config import RunConfig
from bundle.errors import ConfigError
from bundle.runtime import devices as dev
from bundle.topology import Topology
from tests.support.config import make_config

ENV = dev.MULTI_RANK_GPU_ENV


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this node has ``n`` CUDA devices; returns the devices made current, in order."""
    current: list[int] = []

    def fake(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(int(d)))
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 7))  # a multi-rank mode
        return current

    monkeypatch.setenv(ENV, "unset")  # records the original, so teardown restores it
    monkeypatch.delenv(ENV)
    return fake


def _cfg(procs: int, *, share: bool = False, backend: str = "nccl") -> RunConfig:
    return make_config(
        parallel={"shape": (procs,)}, launch={"backend": backend, "share_gpus": share}
    )


def _check(cfg: RunConfig) -> None:
    dev.check_devices(cfg, Topology.from_config(cfg))


def test_more_processes_than_gpus_is_refused_and_names_share_gpus(gpus):
    gpus(2)
    with pytest.raises(ConfigError) as err:
        _check(_cfg(4))
    assert err.value.key == "--nproc-per-node" and err.value.value == 4
    assert "has 2" in str(err.value) and "--share-gpus" in str(err.value)


def test_share_gpus_allows_more_processes_than_gpus(gpus):
    gpus(2)
    _check(_cfg(4, share=True))
    gpus(1)
    _check(_cfg(3, share=True))


def test_one_process_per_gpu_needs_no_sharing(gpus):
    gpus(4)
    _check(_cfg(4))
    _check(_cfg(2))


def test_no_gpu_is_refused_even_when_sharing(gpus):
    gpus(0)
    for share in (False, True):
        with pytest.raises(ConfigError) as err:
            _check(_cfg(2, share=share))
        assert err.value.key == "--nproc-per-node" and "has 0" in str(err.value)
        assert "--share-gpus" not in str(err.value)  # sharing cannot help without a GPU


def test_gloo_never_counts_gpus(gpus):
    gpus(0)
    _check(_cfg(8, backend="gloo"))
    _check(_cfg(8, share=True, backend="gloo"))


def test_auto_backend_checks_devices_only_when_it_picks_nccl(gpus):
    gpus(0)
    _check(_cfg(4, backend="auto"))  # gloo: no CUDA here
    gpus(2)
    with pytest.raises(ConfigError):
        _check(_cfg(4, backend="auto"))  # nccl, 4 processes on 2 GPUs
    _check(_cfg(4, share=True, backend="auto"))


def test_placement_is_one_gpu_per_local_rank_by_default(gpus):
    current = gpus(4)
    devices = [dev.device_for("nccl", r) for r in range(4)]
    assert devices == [torch.device("cuda", r) for r in range(4)]
    assert current == [0, 1, 2, 3]
    assert ENV not in os.environ


def test_shared_placement_is_round_robin_and_enables_multi_rank_nccl(gpus):
    current = gpus(2)
    devices = [dev.device_for("nccl", r, share_gpus=True) for r in range(5)]
    assert [d.index for d in devices] == [0, 1, 0, 1, 0]
    assert all(d.type == "cuda" for d in devices)
    assert current == [0, 1, 0, 1, 0]  # each made current before its process group exists
    assert os.environ[ENV] == "1"


def test_all_ranks_on_one_gpu(gpus):
    current = gpus(1)
    assert {dev.device_for("nccl", r, share_gpus=True).index for r in range(4)} == {0}
    assert current == [0, 0, 0, 0]


def test_a_multi_rank_setting_from_the_user_is_kept(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv(ENV, "0")
    dev.device_for("nccl", 1, share_gpus=True)
    assert os.environ[ENV] == "0"


def test_nccl_before_2_30_shares_a_gpu_by_a_host_id_per_process(monkeypatch):
    """NCCL 2.28 (torch 2.11's) has no multi-rank mode: each process claims a host of its own."""
    monkeypatch.setenv(dev.HOSTID_ENV, "unset")
    monkeypatch.delenv(dev.HOSTID_ENV)
    assert dev.allow_shared_gpu((2, 28, 9)) == dev.HOSTID_ENV
    assert os.environ[dev.HOSTID_ENV].endswith(f"-pid{os.getpid()}") and ENV not in os.environ
    monkeypatch.setenv(dev.HOSTID_ENV, "mine")
    dev.allow_shared_gpu((2, 28, 9))
    assert os.environ[dev.HOSTID_ENV] == "mine"
    assert dev.allow_shared_gpu((2, 30, 7)) == ENV and os.environ[ENV] == "1"


def test_gloo_places_on_the_cpu_and_touches_nothing(gpus):
    current = gpus(2)
    assert dev.device_for("gloo", 3, share_gpus=True) == torch.device("cpu")
    assert current == [] and ENV not in os.environ


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_gloo_interface_is_pinned_for_every_backend(backend, monkeypatch):
    """NCCL jobs create gloo groups too (control, async): their interface is pinned as well.
    Only gloo shares out the CPU threads."""
    pinned: list[tuple[str, int]] = []
    threads: list[int] = []
    monkeypatch.setattr(dev, "pin_gloo_interface", lambda h, p: pinned.append((h, p)))
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    dev.prepare_backend_env(backend, "10.0.0.1", 29500, procs_per_node=2)
    assert pinned == [("10.0.0.1", 29500)]
    assert bool(threads) == (backend == "gloo")


def _placed(devices: list[int], precision: str = "fp32") -> RunConfig:
    return make_config(
        parallel={
            "shape": (len(devices),),
            "placement": tuple((0, d, "gpu", None) for d in devices),
        },
        launch={"backend": "nccl"},
        compute={"precision": precision},
    )


def test_a_plans_device_beyond_the_node_is_refused(gpus):
    gpus(2)
    _check(_placed([1, 0]))
    with pytest.raises(ConfigError, match=r"rank 1 .* on cuda:2.*has 2 CUDA device"):
        _check(_placed([0, 2]))


@pytest.mark.parametrize("capability,refused", [((7, 0), True), ((8, 0), False)])
def test_bf16_on_a_device_without_it_is_refused_naming_the_device(
    gpus, monkeypatch, capability, refused
):
    gpus(2)
    names = {0: "NVIDIA A100-SXM4-40GB", 1: "Tesla V100-SXM2-32GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda i: (8, 0) if i == 0 else capability
    )
    if not refused:
        _check(_placed([0, 1], "bf16"))
        return
    with pytest.raises(ConfigError) as err:
        _check(_placed([0, 1], "bf16"))
    assert "\n" not in str(err.value)
    assert "rank 1" in str(err.value) and "Tesla V100-SXM2-32GB" in str(err.value)
