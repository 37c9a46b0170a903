"""The optimizer of a stage: SGD, AdamW or Adam over the stage's parameters, built alike on every
replica; with ``--no-decay-norm-bias`` the 1-d parameters (biases, normalisation scales) form a
second group without weight decay. The learning rate of every group follows the schedule
(bundle.lr_schedule); the state is checkpointed per parameter under its full-model name.

With ``--zero 1`` the optimizer is PyTorch's ``ZeroRedundancyOptimizer`` over the stage's group:
each replica holds the state of its share of the parameters (whole parameters, balanced by size),
steps them, and broadcasts them to the others. Every parameter's update is the same arithmetic
as without it, so training is unchanged; ``holder`` is the optimizer that holds this process's
state (a checkpoint saves from it)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from bundle.collectives.comm import Collectives, Comm
from bundle.config import TrainConfig
from bundle.engine.sharded import is_sharded
from bundle.errors import ConfigError


def param_groups(cfg: TrainConfig, stage: nn.Module) -> list[dict[str, Any]]:
    """One group, or decayed and undecayed groups with ``--no-decay-norm-bias``."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not cfg.no_decay_norm_bias:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decayed = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}]
    return groups + [{"params": plain, "weight_decay": 0.0}] if plain else groups


@functools.cache
def _zero_class() -> type:
    """ZeRO-1 whose broadcasts after each step run as one call of the group's communicator
    (bundle.collectives.comm: in order under nccl-emu). torch.distributed.optim is imported only
    for --zero 1: it pulls in FSDP and DTensor, a second of every other process's start-up."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ZeRO(ZeroRedundancyOptimizer):
        def __init__(self, *args: Any, comm: Comm, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._comm = comm

        def step(self, closure: Any = None, **kwargs: Any) -> Any:
            with self._comm.exclusive(self.process_group, "ZeRO-1's parameter broadcasts"):
                return super().step(closure, **kwargs)

    return ZeRO


def _adam_options(cfg: TrainConfig) -> dict[str, Any]:
    return {"betas": (cfg.betas[0], cfg.betas[1]), "eps": cfg.eps}


# --optimizer NAME -> torch's optimizer class and its options from the config (the names
# bundle.config.OPTIMIZERS accepts: a test keeps the two the same).
OPTIMIZERS: dict[str, Callable[[TrainConfig], tuple[type[torch.optim.Optimizer], dict[str, Any]]]]
OPTIMIZERS = {
    "sgd": lambda cfg: (torch.optim.SGD, {"momentum": cfg.momentum, "nesterov": cfg.nesterov}),
    "adamw": lambda cfg: (torch.optim.AdamW, _adam_options(cfg)),
    "adam": lambda cfg: (torch.optim.Adam, _adam_options(cfg)),
}

# --optimizer NAME -> the bytes of state it keeps per parameter, as torch keeps it: fp32 copies,
# since master weights and optimizer state stay fp32 under every --precision
# (bundle.engine.precision). The planner's memory model reads it (bundle.plan.cost), divided by
# the stage group's size under --zero 1. Adam's step count is one scalar per tensor: left out.
STATE_BYTES: dict[str, Callable[[TrainConfig], int]] = {
    "sgd": lambda cfg: 4 if cfg.momentum else 0,  # momentum_buffer, only with --momentum > 0
    "adamw": lambda cfg: 2 * 4,  # exp_avg, exp_avg_sq
    "adam": lambda cfg: 2 * 4,
}


def state_bytes_per_param(cfg: TrainConfig) -> int:
    """Bytes of optimizer state per parameter that ``cfg``'s optimizer keeps (unsharded)."""
    if cfg.optimizer not in STATE_BYTES:
        raise ConfigError("--optimizer", cfg.optimizer, f"choose one of: {', '.join(STATE_BYTES)}")
    return STATE_BYTES[cfg.optimizer](cfg)


def make_optimizer(
    cfg: TrainConfig,
    stage: nn.Module,
    *,
    shard_over: dist.ProcessGroup | None = None,
    comm: Comm | None = None,
) -> torch.optim.Optimizer:
    """This stage's optimizer; every replica of the stage builds the same one. With
    ``shard_over``, its state is sharded over that group (ZeRO-1), its broadcasts through
    ``comm``."""
    groups = param_groups(cfg, stage)
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", cfg.optimizer, f"choose one of: {', '.join(OPTIMIZERS)}")
    kind, options = OPTIMIZERS[cfg.optimizer](cfg)
    options["lr"] = cfg.lr
    if shard_over is None or not any(g["params"] for g in groups):  # nothing to shard: frozen
        return kind(groups, **options)
    return _zero_class()(
        groups,
        optimizer_class=kind,
        process_group=shard_over,
        comm=comm or Collectives(),
        **options,
    )


def holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this process's state: ZeRO's local one, else ``optimizer``."""
    zero = sys.modules.get("torch.distributed.optim")  # not imported: no ZeRO optimizer exists
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` this process holds: of a DTensor (a parameter sharded by FSDP2, its
    gradient, its optimizer state), the local shard, not the global tensor; of a frozen base
    tensor stored in fewer bytes (``--base-dtype``), what it stores."""
    if is_sharded(t):
        t = cast(Any, t).to_local()
    stored = getattr(t, "stored_bytes", None)  # a frozen base kept in fewer bytes (models.quant)
    if isinstance(stored, int):
        return stored
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this process holds (momentum, Adam's moments and step
    counts); 0 before the first step and for plain SGD."""
    return sum(
        local_bytes(t)
        for state in holder(optimizer).state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
