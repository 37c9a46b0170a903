"""The engine's ``Stage``: one piece of the model as a module, its blocks run in order (or
recomputed in backward), its parameters and buffers named as in the full model; ``joined``: a
rank's model chunks as one stage for what holds its whole state; ``split_model``: stages from a
model's blocks and where each begins (``bundle.models.partition.resolve``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from bundle import models
from bundle.engine.memory import run_recomputed
from bundle.errors import PartitionError
from bundle.models import Block, apply_blocks
from bundle.models.cut import split_blocks


class Stage(nn.Module):
    """A contiguous run of blocks; shares modules with the full model (no copies)."""

    def __init__(
        self,
        blocks: Sequence[Block],
        *,
        input_dtype: torch.dtype = torch.float32,
        input_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        if not blocks:
            raise PartitionError("a stage needs at least one block")
        self.names: tuple[str, ...] = tuple(name for name, _ in blocks)
        self.blocks = nn.ModuleList(module for _, module in blocks)
        # A graph split's blocks name their parameters as the full model does already.
        self._named_fully = tuple(getattr(m, "named_fully", False) for _, m in blocks)
        # Set by the runner per micro-batch: keep only the stage's inputs, recompute the rest.
        self.recompute = False
        # What the model takes (token ids: long), for inputs made up before training.
        self.input_dtype = input_dtype
        # The batch's named inputs (models.inputs), in the order the first stage takes them.
        self.input_names = input_names
        # The named inputs its blocks read from the data besides what they receive (read once
        # here: the engine asks every micro-batch).
        self.side = tuple(dict.fromkeys(n for _, m in blocks for n in getattr(m, "side", ())))

    def forward(
        self, *inputs: torch.Tensor, side: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The blocks applied to ``inputs``; ``side``: the named inputs the blocks read."""
        blocks = list(zip(self.names, self.blocks, strict=True))
        if self.recompute and torch.is_grad_enabled():
            out = run_recomputed(blocks, *inputs, side=side)
        else:
            out = apply_blocks(blocks, *inputs, side=side)
        return out if isinstance(out, tuple) else (out,)

    def full_name(self, name: str) -> str:
        """``blocks.3.weight`` -> the full model's name, e.g. ``layer1.0.conv1.weight``."""
        head, _, rest = name.partition(".")
        index, _, leaf = rest.partition(".")
        if head != "blocks" or not index.isdigit() or int(index) >= len(self.names) or not leaf:
            raise PartitionError(f"{name!r} is not a parameter or buffer name of this stage")
        return leaf if self._named_fully[int(index)] else f"{self.names[int(index)]}.{leaf}"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers keyed by full-model names."""
        return {self.full_name(k): v for k, v in self.state_dict().items()}

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load this stage's entries from a full-model state dict (other entries are ignored)."""
        own = {k: self.full_name(k) for k in self.state_dict()}
        missing = sorted(full for full in own.values() if full not in state)
        if missing:
            raise PartitionError(
                f"state dict lacks {len(missing)} entries of stage {self.names[0]}..{self.names[-1]}"
                f", e.g. {missing[:3]}"
            )
        self.load_state_dict({k: state[full] for k, full in own.items()}, strict=True)


def joined(pieces: Sequence[Stage]) -> Stage:
    """The blocks of several pieces as one stage, for what holds a rank's whole state (the
    optimizer, checkpoints) when it runs several model chunks; it is never run forward."""
    return Stage([(n, m) for p in pieces for n, m in zip(p.names, p.blocks, strict=True)])


def split_model(model: nn.Module | Sequence[Block], starts: Sequence[int]) -> list[Stage]:
    """Cut a model (or its ``blocks``) into stages beginning at the given block indices (from
    ``resolve``). A parameter several stages use (tied weights) is held by each of them; their
    gradients are summed among them every step (bundle.engine.ties)."""
    blocks = models.blocks(model) if isinstance(model, nn.Module) else list(model)
    return [Stage(piece) for piece in split_blocks(blocks, starts)]
