"""The planner knows what ``--lora`` freezes: the model is counted as it trains, frozen parameters
take memory but no gradient, optimizer state or sync, a frozen layer's backward has no weight
half, and the best plan for a LoRA run can be another shape than full fine-tuning's."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from bundle import config as C
from bundle.errors import ConfigError
from bundle.plan import auto, planner, report
from bundle.plan import profile as prof
from bundle.plan.anatomy import ModelSpec, count
from bundle.plan.cluster import Link
from bundle.plan.cost import CostModel, Execution
from bundle.plan.dataparallel import DataParallel
from bundle.plan.plans import Plan, evaluate
from tests.support.plan_fixtures import literal_cost, plan_script

PARAMS = [1000, 3000]
FROZEN = [1000, 2900]  # a LoRA run: the first block frozen whole, 100 adapter parameters left
TRAINED = sum(PARAMS) - sum(FROZEN)
DP = Plan((2,), 1, (0,), 1, 2)  # one stage of two replicas: synced flat (DDP's buckets)


def _cost(frozen: list[int], *, collective: Link | None = None, **execution) -> CostModel:
    base = literal_cost(
        [1.0] * len(PARAMS),
        [1.0] * len(PARAMS),
        params=PARAMS,
        execution=Execution(**execution),
        **({"collective": collective} if collective else {}),
    )
    blocks = tuple(replace(b, frozen=f) for b, f in zip(base.anatomy.blocks, frozen, strict=True))
    return CostModel(
        anatomy=replace(base.anatomy, blocks=blocks),
        cluster=base.cluster,
        timings=base.timings,
        overheads=base.overheads,
        execution=base.execution,
    )


def _memory(frozen: list[int], plan: Plan = DP, zero: int = 0):
    cost = _cost(frozen, optimizer="adam")  # 8 bytes of state per parameter
    return evaluate(cost, replace(plan, dp=DataParallel(zero=zero)), 4).memory[0]


def test_memory_charges_no_gradient_or_optimizer_state_to_frozen_parameters():
    whole, lora = _memory([0, 0]), _memory(FROZEN)
    assert whole.params == lora.params == sum(PARAMS) * 4  # frozen parameters are still held
    assert (whole.grads, whole.optimizer, whole.buckets) == (16000, 32000, 16000)
    assert (lora.grads, lora.optimizer, lora.buckets) == (TRAINED * 4, TRAINED * 8, TRAINED * 4)
    assert whole.total - lora.total == (sum(PARAMS) - TRAINED) * (4 + 8 + 4)


def test_zero_shards_the_frozen_base_but_reduces_and_steps_only_what_trains():
    one, three = _memory(FROZEN, zero=1), _memory(FROZEN, zero=3)
    assert one.optimizer == TRAINED * 8 / 2
    assert three.params == sum(PARAMS) * 4 / 2 and three.grads == TRAINED * 4 / 2
    assert three.gathered == (3000 + 100) * 4  # the largest block's parameters, its gradient


def test_the_gradient_sync_moves_only_what_trains():
    slow = Link(1e6, 0.0)  # 1 MB/s between the two replicas: the sync is most of the step
    whole, lora = _cost([0, 0], collective=slow), _cost(FROZEN, collective=slow)
    assert lora.grad_bytes(0, 2) == TRAINED * 4 and lora.param_bytes(0, 2) == 16000
    assert sum(n for _, n in lora.buckets(0, 2, ddp=True)) == TRAINED * 4
    # A ring all-reduce of two: each byte crosses once.
    assert max(evaluate(whole, DP, 4).sim.sync) == pytest.approx(16000 / 1e6, rel=0.05)
    assert max(evaluate(lora, DP, 4).sim.sync) == pytest.approx(TRAINED * 4 / 1e6, rel=0.05)


def test_a_frozen_blocks_backward_is_all_input_gradient():
    cost = _cost(FROZEN)
    assert list(cost.weight_share(0, 2)) == [0.0, pytest.approx(100 / 3100)]
    assert list(_cost([0, 0]).weight_share(0, 2)) == [cost.WEIGHT_SHARE] * 2
    rows = 4
    assert cost.backward_weight(1, 2, rows, recompute=False) == pytest.approx(4 * 100 / 3100)
    assert cost.backward_input(1, 2, rows, recompute=False) == pytest.approx(4 * 3000 / 3100)


def test_the_model_is_counted_as_the_run_trains_it(tmp_path):
    spec = ModelSpec("mlp", (1, 4, 4), 3)
    lora = replace(spec, lora="r=2,targets=hidden.1.fc", lora_train="head")
    model = lora.build(meta=True)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains == {
        "hidden.1.fc.lora_A.weight",
        "hidden.1.fc.lora_B.weight",
        "head.weight",
        "head.bias",
    }
    whole, adapted = count(spec), prof.anatomy(lora, prof.ProfileCache(tmp_path))
    by_name = {b.name: b for b in adapted.blocks}
    assert by_name["hidden.0"].trained == 0 and by_name["head"].frozen == 0
    assert by_name["hidden.1"].trained == 2 * 256 + 256 * 2
    assert by_name["hidden.1"].param_shapes == ((2, 256), (256, 2))
    # A frozen linear layer's backward: its input's gradient, no weight gradient (half the FLOPs).
    flops = [sum(op[0] for op in b.bwd_ops) for b in (whole.blocks[2], adapted.blocks[2])]
    assert flops[1] == pytest.approx(flops[0] / 2, rel=0.05)
    # Cached apart from the model that trains whole.
    assert prof.anatomy(spec, prof.ProfileCache(tmp_path)).blocks[2].frozen == 0


def test_a_target_the_model_lacks_is_refused_naming_the_flag():
    request = planner.Request(
        model="mlp", batch=4, nodes=1, per_node=2, input_shape=(1, 4, 4), num_classes=3
    )
    with pytest.raises(ConfigError, match="--lora"):
        planner.check(replace(request, lora="r=0"), None)
    with pytest.raises(ConfigError, match="--lora-train"):
        planner.check(replace(request, lora_train="head"), None)
    with pytest.raises(ConfigError, match="matches no module"):
        count(replace(request, lora="targets=qkv").spec)


# docs/planner.md's case: GPT-2 small's shape on two nodes joined by 10 Gb/s Ethernet, AdamW.
COMMAND = (
    "python scripts/plan.py --model gpt --model-args layers=12,width=768,heads=12 "
    "--cluster clusters/v100_4x4_eth.yaml --nodes 2 --batch-size 64 --optimizer adamw --top 3"
)


def test_lora_changes_the_best_plans_shape():
    """Full fine-tuning syncs 342 MB of gradients a step over Ethernet: a pipeline keeps that
    inside the nodes. A LoRA run syncs 1.2 MB: data parallelism wins."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    assert f"{COMMAND}\n" in docs and f"{COMMAND} --lora r=8\n" in docs
    script = plan_script()
    best = {}
    for lora in ([], ["--lora", "r=8"]):
        args = script.parse_args([*shlex.split(COMMAND)[2:], *lora])
        cluster = script._cluster(args)
        request = script._request(args, cluster)
        cost = planner.cost_model(request, cluster=cluster, cache=prof.ProfileCache(None))
        best[bool(lora)] = planner.plan(request, cost)[0].plan
    full, lora = best[False], best[True]
    assert len(full.shape) > 1 and full.micro_batches > 1  # a pipeline
    assert len(lora.shape) == 1 and lora.micro_batches == 1  # data parallel
    assert (full.shape, full.micro_batches) != (lora.shape, lora.micro_batches)


def test_plan_py_and_bundle_shape_auto_plan_for_the_runs_lora():
    script = plan_script()
    args = script.parse_args(["--model", "mlp", "--lora", "r=4", "--lora-train", "head"])
    request = script._request(args, None)
    assert (request.lora, request.lora_train) == ("r=4", "head")
    assert request.spec.lora == "r=4" and request.spec.lora_train == "head"
    extra = script._extra(args, script._data(args))
    assert extra[-4:] == ("--lora", "r=4", "--lora-train", "head")
    job = report.Job(model="mlp", batch=4, nodes=1, extra=extra)
    cost = _cost(FROZEN)
    run = report.run_options(DP, job, cost)
    assert (run["lora"], run["lora_train"]) == ("r=4", "head")
    assert "--lora r=4 --lora-train head" in report.command(DP, job, cost)
    cfg = C.RunConfig(model=C.ModelConfig(name="mlp", lora="r=4", lora_train="head"))
    spec = auto._request(cfg, 1, 2).spec
    assert (spec.lora, spec.lora_train) == ("r=4", "head")
