"""A survivor hands its state to a new process of its own (``--fault-tolerance bundle`` on NCCL).

On NCCL a wait on a lost peer never ends, and aborting the communicators in place hung on a GPU
as soon as two of them had work in flight (docs/fault-tolerance.md). What was measured to work
there: copying a stage's state to the host on a fresh CUDA stream while the kernels still wait
(4-9 ms for 4 MiB) and leaving (``os._exit``: gone 0.2 s after the mark). So a survivor does
that: once a member bundle is marked dead, it takes the state of the steps it committed, writes
it to a file of its node's (``Handoff``) and exits ``EXIT_HANDOFF``; its supervisor starts the
rank again at once (same attempt, same incarnation), and the new process reads the file and goes
on where the old one would have in place: it agrees with the others which bundles train on,
forms the new world and trains the failed step again. No checkpoint is read and no step is lost;
the process and its CUDA context are new.

``Carried`` is a rank's training state (``bundle.checkpoint.state.RankState``, the one a
checkpoint saves) kept across a change of members: in memory where the
survivors train on in place (gloo), in the handoff file here, and sent to a healed bundle.

The state is never taken halfway through an update: the engine holds ``StepGuard`` from the moment
a step's commit vote passed until its update is enqueued, the state is taken under it, and on
CUDA the copy waits for the update's kernels (an event recorded after them), not for the stuck
ones behind them. A process stuck while holding it cannot hand off: it is left to the step
watchdog, which fails the job (then ``--max-restarts`` restarts it from its checkpoint, as under
``restart``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bundle.checkpoint.state import State, checked, on_cpu
from bundle.errors import ExitCode

if TYPE_CHECKING:
    from bundle.trainer import Trainer

EXIT_HANDOFF = ExitCode.HANDOFF  # a survivor that wrote its state for a new process of its rank
GUARD_WAIT_S = 5.0  # how long a survivor waits for its step's update to be enqueued


def handoff_directory(node: int) -> Path:
    """A new directory (under the system's temporary one) where this node's survivors leave
    their state; its supervisor removes it when the attempt ends."""
    return Path(tempfile.mkdtemp(prefix=f"bundle-handoff-{node}-"))


def file_of(handoffs: Path, rank: int) -> Path:
    """Where ``rank``'s survivor leaves its state in its node's handoff directory."""
    return handoffs / f"rank{rank}.pt"


def wanted(backend: str) -> bool:
    """Whether a survivor hands off rather than training on in the same process: on NCCL, and
    on its emulator (``nccl-emu``), which is how the path runs on CPUs."""
    return backend in ("nccl", "nccl-emu")


@dataclass
class Carried:
    """A rank's training state (``RankState``) after ``step`` committed steps, kept across a
    change of members."""

    step: int
    state: State

    @classmethod
    def of(cls, trainer: Trainer, step: int | None = None) -> Carried:
        """The trainer's state as it stands (its live tensors: the epoch's session is dropped
        once this is taken)."""
        return cls(
            step=trainer.committed if step is None else step,
            state=trainer.checkpointer.rank_state.state_dict(),
        )

    def on_cpu(self) -> Carried:
        """This state with its tensors on the CPU (``state.on_cpu``): what is sent or written."""
        return Carried(self.step, on_cpu(self.state))

    def load(self, trainer: Trainer) -> None:
        trainer.checkpointer.rank_state.load_state_dict(self.state)


@dataclass
class Handoff:
    """What a survivor leaves its new process: the stage's state and where membership stood."""

    carried: Carried  # on the CPU
    epoch: int
    members: tuple[int, ...]
    incs: dict[int, int]
    failures: int
    heals: int
    why: str  # the loss that ended the epoch

    def write(self, path: str) -> None:
        """Written whole or not at all (a new process never reads half a file), as plain
        containers of tensors and numbers, which ``read`` loads without running code."""
        tmp = f"{path}.tmp"
        plain = {**self.__dict__, "carried": self.carried.__dict__, "members": list(self.members)}
        torch.save(plain, tmp)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> Handoff:
        """The handoff at ``path`` (this node's own file, written by the process before this
        one), removed once read; it is data (``weights_only``), whoever wrote it."""
        try:
            got = torch.load(path, map_location="cpu", weights_only=True)
            Path(path).unlink()
            return Handoff(
                carried=Carried(int(got["carried"]["step"]), checked(got["carried"]["state"])),
                epoch=int(got["epoch"]),
                members=tuple(int(b) for b in got["members"]),
                incs={int(b): int(i) for b, i in got["incs"].items()},
                failures=int(got["failures"]),
                heals=int(got["heals"]),
                why=str(got["why"]),
            )
        except Exception as exc:  # noqa: BLE001 - whatever a damaged or foreign file raises
            raise RuntimeError(f"{path} holds no handoff ({type(exc).__name__}: {exc})") from exc


class StepGuard:
    """Held from a step's passed commit vote until its update is enqueued (``commit`` and
    ``updated`` are the engine's hooks); ``committed`` counts the steps whose update this process
    enqueued, and on CUDA ``event`` marks the end of the last one on the compute stream."""

    def __init__(self, committed: int, vote: Callable[[int], None], *, cuda: bool) -> None:
        self.committed, self.vote, self.cuda = committed, vote, cuda
        self.event: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def commit(self, step: int) -> None:
        self.vote(step)  # raises when a process is lost before it voted: nobody steps
        self._lock.acquire()

    def updated(self, step: int) -> None:
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.committed = step + 1
        self._lock.release()

    @contextmanager
    def held(self, timeout: float) -> Iterator[bool]:
        """Between steps (True), or not within ``timeout`` seconds (False)."""
        got = self._lock.acquire(timeout=timeout) if timeout > 0 else self._lock.acquire(False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Where the state is copied: on CUDA a fresh stream that waits for the last update
        only (the compute stream itself waits on the lost peer); elsewhere as is."""
        if not self.cuda:
            yield
            return
        side = torch.cuda.Stream()
        if self.event is not None:
            side.wait_event(self.event)
        with torch.cuda.stream(side):
            yield
        side.synchronize()


_HANDING = threading.Lock()  # one handoff per process: the loss watch's or the main thread's


def leave(path: str, handoff: Callable[[], Handoff | None], say: Callable[[str], None]) -> None:
    """Write what ``handoff()`` returns to ``path`` and end the process (``EXIT_HANDOFF``);
    returns only when there is nothing to hand (``handoff()`` returned None)."""
    with _HANDING:
        got = handoff()
        if got is None:
            return
        got.write(path)
        say(f"{got.why}: this process hands its state (step {got.carried.step}) to a new one")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HANDOFF)
