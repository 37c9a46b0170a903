"""Datasets as users bring them (``--dataset tests.support.user_data:NAME``)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Tiny(Dataset):
    """Deterministic 4x4 images in 3 classes, labels as 0-d tensors."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 4, 4, generator=gen)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def tiny(split: str) -> Dataset:
    return Tiny(40 if split == "train" else 8, 0 if split == "train" else 1)


def not_data(split: str) -> int:
    return 3


def tiny_declared(split: str) -> Dataset:
    """``tiny`` declaring its classes, as torchvision's datasets do (``classes``)."""
    ds = tiny(split)
    ds.classes = ["circle", "square", "star"]  # type: ignore[attr-defined]
    return ds


def two_classes(split: str) -> Dataset:
    """Two classes, labels held apart from the samples (``targets``) as torchvision's are."""
    ds = tiny(split)
    ds.y = ds.y % 2
    ds.targets = ds.y.tolist()  # type: ignore[attr-defined]
    return ds
