"""Rank layout, process groups and row plans: one frozen value computed from the config alone.

Ranks are laid out bundle-major; inside a bundle, stage 0's replicas come first::

    shape 2,1 x 2 bundles, 3 processes per node
    rank:    0    1    2  |  3    4    5
    bundle:  0    0    0  |  1    1    1
    stage:   0    0    1  |  0    0    1
    replica: 0    1    0  |  0    1    0
    node:    0    0    0  |  1    1    1

A micro-batch of ``m`` rows is cut into contiguous row ranges, one per replica of a stage (sizes
differ by at most one). Between stage ``s`` and ``s + 1`` replica ``i`` sends replica ``j`` exactly
the rows both own::

    m = 5, widths 2 -> 3
    stage s:   [0 1 2][3 4]          i=0: rows 0-2, i=1: rows 3-4
    stage s+1: [0 1][2 3][4]         j=0: rows 0-1, j=1: rows 2-3, j=2: row 4
    plan:      0->0 rows 0:2, 0->1 rows 2:3, 1->1 rows 3:4, 1->2 rows 4:5
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from bundle.errors import TopologyError

if TYPE_CHECKING:
    from bundle.config import RunConfig


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` contiguous pieces of ``total`` that differ by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def split_ranges(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Half-open ``[start, stop)`` ranges of :func:`split_sizes`."""
    ranges, start = [], 0
    for size in split_sizes(total, parts):
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


@dataclass(frozen=True)
class Coord:
    """Where one rank sits: its bundle, stage and replica index inside that stage."""

    bundle: int
    stage: int
    replica: int


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` of a micro-batch that replica ``src`` sends to replica ``dst``."""

    src: int
    dst: int
    start: int
    stop: int


def replica_rows(
    batch: int,
    num_bundles: int,
    micro_batches: int,
    width: int,
    bundle: int,
    micro: int,
    replica: int,
) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch of ``batch`` rows held by one replica of a stage of
    ``width`` replicas, for micro-batch ``micro`` of ``bundle``."""
    bundle_ranges = split_ranges(batch, num_bundles)
    b0, b1 = bundle_ranges[bundle]
    m0, m1 = split_ranges(b1 - b0, micro_batches)[micro]
    r0, r1 = split_ranges(m1 - m0, width)[replica]
    return b0 + m0 + r0, b0 + m0 + r1


def row_plan(rows: int, src_width: int, dst_width: int) -> tuple[Transfer, ...]:
    """Every non-empty intersection of the two stages' row ranges, in (src, dst) order."""
    plan = []
    dst_ranges = split_ranges(rows, dst_width)
    for i, (a, b) in enumerate(split_ranges(rows, src_width)):
        for j, (c, d) in enumerate(dst_ranges):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                plan.append(Transfer(i, j, lo, hi))
    return tuple(plan)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The whole job's layout. Pure: no torch.distributed call, so it is tested as data."""

    shape: tuple[int, ...]
    num_bundles: int
    procs_per_node: int
    global_batch: int
    micro_batches: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Topology:
        """The layout a run's config asks for (validated here, before any process starts)."""
        return cls(
            shape=cfg.parallel.shape,
            num_bundles=cfg.parallel.num_bundles,
            procs_per_node=cfg.procs_per_node,
            global_batch=cfg.train.batch_size,
            micro_batches=cfg.parallel.micro_batches,
        )

    def __post_init__(self) -> None:
        if not self.shape or any(w < 1 for w in self.shape):
            raise TopologyError(
                "--bundle-shape", ",".join(map(str, self.shape)), "every stage width must be >= 1"
            )
        if self.num_bundles < 1:
            raise TopologyError("--num-bundle", self.num_bundles, "must be >= 1")
        if self.procs_per_node < 1 or self.world_size % self.procs_per_node:
            raise TopologyError(
                "--nproc-per-node",
                self.procs_per_node,
                f"must divide the {self.world_size} processes "
                f"(sum of shape {self.shape} x {self.num_bundles} bundles)",
            )
        if self.micro_batches < 1:
            raise TopologyError("--micro-batches", self.micro_batches, "must be >= 1")
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

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.shape)

    @property
    def bundle_width(self) -> int:
        return sum(self.shape)

    @property
    def world_size(self) -> int:
        return self.bundle_width * self.num_bundles

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.procs_per_node

    # -- rank layout -----------------------------------------------------------------------------

    @cached_property
    def _stage_offsets(self) -> tuple[int, ...]:
        offsets, acc = [], 0
        for w in self.shape:
            offsets.append(acc)
            acc += w
        return tuple(offsets)

    def rank(self, bundle: int, stage: int, replica: int) -> int:
        if not (0 <= replica < self.shape[stage] and 0 <= bundle < self.num_bundles):
            raise IndexError(f"no replica {replica} of stage {stage} in bundle {bundle}")
        return bundle * self.bundle_width + self._stage_offsets[stage] + replica

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        bundle, local = divmod(rank, self.bundle_width)
        for stage in reversed(range(self.num_stages)):
            if local >= self._stage_offsets[stage]:
                return Coord(bundle, stage, local - self._stage_offsets[stage])
        raise AssertionError("unreachable")

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.procs_per_node

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.procs_per_node, (node + 1) * self.procs_per_node))

    def describe(self, rank: int) -> str:
        """``rank R (node n, bundle b, stage s, replica r)``: how errors name a process."""
        c = self.coord(rank)
        return (
            f"rank {rank} (node {self.node_of(rank)}, bundle {c.bundle}, "
            f"stage {c.stage}, replica {c.replica})"
        )

    # -- groups ----------------------------------------------------------------------------------

    def stage_group(self, stage: int) -> tuple[int, ...]:
        """All replicas of ``stage`` in all bundles: its data-parallel peers."""
        return tuple(
            self.rank(b, stage, r)
            for b in range(self.num_bundles)
            for r in range(self.shape[stage])
        )

    def bundle_stage_group(self, bundle: int, stage: int) -> tuple[int, ...]:
        """Replicas of ``stage`` inside one bundle."""
        return tuple(self.rank(bundle, stage, r) for r in range(self.shape[stage]))

    def stage_master(self, bundle: int, stage: int) -> int:
        return self.rank(bundle, stage, 0)

    def masters_group(self, stage: int) -> tuple[int, ...]:
        """The stage masters of every bundle (they allreduce in the hierarchical sync)."""
        return tuple(self.stage_master(b, stage) for b in range(self.num_bundles))

    # -- rows --------------------------------------------------------------------------------

    @cached_property
    def bundle_batches(self) -> tuple[int, ...]:
        """Rows of each bundle in one global batch."""
        return split_sizes(self.global_batch, self.num_bundles)

    def micro_sizes(self, bundle: int) -> tuple[int, ...]:
        """Rows of each micro-batch of ``bundle``."""
        return split_sizes(self.bundle_batches[bundle], self.micro_batches)

    def global_rows(self, bundle: int, micro: int, stage: int, replica: int) -> tuple[int, int]:
        """Rows of the global batch that this replica holds for one micro-batch."""
        return replica_rows(
            self.global_batch,
            self.num_bundles,
            self.micro_batches,
            self.shape[stage],
            bundle,
            micro,
            replica,
        )

    def sends(self, stage: int, replica: int, rows: int) -> tuple[Transfer, ...]:
        """What ``replica`` of ``stage`` sends forward for a micro-batch of ``rows`` rows."""
        if stage + 1 >= self.num_stages:
            return ()
        plan = row_plan(rows, self.shape[stage], self.shape[stage + 1])
        return tuple(t for t in plan if t.src == replica)

    def recvs(self, stage: int, replica: int, rows: int) -> tuple[Transfer, ...]:
        """What ``replica`` of ``stage`` receives from the previous stage for ``rows`` rows."""
        if stage == 0:
            return ()
        plan = row_plan(rows, self.shape[stage - 1], self.shape[stage])
        return tuple(t for t in plan if t.dst == replica)
