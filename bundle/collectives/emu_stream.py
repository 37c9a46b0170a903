"""The NCCL emulation's streams (bundle.collectives.nccl_emu): one communicator's calls in one
process, run in order by a thread of their own, each call's messages, and what a wait on it reports
when it stalls."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from bundle.runtime import keys


def rank_name(rank: int) -> str:
    """How a report names a rank, unless the session names it by its place."""
    return f"rank {rank}"


@dataclass
class Message:
    """One send or receive of a point-to-point call, and where it stands (for a stall report)."""

    send: bool
    tensor: torch.Tensor
    peer: int
    n: int  # this message's number between the pair, in its direction
    label: str
    eager: bool
    state: str = "queued"

    def key(self, rank: int, *, partner: bool) -> str:
        src, dst = (rank, self.peer) if self.send else (self.peer, rank)
        return keys.p2p(src, dst, self.n, send=self.send != partner)


@dataclass
class Call:
    """One call posted on a stream: what it runs, its messages, and how it ended."""

    number: int
    what: str
    run: Callable[[Call, float], None]
    ops: list[Message] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    future: torch.futures.Future | None = None
    result: object = None
    # For a report: the ranks whose matching call is not running (it is stuck on them).
    absent: Callable[[Call], list[int]] | None = None
    name_rank: Callable[[int], str] = rank_name

    def describe(self) -> str:
        if not self.ops:
            text = f"call {self.number} ({self.what})"
        else:
            text = f"call {self.number} [{', '.join(f'{o.label}: {o.state}' for o in self.ops)}]"
        try:
            ranks = self.absent(self) if self.absent is not None else []
        except RuntimeError:  # the job's store is gone: the report goes without them
            ranks = []
        if ranks:
            text += f"; no matching call running on {', '.join(map(self.name_rank, ranks))}"
        return text


class Work:
    """What a posted call returns: ``wait`` blocks (with a timeout) until the call completed."""

    def __init__(self, call: Call, stream: Stream) -> None:
        self._call, self._stream = call, stream

    def is_completed(self) -> bool:
        return self._call.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = self._stream.timeout if timeout is None else timeout.total_seconds()
        if not self._call.done.wait(seconds):
            raise RuntimeError(
                f"nccl-emu: no completion within {seconds:.0f}s; {self._stream.status(self._call)}"
            )
        if self._call.error is not None:
            raise RuntimeError(self._call.error)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        assert self._call.future is not None, "only collectives carry a future"
        return self._call.future


class Stream:
    """One communicator's in-order stream in this process: a thread that runs its calls in turn."""

    def __init__(
        self, name: str, rank: int, timeout: float, name_rank: Callable[[int], str] = rank_name
    ) -> None:
        self.name, self.rank, self.timeout, self.name_rank = name, rank, timeout, name_rank
        self._queue: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._pending: list[Call] = []  # posted and not completed, in order
        self._broken: str | None = None
        self._broken_at: str | None = None  # the call that broke it, as it stood
        self._thread = threading.Thread(target=self._loop, name=f"nccl-emu {name}", daemon=True)
        self._thread.start()

    def post(
        self,
        what: str,
        run: Callable[[Call, float], None],
        ops=(),
        future=False,
        absent: Callable[[Call], list[int]] | None = None,
    ) -> Work:
        call = Call(
            next(self._numbers), what, run, list(ops), absent=absent, name_rank=self.name_rank
        )
        if future:
            call.future = torch.futures.Future()
        with self._lock:
            self._pending.append(call)
        self._queue.put(call)
        return Work(call, self)

    def status(self, call: Call) -> str:
        """Where this stream stands, for a stall report."""
        with self._lock:
            pending = list(self._pending)
        head = pending[0] if pending else None
        where = f"rank {self.rank}'s {self.name} stream"
        if self._broken_at is not None:
            # The call that broke the stream is the stall, though it has left the queue: what
            # waits behind it is ended with its error next (a timeout may see it first).
            return f"{where} is stuck at {self._broken_at}"
        if head is None or head is call or call not in pending:
            return f"{where} is stuck at {call.describe()}"
        ahead = pending.index(call)
        return (
            f"{where} has not started {call.describe()}: {ahead} call(s) ahead of it, "
            f"the first stuck at {head.describe()}"
        )

    def _finish(self, call: Call, error: str | None) -> None:
        call.error = error
        with self._lock:
            self._pending.remove(call)
        if call.future is not None:
            if error is None:
                call.future.set_result(call.result)
            else:
                call.future.set_exception(RuntimeError(error))
        call.done.set()

    def _loop(self) -> None:
        while (call := self._queue.get()) is not None:
            if self._broken is not None:  # a stream that failed runs nothing more
                self._finish(call, self._broken)
                continue
            try:
                call.run(call, time.monotonic() + self.timeout)
                self._finish(call, None)
            except Exception as exc:  # noqa: BLE001 - reported to whoever waits on the call
                self._broken_at = call.describe()
                self._broken = f"nccl-emu: rank {self.rank}'s {self.name} stream: {exc}"
                self._finish(call, self._broken)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=1.0)
