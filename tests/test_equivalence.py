"""Gradient equivalence: hybrid training == one process training the unsplit model on the same batches.

For every shape x bundles x schedule x micro-batches x sync strategy, K steps of SGD with momentum
and weight decay give the same parameters (1e-5) on every replica of every stage. Global batches
are chosen so that bundle, micro-batch and replica row splits are uneven.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from bundle import data
from bundle.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from bundle.localworld import run_world
from bundle.worker import build_session, make_topology, train_stream

STEPS = 3
TOL = 1e-5
SHAPES = [(1,), (2,), (1, 1), (2, 1), (1, 2), (2, 3), (1, 1, 1), (2, 2, 1)]
VARIANTS = list(itertools.product(("gpipe", "1f1b"), (1, 3), ("flat", "hierarchical")))


def _config(shape, bundles, schedule, micro, sync, model) -> RunConfig:
    return RunConfig(
        parallel=ParallelConfig(
            shape=shape,
            num_bundles=bundles,
            micro_batches=micro,
            schedule=schedule,
            grad_sync=sync,
            # tiny buckets with 3 micro-batches: every parameter syncs in its own bucket
            bucket_mb=0.001 if micro == 3 else 25.0,
        ),
        model=ModelConfig(name=model),
        data=DataConfig(dataset="synthetic", image_size=4, num_classes=5, synthetic_size=128),
        # 23 rows: bundles of 12/11, micro-batches of 4/4/3 (or 4/4/4), replicas of 2/1/1 ...
        train=TrainConfig(
            batch_size=23, steps=STEPS, lr=0.1, momentum=0.9, weight_decay=0.01, seed=7, eval=False
        ),
    )


def reference(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """One process, the unsplit model, the same global batches, mean loss over each batch."""
    splits = data.load(cfg.data, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = models.build(
        cfg.model.name, num_classes=splits.num_classes, input_shape=splits.input_shape
    )
    opt = torch.optim.SGD(
        model.parameters(),
        lr=cfg.train.lr,
        momentum=cfg.train.momentum,
        weight_decay=cfg.train.weight_decay,
    )
    x, y = splits.train.tensors
    for step in range(cfg.train.steps):
        idx = data.global_batch(len(y), cfg.train.batch_size, cfg.train.seed, step)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _hybrid(rank: int, world: int, shape, bundles) -> list[str]:
    """Runs every variant in one world of processes; rank 0 returns the mismatches found."""
    failures, refs = [], {}
    for schedule, micro, sync in VARIANTS:
        model = "skip_mlp" if len(shape) > 1 and micro == 3 else "mlp"
        cfg = _config(shape, bundles, schedule, micro, sync, model)
        topo = make_topology(cfg)
        session = build_session(cfg, topo, rank, torch.device("cpu"))
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.runner.train_step(step, next(batches))
        mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), mine), gathered, dst=0)
        if rank != 0:
            continue
        if model not in refs:
            refs[model] = reference(cfg)
        ref = refs[model]
        seen = set()
        for coord, params in gathered:
            for name, value in params.items():
                seen.add(name)
                err = (value - ref[name]).abs().max().item()
                if err > TOL:
                    failures.append(
                        f"{schedule} M={micro} {sync} {model} {coord}: {name} off by {err:.2e}"
                    )
        if seen != set(ref):
            failures.append(
                f"{schedule} M={micro} {sync}: parameters not covered: {set(ref) - seen}"
            )
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("bundles", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(map(str, s)))
def test_hybrid_equals_single_process(shape, bundles):
    results = run_world(sum(shape) * bundles, _hybrid, shape, bundles)
    assert results[0] == [], "\n".join(results[0])


def test_reference_moves_parameters():
    """The comparison is not vacuous: training changes the parameters well beyond the tolerance."""
    cfg = _config((1,), 1, "gpipe", 1, "flat", "mlp")
    splits = data.load(cfg.data, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    init = dict(
        models.build(
            "mlp", num_classes=splits.num_classes, input_shape=splits.input_shape
        ).named_parameters()
    )
    trained = reference(cfg)
    assert max((trained[k] - init[k]).abs().max().item() for k in init) > 1e3 * TOL
