"""A node's workers' signs of life, as the node supervisor reads them: a worker that gives none
for a while (stopped: SIGSTOP, Ctrl-Z, a debugger; or frozen) is named before its peers' timeouts
blame whoever waited first. The beats are written by ``process.beat``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from bundle.runtime.store import post_abort

if TYPE_CHECKING:
    import torch.distributed as dist

    from bundle.launch.context import SharedFloat
    from bundle.topology import Topology

_FROZEN_MIN_S = 3.0


class Worker(Protocol):
    """What the node supervisor reads of a worker (a process, or a test's stand-in)."""

    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def pid(self) -> int | None: ...


def frozen_limit(timeout: float) -> float:
    """Seconds without a sign of life after which a worker is reported stopped responding: well
    before its peers' ``--timeout`` fires (their report would blame whoever waited first), and
    never under a few seconds (a busy machine delays a thread, briefly)."""
    return max(_FROZEN_MIN_S, timeout / 2)


def frozen(
    procs: Mapping[int, Worker],
    last_beat: Callable[[int], float],
    describe: Callable[[int], str],
    limit: float,
    post: Callable[[int, str], str | None],
    clock: Callable[[], float] = time.monotonic,
) -> str | None:
    """The job's failure once a running worker has given no sign of life (``process.beat``) for
    ``limit`` seconds: stopped (SIGSTOP, Ctrl-Z, a debugger) or frozen. Its peers, waiting on it,
    would each time out naming themselves; this names it. Not before its first beat (start-up)."""
    now = clock()
    for rank, p in procs.items():
        last = last_beat(rank)
        if last > 0 and p.exitcode is None and now - last > limit:
            failure = post(
                rank,
                f"{describe(rank)} stopped responding: no sign of life for {now - last:.0f}s"
                + _state(p.pid),
            )
            if failure is not None:
                return failure
    return None


def liveness_check(
    procs: Mapping[int, Worker],
    alive: Mapping[int, SharedFloat],
    topo: Topology,
    timeout: float,
    store: dist.Store,
    report: Callable[[int, str], str | None] | None = None,
) -> Callable[[], str | None]:
    """The look at this node's workers' beats that the supervisor takes every poll (``frozen``).
    ``report`` (--fault-tolerance bundle) takes a frozen worker out; else its failure is posted."""
    report = report or (lambda rank, message: post_abort(store, message))
    return unless_paused(
        lambda: frozen(
            procs,
            lambda rank: float(alive[rank].value),
            topo.describe,
            frozen_limit(timeout),
            report,
        ),
        _FROZEN_MIN_S / 2,
    )


def unless_paused(
    check: Callable[[], str | None], gap: float, clock: Callable[[], float] = time.monotonic
) -> Callable[[], str | None]:
    """``check``, skipped on a look that comes more than ``gap`` seconds after the previous one:
    this supervisor did not run either (the whole job was stopped, Ctrl-Z, and continued), so its
    workers' beats are stale for the same reason; they are read again on the next look."""
    last = [clock()]

    def look() -> str | None:
        now = clock()
        paused, last[0] = now - last[0] > gap, now
        return None if paused else check()

    return look


_STATES = {
    "T": "its process is stopped (SIGSTOP or Ctrl-Z)",
    "t": "its process is stopped by a debugger",
    "D": "its process is in uninterruptible sleep (I/O, or a frozen cgroup)",
}


def _state(pid: int | None) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f" ({_STATES.get(state, 'its threads do not run: the interpreter is blocked')})"
