"""The closed form that ranks a search's candidates before any is simulated: the bubble-bound
pipeline (``(M + S - 1)`` slowest stages), then the slowest stage's gradient sync (its whole
gradient as one bucket through the sync the plan runs) and optimizer step (``estimate``)."""

from __future__ import annotations

import functools
from typing import Any

from bundle.plan.dataparallel import HopCost
from bundle.plan.plans import Plan
from bundle.plan.zero import FULL, Collectives


def estimate(
    hop: HopCost,
    plan: Plan,
    batch: int,
    slowest: float,
    memo: dict[tuple[object, ...], Any] | None = None,
) -> float:
    """A closed-form step time: the bubble-bound pipeline, then the slowest sync and step.

    ``memo`` keeps each stage's sync and step across the candidates of one search: they depend
    on the layout of the ranks and the stage's blocks, not on the micro-batches or the rest of
    the split (the search asks for the same ones tens of thousands of times), as do ZeRO-3's
    collectives per micro-batch; and the nodes of each stage's groups, which depend on the
    layout alone."""
    cost = hop.cost
    memo = {} if memo is None else memo
    ends = [*plan.starts[1:], cost.n]
    layout: tuple[object, ...] = (plan.shape, plan.num_bundles, plan.procs_per_node)
    layout += (plan.grad_sync, plan.placement, plan.row_weights, plan.dp, plan.tp)
    tail = comm = 0.0
    full = plan.dp.zero == FULL
    for s, (a, b) in enumerate(zip(plan.starts, ends, strict=True)):
        key = (layout, s, a, b)
        if key not in memo:
            if layout not in memo:  # the layout checked once (a mixed plan's may be refused)
                topo = plan.layout(batch).topology()
                memo[layout] = Collectives(cost, topo, plan.grad_sync) if full else None
            if (layout, s) not in memo:
                memo[layout, s] = _group_nodes(plan, s)
            if full:  # no sync at the end; each micro-batch's collectives
                zero = memo[layout]
                memo[key] = cost.optimizer(a, b) / zero.over(s), zero.per_micro(s, a, b)
            else:
                groups = memo[layout, s]
                memo[key] = _sync_estimate(hop, plan, groups, a, b) + cost.optimizer(a, b), 0.0
        tail, comm = max(tail, memo[key][0]), max(comm, memo[key][1])
    stages = len(plan.shape)
    # ZeRO-3's collectives: hidden behind the slowest stage's compute where they overlap it.
    exposed = max(0.0, comm - slowest) if cost.overlap else comm
    return (plan.micro_batches + stages - 1) * slowest + tail + plan.micro_batches * exposed


def _group_nodes(plan: Plan, s: int) -> tuple[list[int], list[int], list[int]]:
    """The nodes of stage ``s``'s group, of its replicas in bundle 0 and of its masters: the
    topology's groups (``Topology.stage_group``, bundle-major, replica by replica), their ranks
    counted here from the layout alone (a search asks for tens of thousands of layouts)."""
    degrees, width = plan.degrees, plan.shape[s]
    bundle = sum(w * t for w, t in zip(plan.shape, degrees, strict=True))
    first = sum(w * t for w, t in zip(plan.shape[:s], degrees[:s], strict=True))
    if not plan.placement:
        return _filled(bundle, first, degrees[s], width, plan.num_bundles, plan.procs_per_node)
    ranks = _ranks(bundle, first, degrees[s], width, plan.num_bundles)
    flat = [plan.placement[r].node for r in ranks]
    return flat, flat[:width], flat[::width]


def _ranks(bundle: int, first: int, step: int, width: int, bundles: int) -> list[int]:
    return [b * bundle + first + i * step for b in range(bundles) for i in range(width)]


@functools.lru_cache(maxsize=1 << 16)
def _filled(
    bundle: int, first: int, step: int, width: int, bundles: int, ppn: int
) -> tuple[list[int], list[int], list[int]]:
    """``_group_nodes`` where ranks fill the nodes in order (kept: many layouts share a stage's
    place; the lists are read, never changed)."""
    flat = [r // ppn for r in _ranks(bundle, first, step, width, bundles)]
    return flat, flat[:width], flat[::width]


def _sync_estimate(
    hop: HopCost, plan: Plan, groups: tuple[list[int], list[int], list[int]], a: int, b: int
) -> float:
    """Stage ``s``'s whole gradient as one bucket through the sync the plan runs (``groups``:
    its groups' nodes, ``_group_nodes``)."""
    cost = hop.cost
    nbytes = cost.grad_bytes(a, b)
    flat, inner, masters = groups
    (wire,) = hop.wire_bytes([(a, nbytes)], b)
    if not plan.dp.two_hops(plan.grad_sync):
        return hop.between(nbytes, wire, flat)
    step = hop.between(nbytes, wire, masters) if plan.dp.per_step else 0.0
    return 2 * cost.reduce(nbytes, inner) + step + hop.meeting(a, b, masters, inner)
