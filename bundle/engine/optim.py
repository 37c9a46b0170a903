"""The optimizer of a stage: SGD, AdamW or Adam over the stage's parameters, built alike on every
replica; with ``--no-decay-norm-bias`` the 1-d parameters (biases, normalisation scales) form a
second group without weight decay. The learning rate of every group follows the schedule
(bundle.lr_schedule); the state is checkpointed per parameter under its full-model name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bundle.config import TrainConfig


def param_groups(cfg: TrainConfig, stage: nn.Module) -> list[dict[str, Any]]:
    """One group, or decayed and undecayed groups with ``--no-decay-norm-bias``."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not cfg.no_decay_norm_bias:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decayed = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}]
    return groups + [{"params": plain, "weight_decay": 0.0}] if plain else groups


def make_optimizer(cfg: TrainConfig, stage: nn.Module) -> torch.optim.Optimizer:
    """This stage's optimizer; every replica of the stage builds the same one."""
    groups = param_groups(cfg, stage)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    kind = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return kind(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this process holds (momentum, Adam's moments and step
    counts); 0 before the first step and for plain SGD."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
