"""Under nccl-emu, the device audit (bundle.collectives.device_audit): it catches the checkpoint
agreement that stacked a GPU checksum with Adam's CPU step count (a crash on the first save of
an Adam run on GPUs, invisible on the CPU), and every feature path trains, saves and resumes
under it, and under ``--nccl-emu-strict`` (communicators one call at a time), in one world."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from bundle.checkpoint import manager
from bundle.config import CheckpointConfig, RunConfig
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import equivalence_config

pytestmark = pytest.mark.slow

SHAPE, BUNDLES = (1, 2), 2  # the rear's replicas agree within a bundle and across bundles
ADAM = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}
# (name, sync, parallel/train/compute/launch changes): each saves after step 2 and resumes from
# it. The median needs 3 bundles: test_data_parallel.py runs it under nccl-emu (so audited).
VARIANTS = [
    ("adamw flat", "flat", ADAM),
    ("adam hierarchical", "hierarchical", {"optimizer": "adam", "lr": 0.01}),
    ("zero-1 adamw", "flat", {**ADAM, "zero": 1}),
    ("powersgd flat", "flat", {"grad_compression": "powersgd", "compression_warmup": 1}),
    ("powersgd hierarchical", "hierarchical", {"grad_compression": "powersgd"}),
    ("diloco adamw", "flat", {**ADAM, "bundle_sync": "diloco:2"}),
    ("fp16 adam", "flat", {"optimizer": "adam", "lr": 0.01, "precision": "fp16"}),
    ("bf16 rows", "hierarchical", {"precision": "bf16", "row_weights": "1,1:3"}),
    ("strict adamw", "flat", {**ADAM, "emu_strict": True}),
    ("strict hierarchical fp16", "hierarchical", {"precision": "fp16", "emu_strict": True}),
]
STEPS, SAVE_AT = 3, 2


def _cfg(sync: str, changes: dict, save_dir: str, backend: str = "nccl-emu") -> RunConfig:
    cfg = equivalence_config(SHAPE, BUNDLES, "1f1b", 3, sync, "skip_mlp")
    changes = {**changes, "steps": STEPS, "backend": backend}
    sections = {}
    for name in ("parallel", "train", "compute", "launch"):
        section = getattr(cfg, name)
        mine = {k: v for k, v in changes.items() if hasattr(section, k)}
        sections[name] = dataclasses.replace(section, **mine)
    return dataclasses.replace(cfg, **sections, checkpoint=CheckpointConfig(save_dir=save_dir))


def _train(cfg: RunConfig, rank: int, *, until: int, resume: str | None = None, save: bool):
    """A session trained to ``until`` from ``resume``, saving after step SAVE_AT; its parameters."""
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    if session.engine.outer is not None:
        session.engine.outer.total = STEPS
    saver = make_checkpointer(cfg, topo, rank, session)
    start = saver.restore(resume)
    batches = train_stream(session, topo, cfg.train.seed, STEPS, 0, start=start)
    for step in range(start, until):
        session.engine.train_step(step, next(batches))
        if save and step + 1 == SAVE_AT:
            saver.save(SAVE_AT)
    stage = session.stage
    return {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}


def _features(rank: int, world: int, root: str) -> list[str]:
    """Per variant: train through a save, resume from it; the failures (rank 0's list)."""
    failures = []
    for name, sync, changes in VARIANTS:
        save_dir = os.path.join(root, name.replace(" ", "-"))
        try:
            cfg = _cfg(sync, changes, save_dir)
            straight = _train(cfg, rank, until=STEPS, save=True)
            resumed = _train(
                cfg, rank, until=STEPS, resume=f"{save_dir}/step-{SAVE_AT}", save=False
            )
            if any(not torch.equal(straight[k], resumed[k]) for k in straight):
                failures.append(f"{name}: rank {rank} resumed differently")
        except Exception as exc:  # noqa: BLE001 - every variant reported, not the first only
            failures.append(f"{name}: rank {rank}: {type(exc).__name__}: {exc}")
        dist.barrier()
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(failures, gathered, dst=0)
    return [f for per_rank in gathered or [] for f in per_rank]


def test_device_audit_passes_every_feature_path(tmp_path):
    failures = run_world(sum(SHAPE) * BUNDLES, _features, str(tmp_path), timeout=900)[0]
    assert failures == [], "\n".join(failures)


def _unfixed_agree(self, state, step):
    """``Checkpointer._agree`` as it was: one checksum per entry, stacked where each was made."""
    if self.stage_group is None:
        return
    optim = f"{self.prefix}optim."
    names = [k for k in state if k.startswith(f"{self.prefix}model.") or k.startswith(optim)]
    sums = torch.stack([manager._checksum(state[k]) for k in names])
    dist.all_reduce(sums, group=self.stage_group)


def _save_with_the_unfixed_agreement(rank: int, world: int, root: str, backend: str) -> str:
    manager.Checkpointer._agree = _unfixed_agree  # this child process only
    try:
        _train(_cfg("flat", ADAM, os.path.join(root, backend), backend), rank, until=2, save=True)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_device_audit_catches_the_checkpoint_agreement_that_crashed_on_gpus(tmp_path):
    """The stack of parameter checksums (device) with Adam's step's (host): what CUDA refuses."""
    world = sum(SHAPE) * BUNDLES
    emulated = run_world(world, _save_with_the_unfixed_agreement, str(tmp_path), "nccl-emu")
    caught = [r for r in emulated if "DeviceMixing" in r]
    assert caught, emulated
    assert "torch.stack combines device tensors with" in caught[0]
    assert "bundle/checkpoint/manager.py" not in caught[0]  # the call site is the test's copy
    assert "test_device_audit.py" in caught[0] and "_unfixed_agree" in caught[0]
    # Plain gloo has nothing to tell the two apart: the same code saves there.
    assert (
        run_world(world, _save_with_the_unfixed_agreement, str(tmp_path), "gloo")
        == ["saved"] * world
    )
