"""Search plans: shapes, bundles, split points, micro-batches, schedules and sync strategies.

For every bundle count ``b`` (all of them up to 64 devices; beyond, those dividing the devices
or the batch: ``bundle_counts``) and stage count ``S`` (up to ``max_stages``), the compositions of
the ``devices // b`` devices of a bundle into ``S`` stage widths (every one where there are at
most ``EXHAUSTIVE``, else searched coarse to fine: ``search_widths``), and every micro-batch count
that divides a bundle's batch and gives every replica a row, a dynamic program picks the split
points that minimise the slowest stage (its forward + backward at the rows one replica holds, or
its boundary transfer where that is slower). A closed form ranks those candidates (``(M + S - 1)``
slowest stages, plus the largest gradient sync and optimizer step); the best ones are then
simulated under 1F1B and each sync strategy, the ``SCHEDULE_LEADERS`` best of those under every
other schedule too, and ranked by simulated throughput, plans that do not fit in device memory
last. The data-parallel options (``DataParallel``:
compression, bundle sync, aggregation) are the user's: every plan is costed under them, never
under others, and only bundle counts they accept are planned.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any

import numpy as np

from bundle.engine.precision import Policy
from bundle.engine.schedule import REGISTRY, SCHEDULES, Action, actions
from bundle.errors import ConfigError, ScheduleError
from bundle.plan.cost import CostModel, Memory
from bundle.plan.dataparallel import EXACT, DataParallel, HopCost
from bundle.plan.simulate import Layout, SimResult, simulate
from bundle.topology import Place, Topology

SYNCS = ("flat", "hierarchical")
# Compositions of one bundle's devices scored one by one up to this many; beyond, coarse to fine.
EXHAUSTIVE = 512
_KEEP_COARSE = 6  # compositions refined from each level to the next
SCHEDULE_LEADERS = 8  # plans simulated under every schedule, after all under 1F1B


@dataclass(frozen=True)
class Plan:
    shape: tuple[int, ...]
    num_bundles: int
    starts: tuple[int, ...]
    micro_batches: int
    procs_per_node: int
    schedule: str = "1f1b"
    grad_sync: str = "flat"
    dp: DataParallel = DataParallel()
    row_weights: tuple[tuple[Fraction, ...], ...] = ()  # () : even rows (bundle.plan.mixed)
    placement: tuple[Place, ...] = ()  # () : ranks fill the nodes in order
    chunks: int = 1  # model chunks per stage; ``starts`` then holds stages x chunks pieces

    @property
    def processes(self) -> int:
        return sum(self.shape) * self.num_bundles

    def layout(self, batch: int) -> Layout:
        return Layout(
            shape=self.shape,
            num_bundles=self.num_bundles,
            starts=self.starts,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
            grad_sync=self.grad_sync,
            batch=batch,
            procs_per_node=self.procs_per_node,
            dp=self.dp,
            row_weights=self.row_weights,
            placement=self.placement,
            chunks=self.chunks,
        )


@dataclass
class Evaluated:
    plan: Plan
    sim: SimResult
    samples_per_s: float
    memory: list[Memory]  # per stage, of its replica with the most rows
    fits: bool
    stage_compute: list[float]  # per stage: compute seconds per step of its busiest replica


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
        rows = [math.ceil(micro_rows / w) for w in widths]
        f = self.matrix(rows[0])[0].copy()
        back = []
        for r in rows[1:]:
            m = np.maximum(f[:, None], self.matrix(r))
            back.append(m.argmin(axis=0))
            f = m.min(axis=0)
        starts, i = [], self.n
        for arg in reversed(back):
            i = int(arg[i])
            starts.append(i)
        return (0, *reversed(starts)), float(f[self.n])


@dataclass(frozen=True, order=True)
class _Candidate:
    estimate: float  # negated: the heap's smallest is the worst kept
    plan: Plan = field(compare=False)


def placement(processes: int, nodes: int, per_node: int) -> int | None:
    """Processes per node of a job of ``processes`` on ``nodes`` nodes of ``per_node`` devices,
    filled evenly as the engine lays ranks out; None where they cannot be."""
    used = -(-processes // per_node)
    if used > nodes or processes % used:
        return None
    return processes // used


def search(
    cost: CostModel,
    *,
    nodes: int,
    per_node: int,
    batch: int,
    max_stages: int = 4,
    max_micro: int = 64,
    simulate_top: int = 48,
    schedules: tuple[str, ...] = SCHEDULES,
    syncs: tuple[str, ...] = SYNCS,
    exact: bool = False,
    dp: DataParallel = EXACT,
    exhaustive: int = EXHAUSTIVE,
    progress: Callable[[str], None] | None = None,
) -> list[Evaluated]:
    """Plans for ``nodes x per_node`` devices, best first (those that fit in memory first);
    ``exact``: only plans that use every device (a job whose processes are given); each costed
    under ``dp``; ``exhaustive``: how many compositions of a bundle's devices into stage widths
    are scored one by one before the widths are searched coarse to fine (``search_widths``);
    ``progress``: told what the search is doing as it starts each part."""
    devices = nodes * per_node
    say = progress or (lambda line: None)
    counts = bundle_counts(devices, batch, dp.min_bundles)
    say(
        f"searching {len(counts)} bundle count(s) x stage widths x split points x micro-batches "
        f"for {devices} devices"
    )
    best = _best_estimates(
        cost,
        nodes=nodes,
        per_node=per_node,
        batch=batch,
        max_stages=max_stages,
        max_micro=max_micro,
        keep=simulate_top,
        exact=exact,
        dp=dp,
        exhaustive=exhaustive,
    )
    if not best and dp.flags():
        flag, value = dp.flags()[:2]
        raise ConfigError(flag, value, f"no plan on {devices} devices can run it")
    if not best:
        raise ConfigError(
            "--batch-size",
            batch,
            f"no plan gives each replica on {devices} devices at least one row of a micro-batch",
        )
    plans = {c.plan for c in best}
    everywhere = replace(data_parallel(nodes, per_node), dp=dp)
    if batch >= devices and dp.accepts(everywhere.shape, everywhere.num_bundles):
        plans.add(everywhere)
    # Every plan under the first schedule (1F1B where searched: its memory is the least), then
    # the leaders under the others: another schedule reorders the same work, so it moves a plan
    # by at most its bubble, and simulating each under all of them would cost their number.
    first = _first(schedules)
    variants = _variants(plans, (first,), syncs)
    say(f"simulating the {len(variants)} best plan(s) under {first} and each sync")
    evaluated = [evaluate(cost, v, batch) for v in variants]
    leaders = [e.plan for e in rank(evaluated)[:SCHEDULE_LEADERS] if e.plan.micro_batches > 1]
    link = cost.cluster.intra if nodes == 1 else cost.cluster.inter
    splitter = Splitter(cost, link.bandwidth, link.latency)
    others = [
        o
        for plan in leaders
        for name in schedules
        if name != first
        for o in _under(plan, name, splitter, batch)
    ]
    if others:
        say(f"simulating the {len(leaders)} best under the other schedules")
    return rank(evaluated + [evaluate(cost, v, batch) for v in others])


# Model chunks per stage the schedules that run several are planned with (--virtual-stages).
PLANNED_CHUNKS = (2, 3)


def _under(plan: Plan, schedule: str, splitter: Splitter, batch: int) -> list[Plan]:
    """``plan`` under another schedule: the same split, or with model chunks (each number it
    runs of ``PLANNED_CHUNKS``), the model cut into stages x chunks pieces balanced for the same
    widths (piece j at its stage's width); none where the schedule cannot run it (too few
    stages, micro-batches or blocks)."""
    sched = REGISTRY[schedule]
    if not sched.chunks:
        return [replace(plan, schedule=schedule)]
    S, out = len(plan.shape), []
    rows = -(-(batch // plan.num_bundles) // plan.micro_batches)
    for V in PLANNED_CHUNKS:
        try:
            actions(schedule, 0, S, plan.micro_batches, V)
        except ScheduleError:
            continue
        if S < 2 or splitter.n < S * V:
            continue
        pipe = sched.pipe(S, V)
        widths = tuple(plan.shape[pipe.place(j)[0]] for j in range(pipe.pieces))
        starts, _ = splitter.split(widths, rows)
        out.append(replace(plan, schedule=schedule, chunks=V, starts=starts))
    return out


def _bundle_layout(
    b: int, *, devices: int, nodes: int, per_node: int, exact: bool
) -> tuple[int, int | None]:
    """The widest bundle ``b`` bundles can have on the devices, and its processes per node."""
    if exact:
        fit = [(devices // b, per_node if devices % b == 0 else None)]
    else:
        fit = [(w, placement(b * w, nodes, per_node)) for w in range(devices // b, 0, -1)]
    return next(((w, p) for w, p in fit if p is not None), (0, None))


def _best_estimates(
    cost: CostModel,
    *,
    nodes: int,
    per_node: int,
    batch: int,
    max_stages: int,
    max_micro: int,
    keep: int,
    exact: bool,
    dp: DataParallel,
    exhaustive: int = EXHAUSTIVE,
) -> list[_Candidate]:
    """The ``keep`` plans with the best estimates, over bundles, stage widths and micro-batches."""
    devices = nodes * per_node
    link = cost.cluster.intra if nodes == 1 else cost.cluster.inter
    splitter = Splitter(cost, link.bandwidth, link.latency)
    hop = HopCost(cost, dp)
    best: list[_Candidate] = []  # a heap of the ``keep`` best estimates
    tails: dict[tuple[object, ...], Any] = {}  # _estimate's memo
    for b in bundle_counts(devices, batch, dp.min_bundles):
        bundle_rows = batch // b
        width, ppn = _bundle_layout(b, devices=devices, nodes=nodes, per_node=per_node, exact=exact)
        if bundle_rows < 1 or ppn is None:
            continue

        def scored(
            widths: tuple[int, ...], b: int = b, rows: int = bundle_rows, ppn: int = ppn
        ) -> float:
            """Every micro-batch count of these widths into the heap; the best estimate."""
            if not dp.accepts(widths, b):
                return math.inf
            least = math.inf
            for m in micro_counts(rows, max(widths), max_micro):
                starts, slowest = splitter.split(widths, -(-rows // m))
                plan = Plan(widths, b, starts, m, ppn, dp=dp)
                estimate = _estimate(hop, plan, batch, slowest, tails)
                least = min(least, estimate)
                item = _Candidate(-estimate, plan)
                if len(best) < keep:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)
            return least

        for stages in range(1, min(max_stages, width, cost.n) + 1):
            search_widths(width, stages, scored, exhaustive=exhaustive)
    return best


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


def bundle_counts(devices: int, batch: int, least: int) -> list[int]:
    """Bundle counts searched: every one up to 64 devices; beyond, those that divide the devices
    or the batch (a count dividing neither leaves devices idle and rows unplaced)."""
    counts = range(least, devices + 1)
    if devices <= 64:
        return list(counts)
    return [b for b in counts if devices % b == 0 or batch % b == 0]


def _variants(plans: set[Plan], schedules: tuple[str, ...], syncs: tuple[str, ...]) -> set[Plan]:
    """Each plan under every schedule and sync that makes a difference to it."""
    variants = set()
    single = _first(schedules)
    for plan in plans:
        for schedule, sync in itertools.product(schedules, syncs):
            if plan.micro_batches == 1 and schedule != single:
                continue  # one micro-batch: every schedule is the same action list
            if sync != syncs[0] and (not _has_hierarchy(plan) or plan.dp.two_hops(syncs[0])):
                continue  # the same sync under either name
            variants.add(_canonical(replace(plan, schedule=schedule, grad_sync=sync)))
    return variants


def _first(schedules: tuple[str, ...]) -> str:
    """The schedule every plan is simulated under: 1F1B where searched (the least memory)."""
    return "1f1b" if "1f1b" in schedules else schedules[0]


def _canonical(plan: Plan) -> Plan:
    """One stage synced flat over ``b`` bundles of ``w`` is the engine's one bundle of ``b * w``
    (the same rows per replica, the same stage group): named the ``--DP-ONLY`` way."""
    flat = not plan.dp.two_hops(plan.grad_sync)
    if len(plan.shape) == 1 and flat and plan.num_bundles > 1:
        # Ranks keep their places; the bundles' row weights line up one after another.
        weights = (plan.row_weights[0] * plan.num_bundles,) if plan.row_weights else ()
        return replace(plan, shape=(plan.processes,), num_bundles=1, row_weights=weights)
    return plan


def _has_hierarchy(plan: Plan) -> bool:
    """Hierarchical sync differs from flat only where a stage has replicas in several bundles and
    more than one inside a bundle."""
    return plan.num_bundles > 1 and max(plan.shape) > 1


def data_parallel(nodes: int, per_node: int) -> Plan:
    """``--DP-ONLY`` on every device: one stage, one micro-batch, flat sync."""
    return Plan((nodes * per_node,), 1, (0,), 1, per_node)


def rank(evaluated: list[Evaluated]) -> list[Evaluated]:
    """Fitting plans first, then by throughput (to 4 digits: the simulation's resolution); on a
    tie the simpler plan: fewer processes, stages and bundles, 1F1B (less memory), flat sync."""

    def key(e: Evaluated) -> tuple[bool, float, tuple[int, int, int, bool, bool]]:
        p = e.plan
        simpler = (
            p.processes,
            len(p.shape),
            p.num_bundles,
            p.schedule != "1f1b",
            p.grad_sync != "flat",
        )
        return (not e.fits, -float(f"{e.samples_per_s:.4g}"), simpler)

    return sorted(evaluated, key=key)


def _estimate(
    hop: HopCost,
    plan: Plan,
    batch: int,
    slowest: float,
    memo: dict[tuple[object, ...], Any] | None = None,
) -> float:
    """A closed-form step time: the bubble-bound pipeline, then the slowest sync and step.

    ``memo`` keeps each stage's sync and step across the candidates of one search: they depend
    on the layout of the ranks and the stage's blocks, not on the micro-batches or the rest of
    the split (the search asks for the same ones tens of thousands of times); and the nodes of
    each stage's groups, which depend on the layout alone."""
    cost = hop.cost
    memo = {} if memo is None else memo
    ends = [*plan.starts[1:], cost.n]
    layout: tuple[object, ...] = (plan.shape, plan.num_bundles, plan.procs_per_node)
    layout += (plan.grad_sync, plan.placement, plan.row_weights, plan.dp)
    tail = 0.0
    for s, (a, b) in enumerate(zip(plan.starts, ends, strict=True)):
        key = (layout, s, a, b)
        if key not in memo:
            if (layout, s) not in memo:
                memo[layout, s] = _group_nodes(plan.layout(batch).topology(), s)
            groups = memo[layout, s]
            memo[key] = _sync_estimate(hop, plan, groups, a, b) + cost.optimizer(a, b)
        tail = max(tail, memo[key])
    stages = len(plan.shape)
    return (plan.micro_batches + stages - 1) * slowest + tail


def _group_nodes(topo: Topology, s: int) -> tuple[list[int], list[int], list[int]]:
    """The nodes of stage ``s``'s group, of its replicas in bundle 0 and of its masters."""

    def nodes(ranks: tuple[int, ...]) -> list[int]:
        return [topo.node_of(r) for r in ranks]

    groups = (topo.stage_group(s), topo.bundle_stage_group(0, s), topo.masters_group(s))
    flat, inner, masters = (nodes(g) for g in groups)
    return flat, inner, masters


def _sync_estimate(
    hop: HopCost, plan: Plan, groups: tuple[list[int], list[int], list[int]], a: int, b: int
) -> float:
    """Stage ``s``'s whole gradient as one bucket through the sync the plan runs (``groups``:
    its groups' nodes, ``_group_nodes``)."""
    cost = hop.cost
    nbytes = float(cost.params[a:b].sum()) * 4
    flat, inner, masters = groups
    (wire,) = hop.wire_bytes([(a, nbytes)], b)
    if not plan.dp.two_hops(plan.grad_sync):
        return hop.between(nbytes, wire, flat)
    step = hop.between(nbytes, wire, masters) if plan.dp.per_step else 0.0
    return 2 * cost.reduce(nbytes, inner) + step + hop.meeting(a, b, masters, inner)


def evaluate(cost: CostModel, plan: Plan, batch: int, *, timeline: bool = False) -> Evaluated:
    """Simulate one plan and count its memory."""
    layout = plan.layout(batch)
    sim = simulate(layout, cost, timeline=timeline)
    topo = layout.topology()
    S, M, V = len(plan.shape), plan.micro_batches, plan.chunks
    ends = [*plan.starts[1:], cost.n]
    bounds = list(zip(plan.starts, ends, strict=True))
    pipe = layout.pipe
    policy = Policy(recompute=cost.recompute)
    hop = HopCost(cost, plan.dp)
    ddp = not plan.dp.two_hops(plan.grad_sync)
    memory, compute, fits = [], [], True
    for s in range(S):
        acts = actions(plan.schedule, s, S, M, V)
        pieces = [bounds[pipe.piece(s, c)] for c in range(V)]
        synced = len(topo.stage_group(s)) > 1
        state = 0.0
        if synced:
            for a, b in pieces:
                largest = max((n for _, n in cost.buckets(a, b, ddp=ddp)), default=0.0)
                state += hop.state_bytes(a, b, largest_bucket=largest, bundles=plan.num_bundles)
        # Each replica against its own device's memory (rows differ under row weights); the
        # stage's figure is its replica with the most rows.
        per_replica = []
        for i in _distinct_replicas(plan, topo, s):
            rows = [topo.stage_sizes(s, m)[i] for m in topo.micro_sizes(0)]
            mem = _chunks_memory(cost, pieces, acts, rows, policy, synced=synced, ddp=ddp)
            mem = replace(mem, data_parallel=state) if synced else mem
            per_replica.append((rows[0], mem))
            fits &= all(
                mem.total <= _device_memory(cost, plan, topo.rank(bb, s, i))
                for bb in range(plan.num_bundles if plan.placement else 1)
            )
        memory.append(max(per_replica, key=lambda x: x[0])[1])
        compute.append(max(t for t, st in zip(sim.busy, sim.stage_of, strict=True) if st == s))
    return Evaluated(plan, sim, batch / sim.step_time, memory, fits, compute)


def _chunks_memory(
    cost: CostModel,
    pieces: list[tuple[int, int]],
    acts: list[Action],
    rows: list[int],
    policy: Policy,
    *,
    synced: bool,
    ddp: bool,
) -> Memory:
    """A replica's memory over its chunks: each chunk's pieces through that chunk's actions,
    added up (their peaks taken as coinciding: an upper bound with several chunks)."""
    parts = [
        cost.memory(
            a,
            b,
            acts=[x for x in acts if x.chunk == c],
            rows=rows,
            recomputed=policy.recomputes(acts, len(rows), c),
            synced=synced,
            ddp=ddp,
        )
        for c, (a, b) in enumerate(pieces)
    ]
    if len(parts) == 1:
        return parts[0]
    return Memory(*(sum(getattr(m, f.name) for m in parts) for f in fields(Memory)))


def _distinct_replicas(plan: Plan, topo: Topology, s: int) -> list[int]:
    """Replicas of stage ``s`` whose memory differs: one where rows are even on one device type."""
    if not plan.row_weights and not plan.placement:
        return [0]
    return list(range(topo.shape[s]))


def _device_memory(cost: CostModel, plan: Plan, rank: int) -> float:
    kind = plan.placement[rank].kind if plan.placement else ""
    return cost.on(kind).cluster.memory_bytes
