"""bundle/engine/precision.py and recompute in one process: the boundary's wire form, loss scaling, what recompute keeps, refusals before start."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bundle import models, preflight
from bundle.config import ComputeConfig
from bundle.engine.memory import SavedBytes
from bundle.engine.precision import LossScaler, Policy
from bundle.engine.stage import Stage, split_model
from bundle.engine.transport import TensorMeta, _check_wire
from bundle.errors import ConfigError
from bundle.ir.schedule import actions
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


def _bn_stage() -> Stage:
    torch.manual_seed(0)
    model = models.build("resnet18", num_classes=10, input_shape=(3, 32, 32))
    return split_model(model, (0, 4))[0]  # conv1, bn1, relu, maxpool | layer1 ...


def _step(stage: Stage, x: torch.Tensor, recompute: bool) -> dict[str, torch.Tensor]:
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
    def stage() -> Stage:
        torch.manual_seed(0)
        conv = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.InstanceNorm2d(4, track_running_stats=True)
        )
        return Stage([("conv", conv), ("relu", torch.nn.ReLU())])

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
    stage = split_model(model, (0, 3))[0]
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
