"""Stage widths and split points: compositions of a bundle's devices into stages, the dynamic
program that splits the blocks for given widths (``Splitter``), and the coarse-to-fine search of
widths where the compositions are too many to score one by one (``search_widths``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np

from bundle.plan.cost import CostModel

# Compositions of one bundle's devices scored one by one up to this many; beyond, coarse to fine.
EXHAUSTIVE = 512
_KEEP_COARSE = 6  # compositions refined from each level to the next


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` positive integers summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def micro_counts(bundle_rows: int, widest: int, limit: int) -> list[int]:
    """Micro-batch counts that divide a bundle's rows and leave every replica a row."""
    return [m for m in range(1, limit + 1) if bundle_rows % m == 0 and bundle_rows // m >= widest]


class Splitter:
    """The split points minimising the slowest stage, for given widths and micro-batch rows."""

    def __init__(self, cost: CostModel, link_bandwidth: float, link_latency: float) -> None:
        self.cost, self.n = cost, cost.n
        self.bw, self.lat = link_bandwidth, link_latency
        self._matrix: dict[int, np.ndarray] = {}

    def matrix(self, rows: int) -> np.ndarray:
        """``C[j, i]``: one micro-batch's cycle of a stage of blocks ``j..i-1`` at ``rows`` rows."""
        if rows not in self._matrix:
            cost, n = self.cost, self.n
            p = cost.prefix(rows)
            c = p[None, :] - p[:, None] + 2 * cost.overheads.compute_action
            c[:, n] += cost.block_times(rows)[2]
            xfer = np.array(
                [0.0]
                + [cost.boundary_bytes(i, rows) / self.bw + self.lat for i in range(1, n)]
                + [0.0]
            )
            c = np.maximum(c, np.maximum(xfer[None, :], xfer[:, None]))
            c[np.tril_indices(n + 1)] = np.inf
            self._matrix[rows] = c
        return self._matrix[rows]

    def split(self, widths: tuple[int, ...], micro_rows: int) -> tuple[tuple[int, ...], float]:
        """(start block of each stage, the slowest stage's cycle)."""
        return slowest_first([self.matrix(math.ceil(micro_rows / w)) for w in widths], self.n)


def slowest_first(cycles: list[np.ndarray], n: int) -> tuple[tuple[int, ...], float]:
    """The split of ``n`` blocks into ``len(cycles)`` stages whose slowest stage is fastest:
    ``cycles[k][j, i]`` is stage k's cycle over blocks ``j..i-1``; (each stage's first block,
    that slowest cycle). A dynamic program over the stages, one min-max step each."""
    f = cycles[0][0].copy()
    back = []
    for c in cycles[1:]:
        m = np.maximum(f[:, None], c)
        back.append(m.argmin(axis=0))
        f = m.min(axis=0)
    starts, i = [], n
    for arg in reversed(back):
        i = int(arg[i])
        starts.append(i)
    return (0, *reversed(starts)), float(f[n])


def search_widths(
    width: int,
    stages: int,
    scored: Callable[[tuple[int, ...]], float],
    *,
    exhaustive: int = EXHAUSTIVE,
) -> None:
    """Score stage widths summing to ``width``: every composition where there are at most
    ``exhaustive`` of them, else coarse to fine. Widths in steps of ``g`` (the smallest power of
    two leaving at most ``exhaustive`` compositions, the remainder on the widest stage) are all
    scored; then, halving ``g`` down to 1, the best few are refined by moving ``g`` devices from
    one stage to another until none of those moves improves them. The pipeline's time falls
    smoothly with a stage's width (its rows per replica), which is what makes this find what the
    exhaustive search finds (tests/unit/test_plan_search.py compares them)."""
    if math.comb(width - 1, stages - 1) <= exhaustive:
        for widths in compositions(width, stages):
            scored(widths)
        return
    g = 1
    while math.comb(width // g - 1, stages - 1) > exhaustive:
        g *= 2
    score: dict[tuple[int, ...], float] = {}

    def rate(widths: tuple[int, ...]) -> None:
        if widths not in score:
            score[widths] = scored(widths)

    for coarse in compositions(width // g, stages):
        stepped = [w * g for w in coarse]
        stepped[stepped.index(max(stepped))] += width - g * (width // g)
        rate(tuple(stepped))
    frontier = sorted(score, key=score.__getitem__)[:_KEEP_COARSE]
    while g > 1:
        g //= 2
        while True:
            for widths in frontier:
                for moved in _moves(widths, g):
                    rate(moved)
            better = sorted(score, key=score.__getitem__)[:_KEEP_COARSE]
            if better == frontier:
                break
            frontier = better


def _moves(widths: tuple[int, ...], g: int) -> Iterator[tuple[int, ...]]:
    """``widths`` with ``g`` devices moved from one stage to another (each keeping one)."""
    for i, j in itertools.permutations(range(len(widths)), 2):
        if widths[j] > g:
            moved = list(widths)
            moved[i], moved[j] = moved[i] + g, moved[j] - g
            yield tuple(moved)
