"""Stopping a job cleanly on SIGTERM/SIGINT, and the ``BUNDLE_FAULT`` hook that kills a rank.

Every process of the job must stop after the *same* step, or the ones that go on wait forever on
the ones that left. A signal reaches some processes and not others (one node's supervisor, the
whole foreground process group, torchrun's forwarding), so each process only notes it, and the
job decides together::

    supervisor's first signal ──▶ shared value ─┐
    this process's first signal ──▶ local flag ─┴─ max ─▶ all-reduce(MAX) over every rank,
                                                           started as a step begins and read
                                                           when it ends: stop after that step?

All stop after the same step, save, and exit 128 + the signal (143 SIGTERM, 130 SIGINT). A second
signal, more than ``DEBOUNCE_S`` after the first (one Ctrl-C reaches a process both from the
terminal and from its launcher), stops at once.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from bundle.errors import ConfigError, signalled

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEBOUNCE_S = 2.0
FAULT_ENV = "BUNDLE_FAULT"
HEAL_FAULT_ENV = "BUNDLE_HEAL_FAULT"


def exit_code(signum: int) -> int:
    """What a process stopped by ``signum`` exits with (``errors.signalled``)."""
    return signalled(signum)


class StopRequest:
    """The first stop signal this process has seen (0: none), set from signal handlers."""

    def __init__(self, shared=None, *, announce: bool = True) -> None:
        self.signum, self.first_at, self.shared = 0, 0.0, shared
        self.announce = announce

    def install(self, on_second) -> None:
        """Handle SIGTERM and SIGINT: note the first, call ``on_second(signum)`` on a later one."""

        def handle(signum, _frame) -> None:
            now = time.monotonic()
            if not self.signum:
                self.signum, self.first_at = signum, now
                if self.shared is not None:  # the supervisor's request reaches its workers
                    self.shared.value = signum
                if self.announce:
                    # os.write, not logging: a handler may interrupt the logger holding its lock.
                    name = signal.Signals(signum).name
                    os.write(2, f"{name} received: finishing the step in progress\n".encode())
            elif now - self.first_at > DEBOUNCE_S:
                on_second(signum)

        for sig in SIGNALS:
            signal.signal(sig, handle)

    @property
    def value(self) -> int:
        return max(self.signum, self.shared.value if self.shared is not None else 0)


class StopVote:
    """The job-wide decision to stop: one small all-reduce per step, overlapped with the step.

    ``at_commit`` (--fault-tolerance bundle): cast instead between the gradient sync and the
    optimizer step, and waited for there (``commit``, the engine's commit hook): the same
    all-reduce is then the vote that lets every process take the step, or none.
    """

    def __init__(
        self,
        request: StopRequest,
        group: dist.ProcessGroup,
        timeout: float,
        asks: Callable[[], list[int]] | None = None,
        *,
        at_commit: bool = False,
    ) -> None:
        """``asks``, when given, returns this process's flags (0/1) to agree on in the same
        all-reduce (bundles ready to join, --fault-tolerance bundle): ``agreed`` says which
        flags every process raised."""
        self.request, self.group, self.asks, self.at_commit = request, group, asks, at_commit
        self.timeout = timedelta(seconds=timeout)
        self.flag = torch.zeros(1 + len(asks()) if asks else 1, dtype=torch.int32)
        self.work: dist.Work | None = None

    def begin(self) -> None:
        """A step begins: cast the vote (unless it is cast at the commit)."""
        self.work = None
        if not self.at_commit:
            self._cast()

    def commit(self, step: int) -> None:
        """``at_commit``: cast the vote and wait for every process's (raises when one is lost)."""
        self._cast()
        self.decided()

    def _cast(self) -> None:
        self.flag[0] = self.request.value
        if self.asks is not None:
            # All-reduced with MAX, as the signal is: negated, each flag's minimum over the job.
            self.flag[1:] = -torch.tensor(self.asks(), dtype=torch.int32)
        self.work = dist.all_reduce(
            self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )

    def decided(self) -> int:
        """The signal the job stops for after this step (0: go on)."""
        if self.work is None:
            raise RuntimeError("StopVote.decided() before the vote was cast")
        self.work.wait(self.timeout)
        return int(self.flag[0].item())

    def agreed(self) -> list[int]:
        """After ``decided``: the indices of the flags every process raised this step."""
        return [i for i, v in enumerate(self.flag[1:].tolist()) if v == -1]


class Regroup(Exception):  # noqa: N818 - a change of course, not an error
    """Raised on every rank after a step when the bundles that train change (bundles taken back
    in under --fault-tolerance bundle): ``bundles`` join after step ``step``."""

    def __init__(self, bundles: list[int], step: int) -> None:
        super().__init__(f"bundles {bundles} join after step {step}")
        self.bundles, self.step = bundles, step


class Stopped(Exception):
    """Raised on every rank once the job has stopped for a signal (after saving, if it could)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def code(self) -> int:
        return exit_code(self.signum)


def stop_line(
    signum: int, step: int | None, checkpoint: str | None, argv: list[str], launcher: str
) -> str:
    """The one line a stopped job prints: where its checkpoint is and how to resume it."""
    head = f"stopped by {signal.Signals(signum).name} after step {'?' if step is None else step}"
    if not checkpoint:
        return f"{head}; no checkpoint written (set --save-dir to make runs resumable)"
    return f"{head}; checkpoint {checkpoint}; resume with: {resume_command(argv, launcher)}"


def resume_command(argv: list[str], launcher: str) -> str:
    """``launcher main.py ARGS --resume auto`` with any earlier --resume dropped."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            args.append(a)
    return " ".join([launcher, "main.py", *map(shlex.quote, args), "--resume", "auto"])


FAULT_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def parse_fault(env: Mapping[str, str]) -> tuple[int, int, signal.Signals] | None:
    """``BUNDLE_FAULT=RANK:STEP[:kill|stop]`` -> (rank, step, signal), checked before anything
    starts. ``stop`` freezes the rank (SIGSTOP) instead of killing it: a slow, not dead, peer."""
    text = env.get(FAULT_ENV)
    if not text:
        return None
    head, _, how = text.rpartition(":")
    if how not in FAULT_SIGNALS:
        head, how = text, "kill"
    usage = "must be RANK:STEP[:kill|stop], e.g. 1:7 (global rank, step >= 1)"
    rank, step = _two_counts(FAULT_ENV, text, head, usage)
    return rank, step, FAULT_SIGNALS[how]


def parse_heal_fault(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``BUNDLE_HEAL_FAULT=RANK:INCARNATION`` -> (rank, incarnation): under --fault-tolerance
    bundle, global rank RANK of its bundle's INCARNATION-th heal kills itself as it starts."""
    text = env.get(HEAL_FAULT_ENV)
    if not text:
        return None
    usage = "must be RANK:INCARNATION, e.g. 3:1 (global rank, heal >= 1)"
    return _two_counts(HEAL_FAULT_ENV, text, text, usage)


def _two_counts(name: str, text: str, pair: str, usage: str) -> tuple[int, int]:
    """``pair`` = "A:B" with B >= 1, else a ConfigError on ``name`` = ``text``."""
    parts = pair.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
        raise ConfigError(name, text, usage)
    return int(parts[0]), int(parts[1])


def maybe_fail(rank: int, step: int, attempt: int) -> None:
    """The fault hook: global rank RANK SIGKILLs (or SIGSTOPs) itself as step STEP (1-based)
    begins, first attempt only."""
    fault = parse_fault(os.environ)
    if fault is not None and fault[:2] == (rank, step + 1) and attempt == 0:
        sys.stderr.flush()
        os.kill(os.getpid(), fault[2])


def maybe_fail_heal(rank: int, incarnation: int) -> None:
    """The heal's fault hook (``BUNDLE_HEAL_FAULT``): SIGKILL as the new process starts."""
    if incarnation and parse_heal_fault(os.environ) == (rank, incarnation):
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
