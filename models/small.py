"""CPU-sized models without batch statistics, built as explicit chains of pipeline blocks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

Block = tuple[str, nn.Module]


def apply_blocks(
    blocks: Sequence[Block],
    *inputs: torch.Tensor,
    side: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor | tuple:
    """Run blocks in order; a tuple returned by one block is unpacked into the next, followed by
    the named inputs the block reads (its ``side``, from ``side``)."""
    x: torch.Tensor | tuple = inputs if len(inputs) > 1 else inputs[0]
    for _, block in blocks:
        names = getattr(block, "side", ())
        if names:
            if side is None:
                raise ValueError(f"a block reads the batch's {', '.join(names)}, given none")
            x = (*(x if isinstance(x, tuple) else (x,)), *(side[n] for n in names))
        x = block(*x) if isinstance(x, tuple) else block(x)
    return x


class Chain(nn.Module):
    """A model whose forward is, by construction, its blocks applied in order."""

    block_names: tuple[str, ...] = ()

    def blocks(self) -> list[Block]:
        return [(name, self.get_submodule(name)) for name in self.block_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, apply_blocks(self.blocks(), x))


class LinearReLU(nn.Module):
    """One hidden layer; a unit of its own so a split may fall between any two layers."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(Chain):
    """flatten -> depth x (Linear, ReLU) -> Linear head."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, width: int = 256, depth: int = 4
    ) -> None:
        super().__init__()
        self.flatten = nn.Flatten(1)
        dims = [math.prod(input_shape)] + [width] * depth
        self.hidden = nn.Sequential(*(LinearReLU(a, b) for a, b in pairwise(dims)))
        self.head = nn.Linear(width, num_classes)
        self.block_names = (
            "flatten",
            *(f"hidden.{i}" for i in range(depth)),
            "head",
        )


class DigitsCNN(Chain):
    """Two 3x3 convs, one 2x2 max-pool, two linears: enough for 8x8 digit images."""

    block_names = (
        "conv1",
        "relu1",
        "conv2",
        "relu2",
        "pool",
        "flatten",
        "fc1",
        "relu3",
        "fc2",
    )

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten(1)
        self.fc1 = nn.Linear(64 * (height // 2) * (width // 2), 128)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(128, num_classes)


class SkipIn(nn.Module):
    """x -> (hidden, skip): opens the two-tensor path that crosses every later boundary."""

    def __init__(self, d_in: int, width: int, skip_dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, width)
        # The skip is learned (not the raw input) so both boundary tensors carry a gradient.
        self.skip = nn.Linear(d_in, skip_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.flatten(1)
        return F.relu(self.fc(x)), self.skip(x)


class SkipMid(nn.Module):
    """(hidden, skip) -> (relu(fc(hidden)), skip): the skip passes through untouched."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.relu(self.fc(h)), skip


class SkipHead(nn.Module):
    """(hidden, skip) -> fc(hidden) + proj(skip): closes the skip connection."""

    def __init__(self, width: int, skip_dim: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, num_classes)
        self.proj = nn.Linear(skip_dim, num_classes)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(h) + self.proj(skip)


class SkipMLP(Chain):
    """An MLP with a long skip connection, so every inner split carries two tensors."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        width: int = 64,
        skip_dim: int = 32,
        depth: int = 3,
    ) -> None:
        super().__init__()
        self.inp = SkipIn(math.prod(input_shape), width, skip_dim)
        self.mid = nn.ModuleList(SkipMid(width) for _ in range(depth))
        self.head = SkipHead(width, skip_dim, num_classes)
        self.block_names = ("inp", *(f"mid.{i}" for i in range(depth)), "head")


class ResBlock(nn.Module):
    """BasicBlock without normalization: relu(conv2(relu(conv1(x))) + shortcut(x))."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        needs_proj = stride != 1 or c_in != c_out
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride) if needs_proj else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.conv1(x))) + self.shortcut(x))


class SmallResNet(Chain):
    """stem -> four residual blocks (16, 32, 64, 64 channels) -> avgpool -> fc; no BatchNorm."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, widths: Sequence[int] = (16, 32, 64, 64)
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], widths[0], 3, padding=1), nn.ReLU())
        strides = [1] + [2 if b > a else 1 for a, b in pairwise(widths)]
        c_ins = [widths[0], *widths[:-1]]
        self.res = nn.Sequential(
            *(ResBlock(a, b, s) for a, b, s in zip(c_ins, widths, strides, strict=True))
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        self.block_names = (
            "stem",
            *(f"res.{i}" for i in range(len(widths))),
            "avgpool",
            "flatten",
            "fc",
        )


def no_inplace(model: nn.Module) -> None:
    """In-place activations off: a stage's first layer gets a received tensor that autograd
    tracks as a leaf, and an in-place op on it raises. Output values are unchanged."""
    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            setattr(module, "inplace", False)  # noqa: B010 - nn.Module's own attribute
