"""The precision policy, boundary wire formats, recompute and the job-wide loss-scale skip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import models
from bundle import partition, preflight
from bundle.config import CheckpointConfig, ComputeConfig
from bundle.engine.memory import SavedBytes
from bundle.engine.precision import LossScaler, Policy
from bundle.engine.schedule import Op, actions
from bundle.engine.transport import TensorMeta, _check_wire
from bundle.errors import ConfigError
from bundle.runtime.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import TOL, equivalence_config

IMAGE = TensorMeta((8, 4, 4), torch.float32)
LABELS = TensorMeta((), torch.int64)


def test_policy_sets_boundary_dtype_and_layout_for_both_sides():
    bf16_cl = Policy("bf16", "cpu", channels_last=True)
    assert bf16_cl.boundary(IMAGE) == TensorMeta((8, 4, 4), torch.bfloat16, True)
    assert bf16_cl.boundary(LABELS) == LABELS  # integers keep their dtype
    flat = TensorMeta((32,), torch.float32)
    assert bf16_cl.boundary(flat) == TensorMeta((32,), torch.bfloat16, False)  # not an image
    assert Policy("fp32", "cpu").boundary(IMAGE) == IMAGE
    assert Policy("fp16", "cpu").boundary(IMAGE).dtype == torch.float16
    wide = TensorMeta((4,), torch.float64)  # only fp32 activations change dtype
    assert Policy("bf16", "cpu").boundary(wide) == Policy("fp32", "cpu").boundary(wide) == wide


def test_channels_last_wire_form_is_the_tensors_own_bytes():
    meta = Policy("fp32", "cpu", channels_last=True).boundary(IMAGE)
    x = torch.randn(3, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    wire = meta.to_wire(x)
    assert wire.shape == meta.wire_shape(3) == (3, 4, 4, 8) and wire.is_contiguous()
    assert wire.data_ptr() == x.data_ptr()  # no copy
    back = meta.from_wire(wire)
    assert torch.equal(back, x) and back.is_contiguous(memory_format=torch.channels_last)
    # An NCHW tensor is converted (a copy), never sent with the wrong layout.
    assert torch.equal(meta.from_wire(meta.to_wire(x.contiguous())), x)


def test_a_send_that_disagrees_with_the_receivers_buffers_is_refused():
    meta = (Policy("bf16", "cpu").boundary(TensorMeta((5,), torch.float32)),)
    _check_wire((torch.zeros(2, 5, dtype=torch.bfloat16),), meta, 2, "rank 1")
    for bad in (
        torch.zeros(2, 5),  # fp32 into a bf16 buffer
        torch.zeros(3, 5, dtype=torch.bfloat16),  # rows
        torch.zeros(5, 2, dtype=torch.bfloat16).t(),  # not contiguous
    ):
        with pytest.raises(TypeError, match="do not match the boundary"):
            _check_wire((bad,), meta, 2, "rank 1")


def test_except_last_keeps_what_recomputing_would_rebuild_at_once():
    def plan(mode: str, schedule: str, stage: int, micro: int) -> list[bool]:
        return Policy(recompute=mode).recomputes(actions(schedule, stage, 2, micro), micro)

    # 1F1B's last stage runs each backward right after its forward: nothing to gain there.
    assert plan("except-last", "1f1b", 1, 3) == [False, False, False]
    # Stage 0 holds two micro-batches at once, and its last forward precedes another backward.
    assert plan("except-last", "1f1b", 0, 3) == [True, True, True]
    # GPipe as run here (backwards in forward order): keeping the last would double the peak.
    assert plan("except-last", "gpipe", 1, 3) == [True, True, True]
    assert plan("except-last", "gpipe", 0, 1) == [False]  # one micro-batch
    assert plan("always", "1f1b", 1, 3) == [True, True, True]
    assert plan("never", "gpipe", 0, 3) == [False, False, False]


def _bn_stage() -> partition.Stage:
    torch.manual_seed(0)
    model = models.build("resnet18", num_classes=10, input_shape=(3, 32, 32))
    return partition.split_model(model, (0, 4))[0]  # conv1, bn1, relu, maxpool | layer1 ...


def _step(stage: partition.Stage, x: torch.Tensor, recompute: bool) -> dict[str, torch.Tensor]:
    stage.recompute = recompute
    stage(x)[0].square().mean().backward()
    return {
        **{k: v.clone() for k, v in stage.state_dict().items()},
        **{f"grad.{k}": p.grad.clone() for k, p in stage.named_parameters()},
    }


def test_recompute_matches_and_updates_batchnorm_statistics_once():
    x = torch.randn(4, 3, 32, 32)
    plain, recomputed = _step(_bn_stage(), x, False), _step(_bn_stage(), x, True)
    assert plain.keys() == recomputed.keys()
    for k, v in plain.items():
        if v.is_floating_point():
            assert (v - recomputed[k]).abs().max().item() <= TOL, k
        else:
            assert torch.equal(v, recomputed[k]), k  # num_batches_tracked


def test_recompute_updates_instance_norm_statistics_once():
    def stage() -> partition.Stage:
        torch.manual_seed(0)
        conv = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.InstanceNorm2d(4, track_running_stats=True)
        )
        return partition.Stage([("conv", conv), ("relu", torch.nn.ReLU())])

    x = torch.randn(2, 3, 8, 8)
    plain, recomputed = _step(stage(), x, False), _step(stage(), x, True)
    for k, v in plain.items():
        assert (
            torch.allclose(v, recomputed[k], atol=TOL)
            if v.is_floating_point()
            else torch.equal(v, recomputed[k])
        ), k


def test_plain_checkpoint_would_update_batchnorm_twice():
    """What the test above guards against is real (pytorch issue 96136)."""
    stage = _bn_stage()
    bn = stage.blocks[1]
    checkpoint(stage.blocks[1], stage.blocks[0](torch.randn(4, 3, 32, 32)), use_reentrant=False)
    out = checkpoint(bn, torch.randn(4, 64, 16, 16, requires_grad=True), use_reentrant=False)
    out.sum().backward()
    assert int(bn.num_batches_tracked) == 3  # two forwards, one recompute


def _saved_peak(recompute: bool) -> int:
    torch.manual_seed(0)
    model = models.build("small_resnet", num_classes=10, input_shape=(3, 32, 32))
    stage = partition.split_model(model, (0, 3))[0]
    stage.recompute = recompute
    meter = SavedBytes(stage)
    with meter.tracking():
        outs = [stage(torch.randn(8, 3, 32, 32))[0] for _ in range(3)]
    for out in outs:
        out.sum().backward()
    assert meter.current == 0  # every saved tensor was released by its backward
    return meter.peak


def test_saved_bytes_shrink_with_recompute():
    never, always = _saved_peak(False), _saved_peak(True)
    # Three micro-batches' stage inputs are all that recompute keeps.
    assert always == 3 * 8 * 3 * 32 * 32 * 4 and never > 10 * always


def test_loss_scaler_follows_grad_scaler_rules():
    scaler = LossScaler(device=torch.device("cpu"), growth_interval=2)
    scaler._update(True)
    scaler._update(True)
    assert scaler.scale == 2.0**17
    scaler._update(False)
    assert scaler.scale == 2.0**16 and int(scaler.growth_t) == 0 and scaler.skipped == 1


# -- spawned: fp16 skips agreed by every rank; channels-last and bf16 across a boundary ---------


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


def test_precision_the_devices_cannot_run_is_refused_before_start(monkeypatch):
    bf16 = dataclasses.replace(
        equivalence_config((1, 1), 1, "1f1b", 1, "flat", "mlp"),
        compute=ComputeConfig(precision="bf16"),
    )
    preflight.check_precision(bf16, "gloo")  # this CPU runs bf16 autocast
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    with pytest.raises(ConfigError, match="this GPU has no bf16"):
        preflight.check_precision(bf16, "nccl")

    def no_autocast(*args, **kwargs):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(torch, "autocast", no_autocast)
    with pytest.raises(ConfigError, match="--precision: 'bf16'.*cannot run it"):
        preflight.check_precision(bf16, "gloo")
    preflight.check_precision(
        equivalence_config((1, 1), 1, "1f1b", 1, "flat", "mlp"), "gloo"
    )  # fp32


def test_loss_is_fp32_under_autocast():
    with Policy("bf16", "cpu").autocast():
        logits = torch.nn.Linear(4, 3)(torch.randn(2, 4))
    assert logits.dtype == torch.bfloat16
    loss = F.cross_entropy(logits.float(), torch.tensor([0, 1]))
    assert loss.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu") and dist.is_available()
