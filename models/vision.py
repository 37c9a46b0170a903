"""torchvision ResNets and VGG-16 (random init) and their flattening into pipeline blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torchvision.models import ResNet, resnet18, resnet50, resnet101, vgg16
from torchvision.models.vgg import VGG

from bundle.errors import ConfigError

Block = tuple[str, nn.Module]

_TORCHVISION: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "vgg16": vgg16,
}


def build_torchvision(name: str, num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    """One torchvision classifier with random weights (never downloads anything)."""
    if input_shape[0] != 3:
        raise ConfigError("input_shape", input_shape, f"{name} takes 3-channel images")
    model = _TORCHVISION[name](weights=None, num_classes=num_classes)
    _no_inplace_at_boundaries(model)
    return model


def resnet_blocks(model: ResNet) -> list[Block]:
    """conv1, bn1, relu, maxpool, layer1.0 ... layer4.N, avgpool, flatten, fc."""
    out: list[Block] = [(n, getattr(model, n)) for n in ("conv1", "bn1", "relu", "maxpool")]
    for layer in ("layer1", "layer2", "layer3", "layer4"):
        out += [(f"{layer}.{i}", m) for i, m in enumerate(getattr(model, layer))]
    # ResNet.forward calls torch.flatten(x, 1); this stands in for it as a parameterless block.
    out += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    return out


def vgg_blocks(model: VGG) -> list[Block]:
    """features.0 ... features.30, avgpool, flatten, classifier.0 ... classifier.6."""
    out: list[Block] = [(f"features.{i}", m) for i, m in enumerate(model.features)]
    out += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1))]
    out += [(f"classifier.{i}", m) for i, m in enumerate(model.classifier)]
    return out


def _no_inplace_at_boundaries(model: nn.Module) -> None:
    # A top-level block may begin a stage, where its input is a received leaf tensor that
    # requires grad; an in-place ReLU there raises in autograd. Output values are unchanged.
    top = resnet_blocks(model) if isinstance(model, ResNet) else vgg_blocks(model)
    for _, module in top:
        if getattr(module, "inplace", False):
            setattr(module, "inplace", False)  # noqa: B010 - nn.Module's own attribute
