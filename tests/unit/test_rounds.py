"""The lockstep calls of stages with several model chunks (bundle.ir.rounds), as data."""

from __future__ import annotations

import itertools

import pytest

from bundle.errors import ScheduleError
from bundle.ir import p2p
from bundle.ir.p2p import programs, replay, step_plan
from bundle.ir.rounds import clock, lockstep
from bundle.ir.schedule import REGISTRY, Action, Op, Pipe, actions
from bundle.topology import Topology


def test_each_round_holds_the_messages_its_senders_computed_in_it():
    """S=2, V=2, M=2 (the schedule module's drawing): pieces 0..3 on stages 0, 1, 0, 1. Each
    message is in the call of the round its sender computed it, listed by boundary, then
    micro-batch: in round 1, stage 1 receives activation 1 from piece 0 and sends its own
    activation 0 (piece 1) on to piece 2; in round 2 piece 2's output comes back to it."""
    lists = [actions("interleaved-1f1b", s, 2, 2, 2) for s in range(2)]
    rounds = clock(lists, Pipe(2, 2))
    assert [rounds["F", 0, k] for k in (0, 1)] == [0, 1]
    assert [rounds["F", 1, k] for k in (0, 1)] == [1, 2]
    assert rounds["F", 2, 0] == 2 and rounds["B", 3, 0] == 4 and rounds["B", 0, 1] == 9
    _, calls, _, _ = lockstep("interleaved-1f1b", 1, 2, 2, 2)
    assert [tuple(map(repr, c)) for c in calls][:4] == [
        ("recv_act0",),
        ("recv_act1", "send_act0"),
        ("send_act1", "recv_act0c1"),
        ("recv_act1c1",),
    ]


def _pair_view(stage: int, chunks: int, schedule: str, stages: int, micro: int):
    """The messages of one stage's calls, per peer stage, in the order they are posted, each
    named alike on both sides: (activation or gradient, the boundary's upstream piece, micro)."""
    plan = step_plan(schedule, stage, stages, micro, chunks=chunks)
    pipe = REGISTRY[schedule].pipe(stages, chunks)
    out: dict[int, list[tuple[str, int, int]]] = {}
    for c in plan.calls:
        for a in c.ops:
            piece = pipe.piece(stage, a.chunk)
            upstream = piece if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else piece - 1
            kind = "act" if a.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad"
            out.setdefault(p2p.peer(a, stage, pipe)[0], []).append((kind, upstream, a.micro))
    return out


@pytest.mark.parametrize(
    "schedule,stages,micro,chunks",
    [
        ("interleaved-1f1b", 2, 4, 2),
        ("interleaved-1f1b", 3, 3, 2),
        ("interleaved-1f1b", 4, 8, 3),
        ("interleaved-1f1b", 2, 6, 3),
        ("zbv", 2, 3, 2),
        ("zbv", 4, 8, 2),
    ],
)
def test_both_sides_of_every_pair_of_stages_post_the_same_messages_in_the_same_order(
    schedule, stages, micro, chunks
):
    views = [_pair_view(s, chunks, schedule, stages, micro) for s in range(stages)]
    for s, t in itertools.permutations(range(stages), 2):
        assert views[s].get(t, []) == views[t].get(s, []), (s, t)


def test_every_action_is_in_exactly_one_call_and_each_receive_has_a_free_buffer():
    for stages, micro, chunks in [(2, 8, 2), (3, 6, 3), (4, 4, 2)]:
        for s in range(stages):
            plan = step_plan("interleaved-1f1b", s, stages, micro, chunks=chunks)
            comm = [a for a in plan.actions if a.op in p2p.COMM]
            posted = [a for c in plan.calls for a in c.ops]
            assert sorted(map(repr, posted)) == sorted(map(repr, comm))
            # A slot is reused only after the micro-batch that held it ran its backward.
            live: dict[tuple[Op, int, int], int] = {}
            for i, a in enumerate(plan.actions):
                for n in plan.post_at[i]:
                    for r in plan.calls[n].ops:
                        if r.op in p2p.RECVS:
                            key = (r.op, r.chunk, plan.slots[r])
                            assert key not in live, (s, r, live)
                            live[key] = r.micro
                if a.op is Op.BACKWARD:
                    for key in [k for k, m in live.items() if k[1] == a.chunk and m == a.micro]:
                        del live[key]


def test_the_chunked_plan_completes_where_fused_calls_deadlock():
    """Fusing a send with the next receive, as one chunk per stage does, deadlocks interleaving
    from M = 3 on; the rounds complete, at every shape of uneven widths."""
    topo = Topology(
        shape=(2, 3), num_bundles=2, procs_per_node=10, global_batch=48, micro_batches=4
    )
    assert replay(programs(topo, "interleaved-1f1b", chunks=2)) == []


def test_a_schedule_whose_stages_wait_on_each_other_is_refused():
    """Stage 0 starts with a backward that needs stage 1's, which needs a forward stage 0 never
    runs: refused, never a plan that hangs."""
    lists = [[Action(Op.BACKWARD, 0)], [Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0)]]
    with pytest.raises(ScheduleError, match="deadlocks at round 0"):
        clock(lists, Pipe(2))
