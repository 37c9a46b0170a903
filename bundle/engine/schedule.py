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
"""

from __future__ import annotations

from collections.abc import Iterator
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


@dataclass(frozen=True)
class Action:
    op: Op
    micro: int

    def __repr__(self) -> str:
        return f"{self.op.value}{self.micro}"


SCHEDULES = ("gpipe", "1f1b")


def _check(stage: int, num_stages: int, micro_batches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage (got {num_stages})")
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if micro_batches < 1:
        raise ScheduleError(f"micro-batches must be >= 1 (got {micro_batches})")


def _forward(stage: int, num_stages: int, k: int) -> Iterator[Action]:
    if stage > 0:
        yield Action(Op.RECV_ACT, k)
    yield Action(Op.FORWARD, k)
    if stage < num_stages - 1:
        yield Action(Op.SEND_ACT, k)


def _backward(stage: int, num_stages: int, k: int) -> Iterator[Action]:
    if stage < num_stages - 1:
        yield Action(Op.RECV_GRAD, k)
    yield Action(Op.BACKWARD, k)
    if stage > 0:
        yield Action(Op.SEND_GRAD, k)


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


def actions(name: str, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """The action list of one stage for the schedule called ``name``."""
    if name == "gpipe":
        return list(gpipe(stage, num_stages, micro_batches))
    if name == "1f1b":
        return list(one_f_one_b(stage, num_stages, micro_batches))
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def peak_in_flight(acts: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not (activations held)."""
    live = peak = 0
    for a in acts:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak


def backward_follows_forward(acts: list[Action]) -> set[int]:
    """Micro-batches whose backward is the stage's next compute after their forward.

    Their activations never coexist with another micro-batch's, so recomputing them would rebuild
    at the backward exactly what keeping them holds: ``--recompute except-last`` keeps these (every
    micro-batch of 1F1B's last stage; with one micro-batch, that one).
    """
    computes = [a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)]
    return {
        a.micro
        for a, b in zip(computes, computes[1:], strict=False)
        if a.op is Op.FORWARD and b.op is Op.BACKWARD and b.micro == a.micro
    }
