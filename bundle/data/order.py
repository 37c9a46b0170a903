"""The order samples are trained in: a pure function of ``(seed, epoch, global index)``.

Every step draws one global batch from a permutation of the epoch seeded by ``(seed, epoch)``;
the batch is cut into bundles, micro-batches and replica rows exactly as the topology cuts it, so a
single process reading the same global batches sees the same samples in the same rows, and a run
resumed at step ``s`` under any shape reads exactly the batches the uninterrupted run would have.
The training stream names samples by *key* ``epoch * n + index``: a stream can start at any step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import torch

from bundle.errors import DataError
from bundle.topology import replica_rows


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch; the same on every process."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def steps_per_epoch(n: int, batch: int) -> int:
    return n // batch


def global_batch(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices of the global batch of training ``step`` (epochs follow each other)."""
    spe = steps_per_epoch(n, batch)
    if spe == 0:
        raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
    epoch, t = divmod(step, spe)
    return epoch_order(n, seed, epoch)[t * batch : (t + 1) * batch]


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Which rows of each batch one stage-0 replica reads."""

    num_bundles: int
    micro_batches: int
    width: int | tuple[Fraction, ...]  # replicas of the stage, or their row weights
    bundle: int
    replica: int

    def rows(self, batch_len: int, micro: int) -> tuple[int, int]:
        return replica_rows(
            batch_len,
            self.num_bundles,
            self.micro_batches,
            self.width,
            self.bundle,
            micro,
            self.replica,
        )

    def micro_indices(self, batch: torch.Tensor) -> list[torch.Tensor]:
        return [batch[slice(*self.rows(len(batch), k))] for k in range(self.micro_batches)]


def replica_indices(
    shard: Shard, n: int, batch: int, seed: int, steps: int, *, start: int = 0
) -> Iterator[torch.Tensor]:
    """This replica's key list of every micro-batch of steps ``start .. steps-1``, lazily.

    A key is ``epoch * n + index`` (``index`` from ``global_batch``); starting at ``start`` yields
    exactly the tail of the stream from step 0, without drawing the earlier epochs' permutations.
    """
    spe = steps_per_epoch(n, batch)
    if spe == 0:
        raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    keys, epoch = torch.empty(0, dtype=torch.long), -1
    for step in range(start, steps):
        if step // spe != epoch:
            epoch = step // spe
            keys = epoch_order(n, seed, epoch) + epoch * n
        t = step % spe
        yield from shard.micro_indices(keys[t * batch : (t + 1) * batch])
