"""Where each tensor of a safetensors file lies (``Span``, from its header), and a tensor-parallel
shard read from it (``--pretrained`` under ``--tensor-parallel``): only this process's rows or
columns of each split weight, never the whole tensor, so what a process holds resident is its
share of its stages."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from safetensors import safe_open

from bundle.models.tp import ShardSpec


@dataclass(frozen=True)
class Span:
    """One tensor as its file's header gives it: the file, its dtype (safetensors' name) and
    shape, and the byte range of its data."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header(path: str) -> dict[str, Span]:
    """A file's tensors by name: their dtype, shape and byte range, from its header (checked
    against the file's size)."""
    with safe_open(path, framework="pt"):
        pass
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(size))
    spans = {}
    for key, entry in entries.items():
        if key != "__metadata__":
            begin, end = (8 + size + offset for offset in entry["data_offsets"])
            spans[key] = Span(path, entry["dtype"], tuple(entry["shape"]), begin, end)
    return spans


@dataclass(frozen=True)
class ShardRead:
    """Process ``index`` of a TP group of ``degree``'s shard of one tensor, cut as ``spec``."""

    spec: ShardSpec
    index: int
    degree: int

    def whole(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The whole tensor's shape from the shard's."""
        out = list(shape)
        out[self.spec.dim] *= self.degree
        return tuple(out)

    @torch.no_grad()
    def read(self, span: Span, targets: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        """The shard's bytes of the file's tensor (of element type ``dtype``) into the first
        target, one contiguous run at a time (a run per block and outer index: rows of a colwise
        weight, a row's columns of a rowwise one); the other targets (tied names) copy it."""
        first, d, parts = targets[0], self.spec.dim, self.spec.parts
        outer, n = math.prod(span.shape[:d]), span.shape[d]
        inner = math.prod(span.shape[d + 1 :])
        block = n // parts
        piece = block // self.degree
        rows = first.view(outer, parts * piece * inner)
        size = torch.empty((), dtype=dtype).element_size()
        with open(span.path, "rb") as f:
            for o in range(outer):
                for p in range(parts):
                    start = (o * n + p * block + self.index * piece) * inner
                    f.seek(span.begin + start * size)
                    out = rows[o, p * piece * inner : (p + 1) * piece * inner]
                    raw = out if dtype == first.dtype else torch.empty(out.numel(), dtype=dtype)
                    got = f.readinto(cast(Any, raw.view(torch.uint8).numpy()))
                    if got != raw.numel() * size:
                        raise OSError(f"{span.path} was cut short while it was read")
                    if raw is not out:
                        out.copy_(raw)
        for other in targets[1:]:
            if other.data_ptr() != first.data_ptr():
                other.copy_(first)
