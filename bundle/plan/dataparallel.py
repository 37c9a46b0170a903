"""The data-parallel options the planner costs as given (never searched): the hop between bundles
compressed, bundles that meet every H steps, robust aggregation, and ZeRO-1 and ZeRO-3.

The cost of each, beside the plain sync of ``bundle.plan.cost`` (steady state: the uncompressed
warm-up steps of ``--compression-warmup`` are not counted):

- **Two hops.** ``--bundle-sync local:H|diloco:H`` or ``--aggregate`` other than ``mean`` sync
  gradients as ``--grad-sync hierarchical`` does (reduce in the bundle, the masters' hop between
  bundles, broadcast in the bundle), whatever ``--grad-sync`` says (``bundle.session``).
- **Compression** (``--grad-compression``) shrinks the bytes of the hop between bundles only: the
  whole DDP all-reduce of the flat sync, the masters' all-reduce of the hierarchical one. ``bf16``
  and ``fp16`` halve them. ``powersgd`` sends, per parameter viewed as ``(shape[0], -1)``,
  ``rank * (rows + cols)`` elements where torch's ``_should_compress`` (min rate 2) says so, and
  every element otherwise (1-d parameters always); its latency, QR and error-feedback arithmetic are
  not counted. An anatomy without parameter shapes (an older cache entry, a literal test model) is
  approximated: each block's parameters as one square matrix.
- **Meetings** (``local:H``, ``diloco:H``): no masters' hop per step; every H steps the masters
  all-reduce the stage's fp32 parameters (its drift), broadcast the result in the bundle and take
  the outer step (counted as one optimizer step): a 1/H share of that per step.
- **Robust aggregation** (``median``, ``trimmed:K``): the masters' hop is a ring all-gather (each
  master receives the N - 1 other bundles' buckets: ``(N-1) * bytes``, about N/2 all-reduces), then
  the coordinate-wise sort, counted as memory traffic only: four copies of the N gathered buckets
  (stack, scale, sorted values and their int64 indices); a lower bound, comparisons are free.
- **Memory**: PowerSGD's error feedback (the stage's fp32 gradients once more), a meeting's anchor,
  drift and DiLoCo's momentum (assumed on: DiLoCo's default), and a gather's N buckets five times
  over (parts, stack, values, indices of 8 bytes) on the masters.
- **ZeRO-1** (``--zero 1``): each replica holds its share of the optimizer's state, the state
  divided by its stage group's size (``plans.evaluate``); the parameter broadcasts after the step
  are not counted.
- **ZeRO-3** (``--zero 3``): parameters, gradients and state sharded, gathered block by block every
  micro-batch (``bundle.plan.zero``); costed with the plain sync only (no compression, the mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bundle.config import (
    COMPRESSIONS,
    ZERO_LEVELS,
    ParallelConfig,
    parse_aggregate,
    parse_bundle_sync,
)
from bundle.errors import ConfigError
from bundle.plan.cost import CostModel

HALF = ("bf16", "fp16")
_PSGD_MIN_RATE = 2  # PowerSGDState's min_compression_rate default, which the engine keeps
_COMBINE_COPIES = 4  # stack, scale by shares, sort's values and indices (8-byte: two copies' worth)
_GATHER_COPIES = 5  # what a master holds of the gathered buckets at once, the indices twice


@dataclass(frozen=True)
class DataParallel:
    """``--grad-compression``, ``--powersgd-rank``, ``--bundle-sync``, ``--aggregate`` and
    ``--zero``."""

    compression: str = "none"
    powersgd_rank: int = 4
    bundle_sync: str = "step"
    aggregate: str = "mean"
    zero: int = 0  # 1: the optimizer's state sharded (ZeRO-1); 3: parameters and gradients too

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                "--grad-compression",
                self.compression,
                f"choose one of: {', '.join(COMPRESSIONS)}",
            )
        if not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ConfigError("--powersgd-rank", self.powersgd_rank, "must be an integer >= 1")
        parse_bundle_sync(self.bundle_sync)
        parse_aggregate(self.aggregate)
        # The combinations ParallelConfig refuses: a plan for them could never run.
        if self.compression != "none" and (not self.per_step or self.gathers):
            raise ConfigError(
                "--grad-compression",
                self.compression,
                "compresses the per-step, averaged sync between bundles only",
            )
        if self.zero not in ZERO_LEVELS:
            raise ConfigError(
                "--zero",
                self.zero,
                "choose 0 (off), 1 (shard optimizer state) or 3 (shard parameters, gradients and "
                "optimizer state)",
            )
        if self.zero == 3 and (self.compression != "none" or self.gathers):
            raise ConfigError(
                "--zero",
                self.zero,
                "reduce-scatters plain averaged gradients: no compression or robust "
                "aggregation with it",
            )
        if self.zero and not self.per_step:
            raise ConfigError(
                "--zero", self.zero, "shards state that --bundle-sync keeps per bundle"
            )

    @classmethod
    def of(cls, par: ParallelConfig) -> DataParallel:
        return cls(
            par.grad_compression, par.powersgd_rank, par.bundle_sync, par.aggregate, par.zero
        )

    @property
    def every(self) -> int:
        """Steps between the bundles' meetings (1: every step)."""
        return parse_bundle_sync(self.bundle_sync)[1]

    @property
    def per_step(self) -> bool:
        return parse_bundle_sync(self.bundle_sync)[0] == "step"

    @property
    def shardable(self) -> bool:
        """Whether ``--zero 3`` runs beside these options (a per-step, averaged, plain sync)."""
        return self.compression == "none" and self.per_step and not self.gathers

    @property
    def gathers(self) -> bool:
        return parse_aggregate(self.aggregate) is not None

    @property
    def min_bundles(self) -> int:
        """The fewest bundles these options accept (ParallelConfig's checks)."""
        trim = parse_aggregate(self.aggregate)
        if trim is not None:
            return max(3, 2 * trim + 1)
        return 1 if self.per_step else 2

    def accepts(self, shape: tuple[int, ...], num_bundles: int) -> bool:
        """Whether ParallelConfig runs these options on this shape and bundle count."""
        if num_bundles < self.min_bundles:
            return False
        plain = self.compression == "none" and not self.zero  # both need a replica to sync with
        return plain or max(shape) * num_bundles > 1

    def two_hops(self, grad_sync: str) -> bool:
        """Whether the stage syncs in the bundle, then between bundles (``bundle.engine.data_parallel.in_two_hops``)."""
        return grad_sync == "hierarchical" or not self.per_step or self.gathers

    def flags(self) -> list[str]:
        """The main.py arguments that differ from the defaults."""
        out: list[str] = []
        if self.compression != "none":
            out += ["--grad-compression", self.compression]
            if self.compression == "powersgd":
                out += ["--powersgd-rank", str(self.powersgd_rank)]
        if self.bundle_sync != "step":
            out += ["--bundle-sync", self.bundle_sync]
        if self.aggregate != "mean":
            out += ["--aggregate", self.aggregate]
        if self.zero:
            out += ["--zero", str(self.zero)]
        return out


EXACT = DataParallel()  # every option at its default: the sync as it always was


def powersgd_elems(shape: tuple[int, ...], rank: int) -> int:
    """Elements PowerSGD sends for one parameter (P and Q, or the tensor itself)."""
    # Imported here: the planner's pure parts should not pull torch.distributed in for nothing.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    # torch leaves it unannotated: typed here, so this module passes mypy's strict set.
    should: Callable[[int, int, int, int], tuple[bool, int, int]] = powerSGD_hook._should_compress
    numel = math.prod(shape)
    if len(shape) <= 1:
        return numel
    rows = shape[0]
    cols = numel // rows if rows else 0
    ok, full, small = should(rows, cols, min(rows, cols, rank), _PSGD_MIN_RATE)
    return int(small if ok else full)


def _block_wire(cost: CostModel, dp: DataParallel) -> np.ndarray:
    """Bytes per block on the hop between bundles under ``dp``'s compression."""
    full = np.array([cost.grad_bytes(j, j + 1) for j in range(cost.n)])
    if dp.compression in HALF:
        return full / 2
    if dp.compression != "powersgd":
        return full
    out = full.copy()
    for j, block in enumerate(cost.anatomy.blocks):
        shapes, trained = block.param_shapes, block.trained
        if not shapes and trained:  # no shapes counted: one square matrix (module docstring)
            side = max(1, math.isqrt(trained))
            shapes = ((side, trained // side),)
        elems = sum(powersgd_elems(s, dp.powersgd_rank) for s in shapes)
        out[j] = full[j] * min(1.0, elems / trained) if trained else 0.0
    return out


class HopCost:
    """Seconds and bytes of the hop between bundles, and of the meetings, for one cost model."""

    def __init__(self, cost: CostModel, dp: DataParallel) -> None:
        self.cost, self.dp = cost, dp
        self.wire = _block_wire(cost, dp)

    def wire_bytes(self, buckets: list[tuple[int, float]], hi: int) -> list[float]:
        """Bytes each bucket of ``cost.buckets(lo, hi)`` puts on the hop between bundles."""
        if self.dp.compression == "none":
            return [nbytes for _, nbytes in buckets]  # exactly the sync's own bytes
        out, end = [], hi
        for j, _ in buckets:  # a bucket holds blocks j .. end-1 (buckets fill from the back)
            out.append(float(self.wire[j:end].sum()))
            end = j
        return out

    def between(self, nbytes: float, wire: float, nodes: list[int]) -> float:
        """One bucket's hop between bundles: ``nbytes`` in fp32, ``wire`` of them compressed."""
        if self.dp.gathers:
            return self.cost.allgather(nbytes, nodes) + self.combine(nbytes, len(nodes))
        return self.cost.allreduce(wire, nodes)

    def combine(self, nbytes: float, n: int) -> float:
        """The coordinate-wise sort of ``n`` gathered buckets, as memory traffic."""
        return self.cost.copy_time(_COMBINE_COPIES * n * nbytes) if n > 1 else 0.0

    def meeting(self, lo: int, hi: int, masters: list[int], inner: list[int]) -> float:
        """Per step: a 1/H share of the masters' meeting, its broadcast and the outer step."""
        if self.dp.per_step:
            return 0.0
        nbytes = self.cost.grad_bytes(lo, hi)
        whole = (
            self.between(nbytes, nbytes, masters)
            + self.cost.reduce(nbytes, inner)
            + self.cost.optimizer(lo, hi)
        )
        return whole / self.dp.every

    def state_bytes(self, lo: int, hi: int, *, largest_bucket: float, bundles: int) -> float:
        """Bytes a stage's master holds for the options (the module docstring's memory)."""
        params = self.cost.grad_bytes(lo, hi)
        out = params if self.dp.compression == "powersgd" else 0.0
        mode = parse_bundle_sync(self.dp.bundle_sync)[0]
        if mode != "step":
            out += params * (3 if mode == "diloco" else 2)  # anchor, drift (and momentum)
        if self.dp.gathers and bundles > 1:
            gathered = largest_bucket if self.dp.per_step else params
            out += _GATHER_COPIES * bundles * gathered
        return out
