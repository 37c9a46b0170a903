"""The calls of stages that run several model chunks (interleaving), posted in lockstep rounds.

With one chunk per stage, a stage's calls pair up with its neighbours' by fusing a send with the
receive after it (bundle.ir.p2p). With V chunks per stage the pieces wrap around the stages
(piece j on stage j mod S), so a stage sends to and receives from the same neighbour for several
pieces at once, in orders that differ on the two sides: NCCL's in-order streams deadlock on most
such plans (``p2p.replay`` finds them for every M >= 3).

So the calls are built from one global clock instead. Every stage runs its computes in schedule
order, each in the first round in which what it needs was computed in an earlier round (F = B = 1;
only the order matters, not the times). A message is posted by both of its sides in the call of
the round its sender computed it: the sender right after that compute, the receiver as soon as it
has run its computes up to that round, before it waits for anything later. Each round's calls
therefore match only each other, and they complete in round order on every stream, whatever the
real times are (Megatron's interleaved schedule posts its fused send-and-receive calls in the
same lockstep). Inside a call, the messages between two ranks are listed in one canonical order
on both sides (activations before gradients, by boundary and micro-batch): NCCL matches the n-th
send with the n-th receive.

A message can arrive long before its compute, so receive buffers are not rotated by micro-batch:
each receive gets the lowest buffer slot of its kind that no live micro-batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from bundle.errors import ScheduleError
from bundle.ir.schedule import COMPUTE, REGISTRY, Action, Op, Pipe, actions, unknown

# The compute whose result a message carries (its sender's) and the one that consumes it.
_MADE_BY = {Op.SEND_ACT: Op.FORWARD, Op.SEND_GRAD: Op.BACKWARD}
_KIND = {Op.SEND_ACT: 0, Op.RECV_ACT: 0, Op.SEND_GRAD: 1, Op.RECV_GRAD: 1}


def _key(a: Action, stage: int, pipe: Pipe) -> tuple[str, int, int]:
    """A compute as the global clock knows it: (F or B, piece, micro-batch)."""
    kind = "F" if a.op is Op.FORWARD else "B" if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) else "W"
    return kind, pipe.piece(stage, a.chunk), a.micro


def _needs(a: Action, stage: int, pipe: Pipe) -> list[tuple[str, int, int]]:
    """What a compute waits for: the piece before's forward, the piece after's backward."""
    kind, j, k = _key(a, stage, pipe)
    if kind == "F":
        return [("F", j - 1, k)] if j > 0 else []
    if kind == "B":
        return [("B", j + 1, k)] if j < pipe.pieces - 1 else []
    return []


Clock = dict[tuple[str, int, int], int]  # (F|B|W, piece, micro-batch) -> round


def clock(lists: Sequence[Sequence[Action]], pipe: Pipe) -> Clock:
    """The round of every compute of every stage."""
    num_stages = pipe.stages
    computes = [[a for a in acts if a.op in COMPUTE] for acts in lists]
    done: Clock = {}
    pc, t = [0] * num_stages, 0
    while any(pc[s] < len(computes[s]) for s in range(num_stages)):
        ran = []
        for s in range(num_stages):
            if pc[s] < len(computes[s]):
                a = computes[s][pc[s]]
                if all(done.get(n, t) < t for n in _needs(a, s, pipe)):
                    ran.append(_key(a, s, pipe))
                    pc[s] += 1
        if not ran:
            raise ScheduleError(f"the schedule deadlocks at round {t}: stages wait on each other")
        done.update(dict.fromkeys(ran, t))
        t += 1
    return done


def _sent_in(a: Action, stage: int, pipe: Pipe, rounds: Clock) -> int:
    """The round in which the message of a communication action is computed by its sender."""
    j = pipe.piece(stage, a.chunk)
    if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
        return rounds["F" if _MADE_BY[a.op] is Op.FORWARD else "B", j, a.micro]
    if a.op is Op.RECV_ACT:
        return rounds["F", j - 1, a.micro]
    return rounds["B", j + 1, a.micro]


def _canonical(a: Action, stage: int, pipe: Pipe) -> tuple[int, int, int]:
    """The same key on both sides of a message: (activation or gradient, boundary, micro-batch)."""
    j = pipe.piece(stage, a.chunk)
    boundary = j if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else j - 1
    return _KIND[a.op], boundary, a.micro


def lockstep(
    schedule: str, stage: int, num_stages: int, micro_batches: int, chunks: int
) -> tuple[list[Action], list[tuple[Action, ...]], list[list[int]], dict[Action, int]]:
    """One stage's actions, its calls, where each call is posted (per action: the calls posted as
    it begins) and each receive's buffer slot."""
    S, pipe = num_stages, REGISTRY[schedule].pipe(num_stages, chunks)
    lists = [actions(schedule, s, S, micro_batches, chunks) for s in range(S)]
    rounds = clock(lists, pipe)
    mine = lists[stage]
    comm = []
    for a in mine:
        if a.op in _KIND:
            comm.append(a)
        elif a.op not in COMPUTE:
            raise unknown(a, "the NCCL plan")
    comm.sort(key=lambda a: (_sent_in(a, stage, pipe, rounds), *_canonical(a, stage, pipe)))
    calls = [
        (t, tuple(group))
        for t, group in groupby(comm, key=lambda a: _sent_in(a, stage, pipe, rounds))
    ]
    # A round's call is posted right after the stage's last compute of that round or before.
    ran = [(i, rounds[_key(a, stage, pipe)]) for i, a in enumerate(mine) if a.op in COMPUTE]
    post: list[list[int]] = [[] for _ in mine]
    for n, (t, _) in enumerate(calls):
        at = max((i + 1 for i, r in ran if r <= t), default=0)
        post[at].append(n)
    return mine, [ops for _, ops in calls], post, _slots(mine, calls, post)


def _slots(
    mine: list[Action], calls: list[tuple[int, tuple[Action, ...]]], post: list[list[int]]
) -> dict[Action, int]:
    """Each receive's buffer slot: the lowest of its kind (operation, chunk) free when its call
    is posted; a buffer is free once the backward of the micro-batch it held has run."""
    posted_at = {n: i for i, ns in enumerate(post) for n in ns}
    released = {
        (a.micro, a.chunk): i
        for i, a in enumerate(mine)
        if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)
    }
    recvs = sorted(
        (
            (posted_at[n], a)
            for n, (_, ops) in enumerate(calls)
            for a in ops
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD)
        ),
        key=lambda p: p[0],
    )
    held: dict[tuple[Op, int], list[int]] = {}  # per kind: the release index of each slot
    slots: dict[Action, int] = {}
    for at, a in recvs:
        kind = held.setdefault((a.op, a.chunk), [])
        free = next((n for n, until in enumerate(kind) if until < at), len(kind))
        until = released[a.micro, a.chunk]
        if free == len(kind):
            kind.append(until)
        else:
            kind[free] = until
        slots[a] = free
    return slots
