"""Checkpoints: one plain state dict keyed by full-model names, written atomically, loaded safely."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from bundle.topology import Coord, Topology


def save(path: str, state: dict[str, torch.Tensor]) -> None:
    """Write to a temporary file beside ``path`` and rename, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _unwrap(stage: nn.Module) -> nn.Module:
    return getattr(stage, "module", stage)


def save_distributed(path: str, stage: nn.Module, topo: Topology, coord: Coord) -> None:
    """Bundle 0's stage masters send their stage to rank 0, which writes the whole model."""
    mine = None
    if coord.bundle == 0 and coord.replica == 0:
        mine = {k: v.detach().cpu() for k, v in _unwrap(stage).full_state_dict().items()}
    parts: list | None = [None] * topo.world_size if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is not None:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            if part:
                state.update(part)
        save(path, state)
