"""The step watchdog: a training process that makes no progress for ``--timeout`` seconds ends,
saying where it stalled, so that the job ends on NCCL as it does on gloo.

On gloo a stalled peer makes the waiting operation raise after ``--timeout`` (the process group's
timeout, and the transport's timed waits); the error reaches the store and every process stops.
On NCCL nothing raises: ``work.wait()`` only orders the CUDA stream, the CPU runs ahead into the
next wait, and NCCL's own watchdog thread aborts the process (SIGABRT, no message) once a
collective outlives the group's timeout. So each worker runs this watchdog: a daemon thread that
reads the process's position (its ``Phase``: the engine's "step 3 recv_act1", which the engine
keeps up to date anyway, or the loop's named phase) every half second and, when it has not
changed for the limit, posts
``<rank> stalled at <position>: no progress in <limit>s`` to the store and exits with code 1; the
other processes' abort watches then stop them. It costs nothing per micro-batch.

What is watched: training steps, evaluation (each batch moves the position) and the end of the
job. Not watched: start-up (``--init-timeout`` bounds it), restoring a checkpoint
(``resume``) and checkpoint saves (``checkpoint``...): a large model's write to a slow disk may
legitimately outlast ``--timeout`` and has no peer to wait on; the saves' coordination runs on the
gloo control group, whose operations raise after ``--timeout`` themselves.

Limits: on NCCL the watchdog fires after ``--timeout`` and NCCL's groups get ``--timeout`` +
``NCCL_GRACE_S``, so ours reports first and NCCL's abort stays the backstop. On gloo the
transport's timed waits report first after ``--timeout`` (they name the operation and the peer),
the groups' own timeouts ``GLOO_GROUP_GRACE_S`` later (a stalled peer seen only in a collective,
DDP's all-reduce), and the watchdog is the last backstop, ``GLOO_WATCH_GRACE_S`` after
``--timeout``, for a stall that no operation bounds (a hang in compute or in data loading).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from bundle.errors import ExitCode

NCCL_GRACE_S = 30.0
# Longer than the 2 s a failing worker waits for an earlier report before it posts its own.
GLOO_GROUP_GRACE_S = 3.0
GLOO_WATCH_GRACE_S = 10.0
POLL_S = 0.5
# Positions (a process's Phase) that are not watched: see the module docstring.
UNWATCHED = ("start-up", "set-up", "resume", "checkpoint")


def group_timeout(backend: str, timeout: float) -> timedelta:
    """A process group's timeout for a job with ``--timeout`` ``timeout``.

    NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, by default tearing the process down on a
    timeout) is left on, as the backstop, but later than ours so that ours reports first. Not
    TORCH_NCCL_BLOCKING_WAIT: it makes every ``wait()`` block the CPU on the GPU (no more queuing
    ahead of the stream) and still misses a stall in a collective nobody waits on (DDP's).
    On gloo, a group's timeout comes just after the transport's, whose report names the peer.
    """
    return timedelta(seconds=timeout + (NCCL_GRACE_S if backend == "nccl" else GLOO_GROUP_GRACE_S))


def watch_limit(backend: str, timeout: float) -> float:
    """Seconds without progress after which the watchdog ends the process."""
    return timeout if backend == "nccl" else timeout + GLOO_WATCH_GRACE_S


class StepWatchdog:
    """Ends the process when ``position()`` stays the same for ``limit`` seconds.

    ``position()`` returns the process's position (None: not watched). ``report``
    (given the message) posts it to the job; ``exit`` ends the process (``os._exit``; tests give
    their own). ``stop()`` disarms it (the process is already leaving with an error of its own).
    """

    def __init__(
        self,
        *,
        me: str,
        position: Callable[[], str | None],
        limit: float,
        report: Callable[[str], None],
        exit: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me, self.position, self.limit = me, position, limit
        self.report, self.exit, self.clock = report, exit, clock
        self._seen: str | None = None
        self._since = clock()
        self._stopped = threading.Event()

    def check(self) -> bool:
        """One look at the position; True when it fired."""
        if self._stopped.is_set():
            return False
        now, at = self.clock(), self.position()
        if at != self._seen:
            self._seen, self._since = at, now
            return False
        if at is None or at.startswith(UNWATCHED) or now - self._since < self.limit:
            return False
        self._stopped.set()
        # The store may be gone: the process ends all the same.
        with contextlib.suppress(Exception):
            self.report(f"{self.me} stalled at {at}: no progress in {self.limit:g}s")
        self.exit(ExitCode.FAILED)
        return True

    def stop(self) -> None:
        self._stopped.set()

    def start(self, poll_s: float = POLL_S) -> StepWatchdog:
        def watch() -> None:
            while not self._stopped.wait(poll_s):
                self.check()

        threading.Thread(target=watch, name="bundle-step-watchdog", daemon=True).start()
        return self
