"""Gradient equivalence over NCCL on CUDA: every rank on one GPU, compared with the CPU reference.

The check of test_equivalence.py on the GPU path: ``batch_isend_irecv`` between stages, DDP with
``device_ids`` (flat) and reduce/allreduce/broadcast started from gradient hooks (hierarchical).
Shapes ``1,1`` and ``2,1`` and two bundles of ``1,1``; 1F1B with 3 and 1 micro-batches. All ranks
share ``cuda:0`` (NCCL's multi-rank mode from 2.30, a host id per process before it), so one GPU
runs it. TF32
is off, so fp32 on the GPU matches the CPU reference at 1e-5; parameters are compared on the CPU.
Where there is no GPU these skip; how run_world places NCCL children is still checked, on fakes.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle.config import CheckpointConfig, ComputeConfig, RunConfig
from bundle.launch import localworld
from bundle.runtime import devices
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import STEPS, TOL, equivalence_config, reference

DEVICE = "cuda:0"
CASES = [((1, 1), 1), ((2, 1), 1), ((1, 1), 2)]  # (shape, bundles)
VARIANTS = list(itertools.product((3, 1), ("flat", "hierarchical")))  # (micro-batches, sync)


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


SKIP = _skip_reason()


def _gpu_config(shape, bundles, micro: int, sync: str) -> RunConfig:
    model = "skip_mlp" if micro == 3 else "mlp"  # two tensors cross the boundary with M = 3
    cfg = equivalence_config(shape, bundles, "1f1b", micro, sync, model)
    return replace(cfg, compute=ComputeConfig(precision="fp32", tf32=False))


def _mismatches(label: str, gathered: list, ref: dict[str, torch.Tensor]) -> list[str]:
    out, seen = [], set()
    for coord, params in gathered:
        for name, value in params.items():
            seen.add(name)
            err = (value - ref[name]).abs().max().item()
            if err > TOL:
                out.append(f"{label} {coord}: {name} off by {err:.2e}")
    if seen != set(ref):
        out.append(f"{label}: parameters not covered: {set(ref) - seen}")
    return out


def _nccl(rank: int, world: int, shape, bundles) -> list[str]:
    """Every variant in one world of processes on one GPU; rank 0 returns the mismatches."""
    device = torch.device(DEVICE)
    cpu = dist.new_group(backend="gloo")  # the results travel as CPU tensors
    failures: list[str] = []
    refs: dict[str, dict[str, torch.Tensor]] = {}
    for micro, sync in VARIANTS:
        cfg = _gpu_config(shape, bundles, micro, sync)
        topo = Topology.from_config(cfg)
        session = build_session(cfg, topo, rank, device)
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.engine.train_step(step, next(batches))
        torch.cuda.synchronize(device)
        mine = {k: v.detach().cpu() for k, v in session.stage.full_state_dict().items()}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), mine), gathered, dst=0, group=cpu)
        if rank != 0:
            continue
        if cfg.model.name not in refs:
            refs[cfg.model.name] = reference(cfg)
        label = f"nccl 1f1b M={micro} {sync} {cfg.model.name}"
        failures += _mismatches(label, gathered, refs[cfg.model.name])
    return failures


@pytest.mark.slow
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
@pytest.mark.parametrize(
    "shape,bundles", CASES, ids=lambda c: ",".join(map(str, c)) if isinstance(c, tuple) else f"x{c}"
)
def test_nccl_hybrid_equals_single_process(shape, bundles):
    world = sum(shape) * bundles
    results = localworld.run_world(world, _nccl, shape, bundles, backend="nccl", device=DEVICE)
    assert results[0] == [], "\n".join(results[0])


def _adam_saves(rank: int, world: int, root: str) -> str:
    """Two AdamW steps over NCCL, a checkpoint (its agreement runs on the stage's NCCL group,
    over the parameters' checksums and Adam's CPU step counts), and a resume from it."""
    base = _gpu_config((1, 1), 2, 3, "flat")
    cfg = replace(
        base,
        train=replace(base.train, optimizer="adamw", lr=0.01),
        checkpoint=CheckpointConfig(save_dir=root),
    )
    topo = Topology.from_config(cfg)
    for resume in (None, f"{root}/step-2"):
        session = build_session(cfg, topo, rank, torch.device(DEVICE))
        saver = make_checkpointer(cfg, topo, rank, session)
        start = saver.restore(resume)
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0, start=start)
        for step in range(start, 2 if resume is None else STEPS):
            session.engine.train_step(step, next(batches))
        if resume is None:
            saver.save(2)
    return "saved and resumed"


@pytest.mark.slow
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_an_adamw_checkpoint_saves_and_resumes_over_nccl(tmp_path):
    results = localworld.run_world(4, _adam_saves, str(tmp_path), backend="nccl", device=DEVICE)
    assert results == ["saved and resumed"] * 4


def test_children_share_one_gpu_with_nccl_multi_rank_mode(monkeypatch):
    """run_world's placement of NCCL children, with the device count faked (no GPU needed)."""
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d).index))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 7))  # 2.28: a host id each
    monkeypatch.setenv(devices.MULTI_RANK_GPU_ENV, "unset")  # teardown restores the original
    monkeypatch.delenv(devices.MULTI_RANK_GPU_ENV)

    # one child per GPU: round-robin, no sharing, NCCL left as it is
    assert [localworld._bind_gpu(r, 2, None).index for r in range(2)] == [0, 1]
    assert devices.MULTI_RANK_GPU_ENV not in os.environ
    # every child on cuda:0
    assert {localworld._bind_gpu(r, 4, DEVICE).index for r in range(4)} == {0}
    assert os.environ[devices.MULTI_RANK_GPU_ENV] == "1"
    assert current == [0, 1, 0, 0, 0, 0]


def test_run_world_names_a_bad_backend():
    with pytest.raises(ValueError, match="mpi"):
        localworld.run_world(1, print, backend="mpi")


def _breaks(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one breaks")
    time.sleep(60)  # would hold the world for a minute if its failed peer did not end it


def test_a_failed_child_ends_the_world_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*rank one breaks"):
        localworld.run_world(2, _breaks)
    assert time.monotonic() - start < 30
