"""bundle/engine/stage.py: a Stage runs its blocks as the full model does (boundaries of several
tensors, gradients routed back), names its state as the full model does, and refuses bad names
and starts with typed errors."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from bundle import models
from bundle.engine.stage import joined, split_model
from bundle.errors import PartitionError
from bundle.models.partition import load_spec, resolve

SHAPES = {"mlp": (1, 8, 8), "skip_mlp": (1, 8, 8), "small_resnet": (3, 32, 32)}


def shape_of(name: str) -> tuple[int, ...]:
    return SHAPES.get(name, (3, 64, 64))


@functools.cache
def built(name: str) -> nn.Module:
    torch.manual_seed(0)
    return models.build(name, num_classes=10, input_shape=shape_of(name)).eval()


def test_skip_mlp_boundaries_carry_two_tensors() -> None:
    model = built("skip_mlp")
    spec = load_spec("skip_mlp_3stage")
    stages = split_model(model, resolve(spec, models.blocks(model), 3, "skip_mlp"))
    x = torch.randn(4, *shape_of("skip_mlp"))
    first = stages[0](x)
    second = stages[1](*first)
    assert len(first) == 2 and len(second) == 2
    assert len(stages[2](*second)) == 1


def test_pipelined_gradients_equal_full_model_gradients() -> None:
    # Mimics what the engine does at a boundary: detach, receive with requires_grad, send grads back.
    model = built("skip_mlp")
    stages = split_model(
        model, resolve(load_spec("skip_mlp_3stage"), models.blocks(model), 3, "skip_mlp")
    )
    x = torch.randn(4, *shape_of("skip_mlp"))
    model.zero_grad()
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    received: list[tuple[torch.Tensor, ...]] = []
    produced: list[tuple[torch.Tensor, ...]] = []
    carried: tuple[torch.Tensor, ...] = (x,)
    for k, stage in enumerate(stages):
        received.append(carried if k == 0 else tuple(t.detach().requires_grad_() for t in carried))
        carried = stage(*received[k])
        produced.append(carried)
    grads: tuple[torch.Tensor, ...] = (torch.ones_like(carried[0]),)
    for k in reversed(range(len(stages))):
        # stage 1 returns its received skip tensor unchanged; backward must still route its grad.
        torch.autograd.backward(produced[k], grads)
        grads = tuple(t.grad for t in received[k]) if k else ()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[n], atol=1e-6), n


def test_full_state_dict_uses_full_model_names() -> None:
    model = built("resnet18")
    starts = resolve(load_spec("resnet18_2stage"), models.blocks(model), 2, "resnet18")
    stages = split_model(model, starts)
    full = model.state_dict()
    keys = [k for stage in stages for k in stage.full_state_dict()]
    assert len(keys) == len(set(keys)) and set(keys) == set(full)
    assert stages[0].full_name("blocks.4.conv1.weight") == "layer1.0.conv1.weight"
    for stage in stages:
        for k, v in stage.full_state_dict().items():
            assert v.data_ptr() == full[k].data_ptr()  # shared, not copied


def test_load_full_state_dict_round_trip() -> None:
    source = built("small_resnet")
    torch.manual_seed(1)
    target = models.build("small_resnet", num_classes=10, input_shape=(3, 32, 32))
    stages = split_model(target, (0, 3))
    for stage in stages:
        stage.load_full_state_dict(source.state_dict())
    for k, v in target.state_dict().items():
        assert torch.equal(v, source.state_dict()[k])
    with pytest.raises(PartitionError, match="lacks"):
        stages[0].load_full_state_dict({})


def test_bad_names_and_starts_are_typed_errors() -> None:
    model = built("mlp")
    (stage,) = split_model(model, (0,))
    with pytest.raises(PartitionError, match="weight"):
        stage.full_name("weight")
    for starts in [(), (1, 3), (0, 3, 3), (0, 99)]:
        with pytest.raises(PartitionError):
            split_model(model, starts)


def test_joined_pieces_hold_every_block_under_full_names() -> None:
    model = built("small_resnet")
    pieces = split_model(model, (0, 2, 4))
    whole = joined(pieces)
    assert whole.names == tuple(n for p in pieces for n in p.names)
    assert set(whole.full_state_dict()) == set(model.state_dict())
