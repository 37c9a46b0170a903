"""Activation memory: recompute of a stage's blocks, and an exact count of what backward keeps.

Recompute runs a stage's blocks as one non-reentrant ``torch.utils.checkpoint`` unit per
micro-batch, as torchgpipe does: the forward keeps only the stage's inputs, and the micro-batch's
backward runs the stage again to rebuild what it needs, so at most one micro-batch's activations
exist in full at any time (while its backward runs). Running a block
again in training mode would update the running statistics of BatchNorm (and of InstanceNorm
that tracks them) a second time (pytorch issue 96136), so the recomputation runs those layers with
momentum 0: they normalise with the same batch statistics and leave the buffers (and
``num_batches_tracked``) as the forward left them.

``SavedBytes`` counts, with ``saved_tensors_hooks``, the bytes of tensors saved for backward
that are alive at once (storages counted once, parameters not at all): the activation memory of
a schedule, exactly, without timing anything. What a recomputation rebuilds is invisible to those
hooks (checkpoint keeps it apart), so for a recomputed micro-batch the meter also measures, at its
forward, what a plain forward would have saved, and counts that on top of everything alive when
the micro-batch's backward starts: ``peak`` is then the peak with recompute's transient included,
and ``kept_peak`` what stays saved between forwards and backwards.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from bundle.models import Block, apply_blocks


class _StatisticsFrozen:
    """Momentum 0 leaves the running statistics as they are; the step counter is put back.

    (Turning ``track_running_stats`` off instead would change which tensors the recomputation
    saves, and checkpoint refuses a recomputation that saves differently.) Entered once per
    recomputation: twice for a backward split in two halves (zero-bubble schedules), whose
    weight half recomputes again."""

    def __init__(self, norms: Sequence[_NormBase]) -> None:
        self.norms = norms
        self.saved: list[tuple] = []

    def __enter__(self) -> None:
        self.saved = [
            (m.momentum, n, n.clone() if n is not None else None)
            for m in self.norms
            for n in (m.num_batches_tracked,)
        ]
        for m in self.norms:
            m.momentum = 0.0

    def __exit__(self, *exc) -> None:
        for m, (momentum, n, count) in zip(self.norms, self.saved, strict=True):
            m.momentum = momentum
            if n is not None and count is not None:
                n.copy_(count)


def run_recomputed(
    blocks: Sequence[Block], *inputs: torch.Tensor, side: Mapping[str, torch.Tensor] | None = None
) -> torch.Tensor | tuple:
    """Apply ``blocks`` as one checkpointed unit: keep the stage's inputs (and the named inputs
    ``side`` it reads), recompute the rest."""
    norms = [m for _, block in blocks for m in block.modules() if isinstance(m, _NormBase)]
    return checkpoint(
        apply_blocks,
        blocks,
        *inputs,
        side=side,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _StatisticsFrozen(norms)),
    )


class SavedBytes:
    """Peak bytes of saved-for-backward tensors alive at once, while ``tracking()`` is entered."""

    def __init__(self, module: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._live: dict[int, int] = {}  # storage -> saved tensors holding it
        self._rebuilt: dict[int, int] = {}  # micro-batch -> bytes its recomputation rebuilds
        self.current = 0
        self.kept_peak = 0  # saved between forward and backward
        self.peak = 0  # with recomputation's transient

    def reset_peak(self) -> None:
        self.peak = self.kept_peak = self.current

    def recomputed_forward(self, micro: int, stage: nn.Module, run) -> None:
        """Measure what recomputing ``micro`` will rebuild: ``run()`` once more, plainly.

        Untimed measurement only: a second forward, with running statistics left alone.
        """
        inner = SavedBytes(stage)
        inner._params |= set(self._live)  # what is already counted (the stage's inputs) once
        norms = [m for m in stage.modules() if isinstance(m, _NormBase)]
        with inner.tracking(), _StatisticsFrozen(norms):
            out = run()
        del out
        self._rebuilt[micro] = inner.peak

    def backward_starts(self, micro: int) -> None:
        self.peak = max(self.peak, self.current + self._rebuilt.pop(micro, 0))

    def _pack(self, t: torch.Tensor) -> _Held:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        held = _Held(t)
        if key in self._params or t.device.type == "meta":
            return held
        count = self._live.get(key, 0)
        self._live[key] = count + 1
        if count == 0:
            self.current += storage.nbytes()
            self.kept_peak = max(self.kept_peak, self.current)
            self.peak = max(self.peak, self.current)
        # Autograd drops the packed value when the saved tensor is freed (after its backward).
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key: int, nbytes: int) -> None:
        self._live[key] -= 1
        if self._live[key] == 0:
            del self._live[key]
            self.current -= nbytes

    def tracking(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.t
