"""Point-to-point activations forward and gradients backward between stages of any widths.

The engine posts the calls that bundle.ir.p2p derives from the schedule: each call is one
``batch_isend_irecv`` holding every operation of those actions with every peer, so both sides of a
boundary post the same calls in the same order (NCCL runs a communicator's calls in order).
Each replica sends exactly the rows its peer owns (the topology's row plan): no padding, no relay
through a master, no host copy on the GPU path. Several tensors may cross one boundary. Receives
land in slices of one buffer per tensor, so the stage sees a contiguous tensor without a
concatenation. Tensors travel in their wire form (``TensorMeta.to_wire``): the dtype and layout of
the run's precision policy, the same on both sides by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bundle.errors import PeerFailure
from bundle.ir.p2p import SIDE, boundary_peers
from bundle.ir.schedule import Op, Pipe
from bundle.topology import Coord, Topology, Transfer

# Posts one call (a list of point-to-point operations, and a function naming each of them for
# errors, called only by a poster that reports them) and returns its works:
# ``torch.distributed.batch_isend_irecv``, or the NCCL emulation's (bundle.collectives.nccl_emu).
PostCall = Callable[[list, Callable[[], list[str]]], list]


def post_with_torch(ops: list, labels: Callable[[], list[str]]) -> list:
    return dist.batch_isend_irecv(ops)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor crossing a stage boundary: shape without the batch dimension, dtype, layout.

    ``channels_last`` images travel as NHWC rows (the bytes of a channels-last tensor, which is
    not contiguous in torch's sense and which gloo refuses): the sender permutes to NHWC, which
    copies nothing when the tensor is already channels-last, and the receiver sees its NHWC
    buffer as an NCHW tensor in channels-last layout, again without a copy.
    """

    tail: tuple[int, ...]
    dtype: torch.dtype
    channels_last: bool = False

    @property
    def has_grad(self) -> bool:
        return self.dtype.is_floating_point

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape[1:]), t.dtype)

    def wire_shape(self, rows: int) -> tuple[int, ...]:
        if self.channels_last:
            c, h, w = self.tail
            return (rows, h, w, c)
        return (rows, *self.tail)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor as it is sent: this dtype, contiguous in this layout (differentiable)."""
        t = t.to(self.dtype)
        if self.channels_last:
            return t.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
        return t.contiguous()

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A received (or sent) wire tensor as the stage sees it."""
        return t.permute(0, 3, 1, 2) if self.channels_last else t


@dataclass(frozen=True)
class Boundaries:
    """What crosses the two boundaries of a piece of the model: the tensors it receives (none on
    the first piece) and the tensors it sends (none on the last)."""

    inputs: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()


@dataclass(frozen=True)
class _Plan:
    rows: tuple[int, int]  # this replica's rows of the micro-batch
    peers: tuple[tuple[Transfer, int], ...]  # (rows to move, peer rank)
    peer_text: str  # for errors


class Pending:
    """One posted call; ``wait`` returns the tensors of each of its receives, in the call's order.

    ``what()`` names the call's actions and peers; it runs only when an error is reported.
    """

    def __init__(
        self,
        works: list,
        received: list[tuple[torch.Tensor, ...]],
        timeout: timedelta,
        what: Callable[[], str],
    ) -> None:
        self.works, self.received, self.timeout, self.what = works, received, timeout, what

    def wait(self) -> list[tuple[torch.Tensor, ...]]:
        try:
            for w in self.works:
                w.wait(self.timeout)
        except RuntimeError as exc:
            # Name the peers: the error of the process that notices is rarely the root cause.
            raise PeerFailure(
                f"{self.what()} did not complete within {self.timeout.total_seconds():.0f}s: {exc}"
            ) from exc
        self.works = []
        return self.received


def _check_wire(
    tensors: tuple[torch.Tensor, ...], meta: tuple[TensorMeta, ...], rows: int, peers: str
) -> None:
    """A send must match the receiver's buffers exactly: the wire moves bytes, not values."""
    ok = len(tensors) == len(meta) and all(
        t.dtype == m.dtype and tuple(t.shape) == m.wire_shape(rows) and t.is_contiguous()
        for t, m in zip(tensors, meta, strict=False)
    )
    if not ok:
        got = [(tuple(t.shape), t.dtype, t.is_contiguous()) for t in tensors]
        want = [(m.wire_shape(rows), m.dtype, True) for m in meta]
        raise TypeError(f"send to {peers}: tensors {got} do not match the boundary {want}")


_TO = {Op.SEND_ACT: "to", Op.SEND_GRAD: "to", Op.RECV_ACT: "from", Op.RECV_GRAD: "from"}

# One action of a call: what, the micro-batch's rows, and the tensors to send (a send) or the
# buffer slot to receive into (a receive), and the micro-batch index (for errors).
Part = tuple[Op, int, "tuple[torch.Tensor, ...] | int", int]


class Transport:
    """The sends and receives of one replica of one stage, for one bundle."""

    def __init__(
        self,
        *,
        topo: Topology,
        coord: Coord,
        boundaries: Boundaries,
        device: torch.device,
        timeout: float,
        post: PostCall = post_with_torch,
        chunk: int = 0,
        pipe: Pipe | None = None,
    ) -> None:
        """The transport of ``coord``'s replica, for the piece whose ``boundaries`` it carries:
        model chunk ``chunk`` where the model's pieces run as ``pipe`` (one chunk per stage by
        default)."""
        self.topo, self.coord = topo, coord
        self.bundle, self.stage, self.replica = coord.bundle, coord.stage, coord.replica
        self.chunk, self.pipe = chunk, pipe
        in_meta, out_meta = boundaries.inputs, boundaries.outputs
        self.in_meta, self.out_meta = in_meta, out_meta
        in_grad = tuple(m for m in in_meta if m.has_grad)
        out_grad = tuple(m for m in out_meta if m.has_grad)
        self._meta = {
            Op.RECV_ACT: in_meta,
            Op.SEND_ACT: out_meta,
            Op.RECV_GRAD: out_grad,
            Op.SEND_GRAD: in_grad,
        }
        self.device = device
        self.timeout = timedelta(seconds=timeout)
        self._post_call = post
        self._plans: dict[tuple[int, int], _Plan] = {}
        self._buffers: dict[tuple[Op, int, int], tuple[torch.Tensor, ...]] = {}

    # Plans depend only on the micro-batch size; at most two sizes occur, so they are computed once.
    def _plan(self, side: int, rows: int) -> _Plan:
        key = (side, rows)
        if key not in self._plans:
            topo, s = self.topo, self.stage
            peers = boundary_peers(
                topo, self.bundle, s, self.replica, side, rows, chunk=self.chunk, pipe=self.pipe
            )
            text = ", ".join(topo.describe(rank) for _, rank in peers)
            self._plans[key] = _Plan(topo.stage_ranges(s, rows)[self.replica], peers, text)
        return self._plans[key]

    def _recv_buffers(self, op: Op, rows: int, slot: int) -> tuple[torch.Tensor, ...]:
        """Receive buffers are allocated once per (size, slot) and reused every step.

        The caller picks ``slot`` so that a buffer is not received into again while the
        micro-batch that used it is still alive (see StageEngine).
        """
        key = (op, rows, slot)
        if key not in self._buffers:
            lo, hi = self._plan(SIDE[op], rows).rows
            self._buffers[key] = tuple(
                torch.empty(m.wire_shape(hi - lo), dtype=m.dtype, device=self.device)
                for m in self._meta[op]
            )
        return self._buffers[key]

    def call(self, parts: Sequence[Part]) -> Pending:
        """Post the actions of one call as one ``batch_isend_irecv``: every peer, both directions."""
        return post_call([(self, p) for p in parts])

    def _ops(self, part: Part, ops: list, received: list) -> _Plan:
        """Add one action's point-to-point operations (every peer, every tensor) to ``ops``."""
        op, rows, payload, _ = part
        plan = self._plan(SIDE[op], rows)
        lo, hi = plan.rows
        if isinstance(payload, int):
            bufs = self._recv_buffers(op, rows, payload)
            received.append(bufs)
            for t, peer in plan.peers:
                ops += [dist.P2POp(dist.irecv, b[t.start - lo : t.stop - lo], peer) for b in bufs]
        else:
            _check_wire(payload, self._meta[op], hi - lo, plan.peer_text)
            for t, peer in plan.peers:
                ops += [
                    dist.P2POp(dist.isend, x[t.start - lo : t.stop - lo], peer) for x in payload
                ]
        return plan

    # -- single actions (evaluation, calibration) --------------------------------------------------

    def recv_act(self, rows: int, slot: int = 0) -> Pending:
        return self.call([(Op.RECV_ACT, rows, slot, 0)])

    def send_act(self, rows: int, tensors: tuple[torch.Tensor, ...]) -> Pending:
        return self.call([(Op.SEND_ACT, rows, tensors, 0)])

    def recv_grad(self, rows: int, slot: int = 0) -> Pending:
        return self.call([(Op.RECV_GRAD, rows, slot, 0)])

    def send_grad(self, rows: int, grads: tuple[torch.Tensor, ...]) -> Pending:
        return self.call([(Op.SEND_GRAD, rows, grads, 0)])


def post_call(items: Sequence[tuple[Transport, Part]]) -> Pending:
    """Post one call whose actions may belong to several model chunks of one replica (each with
    its own transport), in the order given: both sides of a call list its messages alike."""
    ops: list = []
    received: list[tuple[torch.Tensor, ...]] = []
    named: list[tuple[Transport, Op, int, _Plan]] = []  # for the names, built only if asked for
    for tr, part in items:
        named.append((tr, part[0], part[3], tr._ops(part, ops, received)))

    def labels() -> list[str]:  # one per operation, in the order of ``ops``
        return [
            f"{op.value}{micro} {_TO[op]} rank {peer}"
            for tr, op, micro, plan in named
            for _, peer in plan.peers
            for _ in tr._meta[op]
        ]

    def what() -> str:
        return " + ".join(f"{op.value}{k} {_TO[op]} {plan.peer_text}" for _, op, k, plan in named)

    first = items[0][0]
    works = first._post_call(ops, labels) if ops else []
    return Pending(works, received, first.timeout, what)
