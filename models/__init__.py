"""Model registry: build a model by name and flatten it into the ordered blocks stages are cut from."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torchvision.models import ResNet
from torchvision.models.vgg import VGG

from bundle.errors import ConfigError, PartitionError
from models.small import MLP, Block, Chain, DigitsCNN, SkipMLP, SmallResNet, apply_blocks
from models.vision import build_torchvision, resnet_blocks, vgg_blocks

__all__ = ["Block", "apply_blocks", "available", "blocks", "build"]

Builder = Callable[[int, tuple[int, int, int]], nn.Module]


def _torchvision(name: str) -> Builder:
    return lambda num_classes, shape: build_torchvision(name, num_classes, shape)


_REGISTRY: dict[str, Builder] = {
    "resnet18": _torchvision("resnet18"),
    "resnet50": _torchvision("resnet50"),
    "resnet101": _torchvision("resnet101"),
    "vgg16": _torchvision("vgg16"),
    "mlp": lambda num_classes, shape: MLP(shape, num_classes),
    # Compute-heavy enough per micro-batch that a pipeline's own overhead can be seen (benchmark).
    "mlp_wide": lambda num_classes, shape: MLP(shape, num_classes, width=1024),
    "digits_cnn": lambda num_classes, shape: DigitsCNN(shape, num_classes),
    "skip_mlp": lambda num_classes, shape: SkipMLP(shape, num_classes),
    "small_resnet": lambda num_classes, shape: SmallResNet(shape, num_classes),
}


def available() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)


def build(name: str, *, num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    """A freshly initialised model (random weights; seed torch first for reproducibility)."""
    if name not in _REGISTRY:
        raise ConfigError("--model", name, f"choose one of: {', '.join(available())}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError("num_classes", num_classes, "a positive integer")
    shape = tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ConfigError("input_shape", input_shape, "three positive integers (C, H, W)")
    return _REGISTRY[name](num_classes, (shape[0], shape[1], shape[2]))


def blocks(model: nn.Module) -> list[Block]:
    """The model as ordered (dotted name, module) pairs whose chained application equals model(x).

    Names are the model's own module paths, so ``f"{name}.{param}"`` is a key of
    ``model.named_parameters()``; the only exception is a parameterless ``flatten`` block that
    stands in for a functional ``torch.flatten`` in torchvision forwards.
    """
    if isinstance(model, Chain):
        return model.blocks()
    if isinstance(model, ResNet):
        return resnet_blocks(model)
    if isinstance(model, VGG):
        return vgg_blocks(model)
    raise PartitionError(
        f"cannot flatten a {type(model).__name__} into blocks; "
        f"use a model from models.build ({', '.join(available())})"
    )
