"""An event simulation of one training step, driven by the engine's own schedule action lists.

Every replica of bundle 0 (bundles are alike) runs ``bundle.schedule.actions(...)`` for its stage
in order, each action at the earliest time it can: a forward or backward takes the stage's
compute time at the rows this replica holds (``Topology.global_rows``: the engine's row split); a
send hands each peer of the topology's row plan its rows, over the link between the two ranks'
nodes (transfers between one pair of ranks queue behind each other); a receive waits until every
transfer of its micro-batch has arrived. No schedule logic lives here: change a schedule and the
simulation follows.

After its last action a replica waits for its sends, then for its stage's gradient sync (buckets
started during the last backward, as the engine does: DDP all-reduce for ``flat``; reduce in the
bundle, then all-reduce among stage masters and broadcast for ``hierarchical``), then steps the
optimizer. The step time is the latest replica's finish.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from bundle.engine.precision import Policy
from bundle.engine.schedule import Op, actions, peak_in_flight
from bundle.errors import ScheduleError
from bundle.plan.cost import CostModel
from bundle.topology import Topology, split_sizes

COMPUTE, WAIT, SEND, SYNC, OPTIMIZER = "compute", "wait", "send", "sync", "optimizer"


@dataclass(frozen=True)
class Span:
    """One interval of one replica's step: ``kind`` is compute, wait, send, sync or optimizer."""

    rank: int
    kind: str
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class Layout:
    """What the simulation needs of a plan: the engine's own parameters, nothing derived."""

    shape: tuple[int, ...]
    num_bundles: int
    starts: tuple[int, ...]  # block where each stage begins
    micro_batches: int
    schedule: str
    grad_sync: str
    batch: int
    procs_per_node: int

    def topology(self) -> Topology:
        return Topology(
            shape=self.shape,
            num_bundles=self.num_bundles,
            procs_per_node=self.procs_per_node,
            global_batch=self.batch,
            micro_batches=self.micro_batches,
        )


@dataclass
class SimResult:
    step_time: float
    ranks: list[int]  # the replicas of bundle 0, in rank order
    stage_of: list[int]
    busy: list[float]  # compute seconds per replica
    sync: list[float]  # seconds a replica waited for its gradient sync after its last action
    peak_in_flight: list[int]
    timeline: list[Span] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.step_time - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Fraction of the step the replicas spend neither computing nor syncing gradients."""
        n = len(self.busy)
        waiting = sum(self.step_time - b - s for b, s in zip(self.busy, self.sync, strict=True))
        return max(0.0, waiting / (n * self.step_time)) if self.step_time > 0 else 0.0


def _stage_bounds(layout: Layout, n_blocks: int) -> list[tuple[int, int]]:
    ends = [*layout.starts[1:], n_blocks]
    return list(zip(layout.starts, ends, strict=True))


def simulate(layout: Layout, cost: CostModel, *, timeline: bool = False) -> SimResult:
    """Simulate one step of ``layout``; ``timeline`` keeps every span (for pictures)."""
    topo = layout.topology()
    S, M = topo.num_stages, topo.micro_batches
    if len(layout.starts) != S:
        raise ScheduleError(f"{len(layout.starts)} split points for {S} stages")
    bounds = _stage_bounds(layout, cost.n)
    sizes = topo.micro_sizes(0)
    policy = Policy(recompute=cost.recompute)
    procs = [(s, i) for s in range(S) for i in range(topo.shape[s])]
    rank = {p: topo.rank(0, *p) for p in procs}
    node = {p: topo.node_of(rank[p]) for p in procs}
    lists = {p: actions(layout.schedule, p[0], S, M) for p in procs}
    recomputed = {p: policy.recomputes(lists[p], M) for p in procs}
    rows = {p: [split_sizes(sizes[k], topo.shape[p[0]])[p[1]] for k in range(M)] for p in procs}

    clock = dict.fromkeys(procs, 0.0)
    pc = dict.fromkeys(procs, 0)
    busy = dict.fromkeys(procs, 0.0)
    sent = dict.fromkeys(procs, 0.0)  # when this replica's last send has left
    last_bwd: dict = {}
    arrived: dict = defaultdict(list)  # (direction, stage, replica, micro) -> arrival times
    channel: dict = defaultdict(float)  # (src rank, dst rank) -> when the pair's link is free
    spans: list[Span] = []
    oh = cost.overheads

    def span(p, kind, label, start, end):
        if timeline and end > start:
            spans.append(Span(rank[p], kind, label, start, end))

    def transfer(p, q, nbytes, key, label):
        link = cost.link(node[p], node[q])
        start = max(clock[p], channel[(rank[p], rank[q])])
        done = start + nbytes / link.bandwidth
        channel[(rank[p], rank[q])] = done
        arrived[key].append(done + link.latency)
        sent[p] = max(sent[p], done)
        span(p, SEND, label, start, done)

    def peers(s, i, k, forward):
        """The row plan of micro-batch k at stage s's outgoing (forward) or incoming boundary."""
        return topo.sends(s, i, sizes[k]) if forward else topo.recvs(s, i, sizes[k])

    def step(p) -> bool:
        """Run p's next action if it can start; False when it waits on a transfer."""
        s, i = p
        a = lists[p][pc[p]]
        k, (lo, hi) = a.micro, bounds[s]
        if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            fwd = a.op is Op.RECV_ACT
            want = len(peers(s, i, k, forward=not fwd))
            got = arrived[("act" if fwd else "grad", s, i, k)]
            if len(got) < want:
                return False
            ready = max(got, default=clock[p])
            span(p, WAIT, repr(a), clock[p], ready)
            clock[p] = max(clock[p], ready) + oh.comm_action
        elif a.op is Op.FORWARD:
            d = cost.forward(lo, hi, rows[p][k])
            span(p, COMPUTE, f"F{k}", clock[p], clock[p] + d)
            clock[p] += d
            busy[p] += d
        elif a.op is Op.BACKWARD:
            d = cost.backward(lo, hi, rows[p][k], recompute=recomputed[p][k])
            last_bwd[p] = (clock[p], clock[p] + d)
            span(p, COMPUTE, f"B{k}", clock[p], clock[p] + d)
            clock[p] += d
            busy[p] += d
        elif a.op is Op.SEND_ACT:
            for t in peers(s, i, k, forward=True):
                nbytes = cost.boundary_bytes(hi, t.stop - t.start)
                transfer(p, (s + 1, t.dst), nbytes, ("act", s + 1, t.dst, k), f"A{k}")
            clock[p] += oh.comm_action
        elif a.op is Op.SEND_GRAD:
            for t in peers(s, i, k, forward=False):
                nbytes = cost.boundary_bytes(lo, t.stop - t.start, grad=True)
                transfer(p, (s - 1, t.src), nbytes, ("grad", s - 1, t.src, k), f"G{k}")
            clock[p] += oh.comm_action
        pc[p] += 1
        return True

    left = set(procs)
    while left:
        moved = False
        for p in sorted(left):
            while pc[p] < len(lists[p]) and step(p):
                moved = True
            if pc[p] == len(lists[p]):
                left.discard(p)
        if left and not moved:
            stuck = ", ".join(
                f"stage {s} replica {i} at {lists[(s, i)][pc[(s, i)]]!r}" for s, i in sorted(left)
            )
            raise ScheduleError(f"the schedules wait on each other: {stuck}")

    done = {p: max(clock[p], sent[p]) for p in procs}
    finish, sync_wait = {}, {}
    for s in range(S):
        members = [p for p in procs if p[0] == s]
        synced = _sync(layout, topo, cost, s, bounds[s], members, done, last_bwd, rows)
        for p in members:
            ready = max(done[p], synced)
            sync_wait[p] = ready - done[p]
            span(p, SYNC, "sync", done[p], ready)
            opt = cost.optimizer(*bounds[s])
            span(p, OPTIMIZER, "optimizer", ready, ready + opt)
            finish[p] = ready + opt + oh.step
    return SimResult(
        step_time=max(finish.values()),
        ranks=[rank[p] for p in procs],
        stage_of=[p[0] for p in procs],
        busy=[busy[p] for p in procs],
        sync=[sync_wait[p] for p in procs],
        peak_in_flight=[peak_in_flight(lists[p]) for p in procs],
        timeline=spans,
    )


def _sync(layout, topo, cost, s, bounds, members, done, last_bwd, rows) -> float:
    """When stage ``s``'s gradients are summed over its stage group (every bundle alike)."""
    group = topo.stage_group(s)
    if len(group) == 1:
        return 0.0
    lo, hi = bounds
    # Buckets are collective: one is ready when the slowest replica of the stage has filled it.
    slowest = max(members, key=lambda p: last_bwd[p][1])
    b0, b1 = last_bwd[slowest]
    share = cost.backward_share(lo, hi, rows[slowest][-1])
    finished = max(done[p] for p in members)
    nodes = lambda ranks: [topo.node_of(r) for r in ranks]  # noqa: E731
    if layout.grad_sync == "flat":
        t = 0.0
        for j, nbytes in cost.buckets(lo, hi, ddp=True):
            ready = b0 + share[j - lo] * (b1 - b0)
            t = max(t, ready) + cost.allreduce(nbytes, nodes(group)) + cost.bucket_copies(nbytes)
        return t
    # Hierarchical: in-bundle reduces start from gradient hooks; the masters' all-reduce and the
    # broadcast follow bucket by bucket once every replica has called finish().
    inner = nodes(topo.bundle_stage_group(0, s))
    masters = nodes(topo.masters_group(s))
    buckets = cost.buckets(lo, hi, ddp=False)
    reduced, t = [], 0.0
    for j, nbytes in buckets:
        ready = b0 + share[j - lo] * (b1 - b0)
        t = max(t, ready) + cost.reduce(nbytes, inner)
        reduced.append(t)
    t = finished
    summed = []
    for (_, nbytes), r in zip(buckets, reduced, strict=True):
        t = max(t, r) + cost.allreduce(nbytes, masters)
        summed.append(t)
    t = finished
    for (_, nbytes), r in zip(buckets, summed, strict=True):
        t = max(t, r) + cost.reduce(nbytes, inner)
    return t
