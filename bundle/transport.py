"""Point-to-point activations forward and gradients backward between stages of any widths.

Each replica sends exactly the rows its peer owns (the topology's row plan): no padding, no relay
through a master, no host copy on the GPU path. Several tensors may cross one boundary. Receives
land in slices of one buffer per tensor, so the stage sees a contiguous tensor without a
concatenation. Tensors travel in their wire form (``TensorMeta.to_wire``): the dtype and layout of
the run's precision policy, the same on both sides by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bundle.errors import PeerFailure
from bundle.topology import Topology, Transfer, split_ranges


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
class _Plan:
    rows: tuple[int, int]  # this replica's rows of the micro-batch
    peers: tuple[tuple[Transfer, int], ...]  # (rows to move, peer rank)
    peer_text: str  # for errors


class Pending:
    """In-flight point-to-point work; ``wait`` returns the received tensors (if any)."""

    def __init__(
        self, works: list, tensors: tuple[torch.Tensor, ...], timeout: timedelta, what: str
    ) -> None:
        self.works, self.tensors, self.timeout, self.what = works, tensors, timeout, what

    def wait(self) -> tuple[torch.Tensor, ...]:
        try:
            for w in self.works:
                w.wait(self.timeout)
        except RuntimeError as exc:
            # Name the peers: the error of the process that notices is rarely the root cause.
            raise PeerFailure(
                f"{self.what} did not complete within {self.timeout.total_seconds():.0f}s: {exc}"
            ) from exc
        self.works = []
        return self.tensors


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


class Transport:
    """The sends and receives of one replica of one stage, for one bundle."""

    def __init__(
        self,
        *,
        topo: Topology,
        bundle: int,
        stage: int,
        replica: int,
        in_meta: tuple[TensorMeta, ...],
        out_meta: tuple[TensorMeta, ...],
        device: torch.device,
        timeout: float,
    ) -> None:
        self.topo, self.bundle, self.stage, self.replica = topo, bundle, stage, replica
        self.in_meta, self.out_meta = in_meta, out_meta
        self._in_grad_meta = tuple(m for m in in_meta if m.has_grad)
        self._out_grad_meta = tuple(m for m in out_meta if m.has_grad)
        self.device = device
        self.timeout = timedelta(seconds=timeout)
        self._plans: dict[tuple[str, int], _Plan] = {}
        self._buffers: dict[tuple[str, int, int], tuple[torch.Tensor, ...]] = {}

    # Plans depend only on the micro-batch size; at most two sizes occur, so they are computed once.
    def _plan(self, direction: str, rows: int) -> _Plan:
        key = (direction, rows)
        if key not in self._plans:
            topo, s, r = self.topo, self.stage, self.replica
            if direction == "prev":  # peers in stage s-1
                transfers = topo.recvs(s, r, rows)
                peers = tuple((t, topo.rank(self.bundle, s - 1, t.src)) for t in transfers)
            else:  # peers in stage s+1
                transfers = topo.sends(s, r, rows)
                peers = tuple((t, topo.rank(self.bundle, s + 1, t.dst)) for t in transfers)
            text = ", ".join(topo.describe(rank) for _, rank in peers)
            self._plans[key] = _Plan(split_ranges(rows, topo.shape[s])[r], peers, text)
        return self._plans[key]

    def _recv_buffers(self, direction: str, rows: int, slot: int, meta: tuple[TensorMeta, ...]):
        """Receive buffers are allocated once per (size, slot) and reused every step.

        The caller picks ``slot`` so that a buffer is not received into again while the
        micro-batch that used it is still alive (see StageRunner).
        """
        key = (direction, rows, slot)
        if key not in self._buffers:
            lo, hi = self._plan(direction, rows).rows
            self._buffers[key] = tuple(
                torch.empty(m.wire_shape(hi - lo), dtype=m.dtype, device=self.device) for m in meta
            )
        return self._buffers[key]

    def _exchange(
        self,
        direction: str,
        rows: int,
        send: tuple[torch.Tensor, ...] | None,
        meta: tuple[TensorMeta, ...],
        slot: int = 0,
    ) -> Pending:
        plan = self._plan(direction, rows)
        lo, hi = plan.rows
        ops = []
        if send is None:
            bufs = self._recv_buffers(direction, rows, slot, meta)
            for t, peer in plan.peers:
                ops += [dist.P2POp(dist.irecv, b[t.start - lo : t.stop - lo], peer) for b in bufs]
        else:
            bufs = ()
            _check_wire(send, meta, hi - lo, plan.peer_text)
            for t, peer in plan.peers:
                ops += [dist.P2POp(dist.isend, x[t.start - lo : t.stop - lo], peer) for x in send]
        works = dist.batch_isend_irecv(ops) if ops else []
        what = f"{'receive from' if send is None else 'send to'} {plan.peer_text}"
        return Pending(works, bufs, self.timeout, what)

    # -- forward: activations -----------------------------------------------------------------

    def recv_act(self, rows: int, slot: int = 0) -> Pending:
        return self._exchange("prev", rows, None, self.in_meta, slot)

    def send_act(self, rows: int, tensors: tuple[torch.Tensor, ...]) -> Pending:
        return self._exchange("next", rows, tensors, self.out_meta)

    # -- backward: gradients of the floating-point boundary tensors ----------------------------

    def recv_grad(self, rows: int, slot: int = 0) -> Pending:
        return self._exchange("next", rows, None, self._out_grad_meta, slot)

    def send_grad(self, rows: int, grads: tuple[torch.Tensor, ...]) -> Pending:
        return self._exchange("prev", rows, grads, self._in_grad_meta)
