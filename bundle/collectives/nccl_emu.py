"""``--backend nccl-emu``: gloo on the CPU with NCCL's ordering, so "will this run on NCCL?" is
answered on a laptop.

gloo lets every send and receive progress on its own; NCCL does not, and a pattern that finishes
on gloo can hang on GPUs. Under this backend the engine's calls go through the model NCCL imposes:

- **One in-order stream per communicator per process.** A posted call starts only after the
  previous call on that communicator completed. The world communicator's stream holds the
  point-to-point calls (``batch_isend_irecv`` on the default group) and the world group's
  collectives (the fp16 scaler's vote, the final barrier); each other NCCL group (stage, bundle,
  masters) has its own. Every collective training runs on them goes through this stream model
  (bundle.collectives.comm), including those torch's own code starts (DDP, ZeRO-1, PowerSGD), which
  run as one call of their group's stream.
- **Communicators one at a time** (``--nccl-emu-strict``): NCCL does not promise that two
  communicators progress concurrently, so in this mode a rank's calls on all of them run one at
  a time, in the order they were posted. Without it streams progress independently.
- **A call's operations progress together:** each starts as soon as its peer is ready, and the
  call completes when all of them have.
- **Rendezvous:** a send completes only while the call holding its matching receive runs, as NCCL
  does for messages larger than its buffers; a receive completes once its send runs. The n-th
  send from a to b matches the n-th receive at b from a. ``--nccl-emu-eager-bytes N`` lets sends
  of 1 to N bytes complete without waiting for their receiver (NCCL's small messages); the
  default, 0, is the strict model; zero-byte messages always rendezvous.
- **Devices** (bundle.collectives.device_audit): tensors that would be on the GPU are told apart
  from host tensors; an operation CUDA would refuse for mixing them fails, naming it and its call
  site, and what a call moves must be on the device.
- **Waits keep their timeouts** (``--timeout``), and a stall names the stuck call, its operations
  and peers, and what the stream holds behind it.

Not modelled: kernels and their timing, NVLink/InfiniBand bandwidth, NCCL's own buffer sizes and
protocols (the eager limit is a single switch), the compute streams and events of CUDA beyond
"a wait orders what is posted after it". Collectives run as gloo's, one call each on their
group's stream, so their ordering and timeouts are NCCL's but a mismatch between ranks fails as
gloo reports it.

Rendezvous goes through the job's store: a call that starts running sets one key per operation,
and an operation is handed to gloo (with the message's number as its tag) once its partner's key
is there. That costs a few store round trips per message: this backend is for checking, not
speed.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bundle.collectives import device_audit
from bundle.collectives.device_audit import DeviceAudit
from bundle.collectives.emu_stream import Call, Message, Stream, Work, rank_name
from bundle.errors import PeerFailure
from bundle.runtime import keys

_POLL_FIRST_S, _POLL_MAX_S = 5e-5, 2e-3
_TAG_MOD = 2**31 - 1
_WAITING = "waiting for its peer"


class Emulator:
    """This process's side of the emulation: its point-to-point stream and its groups' streams.

    ``strict``: the rank's communicators run one call at a time, in the order they were posted
    (NCCL does not promise that two communicators progress concurrently), as if one stream held
    them all. ``audit`` (bundle.collectives.device_audit) checks that what NCCL would move is on the
    device.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        *,
        timeout: float,
        eager_bytes: int = 0,
        strict: bool = False,
        audit: DeviceAudit | None = None,
        name_rank: Callable[[int], str] = rank_name,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        self.store, self.rank, self.timeout, self.eager_bytes = store, rank, timeout, eager_bytes
        self.strict, self.audit, self.name_rank = strict, audit, name_rank
        # Asked while a call waits for its partners: a reason ends the wait at once, as NCCL's
        # communicator abort does (--fault-tolerance bundle: this process's bundle has left).
        self.abort = abort
        name = "one-at-a-time (every communicator)" if strict else "world (point-to-point)"
        self._p2p = Stream(name, rank, timeout, name_rank)
        self._groups: dict[object, Stream] = {}
        self._collectives: dict[str, int] = {}  # communicator -> collectives posted so far
        self._sent: dict[tuple[int, bool], int] = {}  # (peer, send?) -> messages so far
        self._eager: list = []  # eager sends gloo has not delivered yet
        # Stop the stream threads once the session that built this is gone, or at exit.
        self._finalizer = weakref.finalize(self, _stop, self._p2p, self._groups)

    # -- point-to-point ------------------------------------------------------------------------

    def batch_isend_irecv(
        self, ops: list[dist.P2POp], labels: Callable[[], list[str]]
    ) -> list[Work]:
        """Post one call; ``labels()`` names each operation (the engine's ``PostCall``)."""
        mine = []
        names = labels()
        for op, label in zip(ops, names, strict=True):
            send = op.op is dist.isend
            n = self._sent.get((op.peer, send), 0)
            self._sent[(op.peer, send)] = n + 1
            nbytes = op.tensor.numel() * op.tensor.element_size()
            self._check_device(op.tensor, label)
            # Zero-byte messages rendezvous like the rest.
            eager = 0 < nbytes <= self.eager_bytes
            mine.append(Message(send, op.tensor, op.peer, n, label, eager))
        return [self._p2p.post(", ".join(names), self._run_p2p, mine, absent=_partners_absent)]

    def _run_p2p(self, call: Call, deadline: float) -> None:
        store, rank = self.store, self.rank
        self._eager = [w for w in self._eager if not w.is_completed()]
        for op in call.ops:  # this call is running: tell each partner (eager messages need not)
            op.state = _WAITING
            if not op.eager:
                store.set(op.key(rank, partner=False), "1")
        waiting, works, pause = list(call.ops), [], _POLL_FIRST_S
        while waiting:
            still = []
            for op in waiting:
                if op.send and op.eager:
                    self._eager.append(dist.isend(op.tensor.clone(), op.peer, tag=op.n % _TAG_MOD))
                    op.state = "sent eagerly"
                    continue
                key = op.key(rank, partner=True)
                if op.eager or store.check([key]):  # an eager receive: its send ran already
                    if not op.eager:
                        store.delete_key(key)
                    start = dist.isend if op.send else dist.irecv
                    works.append((op, start(op.tensor, op.peer, tag=op.n % _TAG_MOD)))
                    op.state = "moving data" if not op.eager else "waiting for its eager send"
                else:
                    still.append(op)
            waiting = still
            if waiting:
                if self.abort is not None and (why := self.abort()):
                    raise PeerFailure(f"aborted at {call.describe()}: {why}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stuck {self.timeout:.0f}s at {call.describe()}")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        for op, w in works:
            assert w is not None  # a point-to-point operation to a peer always returns its work
            w.wait(timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
            op.state = "done"

    # -- collectives ---------------------------------------------------------------------------

    def _stream_of(self, group: dist.ProcessGroup | None) -> Stream:
        """The stream of ``group``'s communicator: the world group's is the point-to-point one."""
        if self.strict or group is None or group is dist.GroupMember.WORLD:
            return self._p2p
        if group not in self._groups:
            name = f"group {dist.get_process_group_ranks(group)}"
            self._groups[group] = Stream(name, self.rank, self.timeout, self.name_rank)
        return self._groups[group]

    def _check_device(self, tensors: Any, what: str) -> None:
        if self.audit is not None:
            self.audit.require_device(tensors, what)

    def _arrival(
        self, group: dist.ProcessGroup | None
    ) -> tuple[Callable[[], None], Callable[[Call], list[int]]]:
        """The n-th collective on ``group``'s communicator: ``arrive()`` records, when it starts
        running, that this rank reached it (one key per rank and communicator, so the store does
        not grow); ``absent(call)`` lists the group's ranks that have not, for a stall report."""
        ranks = None if group is None else dist.get_process_group_ranks(group)
        where = "world" if ranks is None else ",".join(map(str, ranks))
        n = self._collectives[where] = self._collectives.get(where, 0) + 1
        store, me = self.store, self.rank

        def arrive() -> None:
            store.set(keys.collective(where, me), str(n))

        def absent(call: Call) -> list[int]:
            members = ranks if ranks is not None else range(dist.get_world_size())
            return [
                r
                for r in members
                if not store.check([keys.collective(where, r)])
                or int(store.get(keys.collective(where, r))) < n
            ]

        return arrive, absent

    def collective(
        self, name: str, tensor: Any, group: dist.ProcessGroup | None, start: Callable
    ) -> Work:
        """Run ``start()`` (a blocking gloo collective on ``group``) as one call of its stream."""
        where = "world" if group is None else f"group {dist.get_process_group_ranks(group)}"
        self._check_device(tensor, f"{name} on the {where}")
        arrive, absent = self._arrival(group)

        def run(call: Call, deadline: float) -> None:
            arrive()
            start()
            call.result = [tensor]

        return self._stream_of(group).post(
            f"{name} on the {where}", run, future=True, absent=absent
        )

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM
    ) -> Work:
        return self.collective(
            "all_reduce", tensor, group, lambda: dist.all_reduce(tensor, op=op, group=group)
        )

    def reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> Work:
        return self.collective(
            f"reduce to rank {dst}", tensor, group, lambda: dist.reduce(tensor, dst, group=group)
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> Work:
        return self.collective(
            f"broadcast from rank {src}",
            tensor,
            group,
            lambda: dist.broadcast(tensor, src, group=group),
        )

    def all_gather(
        self, parts: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> Work:
        return self.collective(
            "all_gather", [tensor, *parts], group, lambda: dist.all_gather(parts, tensor, group)
        )

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        # NCCL's barrier is an all-reduce of one element on the device, in the stream's order.
        self.collective("barrier", [], group, lambda: dist.barrier(group=group)).wait()

    @contextlib.contextmanager
    def exclusive(self, group: dist.ProcessGroup | None, what: str) -> Iterator[None]:
        """Collectives that torch's own code starts on ``group`` (DDP, ZeRO-1, PowerSGD), run
        by the caller as one call of the group's stream: after what was posted before, before
        what is posted after."""
        running, done = threading.Event(), threading.Event()
        arrive, absent = self._arrival(group)

        def hold(call: Call, deadline: float) -> None:
            arrive()
            running.set()
            if not done.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"{what} did not end within {self.timeout:.0f}s")

        stream = self._stream_of(group)
        work = stream.post(what, hold, absent=absent)
        call, end = work._call, time.monotonic() + self.timeout
        while not running.wait(_POLL_MAX_S):
            if call.done.is_set():  # the stream broke on a call ahead of it
                raise RuntimeError(f"nccl-emu: {what} could not start: {call.error}")
            if time.monotonic() > end:
                raise RuntimeError(
                    f"nccl-emu: {what} could not start within {self.timeout:.0f}s; "
                    f"{stream.status(call)}"
                )
        try:
            yield
        finally:
            done.set()
            work.wait()

    def close(self) -> None:
        """Finish what gloo still holds of eager sends, then stop the streams."""
        for w in self._eager:
            w.wait(timedelta(seconds=self.timeout))
        self._finalizer()


def _partners_absent(call: Call) -> list[int]:
    """The peers of a point-to-point call whose matching call is not running."""
    return sorted({o.peer for o in call.ops if o.state == _WAITING})


def _stop(p2p: Stream, groups: dict) -> None:
    # Joined, not left to die with the interpreter: a stream thread that torch's teardown finds
    # alive after it ran gloo operations ends the process in std::terminate.
    for s in (p2p, *groups.values()):
        s.close()


_sessions = itertools.count()


def for_session(
    launch,
    rank: int,
    name_rank: Callable[[int], str] = rank_name,
    abort: Callable[[], str | None] | None = None,
) -> Emulator:
    """The emulation for one training session of this process, on the job's store.

    Every process builds its sessions in the same order, so the n-th session's keys are the same
    namespace everywhere and a later session (tests build several per process) starts afresh.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(keys.emulation(next(_sessions)), _get_default_store())
    return Emulator(
        store,
        rank,
        timeout=launch.timeout,
        eager_bytes=launch.emu_eager_bytes,
        strict=launch.emu_strict,
        audit=device_audit.install(),
        name_rank=name_rank,
        abort=abort,
    )
