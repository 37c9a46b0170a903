"""An event simulation of one training step, driven by the engine's own schedule action lists.

Every replica of bundle 0 (bundles are alike) runs ``bundle.ir.schedule.actions(...)`` for its stage
in order, each action at the earliest time it can: a forward or backward takes the stage's
compute time at the rows this replica holds (``Topology.global_rows``: the engine's row split, even
or by row weights) on its own device (``CostModel.on`` its placement's device type); a
send hands each peer of the topology's row plan its rows, over the link between the two ranks'
nodes (transfers between one pair of ranks queue behind each other); a receive waits until every
transfer of its micro-batch has arrived. Each message also costs its call on both sides
(``Overheads.send_call`` and ``recv_call``, measured by ``bundle.plan.messages``): a send's on the
sender's clock as its transfer starts (the link's one-way time counts from the call's start, as
the ping-pong measures it), a receive's (posted ahead of its wait, as the engine does on gloo) on
the receiver's before it waits; and each send or receive action the engine's own work after it
(``comm_action``). No schedule logic lives here: change a schedule and the simulation follows.

After its last action a replica waits for its sends, then for its stage's gradient sync (buckets
started during the last backward, as the engine does: DDP all-reduce for ``flat``; reduce in the
bundle, then the masters' hop between bundles and broadcast for ``hierarchical``, or where the
data-parallel options need two hops; compressed, gathered or met every H steps as
``bundle.plan.dataparallel`` costs it), then steps the optimizer. The step time is the latest
replica's finish. Under ``--zero 3`` the collectives run inside each forward and backward instead
(``bundle.plan.zero``: spans of kind sync labelled ``gather`` where they outlast the compute), no
sync is left after the last action, and the optimizer steps a shard.

For the search: layouts that differ only in their sync share one run of their action lists
(``simulate``'s ``runs``), and ``lower_bound`` is a step time no simulation of a layout goes
below, cheap beside one (``plans.evaluate_many`` leaves out the plans it shows cannot win).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from bundle.engine.precision import Policy
from bundle.errors import ScheduleError
from bundle.ir.schedule import COMPUTE as SCHEDULE_COMPUTE
from bundle.ir.schedule import REGISTRY, Action, Op, actions, peak_in_flight, unknown
from bundle.plan import tensor
from bundle.plan.cost import CostModel
from bundle.plan.dataparallel import HopCost
from bundle.plan.layout import Layout, SimResult, Span
from bundle.plan.zero import FULL, Collectives, action_time
from bundle.topology import Topology, Transfer

# Layout, SimResult and Span live in ``layout``; the simulation's callers take them from here too.
__all__ = ["Layout", "Runs", "SimResult", "Span", "cpu_slowdown", "lower_bound", "simulate"]
__all__ += ["COMPUTE", "WAIT", "SEND", "SYNC", "OPTIMIZER"]

COMPUTE, WAIT, SEND, SYNC, OPTIMIZER = "compute", "wait", "send", "sync", "optimizer"


def _stage_bounds(layout: Layout, n_blocks: int) -> list[tuple[int, int]]:
    """Each piece's blocks ``[start, end)`` (a stage's, with one chunk per stage)."""
    ends = [*layout.starts[1:], n_blocks]
    return list(zip(layout.starts, ends, strict=True))


Runs = dict[Layout, list["_Simulation"]]
_LETTERS = {Op.FORWARD: "F", Op.BACKWARD_INPUT: "I", Op.BACKWARD: "B", Op.BACKWARD_WEIGHT: "W"}


def simulate(
    layout: Layout, cost: CostModel, *, timeline: bool = False, runs: Runs | None = None
) -> SimResult:
    """Simulate one step of ``layout``; ``timeline`` keeps every span (for pictures). ``runs``
    keeps the replicas' action lists run once for the layouts that differ only in their sync
    (which starts after them), for ``cost`` alone: a layout under another sync reuses them."""
    key = replace(layout, grad_sync="")
    sims = runs.get(key) if runs is not None and not timeline else None
    if sims is None:
        topo = layout.topology()
        bundles = _distinct_bundles(topo)
        sims = [_Simulation(layout, cost, timeline=timeline, bundle=b) for b in bundles]
        for sim in sims:  # bundles meet only in the gradient sync
            sim.run_actions()
        if runs is not None and layout.dp.zero != FULL and not timeline:  # ZeRO-3: sync inside
            runs[key] = sims
    return _finish(sims, layout.grad_sync)


def lower_bound(layout: Layout, cost: CostModel) -> float:
    """A step time ``simulate`` never goes below. Each stage's replica 0 runs its compute actions
    one after another, then its optimizer step (``_finish``); with one chunk per stage, not before
    its first forward's micro-batch has passed the stages before it (the shortest forward of
    each, transfers left out), and without a split backward, its last backward's micro-batch then
    passes back through the stages before it before stage 0 steps. Waits, transfers and the sync
    only add to these."""
    sim, out = _Simulation(layout, cost, timeline=False), 0.0
    chain = sim.pipe.chunks == 1
    drains = chain and not REGISTRY[layout.schedule].split_backward

    def least(stage: int, like: Action) -> float:
        """The shortest of ``like``'s action (op and micro-batch) among ``stage``'s replicas."""
        a = next(x for x in sim.stage_lists[stage] if x.op is like.op and x.micro == like.micro)
        return min(sim.duration((stage, i), a) for i in range(sim.topo.shape[stage]))

    def step(p: Replica) -> float:
        opt = sum(sim.dev[p].optimizer(*sim.bounds[j]) for j in sim.pieces_of(p[0]))
        opt /= sim.zero.over(p[0]) if sim.zero is not None else 1
        return opt + sim.dev[p].host(cost.overheads.step)

    first_steps = min(step((0, i)) for i in range(sim.topo.shape[0]))
    for s in range(sim.topo.num_stages):
        p = (s, 0)
        computes = [a for a in sim.lists[p] if a.op in SCHEDULE_COMPUTE]
        busy = sum(sim.duration(p, a) for a in computes)
        fill = sum(least(r, computes[0]) for r in range(s)) if chain else 0.0
        out = max(out, fill + busy + step(p))
        if drains and s > 0 and computes[-1].op is Op.BACKWARD:
            drain = sum(least(r, computes[-1]) for r in range(s))
            out = max(out, fill + busy + drain + first_steps)
    return out


Replica = tuple[int, int]  # (stage, replica) in the bundle simulated


class _Simulation:
    """Every replica's clock, position in its action list and transfers in flight."""

    def __init__(self, layout: Layout, cost: CostModel, *, timeline: bool, bundle: int = 0) -> None:
        topo = layout.topology()
        S, M, V = topo.num_stages, topo.micro_batches, layout.chunks
        self.pipe = layout.pipe
        if len(layout.starts) != self.pipe.pieces:
            raise ScheduleError(f"{len(layout.starts)} split points for {self.pipe.pieces} pieces")
        self.layout, self.cost, self.topo, self.timeline = layout, cost, topo, timeline
        self.bounds = _stage_bounds(layout, cost.n)
        self.hop = HopCost(cost, layout.dp)
        full = layout.dp.zero == FULL
        self.zero = Collectives(cost, topo, layout.grad_sync, bundle) if full else None
        self.sizes = topo.micro_sizes(bundle)
        policy = Policy(recompute=cost.recompute)
        procs = [(s, i) for s in range(S) for i in range(topo.shape[s])]
        self.procs = procs
        self.rank = {p: topo.rank(bundle, *p) for p in procs}
        self.node = {p: topo.node_of(self.rank[p]) for p in procs}
        # A stage's replicas share one action list and recompute plan (read, never changed).
        lists = [actions(layout.schedule, s, S, M, V) for s in range(S)]
        again = [[policy.recomputes(acts, M, c) for c in range(V)] for acts in lists]
        self.stage_lists = lists
        self.lists = {p: lists[p[0]] for p in procs}
        self.recomputed = {p: again[p[0]] for p in procs}
        sizes = {(s, k): topo.stage_sizes(s, self.sizes[k]) for s in range(S) for k in range(M)}
        self.rows = {p: [sizes[p[0], k][p[1]] for k in range(M)] for p in procs}
        place = topo.placement
        self.dev = {
            p: tensor.at(cost.on(place[self.rank[p]].kind if place else ""), topo.tp_of(p[0]))
            for p in procs
        }
        self.clock = dict.fromkeys(procs, 0.0)
        self.pc = dict.fromkeys(procs, 0)
        self.busy = dict.fromkeys(procs, 0.0)
        self.sent = dict.fromkeys(procs, 0.0)  # when this replica's last send has left
        # (replica, chunk) -> its last backward work on the chunk's weights (start, end)
        self.last_bwd: dict[tuple[Replica, int], tuple[float, float]] = {}
        # (direction, piece, replica, micro) -> arrival times
        self.arrived: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
        # (src rank, dst rank) -> when the pair's link is free
        self.channel: dict[tuple[int, int], float] = defaultdict(float)
        self.spans: list[Span] = []
        self._durations: dict[tuple[int, int, int, Op, int, bool], float] = {}
        self._peers: dict[tuple[int, int, int, bool], tuple[int, tuple[Transfer, ...]]] = {}

    def pieces_of(self, s: int) -> list[int]:
        """The pieces stage ``s`` runs, chunk by chunk."""
        return [self.pipe.piece(s, c) for c in range(self.pipe.chunks)]

    def span(self, p: Replica, kind: str, label: str, start: float, end: float) -> None:
        if self.timeline and end > start:
            self.spans.append(Span(self.rank[p], kind, label, start, end))

    def transfer(
        self, p: Replica, q: Replica, nbytes: float, key: tuple[str, int, int, int], label: str
    ) -> None:
        link, o = self.cost.link(self.node[p], self.node[q]), self.cost.overheads
        pair = (self.rank[p], self.rank[q])
        start = max(self.clock[p], self.channel[pair])
        done = start + nbytes / link.bandwidth * cpu_slowdown(self.topo, pair)
        self.channel[pair] = done
        self.arrived[key].append(done + link.latency)
        self.sent[p] = max(self.sent[p], done)
        self.span(p, SEND, label, start, done)
        # The message leaves as its call starts (the link's time counts from there, as the
        # ping-pong measures it); the call takes the sender's own time besides.
        self.clock[p] += self.dev[p].host(o.send_call + nbytes * o.send_call_per_byte)

    def peers(
        self, piece: int, i: int, k: int, *, forward: bool
    ) -> tuple[int, tuple[Transfer, ...]]:
        """The stage across a piece's outgoing (forward) or incoming boundary, and the row plan of
        micro-batch k there for replica i (kept: a step asks for each one several times)."""
        key = (piece, i, k, forward)
        if key not in self._peers:
            s = self.pipe.place(piece)[0]
            other = self.pipe.place(piece + (1 if forward else -1))[0]
            src, dst = (s, other) if forward else (other, s)
            plan = self.topo.transfers(src, dst, self.sizes[k], by_src=forward)[i]
            self._peers[key] = other, plan
        return self._peers[key]

    def step(self, p: Replica) -> bool:
        """Run p's next action if it can start; False when it waits on a transfer."""
        a = self.lists[p][self.pc[p]]
        if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            if not self._receive(p, a):
                return False
        elif a.op in SCHEDULE_COMPUTE:
            self._compute(p, a)
        elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            self._send(p, a)
        else:
            raise unknown(a, "the planner's simulator")
        self.pc[p] += 1
        return True

    def _receive(self, p: Replica, a: Action) -> bool:
        (s, i), fwd = p, a.op is Op.RECV_ACT
        piece = self.pipe.piece(s, a.chunk)
        want = len(self.peers(piece, i, a.micro, forward=not fwd)[1])
        got = self.arrived[("act" if fwd else "grad", piece, i, a.micro)]
        if len(got) < want:
            return False
        # Each peer's receive was posted ahead of the wait, on this replica's own time.
        self.clock[p] += self.dev[p].host(want * self.cost.overheads.recv_call)
        ready = max(got, default=self.clock[p])
        self.span(p, WAIT, repr(a), self.clock[p], ready)
        self.clock[p] = max(self.clock[p], ready) + self.dev[p].host(
            self.cost.overheads.comm_action
        )
        return True

    def duration(self, p: Replica, a: Action) -> float:
        """Seconds of compute action ``a`` of replica ``p`` on its device (kept per stage, chunk,
        action, rows and recompute on the device: the replicas of a stage ask alike)."""
        k, (lo, hi) = a.micro, self.bounds[self.pipe.piece(p[0], a.chunk)]
        dev, rows, again = self.dev[p], self.rows[p][k], self.recomputed[p][a.chunk][k]
        key = (id(dev), lo, hi, a.op, rows, again)
        if key not in self._durations:
            if a.op is Op.FORWARD:
                d = dev.forward(lo, hi, rows)
            elif a.op is Op.BACKWARD_INPUT:
                d = dev.backward_input(lo, hi, rows, recompute=again)
            elif a.op is Op.BACKWARD:
                d = dev.backward(lo, hi, rows, recompute=again)
            else:
                d = dev.backward_weight(lo, hi, rows, recompute=again)
            self._durations[key] = d
        return self._durations[key]

    def _compute(self, p: Replica, a: Action) -> None:
        lo, hi = self.bounds[self.pipe.piece(p[0], a.chunk)]
        dev = self.dev[p]
        d = self.duration(p, a)
        if a.op is Op.BACKWARD or a.op is Op.BACKWARD_WEIGHT:
            # The gradients are complete with the last backward work on the weights.
            self.last_bwd[p, a.chunk] = (self.clock[p], self.clock[p] + d)
        if self.timeline:
            label = f"{_LETTERS[a.op]}{a.micro}"
            self.span(p, COMPUTE, label, self.clock[p], self.clock[p] + d)
        took = d
        if self.zero is not None:  # ZeRO-3's gathers and reduce-scatters in the action
            group = self.topo.stage_group(p[0])
            comm = self.zero.seconds(p[0], lo, hi, a.op) * cpu_slowdown(self.topo, group)
            took = action_time(d, comm, overlap=dev.overlap)
            self.span(p, SYNC, "gather", self.clock[p] + d, self.clock[p] + took)
        self.clock[p] += took
        self.busy[p] += d

    def _send(self, p: Replica, a: Action) -> None:
        (s, i), k = p, a.micro
        piece = self.pipe.piece(s, a.chunk)
        lo, hi = self.bounds[piece]
        if a.op is Op.SEND_ACT:
            other, plan = self.peers(piece, i, k, forward=True)
            for t in plan:
                nbytes = self.cost.boundary_bytes(hi, t.stop - t.start)
                key = ("act", piece + 1, t.dst, k)
                self.transfer(p, (other, t.dst), nbytes, key, f"A{k}")
        else:
            other, plan = self.peers(piece, i, k, forward=False)
            for t in plan:
                nbytes = self.cost.boundary_bytes(lo, t.stop - t.start, grad=True)
                key = ("grad", piece - 1, t.src, k)
                self.transfer(p, (other, t.src), nbytes, key, f"G{k}")
        self.clock[p] += self.dev[p].host(self.cost.overheads.comm_action)

    def run_actions(self) -> None:
        """Every replica runs its actions, each as early as it can; a deadlock is an error."""
        left = set(self.procs)
        while left:
            moved = False
            for p in sorted(left):
                while self.pc[p] < len(self.lists[p]) and self.step(p):
                    moved = True
                if self.pc[p] == len(self.lists[p]):
                    left.discard(p)
            if left and not moved:
                stuck = ", ".join(
                    f"stage {s} replica {i} at {self.lists[(s, i)][self.pc[(s, i)]]!r}"
                    for s, i in sorted(left)
                )
                raise ScheduleError(f"the schedules wait on each other: {stuck}")


Member = tuple[int, Replica]  # (index of the bundle simulated, replica)


def _finish(sims: list[_Simulation], grad_sync: str) -> SimResult:
    """After its actions a replica waits for its sends, its stage's sync (``grad_sync``), the
    optimizer."""
    done = {(j, p): max(sim.clock[p], sim.sent[p]) for j, sim in enumerate(sims) for p in sim.procs}
    finish, sync_wait = {}, {}
    for s in range(sims[0].topo.num_stages):
        members = [m for m in done if m[1][0] == s]
        synced = _sync(sims, s, members, done, grad_sync)
        for m in members:
            sim, p = sims[m[0]], m[1]
            ready = max(done[m], synced)
            sync_wait[m] = ready - done[m]
            sim.span(p, SYNC, "sync", done[m], ready)
            opt = sum(sim.dev[p].optimizer(*sim.bounds[j]) for j in sim.pieces_of(s))
            opt /= sim.zero.over(s) if sim.zero is not None else 1  # a shard's step
            sim.span(p, OPTIMIZER, "optimizer", ready, ready + opt)
            finish[m] = ready + opt + sim.dev[p].host(sim.cost.overheads.step)
    order = list(done)
    peaks = [peak_in_flight(acts) for acts in sims[0].stage_lists]
    return SimResult(
        step_time=max(finish.values()),
        ranks=[sims[j].rank[p] for j, p in order],
        stage_of=[p[0] for _, p in order],
        busy=[sims[j].busy[p] for j, p in order],
        sync=[sync_wait[m] for m in order],
        peak_in_flight=[peaks[p[0]] for _, p in order],
        timeline=[span for sim in sims for span in sim.spans],
    )


def cpu_slowdown(topo: Topology, ranks: tuple[int, ...] | list[int]) -> float:
    """How much slower communication among ``ranks`` runs where they are CPU processes held to a
    share of a CPU (emulated devices): gloo moves and sums bytes on the processes' own time, so a
    transfer or collective goes at its slowest member's share."""
    shares = [topo.placement[r].cpu for r in ranks] if topo.placement else []
    held = [s for s in shares if s]
    return 1.0 / min(held) if held else 1.0


def _distinct_bundles(topo: Topology) -> list[int]:
    """Bundles to simulate: one per distinct set of devices (bundle 0 alone without a placement:
    every bundle runs alike)."""
    if not topo.placement:
        return [0]
    seen: dict[tuple[tuple[str, float | None], ...], int] = {}
    for b in range(topo.num_bundles):
        ranks = [topo.rank(b, s, i) for s in range(topo.num_stages) for i in range(topo.shape[s])]
        sig = tuple((topo.placement[r].kind, topo.placement[r].cpu) for r in ranks)
        seen.setdefault(sig, b)
    return list(seen.values())


def _sync(
    sims: list[_Simulation], s: int, members: list[Member], done: dict[Member, float], sync: str
) -> float:
    """When stage ``s``'s gradients are summed over its stage group (bundles simulated once per
    distinct set of devices; without a placement bundle 0 stands for all)."""
    sim = sims[0]
    if len(sim.topo.stage_group(s)) == 1 or sim.zero is not None:
        return 0.0  # ZeRO-3: reduced in every backward (``_Simulation._compute``)
    # Each chunk's gradient sync starts with its own last backward, one after another on the
    # stage group (one chunk per stage: the stage's).
    chunks = sorted(
        range(sim.pipe.chunks),
        key=lambda c: max(sims[j].last_bwd[p, c][1] for j, p in members),
    )
    t = 0.0
    for c in chunks:
        t = _sync_chunk(sims, s, c, members, done, after=t, sync=sync)
    return t


def _sync_chunk(
    sims: list[_Simulation],
    s: int,
    c: int,
    members: list[Member],
    done: dict[Member, float],
    *,
    after: float,
    sync: str,
) -> float:
    """When chunk ``c`` of stage ``s`` has its gradients summed, its sync starting no earlier
    than ``after`` (the chunk before's)."""
    sim = sims[0]
    topo, cost = sim.topo, sim.cost
    group = topo.stage_group(s)
    lo, hi = sim.bounds[sim.pipe.piece(s, c)]
    # Buckets are collective: one is ready when the slowest replica of the stage has filled it.
    late, slowest = max(members, key=lambda m: sims[m[0]].last_bwd[m[1], c][1])
    b0, b1 = sims[late].last_bwd[slowest, c]
    device = sims[late].dev[slowest]
    share = device.backward_share(lo, hi, sims[late].rows[slowest][-1])
    finished = max(done[m] for m in members)

    def nodes(ranks: tuple[int, ...] | list[int]) -> list[int]:
        return [topo.node_of(r) for r in ranks]

    hop, slow = sim.hop, cpu_slowdown(topo, group)
    if not hop.dp.two_hops(sync):
        buckets = device.buckets(lo, hi, ddp=True)
        t = after
        for (j, nbytes), wire in zip(buckets, hop.wire_bytes(buckets, hi), strict=True):
            ready = b0 + share[j - lo] * (b1 - b0)
            t = max(t, ready) + hop.between(nbytes, wire, nodes(group)) * slow
            t += device.bucket_copies(nbytes)
        return t
    # Two hops: in-bundle reduces start from gradient hooks; the masters' hop and the broadcast
    # follow bucket by bucket once every replica has called finish().
    inner = nodes(topo.bundle_stage_group(0, s))
    masters = nodes(topo.masters_group(s))
    buckets = device.buckets(lo, hi, ddp=False)
    reduced, t = [], after
    for j, nbytes in buckets:
        ready = b0 + share[j - lo] * (b1 - b0)
        t = max(t, ready) + cost.reduce(nbytes, inner) * slow
        reduced.append(t)
    summed = reduced  # bundles that meet every H steps skip the masters' hop between meetings
    finished = max(finished, after)
    if hop.dp.per_step:
        t, summed = finished, []
        for (_, nbytes), wire, r in zip(buckets, hop.wire_bytes(buckets, hi), reduced, strict=True):
            t = max(t, r) + hop.between(nbytes, wire, masters) * slow
            summed.append(t)
    t = finished
    for (_, nbytes), r in zip(buckets, summed, strict=True):
        t = max(t, r) + cost.reduce(nbytes, inner) * slow
    return t + hop.meeting(lo, hi, masters, inner) * slow
