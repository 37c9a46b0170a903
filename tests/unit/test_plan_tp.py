"""Tensor parallelism per stage in the planner: a stage's costs at degree t (``bundle.plan.tensor``),
the search over degrees, and the table, command and JSON that carry ``--tensor-parallel``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bundle.config import options
from bundle.config.job import parse_degrees
from bundle.data import TEXT_VOCAB
from bundle.plan import planner, report, tensor
from bundle.plan.anatomy import ModelSpec
from bundle.plan.cluster import Link, counted, load_cluster
from bundle.plan.plans import Plan, evaluate
from bundle.plan.profile import ProfileCache, Timings, measure_timings, split_for_timing
from bundle.plan.search import Limits, Workload, search
from tests.support.plan_fixtures import literal_cost

ROOT = Path(__file__).resolve().parents[2]
NVLINK = Link(bandwidth=1e3, latency=1e-3)  # 1,000 bytes/s: all-reduces big enough to see
# Four blocks of 1,000 parameters; blocks 1 and 2 split 800 of theirs, 2 rowwise layers each.
PARAMS = [1000, 1000, 1000, 1000]
SPLIT = tensor.Split(
    params=(0.0, 800.0, 800.0, 0.0),
    trained=(0.0, 800.0, 800.0, 0.0),
    reduces=(0, 2, 2, 0),
    degrees=(1, 2, 4, 8),
)


def _cost(split: tensor.Split = SPLIT, **kwargs):
    base = literal_cost([1.0] * 4, [2.0] * 4, params=PARAMS, collective=NVLINK, **kwargs)
    return tensor.Splittable.of(base, split)


def test_degree_2_halves_the_split_bytes_and_adds_two_all_reduces_each_way():
    cost = _cost()
    two = tensor.at(cost, 2)
    # Parameters, gradients and optimizer state: the split 1,600 halved, the other 2,400 whole.
    assert cost.param_bytes(0, 4) == 4 * 4000
    assert two.param_bytes(0, 4) == 4 * (2400 + 800)
    assert two.grad_bytes(1, 2) == 4 * 600
    # 3 rows: each block's output is 3 fp32 floats; a ring of 2: 2 (1/2) 12 B / 1000 B/s + 2 ms.
    fwd, bwd, _ = cost.block_times(3)
    fwd2, bwd2, _ = two.block_times(3)
    ring = 2 * 0.5 * 12 / 1e3 + 2 * 1e-3
    expected = np.array([0.0, 2 * ring, 2 * ring, 0.0])
    np.testing.assert_allclose(fwd2, fwd / 2 + expected)
    np.testing.assert_allclose(bwd2, bwd / 2 + expected)
    assert tensor.at(cost, 1) is cost


def test_a_measured_split_replaces_compute_divided_by_the_degree():
    """Where the planner timed the split model on this CPU, a stage at that degree costs those
    timings (plus its sums), not the whole model's / t; another degree still divides."""
    split_fwd, split_bwd = [0.1, 0.7, 0.9, 0.3], [0.2, 1.3, 1.7, 0.4]
    timed = Timings("cpu", "fp32", (1,), (tuple(split_fwd),), (tuple(split_bwd),), (0.05,), 0.0)
    base = literal_cost([1.0] * 4, [2.0] * 4, params=PARAMS, collective=NVLINK)
    cost = tensor.Splittable.of(base, SPLIT, {2: timed})
    fwd, _, _ = cost.block_times(3)
    fwd2, bwd2, loss2 = tensor.at(cost, 2).block_times(3)
    ring = 2 * 0.5 * 12 / 1e3 + 2 * 1e-3
    comm = np.array([0.0, 2 * ring, 2 * ring, 0.0])
    np.testing.assert_allclose(fwd2, 3 * np.array(split_fwd) + comm)  # 3 rows, from one timed
    np.testing.assert_allclose(bwd2, 3 * np.array(split_bwd) + comm)
    assert loss2 == pytest.approx(0.15)
    fwd4, _, _ = tensor.at(cost, 4).block_times(3)
    np.testing.assert_allclose(fwd4, fwd / 4 + tensor.reduce_seconds(cost, SPLIT, 4, 3))


def test_the_split_model_is_timed_as_one_process_holds_it():
    """``profile.split_for_timing``: GPT's planned layers hold 1/t of their outputs, its sums are
    skipped, and it runs (so the planner can time it)."""
    import torch

    spec = ModelSpec("gpt", (8,), TEXT_VOCAB, args="layers=1,width=16,heads=2")
    whole, split = spec.build(), split_for_timing(spec.build(), 2)
    sizes = {n: p.shape for n, p in whole.named_parameters()}
    halved = [n for n, p in split.named_parameters() if p.shape != sizes[n]]
    assert halved and all(
        split.get_parameter(n).numel() * 2 == whole.get_parameter(n).numel() for n in halved
    )
    out = split(torch.randint(0, TEXT_VOCAB, (2, 8)))
    out.sum().backward()
    assert out.shape == whole(torch.randint(0, TEXT_VOCAB, (2, 8))).shape
    timed = measure_timings(spec, rows=(2,), passes=(0, 1), tp_degree=2)
    assert len(timed.fwd[0]) == len(whole_blocks(spec)) and min(timed.fwd[0]) > 0


def whole_blocks(spec: ModelSpec) -> list:
    from bundle import models

    return models.blocks(spec.build(), spec.input_shape)


def test_a_degree_the_model_does_not_take_is_refused():
    cost = _cost(tensor.Split(SPLIT.params, SPLIT.trained, SPLIT.reduces, (1, 2)))
    with pytest.raises(ValueError, match="--tensor-parallel 4"):
        tensor.at(cost, 4)


def test_memory_forces_tensor_parallelism_where_one_device_cannot_hold_a_replica():
    """Momentum SGD, one stage of 2 devices: at degree 1 a replica holds 16 B a parameter
    (parameters, gradients, momentum, DDP's buckets) = 64,000 B; at degree 2, 40,400 B."""
    cost = _cost(memory_bytes=50_000)
    work = Workload(nodes=1, per_node=2, batch=4)
    best = search(cost, workload=work, limits=Limits(max_stages=1))[0]
    assert best.fits and best.plan.tp == (2,) and best.plan.shape == (1,)
    assert best.memory[0].params + best.memory[0].grads == 4 * 3200 * 2
    roomy = search(_cost(), workload=work, limits=Limits(max_stages=1))
    unsplit = [e for e in roomy if not e.plan.tp]
    assert unsplit and all(not e.fits or e.plan.tp or e in unsplit for e in roomy)
    # Without the split known, nothing is planned with TP, and nothing fits.
    plain = literal_cost([1.0] * 4, [2.0] * 4, params=PARAMS, memory_bytes=50_000)
    ranked = search(plain, workload=work, limits=Limits(max_stages=1))
    assert all(not e.plan.tp for e in ranked) and not any(e.fits for e in ranked)


def test_degrees_beyond_the_devices_of_a_node_are_never_chosen():
    """Memory wants degree 4 (8,200 B at 2, 6,600 at 4... per device); a node of 2 allows 2."""
    cost = _cost(memory_bytes=45_000)
    assert tensor.degrees(cost, 2) == (1, 2)
    assert tensor.degrees(cost, 6) == (1, 2)  # 4 does not divide a node of 6
    ranked = search(cost, workload=Workload(nodes=2, per_node=2, batch=8))
    assert ranked and all(max(e.plan.degrees) <= 2 for e in ranked)
    wide = search(cost, workload=Workload(nodes=1, per_node=8, batch=8), limits=Limits())
    assert any(max(e.plan.degrees) > 2 for e in wide)


def test_a_model_without_a_plan_is_never_split_and_gpt_takes_the_degrees_its_heads_divide():
    mlp = ModelSpec("mlp_wide", (3, 18, 18), 10)
    assert tensor.split_of(mlp, 99) is tensor.NONE
    gpt = ModelSpec("gpt", (16,), 64, "layers=2,width=48,heads=6")
    split = tensor.split_of(gpt, 5)  # embed, 2 layers, ln_f, head
    assert split.degrees == (1, 2)  # 6 heads: 4 does not divide them; 3 is not searched
    assert split.reduces == (0, 2, 2, 0, 0)
    # qkv 48x144 + bias, mlp.0 48x192 + bias split; proj and mlp.2 weights split, biases whole.
    per_layer = 48 * 144 + 144 + 48 * 192 + 192 + 48 * 48 + 192 * 48
    assert split.params == (0, per_layer, per_layer, 0, 0)
    plain = literal_cost([1.0] * 4, [2.0] * 4)
    assert tensor.Splittable.of(plain, tensor.NONE) is plain
    assert tensor.degrees(plain, 8) == (1,)


def test_the_command_json_and_table_carry_the_degrees_per_stage():
    cost = _cost()
    plan = Plan((1, 2), 1, (0, 2), 2, 4, tp=(2, 1))
    e = evaluate(cost, plan, 4)
    job = report.Job(model="gpt", batch=4, nodes=1)
    row = report.row(e, job, cost)
    assert "--tensor-parallel 2,1" in row["command"]
    assert row["tensor_parallel"] == [2, 1] and row["processes"] == 4
    assert row["run"]["tensor_parallel"] == "2,1"
    # main.py --plan reads the key as --tensor-parallel's text (bundle.cli, bundle.plan_file).
    opt = options.BY_YAML_KEY["tensor_parallel"]
    saved = opt.from_yaml(json.loads(json.dumps(row))["run"]["tensor_parallel"], "x")
    assert opt.flag == "--tensor-parallel" and parse_degrees(saved) == (2, 1)
    text = report.table([row], float("inf"))
    head, line = text.splitlines()[:2]
    assert " tp " in head and " 2,1 " in line
    uniform = report.row(evaluate(cost, Plan((1, 1), 1, (0, 2), 2, 4, tp=(2, 2)), 4), job, cost)
    assert "--tensor-parallel 2 " in uniform["command"] + " "
    none = report.row(evaluate(cost, Plan((2, 2), 1, (0, 2), 2, 4), 4), job, cost)
    assert "--tensor-parallel" not in none["command"] and "tensor_parallel" not in none["run"]
    assert " tp " not in report.table([none], float("inf")).splitlines()[0]


def test_the_first_stage_alone_takes_degree_2_where_its_sync_is_the_one_exposed():
    """docs/planner.md's per-stage example, on a smaller search: a 6.3B GPT on 2 nodes of 8 H100s
    (Adam, batch 128, at most 2 stages). Stage 0 at degree 2 halves the gradient it syncs after
    the step's last backward; stage 1, whose sync runs beside stage 0's last backwards, skips
    the all-reduces at degree 1. The plan beats every plan with one degree for all stages."""
    request = planner.Request(
        model="gpt",
        batch=128,
        nodes=2,
        per_node=8,
        input_shape=(2048,),
        num_classes=TEXT_VOCAB,
        precision="bf16",
        optimizer="adam",
        max_stages=2,
        max_micro=16,
        model_args="layers=31,width=4096,heads=32",
    )
    cluster, _ = counted(load_cluster(ROOT / "clusters" / "h100_2x8_ib.yaml"), 2, 8)
    cost = planner.cost_model(request, cluster=cluster, cache=ProfileCache(None))
    schedules = ("1f1b", "interleaved-1f1b")

    def best(limits: Limits):
        return search(cost, workload=request.workload, limits=limits, schedules=schedules)[0]

    chosen = best(request.limits)
    uniform = best(replace(request.limits, per_stage=False))
    assert chosen.fits and chosen.plan.shape == (4, 8) and chosen.plan.tp == (2, 1)
    assert len(set(uniform.plan.degrees)) == 1
    assert chosen.samples_per_s > 1.01 * uniform.samples_per_s


def test_a_split_that_cannot_be_timed_leaves_its_degree_divided_and_says_so(monkeypatch):
    """Planning goes on when the split model fails to run: that degree is costed as the whole
    model's / t, and the plan's notes say why."""
    from bundle.plan import calibrate
    from bundle.plan import profile as prof
    from bundle.plan.cost import Overheads

    whole = Timings("cpu", "fp32", (1,), ((1.0,),), ((2.0,),), (0.0,), 0.0)

    def timings(spec, cache, *, tp_degree=1, **_):
        if tp_degree == 4:
            raise RuntimeError("shape mismatch\nsecond line")
        return whole

    monkeypatch.setattr(calibrate, "engine", lambda cache: Overheads())
    monkeypatch.setattr(prof, "timings", timings)
    monkeypatch.setattr(planner, "_split_degrees", lambda request, n: (2, 4))
    monkeypatch.setattr(
        planner,
        "_measure_links",
        lambda request, cluster, cache, device, t, o, s: planner.Measured(t, o, None),  # type: ignore[arg-type]
    )
    request = planner.Request(
        model="gpt", batch=4, nodes=1, per_node=4, input_shape=(8,), num_classes=TEXT_VOCAB
    )
    cache = ProfileCache(None)
    got = planner.measure(request, cluster=None, cache=cache, device_type="cpu")
    assert set(got.split_timings) == {2}
    assert cache.notes == [
        "gpt split 4 ways could not be timed (RuntimeError: shape mismatch): a stage at degree 4 "
        "is costed as the whole model's time / 4"
    ]
