"""CPU quotas that emulate slower devices: a process in a cgroup of its own, limited to a fraction
of one CPU (a plan's ``placement`` ``cpu`` share, on a run that computes on the CPU).

    share 0.4, period 2.5 ms  ->  cgroup v2 cpu.max "1000 2500", cpu.weight 400
                                  cgroup v1 cpu.cfs_quota_us 1000, cpu.cfs_period_us 2500,
                                            cpu.shares 4096 (weights: see WEIGHT_PER_CPU)

The period is as short as the kernel's smallest quota (1 ms) allows, and at least 2 ms
(``period_us``), so that a quota slows a process about evenly, as a slower device would. A quota
is spent in bursts: within a period a process runs at full speed until its quota is used, then
stands still until the next one. A process that has waited on a peer starts its next work with
the period's quota unspent, and work shorter than a period's wait finishes before the stand-still
it would pay when computing without pause; so a stage that waits once per micro-batch computes
faster than one kept busy, by up to a period's stand-still per wait (measured on 0.2 of a CPU at
a 10 ms period: work of 6.5 ms took 0.54 to 0.75 of its time without pause when 2 to 40 ms of
waiting came between, and a zero-bubble plan, which keeps its slow stage busy, ran 13 % slower
than predicted while 1F1B on the same split ran as predicted). The kernel's usual 100 ms period
made the same plan 13 % faster than predicted under one schedule and 17 % slower under another.
At 2 to 5 ms both schedules ran within 3 % of each other against their predictions.

Who owns the cgroups: a self-spawned job's node supervisor creates one per throttled worker,
moves the worker in by pid right after starting it, and removes it once it has joined the worker
(``NodeQuotas``); under torchrun each process throttles itself and removes its cgroup on its way
out (``own_quota``). A cgroup is named after the job and the rank (``cgroup_name``) and created
under the cgroup this process is in, on the cgroup v2 hierarchy when it has the cpu controller,
else on cgroup v1's cpu hierarchy. ``available()`` says why neither can be used, for preflight.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bundle import log
from bundle.errors import LaunchError

if TYPE_CHECKING:
    from bundle.topology import Topology

PERIOD_US = 2_000  # the shortest period used (see the module's docstring)
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota
MAX_PERIOD_US = 1_000_000  # and a longer period
# A quota caps a process; on a machine busy with other work it would still get only a fair share
# of what is left, and the neighbours, not the plan, would set its speed. A weight well above the
# default (in proportion to the share) lets it reach its quota first, and processes whose quotas
# add up to more CPUs than there are share them in proportion to their shares.
WEIGHT_PER_CPU = 10
CPU_BACKENDS = ("gloo", "nccl-emu")  # the backends whose processes compute on the CPU
_RELEASE_S = 5.0  # how long a cgroup may stay busy (a worker still exiting) before we give up


class ThrottleError(LaunchError):
    """A CPU quota could not be set up or removed; the message names the rank."""


def period_us(share: float) -> int:
    """The period of ``share``'s quota: the shortest whose quota is at least the kernel's minimum
    (MIN_QUOTA_US over the share), and at least PERIOD_US."""
    if not share > 0:
        raise ValueError(f"a CPU share must be > 0, not {share!r}")
    return min(MAX_PERIOD_US, max(PERIOD_US, math.ceil(MIN_QUOTA_US / share)))


def quota_us(share: float, period: int | None = None) -> int:
    """Microseconds of CPU per ``period`` (by default ``period_us(share)``) for ``share`` of one
    CPU (at least the kernel's minimum)."""
    if not share > 0:
        raise ValueError(f"a CPU share must be > 0, not {share!r}")
    return max(MIN_QUOTA_US, round(share * (period_us(share) if period is None else period)))


def cgroup_name(job: str, rank: int) -> str:
    """``bundle-JOB-rankR``, the job's characters outside ``[A-Za-z0-9_.-]`` as ``_``."""
    return f"bundle-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-rank{rank}"


@dataclass(frozen=True)
class Hierarchy:
    """Where quota cgroups go: ``parent`` (a directory of the mounted hierarchy) and its version."""

    version: int  # 1 or 2
    parent: Path

    def limit_files(self, share: float, period: int | None = None) -> dict[str, str]:
        """The files of a quota cgroup, written in this order, and their contents: the quota (over
        ``period`` microseconds, by default ``period_us(share)``), and a scheduling weight of
        WEIGHT_PER_CPU times the default per CPU of the share."""
        period = period_us(share) if period is None else period
        quota = quota_us(share, period)
        if self.version == 2:
            weight = min(10_000, max(1, round(100 * WEIGHT_PER_CPU * share)))
            return {"cpu.max": f"{quota} {period}", "cpu.weight": str(weight)}
        # v1 refuses a period under the current quota: the period first, then the quota.
        shares = min(262_144, max(2, round(1024 * WEIGHT_PER_CPU * share)))
        return {
            "cpu.cfs_period_us": str(period),
            "cpu.cfs_quota_us": str(quota),
            "cpu.shares": str(shares),
        }


def _mounts(text: str) -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, options) of every cgroup mount in /proc/self/mounts' ``text``."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            out.append((fields[1].replace("\\040", " "), fields[2], fields[3].split(",")))
    return out


def _own_paths(text: str) -> dict[str, str]:
    """This process's cgroup per hierarchy from /proc/self/cgroup: ``""`` for v2, else each
    v1 controller's name."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out[""] = parts[2]
        for controller in parts[1].split(","):
            if controller:
                out[controller] = parts[2]
    return out


def _under(mount: str, own: str | None) -> Path:
    """The directory of this process's cgroup under ``mount``, or the mount itself when that path
    is not visible there (a container whose cgroup namespace shows a parent's paths)."""
    path = Path(mount) / (own or "/").lstrip("/")
    return path if path.is_dir() else Path(mount)


def find(mounts: str | None = None, own: str | None = None) -> Hierarchy | str:
    """The hierarchy to put quota cgroups in, or why there is none (``mounts`` and ``own``: the
    text of /proc/self/mounts and /proc/self/cgroup, read when not given)."""
    mounts = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    own = Path("/proc/self/cgroup").read_text() if own is None else own
    table, paths = _mounts(mounts), _own_paths(own)
    for mount, kind, _ in table:
        if kind != "cgroup2":
            continue
        parent = _under(mount, paths.get(""))
        try:
            controllers = (parent / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in controllers:
            return Hierarchy(2, parent)
    for mount, kind, options in table:
        if kind == "cgroup" and "cpu" in options:
            return Hierarchy(1, _under(mount, paths.get("cpu")))
    return (
        "no cgroup v2 hierarchy with the cpu controller and no cgroup v1 cpu hierarchy is mounted"
    )


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enable_cpu(parent: Path) -> None:
    """Cgroup v2 gives a child the cpu controller only when its parent delegates it."""
    control = parent / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        _write(control, "+cpu")


def available() -> str | None:
    """None when quota cgroups can be created here, else the reason (one line)."""
    found = find()
    if isinstance(found, str):
        return found
    probe = Quota(found, f"bundle-probe-{os.getpid()}", 1.0)
    try:
        probe.create()
    except OSError as exc:
        where = f"cgroup v{found.version} at {found.parent}"
        return f"cannot create a CPU-limited cgroup in {where} ({exc.strerror or exc})"
    finally:
        with contextlib.suppress(OSError):
            probe.remove(wait_s=0.0)
    return None


class Quota:
    """One cgroup limited to ``share`` of one CPU: created, given processes, removed."""

    def __init__(
        self, hierarchy: Hierarchy, name: str, share: float, *, period: int | None = None
    ) -> None:
        self.hierarchy, self.share, self.period = hierarchy, share, period
        self.path = hierarchy.parent / name

    def create(self) -> Quota:
        """Make the cgroup (an empty one of the same name is reused) and set its limit."""
        if self.hierarchy.version == 2:
            _enable_cpu(self.hierarchy.parent)
        self.path.mkdir(exist_ok=True)
        for name, text in self.hierarchy.limit_files(self.share, self.period).items():
            _write(self.path / name, text)
        return self

    def add(self, pid: int) -> None:
        """Move process ``pid`` (every thread of it) into the cgroup."""
        _write(self.path / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def remove(self, *, wait_s: float = _RELEASE_S) -> None:
        """Move what still runs in the cgroup back to its parent, then delete the cgroup.

        A cgroup can be removed only once empty; a process that has just exited may hold it for
        a moment, so a busy cgroup is retried for up to ``wait_s`` seconds.
        """
        deadline = time.monotonic() + wait_s
        while self.path.exists():
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    _write(self.hierarchy.parent / "cgroup.procs", str(pid))
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def cpu_shares(topo: Topology, ranks: Iterable[int], backend: str) -> dict[int, float]:
    """The ranks of ``ranks`` that run under a quota and their shares: those the placement gives a
    ``cpu`` share, on a backend that computes on the CPU (a GPU's speed is not the CPU's)."""
    if backend not in CPU_BACKENDS:
        return {}
    return {r: s for r in ranks if (s := topo.cpu_share(r)) is not None}


class NodeQuotas:
    """The quotas of one node's throttled workers (rank -> CPU share), owned by its supervisor."""

    def __init__(self, shares: Mapping[int, float], job: str) -> None:
        self.shares, self.job = dict(shares), job
        self.quotas: dict[int, Quota] = {}

    def admit(self, pids: Mapping[int, int | None]) -> None:
        """Put each throttled rank's process (rank -> pid) under its quota (a rank's process
        started again joins the quota its first one had)."""
        if not self.shares:
            return
        found = find()
        for rank, pid in pids.items():
            share = self.shares.get(rank)
            if share is None:
                continue
            if isinstance(found, str) or pid is None:
                why = found if isinstance(found, str) else "it has no process"
                raise ThrottleError(f"rank {rank}: cannot limit it to {share:g} CPU: {why}")
            quota = self.quotas.get(rank)
            fresh = quota is None
            if quota is None:
                quota = self.quotas[rank] = Quota(found, cgroup_name(self.job, rank), share)
            try:
                (quota.create() if fresh else quota).add(pid)
            except OSError as exc:
                raise ThrottleError(
                    f"rank {rank}: cannot limit it to {share:g} CPU in {quota.path}: "
                    f"{exc.strerror or exc}"
                ) from exc

    def release(self) -> None:
        """Remove every quota cgroup (their workers have exited, or go back to the parent); one
        that cannot be removed is reported as a warning: the run itself is over."""
        for rank, quota in self.quotas.items():
            try:
                quota.remove()
            except OSError as exc:
                log.get().warning(
                    f"rank {rank}: cannot remove its CPU quota cgroup {quota.path}: "
                    f"{exc.strerror or exc}"
                )
        self.quotas.clear()


def own_quota(topo: Topology, rank: int, backend: str, job: str) -> NodeQuotas:
    """This process under its own quota (torchrun: no supervisor owns it); ``release()`` it at exit."""
    quotas = NodeQuotas(cpu_shares(topo, [rank], backend), job)
    try:
        quotas.admit({rank: os.getpid()})
    except ThrottleError:
        quotas.release()  # a cgroup made before the failure
        raise
    return quotas
