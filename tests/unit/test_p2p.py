"""The calls each stage posts, as literal data, and every shape's calls replayed through NCCL's model.

``replay`` is the pure model of NCCL's streams (one in-order stream per rank, rendezvous sends);
the engine's calls must complete under it for every shape, bundle count, schedule and M, and
gloo's plan (receives posted ahead of the sends, the engine's only order before) must not.
"""

from __future__ import annotations

import itertools

import pytest

from bundle.errors import ScheduleError
from bundle.ir import p2p
from bundle.ir.p2p import MIRROR, SIDE, Call, calls, programs, replay, step_plan
from bundle.ir.schedule import ONE_CHUNK, REGISTRY, SCHEDULES, Action, actions
from bundle.topology import Topology


def _c(text: str) -> list[str]:
    return text.split(" | ")


def _text(cs: list[Call]) -> list[str]:
    return [repr(c) for c in cs]


def test_1f1b_two_stages_fuses_each_send_with_the_mirror_receive():
    assert _text(calls("1f1b", 0, 2, 3)) == _c(
        "send_act0 | send_act1+recv_grad0 | send_act2+recv_grad1 | recv_grad2"
    )
    assert _text(calls("1f1b", 1, 2, 3)) == _c(
        "recv_act0 | send_grad0+recv_act1 | send_grad1+recv_act2 | send_grad2"
    )


def test_zb_h1_fuses_across_the_weight_half_between_send_and_receive():
    """Stage 1's send_grad1 and recv_act2 have backward_weight0 between them: still one call,
    the same as stage 0's mirror pair, and the weight half runs while it is in flight."""
    assert _text(calls("zb-h1", 0, 2, 3)) == _text(calls("1f1b", 0, 2, 3))
    assert _text(calls("zb-h1", 1, 2, 3)) == _text(calls("1f1b", 1, 2, 3))
    plan = step_plan("zb-h1", 1, 2, 3)
    posts = _posts(plan)
    assert ("send_grad1", ["send_grad1+recv_act2"]) in posts
    at = [repr(a) for a in plan.actions]
    assert at.index("send_grad1") < at.index("backward_weight0") < at.index("recv_act2")


def _chunks(schedule: str) -> tuple[int, ...]:
    """The chunks per stage a schedule is proven with (--virtual-stages)."""
    return (2, 3) if REGISTRY[schedule].chunks else (1,)


def _valid(schedule: str, stages: int, micro: int, chunks: int) -> bool:
    try:
        actions(schedule, 0, stages, micro, chunks)
    except ScheduleError:
        return False  # refused by the config in one line (interleaving's rounds)
    return True


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_completes_for_every_depth_and_micro_batch_count(schedule):
    """The registry's schedules on S = 2..5 one-wide stages, M = 1..8, V = 1..3 where the
    schedule runs it: NCCL's model finishes."""
    for stages, micro, v in itertools.product(range(2, 6), range(1, 9), _chunks(schedule)):
        if _valid(schedule, stages, micro, v):
            topo = _topo((1,) * stages, 1, micro)
            assert replay(programs(topo, schedule, chunks=v)) == [], (stages, micro, v)


def test_1f1b_three_stages_middle_fuses_on_both_boundaries():
    assert _text(calls("1f1b", 0, 3, 4)) == _c(
        "send_act0 | send_act1 | send_act2+recv_grad0 | send_act3+recv_grad1 | recv_grad2 | "
        "recv_grad3"
    )
    assert _text(calls("1f1b", 1, 3, 4)) == _c(
        "recv_act0 | send_act0 | recv_act1 | send_act1+recv_grad0 | send_grad0+recv_act2 | "
        "send_act2+recv_grad1 | send_grad1+recv_act3 | send_act3+recv_grad2 | send_grad2 | "
        "recv_grad3 | send_grad3"
    )
    assert _text(calls("1f1b", 2, 3, 4)) == _c(
        "recv_act0 | send_grad0+recv_act1 | send_grad1+recv_act2 | send_grad2+recv_act3 | "
        "send_grad3"
    )


def test_gpipe_fuses_nothing_across_its_drain():
    # Stage 0 has send_act2 beside recv_grad0, but stage 1 computes between recv_act2 and
    # send_grad0: fusing one side only would give the boundary two different call sequences.
    assert _text(calls("gpipe", 0, 2, 3)) == _c(
        "send_act0 | send_act1 | send_act2 | recv_grad0 | recv_grad1 | recv_grad2"
    )
    assert _text(calls("gpipe", 1, 3, 2)) == _c(
        "recv_act0 | send_act0 | recv_act1 | send_act1 | recv_grad0 | send_grad0 | recv_grad1 | "
        "send_grad1"
    )


def test_one_stage_posts_nothing():
    assert calls("1f1b", 0, 1, 4) == [] == calls("gpipe", 0, 1, 4)


def _boundary_view(cs: list[Call], side: int) -> list[tuple[Action, ...]]:
    """The calls as the boundary on ``side`` sees them, each message named from the upstream side."""
    out = []
    for c in cs:
        ops = tuple(
            a if side > 0 else Action(MIRROR[a.op], a.micro) for a in c.ops if SIDE[a.op] == side
        )
        if ops:
            out.append(tuple(sorted(ops, key=repr)))
    return out


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_both_sides_of_every_boundary_post_the_same_calls_in_the_same_order(schedule):
    for stages, micro in itertools.product(range(2, 6), range(1, 8)):
        per_stage = [calls(schedule, s, stages, micro) for s in range(stages)]
        for s in range(stages - 1):
            up, down = _boundary_view(per_stage[s], 1), _boundary_view(per_stage[s + 1], -1)
            assert up == down, (schedule, stages, micro, s)


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_every_action_is_in_exactly_one_call_in_schedule_order(schedule):
    for stages, micro, s in ((4, 5, 1), (3, 2, 2), (2, 7, 0)):
        comm = [a for a in actions(schedule, s, stages, micro) if a.op in p2p.COMM]
        assert [a for c in calls(schedule, s, stages, micro) for a in c.ops] == comm


SHAPES = [(1, 1), (2, 1), (1, 2), (2, 3), (3, 2), (1, 1, 1), (2, 2, 1), (1, 3, 2), (1, 1, 1, 1)]


def _topo(shape, bundles, micro) -> Topology:
    return Topology(
        shape=shape,
        num_bundles=bundles,
        procs_per_node=sum(shape),
        global_batch=max(23, micro * max(shape) * bundles),
        micro_batches=micro,
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_engines_calls_complete_under_nccls_ordering(schedule):
    """Every shape (uneven widths: several peers per boundary, and across the wrap from the last
    stage to the first under interleaving), bundles and micro-batches."""
    for shape, bundles, micro in itertools.product(SHAPES, (1, 2), (1, 2, 3, 4, 7)):
        for v in _chunks(schedule):
            if _valid(schedule, len(shape), micro, v):
                stuck = replay(programs(_topo(shape, bundles, micro), schedule, chunks=v))
                assert stuck == [], (shape, bundles, micro, v, stuck)


def _posts(plan) -> list[tuple[str, list[str]]]:
    """Where each call is posted: (action, calls posted as it begins), for actions that post."""
    return [
        (repr(a), [repr(plan.calls[c]) for c in plan.post_at[i]])
        for i, a in enumerate(plan.actions)
        if plan.post_at[i]
    ]


def test_nccl_plan_posts_each_call_where_its_first_action_stands():
    plan = step_plan("1f1b", 0, 2, 3)
    assert _posts(plan) == [
        ("send_act0", ["send_act0"]),
        ("send_act1", ["send_act1+recv_grad0"]),
        ("send_act2", ["send_act2+recv_grad1"]),
        ("recv_grad2", ["recv_grad2"]),
    ]
    assert [plan.call_of[i] for i, a in enumerate(plan.actions) if a.op in p2p.RECVS] == [1, 2, 3]


def test_gloo_plan_posts_each_receive_one_ahead():
    """gloo's plan (early receives): the first receive of each kind as the step begins, the next
    as soon as the one before it has arrived; sends where they stand; nothing fused."""
    assert _posts(step_plan("1f1b", 0, 2, 3, early_receives=True)) == [
        ("forward0", ["recv_grad0"]),
        ("send_act0", ["send_act0"]),
        ("send_act1", ["send_act1"]),
        ("backward0", ["recv_grad1"]),
        ("send_act2", ["send_act2"]),
        ("backward1", ["recv_grad2"]),
    ]
    assert _posts(step_plan("gpipe", 1, 3, 2, early_receives=True)) == [
        ("recv_act0", ["recv_act0", "recv_grad0"]),
        ("forward0", ["recv_act1"]),
        ("send_act0", ["send_act0"]),
        ("send_act1", ["send_act1"]),
        ("backward0", ["recv_grad1"]),
        ("send_grad0", ["send_grad0"]),
        ("send_grad1", ["send_grad1"]),
    ]


@pytest.mark.parametrize("schedule", ONE_CHUNK)  # several chunks post in rounds on every backend
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("micro", [1, 3, 4])
def test_gloos_early_receives_deadlock_under_nccls_ordering(shape, micro, schedule):
    """gloo's plan, which was the engine's only order before, cannot run on NCCL."""
    assert replay(programs(_topo(shape, 1, micro), schedule, early_receives=True), 10**9)
    stuck = replay(programs(_topo(shape, 1, micro), schedule, early_receives=True))
    # Stage 0's first call receives a gradient no one can send before its activation arrived.
    assert stuck and stuck[0].startswith("rank 0: call 0 stuck on recv from rank")


def test_unfused_1f1b_crosses_and_deadlocks_unless_sends_are_eager(monkeypatch):
    """Receives posted where they stand are not enough: 1F1B's sends cross (stage 0's send_act1
    and stage 1's send_grad0 each head their stream, each waiting for a receive queued behind the
    other's), unless messages are small enough for NCCL to send eagerly."""

    def unfused(schedule, stage, num_stages, micro, frozen=0):
        acts = actions(schedule, stage, num_stages, micro)
        return acts, [Call((a,)) for a in acts if a.op in p2p.COMM]

    topo = _topo((1, 1), 1, 3)
    assert replay(programs(topo, "1f1b")) == []
    monkeypatch.setattr(p2p, "stage_calls", unfused)
    assert replay(programs(topo, "1f1b")) == [
        "rank 0: call 1 stuck on send to rank 1",
        "rank 1: call 1 stuck on send to rank 0",
    ]
    assert replay(programs(topo, "1f1b"), eager_bytes=12) == []


def test_replay_names_a_rank_that_waits_forever():
    progs = {0: [("post", [("recv", 1, 4)]), ("wait", 0)], 1: []}
    assert replay(progs) == ["rank 0: call 0 stuck on recv from rank 1"]


def test_stages_before_the_first_that_trains_get_no_gradient_as_literal_calls():
    """A frozen stage 0 (a LoRA model's embedding) sends its activations and runs no backward;
    stage 1, whose input needs no gradient, sends none back."""
    assert _text(p2p.stage_calls("1f1b", 0, 2, 3, frozen=1)[1]) == _c(
        "send_act0 | send_act1 | send_act2"
    )
    assert _text(p2p.stage_calls("1f1b", 1, 2, 3, frozen=1)[1]) == _c(
        "recv_act0 | recv_act1 | recv_act2"
    )
    front = p2p.stage_calls("zb-h1", 0, 3, 4, frozen=2)[0]
    assert {a.op.value for a in front} == {"forward", "send_act"}
    middle = p2p.stage_calls("zb-h1", 1, 3, 4, frozen=2)[0]
    assert {a.op.value for a in middle} == {"recv_act", "forward", "send_act"}
    last = p2p.stage_calls("zb-h1", 2, 3, 4, frozen=2)[0]
    assert "send_grad" not in {a.op.value for a in last}
    assert "backward_weight" in {a.op.value for a in last}


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_calls_without_gradients_into_a_frozen_front_complete_under_nccls_ordering(schedule):
    for shape, bundles, micro in (((1, 1), 1, 3), ((2, 1, 3), 2, 4), ((1, 2, 2, 1), 1, 5)):
        for frozen in range(1, len(shape)):
            topo = _topo(shape, bundles, micro)
            stuck = replay(programs(topo, schedule, frozen=frozen))
            assert stuck == [], (shape, bundles, micro, frozen, stuck)
