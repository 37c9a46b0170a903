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


class MaskedText(Dataset):
    """Padded token sequences in 3 classes, as a tokenizer gives them to a text classifier:
    ``input_ids`` (0 where padded), ``attention_mask`` (0 there) and ``token_type_ids`` (a
    second segment from the middle on); lengths vary, so the mask changes the outputs."""

    classes = ["negative", "neutral", "positive"]

    def __init__(self, n: int, seed: int, seq_len: int = 8) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, seq_len + 1, (n,), generator=gen)
        keep = torch.arange(seq_len) < lengths[:, None]
        self.ids = torch.randint(1, 40, (n, seq_len), generator=gen) * keep
        self.mask = keep.long()
        self.types = (torch.arange(seq_len) >= seq_len // 2).long().expand(n, -1) * keep
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = {
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "token_type_ids": self.types[i],
        }
        return x, self.y[i]


def masked_text(split: str) -> Dataset:
    return MaskedText(64 if split == "train" else 16, 0 if split == "train" else 1)


def masked_text_unmasked(split: str) -> Dataset:
    """``masked_text`` with every position kept: what a run that dropped the mask would see."""
    ds = masked_text(split)
    ds.mask = torch.ones_like(ds.mask)  # type: ignore[attr-defined]
    return ds
