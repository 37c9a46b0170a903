"""What a simulation of one step takes and gives: a plan's layout as the engine runs it
(``Layout``), and the simulated step (``SimResult``: per replica, and its ``Span`` timeline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from bundle.ir.schedule import REGISTRY, Pipe
from bundle.plan.dataparallel import DataParallel
from bundle.topology import Place, Topology


@dataclass(frozen=True)
class Span:
    """One interval of one replica's step: ``kind`` is compute, wait, send, sync or optimizer."""

    rank: int
    kind: str
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class Layout:
    """What the simulation needs of a plan: the engine's own parameters, nothing derived."""

    shape: tuple[int, ...]
    num_bundles: int
    starts: tuple[int, ...]  # block where each piece begins (stages x chunks pieces)
    micro_batches: int
    schedule: str
    grad_sync: str
    batch: int
    procs_per_node: int
    dp: DataParallel = DataParallel()  # the user's options, costed as given
    row_weights: tuple[tuple[Fraction, ...], ...] = ()  # () : even rows
    placement: tuple[Place, ...] = ()  # () : ranks fill the nodes in order, on one device type
    chunks: int = 1  # model chunks per stage (--virtual-stages)
    tp: tuple[int, ...] = ()  # each stage's tensor-parallel degree (() : 1 everywhere)

    @property
    def pipe(self) -> Pipe:
        return REGISTRY[self.schedule].pipe(len(self.shape), self.chunks)

    def topology(self) -> Topology:
        return Topology(
            shape=self.shape,
            num_bundles=self.num_bundles,
            procs_per_node=self.procs_per_node,
            global_batch=self.batch,
            micro_batches=self.micro_batches,
            row_weights=self.row_weights,
            placement=self.placement,
            tp=self.tp,
        )


@dataclass
class SimResult:
    step_time: float
    ranks: list[int]  # the replicas of bundle 0, in rank order
    stage_of: list[int]
    busy: list[float]  # compute seconds per replica
    sync: list[float]  # seconds a replica waited for its gradient sync after its last action
    peak_in_flight: list[int]
    timeline: list[Span] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.step_time - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Fraction of the step the replicas spend neither computing nor syncing gradients."""
        n = len(self.busy)
        waiting = sum(self.step_time - b - s for b, s in zip(self.busy, self.sync, strict=True))
        return max(0.0, waiting / (n * self.step_time)) if self.step_time > 0 else 0.0
