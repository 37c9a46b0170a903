"""Rank layout, process groups and row plans: one frozen value computed from the config alone.

Ranks are laid out bundle-major; inside a bundle, stage 0's replicas come first::

    shape 2,1 x 2 bundles, 3 processes per node
    rank:    0    1    2  |  3    4    5
    bundle:  0    0    0  |  1    1    1
    stage:   0    0    1  |  0    0    1
    replica: 0    1    0  |  0    1    0
    node:    0    0    0  |  1    1    1

How a micro-batch's rows are cut among a stage's replicas, and which rows cross between two
stages, is ``bundle.rows``' arithmetic; the layout asks it per stage (``stage_ranges``,
``transfers``), with the stage's width or its row weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import TYPE_CHECKING

from bundle.errors import TopologyError
from bundle.row_weights import format_row_weights as format_row_weights
from bundle.row_weights import parse_row_weights as parse_row_weights
from bundle.row_weights import shape_text
from bundle.rows import Transfer as Transfer
from bundle.rows import replica_rows as replica_rows
from bundle.rows import row_plan as row_plan
from bundle.rows import row_plan_by, width_ranges
from bundle.rows import split_ranges as split_ranges
from bundle.rows import split_sizes as split_sizes
from bundle.rows import weighted_ranges as weighted_ranges
from bundle.rows import weighted_sizes as weighted_sizes

if TYPE_CHECKING:
    from bundle.config import RunConfig


@dataclass(frozen=True)
class Coord:
    """Where one rank sits: its bundle, stage and replica index inside that stage, and its index
    in the replica's tensor-parallel group (0 without tensor parallelism)."""

    bundle: int
    stage: int
    replica: int
    tp: int = 0


@dataclass(frozen=True)
class Place:
    """Where one rank runs (a plan's placement): its node, the local device index it drives (None:
    its local rank, the default), the device type's name, and on CPU the fraction of one CPU it
    may use (an emulated slower device; None: no limit)."""

    node: int
    device: int | None = None
    kind: str = ""
    cpu: float | None = None


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The whole job's layout. Pure: no torch.distributed call, so it is tested as data."""

    shape: tuple[int, ...]
    num_bundles: int
    procs_per_node: int
    global_batch: int
    micro_batches: int
    # Per stage, each replica's share of a micro-batch's rows (parse_row_weights); () : even.
    row_weights: tuple[tuple[Fraction, ...], ...] = ()
    # Per rank, where it runs (a plan's placement); () : ranks fill the nodes in order.
    placement: tuple[Place, ...] = field(default=(), compare=False)
    # The model's last piece, which computes the loss, runs on the first stage (a V placement of
    # model chunks, --schedule zbv) instead of the last.
    loss_on_first: bool = False
    # Fault tolerance (``keep``): the job's bundles this layout holds, in order, and the job's
    # layout they come from; each keeps its ranks' devices and its rows of every global batch.
    members: tuple[int, ...] = ()
    job: Topology | None = field(default=None, compare=False, repr=False)
    # Each stage's tensor-parallel degree (() : 1 everywhere): a replica of stage s runs on
    # tp[s] consecutive processes, its TP group; ``rank`` names the first of them by default.
    tp: tuple[int, ...] = ()

    @property
    def loss_stage(self) -> int:
        """The stage whose replicas compute the loss (and read the labels)."""
        return 0 if self.loss_on_first else self.num_stages - 1

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Topology:
        """The layout a run's config asks for (validated here, before any process starts)."""
        return cls(
            shape=cfg.parallel.shape,
            num_bundles=cfg.parallel.num_bundles,
            procs_per_node=cfg.procs_per_node,
            global_batch=cfg.train.batch_size,
            micro_batches=cfg.parallel.micro_batches,
            row_weights=(
                parse_row_weights(cfg.parallel.row_weights, cfg.parallel.shape)
                if cfg.parallel.row_weights
                else ()
            ),
            placement=tuple(Place(*p) for p in cfg.parallel.placement),
            loss_on_first=cfg.parallel.loss_on_first,
            tp=cfg.parallel.tp_degrees if max(cfg.parallel.tp_degrees, default=1) > 1 else (),
        )

    def __post_init__(self) -> None:
        if not self.shape or any(w < 1 for w in self.shape):
            raise TopologyError(
                "--bundle-shape", ",".join(map(str, self.shape)), "every stage width must be >= 1"
            )
        if self.num_bundles < 1:
            raise TopologyError("--num-bundle", self.num_bundles, "must be >= 1")
        if self.tp and (len(self.tp) != len(self.shape) or min(self.tp) < 1):
            raise TopologyError("--tensor-parallel", self.tp, "give one degree >= 1 per stage")
        if self.job is not None:
            return  # cut from a job's layout, which was checked
        if self.procs_per_node < 1 or self.world_size % self.procs_per_node:
            raise TopologyError(
                "--nproc-per-node",
                self.procs_per_node,
                f"must divide the {self.world_size} processes "
                f"(sum of shape {self.shape} x {self.num_bundles} bundles)",
            )
        if self.micro_batches < 1:
            raise TopologyError("--micro-batches", self.micro_batches, "must be >= 1")
        if self.row_weights:
            self._check_weighted_rows()
            self._check_placement()
            return
        self._check_placement()
        if self.tp:
            self._check_tp_nodes()
        smallest = self.global_batch // self.num_bundles // self.micro_batches
        if smallest < max(self.shape):
            need = max(self.shape) * self.micro_batches * self.num_bundles
            raise TopologyError(
                "--batch-size",
                self.global_batch,
                f"must be >= {need} so that each of {self.num_bundles} bundle(s) x "
                f"{self.micro_batches} micro-batch(es) gives every one of the "
                f"{max(self.shape)} replicas of the widest stage at least one row",
            )

    def keep(self, members: tuple[int, ...]) -> Topology:
        """The layout of the job's bundles ``members`` alone (a bundle left: fault tolerance).

        Its ranks are numbered afresh, bundle-major as always, but each keeps the node, device and
        CPU share its rank has in the job, and each bundle its rows of every global batch: the
        global batch is the members' rows, so the loss is their mean.
        """
        job = self.job or self
        if self.job is not None:
            members = tuple(self.members[b] for b in members)
        if list(members) == list(range(job.num_bundles)):
            return job
        if not members or sorted(set(members)) != list(members) or members[-1] >= job.num_bundles:
            raise TopologyError("members", members, f"bundles 0..{job.num_bundles - 1}, in order")
        ranks = [job.rank(b, 0, 0) + i for b in members for i in range(job.bundle_width)]
        return Topology(
            shape=job.shape,
            num_bundles=len(members),
            procs_per_node=job.procs_per_node,
            global_batch=sum(job.bundle_batches[b] for b in members),
            micro_batches=job.micro_batches,
            row_weights=job.row_weights,
            placement=tuple(
                Place(job.node_of(r), job.device_index(r), job.kind(r), job.cpu_share(r))
                for r in ranks
            ),
            loss_on_first=job.loss_on_first,
            members=members,
            job=job,
            tp=job.tp,
        )

    @property
    def bundles(self) -> tuple[int, ...]:
        """The job's numbers of this layout's bundles."""
        return self.members if self.job is not None else tuple(range(self.num_bundles))

    @property
    def whole(self) -> Topology:
        """The job's layout (itself unless cut by ``keep``)."""
        return self.job or self

    def job_bundle(self, bundle: int) -> int:
        """The job's number of this layout's ``bundle``."""
        return self.bundles[bundle]

    def job_rank(self, rank: int) -> int:
        """The job's number of this layout's ``rank``."""
        if self.job is None:
            return rank
        c = self.coord(rank)
        return self.job.rank(self.members[c.bundle], c.stage, c.replica)

    def _check_weighted_rows(self) -> None:
        if tuple(map(len, self.row_weights)) != self.shape:
            raise TopologyError(
                "--row-weights",
                format_row_weights(self.row_weights),
                f"give one weight per replica of shape {shape_text(self.shape)}",
            )
        micro = sorted({m for b in range(self.num_bundles) for m in self.micro_sizes(b)})
        for rows in micro:
            for s, weights in enumerate(self.row_weights):
                sizes = weighted_sizes(rows, weights)
                if min(sizes) < 1:
                    r = sizes.index(0)
                    raise TopologyError(
                        "--row-weights",
                        format_row_weights(self.row_weights),
                        f"a micro-batch of {rows} rows gives replica {r} of stage {s} no row "
                        f"(rows {'/'.join(map(str, sizes))}); raise --batch-size, lower "
                        "--micro-batches or even out the weights",
                    )

    def _check_tp_nodes(self) -> None:
        """A TP group's processes sum every layer's output: they share a node."""
        for s, b in ((s, b) for s in range(self.num_stages) for b in range(self.num_bundles)):
            for g in (self.tp_group(b, s, r) for r in range(self.shape[s])):
                if self.node_of(g[0]) != self.node_of(g[-1]):
                    why = f"the TP group of ranks {g[0]}..{g[-1]} would span two nodes"
                    raise TopologyError("--nproc-per-node", self.procs_per_node, why)

    def _check_placement(self) -> None:
        if not self.placement:
            return
        if len(self.placement) != self.world_size:
            raise TopologyError(
                "placement",
                f"{len(self.placement)} ranks",
                f"must place each of the {self.world_size} processes",
            )
        seen: dict[tuple[int, int], int] = {}
        for rank, p in enumerate(self.placement):
            if not 0 <= p.node < self.num_nodes:
                raise TopologyError(
                    "placement",
                    f"rank {rank} on node {p.node}",
                    f"the job has nodes 0..{self.num_nodes - 1}",
                )
            if p.cpu is not None and p.cpu <= 0:
                raise TopologyError("placement", f"rank {rank} cpu {p.cpu}", "must be > 0")
            if p.device is not None:
                other = seen.setdefault((p.node, p.device), rank)
                if other != rank:
                    raise TopologyError(
                        "placement",
                        f"rank {rank} on node {p.node} device {p.device}",
                        f"rank {other} drives that device already",
                    )
        for node in range(self.num_nodes):
            n = sum(p.node == node for p in self.placement)
            if n != self.procs_per_node:
                raise TopologyError(
                    "placement",
                    f"{n} processes on node {node}",
                    f"every node runs {self.procs_per_node} (--nproc-per-node)",
                )

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.shape)

    @property
    def bundle_width(self) -> int:
        """Processes of one bundle: each stage's width times its tensor-parallel degree."""
        return sum(w * self.tp_of(s) for s, w in enumerate(self.shape))

    def tp_of(self, stage: int) -> int:
        """``stage``'s tensor-parallel degree (1: none)."""
        return self.tp[stage] if self.tp else 1

    @property
    def world_size(self) -> int:
        return self.bundle_width * self.num_bundles

    @property
    def num_nodes(self) -> int:
        if self.job is not None:
            return self.job.num_nodes
        return self.world_size // self.procs_per_node

    # -- rank layout -----------------------------------------------------------------------------

    @cached_property
    def _stage_offsets(self) -> tuple[int, ...]:
        offsets, acc = [], 0
        for s, w in enumerate(self.shape):
            offsets.append(acc)
            acc += w * self.tp_of(s)
        return tuple(offsets)

    def rank(self, bundle: int, stage: int, replica: int, tp: int = 0) -> int:
        """The process of ``replica`` of ``stage`` in ``bundle``: its TP group's ``tp``-th."""
        if not (0 <= replica < self.shape[stage] and 0 <= bundle < self.num_bundles):
            raise IndexError(f"no replica {replica} of stage {stage} in bundle {bundle}")
        degree = self.tp_of(stage)
        if not 0 <= tp < degree:
            raise IndexError(f"no tensor-parallel rank {tp} in stage {stage} of degree {degree}")
        return bundle * self.bundle_width + self._stage_offsets[stage] + replica * degree + tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        bundle, local = divmod(rank, self.bundle_width)
        for stage in reversed(range(self.num_stages)):
            if local >= self._stage_offsets[stage]:
                replica, tp = divmod(local - self._stage_offsets[stage], self.tp_of(stage))
                return Coord(bundle, stage, replica, tp)
        raise AssertionError("unreachable")

    def node_of(self, rank: int) -> int:
        if self.placement:
            return self.placement[rank].node
        return rank // self.procs_per_node

    def local_rank(self, rank: int) -> int:
        if self.placement:
            return self.node_ranks(self.node_of(rank)).index(rank)
        return rank % self.procs_per_node

    def node_ranks(self, node: int) -> tuple[int, ...]:
        if self.placement:
            return tuple(r for r, p in enumerate(self.placement) if p.node == node)
        return tuple(range(node * self.procs_per_node, (node + 1) * self.procs_per_node))

    def device_index(self, rank: int) -> int:
        """The local device ``rank`` drives: its placement's, else its local rank."""
        if self.placement and self.placement[rank].device is not None:
            return self.placement[rank].device  # type: ignore[return-value]
        return self.local_rank(rank)

    def kind(self, rank: int) -> str:
        """The device type a plan places ``rank`` on ("": not named)."""
        return self.placement[rank].kind if self.placement else ""

    def cpu_share(self, rank: int) -> float | None:
        """The fraction of one CPU a plan gives ``rank`` (an emulated slower device), or None."""
        return self.placement[rank].cpu if self.placement else None

    def describe(self, rank: int) -> str:
        """``rank R (node n, bundle b, stage s, replica r)``: how errors name a process."""
        if self.job is not None:  # processes are named as in the job
            return self.job.describe(self.job_rank(rank))
        c = self.coord(rank)
        tp = f", tp {c.tp}" if self.tp_of(c.stage) > 1 else ""
        return (
            f"rank {rank} (node {self.node_of(rank)}, bundle {c.bundle}, "
            f"stage {c.stage}, replica {c.replica}{tp})"
        )

    # -- groups ----------------------------------------------------------------------------------

    def stage_group(self, stage: int) -> tuple[int, ...]:
        """All replicas of ``stage`` in all bundles: its data-parallel peers."""
        width = self.shape[stage]
        return tuple(self.rank(b, stage, r) for b in range(self.num_bundles) for r in range(width))

    def bundle_stage_group(self, bundle: int, stage: int) -> tuple[int, ...]:
        """Replicas of ``stage`` inside one bundle."""
        return tuple(self.rank(bundle, stage, r) for r in range(self.shape[stage]))

    def tp_group(self, bundle: int, stage: int, replica: int) -> tuple[int, ...]:
        """The processes of one replica, which split its layers (tensor parallelism)."""
        first = self.rank(bundle, stage, replica)
        return tuple(range(first, first + self.tp_of(stage)))

    @staticmethod
    def shifted(ranks: tuple[int, ...], tp: int) -> tuple[int, ...]:
        """A group of replicas (named by their first processes) as its ``tp``-th processes."""
        return tuple(r + tp for r in ranks)

    def stage_master(self, bundle: int, stage: int) -> int:
        return self.rank(bundle, stage, 0)

    def masters_group(self, stage: int) -> tuple[int, ...]:
        """The stage masters of every bundle (they allreduce in the hierarchical sync)."""
        return tuple(self.stage_master(b, stage) for b in range(self.num_bundles))

    # -- rows --------------------------------------------------------------------------------

    @cached_property
    def bundle_batches(self) -> tuple[int, ...]:
        """Rows of each bundle in one global batch."""
        if self.job is not None:
            return tuple(self.job.bundle_batches[b] for b in self.members)
        return split_sizes(self.global_batch, self.num_bundles)

    def micro_sizes(self, bundle: int) -> tuple[int, ...]:
        """Rows of each micro-batch of ``bundle``."""
        return split_sizes(self.bundle_batches[bundle], self.micro_batches)

    def stage_weights(self, stage: int) -> int | tuple[Fraction, ...]:
        """How ``stage`` splits a micro-batch: its width (even rows) or its replicas' weights."""
        return self.row_weights[stage] if self.row_weights else self.shape[stage]

    def stage_ranges(self, stage: int, rows: int) -> tuple[tuple[int, int], ...]:
        """Each replica's ``[start, stop)`` of a micro-batch of ``rows`` rows at ``stage``."""
        return width_ranges(rows, self.stage_weights(stage))

    def stage_sizes(self, stage: int, rows: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.stage_ranges(stage, rows))

    def rows_fit(self, rows: int) -> bool:
        """Whether a bundle batch of ``rows`` rows (one micro-batch) gives every replica a row."""
        return all(min(self.stage_sizes(s, rows)) >= 1 for s in range(self.num_stages))

    def global_rows(self, bundle: int, micro: int, stage: int, replica: int) -> tuple[int, int]:
        """Rows of the global batch that this replica holds for one micro-batch."""
        if self.job is not None:
            return self.job.global_rows(self.members[bundle], micro, stage, replica)
        return replica_rows(
            self.global_batch,
            self.num_bundles,
            self.micro_batches,
            self.stage_weights(stage),
            bundle,
            micro,
            replica,
        )

    def transfers(
        self, src: int, dst: int, rows: int, *, by_src: bool
    ) -> tuple[tuple[Transfer, ...], ...]:
        """The row plan of a micro-batch of ``rows`` rows from stage ``src`` to stage ``dst`` (any
        two stages: interleaved chunks also cross from the last stage to the first), listed per
        replica of ``src`` (``by_src``) or of ``dst``."""
        return row_plan_by(rows, self.stage_weights(src), self.stage_weights(dst), by_src)

    def sends(self, stage: int, replica: int, rows: int) -> tuple[Transfer, ...]:
        """What ``replica`` of ``stage`` sends forward for a micro-batch of ``rows`` rows."""
        if stage + 1 >= self.num_stages:
            return ()
        return self.transfers(stage, stage + 1, rows, by_src=True)[replica]

    def recvs(self, stage: int, replica: int, rows: int) -> tuple[Transfer, ...]:
        """What ``replica`` of ``stage`` receives from the previous stage for ``rows`` rows."""
        if stage == 0:
            return ()
        return self.transfers(stage - 1, stage, rows, by_src=False)[replica]
