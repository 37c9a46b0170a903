"""What a training process is started with, as typed values passed whole.

``WorkerStart`` is what its node supervisor (or torchrun's entry) hands a worker: plain values and
the supervisor's shared counters, picklable for a spawned process. In the worker it becomes a
``ProcessContext``: that, with the store, phase and stop request the worker made for itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

    from bundle.config import RunConfig
    from bundle.models.cut import Capture
    from bundle.runtime.phase import Phase
    from bundle.runtime.preemption import StopRequest
    from bundle.topology import Topology


class SharedInt(Protocol):
    """An integer shared with the node supervisor (a ``multiprocessing`` value)."""

    value: int


class SharedFloat(Protocol):
    """A float shared with the node supervisor (a ``multiprocessing`` value)."""

    value: float


@dataclass(frozen=True, kw_only=True)
class Counters:
    """What a worker shares with its node supervisor; all None under torchrun."""

    step_now: SharedInt | None = None  # the step in progress (-1 before the first)
    alive: SharedFloat | None = None  # the last sign of life (process.beat)
    stop: SharedInt | None = None  # the supervisor's stop flag (the signal number)


@dataclass(frozen=True, kw_only=True)
class StoreAt:
    """Where the job's store is; ``serve``: this process serves it (torchrun's rank 0 when its
    agent serves none)."""

    host: str
    port: int
    serve: bool = False


@dataclass(frozen=True, kw_only=True)
class Incarnation:
    """Which process of its rank this is, under --fault-tolerance bundle (``fault.train_on``).
    ``number`` > 0: started again to heal its bundle; ``handoff_to``: where a survivor writes its
    state for a new process (on NCCL); ``handed``: this process is that new process, the file to
    read."""

    number: int = 0
    handoff_to: str | None = None
    handed: str | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerStart:
    """What one training process is started with. ``attempt`` counts the job's restarts,
    ``resume`` is the checkpoint to start from, ``capture`` the model's graph split made by the
    launch's checks (None: cut here)."""

    cfg: RunConfig
    topo: Topology
    rank: int
    local_rank: int
    store_at: StoreAt
    attempt: int = 0
    resume: str | None = None
    capture: Capture | None = None
    counters: Counters = field(default_factory=Counters)
    incarnation: Incarnation = field(default_factory=Incarnation)


@dataclass(frozen=True, kw_only=True)
class ProcessContext:
    """A running worker: what it was started with, its backend ("gloo" or "nccl"), the job's
    store (under this attempt's or generation's prefix), where it is (``phase``) and its stop
    request."""

    start: WorkerStart
    backend: str
    store: dist.Store
    phase: Phase
    stop: StopRequest
