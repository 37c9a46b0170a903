"""The planner knows the optimizer: each one's state bytes per parameter (one table, beside where
the optimizers are built), counted in a plan's memory, divided over a stage group by ZeRO-1."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bundle import cli
from bundle import config as C
from bundle.config.options import BY_YAML_KEY
from bundle.engine import optim
from bundle.errors import ConfigError
from bundle.plan import auto, planner, report
from bundle.plan.cost import Execution
from bundle.plan.dataparallel import DataParallel
from bundle.plan.plans import Plan, evaluate, with_options
from bundle.plan.search import Workload, search
from tests.support.plan_fixtures import literal_cost, plan_script

PARAMS = [1000, 3000]  # two blocks; the stage of shape (1,) holds 4,000 parameters
PIPE = Plan((1, 1), 1, (0, 1), 2, 2)
DP = Plan((1,), 1, (0,), 1, 1)
ZERO = DataParallel(zero=1)


def _memory(plan: Plan, batch: int = 4, *, zero: int = 0, **execution):
    cost = literal_cost([1.0, 1.0], [1.0, 1.0], params=PARAMS, execution=Execution(**execution))
    return evaluate(cost, replace(plan, dp=DataParallel(zero=zero)), batch).memory


def test_every_optimizer_choice_has_a_state_row_and_no_other():
    assert set(optim.STATE_BYTES) == set(C.OPTIMIZERS)
    bogus = object.__new__(C.TrainConfig)  # as if the config's list had a name the table lacks
    object.__setattr__(bogus, "__dict__", {**C.TrainConfig().__dict__, "optimizer": "lion"})
    with pytest.raises(ConfigError, match="--optimizer.*choose one of: sgd, adamw, adam"):
        optim.state_bytes_per_param(bogus)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("name", C.OPTIMIZERS)
def test_each_row_is_the_state_torch_keeps_after_a_step(name, momentum):
    """The table's bytes per parameter are what the built optimizer holds after one step (less
    Adam's step count, one scalar per tensor)."""
    cfg = C.TrainConfig(optimizer=name, momentum=momentum)
    stage = torch.nn.Linear(16, 8)
    opt = optim.make_optimizer(cfg, stage)
    stage(torch.randn(4, 16)).sum().backward()
    opt.step()
    held = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for key, t in state.items()
        if isinstance(t, torch.Tensor) and key != "step"
    )
    count = sum(p.numel() for p in stage.parameters())
    assert optim.state_bytes_per_param(cfg) == held / count


def test_adam_holds_twice_momentum_sgds_state_and_plain_sgd_none():
    sgd, adam = _memory(PIPE), _memory(PIPE, optimizer="adam")
    plain = _memory(PIPE, momentum=0.0)
    assert [m.optimizer for m in sgd] == [1000 * 4, 3000 * 4]
    assert [m.optimizer for m in adam] == [2 * 1000 * 4, 2 * 3000 * 4]
    assert [m.optimizer for m in plain] == [0.0, 0.0]
    # Only the state differs: Adam's device holds one more fp32 copy of its parameters.
    assert [a.total - s.total for a, s in zip(adam, sgd, strict=True)] == [4000, 12000]
    assert [replace(a, optimizer=0) for a in adam] == [replace(s, optimizer=0) for s in sgd]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_zero_1_divides_the_state_by_the_stage_groups_size_across_bundles(optimizer):
    """Shape 2,1 in 2 bundles: stage 0's group is 4 replicas, stage 1's is 2."""
    plan = Plan((2, 1), 2, (0, 1), 1, 6)
    whole = _memory(plan, batch=8, optimizer=optimizer)
    sharded = _memory(plan, batch=8, optimizer=optimizer, zero=1)
    assert sharded[0].optimizer == pytest.approx(whole[0].optimizer / 4)
    assert sharded[1].optimizer == pytest.approx(whole[1].optimizer / 2)
    assert [replace(m, optimizer=0) for m in sharded] == [replace(m, optimizer=0) for m in whole]


def test_zero_1_plans_only_shapes_with_replicas_to_share_with():
    """Every stage of one replica in one bundle: main.py refuses --zero 1, so no plan offers it."""
    assert not ZERO.accepts((1, 1), 1) and ZERO.accepts((1, 1), 2) and ZERO.accepts((2, 1), 1)
    cost = literal_cost([1.0, 1.0], [1.0, 1.0], params=PARAMS)
    ranked = search(cost, workload=Workload(nodes=1, per_node=2, batch=4, dp=ZERO))
    assert ranked and all(max(e.plan.shape) * e.plan.num_bundles > 1 for e in ranked)
    assert all("--zero 1" in report.command(e.plan, report.Job("mlp", 4, 1), cost) for e in ranked)
    # The data-parallel baseline plan.py compares with is costed with ZeRO-1 where it can run.
    assert with_options(DP, ZERO) == DP
    assert with_options(Plan((2,), 1, (0,), 1, 2), ZERO).dp == ZERO


def _fits(plan: Plan, device: float, *, zero: int = 0, **execution) -> bool:
    cost = literal_cost(
        [1.0, 1.0], [1.0, 1.0], params=PARAMS, memory_bytes=device, execution=Execution(**execution)
    )
    return evaluate(cost, replace(plan, dp=DataParallel(zero=zero)), 4).fits


def test_a_plan_that_fits_with_sgd_does_not_fit_with_adam_between_the_two():
    sgd, adam = _memory(DP)[0].total, _memory(DP, optimizer="adam")[0].total
    assert adam == sgd + 4000 * 4
    device = (sgd + adam) / 2
    assert _fits(DP, device)
    assert not _fits(DP, device, optimizer="adam") and not _fits(DP, device, optimizer="adamw")


def test_zero_1_over_two_bundles_makes_adam_fit_where_momentum_sgd_fits():
    """Sharded over 2 replicas, Adam's two copies are one per device: momentum SGD's memory."""
    two = Plan((1,), 2, (0,), 1, 2)
    assert _memory(two, optimizer="adam", zero=1) == _memory(two)
    device = _memory(two)[0].total + 1000
    assert _fits(two, device) and _fits(two, device, optimizer="adam", zero=1)
    assert not _fits(two, device, optimizer="adam")


def test_the_request_carries_the_optimizer_into_the_cost_model():
    request = planner.Request(
        model="mlp_wide", batch=8, nodes=1, per_node=2, input_shape=(1, 4, 4), num_classes=2
    )
    assert request.execution().state_bytes == 4  # the trainer's default: SGD with momentum
    assert replace(request, optimizer="adam").execution().state_bytes == 8
    for flag, values in {
        "--optimizer": {"optimizer": "lion"},
        "--momentum": {"momentum": 1.5},
    }.items():
        with pytest.raises(ConfigError, match=flag):
            planner.check(replace(request, **values), None)
    with pytest.raises(ConfigError, match="--zero"):
        DataParallel(zero=2)


def test_bundle_shape_auto_plans_for_the_runs_optimizer_and_zero():
    cfg = C.RunConfig(
        train=C.TrainConfig(optimizer="adamw", momentum=0.0),
        parallel=C.ParallelConfig(shape=(2,), zero=1),
    )
    request = auto._request(cfg, 1, 2)
    assert (request.optimizer, request.momentum, request.dp) == ("adamw", 0.0, ZERO)


def test_plan_py_defaults_to_the_trainers_optimizer():
    script = plan_script()
    args = script.parse_args(["--model", "mlp_wide"])
    train = C.TrainConfig()
    assert (args.optimizer, args.momentum, args.zero) == (train.optimizer, train.momentum, 0)
    args = script.parse_args(["--model", "mlp_wide", "--optimizer", "adam", "--zero", "1"])
    request = script._request(args, None)
    assert (request.optimizer, request.dp) == ("adam", ZERO)


def test_the_report_shows_the_state_and_runs_with_the_optimizer_it_was_planned_for():
    cost = literal_cost(
        [1.0, 1.0], [1.0, 1.0], params=PARAMS, execution=Execution(optimizer="adam")
    )
    job = report.Job(model="mlp", batch=4, nodes=1, optimizer="adam")
    row = report.row(evaluate(cost, replace(PIPE, num_bundles=2, dp=ZERO), 8), job, cost)
    assert [m["optimizer"] for m in row["memory_bytes"]] == [8000 / 2, 24000 / 2]
    assert row["run"]["optimizer"] == "adam" and row["run"]["zero"] == 1
    assert set(row["run"]) <= set(BY_YAML_KEY)
    assert "--zero 1" in row["command"] and "--optimizer adam" in row["command"]
    cfg = cli.parse(row["command"].split()[2:], {})  # main.py runs what was planned
    assert (cfg.train.optimizer, cfg.parallel.zero) == ("adam", 1)
    head, first = report.table([row], float("inf")).splitlines()[:2]
    assert "opt GiB" in head and f"{12000 / 2**30:.2f}" in first
    default = report.row(evaluate(cost, PIPE, 4), report.Job(model="mlp", batch=4, nodes=1), cost)
    assert "--optimizer" not in default["command"] and "optimizer" not in default["run"]
