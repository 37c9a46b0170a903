"""torchvision classification models by name (random init, nothing downloaded) and the hand-written
flattening of ResNets and VGGs into pipeline blocks (every other model is cut by its graph)."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch.nn as nn
import torchvision
from torchvision.models import ResNet
from torchvision.models.vgg import VGG

from bundle.errors import ConfigError
from bundle.models.small import no_inplace

Block = tuple[str, nn.Module]


@functools.cache
def zoo_names() -> frozenset[str]:
    """Every torchvision classification model name."""
    return frozenset(torchvision.models.list_models(module=torchvision.models))


def size_rule(name: str) -> tuple[int, int]:
    """(multiple, minimum) an image side must be for model ``name`` (1, 1: anything works)."""
    patch = re.fullmatch(r"vit_\w_(\d+)", name)
    if patch:
        return int(patch.group(1)), int(patch.group(1))
    if name.startswith("maxvit"):
        return 224, 224  # a 7x7 partition at every one of its four strides of two after the stem
    if name == "inception_v3":
        return 1, 75
    if name in ("alexnet", "googlenet") or name.startswith("squeezenet"):
        return 1, 64
    return 1, 1


def build_zoo(
    name: str, num_classes: int, input_shape: tuple[int, ...], kwargs: dict[str, Any]
) -> nn.Module:
    """One torchvision classifier for ``num_classes`` and this image size, random weights."""
    if len(input_shape) != 3 or input_shape[0] != 3:
        raise ConfigError("input_shape", input_shape, f"{name} takes 3-channel images (3, H, W)")
    side = input_shape[1]
    multiple, minimum = size_rule(name)
    if input_shape[1] != input_shape[2] or side % multiple or side < minimum:
        works = f"multiples of {multiple}" if multiple > 1 else f"at least {minimum}"
        raise ConfigError("--image-size", side, f"{name} takes square images of side {works}")
    extra: dict[str, Any] = {}
    if name.startswith("vit_"):
        extra["image_size"] = side
    elif name.startswith("maxvit"):
        extra["input_size"] = (side, side)
    elif name in ("googlenet", "inception_v3"):
        # One output (no auxiliary heads), as every other model here; no pretrained-style init.
        extra.update(aux_logits=False, init_weights=True)
    try:
        model = torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, **{**extra, **kwargs}
        )
    except TypeError as exc:
        raise ConfigError("--model-args", kwargs, f"--model {name}: {exc}") from None
    no_inplace(model)
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


def chain_blocks(model: nn.Module) -> list[Block] | None:
    """A ResNet's or VGG's hand-written chain of blocks; None for any other model."""
    if isinstance(model, ResNet):
        return resnet_blocks(model)
    if isinstance(model, VGG):
        return vgg_blocks(model)
    return None
