"""Pipeline schedules as pure generators of actions, one list per stage (tested as literal data).

Each stage runs its own list; communication actions pair up across neighbouring stages because
both sides list them in the same micro-batch order. Receives are posted early by the engine, so
a ``RECV_*`` action means "wait for it here".

GPipe, S=2, M=3 (F = forward, B = backward)::

    stage 0:  F0 F1 F2 .  .  .  B0 B1 B2
    stage 1:  .  F0 F1 F2 B0 B1 B2

1F1B, S=2, M=3 (at most S micro-batches in flight on stage 0)::

    stage 0:  F0 F1 .  B0 F2 B1 .  B2
    stage 1:  .  F0 B0 F1 B1 F2 B2

ZB-H1 (Zero Bubble, H1), S=2, M=3: 1F1B's order with each backward split into its input-gradient
half (I, which the stage upstream waits for) and its weight-gradient half (W, which nobody waits
for); stage s defers its first s W's, so they fill the waits of the cool-down (compute units
F = I = W = 1, so a 1F1B backward is 2: 10 units against 1F1B's 12)::

    stage 0:  F0 F1 .  I0 W0 F2 I1 W1 I2 W2
    stage 1:  .  F0 I0 F1 I1 W0 F2 I2 W1 W2

Interleaved 1F1B (Megatron's, torch's ``ScheduleInterleaved1F1B``) with V model chunks per stage:
the model is cut into S x V pieces and piece j runs on stage j mod S as its chunk j // S (the
looped placement), so each stage's bubble shrinks V-fold. S=2, V=2, M=2 (``F0'`` is micro-batch
0 in chunk 1; pieces 0, 1, 2, 3 on stages 0, 1, 0, 1; F = B = 1 here)::

    stage 0:  F0 F1 F0' F1' .   B0' .   B1' B0 B1
    stage 1:  .  F0 F1  F0' B0' F1' B1' B0  B1

An action names its chunk; with V = 1 every chunk is 0 and nothing else changes.

Schedules are a registry (``REGISTRY``: name -> ``Schedule``): the engine, the NCCL plan
(bundle.ir.p2p), the planner's simulator and memory model, ``make gpu-check`` and the tests
all read it, and every one of them raises on an operation it does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

from bundle.errors import ScheduleError


class Op(Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    # A backward split in two (zero-bubble schedules): the gradient of the stage's inputs, sent
    # upstream at once, and later the gradient of its weights from what the first half kept.
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"


# Compute operations; the others are communication (bundle.ir.p2p.COMM).
COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
# The operation after which a micro-batch's activations are no longer held.
RELEASES = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Action:
    op: Op
    micro: int
    chunk: int = 0  # the stage's model chunk (its piece chunk x S + stage); 0 without interleaving

    def __repr__(self) -> str:
        return f"{self.op.value}{self.micro}" + (f"c{self.chunk}" if self.chunk else "")


def _check(stage: int, num_stages: int, micro_batches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage (got {num_stages})")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if micro_batches < 1:
        raise ScheduleError(f"micro-batches must be >= 1 (got {micro_batches})")


@dataclass(frozen=True)
class Pipe:
    """Where the model's S x V pieces run: piece j as chunk c of stage s.

    ``looped`` (interleaved 1F1B): piece j on stage j mod S, chunk j // S; every boundary crosses
    stages. ``v`` (ZBV, V = 2): down the stages, then back up: chunk 0 of stage s is piece s,
    chunk 1 is piece 2S - 1 - s, so the turn (pieces S - 1 and S) stays on the last stage.
    """

    stages: int
    chunks: int = 1
    shape: str = "looped"

    @property
    def pieces(self) -> int:
        return self.stages * self.chunks

    def piece(self, stage: int, chunk: int) -> int:
        if self.shape == "v" and chunk % 2:
            return (chunk + 1) * self.stages - 1 - stage
        return chunk * self.stages + stage

    def place(self, piece: int) -> tuple[int, int]:
        """(stage, chunk) of a piece."""
        chunk, at = divmod(piece, self.stages)
        if self.shape == "v" and chunk % 2:
            return self.stages - 1 - at, chunk
        return at, chunk

    def crosses(self, piece: int, side: int) -> bool:
        """Whether the boundary on ``side`` of a piece is a message to another stage (not the
        first piece's input, the last one's output, or a turn that stays on one stage)."""
        there = piece + side
        if not 0 <= there < self.pieces:
            return False
        return self.place(there)[0] != self.place(piece)[0]


def _forward(
    stage: int, num_stages: int, k: int, chunk: int = 0, pipe: Pipe | None = None
) -> Iterator[Action]:
    """Micro-batch k's forward through the stage's ``chunk`` (its piece of ``pipe``)."""
    pipe = pipe or Pipe(num_stages)
    piece = pipe.piece(stage, chunk)
    if pipe.crosses(piece, -1):
        yield Action(Op.RECV_ACT, k, chunk)
    yield Action(Op.FORWARD, k, chunk)
    if pipe.crosses(piece, 1):
        yield Action(Op.SEND_ACT, k, chunk)


def _backward(
    stage: int,
    num_stages: int,
    k: int,
    op: Op = Op.BACKWARD,
    chunk: int = 0,
    pipe: Pipe | None = None,
) -> Iterator[Action]:
    pipe = pipe or Pipe(num_stages)
    piece = pipe.piece(stage, chunk)
    if pipe.crosses(piece, 1):
        yield Action(Op.RECV_GRAD, k, chunk)
    yield Action(op, k, chunk)
    if pipe.crosses(piece, -1):
        yield Action(Op.SEND_GRAD, k, chunk)


def gpipe(stage: int, num_stages: int, micro_batches: int) -> Iterator[Action]:
    """Fill-drain: every forward, then every backward; M micro-batches of activations in flight."""
    _check(stage, num_stages, micro_batches)
    for k in range(micro_batches):
        yield from _forward(stage, num_stages, k)
    for k in range(micro_batches):
        yield from _backward(stage, num_stages, k)


def one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> Iterator[Action]:
    """1F1B: ``S - s - 1`` warm-up forwards, then alternate; at most ``S - s`` in flight.

    With fewer micro-batches than stages the warm-up takes them all and 1F1B becomes GPipe.
    """
    _check(stage, num_stages, micro_batches)
    warmup = min(num_stages - stage - 1, micro_batches)
    for k in range(warmup):
        yield from _forward(stage, num_stages, k)
    for k in range(micro_batches - warmup):
        yield from _forward(stage, num_stages, warmup + k)
        yield from _backward(stage, num_stages, k)
    for k in range(micro_batches - warmup, micro_batches):
        yield from _backward(stage, num_stages, k)


def zb_h1(stage: int, num_stages: int, micro_batches: int) -> Iterator[Action]:
    """Zero Bubble H1: 1F1B's forwards and input-gradient halves, the weight-gradient halves
    deferred to fill the waits (as torch.distributed.pipelining's zero-bubble schedules place them).

    Stage s runs its W's in micro-batch order, the first one after its (s+1)-th I, then one after
    every I, and the rest at the end; a micro-batch's activations are held until its W, so every
    stage holds at most S micro-batches (1F1B's peak, which only its first stage reaches). The first stage's inputs need no gradient: its I is empty and its W is the
    whole backward (bundle.engine.split_backward).
    """
    _check(stage, num_stages, micro_batches)
    warmup = min(num_stages - stage - 1, micro_batches)
    weights = iter(range(micro_batches))
    done = 0  # I's so far

    def backward(k: int) -> Iterator[Action]:
        nonlocal done
        yield from _backward(stage, num_stages, k, Op.BACKWARD_INPUT)
        done += 1
        if done > stage:
            yield Action(Op.BACKWARD_WEIGHT, next(weights))

    for k in range(warmup):
        yield from _forward(stage, num_stages, k)
    for k in range(micro_batches - warmup):
        yield from _forward(stage, num_stages, warmup + k)
        yield from backward(k)
    for k in range(micro_batches - warmup, micro_batches):
        yield from backward(k)
    for k in weights:
        yield Action(Op.BACKWARD_WEIGHT, k)


def interleaved_1f1b(
    stage: int, num_stages: int, micro_batches: int, chunks: int
) -> Iterator[Action]:
    """Interleaved 1F1B over ``chunks`` pieces per stage, placed looped (piece j on stage j mod S).

    torch.distributed.pipelining's order (``ScheduleInterleaved1F1B``, Megatron's with its
    ``M % S`` rule relaxed): micro-batches go through the chunks in rounds of R = M / max(1, M // S)
    (depth first: R forwards in chunk 0, R in chunk 1, ...; backwards from the last chunk);
    stage s warms up with ``(V-1) R + 2 (S-1-s)`` forwards, then alternates one forward and one
    backward. Each chunk's forwards and backwards run its micro-batches in order.
    """
    _check(stage, num_stages, micro_batches)
    if chunks < 2:
        raise ScheduleError(f"interleaving needs at least 2 chunks per stage (got {chunks})")
    S, M, V = num_stages, micro_batches, chunks
    rounds = max(1, M // S)
    if M % rounds:
        raise ScheduleError(
            f"interleaved 1F1B runs micro-batches in rounds: {M} micro-batches on {S} stages "
            f"need a multiple of {rounds} (e.g. {M - M % rounds} or {M + rounds - M % rounds})"
        )
    per_round, total, pipe = M // rounds, M * V, Pipe(S, V)
    warmup = min((V - 1) * per_round + 2 * (S - 1 - stage), total)
    forwards, backwards = [0] * V, [0] * V

    def forward(i: int) -> Iterator[Action]:
        c = (i // per_round) % V
        forwards[c] += 1
        yield from _forward(stage, S, forwards[c] - 1, c, pipe)

    def backward(i: int) -> Iterator[Action]:
        c = V - 1 - (i // per_round) % V
        backwards[c] += 1
        yield from _backward(stage, S, backwards[c] - 1, Op.BACKWARD, c, pipe)

    for i in range(warmup):
        yield from forward(i)
    for i in range(total - warmup):
        yield from forward(warmup + i)
        yield from backward(i)
    for i in range(total - warmup, total):
        yield from backward(i)


_F, _I, _W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def _zbv_order(stage: int, num_stages: int, micro_batches: int) -> list[tuple[Op, int]]:
    """ZBV's computes on one stage, as (operation, chunk), in torch's order."""
    S, M = num_stages, micro_batches
    order: list[tuple[Op, int]] = [(_F, 0)] * (2 * (S - stage) - 1)
    order += [(_F, 1), (_F, 0)] * stage
    order += [(_F, 1), (_I, 1), (_W, 1)] * (S - stage)
    forwards = [order.count((_F, 0)), order.count((_F, 1))]
    while forwards[1] < forwards[0] or forwards[0] < M:
        if forwards[0] < M:
            order.append((_F, 0))
            forwards[0] += 1
        order += [(_I, 0), (_W, 0), (_F, 1), (_I, 1), (_W, 1)]
        forwards[1] += 1
    order += [(_I, 0), (_I, 1)] * stage
    order += [(_I, 0), (_W, 0)] * (S - stage)
    for c in (1, 0):  # the weight halves left, chunk 1's first
        order += [(_W, c)] * (order.count((_I, c)) - order.count((_W, c)))
    return order


def zbv(stage: int, num_stages: int, micro_batches: int, chunks: int) -> Iterator[Action]:
    """ZBV (Zero Bubble, V placement; torch's ``ScheduleZBVZeroBubble``): two chunks per stage
    placed as a V, every backward split into I and W.

    Stage s warms up with 2(S-s)-1 forwards of chunk 0, then s pairs of chunk-1 and chunk-0
    forwards, then S-s rounds of chunk 1's F, I, W; in the steady state each chunk runs F, I, W
    in turn; the cool-down runs the remaining I's and fills with the W's. It needs M >= 2S - 1.
    """
    _check(stage, num_stages, micro_batches)
    S, M = num_stages, micro_batches
    if chunks != 2:
        raise ScheduleError(f"ZBV runs exactly 2 chunks per stage (got {chunks})")
    if M < 2 * S - 1:
        raise ScheduleError(f"ZBV on {S} stages needs at least {2 * S - 1} micro-batches (got {M})")
    pipe = Pipe(S, 2, "v")
    count = dict.fromkeys(((op, c) for op in (_F, _I, _W) for c in (0, 1)), 0)
    for op, c in _zbv_order(stage, S, M):
        k = count[op, c]
        count[op, c] += 1
        if op is _F:
            yield from _forward(stage, S, k, c, pipe)
        elif op is _I:
            yield from _backward(stage, S, k, op, c, pipe)
        else:
            yield Action(op, k, c)


@dataclass(frozen=True)
class Schedule:
    """A registered schedule: its generator of one stage's actions, and what it needs."""

    name: str
    # (stage, S, M) -> actions; with ``chunks``, (stage, S, M, V).
    generate: Callable[..., Iterator[Action]]
    # Its backwards are split into input- and weight-gradient halves (I and W).
    split_backward: bool = False
    # It runs V >= 2 model chunks per stage (--virtual-stages); the others run one.
    chunks: bool = False
    # Where its pieces run (``Pipe.shape``), and the one number of chunks it runs (0: any >= 2).
    placement: str = "looped"
    fixed_chunks: int = 0

    def pipe(self, num_stages: int, chunks: int = 1) -> Pipe:
        return Pipe(num_stages, chunks, self.placement)

    # The share of a step a stage waits with equal stages (S, M), and its formula: 1F1B's
    # (S-1)/(M+S-1); a split backward's with F = I = W, the B = 2F of most layers.
    bubble_formula: str = "(S-1)/(M+S-1)"

    def bubble(self, num_stages: int, micro_batches: int, chunks: int = 1) -> float:
        S, M, V = num_stages, micro_batches, chunks
        if self.split_backward:  # (S-1)(F+I-W) over M(F+B) + (S-1)(F+I-W), per chunk
            return (S - 1) / (3 * V * M + S - 1)
        # Interleaving: each of the S-1 waits is one chunk's work, 1/V of a stage's.
        return (S - 1) / (V * M + S - 1)

    def check_chunks(self, chunks: int) -> None:
        """Refuse a number of chunks per stage this schedule cannot run, in one line."""
        if self.chunks and chunks < 2 and not self.fixed_chunks:
            raise ScheduleError(
                f"--schedule {self.name} runs several model chunks per stage: "
                f"give --virtual-stages 2 or more (got {chunks})"
            )
        if self.fixed_chunks and chunks != self.fixed_chunks:
            raise ScheduleError(
                f"--schedule {self.name} runs exactly {self.fixed_chunks} model chunks per stage "
                f"(--virtual-stages {self.fixed_chunks}, got {chunks})"
            )
        if not self.chunks and chunks != 1:
            with_chunks = ", ".join(n for n, s in REGISTRY.items() if s.chunks)
            raise ScheduleError(
                f"--schedule {self.name} runs one model chunk per stage (--virtual-stages 1, "
                f"got {chunks}); {with_chunks} run several"
            )


REGISTRY: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", gpipe),
        Schedule("1f1b", one_f_one_b),
        Schedule("zb-h1", zb_h1, split_backward=True, bubble_formula="(S-1)/(3M+S-1)"),
        Schedule(
            "interleaved-1f1b", interleaved_1f1b, chunks=True, bubble_formula="(S-1)/(VM+S-1)"
        ),
        Schedule(
            "zbv",
            zbv,
            split_backward=True,
            chunks=True,
            placement="v",
            fixed_chunks=2,
            bubble_formula="(S-1)/(6M+S-1)",
        ),
    )
}
SCHEDULES = tuple(REGISTRY)
# What the planner searches and the benchmarks pair with torch's: one chunk per stage (the
# planner does not model interleaving yet: docs/planner.md).
ONE_CHUNK = tuple(n for n, s in REGISTRY.items() if not s.chunks)


def actions(
    name: str, stage: int, num_stages: int, micro_batches: int, chunks: int = 1
) -> list[Action]:
    """The action list of one stage for the schedule called ``name``, with ``chunks`` model
    chunks per stage (``--virtual-stages``)."""
    if name not in REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    sched = REGISTRY[name]
    sched.check_chunks(chunks)
    if sched.chunks:
        return list(sched.generate(stage, num_stages, micro_batches, chunks))
    return list(sched.generate(stage, num_stages, micro_batches))


def unknown(a: Action, where: str) -> ScheduleError:
    """The error of a dispatch that met an operation it does not run."""
    return ScheduleError(f"{where} cannot run {a!r} (operation {a.op.value!r})")


def peak_in_flight(acts: list[Action]) -> int:
    """Most micro-batches (of any chunk) whose forward ran and whose backward (its weight half,
    when split) has not: the activations held."""
    live = peak = 0
    for a in acts:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op in RELEASES:
            live -= 1
    return peak


def backward_follows_forward(acts: list[Action], chunk: int = 0) -> set[int]:
    """Micro-batches of ``chunk`` whose backward is the stage's next compute after their forward.

    Their activations never coexist with another micro-batch's, so recomputing them would rebuild
    at the backward exactly what keeping them holds: ``--recompute except-last`` keeps these (every
    micro-batch of 1F1B's last stage; with one micro-batch, that one).
    """
    computes = [a for a in acts if a.op in COMPUTE]
    keep = set()
    for i, a in enumerate(computes):
        if a.op is not Op.FORWARD or a.chunk != chunk:
            continue
        # Every compute up to the one that frees this micro-batch is this micro-batch's own.
        for b in computes[i + 1 :]:
            if (b.micro, b.chunk) != (a.micro, a.chunk):
                break
            if b.op in RELEASES:
                keep.add(a.micro)
                break
    return keep
