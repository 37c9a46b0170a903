"""Search plans: shapes, bundles, split points, micro-batches, schedules and sync strategies.

For every bundle count ``b`` (all of them up to 64 devices; beyond, those dividing the devices
or the batch: ``bundle_counts``) and stage count ``S`` (up to ``Limits.max_stages``), the
compositions of the ``devices // b`` devices of a bundle into ``S`` stage widths (every one where
there are at most ``Limits.exhaustive``, else searched coarse to fine: ``split.search_widths``),
and every micro-batch count that divides a bundle's batch and gives every replica a row, a dynamic
program (``split.Splitter``) picks the split points that minimise the slowest stage (its forward +
backward at the rows one replica holds, or its boundary transfer where that is slower). A closed
form ranks those candidates (``estimate``: ``(M + S - 1)`` slowest stages, plus the largest
gradient sync and optimizer step); the best ones are then simulated under 1F1B and each sync
strategy, the ``SCHEDULE_LEADERS`` best of those under every other schedule too, and ranked by
simulated throughput, plans that do not fit in device memory last (``plans.evaluate``,
``plans.rank``). A candidate whose step's lower bound cannot reach the ``EXACT_TOP`` best found
so far is not simulated (``plans.evaluate_many``): the leaders, the best plan and the table's
rows are those of simulating them all. Tensor parallelism (``tensor``): each degree the model
and a node take is searched with every stage at it (its TP groups standing for devices), and
the ``TP_LEADERS`` best plans are tried with each stage at each other degree on the same
processes (``_regrouped``; not with ``Limits.per_stage`` off); under a schedule with model
chunks, the pieces of a plan whose stages differ in degree are split at each stage's own. The
data-parallel options (``DataParallel``: compression, bundle sync, aggregation, ZeRO) are the
user's: every plan is costed under them, and only bundle counts they accept are planned; the one
exception is ``search_fitting``, which searches again under ``--zero 3`` where no plan fits in
device memory.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bundle.errors import ConfigError, ScheduleError
from bundle.ir.schedule import REGISTRY, SCHEDULES, actions
from bundle.plan import tensor
from bundle.plan.cost import CostModel
from bundle.plan.dataparallel import EXACT, DataParallel, HopCost
from bundle.plan.estimate import estimate
from bundle.plan.plans import Evaluated, Plan, data_parallel, evaluate_many, rank
from bundle.plan.split import EXHAUSTIVE, Splitter, micro_counts, search_widths, slowest_first
from bundle.plan.zero import FULL

SYNCS = ("flat", "hierarchical")
SCHEDULE_LEADERS = 8  # plans simulated under every schedule, after all under 1F1B
TP_LEADERS = 2  # plans whose stages are each tried at the other tensor-parallel degrees
TP_KEEP = 4  # estimates kept at each tensor-parallel degree above 1
# The best plans every part of the search finds as if it simulated all its candidates (the leaders
# and the table's rows): a candidate that cannot reach them is not simulated (``evaluate_many``).
EXACT_TOP = 10


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a search plans for: ``nodes x per_node`` devices, the batch, and the data-parallel
    options every plan is costed under (the user's: never searched)."""

    nodes: int
    per_node: int  # devices per node
    batch: int
    dp: DataParallel = EXACT

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How far a search looks: the most stages and micro-batches, how many of the best estimates
    are simulated, how many compositions of a bundle's devices into stage widths are scored
    one by one before the widths are searched coarse to fine (``split.search_widths``), and
    whether stages may differ in tensor-parallel degree (``per_stage``)."""

    max_stages: int = 4
    max_micro: int = 64
    simulate_top: int = 48
    exhaustive: int = EXHAUSTIVE
    per_stage: bool = True  # False: every stage at one tensor-parallel degree (no ``_regrouped``)


DEFAULT_LIMITS = Limits()


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
    workload: Workload,
    limits: Limits = DEFAULT_LIMITS,
    schedules: tuple[str, ...] = SCHEDULES,
    syncs: tuple[str, ...] = SYNCS,
    exact: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[Evaluated]:
    """Plans for ``workload``'s devices, best first (those that fit in memory first), within
    ``limits``; ``exact``: only plans that use every device (a job whose processes are given);
    each costed under ``workload.dp``; ``progress``: told what the search is doing as it starts
    each part."""
    nodes, per_node, batch, dp = workload.nodes, workload.per_node, workload.batch, workload.dp
    devices = workload.devices
    if dp.zero == FULL:  # FSDP reduce-scatters with the input half: the split is refused
        schedules = tuple(s for s in schedules if not REGISTRY[s].split_backward)
    say = progress or (lambda line: None)
    counts = bundle_counts(devices, batch, dp.min_bundles)
    say(
        f"searching {len(counts)} bundle count(s) x stage widths x split points x micro-batches "
        f"for {devices} devices"
    )
    best = _degree_estimates(cost, workload=workload, limits=limits, exact=exact)
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
    evaluated = evaluate_many(cost, variants, batch, keep=EXACT_TOP)
    regrouped = rank(evaluated)[:TP_LEADERS] if limits.per_stage else []
    tuned = {_canonical(v) for e in regrouped for v in _regrouped(cost, e.plan, batch)}
    evaluated += evaluate_many(cost, tuned - variants, batch, keep=EXACT_TOP, known=evaluated)
    leaders = [e.plan for e in rank(evaluated)[:SCHEDULE_LEADERS] if e.plan.micro_batches > 1]
    link = cost.cluster.intra if nodes == 1 else cost.cluster.inter
    splitters: dict[int, Splitter] = {}

    def splitter(t: int) -> Splitter:
        if t not in splitters:
            splitters[t] = Splitter(tensor.at(cost, t), link.bandwidth, link.latency)
        return splitters[t]

    others = [
        o
        for plan in leaders
        for name in schedules
        if name != first
        for o in _under(plan, name, splitter, batch)
    ]
    if others:
        say(f"simulating the {len(leaders)} best under the other schedules")
    return rank(evaluated + evaluate_many(cost, others, batch, keep=EXACT_TOP, known=evaluated))


def search_fitting(
    cost: CostModel,
    *,
    workload: Workload,
    limits: Limits = DEFAULT_LIMITS,
    exact: bool = False,
    progress: Callable[[str], None] | None = None,
    schedules: tuple[str, ...] = SCHEDULES,
) -> list[Evaluated]:
    """``search`` (among ``schedules``); where none of its plans fits in device memory, the
    search again under ``--zero 3`` (if the run's options allow it: ``DataParallel.shardable``):
    the sharded plans first where some of them fit (their commands say ``--zero 3``), the run's
    own after them."""

    def under(w: Workload) -> list[Evaluated]:
        return search(
            cost, workload=w, limits=limits, exact=exact, progress=progress, schedules=schedules
        )

    ranked = under(workload)
    dp = workload.dp
    if any(e.fits for e in ranked) or dp.zero == FULL or not dp.shardable:
        return ranked
    if progress is not None:
        progress("no plan fits in device memory: searching again with --zero 3")
    try:
        found = under(replace(workload, dp=replace(dp, zero=FULL)))
    except ConfigError:  # no stage on these devices has a replica to shard over
        return ranked
    return rank(found + ranked) if any(e.fits for e in found) else ranked


# Model chunks per stage the schedules that run several are planned with (--virtual-stages).
PLANNED_CHUNKS = (2, 3)


def _under(
    plan: Plan, schedule: str, splitter: Callable[[int], Splitter], batch: int
) -> list[Plan]:
    """``plan`` under another schedule: the same split, or with model chunks (each number it
    runs of ``PLANNED_CHUNKS``), the model cut into stages x chunks pieces balanced for the same
    widths (piece j at its stage's width; at its stage's degree where the degrees differ:
    ``splitter(t)`` splits at degree t); none where the schedule cannot run it (too few stages,
    micro-batches or blocks)."""
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
        if S < 2 or splitter(1).n < S * V:
            continue
        stages = [sched.pipe(S, V).place(j)[0] for j in range(S * V)]
        widths = tuple(plan.shape[s] for s in stages)
        if len(set(plan.degrees)) == 1:
            starts, _ = splitter(1).split(widths, rows)
        else:  # each piece's cycle at its own stage's degree
            cycles = [
                splitter(plan.degrees[s]).matrix(-(-rows // w))
                for s, w in zip(stages, widths, strict=True)
            ]
            starts, _ = slowest_first(cycles, splitter(1).n)
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
    cost: CostModel, *, workload: Workload, limits: Limits, exact: bool
) -> list[_Candidate]:
    """The ``limits.simulate_top`` plans with the best estimates, over bundles, stage widths and
    micro-batches."""
    nodes, per_node, batch, dp = workload.nodes, workload.per_node, workload.batch, workload.dp
    devices, keep = workload.devices, limits.simulate_top
    link = cost.cluster.intra if nodes == 1 else cost.cluster.inter
    splitter = Splitter(cost, link.bandwidth, link.latency)
    hop = HopCost(cost, dp)
    best: list[_Candidate] = []  # a heap of the ``keep`` best estimates
    tails: dict[tuple[object, ...], Any] = {}  # estimate's memo
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
            for m in micro_counts(rows, max(widths), limits.max_micro):
                starts, slowest = splitter.split(widths, -(-rows // m))
                plan = Plan(widths, b, starts, m, ppn, dp=dp)
                guess = estimate(hop, plan, batch, slowest, tails)
                least = min(least, guess)
                item = _Candidate(-guess, plan)
                if len(best) < keep:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)
            return least

        for stages in range(1, min(limits.max_stages, width, cost.n) + 1):
            search_widths(width, stages, scored, exhaustive=limits.exhaustive)
    return best


def _degree_estimates(
    cost: CostModel, *, workload: Workload, limits: Limits, exact: bool
) -> list[_Candidate]:
    """``_best_estimates`` at every tensor-parallel degree the model and a node take, all stages
    at one degree: its TP groups stand for devices (``per_node // t`` a node) costed at degree
    ``t`` (``tensor.at``). Degree 1 keeps ``limits.simulate_top``; each other degree its
    ``TP_KEEP`` best: the estimate leaves memory out, where TP earns its place."""
    out = []
    for t in tensor.degrees(cost, workload.per_node, workload.dp):
        keep = limits.simulate_top if t == 1 else min(TP_KEEP, limits.simulate_top)
        found = _best_estimates(
            tensor.at(cost, t),
            workload=replace(workload, per_node=workload.per_node // t),
            limits=replace(limits, simulate_top=keep),
            exact=exact,
        )
        for c in found:
            p = c.plan
            tp = (t,) * len(p.shape) if t > 1 else ()
            out.append(replace(c, plan=replace(p, procs_per_node=p.procs_per_node * t, tp=tp)))
    return out


def _regrouped(cost: CostModel, plan: Plan, batch: int) -> list[Plan]:
    """``plan`` with one stage at another degree on the same processes (width x degree kept,
    the split kept: a stage's compute per micro-batch stays about the same), where its TP groups
    stay inside nodes and each replica keeps a row: what a stage's own degree buys (memory, a
    smaller sync) for another."""
    out, rows = [], batch // plan.num_bundles // plan.micro_batches
    for s, (w, t) in enumerate(zip(plan.shape, plan.degrees, strict=True)):
        for u in tensor.degrees(cost, plan.procs_per_node, plan.dp):
            if u == t or (w * t) % u or w * t // u > rows:
                continue
            shape = (*plan.shape[:s], w * t // u, *plan.shape[s + 1 :])
            degrees = (*plan.degrees[:s], u, *plan.degrees[s + 1 :])
            tp = degrees if max(degrees) > 1 else ()
            moved = replace(plan, shape=shape, tp=tp, row_weights=())
            if not plan.row_weights and _groups_in_nodes(moved):
                out.append(moved)
    return out


def _groups_in_nodes(plan: Plan) -> bool:
    """Whether every TP group of ``plan`` lies inside one node (and its processes fill nodes)."""
    ppn, offset = plan.procs_per_node, 0
    if plan.processes % ppn:
        return False
    width = plan.processes // plan.num_bundles
    for w, t in zip(plan.shape, plan.degrees, strict=True):
        for b in range(plan.num_bundles):
            first = b * width + offset
            if any((first + i * t) // ppn != (first + i * t + t - 1) // ppn for i in range(w)):
                return False
        offset += w * t
    return True


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
        shape = (plan.shape[0] * plan.num_bundles,)
        return replace(plan, shape=shape, num_bundles=1, row_weights=weights)
    return plan


def _has_hierarchy(plan: Plan) -> bool:
    """Hierarchical sync differs from flat only where a stage has replicas in several bundles and
    more than one inside a bundle."""
    return plan.num_bundles > 1 and max(plan.shape) > 1
