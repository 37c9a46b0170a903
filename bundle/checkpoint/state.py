"""One rank's training state, defined once (``RankState``).

It is what a checkpoint saves and restores (``Checkpointer`` flattens it into its keys), what a
survivor keeps across a change of members under ``--fault-tolerance bundle``, hands to a new
process of its rank, and sends to a bundle that heals. Stateful in the sense of
``torch.distributed.checkpoint.stateful``: ``state_dict()`` / ``load_state_dict()`` over named
parts, each a flat ``{name: tensor}`` by full-model names, so any shape reads what another wrote:

    model     the stage's parameters
    buffers   the stage's buffers (BatchNorm's statistics: a replica's own)
    optim     the optimizer's tensors per parameter, ``<parameter>.<slot>`` (momentum, Adam's
              moments and step count); under ``--zero 1`` of the parameters this rank owns
    outer     the outer sync's anchor and momentum, ``<parameter>.anchor|momentum``
              (``--bundle-sync local|diloco``; the same on every replica of a stage)
    hop       PowerSGD's error feedback, ``error.<parameter>``: this rank's own, never sent
    extra     entries the same on every rank (the loss scale)

A tensor-only state: the learning rate is the schedule's at the step, set when training starts.
"""

from __future__ import annotations

from typing import Any

import torch

from bundle.checkpoint.parts import RankParts
from bundle.engine.optim import holder

State = dict[str, dict[str, torch.Tensor]]
PARTS = ("model", "buffers", "optim", "outer", "hop", "extra")
OWN = ("hop",)  # parts a rank keeps for itself: a peer's would count its residuals twice


class RankState:
    """The training state of one rank's parts (``RankParts``)."""

    def __init__(self, parts: RankParts) -> None:
        self.parts = parts
        self.optimizer = holder(parts.optimizer)  # ZeRO's local one: the owned parameters'
        self.owned = {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def state_dict(self) -> State:
        """Every part by name; its tensors are the live ones."""
        params = self.parts.params()
        outer, hop = self.parts.outer, self.parts.hop
        optim = {
            f"{name}.{slot}": value
            for name, p in params.items()
            for slot, value in self.optimizer.state.get(p, {}).items()
            if isinstance(value, torch.Tensor)
        }
        return {
            "model": {name: p.detach() for name, p in params.items()},
            "buffers": self.parts.buffers(),
            "optim": optim,
            "outer": {k.removeprefix("outer."): v for k, v in outer.state().items()}
            if outer is not None
            else {},
            "hop": hop.state(_names(params)) if hop is not None else {},
            "extra": dict(self.parts.extra),
        }

    @torch.no_grad()
    def load_state_dict(self, state: State) -> None:
        """Take ``state`` in place: parameters, buffers, outer state and extras copied into this
        rank's tensors, optimizer slots set on the parameters this rank holds state for (each on
        its parameter's device; Adam's step count where torch keeps it, on the host), the
        compression's error feedback where ``state`` has one (absent: it starts from zero)."""
        params, live = self.parts.params(), self.state_dict()
        for part in ("model", "buffers", "outer", "extra"):
            for name, value in state.get(part, {}).items():
                live[part][name].copy_(value)
        for key, value in state.get("optim", {}).items():
            name, _, slot = key.rpartition(".")
            p = params[name]
            if id(p) in self.owned:
                at = torch.device("cpu") if slot == "step" else p.device
                self.optimizer.state[p][slot] = value.detach().to(at, copy=True)
        if self.parts.hop is not None and state.get("hop"):
            self.parts.hop.load(
                {k: v.to(self.parts.device) for k, v in state["hop"].items()}, _names(params)
            )


def _names(params: dict[str, torch.nn.Parameter]) -> dict[torch.nn.Parameter, str]:
    return {p: n for n, p in params.items()}


def on_cpu(state: State) -> State:
    """The state with its tensors on the host, copied from a device (a host tensor is the same
    one): what is sent or written, since a receiver's device may differ."""
    return {part: {k: v.detach().cpu() for k, v in d.items()} for part, d in state.items()}


def shared(state: State) -> State:
    """``state`` without the parts a rank keeps for itself (what a peer sends to a new one)."""
    return {part: ({} if part in OWN else d) for part, d in state.items()}


def checked(got: Any) -> State:
    """A state read back from a file or a peer: exactly the parts above, each names to tensors
    (anything else is refused)."""
    if not isinstance(got, dict) or set(got) != set(PARTS):
        have = sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__
        raise ValueError(f"a rank's state has the parts {', '.join(PARTS)}; got {have}")
    for part, d in got.items():
        if not isinstance(d, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()
        ):
            raise ValueError(f"a rank's state: part {part} is not names to tensors")
    return got
