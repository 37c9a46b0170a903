"""What one point-to-point message costs on this machine: a ping-pong over the boundary's sizes.

Two gloo processes send each other a message of each size of ``GRID`` (4 B to 16 MiB, x4) as the
engine sends its activations and gradients: the receive posted before the peer sends (on gloo the
engine posts receives ahead: ``bundle.ir.p2p``), each message one ``batch_isend_irecv`` call
(``bundle.engine.transport``). Per size, rank 0 times the round trip and, on its own clock, the
call that posts its send and the one that posts its receive; the medians over the repetitions are
the size's ``Point``, kept with the repetitions' spread.

A plan fits the points that span its boundary's sizes (``boundary_range``, ``fit``):

- a message's one-way time (half the round trip, from the start of the send's call to the peer
  holding the data: the call, the wire, the peer's gloo thread reading it, the waiting process
  woken) as ``latency + bytes / bandwidth``;
- the send's call as ``send_call + bytes * send_call_per_byte``: the sender's own time lost to it
  (gloo writes what the socket takes at once, on the sender's thread; on a machine with a core
  for each process or fewer, the write that wakes the peer may also hand it the sender's core);
- the receive's call, ``recv_call``: the median over every size (it does not grow with the bytes;
  one size's median alone was seen at 3 ms where its neighbours read 0.1 ms).

The simulator (``bundle.plan.simulate``) starts each message's link time as its send's call
starts and charges the call to the sender's clock, and each receive its call on the receiver's. The points are measured with the
calibration's loopback links (``bundle.plan.calibrate``) and cached with them, with the
conditions they were measured under (``bundle.plan.conditions``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from bundle.plan.anatomy import Anatomy
from bundle.plan.cluster import Link
from bundle.plan.conditions import spread
from bundle.plan.cost import Overheads

GRID = tuple(4 * 4**i for i in range(12))  # 4 B .. 16 MiB

# One size's medians: {"bytes", "one_way", "send_call", "recv_call", "spread"} (seconds; the
# spread of the round trips, ``conditions.spread``).
Point = dict


@dataclass(frozen=True)
class MessageCost:
    """One message at the sizes fitted: the link it crosses and the calls on its two sides."""

    link: Link
    send_call: float
    send_call_per_byte: float
    recv_call: float

    def overheads(self, base: Overheads) -> Overheads:
        """``base`` with these calls."""
        return replace(
            base,
            send_call=self.send_call,
            send_call_per_byte=self.send_call_per_byte,
            recv_call=self.recv_call,
        )


# -- measuring (two gloo processes) -----------------------------------------------------------


def _post(op: Callable, tensor: torch.Tensor, peer: int) -> list:
    """One message posted as the engine posts a call."""
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _one_size(rank: int, nbytes: int, reps: int, warmup: int) -> Point:
    """Rank 0 pings rank 1, which pongs it back, ``warmup + reps`` times; rank 0's medians."""
    ping = torch.zeros(max(1, nbytes // 4))
    pong = torch.zeros_like(ping)
    other, clock = 1 - rank, time.perf_counter
    trips, sends, recvs = [], [], []
    for _ in range(warmup + reps):
        t0 = clock()
        inbound = _post(dist.irecv, pong if rank == 0 else ping, other)
        recvs.append(clock() - t0)
        dist.barrier()  # the peer's receive is posted before anything is sent
        if rank == 1:
            _wait(inbound)
        t0 = clock()
        outbound = _post(dist.isend, ping if rank == 0 else pong, other)
        sends.append(clock() - t0)
        if rank == 0:
            _wait(inbound)
            trips.append(clock() - t0)
        _wait(outbound)
    med = statistics.median
    return {
        "bytes": nbytes,
        "one_way": med(trips[warmup:]) / 2 if trips else 0.0,
        "send_call": med(sends[warmup:]),
        "recv_call": med(recvs[warmup:]),
        "spread": spread(trips[warmup:]),
    }


def ping_pong(rank: int, sizes: Sequence[int] = GRID, reps: int = 10, warmup: int = 2) -> list:
    """Each size's ``Point`` between ranks 0 and 1 of the default group; call on both (rank 0's
    points are the measurement)."""
    return [_one_size(rank, n, reps, warmup) for n in sizes]


# -- fitting (pure) -----------------------------------------------------------------------------


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x`` fitted with each point's error relative to its ``y`` (sizes
    span orders of magnitude: a small message counts as much as a large one); neither below 0."""
    pts = [(x, y, 1.0 / max(y, 1e-12) ** 2) for x, y in zip(xs, ys, strict=True)]
    s = sum(w for _, _, w in pts)
    sx = sum(w * x for x, _, w in pts)
    sy = sum(w * y for _, y, w in pts)
    sxx = sum(w * x * x for x, _, w in pts)
    sxy = sum(w * x * y for x, y, w in pts)
    det = s * sxx - sx * sx
    b = (s * sxy - sx * sy) / det if det > 0 else 0.0
    if b <= 0:
        return max(sy / s, 0.0), 0.0
    a = (sy - b * sx) / s
    if a < 0:
        return 0.0, sxy / sxx
    return a, b


def spanning(points: Sequence[Point], lo: float, hi: float) -> list[Point]:
    """The points from the largest size at or below ``lo`` to the smallest at or above ``hi``
    (the grid's ends where the range passes them), at least two."""
    pts = sorted(points, key=lambda p: p["bytes"])
    first = max([i for i, p in enumerate(pts) if p["bytes"] <= lo], default=0)
    last = min([i for i, p in enumerate(pts) if p["bytes"] >= hi], default=len(pts) - 1)
    if last - first < 1:
        first, last = max(0, min(first, len(pts) - 2)), min(len(pts) - 1, max(last, first + 1))
    return pts[first : last + 1]


def fit(points: Sequence[Point], lo: float, hi: float) -> MessageCost:
    """The cost of a message of ``lo`` to ``hi`` bytes, from the points spanning them."""
    pts = spanning(points, lo, hi)
    sizes = [float(p["bytes"]) for p in pts]
    send_a, send_b = line(sizes, [p["send_call"] for p in pts])
    latency, per_byte = line(sizes, [p["one_way"] for p in pts])
    return MessageCost(
        link=Link(1.0 / per_byte if per_byte > 0 else float("inf"), latency),
        send_call=send_a,
        send_call_per_byte=send_b,
        # Not a function of the bytes: every size's, so one size's outlier does not set it.
        recv_call=statistics.median(p["recv_call"] for p in points),
    )


def boundary_range(
    anatomy: Anatomy,
    rows: tuple[float, float],
    *,
    precision: str = "fp32",
    cuts: Sequence[int] | None = None,
) -> tuple[float, float] | None:
    """(fewest, most) bytes of one message across the boundaries ``cuts`` (every boundary between
    two blocks by default) at ``rows[0]`` to ``rows[1]`` rows: a gradient carries the floats of a
    boundary, an activation those and its other tensors too. None where nothing crosses."""
    wire = 2 if precision != "fp32" else 4
    blocks = anatomy.blocks
    cuts = range(1, len(blocks)) if cuts is None else cuts
    per_row = [(sum(blocks[c - 1].out_elems) * wire, blocks[c - 1].out_other_bytes) for c in cuts]
    if not per_row:
        return None
    lo = min(f if f else other for f, other in per_row) * rows[0]
    return lo, max(f + other for f, other in per_row) * rows[1]
