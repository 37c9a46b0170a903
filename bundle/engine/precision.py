"""The precision policy of a run, built once: compute dtype, boundary dtype and layout, loss scaling.

Every rank builds the same ``Policy`` from the same (fingerprint-checked) config, and the tensors
that cross a stage boundary are described by ``Policy.boundary``: the sender casts to that
description and the receiver allocates its buffers from it, so a receive buffer cannot disagree
with its send (gloo and NCCL would move the bytes of a bf16 tensor into an fp32 buffer without a
word). Master weights and optimizer state stay fp32; ``autocast`` sets the compute dtype.

With fp16, ``LossScaler`` scales the loss; after the gradient sync every rank unscales its own
gradients and the job agrees on skipping the step with one MAX all-reduce over all ranks, so a
stage that computes no loss still skips with the stage that overflowed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from bundle.collectives.comm import Collectives, Comm
from bundle.config import ComputeConfig
from bundle.engine.transport import TensorMeta
from bundle.ir.schedule import Action, backward_follows_forward

M = TypeVar("M", bound=nn.Module)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Policy:
    """How every stage of the run computes; the same value on every rank."""

    precision: str = "fp32"
    device_type: str = "cpu"
    channels_last: bool = False
    recompute: str = "never"

    @staticmethod
    def of(cfg: ComputeConfig, device: torch.device) -> Policy:
        return Policy(cfg.precision, device.type, cfg.channels_last, cfg.recompute)

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's context: autocast to the compute dtype, or nothing at all under fp32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def boundary(self, meta: TensorMeta) -> TensorMeta:
        """How one tensor crosses a boundary: floats in the compute dtype, images in the layout."""
        # fp32 activations travel in the compute dtype; other dtypes (integers, fp64) as they are.
        dtype = self.compute_dtype if meta.dtype == torch.float32 else meta.dtype
        return TensorMeta(meta.tail, dtype, self.channels_last and len(meta.tail) == 3)

    def recomputes(self, acts: list[Action], micro_batches: int, chunk: int = 0) -> list[bool]:
        """Per micro-batch, whether its forward (in ``chunk``) keeps only the chunk's inputs.

        ``except-last`` keeps the micro-batches whose backward comes right after their forward
        (torchgpipe's "except last", for its schedule): recomputing those lowers no peak.
        """
        if self.recompute == "never":
            return [False] * micro_batches
        keep = backward_follows_forward(acts, chunk) if self.recompute == "except-last" else set()
        return [k not in keep for k in range(micro_batches)]

    def prepare_stage(self, stage: M) -> M:
        return stage.to(memory_format=torch.channels_last) if self.channels_last else stage

    def prepare_input(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Stage 0's input on the device, in the stage's memory format."""
        if self.channels_last and x.dim() == 4:
            return x.to(device, memory_format=torch.channels_last, non_blocking=True)
        return x.to(device, non_blocking=True)

    def make_scaler(
        self, device: torch.device, group=None, comm: Comm | None = None
    ) -> LossScaler | None:
        if self.precision != "fp16":
            return None
        return LossScaler(device=device, group=group, comm=comm)


def describe(cfg: ComputeConfig) -> str:
    """``bf16, recompute always, channels-last, compiled per block (inductor)`` (only what is
    not the default, after fp32)."""
    parts = [cfg.precision]
    if cfg.recompute != "never":
        parts.append(f"recompute {cfg.recompute}")
    if cfg.channels_last:
        parts.append("channels-last")
    if cfg.compile:
        parts.append(f"compiled per block ({cfg.compile_backend})")
    return ", ".join(parts)


def set_tf32(enabled: bool) -> None:
    """fp32 matmuls and convolutions on CUDA in TF32 (PyTorch's default: convolutions only)."""
    matmul = torch.backends.cuda.matmul
    conv = getattr(torch.backends.cudnn, "conv")  # noqa: B009 - set up at import, not in the stubs
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9; the allow_tf32 flags are deprecated
        matmul.fp32_precision = conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


class LossScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank of the job.

    The rules are ``torch.amp.GradScaler``'s (start at 2**16, halve on inf/NaN and skip the
    step, double after 2000 clean steps); the scale is a power of two, so scaling and unscaling
    are exact. ``group`` spans every rank of the job (None: the default group, whose NCCL
    communicator also carries the pipeline's point-to-point calls: the vote goes through ``comm``).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        group=None,
        comm: Comm | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.device, self.group, self.comm = device, group, comm or Collectives()
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        # Tensors so that a checkpoint holds them like any other entry.
        self.scale_t = torch.tensor(init_scale, dtype=torch.float64)
        self.growth_t = torch.tensor(0, dtype=torch.int64)
        self.skipped_t = torch.tensor(0, dtype=torch.int64)  # over the whole run, resumes too
        self._found = torch.zeros(1, device=device)

    @property
    def scale(self) -> float:
        return float(self.scale_t)

    @property
    def skipped(self) -> int:
        return int(self.skipped_t)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_agree(self, params: Iterable[nn.Parameter]) -> bool:
        """Unscale this rank's gradients; True when every rank of the job found them finite.

        Collective over ``group``: every rank calls it once per step, whatever its stage.
        """
        found = self._found.zero_()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        self.comm.all_reduce(found, self.group, op=dist.ReduceOp.MAX).wait()
        ok = not bool(found.item())
        self._update(ok)
        return ok

    def _update(self, ok: bool) -> None:
        if not ok:
            self.skipped_t += 1
            self.scale_t.mul_(self.backoff_factor)
            self.growth_t.zero_()
            return
        self.growth_t += 1
        if int(self.growth_t) == self.growth_interval:
            self.scale_t.mul_(self.growth_factor)
            self.growth_t.zero_()

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint entries (the same on every rank)."""
        return {
            "precision.loss_scale": self.scale_t,
            "precision.growth_tracker": self.growth_t,
            "precision.skipped_steps": self.skipped_t,
        }
