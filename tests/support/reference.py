"""Gradient equivalence's yardstick: one process training the unsplit model on the same global
batches, and the small configs the equivalence tests run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from bundle import data, models
from bundle.config import RunConfig
from bundle.data import loader
from bundle.engine.optim import make_optimizer
from bundle.lr_schedule import LRSchedule
from bundle.session import make_loss
from tests.support.config import make_config

STEPS = 3
TOL = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def equivalence_config(
    shape,
    bundles,
    schedule,
    micro,
    sync,
    model,
    precision="fp32",
    recompute="never",
    sections: dict | None = None,
    chunks: int = 1,
) -> RunConfig:
    """Synthetic 4x4 images in 5 classes; 23 rows a batch: bundles of 12/11, micro-batches of
    4/4/3 (or 4/4/4), replicas of 2/1/1 ... all uneven. ``sections`` change fields of theirs
    (``{"data": {"image_size": 8}}``), as ``make_config`` does; ``chunks``: --virtual-stages."""
    cfg = make_config(
        parallel={
            "shape": shape,
            "num_bundles": bundles,
            "micro_batches": micro,
            "schedule": schedule,
            "virtual_stages": chunks,
            "grad_sync": sync,
            # tiny buckets with 3 micro-batches: every parameter syncs in its own bucket
            "bucket_mb": 0.001 if micro == 3 else 25.0,
        },
        model={"name": model},
        data={"dataset": "synthetic", "image_size": 4, "num_classes": 5, "synthetic_size": 128},
        train={
            "batch_size": 23,
            "steps": STEPS,
            "lr": 0.1,
            "momentum": 0.9,
            "weight_decay": 0.01,
            "seed": 7,
            "eval": False,
        },
        compute={"precision": precision, "recompute": recompute},
    )
    return replace(
        cfg,
        **{n: replace(getattr(cfg, n), **change) for n, change in (sections or {}).items()},
    )


def reference(
    cfg: RunConfig,
    steps: int | None = None,
    grads: dict[str, torch.Tensor] | None = None,
    rows: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One process, the unsplit model (adapted where ``--lora`` is given), the same global
    batches, mean loss over each batch (``rows(step, batch)``, when given: over the rows of it
    that took part).

    Mixed precision: the forward under the same autocast, the loss in fp32, fp16 through
    ``torch.amp.GradScaler`` (the anchor Bundle's loss scaling follows). ``grads``, when given,
    receives the first step's gradient of every parameter."""
    splits = data.load(cfg.data, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = models.build_model(cfg.model, splits.num_classes, splits.input_shape)
    models.adapt(model, cfg.model, seed=cfg.train.seed)  # --lora: adapters, as build_stages
    opt = make_optimizer(cfg.train, model)
    schedule = LRSchedule.of(
        cfg.train,
        steps_per_epoch=data.steps_per_epoch(len(splits.train), cfg.train.batch_size),
        total=cfg.train.steps,
    )
    loss_fn = make_loss(cfg)
    n = data.size(splits.train)
    precision = cfg.compute.precision
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for step in range(cfg.train.steps if steps is None else steps):
        idx = data.global_batch(n, cfg.train.batch_size, cfg.train.seed, step)
        idx = rows(step, idx) if rows is not None else idx
        # The batch as a stage reads it: one tensor, or named inputs (models.inputs).
        x, y = next(loader.micro_batches(splits.train, [idx], workers=0))
        schedule.apply(opt, step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=DTYPES.get(precision), enabled=precision in DTYPES):
            out = models.forward(model, x, cfg.model.output)
        scaler.scale(loss_fn(out.float(), y)).backward()
        if grads is not None and step == 0:
            grads.update(
                {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}
            )
        scaler.step(opt)
        scaler.update()
    # Tied weights under each of their names: every stage holding one is compared.
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def runnable_micro(schedule: str, stages: int, micro: int, chunks: int = 1) -> int:
    """The fewest micro-batches from ``micro`` up that ``schedule`` runs on ``stages`` stages
    (ZBV needs 2S - 1; interleaving, whole rounds): each schedule is proven where it runs."""
    from bundle.errors import ScheduleError
    from bundle.ir.schedule import actions

    for m in range(micro, micro + 4 * stages):
        try:
            actions(schedule, 0, stages, m, chunks)
            return m
        except ScheduleError:
            continue
    raise ValueError(f"{schedule} runs no micro-batch count from {micro} on {stages} stages")
