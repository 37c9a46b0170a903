"""The simulator runs the engine's own schedules: bubble formula, 1F1B's in-flight bound, and a
step with unequal widths computed by hand."""

from __future__ import annotations

import pytest

from bundle.errors import ScheduleError
from bundle.plan.cluster import Link
from bundle.plan.simulate import COMPUTE, SEND, Layout, simulate
from tests.support.plan_fixtures import literal_cost


def _layout(shape, micro, schedule, *, starts=None, batch=None, sync="flat") -> Layout:
    return Layout(
        shape=tuple(shape),
        num_bundles=1,
        starts=tuple(starts if starts is not None else range(len(shape))),
        micro_batches=micro,
        schedule=schedule,
        grad_sync=sync,
        batch=batch or micro * max(shape),
        procs_per_node=sum(shape),
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_equal_stages_reproduce_the_bubble_formula(schedule, stages, micro):
    # One block per stage, forward 1 s and backward 2 s per micro-batch of one row.
    cost = literal_cost([1.0] * stages, [2.0] * stages)
    sim = simulate(_layout([1] * stages, micro, schedule), cost)
    assert sim.step_time == pytest.approx((micro + stages - 1) * 3.0)
    assert sim.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    assert sim.busy == pytest.approx([micro * 3.0] * stages)


def _in_flight(sim, rank: int) -> int:
    """Most micro-batches forwarded and not yet backwarded on ``rank``, read off the timeline."""
    spans = sorted(
        (s for s in sim.timeline if s.rank == rank and s.kind == COMPUTE), key=lambda s: s.start
    )
    live = peak = 0
    for s in spans:
        live += 1 if s.label.startswith("F") else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("stages", "micro"), [(2, 8), (4, 8), (4, 3)])
def test_1f1b_keeps_at_most_s_minus_stage_in_flight(stages, micro):
    cost = literal_cost([1.0, 0.5, 2.0, 1.0][:stages], [2.0, 1.0, 3.0, 2.0][:stages])
    ofb = simulate(_layout([1] * stages, micro, "1f1b"), cost, timeline=True)
    gpipe = simulate(_layout([1] * stages, micro, "gpipe"), cost, timeline=True)
    for s in range(stages):
        assert _in_flight(ofb, s) == min(stages - s, micro)
        assert _in_flight(gpipe, s) == micro
    assert ofb.peak_in_flight == [min(stages - s, micro) for s in range(stages)]


def test_unequal_widths_by_hand():
    """Shape 2,1, one micro-batch of 4 rows: each front replica forwards 2 rows (1 s/row), sends
    them (4 B/s, 4 B per row, 0.5 s latency) to the rear, which forwards and backwards 4 rows
    (0.5 and 1 s/row) and sends each front replica its rows' gradients back; the front backwards
    2 rows (2 s/row); then the front's 4-byte gradient is all-reduced between its two replicas
    (1 s at 4 B/s: 2 (n-1)/n * bytes / bandwidth)."""
    cost = literal_cost(
        [1.0, 0.5], [2.0, 1.0], params=[1, 0], p2p=Link(4.0, 0.5), collective=Link(4.0, 0.0)
    )
    sim = simulate(_layout([2, 1], 1, "1f1b", batch=4), cost, timeline=True)
    # front: F 0-2, send 2-4 (arrives 4.5); rear: F 4.5-6.5, B 6.5-10.5, send 10.5-12.5
    # (arrives 13); front: B 13-17, all-reduce 17-18.
    assert sim.step_time == pytest.approx(18.0)
    assert sim.busy == pytest.approx([6.0, 6.0, 6.0])
    assert sim.sync == pytest.approx([1.0, 1.0, 0.0])
    sends = sorted((s.rank, s.start, s.end) for s in sim.timeline if s.kind == SEND)
    assert sends == [(0, 2.0, 4.0), (1, 2.0, 4.0), (2, 10.5, 12.5), (2, 10.5, 12.5)]
    rear = [(s.label, s.start, s.end) for s in sim.timeline if s.rank == 2 and s.kind == COMPUTE]
    assert rear == [("F0", 4.5, 6.5), ("B0", 6.5, 10.5)]


def test_hierarchical_sync_is_reduce_allreduce_broadcast():
    """Two bundles of shape 2: reduce in the bundle, all-reduce between the two masters,
    broadcast back: 0.5 + 1 + 0.5 s for 4 bytes at 4 B/s, against flat's ring over 4 replicas
    (2 * 3/4 * 4 / 4 = 1.5 s)."""
    cost = literal_cost([1.0], [1.0], params=[1], collective=Link(4.0, 0.0))
    base = dict(
        shape=(2,),
        num_bundles=2,
        starts=(0,),
        micro_batches=1,
        schedule="1f1b",
        batch=4,
        procs_per_node=4,
    )
    flat = simulate(Layout(grad_sync="flat", **base), cost)
    hier = simulate(Layout(grad_sync="hierarchical", **base), cost)
    assert flat.step_time == pytest.approx(2.0 + 1.5)
    assert hier.step_time == pytest.approx(2.0 + 2.0)


def test_split_points_must_match_the_stages():
    cost = literal_cost([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ScheduleError, match="split points"):
        simulate(_layout([1, 1], 2, "1f1b", starts=(0,)), cost)
