"""The point-to-point calls of one stage in one step, derived from its schedule (tested as data).

NCCL runs the calls of a communicator in the order they were posted, on one stream, and a large
send completes only while the call holding its matching receive runs (rendezvous). A receive
posted early therefore blocks every send posted after it, and two stages whose heads each wait
for a call queued behind the other's head never finish (the 1F1B crossing: stage 0 sends
activation k+1 while stage 1 sends gradient k). The calls are built so that cannot happen:

1. A call is posted where its first action stands in the schedule; nothing is posted early.
2. A send and the receive right after it, on the same boundary (forward-send with
   backward-receive upstream, backward-send with forward-receive downstream), share one call,
   provided the stage across the boundary has the mirror pair side by side too. Both sides of a
   boundary therefore post the same messages, grouped the same way, in the same order (Megatron's
   ``send_forward_recv_backward`` / ``send_backward_recv_forward``; NVIDIA/nccl#783). Weight-
   gradient work (zero-bubble schedules) between the two does not part them: it posts and waits
   for nothing, so it runs while the fused call is in flight.
3. Every peer of a boundary (uneven widths) is inside the same call (bundle.engine.transport).

1F1B, S=2, M=3 (``|`` separates calls; compute between them not drawn)::

    stage 0:  send_act0 | send_act1+recv_grad0 | send_act2+recv_grad1 | recv_grad2
    stage 1:  recv_act0 | send_grad0+recv_act1 | send_grad1+recv_act2 | send_grad2

``replay`` runs the calls of every rank through a model of NCCL's streams and reports whether
they all complete: the pure check behind the tests of every shape, schedule and M, and the same
model that ``--backend nccl-emu`` enforces at run time (bundle.collectives.nccl_emu).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from bundle.ir.rounds import lockstep
from bundle.ir.schedule import COMPUTE, REGISTRY, Action, Op, Pipe, actions, unknown
from bundle.topology import Topology, Transfer

SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
RECVS = (Op.RECV_ACT, Op.RECV_GRAD)
COMM = SENDS + RECVS
# The stage across the boundary an action uses: +1 for the next stage, -1 for the previous one.
SIDE = {Op.SEND_ACT: 1, Op.RECV_GRAD: 1, Op.RECV_ACT: -1, Op.SEND_GRAD: -1}
# The same message seen from the stage across the boundary.
MIRROR = {
    Op.SEND_ACT: Op.RECV_ACT,
    Op.RECV_ACT: Op.SEND_ACT,
    Op.SEND_GRAD: Op.RECV_GRAD,
    Op.RECV_GRAD: Op.SEND_GRAD,
}


@dataclass(frozen=True)
class Call:
    """Communication actions of one stage posted together, as one ``batch_isend_irecv``."""

    ops: tuple[Action, ...]

    def __repr__(self) -> str:
        return "+".join(map(repr, self.ops))


def peer(a: Action, stage: int, pipe: Pipe | int) -> tuple[int, int]:
    """(stage, chunk) across the boundary a communication action uses: the next piece's or the
    previous one's (``pipe``: where the pieces run; a number of stages: one chunk each)."""
    pipe = pipe if isinstance(pipe, Pipe) else Pipe(pipe)
    return pipe.place(pipe.piece(stage, a.chunk) + SIDE[a.op])


def _send_then_recv(a: Action, b: Action, stage: int, num_stages: int) -> bool:
    """A send followed by a receive with the same peer stage (NCCL matches per pair of ranks)."""
    return (
        a.op in SENDS
        and b.op in RECVS
        and peer(a, stage, num_stages)[0] == peer(b, stage, num_stages)[0]
    )


def _adjacent_pairs(
    acts: Sequence[Action], stage: int, num_stages: int
) -> set[tuple[Action, Action]]:
    """(send, receive) pairs with one peer stage and nothing between them in the schedule but
    weight-gradient work, which neither sends nor waits (its stream holds the same calls)."""
    acts = [a for a in acts if a.op is not Op.BACKWARD_WEIGHT]
    return {
        (a, b)
        for a, b in zip(acts, acts[1:], strict=False)
        if _send_then_recv(a, b, stage, num_stages)
    }


# What a stage before the first that trains does without (and that one, of its input: SEND_GRAD).
_NO_GRADIENT = frozenset(
    {Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.SEND_GRAD, Op.RECV_GRAD}
)


def without_gradients(acts: list[Action], stage: int, frozen: int) -> list[Action]:
    """``acts`` of ``stage`` when the first ``frozen`` stages have nothing to train (a frozen
    embedding before a LoRA model's adapters): no gradient flows into them, so they run no
    backward and neither receive a gradient nor send one, and stage ``frozen``, whose input needs
    no gradient, sends none back. Both sides of each boundary drop the same messages."""
    if stage < frozen:
        return [a for a in acts if a.op not in _NO_GRADIENT]
    if stage == frozen:
        return [a for a in acts if a.op is not Op.SEND_GRAD]
    return acts


def stage_calls(
    schedule: str, stage: int, num_stages: int, micro_batches: int, *, frozen: int = 0
) -> tuple[list[Action], list[Call]]:
    """The stage's action list and its calls, in the order they are posted (one chunk per
    stage; several post in rounds, bundle.ir.rounds); ``frozen``: the leading stages that get
    no gradient (bundle.ir.schedule.without_gradients)."""
    S = num_stages
    acts = [without_gradients(actions(schedule, s, S, micro_batches), s, frozen) for s in range(S)]
    mine = acts[stage]
    for a in mine:
        if a.op not in COMM and a.op not in COMPUTE:
            raise unknown(a, "the NCCL plan")
    pairs: dict[int, set[tuple[Action, Action]]] = {}

    def fused(send: Action, recv: Action) -> bool:
        # Across the boundary the same two messages are recv' and send'; fused only if that
        # stage has send' right before recv' too, so both sides group them alike.
        other, send_chunk = peer(send, stage, S)
        recv_chunk = peer(recv, stage, S)[1]
        if other not in pairs:
            pairs[other] = _adjacent_pairs(acts[other], other, S)
        theirs = (
            Action(MIRROR[recv.op], recv.micro, recv_chunk),
            Action(MIRROR[send.op], send.micro, send_chunk),
        )
        return theirs in pairs[other]

    calls: list[Call] = []
    comm = [a for a in mine if a.op is not Op.BACKWARD_WEIGHT]
    i = 0
    while i < len(comm):
        a = comm[i]
        if a.op not in COMM:
            i += 1
            continue
        nxt = comm[i + 1] if i + 1 < len(comm) else None
        if nxt is not None and _send_then_recv(a, nxt, stage, S) and fused(a, nxt):
            calls.append(Call((a, nxt)))
            i += 2
        else:
            calls.append(Call((a,)))
            i += 1
    return mine, calls


def calls(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[Call]:
    """The calls one stage posts in a step, in order (one chunk per stage)."""
    return stage_calls(schedule, stage, num_stages, micro_batches)[1]


@dataclass(frozen=True)
class StepPlan:
    """What one stage does in a step: its actions, its calls, and where each call is posted.

    ``post_at[i]`` lists the calls posted as action ``i`` begins; ``call_of[i]`` is the call
    action ``i`` belongs to (-1 for compute). A receive waits for its call where it stands.
    """

    actions: tuple[Action, ...]
    calls: tuple[Call, ...]
    post_at: tuple[tuple[int, ...], ...]
    call_of: tuple[int, ...]
    # Each receive's buffer slot where the plan chooses them (several chunks: bundle.ir.rounds);
    # empty: the engine rotates buffers by micro-batch.
    slots: dict[Action, int] = field(default_factory=dict)


def step_plan(
    schedule: str,
    stage: int,
    num_stages: int,
    micro_batches: int,
    *,
    chunks: int = 1,
    early_receives: bool = False,
    frozen: int = 0,
) -> StepPlan:
    """The stage's step: NCCL's calls (``stage_calls``, each posted where its first action stands),
    or with ``early_receives`` gloo's: every action its own call, a receive posted as the step
    begins (the first of its kind) or as soon as the one before it arrived, so its data moves
    while the stage computes. gloo progresses each operation on its own, so that order is safe
    there and saves a round trip per message; under NCCL's ordering it deadlocks (``replay``).
    With several chunks per stage, the calls are posted in lockstep rounds on every backend
    (bundle.ir.rounds). ``frozen``: the leading stages with nothing to train, which get no
    gradient (one chunk per stage; with several, every stage runs its whole schedule).
    """
    if chunks > 1:
        mine, ops, posts, slots = lockstep(schedule, stage, num_stages, micro_batches, chunks)
        where = {a: n for n, c in enumerate(ops) for a in c}
        return StepPlan(
            tuple(mine),
            tuple(Call(c) for c in ops),
            tuple(tuple(p) for p in posts),
            tuple(where.get(a, -1) for a in mine),
            slots,
        )
    acts, cs = stage_calls(schedule, stage, num_stages, micro_batches, frozen=frozen)
    if early_receives:
        cs = [Call((a,)) for a in acts if a.op in COMM]
    index = {a: n for n, c in enumerate(cs) for a in c.ops}
    post: list[list[int]] = [[] for _ in acts]
    last_wait: dict[Op, int] = {}  # the action that waited for the previous receive of a kind
    for i, a in enumerate(acts):
        if a.op not in COMM:
            continue
        c = index[a]
        if early_receives and a.op in RECVS:
            post[last_wait[a.op] + 1 if a.op in last_wait else 0].append(c)
            last_wait[a.op] = i
        elif cs[c].ops[0] == a:
            post[i].append(c)
    return StepPlan(
        tuple(acts),
        tuple(cs),
        tuple(tuple(p) for p in post),
        tuple(index.get(a, -1) for a in acts),
    )


def boundary_peers(
    topo: Topology,
    bundle: int,
    stage: int,
    replica: int,
    side: int,
    rows: int,
    *,
    chunk: int = 0,
    pipe: Pipe | None = None,
) -> tuple[tuple[Transfer, int], ...]:
    """(rows to move, peer rank) for every peer of one replica across one boundary of a micro-batch
    of ``rows`` rows; ``side`` is +1 for the next piece, -1 for the previous one (the replica runs
    its ``chunk``: a piece of ``pipe``, by default one chunk per stage)."""
    pipe = pipe or Pipe(topo.num_stages)
    piece = pipe.piece(stage, chunk)
    if not pipe.crosses(piece, side):
        return ()
    other = pipe.place(piece + side)[0]
    if side > 0:
        plan = topo.transfers(stage, other, rows, by_src=True)[replica]
        return tuple((t, topo.rank(bundle, other, t.dst)) for t in plan)
    plan = topo.transfers(other, stage, rows, by_src=False)[replica]
    return tuple((t, topo.rank(bundle, other, t.src)) for t in plan)


# -- the model of NCCL's streams ------------------------------------------------------------------

# One message of a rank's call: (kind, peer, bytes); the n-th send from a to b matches the n-th
# receive at b from a, as NCCL matches point-to-point operations of one communicator.
Msg = tuple[str, int, int]
# A rank's program: ("post", [Msg, ...]) puts a call on its stream; ("wait", i) blocks the rank
# (its compute) until its i-th posted call completed.
Step = tuple[str, object]


def replay(programs: dict[int, list[Step]], eager_bytes: int = 0) -> list[str]:
    """Run every rank's program through NCCL's ordering; the stuck operations, or [] if done.

    Model: one in-order stream per rank (its calls on one communicator); a call starts when the
    previous one completed; the operations of a running call progress together; a send completes
    only while its matching receive's call runs, unless it has at most ``eager_bytes`` bytes; a
    receive completes once its send ran.
    """
    streams = _Streams(programs, eager_bytes)
    progress = True
    while progress:
        progress = any([streams.compute(r) for r in programs])  # every rank, each time
        streams.mark_running()
        progress = any([streams.advance(r) for r in programs]) or progress
    return streams.stuck()


class _Streams:
    """The state of ``replay``: each rank's program counter, posted calls and running call."""

    def __init__(self, programs: dict[int, list[Step]], eager_bytes: int) -> None:
        self.programs, self.eager_bytes = programs, eager_bytes
        self.pc = dict.fromkeys(programs, 0)
        self.posted: dict[int, list[list[Msg]]] = {r: [] for r in programs}
        self.head = dict.fromkeys(programs, 0)  # index of the running call on each rank's stream
        self.done: dict[int, list[set[int]]] = {r: [] for r in programs}  # completed ops per call
        self.seq: dict[tuple[int, int, str], int] = {}
        # (src, dst, n) of every op: the n-th message from src to dst.
        self.ids: dict[int, list[list[tuple[int, int, int]]]] = {r: [] for r in programs}
        self.ran: set[tuple[int, int, int, str]] = set()  # messages whose call started, by side

    def compute(self, r: int) -> bool:
        """Rank ``r``'s compute posts calls until it waits for one still on its stream."""
        prog, moved = self.programs[r], False
        while self.pc[r] < len(prog):
            kind, arg = prog[self.pc[r]]
            if kind == "post":
                self._post(r, cast(list[Msg], arg))
            elif self.head[r] <= cast(int, arg):
                break  # waiting for a call still on the stream
            self.pc[r] += 1
            moved = True
        return moved

    def _post(self, r: int, msgs: list[Msg]) -> None:
        keys = []
        for op, peer, _ in msgs:
            src, dst = (r, peer) if op == "send" else (peer, r)
            n = self.seq.get((src, dst, op), 0)
            self.seq[(src, dst, op)] = n + 1
            keys.append((src, dst, n))
        self.posted[r].append(list(msgs))
        self.ids[r].append(keys)
        self.done[r].append(set())

    def mark_running(self) -> None:
        """The running calls mark their operations as started."""
        for r in self.programs:
            h = self.head[r]
            if h < len(self.posted[r]):
                for (op, _, _), key in zip(self.posted[r][h], self.ids[r][h], strict=True):
                    self.ran.add((*key, op))

    def advance(self, r: int) -> bool:
        """The operations of rank ``r``'s running call progress together; whether any did."""
        h = self.head[r]
        if h >= len(self.posted[r]):
            return False
        moved = False
        for j, ((op, _, size), key) in enumerate(
            zip(self.posted[r][h], self.ids[r][h], strict=True)
        ):
            other = "recv" if op == "send" else "send"
            if j not in self.done[r][h] and (
                (*key, other) in self.ran or (op == "send" and size <= self.eager_bytes)
            ):
                self.done[r][h].add(j)
                moved = True
        if len(self.done[r][h]) == len(self.posted[r][h]):
            self.head[r] += 1
            moved = True
        return moved

    def stuck(self) -> list[str]:
        out = []
        for r, prog in self.programs.items():
            h = self.head[r]
            if h < len(self.posted[r]):
                waiting = [
                    f"{op} {'to' if op == 'send' else 'from'} rank {peer}"
                    for j, (op, peer, _) in enumerate(self.posted[r][h])
                    if j not in self.done[r][h]
                ]
                out.append(f"rank {r}: call {h} stuck on {', '.join(waiting)}")
            elif self.pc[r] < len(prog):
                out.append(f"rank {r}: stopped at step {self.pc[r]} of its program")
        return out


def programs(
    topo: Topology,
    schedule: str,
    *,
    chunks: int = 1,
    early_receives: bool = False,
    row_bytes: int = 1,
    frozen: int = 0,
) -> dict[int, list[Step]]:
    """Every rank's calls and waits in one training step, as the engine posts them.

    A receive is waited for where its action stands; every call has completed by the end of the
    step (the engine waits for its sends before the gradient sync).
    """
    progs: dict[int, list[Step]] = {}
    pipe = REGISTRY[schedule].pipe(topo.num_stages, chunks)
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        plan = step_plan(
            schedule,
            c.stage,
            topo.num_stages,
            topo.micro_batches,
            chunks=chunks,
            early_receives=early_receives,
            frozen=frozen,
        )
        sizes = topo.micro_sizes(c.bundle)
        prog: list[Step] = []
        order: dict[int, int] = {}  # call -> its place on the stream
        for i, a in enumerate(plan.actions):
            for n in plan.post_at[i]:
                order[n] = len(order)
                msgs: list[Msg] = [
                    ("send" if op.op in SENDS else "recv", other, (t.stop - t.start) * row_bytes)
                    for op in plan.calls[n].ops
                    for t, other in boundary_peers(
                        topo,
                        c.bundle,
                        c.stage,
                        c.replica,
                        SIDE[op.op],
                        sizes[op.micro],
                        chunk=op.chunk,
                        pipe=pipe,
                    )
                ]
                prog.append(("post", msgs))
            if a.op in RECVS:
                prog.append(("wait", order[plan.call_of[i]]))
        prog += [("wait", n) for n in range(len(order))]
        progs[rank] = prog
    return progs
