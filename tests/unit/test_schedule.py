"""Schedules as literal data, and the properties every schedule must keep."""

from __future__ import annotations

import itertools

import pytest

from bundle.errors import ScheduleError
from bundle.ir.schedule import REGISTRY, SCHEDULES, actions, peak_in_flight


def ops(name, stage, stages, micro, chunks=1) -> list[str]:
    return [repr(a) for a in actions(name, stage, stages, micro, chunks)]


def test_gpipe_two_stages_literal():
    assert ops("gpipe", 0, 2, 3) == [
        "forward0",
        "send_act0",
        "forward1",
        "send_act1",
        "forward2",
        "send_act2",
        "recv_grad0",
        "backward0",
        "recv_grad1",
        "backward1",
        "recv_grad2",
        "backward2",
    ]
    assert ops("gpipe", 1, 2, 2) == [
        "recv_act0",
        "forward0",
        "recv_act1",
        "forward1",
        "backward0",
        "send_grad0",
        "backward1",
        "send_grad1",
    ]


def test_1f1b_two_stages_literal():
    assert ops("1f1b", 0, 2, 3) == [
        "forward0",
        "send_act0",
        "forward1",
        "send_act1",
        "recv_grad0",
        "backward0",
        "forward2",
        "send_act2",
        "recv_grad1",
        "backward1",
        "recv_grad2",
        "backward2",
    ]
    assert ops("1f1b", 1, 2, 3) == [
        "recv_act0",
        "forward0",
        "backward0",
        "send_grad0",
        "recv_act1",
        "forward1",
        "backward1",
        "send_grad1",
        "recv_act2",
        "forward2",
        "backward2",
        "send_grad2",
    ]


def test_1f1b_middle_stage_of_three():
    assert ops("1f1b", 1, 3, 2) == [
        "recv_act0",
        "forward0",
        "send_act0",
        "recv_act1",
        "forward1",
        "send_act1",
        "recv_grad0",
        "backward0",
        "send_grad0",
        "recv_grad1",
        "backward1",
        "send_grad1",
    ]


def _computes(name, stage, stages, micro) -> str:
    short = {"forward": "F", "backward_input": "I", "backward_weight": "W", "backward": "B"}
    return " ".join(
        short[a.op.value] + str(a.micro)
        for a in actions(name, stage, stages, micro)
        if a.op.value in short
    )


def test_zb_h1_literal():
    """Stage s defers its first s weight halves; the input half is sent upstream at once."""
    assert ops("zb-h1", 1, 2, 3) == [
        "recv_act0",
        "forward0",
        "backward_input0",
        "send_grad0",
        "recv_act1",
        "forward1",
        "backward_input1",
        "send_grad1",
        "backward_weight0",
        "recv_act2",
        "forward2",
        "backward_input2",
        "send_grad2",
        "backward_weight1",
        "backward_weight2",
    ]
    assert _computes("zb-h1", 0, 2, 3) == "F0 F1 I0 W0 F2 I1 W1 I2 W2"
    assert _computes("zb-h1", 0, 4, 6) == "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5"
    assert _computes("zb-h1", 2, 4, 6) == "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5"
    assert _computes("zb-h1", 3, 4, 6) == "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5"
    # Fewer micro-batches than deferrals: every W at the end.
    assert _computes("zb-h1", 3, 4, 2) == "F0 I0 F1 I1 W0 W1"
    assert _computes("zb-h1", 0, 1, 2) == "F0 I0 W0 F1 I1 W1"


def test_single_stage_has_no_communication():
    assert ops("1f1b", 0, 1, 2) == ["forward0", "backward0", "forward1", "backward1"]
    assert ops("gpipe", 0, 1, 2) == ["forward0", "forward1", "backward0", "backward1"]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_every_micro_batch_runs_once_forward_before_backward(name, stages, micro):
    """Each micro-batch in each chunk: one forward, then one backward or (split) its input half,
    then its weight half; each communication once; nothing the registry's schedule does not
    declare."""
    sched = REGISTRY[name]
    if sched.chunks and stages == 1:
        return  # interleaving needs stages to interleave over (refused by the config)
    split = sched.split_backward
    for chunks in (2, 3) if sched.chunks else (1,):
        try:
            actions(name, 0, stages, micro, chunks)
        except ScheduleError:
            continue  # refused in one line (ZBV's 2 chunks and 2S - 1 micro-batches, rounds)
        for s in range(stages):
            acts = actions(name, s, stages, micro, chunks)
            names = [repr(a) for a in acts]
            assert len(set(names)) == len(names)
            halves = ("backward_input", "backward_weight") if split else ("backward",)
            for c, k in itertools.product(range(chunks), range(micro)):
                tail = f"c{c}" if c else ""
                at = [names.index(f"{op}{k}{tail}") for op in ("forward", *halves)]
                assert at == sorted(at), (s, k, c, names)
            assert len(acts) == chunks * micro * (1 + len(halves)) + sum(
                a.op.value.startswith(("send", "recv")) for a in acts
            )


def test_interleaved_1f1b_two_stages_two_chunks():
    """S=2, V=2, M=2 (the module's drawing): pieces 0..3 on stages 0, 1, 0, 1; stage 0 warms up
    with (V-1) R + 2 (S-1) = 4 forwards, stage 1 with 2; backwards from the last chunk."""
    assert ops("interleaved-1f1b", 0, 2, 2, 2) == [
        "forward0", "send_act0", "forward1", "send_act1",
        "recv_act0c1", "forward0c1", "send_act0c1", "recv_act1c1", "forward1c1", "send_act1c1",
        "recv_grad0c1", "backward0c1", "send_grad0c1", "recv_grad1c1", "backward1c1",
        "send_grad1c1", "recv_grad0", "backward0", "recv_grad1", "backward1",
    ]  # fmt: skip
    assert ops("interleaved-1f1b", 1, 2, 2, 2) == [
        "recv_act0", "forward0", "send_act0", "recv_act1", "forward1", "send_act1",
        "recv_act0c1", "forward0c1", "backward0c1", "send_grad0c1",
        "recv_act1c1", "forward1c1", "backward1c1", "send_grad1c1",
        "recv_grad0", "backward0", "send_grad0", "recv_grad1", "backward1", "send_grad1",
    ]  # fmt: skip


def test_interleaved_1f1b_runs_micro_batches_in_rounds():
    """Rounds of R = M / max(1, M // S) micro-batches per chunk (torch's rule): M=4 on S=2 is
    two rounds of 2; M=5 on S=2 cannot be split in rounds and is refused, naming what can."""
    computes = [a for a in actions("interleaved-1f1b", 1, 2, 4, 2) if a.op.value == "forward"]
    assert [repr(a) for a in computes][:6] == [
        "forward0",
        "forward1",
        "forward0c1",
        "forward1c1",
        "forward2",
        "forward3",
    ]
    with pytest.raises(ScheduleError, match="need a multiple of 2 .e.g. 4 or 6."):
        actions("interleaved-1f1b", 0, 2, 5, 2)


def test_zbv_two_stages_literal():
    """ZBV, S=2, M=3 (torch's ScheduleZBVZeroBubble order): chunk 0 of stage s is piece s, chunk 1
    piece 3 - s, so the turn (pieces 1 and 2) stays on stage 1 with no message, and stage 0 runs
    both the first piece and the last (the loss)."""
    assert ops("zbv", 0, 2, 3, 2) == [
        "forward0", "send_act0", "forward1", "send_act1", "forward2", "send_act2",
        "recv_act0c1", "forward0c1", "backward_input0c1", "send_grad0c1", "backward_weight0c1",
        "recv_act1c1", "forward1c1", "backward_input1c1", "send_grad1c1", "backward_weight1c1",
        "recv_grad0", "backward_input0", "backward_weight0",
        "recv_act2c1", "forward2c1", "backward_input2c1", "send_grad2c1", "backward_weight2c1",
        "recv_grad1", "backward_input1", "backward_weight1",
        "recv_grad2", "backward_input2", "backward_weight2",
    ]  # fmt: skip
    assert ops("zbv", 1, 2, 3, 2) == [
        "recv_act0", "forward0", "forward0c1", "send_act0c1",
        "recv_act1", "forward1", "forward1c1", "send_act1c1",
        "recv_grad0c1", "backward_input0c1", "backward_weight0c1",
        "recv_act2", "forward2", "backward_input0", "send_grad0", "backward_weight0",
        "forward2c1", "send_act2c1", "recv_grad1c1", "backward_input1c1", "backward_weight1c1",
        "backward_input1", "send_grad1", "recv_grad2c1", "backward_input2c1",
        "backward_input2", "send_grad2", "backward_weight1", "backward_weight2c1",
        "backward_weight2",
    ]  # fmt: skip


def test_the_v_placement_turns_on_the_last_stage():
    pipe = REGISTRY["zbv"].pipe(3, 2)
    assert [pipe.place(j) for j in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    assert [pipe.crosses(j, 1) for j in range(6)] == [True, True, False, True, True, False]
    looped = REGISTRY["interleaved-1f1b"].pipe(3, 2)
    assert [looped.place(j) for j in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_a_schedule_refuses_a_number_of_chunks_it_cannot_run():
    with pytest.raises(ScheduleError, match="runs exactly 2 model chunks"):
        actions("zbv", 0, 2, 4, 3)
    with pytest.raises(ScheduleError, match="needs at least 5 micro-batches"):
        actions("zbv", 0, 3, 4, 2)
    with pytest.raises(ScheduleError, match="give --virtual-stages 2 or more"):
        actions("interleaved-1f1b", 0, 2, 4)
    with pytest.raises(ScheduleError, match="runs one model chunk per stage"):
        actions("1f1b", 0, 2, 4, 2)


@pytest.mark.parametrize("stages, micro", [(2, 8), (3, 8), (4, 4), (3, 1)])
def test_peak_activations(stages, micro):
    for s in range(stages):
        assert peak_in_flight(actions("gpipe", s, stages, micro)) == micro
        assert peak_in_flight(actions("1f1b", s, stages, micro)) == min(stages - s, micro)
        # Activations are held until the weight half: 1F1B's first-stage peak on every stage.
        assert peak_in_flight(actions("zb-h1", s, stages, micro)) == min(stages, micro)


@pytest.mark.parametrize(
    "args", [("1f1b", 0, 2, 0), ("gpipe", 2, 2, 1), ("gpipe", 0, 0, 1), ("zigzag", 0, 2, 1)]
)
def test_bad_parameters_raise(args):
    with pytest.raises(ScheduleError):
        actions(*args)


def test_an_operation_nobody_runs_raises_wherever_it_is_dispatched(monkeypatch):
    """A schedule is registered alone; an operation the engine's consumers do not know is refused
    by each of them, in one line naming it, instead of being skipped or taken for another."""
    from dataclasses import dataclass

    from bundle.ir import p2p, schedule
    from bundle.plan.simulate import Layout, simulate
    from tests.support.plan_fixtures import literal_cost

    @dataclass(frozen=True)
    class Odd:
        value: str = "teleport"

    def odd(stage, num_stages, micro):
        yield from schedule.one_f_one_b(stage, num_stages, micro)
        yield schedule.Action(Odd(), 0)

    monkeypatch.setitem(schedule.REGISTRY, "odd", schedule.Schedule("odd", odd))
    with pytest.raises(ScheduleError, match="the NCCL plan cannot run .*'teleport'"):
        p2p.calls("odd", 0, 2, 2)
    cost = literal_cost([1.0, 1.0], [2.0, 2.0])
    with pytest.raises(ScheduleError, match="simulator cannot run .*'teleport'"):
        simulate(Layout((1, 1), 1, (0, 1), 2, "odd", "flat", 2, 2), cost)
    with pytest.raises(ScheduleError, match="memory model cannot run .*'teleport'"):
        cost.memory(0, 1, acts=actions("odd", 0, 2, 2), rows=[1, 1], recomputed=[False] * 2,
                    synced=False, ddp=False)  # fmt: skip
