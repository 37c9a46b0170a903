"""The precision policy, boundary wire formats, recompute and the job-wide loss-scale skip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bundle.config import CheckpointConfig, ComputeConfig
from bundle.ir.schedule import Op
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import TOL, equivalence_config


def _poisoned_skip(rank: int, world: int, save_dir: str) -> dict:
    cfg = equivalence_config((2, 1), 1, "1f1b", 3, "flat", "mlp", precision="fp16")
    cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(save_dir=save_dir))
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    runner, batches = session.engine, train_stream(session, topo, cfg.train.seed, 3, 0)
    runner.train_step(0, next(batches))
    before = {k: v.clone() for k, v in session.stage.full_state_dict().items()}
    if rank == 1:  # one replica of the front stage overflows; the rear computes the loss
        handle = next(session.stage.parameters()).register_hook(lambda g: g * float("inf"))
    runner.train_step(1, next(batches))
    if rank == 1:
        handle.remove()
    unchanged = all(torch.equal(v, before[k]) for k, v in session.stage.full_state_dict().items())
    scale_after_skip = runner.scaler.scale
    make_checkpointer(cfg, topo, rank, session).save(2)
    runner.train_step(2, next(batches))
    moved = not all(torch.equal(v, before[k]) for k, v in session.stage.full_state_dict().items())
    fresh = build_session(cfg, topo, rank, torch.device("cpu"))
    make_checkpointer(cfg, topo, rank, fresh).restore(f"{save_dir}/step-2")
    return {
        "unchanged": unchanged,
        "scale": scale_after_skip,
        "skipped": runner.scaler.skipped,
        "moved": moved,
        "restored_scale": fresh.engine.scaler.scale,
        "restored_skipped": fresh.engine.scaler.skipped,
    }


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = run_world(3, _poisoned_skip, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["unchanged"], f"rank {rank} stepped on an overflowed step"
        assert r["scale"] == 2.0**15 and r["skipped"] == 1, (rank, r)
        assert r["moved"], f"rank {rank} did not step after the skip"
        assert r["restored_scale"] == 2.0**15 and r["restored_skipped"] == 1, (rank, r)


def _boundary(rank: int, world: int, compute: ComputeConfig, backend: str = "auto") -> dict:
    # Two rear replicas: the front sends each its rows of the NHWC wire tensor, and the rear's
    # hierarchical sync runs over channels-last parameters.
    cfg = equivalence_config((1, 2), 1, "1f1b", 2, "hierarchical", "small_resnet")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, image_size=8),
        model=dataclasses.replace(cfg.model, partition="small_resnet_2stage"),
        compute=compute,
        launch=dataclasses.replace(cfg.launch, backend=backend),
    )
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    batches = train_stream(session, topo, cfg.train.seed, 2, 0)
    for step in range(2):
        session.engine.train_step(step, next(batches))
    tp = session.engine.transport
    bufs = [t for key, ts in tp._buffers.items() for t in ts if key[0] is Op.RECV_ACT]
    return {
        "params": {k: v.detach() for k, v in session.stage.full_state_dict().items()},
        "buffers": [(t.dtype, t.shape) for t in bufs],
        # Gradients laid out like their parameters (hierarchical sync's bucket views too).
        "grad_layouts": [
            p.grad is None or p.grad.stride() == p.stride() for p in session.stage.parameters()
        ],
        "channels_last": [
            p.is_contiguous(memory_format=torch.channels_last)
            for p in session.stage.parameters()
            if p.dim() == 4 and p.shape[-1] > 1  # a 1x1 kernel is both layouts at once
        ],
    }


def _loss_step(rank: int, world: int) -> list:
    return [
        _boundary(rank, world, ComputeConfig()),
        _boundary(rank, world, ComputeConfig(channels_last=True)),
        _boundary(rank, world, ComputeConfig(precision="bf16", channels_last=True)),
        # The same under NCCL's ordering (fused calls posted where they stand): the same bits.
        _boundary(rank, world, ComputeConfig(precision="bf16", channels_last=True), "nccl-emu"),
    ]


@pytest.mark.slow
def test_channels_last_and_bf16_cross_the_boundary():
    front, rear, rear_twin = run_world(3, _loss_step)
    fp32, cl, bf16_cl, emu = (
        {**f["params"], **r["params"]} for f, r in zip(front, rear, strict=True)
    )
    for k in fp32:
        assert (fp32[k] - cl[k]).abs().max().item() <= TOL, k  # same math, another layout
    for mine, twin in zip(rear, rear_twin, strict=True):  # replicas stay identical
        assert all(torch.equal(v, twin["params"][k]) for k, v in mine["params"].items())
        assert all(mine["grad_layouts"]) and all(twin["grad_layouts"])
    assert max((fp32[k] - bf16_cl[k]).abs().max().item() for k in fp32) > TOL
    assert all(torch.equal(emu[k], v) for k, v in bf16_cl.items()), "nccl-emu changed the result"
    assert all(front[1]["channels_last"]) and all(rear[2]["channels_last"])
    assert not any(front[0]["channels_last"])
    # The rear's receive buffers: NCHW fp32, NHWC fp32, NHWC bf16 (32 channels at 4x4).
    (dtype0, shape0), (dtype1, shape1), (dtype2, shape2), _ = (r["buffers"][0] for r in rear)
    assert (dtype0, dtype1, dtype2) == (torch.float32, torch.float32, torch.bfloat16)
    assert shape0[1:] == (32, 4, 4) and shape1[1:] == shape2[1:] == (4, 4, 32)
