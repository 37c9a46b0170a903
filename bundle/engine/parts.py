"""What a ``StageEngine`` (bundle.engine.stage_engine) is built from: its model chunks with their
gradient syncs and transports, its optimizer and the syncs that run after it, the options of its
steps, the hooks the job around declares inside a step; and what the data hands it for one
micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bundle.engine.grad_sync import GradSync
from bundle.engine.loss import Loss
from bundle.engine.outer import OuterSync
from bundle.engine.precision import LossScaler, Policy
from bundle.engine.stage import Stage
from bundle.engine.ties import TiedGrads
from bundle.engine.transport import Transport
from bundle.models.inputs import Batch

# What the data pipeline hands a stage for one micro-batch: stage 0 gets the inputs, the last
# stage the labels of its own rows (read from the same deterministic shard), middle stages None.
# Named inputs (models.inputs) come as a dict: the whole batch's on stage 0, on a later stage
# the ones its pieces read.
MicroBatch = tuple[Batch | None, torch.Tensor | None]


def given_labels(t: torch.Tensor | None) -> torch.Tensor:
    """A micro-batch's labels (the last stage): there, always present."""
    if t is None:
        raise ValueError("this stage reads data but was handed none")
    return t


def given_batch(t: Batch | None) -> Batch:
    """A micro-batch's inputs (stage 0, or a stage reading named inputs): always present."""
    if t is None:
        raise ValueError("this stage reads data but was handed none")
    return t


@dataclass(frozen=True)
class Chunk:
    """One model chunk a replica runs (interleaving runs several per stage): its piece of the
    model, the gradient sync of that piece across the stage's replicas, and its transport."""

    stage: Stage
    sync: GradSync
    transport: Transport


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    """What one replica's engine runs: its model ``chunks`` in order (the first is the replica's
    own; under interleaving, chunk c is piece ``c x S + stage``), the ``optimizer`` over all of
    them, and where the run has them, the ``outer`` meetings between bundles (``--bundle-sync
    local|diloco``) and the gradient sum of weights ``ties`` across stages."""

    chunks: tuple[Chunk, ...]
    optimizer: torch.optim.Optimizer
    outer: OuterSync | None = None
    ties: TiedGrads | None = None

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("an engine runs at least one model chunk (got chunks=())")


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How the engine runs a step: the ``schedule`` (a name in bundle.ir.schedule's
    registry), the compute ``policy`` (None: the device's defaults), the loss ``scaler`` (None:
    unscaled), the ``loss`` (None: cross-entropy), ``early_receives``: receives posted ahead
    of their turn (bundle.ir.p2p; only gloo lets a receive progress on its own), and ``frozen``:
    the leading stages with nothing to train, which get no gradient (bundle.ir.p2p)."""

    schedule: str
    policy: Policy | None = None
    scaler: LossScaler | None = None
    loss: Loss | None = None
    early_receives: bool = False
    frozen: int = 0


@dataclass(frozen=True)
class StepHooks:
    """What the job around a step declares it does inside it (``--fault-tolerance bundle``):
    ``commit(step)`` between the gradient sync and the optimizer step (the vote: a step is taken
    by every process or by none), ``updated(step)`` once the update is enqueued (a survivor's
    state is taken between steps, never halfway through an update). None: nothing there."""

    commit: Callable[[int], None] | None = None
    updated: Callable[[int], None] | None = None
