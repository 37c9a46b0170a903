"""The simulator runs the engine's own schedules: bubble formula, 1F1B's in-flight bound, a step
with unequal widths computed by hand, and the data-parallel options' sync costed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bundle.errors import ConfigError, ScheduleError
from bundle.plan.cluster import Link
from bundle.plan.cost import Overheads
from bundle.plan.dataparallel import EXACT, DataParallel, powersgd_elems
from bundle.plan.plans import Plan, evaluate
from bundle.plan.search import Workload, search
from bundle.plan.simulate import COMPUTE, SEND, Layout, simulate
from tests.support.plan_fixtures import literal_cost


def _layout(shape, micro, schedule, *, starts=None, batch=None, sync="flat", chunks=1) -> Layout:
    return Layout(
        chunks=chunks,
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


def test_zb_h1_fills_1f1bs_cool_down_with_weight_work():
    """F = 1 s, B = 2 s per block with weights, split I = W = 1 s (the first stage: I nothing, W
    the whole backward). S=2, M=3 by hand (schedule.py's drawing): 10 s against 1F1B's 12 s."""
    cost = literal_cost([1.0, 1.0], [2.0, 2.0], params=[1, 1])
    zb = simulate(_layout([1, 1], 3, "zb-h1"), cost, timeline=True)
    assert zb.step_time == pytest.approx(10.0)
    assert simulate(_layout([1, 1], 3, "1f1b"), cost).step_time == pytest.approx(12.0)
    rear = [x.label for x in sorted(zb.timeline, key=lambda x: x.start) if x.rank == 1]
    assert [x for x in rear if x[0] in "FIW"] == [
        "F0",
        "I0",
        "F1",
        "I1",
        "W0",
        "F2",
        "I2",
        "W1",
        "W2",
    ]
    assert zb.busy == pytest.approx([9.0, 9.0])


def test_interleaving_shrinks_the_bubble_by_the_chunks():
    """S=2, V=2, M=2 with F = B = 1 s per piece (schedule.py's drawing): 10 s, the bubble
    (S-1)/(VM+S-1) = 1/5; 1F1B over the same blocks, two per stage: 12 s."""
    cost = literal_cost([1.0] * 4, [1.0] * 4)
    sim = simulate(_layout([1, 1], 2, "interleaved-1f1b", starts=(0, 1, 2, 3), chunks=2), cost)
    assert sim.step_time == pytest.approx(10.0)
    assert sim.bubble == pytest.approx(1 / 5)
    assert sim.busy == pytest.approx([8.0, 8.0])
    assert simulate(_layout([1, 1], 2, "1f1b", starts=(0, 2)), cost).step_time == 12.0


@pytest.mark.parametrize("micro", [3, 4, 8])
def test_zbv_beats_zb_h1_and_interleaving_beats_1f1b_on_equal_blocks(micro):
    """Four equal blocks with weights (F = 1, B = 2, I = W = 1 s) on two stages: ZBV's half-size
    pieces leave one unit of bubble (M = 3: 19 s against ZB-H1's 20 and 1F1B's 24)."""
    cost = literal_cost([1.0] * 4, [2.0] * 4, params=[1] * 4)

    def step(schedule: str, chunks: int) -> float:
        starts = (0, 1, 2, 3) if chunks > 1 else (0, 2)
        layout = _layout([1, 1], micro, schedule, starts=starts, chunks=chunks)
        return simulate(layout, cost).step_time

    zbv, zb = step("zbv", 2), step("zb-h1", 1)
    assert zbv == pytest.approx(6 * micro + 1) and zb == pytest.approx(6 * micro + 2)
    assert step("interleaved-1f1b", 2) < step("1f1b", 1)


def test_the_planner_cuts_pieces_for_the_schedules_with_chunks():
    """The leaders under interleaving get a split into S x V pieces at their widths (V = 2 and 3);
    ZBV none where it has too few micro-batches, and no chunks where the model has too few
    blocks."""
    from bundle.plan.search import _under
    from bundle.plan.split import Splitter

    cost = literal_cost([1.0] * 8, [2.0] * 8, params=[1] * 8)
    splitter = Splitter(cost, 1e12, 0.0)
    plan = Plan((1, 1), 1, (0, 4), 2, 2)
    il, il3 = _under(plan, "interleaved-1f1b", lambda t: splitter, 4)
    assert il.chunks == 2 and il.starts == (0, 2, 4, 6)
    assert il3.chunks == 3 and len(il3.starts) == 6
    assert _under(plan, "zbv", lambda t: splitter, 4) == []  # M = 2 < 2S - 1
    (zbv,) = _under(replace(plan, micro_batches=4), "zbv", lambda t: splitter, 8)
    assert zbv.starts == (0, 2, 4, 6)
    small = Splitter(literal_cost([1.0] * 3, [2.0] * 3), 1e12, 0.0)
    assert _under(plan, "interleaved-1f1b", lambda t: small, 4) == []
    assert evaluate(cost, il, 4).samples_per_s > evaluate(cost, plan, 4).samples_per_s


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (3, 5), (4, 8), (4, 2)])
def test_zb_h1_is_never_slower_than_1f1b_on_equal_stages(stages, micro):
    cost = literal_cost([1.0] * stages, [2.0] * stages, params=[1] * stages)
    zb = simulate(_layout([1] * stages, micro, "zb-h1"), cost).step_time
    ofb = simulate(_layout([1] * stages, micro, "1f1b"), cost).step_time
    assert zb < ofb


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


# -- the data-parallel options (bundle.plan.dataparallel) -----------------------------------------

# One block of 1000 parameters (4000 fp32 bytes) whose forward and backward take 1 s; the link
# between nodes carries 4000 B/s, the one inside a node is free.
INTER = Link(4000.0, 0.0)


def _dp_cost():
    return literal_cost([1.0], [1.0], params=[1000], p2p=INTER)


def _bundles(n: int, dp: DataParallel = EXACT, *, width: int = 1, sync: str = "flat"):
    """``n`` bundles of one stage of ``width`` replicas, each bundle on a node of its own."""
    return Layout(
        shape=(width,),
        num_bundles=n,
        starts=(0,),
        micro_batches=1,
        schedule="1f1b",
        grad_sync=sync,
        batch=n * width,
        procs_per_node=width,
        dp=dp,
    )


def _sync(layout: Layout, cost=None) -> float:
    return max(simulate(layout, cost or _dp_cost()).sync)


@pytest.mark.parametrize(("width", "sync"), [(1, "flat"), (2, "flat"), (2, "hierarchical")])
def test_default_options_change_nothing(width, sync):
    cost = _dp_cost()
    layout = _bundles(2, width=width, sync=sync)
    assert layout.dp == DataParallel() and Plan((1,), 1, (0,), 1, 1).dp == DataParallel()
    explicit = replace(layout, dp=DataParallel("none", 4, "step", "mean"))
    assert simulate(explicit, cost) == simulate(layout, cost)
    # By hand: the ring over 2 nodes (2 replicas: 2 * 1/2 * 4000 / 4000) or 4 (2 * 3/4).
    flat = {1: 1.0, 2: 1.5}[width]
    assert _sync(layout, cost) == pytest.approx(flat if sync == "flat" else 1.0)
    ranked = search(cost, workload=Workload(nodes=2, per_node=2, batch=4))
    again = search(cost, workload=Workload(nodes=2, per_node=2, batch=4, dp=DataParallel()))
    assert [(e.plan, e.sim.step_time, e.memory) for e in ranked] == [
        (e.plan, e.sim.step_time, e.memory) for e in again
    ]


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize(("width", "sync"), [(1, "flat"), (2, "flat"), (2, "hierarchical")])
def test_half_precision_halves_the_hop_between_bundles(half, width, sync):
    plain = _sync(_bundles(2, width=width, sync=sync))
    halved = _sync(_bundles(2, DataParallel(compression=half), width=width, sync=sync))
    assert halved < plain
    # Every byte of these syncs crosses between the nodes (the in-node hops are free): half.
    assert halved == pytest.approx(plain / 2)


@pytest.mark.parametrize("mode", ["local", "diloco"])
@pytest.mark.parametrize("width", [1, 2])
def test_bundles_meeting_every_8_steps_pay_an_eighth_of_the_hop_per_step(mode, width):
    step = _sync(_bundles(2, width=width, sync="hierarchical"))
    # Whatever --grad-sync says: the meeting's bundles sync in two hops.
    met = _sync(_bundles(2, DataParallel(bundle_sync=f"{mode}:8"), width=width, sync="flat"))
    assert step == pytest.approx(1.0)
    assert 0.11 < met / step < 0.14


def test_median_gathers_every_bundle_and_sorts():
    """3 bundles on 3 nodes: the masters' all-gather receives 2 x 4000 bytes (2 s) against the
    all-reduce's 2 * 2/3 * 4000 (4/3 s); the sort reads and writes the 3 gathered buckets four
    times (4 x 12000 bytes at 12000 B/s: 4 s)."""
    mean = _sync(_bundles(3))
    median = DataParallel(aggregate="median")
    assert mean == pytest.approx(4 / 3)
    assert _sync(_bundles(3, median)) == pytest.approx(2.0)
    cost = _dp_cost()
    cost.overheads = Overheads(copy_bandwidth=12000.0)
    assert _sync(_bundles(3, median), cost) == pytest.approx(2.0 + 4.0)


def test_powersgd_sends_what_torch_would():
    """A (100, 10) weight at rank 4 sends 4 * (100 + 10) elements (compressed: 880 < 1000); the
    bias its 10: 450 of 1010 elements, 1800 bytes over 4000 B/s between the two bundles."""
    assert powersgd_elems((100, 10), 4) == 440
    assert powersgd_elems((10,), 4) == 10
    assert powersgd_elems((64, 3, 3, 3), 4) == 4 * (64 + 27)
    assert powersgd_elems((4, 4), 4) == 16  # not worth it: sent whole
    cost = literal_cost([1.0], [1.0], params=[1010], p2p=INTER)
    block = replace(cost.anatomy.blocks[0], param_shapes=((100, 10), (10,)))
    cost.anatomy = replace(cost.anatomy, blocks=(block,))
    psgd = DataParallel(compression="powersgd", powersgd_rank=4)
    assert _sync(_bundles(2, psgd), cost) == pytest.approx(1800 / 4000)
    # Without parameter shapes: one square matrix (31 x 32) per block, 4 * 63 of its elements.
    bare = literal_cost([1.0], [1.0], params=[1010], p2p=INTER)
    assert _sync(_bundles(2, psgd), bare) == pytest.approx(252 * 4 / 4000)


def test_options_are_costed_never_searched():
    cost = _dp_cost()
    for dp in (DataParallel(bundle_sync="local:4"), DataParallel(aggregate="median")):
        ranked = search(cost, workload=Workload(nodes=2, per_node=2, batch=4, dp=dp))
        assert ranked and all(e.plan.dp == dp for e in ranked)
        assert min(e.plan.num_bundles for e in ranked) >= dp.min_bundles > 1
        assert {e.plan.grad_sync for e in ranked} == {"flat"}  # two hops under either name
    with pytest.raises(ConfigError, match="--aggregate"):
        search(
            cost,
            workload=Workload(nodes=1, per_node=2, batch=4, dp=DataParallel(aggregate="trimmed:1")),
        )
    with pytest.raises(ConfigError, match="--grad-compression"):
        DataParallel(compression="bf16", bundle_sync="local:4")


def test_meetings_and_error_feedback_hold_memory():
    """DiLoCo keeps an anchor, a drift and the outer momentum of the stage's 4000 bytes; PowerSGD
    its error feedback."""
    cost = _dp_cost()
    for dp, held in ((DataParallel(bundle_sync="diloco:4"), 3 * 4000), (DataParallel(), 0)):
        e = evaluate(cost, Plan((1,), 2, (0,), 1, 1, dp=dp), 2)
        assert e.memory[0].data_parallel == held
    e = evaluate(cost, Plan((1,), 2, (0,), 1, 1, dp=DataParallel(compression="powersgd")), 2)
    assert e.memory[0].data_parallel == 4000


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_each_message_on_the_critical_path_adds_its_one_way_time_to_the_step(schedule, stages):
    """One micro-batch of one row (4 bytes) through S stages: F = 1 s, B = 2 s each. The step
    waits for every activation and every gradient: 2 (S - 1) messages, each 0.5 s + 4 bytes at
    8 B/s from its send's start. The calls are the sending and receiving stages' own time, here
    spent where the stage would wait anyway: they add nothing."""
    calls = Overheads(send_call=0.25, send_call_per_byte=0.125, recv_call=0.5)
    plain = literal_cost([1.0] * stages, [2.0] * stages)
    link = Link(8.0, 0.5)
    costed = literal_cost([1.0] * stages, [2.0] * stages, p2p=link, overheads=calls)
    layout = _layout([1] * stages, 1, schedule)
    base = simulate(layout, plain).step_time
    assert base == pytest.approx(3.0 * stages)
    assert simulate(layout, costed).step_time == pytest.approx(base + 2 * (stages - 1) * 1.0)


def test_a_sends_call_takes_the_senders_time_and_a_receives_the_receivers():
    """Shape 1,1, 1F1B, M = 2 (F = 1 s, B = 2 s, free link), a send's call 0.25 s, a receive's
    0.5 s. Front: F0 0-1, its send's call 1-1.25, F1 1.25-2.25. Rear: A0 arrives at 1 (the link
    counts from the call's start), F0 1-2, B0 2-4, its send's call 4-4.25, then A1's receive call
    4.25-4.75 (A1 there since 2.25), F1 from 4.75."""
    calls = Overheads(send_call=0.25, recv_call=0.5)
    sim = simulate(
        _layout([1, 1], 2, "1f1b"),
        literal_cost([1.0, 1.0], [2.0, 2.0], overheads=calls),
        timeline=True,
    )
    starts = {(s.rank, s.label): s.start for s in sim.timeline if s.kind == COMPUTE}
    assert starts[0, "F1"] == pytest.approx(1.25)
    assert (starts[1, "F0"], starts[1, "B0"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert starts[1, "F1"] == pytest.approx(4.75)


@pytest.mark.parametrize("shape", [(1,), (2,), (4,)])
def test_one_stage_shapes_send_nothing_so_message_costs_change_nothing(shape):
    calls = Overheads(send_call=0.25, send_call_per_byte=0.125, recv_call=0.5, comm_action=1.0)
    blocks = {"params": [4, 4], "collective": Link(4.0, 0.0)}
    cost = literal_cost([1.0, 1.0], [2.0, 2.0], **blocks)
    costed = literal_cost([1.0, 1.0], [2.0, 2.0], overheads=calls, **blocks)
    layout = _layout(shape, 2, "1f1b", starts=[0], batch=2 * shape[0])
    assert simulate(layout, costed).step_time == pytest.approx(simulate(layout, cost).step_time)
