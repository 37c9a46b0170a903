"""CPU quotas of bundle/launch/throttle.py: the arithmetic and names as data, the hierarchy found
from /proc texts, and real cgroups (created, limiting, removed) where this machine allows them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bundle import preflight
from bundle.errors import ConfigError
from bundle.launch import throttle
from bundle.runtime import devices
from bundle.topology import Place, Topology
from tests.support.config import make_config

WHY_NOT = throttle.available()
needs_cgroups = pytest.mark.skipif(WHY_NOT is not None, reason=f"no CPU quota cgroups: {WHY_NOT}")


def _topo(*shares: float | None) -> Topology:
    return Topology(
        shape=(len(shares),),
        num_bundles=1,
        procs_per_node=len(shares),
        global_batch=8,
        micro_batches=1,
        placement=tuple(Place(0, cpu=s) for s in shares),
    )


# -- data -------------------------------------------------------------------------------------


def test_quota_is_the_share_of_the_period():
    assert throttle.quota_us(0.4) == 1_000  # of its own period, 2.5 ms
    assert throttle.quota_us(1.0) == 2_000
    assert throttle.quota_us(2.5) == 5_000
    assert throttle.quota_us(0.25, period=20_000) == 5_000
    assert throttle.quota_us(0.001) == throttle.MIN_QUOTA_US  # the kernel's floor


def test_the_period_is_short_and_longer_only_for_small_shares():
    assert throttle.period_us(0.5) == throttle.PERIOD_US == 2_000
    assert throttle.period_us(2.5) == 2_000
    # Under half a CPU a 2 ms period would need a quota under the kernel's 1 ms: the period grows
    # instead, so the share is still the one asked for.
    assert throttle.period_us(0.4) == 2_500
    assert throttle.period_us(0.2) == 5_000
    assert throttle.period_us(0.05) == 20_000
    assert throttle.quota_us(0.05, throttle.period_us(0.05)) == 1_000
    assert throttle.period_us(1e-4) == throttle.MAX_PERIOD_US
    with pytest.raises(ValueError, match="must be > 0"):
        throttle.period_us(0)


@pytest.mark.parametrize("share", [0, -0.5, float("nan")])
def test_a_share_must_be_positive(share):
    with pytest.raises(ValueError, match="must be > 0"):
        throttle.quota_us(share)


def test_limit_files_per_version():
    assert throttle.Hierarchy(2, Path("/x")).limit_files(0.4) == {
        "cpu.max": "1000 2500",
        "cpu.weight": "400",  # 10x the default (100) per CPU of the share
    }
    # v1: the period before the quota (a quota above the old period is refused otherwise).
    assert list(throttle.Hierarchy(1, Path("/x")).limit_files(0.5).items()) == [
        ("cpu.cfs_period_us", "2000"),
        ("cpu.cfs_quota_us", "1000"),
        ("cpu.shares", "5120"),  # 10x the default (1024) per CPU of the share
    ]
    assert throttle.Hierarchy(1, Path("/x")).limit_files(0.02)["cpu.cfs_period_us"] == "50000"
    assert throttle.Hierarchy(2, Path("/x")).limit_files(50.0)["cpu.weight"] == "10000"


def test_cgroup_names_carry_the_job_and_rank():
    assert throttle.cgroup_name("29500.123", 3) == "bundle-29500.123-rank3"
    assert throttle.cgroup_name("run/id:1 x", 0) == "bundle-run_id_1_x-rank0"


def test_only_cpu_runs_with_shares_are_throttled():
    topo = _topo(1.0, None, 0.4)
    assert throttle.cpu_shares(topo, range(3), "gloo") == {0: 1.0, 2: 0.4}
    assert throttle.cpu_shares(topo, [1, 2], "gloo") == {2: 0.4}
    assert throttle.cpu_shares(topo, range(3), "nccl") == {}
    assert throttle.cpu_shares(_topo(None, None), range(2), "gloo") == {}


V1_MOUNTS = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
OWN = "1:cpu:/\n0::/\n"


def test_v2_with_the_cpu_controller_comes_first(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    mounts = V1_MOUNTS + f"cgroup2 {tmp_path} cgroup2 rw 0 0\n"
    found = throttle.find(mounts, "1:cpu:/\n0::/job\n")
    assert found == throttle.Hierarchy(2, tmp_path / "job")


def test_v1_when_v2_has_no_cpu_controller(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    mounts = f"cgroup2 {tmp_path} cgroup2 rw 0 0\n" + V1_MOUNTS
    assert throttle.find(mounts, OWN) == throttle.Hierarchy(1, Path("/sys/fs/cgroup/cpu"))
    # A v1 path not visible under the mount (another cgroup namespace): the mount itself.
    assert throttle.find(V1_MOUNTS, "2:cpu,cpuacct:/not/here\n").parent == Path(
        "/sys/fs/cgroup/cpu"
    )


def test_no_cpu_hierarchy_is_a_reason():
    why = throttle.find("proc /proc proc rw 0 0\n", OWN)
    assert isinstance(why, str) and "cpu" in why


def test_admit_names_the_rank_when_there_are_no_cgroups(monkeypatch):
    monkeypatch.setattr(throttle, "find", lambda: "no cgroup here")
    with pytest.raises(throttle.ThrottleError, match=r"^rank 2: cannot limit it to 0.4 CPU"):
        throttle.NodeQuotas({2: 0.4}, "job").admit({2: 1})
    throttle.NodeQuotas({}, "job").admit({})  # nothing throttled: nothing looked up


def test_preflight_refuses_shares_without_cgroups(monkeypatch):
    monkeypatch.setattr(throttle, "available", lambda: "cgroup v1 at /x is read-only")
    cfg = make_config(parallel={"shape": (2,)}, launch={"backend": "gloo"})
    with pytest.raises(ConfigError, match=r"placement cpu.*0: 1, 1: 0.5.*read-only"):
        preflight.check_cpu_shares(cfg, _topo(1.0, 0.5))
    preflight.check_cpu_shares(cfg, _topo(None, None))  # no shares: nothing asked of cgroups


def test_a_throttled_process_keeps_one_thread_per_whole_cpu(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(devices, "pin_gloo_interface", lambda host, port: None)
    before = torch.get_num_threads()
    try:
        for share, want in ((None, 4), (0.4, 1), (1.0, 1), (2.5, 2), (9.0, 4)):
            devices.prepare_backend_env("gloo", "127.0.0.1", 1, 2, cpu_share=share)
            assert torch.get_num_threads() == want, share
    finally:
        torch.set_num_threads(before)


# -- real cgroups -----------------------------------------------------------------------------


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


@needs_cgroups
def test_admit_and_release_a_live_process():
    child = _child("import sys; sys.stdin.readline()")
    quotas = throttle.NodeQuotas({5: 0.5}, f"test.{os.getpid()}")
    try:
        quotas.admit({5: child.pid})
        quota = quotas.quotas[5]
        assert quota.path.name == f"bundle-test.{os.getpid()}-rank5"
        assert quota.pids() == [child.pid]
        limit = throttle.find().limit_files(0.5)  # type: ignore[union-attr]
        for name, text in limit.items():
            assert (quota.path / name).read_text().split() == text.split()
    finally:
        quotas.release()  # the child still runs: it goes back to the parent first
    assert not quota.path.exists()
    assert child.poll() is None
    child.communicate("\n", timeout=10)


@needs_cgroups
def test_release_after_the_process_exited():
    child = _child("import sys; sys.stdin.readline()")
    quotas = throttle.NodeQuotas({0: 1.0}, f"test-exited.{os.getpid()}")
    try:
        quotas.admit({0: child.pid})
        path = quotas.quotas[0].path
        child.communicate("\n", timeout=30)
    finally:
        quotas.release()
    assert child.returncode == 0
    assert not path.exists()


@needs_cgroups
def test_a_quarter_cpu_gets_about_a_quarter_of_a_cpu():
    """A busy loop under a 0.25 quota: CPU seconds per wall second well under one CPU."""
    busy = (
        "import sys, time\n"
        "sys.stdin.readline()\n"
        "t0, c0 = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - t0 < 1.5: pass\n"
        "print((time.process_time() - c0) / (time.monotonic() - t0))\n"
    )
    child = _child(busy)
    quotas = throttle.NodeQuotas({0: 0.25}, f"test-busy.{os.getpid()}")
    try:
        quotas.admit({0: child.pid})
        out, _ = child.communicate("\n", timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        quotas.release()
    used = float(out)
    assert 0.02 < used <= 0.35, used


@needs_cgroups
def test_available_leaves_nothing_behind():
    found = throttle.find()
    assert isinstance(found, throttle.Hierarchy)
    assert throttle.available() is None
    assert not (found.parent / f"bundle-probe-{os.getpid()}").exists()


@needs_cgroups
def test_a_process_of_its_own_throttles_itself_and_cleans_up():
    """The torchrun path: the process takes its quota, and on release leaves it and removes it."""
    code = (
        "from bundle.launch import throttle\n"
        "from bundle.topology import Place, Topology\n"
        "topo = Topology(shape=(2,), num_bundles=1, procs_per_node=2, global_batch=8,\n"
        "                micro_batches=1, placement=(Place(0, cpu=0.5), Place(0)))\n"
        "q = throttle.own_quota(topo, 0, 'gloo', 'own-test')\n"
        "path = q.quotas[0].path\n"
        "print(path, open('/proc/self/cgroup').read().count(path.name))\n"
        "q.release()\n"
        "print(path.exists(), open('/proc/self/cgroup').read().count(path.name))\n"
        "print(throttle.own_quota(topo, 1, 'gloo', 'own-test').quotas)\n"  # no share: nothing
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    inside, after, unthrottled = out.stdout.splitlines()
    assert inside.endswith("bundle-own-test-rank0 1")
    assert after == "False 0"
    assert unthrottled == "{}"
