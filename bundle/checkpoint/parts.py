"""What one rank's checkpoint holds (``RankParts``) and where and when it saves
(``SaveSettings``): the typed values the session builds once and hands to ``Checkpointer``.

The parts are read by full-model names (``Stage.full_name``), so any shape reads what another
wrote; ``optimizer_slots`` says which tensors a restore reads a parameter's optimizer state into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bundle.config import CheckpointConfig
from bundle.engine.hops import Hop
from bundle.engine.outer import OuterSync
from bundle.engine.sharded import is_sharded
from bundle.engine.stage import Stage
from bundle.engine.tensor_parallel import Split
from bundle.models.quant import Frozen, sha256


def digest_of(t: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a tensor's bytes (uint8[32]): what a checkpoint keeps of a frozen base tensor;
    of one stored in fewer bytes (``--base-dtype``), of the tensor it was stored from, so that
    the base built again in full (a resume, an export's merge) is checked as it is."""
    return t.source if isinstance(t, Frozen) else sha256(t)


@dataclass(frozen=True, kw_only=True)
class RankParts:
    """What one rank's checkpoint holds: its stage's parameters and buffers, its optimizer's state
    (sharded under ``--zero 1``), the outer sync's state (``--bundle-sync local|diloco``), the
    gradient-compression hop's error feedback (PowerSGD) and ``extra`` entries the same on every
    rank (the loss scale), saved and restored in place."""

    stage: Stage
    optimizer: torch.optim.Optimizer
    outer: OuterSync | None = None
    hop: Hop | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # A LoRA run (--lora): the frozen base is not the checkpoint's to hold (it is read again from
    # where it came from); a digest of each of its tensors is, and is checked on resume.
    frozen_base: bool = False
    # Tensor parallelism: the stage's split layers; a checkpoint holds their whole tensors.
    split: Split | None = None
    _digests: dict[str, torch.Tensor] = field(default_factory=dict)

    def params(self) -> dict[str, torch.nn.Parameter]:
        """The stage's parameters by full-model name (of a LoRA run: those that train)."""
        return {
            self.stage.full_name(n): p
            for n, p in self.stage.named_parameters()
            if p.requires_grad or not self.frozen_base
        }

    def base_digests(self) -> dict[str, torch.Tensor]:
        """SHA-256 of each frozen base tensor this rank holds whole (uint8[32] by full-model
        name; computed once: the base never changes). None but of a LoRA run. A split one is
        gathered whole first: the digest is the whole tensor's, which any layout checks
        (collective over the TP group, in one order on each of its processes)."""
        if self.frozen_base and not self._digests:
            split = self.split
            for n, p in self.stage.named_parameters():
                if not p.requires_grad and not is_sharded(p) and not p.is_meta:
                    name = self.stage.full_name(n)
                    whole = split.whole(name, p) if split and name in split.specs else p
                    self._digests[name] = digest_of(whole)
        return self._digests

    def buffers(self) -> dict[str, torch.Tensor]:
        """The stage's buffers by full-model name."""
        return {self.stage.full_name(n): b for n, b in self.stage.named_buffers()}

    @property
    def device(self) -> torch.device:
        """Where the stage's parameters live (the CPU for a stage without any)."""
        return next((p.device for p in self.stage.parameters()), torch.device("cpu"))


@dataclass(frozen=True, kw_only=True)
class SaveSettings:
    """Where and when a rank saves: ``--save-dir``, ``--save-every`` and ``--keep`` (``config``),
    what ``bundle.json`` records of the run (``settings``, its ``layout`` among them), the steps
    of an epoch (the cadence without ``--save-every``) and the run's last step (``total``; 0:
    none), which is always saved."""

    config: CheckpointConfig
    settings: dict
    steps_per_epoch: int
    total: int = 0

    @property
    def every(self) -> int:
        """The save cadence in steps."""
        return self.config.save_every or self.steps_per_epoch


def optimizer_slots(
    params: dict[str, torch.nn.Parameter],
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    want: dict[str, torch.Tensor],
    pre: str = "",
) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Tensors to load the stored optimizer state of each parameter into (SGD's momentum,
    Adam's moments and step count), added to ``want``; whatever the optimizer stored."""
    slots: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        prefix = f"{pre}optim.{name}."
        for key, (shape, dtype) in stored.items():
            slot = key[len(prefix) :]
            if not key.startswith(prefix) or "." in slot:
                continue
            # Adam's step count lives on the CPU, as the optimizer keeps it (neither fused
            # nor capturable); every other slot beside its parameter, 0-d ones too (the
            # momentum of a scalar parameter).
            device = torch.device("cpu") if slot == "step" else p.device
            if is_sharded(p) and tuple(shape) == tuple(p.shape):  # --zero 3: this rank's shard
                want[key] = torch.zeros_like(p.detach(), dtype=dtype)
            else:
                want[key] = torch.zeros(shape, dtype=dtype, device=device)
            slots.setdefault(p, {})[slot] = want[key]
    return slots
