"""bundle/plan/messages.py's fits on literal ping-pong points (no processes): the calls and the
link of a message at the boundary's sizes, and the sizes a model's boundaries send."""

from __future__ import annotations

import pytest

from bundle.plan import messages
from bundle.plan.anatomy import Anatomy, BlockAnatomy, Linear
from bundle.plan.calibrate import Calibration
from bundle.plan.cluster import Link
from bundle.plan.cost import Overheads

# A machine whose messages arrive 50 µs + 0.5 ns/byte (2 GB/s) after their send's call starts,
# that call taking the sender 10 µs + 1 ns/byte, and a receive's call 3 µs.
SEND, SEND_PER_BYTE, RECV, LATENCY, BANDWIDTH = 10e-6, 1e-9, 3e-6, 50e-6, 2e9


def _point(nbytes: int) -> messages.Point:
    return {
        "bytes": nbytes,
        "one_way": LATENCY + nbytes / BANDWIDTH,
        "send_call": SEND + SEND_PER_BYTE * nbytes,
        "recv_call": RECV,
        "spread": 0.01,
    }


POINTS = [_point(n) for n in messages.GRID]


def test_the_relative_line_recovers_an_exact_line_and_never_goes_below_zero():
    assert messages.line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    # Falling: flat, at the constant nearest both points relatively: sum(1/y) / sum(1/y^2).
    assert messages.line([1.0, 2.0], [4.0, 2.0]) == (pytest.approx(2.4), 0.0)
    a, b = messages.line([1.0, 2.0], [1.0, 3.0])  # through (0, -1): held at the origin
    assert a == 0.0 and b == pytest.approx(15 / 13)  # sum(xy/y^2) / sum(x^2/y^2)


def test_the_points_spanning_a_range_bracket_it_and_are_at_least_two():
    sizes = lambda lo, hi: [p["bytes"] for p in messages.spanning(POINTS, lo, hi)]  # noqa: E731
    assert sizes(100, 5000) == [64, 256, 1024, 4096, 16384]
    assert sizes(1024, 1024) == [1024, 4096]
    assert sizes(1, 2) == [4, 16]
    assert sizes(2**30, 2**31) == [4 * 2**20, 16 * 2**20]


@pytest.mark.parametrize(("lo", "hi"), [(4, 16 * 2**20), (1000, 3000), (2**20, 2**20)])
def test_fit_recovers_each_sides_call_and_the_link_wherever_it_looks(lo, hi):
    cost = messages.fit(POINTS, lo, hi)
    assert cost.send_call == pytest.approx(SEND, rel=1e-6)
    assert cost.send_call_per_byte == pytest.approx(SEND_PER_BYTE, rel=1e-6)
    assert cost.recv_call == pytest.approx(RECV)
    assert cost.link.latency == pytest.approx(LATENCY, rel=1e-6)
    assert cost.link.bandwidth == pytest.approx(BANDWIDTH, rel=1e-6)
    got = cost.overheads(Overheads(comm_action=7.0))
    assert (got.comm_action, got.send_call, got.recv_call) == (7.0, cost.send_call, RECV)


def test_one_sizes_slow_receive_call_does_not_set_the_fit():
    odd = [dict(p, recv_call=1e-3) if p["bytes"] == 2**18 else p for p in POINTS]
    assert messages.fit(odd, 2**16, 2**16).recv_call == pytest.approx(RECV)


def _block(floats: int, other: int = 0) -> BlockAnatomy:
    z = Linear(0.0, 0.0)
    return BlockAnatomy("b", 0, (floats,), other, z, z, (), ())


def test_the_boundary_range_runs_from_one_gradient_row_to_the_whole_batchs_activations():
    anatomy = Anatomy("m", (1, 1, 1), 2, (_block(8), _block(2, other=8), _block(5), _block(1)))
    # Cuts 1, 2, 3: 8, 2 (+8 other bytes) and 5 floats a row; fp32 4 bytes, bf16 2.
    assert messages.boundary_range(anatomy, (1, 64)) == (8.0, 32.0 * 64)
    assert messages.boundary_range(anatomy, (1, 64), precision="bf16") == (4.0, 16.0 * 64)
    assert messages.boundary_range(anatomy, (16, 16), cuts=(3,)) == (320.0, 320.0)
    assert messages.boundary_range(anatomy, (1, 1), cuts=()) is None


def test_a_calibration_fitted_at_a_boundary_takes_its_link_and_calls():
    cal = Calibration(Overheads(comm_action=1e-4), Link(1.0, 1.0), Link(2.0, 2.0), tuple(POINTS))
    at = cal.for_boundary((1024.0, 4096.0))
    assert at.p2p.latency == pytest.approx(LATENCY) and at.collective == cal.collective
    assert at.overheads.send_call == pytest.approx(SEND) and at.overheads.comm_action == 1e-4
    assert cal.for_boundary(None) is cal
    assert Calibration(Overheads(), Link(1.0, 1.0), Link(1.0, 1.0)).for_boundary(
        (1, 2)
    ).p2p == Link(1.0, 1.0)
