"""A micro-batch's rows cut among a stage's replicas, and the rows each replica sends the next
stage's: pure arithmetic on row counts, apart from the job's layout (``bundle.topology``), which
asks it per stage, and the planner's simulator, which asks it tens of thousands of times.

A micro-batch of ``m`` rows is cut into contiguous row ranges, one per replica of a stage: sizes
that differ by at most one, or, with row weights (``--row-weights 2:1,1``: a replica on a device
twice as fast takes twice the rows), sizes in proportion to the weights by largest remainder
(:func:`weighted_sizes`). Between stage ``s`` and ``s + 1`` replica ``i`` sends replica ``j`` exactly
the rows both own::

    m = 5, widths 2 -> 3
    stage s:   [0 1 2][3 4]          i=0: rows 0-2, i=1: rows 3-4
    stage s+1: [0 1][2 3][4]         j=0: rows 0-1, j=1: rows 2-3, j=2: row 4
    plan:      0->0 rows 0:2, 0->1 rows 2:3, 1->1 rows 3:4, 1->2 rows 4:5
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` contiguous pieces of ``total`` that differ by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


@lru_cache(maxsize=1 << 14)  # the planner asks for the same splits tens of thousands of times
def weighted_sizes(total: int, weights: tuple[Fraction, ...]) -> tuple[int, ...]:
    """Sizes of contiguous pieces of ``total`` in proportion to ``weights`` (largest remainder:
    each piece gets the floor of its exact share, then the rows left go one each to the largest
    remainders, earlier pieces first on ties). Equal weights give :func:`split_sizes`."""
    whole = sum(weights)
    shares = [total * w / whole for w in weights]
    sizes = [int(s) for s in shares]  # floor: shares are non-negative
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def _ranges(sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


def split_ranges(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Half-open ``[start, stop)`` ranges of :func:`split_sizes`."""
    return _ranges(split_sizes(total, parts))


def weighted_ranges(total: int, weights: tuple[Fraction, ...]) -> tuple[tuple[int, int], ...]:
    """Half-open ``[start, stop)`` ranges of :func:`weighted_sizes`."""
    return _ranges(weighted_sizes(total, weights))


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` of a micro-batch that replica ``src`` sends to replica ``dst``."""

    src: int
    dst: int
    start: int
    stop: int


def replica_rows(
    batch: int,
    num_bundles: int,
    micro_batches: int,
    width: int | tuple[Fraction, ...],
    bundle: int,
    micro: int,
    replica: int,
) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch of ``batch`` rows held by one replica of a stage of
    ``width`` replicas (or replicas of these row weights), for micro-batch ``micro`` of
    ``bundle``."""
    bundle_ranges = split_ranges(batch, num_bundles)
    b0, b1 = bundle_ranges[bundle]
    m0, m1 = split_ranges(b1 - b0, micro_batches)[micro]
    r0, r1 = width_ranges(m1 - m0, width)[replica]
    return b0 + m0 + r0, b0 + m0 + r1


@lru_cache(maxsize=4096)  # pure; asked for per replica, its cost grows with the stage's width
def width_ranges(rows: int, width: int | tuple[Fraction, ...]) -> tuple[tuple[int, int], ...]:
    """Each replica's ``[start, stop)`` of ``rows`` rows, by a stage's width (even rows) or its
    replicas' row weights."""
    if isinstance(width, int):
        return split_ranges(rows, width)
    return weighted_ranges(rows, width)


@lru_cache(maxsize=4096)  # pure; the planner's simulator asks for the same plans many times
def row_plan(
    rows: int, src_width: int | tuple[Fraction, ...], dst_width: int | tuple[Fraction, ...]
) -> tuple[Transfer, ...]:
    """Every non-empty intersection of the two stages' row ranges, in (src, dst) order (a width
    or the stage's row weights)."""
    plan = []
    dst_ranges = width_ranges(rows, dst_width)
    for i, (a, b) in enumerate(width_ranges(rows, src_width)):
        for j, (c, d) in enumerate(dst_ranges):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                plan.append(Transfer(i, j, lo, hi))
    return tuple(plan)


@lru_cache(maxsize=4096)
def row_plan_by(
    rows: int,
    src_width: int | tuple[Fraction, ...],
    dst_width: int | tuple[Fraction, ...],
    by_src: bool,
) -> tuple[tuple[Transfer, ...], ...]:
    """``row_plan``'s transfers per sending (``by_src``) or receiving replica: each replica's own
    without scanning the whole plan (a stage may have a thousand replicas)."""
    width = src_width if by_src else dst_width
    out: list[list[Transfer]] = [[] for _ in width_ranges(rows, width)]
    for t in row_plan(rows, src_width, dst_width):
        out[t.src if by_src else t.dst].append(t)
    return tuple(tuple(ts) for ts in out)
