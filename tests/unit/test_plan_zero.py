"""``--zero 3`` in the planner: parameters, gradients and optimizer state divided over each stage's
shard group with one block gathered on top, each block's collectives inside every forward and
backward, and the search that shards where nothing fits in memory otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bundle import config as C
from bundle.errors import ConfigError
from bundle.plan import auto, planner, report
from bundle.plan.cluster import Link
from bundle.plan.cost import Execution
from bundle.plan.dataparallel import DataParallel
from bundle.plan.plans import Plan, evaluate
from bundle.plan.search import Limits, Workload, search, search_fitting
from tests.support.plan_fixtures import literal_cost, plan_script

BLOCKS = [1000, 2000, 1000, 1000, 1000, 1000, 1000, 1000]  # the largest block: 2,000 parameters
ZERO3 = DataParallel(zero=3)


def _cost(**kwargs):
    n = len(kwargs.get("params", BLOCKS))
    return literal_cost([1.0] * n, [1.0] * n, params=kwargs.pop("params", BLOCKS), **kwargs)


def _memory(plan: Plan, zero: int, batch: int = 8, **execution):
    cost = _cost(execution=Execution(**execution))
    return evaluate(cost, replace(plan, dp=DataParallel(zero=zero)), batch).memory


def _state(m) -> float:
    return m.params + m.grads + m.optimizer


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("width", [2, 4])
def test_zero_3_holds_a_1_over_w_share_and_one_gathered_block(width, optimizer):
    """9,000 parameters, one stage of width w: 36,000 bytes each of parameters and gradients,
    36,000 (momentum SGD) or 72,000 (Adam) of state; under --zero 3 a w-th of them, no DDP
    buckets, and the 2,000-parameter block's full parameters and gradients (16,000 bytes)."""
    plan = Plan((width,), 1, (0,), 1, width)
    (whole,) = _memory(plan, 0, optimizer=optimizer)
    (sharded,) = _memory(plan, 3, optimizer=optimizer)
    state = 4 * 9000 * (3 if optimizer == "sgd" else 4)
    assert _state(whole) == state and whole.buckets == 4 * 9000
    assert _state(sharded) == pytest.approx(state / width)
    assert sharded.buckets == 0.0 and sharded.gathered == 2 * 4 * 2000
    assert sharded.total == pytest.approx(state / width + 16000)
    assert (sharded.activations, sharded.buffers) == (whole.activations, whole.buffers)
    assert sharded.total < _memory(plan, 1, optimizer=optimizer)[0].total < whole.total


def test_the_shard_group_spans_the_bundles_under_flat_sync_and_one_bundle_under_hierarchical():
    plan = Plan((2,), 2, (0,), 1, 4)
    (flat,) = _memory(plan, 3)
    (hier,) = _memory(replace(plan, grad_sync="hierarchical"), 3)
    (whole,) = _memory(plan, 0)
    assert _state(flat) == pytest.approx(_state(whole) / 4)
    assert _state(hier) == pytest.approx(_state(whole) / 2)


def test_a_stage_of_one_replica_in_one_bundle_holds_everything_as_without_sharding():
    plan = Plan((2, 1), 1, (0, 4), 1, 3)
    wide, alone = _memory(plan, 3)
    assert alone == _memory(plan, 0)[1] and alone.gathered == 0.0
    assert wide.gathered > 0 and wide.params == _memory(plan, 0)[0].params / 2


def test_each_forward_gathers_and_each_backward_gathers_and_reduce_scatters():
    """Two blocks of 1,000 and 3,000 parameters (4,000 and 12,000 bytes), two replicas at 1,000
    bytes/s: every gather and every reduce-scatter moves half of each block, 8 s in all; a forward
    computes 2 s, a backward 2 s. Beside the compute the step is 8 + 16 s; after it, 28 s. No sync
    is left for the end of the step."""
    link = Link(1000.0, 0.0)
    plan = Plan((2,), 1, (0,), 1, 2, dp=ZERO3)
    for overlap, step in ((True, 24.0), (False, 28.0)):
        cost = _cost(params=[1000, 3000], collective=link, execution=Execution(overlap=overlap))
        sim = evaluate(cost, plan, 2).sim
        assert sim.step_time == pytest.approx(step)
        assert sim.sync == [0.0, 0.0] and sim.busy == [4.0, 4.0]
    # Hierarchical: shards over the bundle's 2, each shard (2,000 and 6,000 bytes) all-reduced
    # between the 2 bundles as well: 8 s more in the backward.
    cost = _cost(params=[1000, 3000], collective=link)
    hier = replace(plan, num_bundles=2, procs_per_node=4, grad_sync="hierarchical")
    assert evaluate(cost, hier, 4).sim.step_time == pytest.approx(32.0)


def _tight(device: float):
    return _cost(memory_bytes=device)


def test_the_search_picks_zero_3_where_nothing_fits_otherwise():
    """Data parallelism on 2 devices (one stage at most): 144,000 bytes per device without
    sharding, 126,000 with --zero 1, 70,000 with --zero 3 (54,000 + one 2,000-parameter block);
    on devices of 100,000 bytes only --zero 3 fits."""
    device, work = 100_000, Workload(nodes=1, per_node=2, batch=8)
    limits = Limits(max_stages=1)
    dp2 = Plan((2,), 1, (0,), 1, 2)
    assert [
        evaluate(_tight(device), replace(dp2, dp=DataParallel(zero=z)), 8).memory[0].total
        for z in (0, 1, 3)
    ] == [144_000, 126_000, 70_000]
    plain = search(_tight(device), workload=work, limits=limits)
    assert plain and not any(e.fits for e in plain)
    ranked = search_fitting(_tight(device), workload=work, limits=limits)
    best = ranked[0]
    assert best.fits and best.plan.dp.zero == 3 and best.plan.shape == (2,)
    assert "--zero 3" in report.command(best.plan, report.Job("mlp", 8, 1), _tight(device))
    assert any(not e.fits and e.plan.dp.zero == 0 for e in ranked)  # the run's own, after
    # Where a plan fits as asked, the search is the run's own.
    roomy = search_fitting(_tight(200_000), workload=work, limits=limits)
    assert roomy[0].fits and all(e.plan.dp.zero == 0 for e in roomy)
    # Options --zero 3 cannot run beside: the run's own plans, none fitting.
    bf16 = replace(work, dp=DataParallel(compression="bf16"))
    assert all(
        e.plan.dp.zero == 0 for e in search_fitting(_tight(device), workload=bf16, limits=limits)
    )


def test_bundle_shape_auto_runs_zero_3_where_nothing_fits_otherwise():
    cfg = C.RunConfig(parallel=C.ParallelConfig(shape=(2,)))
    request = planner.Request(
        model="mlp", batch=8, nodes=1, per_node=2, input_shape=(1,), num_classes=2, max_stages=1
    )
    best = auto._plan_shape(cfg, request, _tight(100_000))
    assert best.fits and best.plan.dp == ZERO3
    with pytest.raises(ConfigError, match="--bundle-shape"):
        auto._plan_shape(cfg, request, _tight(50_000))


def test_the_plan_shows_zero_3_and_its_gathered_block():
    cost = _cost()
    job = report.Job(model="mlp", batch=8, nodes=1)
    row = report.row(evaluate(cost, Plan((4,), 1, (0,), 1, 4, dp=ZERO3), 8), job, cost)
    (mem,) = row["memory_bytes"]
    assert mem["gathered"] == 16000 and mem["ddp_buckets"] == 0.0
    assert mem["params"] == mem["grads"] == 4 * 9000 / 4
    assert row["run"]["zero"] == 3 and "--zero 3" in row["command"]
    assert "--zero 3" in report.table([row], float("inf"))
    unsharded = report.row(evaluate(cost, Plan((4,), 1, (0,), 1, 4), 8), job, cost)
    assert "gathered" not in unsharded["memory_bytes"][0]
    script = plan_script()
    assert "(--zero 3)" in script._sharding(3, 3)
    assert "no plan fits in device memory without it" in script._sharding(0, 3)
    assert "(--zero 1)" in script._sharding(1, 1) and script._sharding(0, 0) == ""


def test_zero_3_runs_only_beside_a_plain_per_step_sync():
    assert ZERO3.flags() == ["--zero", "3"] and ZERO3.shardable
    assert not ZERO3.accepts((1,), 1) and ZERO3.accepts((1,), 2)
    for options in ({"compression": "bf16"}, {"aggregate": "median"}, {"bundle_sync": "local:4"}):
        with pytest.raises(ConfigError, match="--zero"):
            DataParallel(zero=3, **options)
        assert not DataParallel(**options).shardable
    with pytest.raises(ConfigError, match="--zero.*or 3"):
        DataParallel(zero=2)


def test_plan_py_takes_zero_3():
    script = plan_script()
    args = script.parse_args(["--model", "mlp_wide", "--zero", "3"])
    assert script._request(args, None).dp == ZERO3
    with pytest.raises(SystemExit):
        script.parse_args(["--model", "mlp_wide", "--zero", "2"])
