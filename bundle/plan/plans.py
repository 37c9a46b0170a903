"""One plan as a value (``Plan``), simulated with its memory counted (``evaluate``; many at once,
those that cannot reach the best few left out: ``evaluate_many``), and plans ranked: fitting
ones first, then by simulated throughput (``rank``)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction

from bundle.engine.precision import Policy
from bundle.ir.schedule import Action, actions
from bundle.plan import tensor, zero
from bundle.plan.cost import CostModel, Memory
from bundle.plan.dataparallel import DataParallel, HopCost
from bundle.plan.simulate import Layout, Runs, SimResult, lower_bound, simulate
from bundle.topology import Place, Topology


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
    tp: tuple[int, ...] = ()  # each stage's tensor-parallel degree (() : 1 everywhere)

    @property
    def processes(self) -> int:
        return sum(w * t for w, t in zip(self.shape, self.degrees, strict=True)) * self.num_bundles

    @property
    def degrees(self) -> tuple[int, ...]:
        """Each stage's tensor-parallel degree, 1 where it has none."""
        return self.tp or (1,) * len(self.shape)

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
            tp=self.tp,
        )


@dataclass
class Evaluated:
    plan: Plan
    sim: SimResult
    samples_per_s: float
    memory: list[Memory]  # per stage, of its replica with the most rows
    fits: bool
    stage_compute: list[float]  # per stage: compute seconds per step of its busiest replica


def data_parallel(nodes: int, per_node: int) -> Plan:
    """``--DP-ONLY`` on every device: one stage, one micro-batch, flat sync."""
    return Plan((nodes * per_node,), 1, (0,), 1, per_node)


def with_options(plan: Plan, dp: DataParallel) -> Plan:
    """``plan`` (a baseline the search is compared with) under the data-parallel options ``dp``
    where main.py runs them on its shape and bundles, else as it is."""
    return replace(plan, dp=dp) if dp.accepts(plan.shape, plan.num_bundles) else plan


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


# A plan is left out where its step's lower bound exceeds the kept best by more than this: two
# throughputs this far apart never tie at ``rank``'s 4 digits.
BOUND_MARGIN = 1.01


def evaluate_many(
    cost: CostModel,
    plans: Iterable[Plan],
    batch: int,
    *,
    keep: int,
    known: Sequence[Evaluated] = (),
) -> list[Evaluated]:
    """``plans`` evaluated, in their order, but for those that cannot be among the ``keep`` best
    of them and ``known`` (plans of the same search evaluated already): a plan whose step time's
    lower bound (``simulate.lower_bound``) exceeds by ``BOUND_MARGIN`` the ``keep``-th shortest
    step of the plans that fit so far cannot rank above any of those, so it is not simulated. Plans are simulated from the lowest bound
    up (the search stops at the first one left out); those that differ only in their sync share
    one run of their actions (``simulate``'s ``runs``). The ``keep`` best of ``rank(known +
    result)`` are those of every plan evaluated, in the same order."""
    plans = list(plans)
    layouts = [p.layout(batch) for p in plans]
    runs_of = [replace(x, grad_sync="") for x in layouts]
    first = {key: i for i, key in reversed(list(enumerate(runs_of)))}
    bounds = [lower_bound(x, cost) for x in layouts]
    order = sorted(range(len(plans)), key=lambda i: (bounds[i], first[runs_of[i]]))
    best = heapq.nlargest(keep, (-e.sim.step_time for e in known if e.fits))  # negated
    heapq.heapify(best)
    done: dict[int, Evaluated] = {}
    runs: Runs = {}
    for i in order:
        if len(best) == keep and bounds[i] > -best[0] * BOUND_MARGIN:
            break
        if runs_of[i] not in runs:
            runs.clear()  # siblings are simulated one after another: one run kept at a time
        done[i] = e = evaluate(cost, plans[i], batch, runs=runs)
        if e.fits and len(best) < keep:
            heapq.heappush(best, -e.sim.step_time)
        elif e.fits and -e.sim.step_time > best[0]:
            heapq.heapreplace(best, -e.sim.step_time)
    return [done[i] for i in range(len(plans)) if i in done]


def evaluate(
    cost: CostModel, plan: Plan, batch: int, *, timeline: bool = False, runs: Runs | None = None
) -> Evaluated:
    """Simulate one plan and count its memory (``runs``: ``simulate``'s, shared by plans that
    differ only in their sync)."""
    layout = plan.layout(batch)
    sim = simulate(layout, cost, timeline=timeline, runs=runs)
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
        stage_cost = tensor.at(cost, plan.degrees[s])
        acts = actions(plan.schedule, s, S, M, V)
        pieces = [bounds[pipe.piece(s, c)] for c in range(V)]
        group = len(topo.stage_group(s))
        synced = group > 1
        shards = zero.shards(plan.dp, plan.grad_sync, topo, s)
        state = 0.0
        if synced:
            for a, b in pieces:
                largest = max((n for _, n in stage_cost.buckets(a, b, ddp=ddp)), default=0.0)
                state += hop.state_bytes(a, b, largest_bucket=largest, bundles=plan.num_bundles)
        # Each replica against its own device's memory (rows differ under row weights); the
        # stage's figure is its replica with the most rows.
        per_replica = []
        for i in _distinct_replicas(plan, topo, s):
            rows = [topo.stage_sizes(s, m)[i] for m in topo.micro_sizes(0)]
            mem = _chunks_memory(
                stage_cost, pieces, acts, rows, policy, synced=synced, ddp=ddp, shards=shards
            )
            mem = replace(mem, data_parallel=state) if synced else mem
            mem = zero.memory(stage_cost, mem, pieces, shards) if plan.dp.zero == zero.FULL else mem
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
    shards: int,
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
            shards=shards,
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
