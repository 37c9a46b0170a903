"""Plans for a cluster of several device types: placement, widths, split points and row weights.

Every bundle gets the same mix of devices: each node's devices of each type are cut into as many
contiguous groups as there are bundles (bundle counts that do not divide them are skipped). A
bundle's devices are put in a row, in one of a few orders (node by node; its reverse; fastest
type first; slowest first), and a composition of stage widths cuts that row into contiguous
stages: a stage's replicas and its neighbours stay on one node where the order allows, and each
composition has one placement. The split points come from the search's dynamic program over
per-stage cycle matrices: a stage's cycle at a micro-batch is the slowest of its device types,
each at the rows speed-weighted rows give it. Once the split is known, each replica's row weight
is its device's throughput on its stage's blocks (rounded to quarters), so a replica on a device
twice as fast takes twice the rows. Candidates are then simulated as in ``search``.

Beside the search: the plan chosen as if every device were the cluster's average (``uniform``),
evaluated on the real devices, and data parallelism with even and speed-weighted rows.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from bundle.errors import BundleError, ConfigError
from bundle.ir.schedule import ONE_CHUNK
from bundle.plan.cluster import Cluster, Speed
from bundle.plan.cost import CostModel
from bundle.plan.dataparallel import HopCost
from bundle.plan.estimate import estimate
from bundle.plan.plans import Evaluated, Plan, evaluate, rank, with_options
from bundle.plan.search import (
    DEFAULT_LIMITS,
    SYNCS,
    Limits,
    Workload,
    _Candidate,
    _variants,
    search,
)
from bundle.plan.split import Splitter, compositions, micro_counts, slowest_first
from bundle.topology import Place

_QUANTUM = 4  # row weights in quarters: 1, 1.25, ..., readable on a command line


@dataclass(frozen=True)
class Device:
    node: int
    index: int  # local device index on its node
    kind: str  # device type key


def bundle_devices(cluster: Cluster, nodes: int, per_node: int, b: int) -> list[list[Device]]:
    """Each of ``b`` bundles' devices (node by node), alike in mix; [] where they cannot be."""
    out: list[list[Device]] = [[] for _ in range(b)]
    for n in range(nodes):
        by_kind: dict[str, list[Device]] = {}
        for i in range(per_node):
            kind = cluster.kind_of(n, i)
            by_kind.setdefault(kind, []).append(Device(n, i, kind))
        for devs in by_kind.values():
            if len(devs) % b:
                return []
            k = len(devs) // b
            for j in range(b):
                out[j] += devs[j * k : (j + 1) * k]
    return out


def speeds(cost: CostModel, kinds: list[str], rows: int) -> dict[str, float]:
    """Rows per second of the whole model on each device type, at ``rows`` rows."""
    out = {}
    for kind in kinds:
        c = cost.on(kind)
        out[kind] = rows / max(float(c.prefix(rows)[-1]) + c.block_times(rows)[2], 1e-30)
    return out


def _quantise(ratios: list[float]) -> tuple[Fraction, ...]:
    low = min(ratios)
    return tuple(Fraction(max(1, round(_QUANTUM * r / low)), _QUANTUM) for r in ratios)


def weights_for(
    cost: CostModel, kinds: list[str], a: int, b: int, rows: int
) -> tuple[Fraction, ...]:
    """Row weights of a stage of blocks ``a..b-1`` on devices ``kinds``: each its throughput."""
    if len(set(kinds)) == 1:
        return (Fraction(1),) * len(kinds)
    share = max(1, rows // len(kinds))
    rate = {}
    for kind in set(kinds):
        c = cost.on(kind)
        t = float(c.prefix(share)[b] - c.prefix(share)[a])
        t += c.block_times(share)[2] if b == cost.n else 0.0
        rate[kind] = share / max(t, 1e-30)
    return _quantise([rate[k] for k in kinds])


def placement(
    shape: tuple[int, ...], bundles: list[list[Device]], order: list[int], cluster: Cluster
) -> tuple[Place, ...]:
    """Bundle-major ranks on the devices: each bundle's devices in ``order``, cut into stages."""
    cpu = {t.key: t.cpu for t in cluster.types}
    return tuple(
        Place(d.node, d.index, d.kind, cpu.get(d.kind))
        for devs in bundles
        for d in (devs[i] for i in order[: sum(shape)])
    )


class _MixedSplitter:
    """Split points for stages of mixed devices: each stage's cycle matrix is its types' worst."""

    def __init__(
        self, cost: CostModel, kinds: list[str], rate: dict[str, float], *, nodes: int
    ) -> None:
        link = cost.cluster.inter if nodes > 1 else cost.cluster.intra
        self.by_kind = {k: Splitter(cost.on(k), link.bandwidth, link.latency) for k in kinds}
        self.rate, self.n = rate, cost.n
        self._stage: dict[tuple[tuple[tuple[str, int], ...], int], np.ndarray] = {}

    def stage(self, mix: Counter[str], micro_rows: int) -> np.ndarray:
        key = (tuple(sorted(mix.items())), micro_rows)
        if key not in self._stage:
            total = sum(self.rate[k] * n for k, n in mix.items())
            mats = [
                self.by_kind[k].matrix(max(1, math.ceil(micro_rows * self.rate[k] / total)))
                for k in mix
            ]
            self._stage[key] = np.maximum.reduce(mats) if len(mats) > 1 else mats[0]
        return self._stage[key]

    def split(self, mixes: list[Counter[str]], micro_rows: int) -> tuple[tuple[int, ...], float]:
        return slowest_first([self.stage(mix, micro_rows) for mix in mixes], self.n)


def _orders(devs: list[Device], rate: dict[str, float]) -> list[list[int]]:
    """Orders of a bundle's devices to cut into stages (distinct ones only)."""
    idx = list(range(len(devs)))
    fast = sorted(idx, key=lambda i: -rate[devs[i].kind])
    out: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for order in (idx, idx[::-1], fast, fast[::-1]):
        # Orders that put the same types on the same nodes in the same places are one plan.
        out.setdefault(tuple((devs[i].kind, devs[i].node) for i in order), order)
    return list(out.values())


def _candidates(cost: CostModel, *, workload: Workload, limits: Limits) -> list[_Candidate]:
    nodes, per_node, batch, dp = workload.nodes, workload.per_node, workload.batch, workload.dp
    keep = limits.simulate_top
    cluster = cost.cluster
    kinds = sorted({cluster.kind_of(n, i) for n in range(nodes) for i in range(per_node)})
    rate = speeds(cost, kinds, max(1, batch // (nodes * per_node)))
    splitter = _MixedSplitter(cost, kinds, rate, nodes=nodes)
    hop = HopCost(cost, dp)
    best: list[_Candidate] = []
    devices = nodes * per_node
    for b in range(dp.min_bundles, devices + 1):
        bundles = bundle_devices(cluster, nodes, per_node, b)
        bundle_rows = batch // b
        if not bundles or bundle_rows < 1:
            continue
        width = len(bundles[0])
        for order in _orders(bundles[0], rate):
            row = [bundles[0][i].kind for i in order]
            for stages in range(1, min(limits.max_stages, width, cost.n) + 1):
                for widths in compositions(width, stages):
                    if not dp.accepts(widths, b):
                        continue
                    places = placement(widths, bundles, order, cluster)
                    for m in micro_counts(bundle_rows, max(widths), limits.max_micro):
                        plan = Plan(widths, b, (0,), m, per_node, dp=dp, placement=places)
                        item = _split(cost, splitter, hop, plan, row, batch)
                        if item is None:
                            continue
                        if len(best) < keep:
                            heapq.heappush(best, item)
                        elif item > best[0]:
                            heapq.heapreplace(best, item)
    return best


def _split(
    cost: CostModel, splitter: _MixedSplitter, hop: HopCost, plan: Plan, row: list[str], batch: int
) -> _Candidate | None:
    """``plan`` with its split points and row weights, and its estimate; None where the weights
    leave a replica no row. ``row``: the device types of a bundle's ranks, in rank order."""
    cuts = [sum(plan.shape[:s]) for s in range(len(plan.shape) + 1)]
    kinds = [row[x:y] for x, y in itertools.pairwise(cuts)]
    micro_rows = -(-(batch // plan.num_bundles) // plan.micro_batches)
    starts, slowest = splitter.split([Counter(k) for k in kinds], micro_rows)
    ends = (*starts[1:], cost.n)
    weights = tuple(
        weights_for(cost, k, a, e, micro_rows) for k, a, e in zip(kinds, starts, ends, strict=True)
    )
    even = all(len(set(w)) == 1 for w in weights)
    plan = replace(plan, starts=starts, row_weights=() if even else weights)
    try:
        return _Candidate(-estimate(hop, plan, batch, slowest), plan)
    except BundleError:
        return None


def natural(plan: Plan, cluster: Cluster) -> Plan:
    """``plan`` on the devices main.py gives its ranks without a placement (nodes filled in order)."""
    ppn = plan.procs_per_node
    cpu = {t.key: t.cpu for t in cluster.types}
    places = []
    for r in range(plan.processes):
        node, index = divmod(r, ppn)
        kind = cluster.kind_of(node, index)
        places.append(Place(node, index, kind, cpu.get(kind)))
    return replace(plan, placement=tuple(places))


def data_parallel(
    cost: CostModel, nodes: int, per_node: int, batch: int, *, weighted: bool
) -> Plan:
    """``--DP-ONLY`` on every device, rows even or in proportion to each device's speed."""
    devices = nodes * per_node
    plan = natural(Plan((devices,), 1, (0,), 1, per_node), cost.cluster)
    if not weighted:
        return plan
    kinds = [p.kind for p in plan.placement]
    weights = weights_for(cost, kinds, 0, cost.n, batch)
    return plan if len(set(weights)) == 1 else replace(plan, row_weights=(weights,))


def uniform_cost(cost: CostModel, nodes: int, per_node: int) -> CostModel:
    """The cost model of a cluster whose every device is the average of the real ones planned
    on (the first ``nodes`` nodes, their first ``per_node`` devices)."""
    cluster = cost.cluster
    kinds = [k for node in cluster.kinds[:nodes] for k in node[:per_node]]
    types = [cluster.device_type(k) for k in kinds]
    memory = min(t.memory_bytes for t in types)
    if all(t.speed is not None for t in types):
        sp = [t.speed for t in types if t.speed is not None]
        precisions = set.intersection(*(set(s.peak_flops) for s in sp))
        speed = Speed(
            peak_flops={p: float(np.mean([s.peak_flops[p] for s in sp])) for p in precisions},
            memory_bandwidth=float(np.mean([s.memory_bandwidth for s in sp])),
            efficiency=float(np.mean([s.efficiency for s in sp])),
            kernel_latency=float(np.mean([s.kernel_latency for s in sp])),
        )
        scale = 1.0
    else:  # measured: the average CPU share, and its measured slowdown
        speed = None
        scale = float(np.mean([t.penalty for t in types])) / float(
            np.mean([t.cpu or 1.0 for t in types])
        )
    one = replace(
        cluster,
        name=f"{cluster.name} (every device the average)",
        device_name="average device",
        memory_bytes=memory,
        speed=speed,
        types=(),
        kinds=(),
    )
    return cost.like(one, compute_scale=scale)


@dataclass
class MixedResult:
    ranked: list[Evaluated]  # the mixed search's plans, best first
    uniform: Evaluated  # the plan chosen assuming every device alike, on the real devices
    data_parallel: Evaluated  # even rows
    weighted_data_parallel: Evaluated  # speed-weighted rows


def mixed_search(
    cost: CostModel,
    *,
    workload: Workload,
    limits: Limits = DEFAULT_LIMITS,
    schedules: tuple[str, ...] = ONE_CHUNK,
    syncs: tuple[str, ...] = SYNCS,
    progress: Callable[[str], None] | None = None,
) -> MixedResult:
    """Plans on every device of the first ``workload.nodes`` nodes of a mixed cluster, best first,
    within ``limits``; ``progress``: told what the search is doing as it starts each part."""
    nodes, per_node, batch, dp = workload.nodes, workload.per_node, workload.batch, workload.dp
    say = progress or (lambda line: None)
    say(
        f"searching placements x stage widths x split points x row weights x micro-batches for "
        f"{nodes * per_node} devices of {len(cost.cluster.types)} types (tens of seconds)"
    )
    best = _candidates(cost, workload=workload, limits=limits)
    if not best:
        raise ConfigError(
            "--batch-size",
            batch,
            f"no plan gives each replica on {nodes * per_node} devices at least one row",
        )
    assumed = search(
        uniform_cost(cost, nodes, per_node),
        workload=workload,
        limits=limits,
        schedules=schedules,
        syncs=syncs,
    )[0]

    def run(plan: Plan) -> Evaluated:
        return contended(cost, evaluate(cost, plan, batch), batch)

    uniform = run(natural(assumed.plan, cost.cluster))
    even = run(with_options(data_parallel(cost, nodes, per_node, batch, weighted=False), dp))
    weighted = run(with_options(data_parallel(cost, nodes, per_node, batch, weighted=True), dp))
    variants = _variants({c.plan for c in best}, schedules, syncs)
    say(f"simulating the {len(variants)} best plans step by step, with their links shared")
    found = {v: run(v) for v in variants}
    # The alternatives are plans on these devices too: the search never reports worse.
    for e in (uniform, weighted):
        found.setdefault(e.plan, e)
    # On a tie, fewer micro-batches and ranks in node order (rank sorts stably).
    tidy = sorted(
        found.values(),
        key=lambda e: (e.plan.micro_batches, [(p.node, p.device) for p in e.plan.placement]),
    )
    seen: set[tuple] = set()
    distinct = []
    for e in tidy:  # the same devices and rows per stage in another rank order: one plan
        if _signature(e.plan) not in seen:
            seen.add(_signature(e.plan))
            distinct.append(e)
    return MixedResult(rank(distinct), uniform, even, weighted)


def contended(cost: CostModel, e: Evaluated, batch: int) -> Evaluated:
    """``e`` simulated again with each CPU share's measured penalty (``DeviceType.penalty``)
    eased by how busy the plan keeps the machine.

    A penalty is measured with every emulated device computing at once (``bundle/plan/shares.py``),
    the most contention a plan can meet. In a plan whose processes wait on each other the others
    compete less: the excess of each penalty over 1 is scaled by the share-weighted fraction of
    the step the plan's processes compute (from ``e``'s simulation), and the plan is simulated
    again. Without penalties (devices not emulated by CPU shares) ``e`` is returned as it is.
    """
    types = cost.cluster.types
    if not e.plan.placement or all(t.penalty == 1.0 for t in types) or e.sim.step_time <= 0:
        return e
    shares = [e.plan.placement[r].cpu or 0.0 for r in e.sim.ranks]
    if not sum(shares):
        return e
    demand = sum(b / e.sim.step_time * s for b, s in zip(e.sim.busy, shares, strict=True))
    busy = min(1.0, demand / sum(shares))
    eased = tuple(replace(t, penalty=1.0 + (t.penalty - 1.0) * busy) for t in types)
    eased_cost = cost.like(replace(cost.cluster, types=eased))
    return evaluate(eased_cost, e.plan, batch, timeline=bool(e.sim.timeline))


def _signature(plan: Plan) -> tuple:
    """A plan up to the order of replicas inside a stage (and of alike bundles)."""
    per_stage, rank_ = [], 0
    for s, width in enumerate(plan.shape):
        weights = plan.row_weights[s] if plan.row_weights else (Fraction(1),) * width
        ranks = [rank_ + b * sum(plan.shape) for b in range(plan.num_bundles)]
        held = sorted(
            (p.kind, p.node, w)
            for r in ranks
            for p, w in zip(plan.placement[r : r + width], weights, strict=True)
        )
        per_stage.append(tuple(held))
        rank_ += width
    kept = replace(plan, row_weights=(), placement=())
    return (kept, tuple(per_stage))
