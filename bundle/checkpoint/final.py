"""``--checkpoint FILE``: the weights at the end of a run as one file, gathered from the stages
(``format.save``'s atomic write, ``torch.load(..., weights_only=True)`` reads it)."""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from bundle.checkpoint.format import save
from bundle.engine.sharded import on_host
from bundle.engine.stage import Stage
from bundle.engine.tensor_parallel import Split
from bundle.topology import Coord, Topology


def _unwrap(stage: nn.Module) -> Stage:
    return cast(Stage, getattr(stage, "module", stage))  # a stage, or DDP around one


def save_distributed(
    path: str,
    stage: nn.Module,
    topo: Topology,
    coord: Coord,
    split: Split | None = None,
    *,
    group: dist.ProcessGroup,
    trained_only: bool = False,
) -> None:
    """Bundle 0's stage masters send their stage to rank 0, which writes the whole model
    (gathered first where it is sharded: ``--zero 3``); ``trained_only`` (a LoRA run): only the
    parameters that train (the adapters, ``--lora-train``'s modules).

    ``group`` spans the job on gloo (the control group): on the default group of an NCCL job,
    gather_object would pickle through CUDA tensors on the training communicator. ``split``:
    the stage's layers split over a TP group, gathered whole first (collective in each group).
    """
    whole = _unwrap(stage)
    state = whole.full_state_dict()
    if trained_only:  # first: a frozen split weight is not gathered for nothing
        trains = {whole.full_name(n) for n, p in whole.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trains}
    if split is not None and split.specs:
        state = {k: split.whole(k, v) if k in split.specs else v for k, v in state.items()}
    mine = on_host(state, keep=coord.bundle == 0 and coord.replica == 0 and coord.tp == 0)
    parts: list | None = [None] * topo.world_size if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if parts is not None:
        gathered: dict[str, torch.Tensor] = {}
        for part in parts:
            if part:
                gathered.update(part)
        save(path, gathered)
