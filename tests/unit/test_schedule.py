"""Schedules as literal data, and the properties every schedule must keep."""

from __future__ import annotations

import pytest

from bundle.engine.schedule import actions, peak_in_flight
from bundle.errors import ScheduleError


def ops(name, stage, stages, micro) -> list[str]:
    return [repr(a) for a in actions(name, stage, stages, micro)]


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


def test_single_stage_has_no_communication():
    assert ops("1f1b", 0, 1, 2) == ["forward0", "backward0", "forward1", "backward1"]
    assert ops("gpipe", 0, 1, 2) == ["forward0", "forward1", "backward0", "backward1"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_every_micro_batch_runs_once_forward_before_backward(name, stages, micro):
    for s in range(stages):
        acts = actions(name, s, stages, micro)
        fwd = [a.micro for a in acts if a.op.value == "forward"]
        bwd = [a.micro for a in acts if a.op.value == "backward"]
        assert sorted(fwd) == sorted(bwd) == list(range(micro))
        names = [repr(a) for a in acts]
        for k in range(micro):
            assert names.index(f"forward{k}") < names.index(f"backward{k}")


@pytest.mark.parametrize("stages, micro", [(2, 8), (3, 8), (4, 4), (3, 1)])
def test_peak_activations(stages, micro):
    for s in range(stages):
        assert peak_in_flight(actions("gpipe", s, stages, micro)) == micro
        assert peak_in_flight(actions("1f1b", s, stages, micro)) == min(stages - s, micro)


@pytest.mark.parametrize(
    "args", [("1f1b", 0, 2, 0), ("gpipe", 2, 2, 1), ("gpipe", 0, 0, 1), ("zigzag", 0, 2, 1)]
)
def test_bad_parameters_raise(args):
    with pytest.raises(ScheduleError):
        actions(*args)
