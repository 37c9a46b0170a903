"""A tensor-parallel rank's checkpoint entries (``--tensor-parallel``): whole tensors.

Each process of a TP group holds a shard of every split layer's parameters and of their optimizer
state. A checkpoint holds them whole, as a run without tensor parallelism writes them: the group
gathers each before it is written (every process then offers the same tensor, which the writer
keeps once), and a restore reads the whole tensor and takes this process's shard. A checkpoint
is therefore read by any layout, with or without tensor parallelism, and exported as any other.
Under ``--zero 3`` a split parameter and its optimizer state are DTensors over the replicas of
the same TP index: gathered over them first (``Split.whole``), and on restore this process's TP
shard is cut again as FSDP holds it.
"""

from __future__ import annotations

import torch

from bundle.engine.sharded import assign, like
from bundle.engine.tensor_parallel import Split

State = dict[str, dict[str, torch.Tensor]]


def whole_state(state: State, split: Split) -> State:
    """``state`` (``RankState.state_dict``'s parts) with every split parameter and every
    optimizer slot shaped like one whole; collective over the TP group, in the same order on
    every process of it (the parts are alike)."""
    model, optim = dict(state["model"]), dict(state["optim"])
    for name, p in state["model"].items():
        if name in split.specs:
            model[name] = split.whole(name, p)
    for key, value in state["optim"].items():
        name = key.rpartition(".")[0]
        if name in split.specs and value.shape == state["model"][name].shape:
            optim[key] = split.whole(name, value)
    return {**state, "model": model, "optim": optim}


def whole_targets(
    want: dict[str, torch.Tensor],
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    split: Split,
    pre: str,
) -> dict[str, torch.Tensor]:
    """Replace each split parameter's target in ``want`` (its live shard) by a whole tensor of
    the stored shape to read into; returns the live shards by key (``take_shards`` fills them)."""
    live = {}
    for key in list(want):
        name = key.removeprefix(f"{pre}model.")
        if key.startswith(f"{pre}model.") and name in split.specs:
            live[key] = want[key]
            shape, dtype = stored[key]
            want[key] = torch.zeros(shape, dtype=dtype, device=live[key].device)
    return live


@torch.no_grad()
def take_shards(
    want: dict[str, torch.Tensor],
    live: dict[str, torch.Tensor],
    slots: dict[torch.nn.Parameter, dict[str, torch.Tensor]],
    params: dict[str, torch.nn.Parameter],
    split: Split,
    pre: str,
) -> None:
    """This process's shard of each whole tensor read: into the live parameters (``live``, from
    ``whole_targets``) and in place of each whole optimizer slot (``slots``, by parameter;
    ``params``: the parameters by full name)."""
    for key, shard in live.items():
        assign(shard, split.shard(key.removeprefix(f"{pre}model."), want[key]))
    names = {id(p): n for n, p in params.items()}
    for p, by_slot in slots.items():
        name = names[id(p)]
        if name not in split.specs:
            continue
        for slot, value in by_slot.items():
            if value.dim() and value.shape != p.shape:
                by_slot[slot] = like(p, split.shard(name, value))
