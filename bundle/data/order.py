"""The order samples are trained in: a pure function of ``(seed, epoch, global index)``.

Every step draws one global batch from a permutation of the epoch seeded by ``(seed, epoch)``;
the batch is cut into bundles, micro-batches and replica rows exactly as the topology cuts it, so a
single process reading the same global batches sees the same samples in the same rows, and a run
resumed at step ``s`` under any shape reads exactly the batches the uninterrupted run would have.
The training stream names samples by *key* ``epoch * n + index``: a stream can start at any step.

The permutation is drawn whole (``torch.randperm``) for the datasets that fit in memory; a corpus
of tokens (``lazy``) takes it from ``Walked``, which computes each position's sample alone, so no
process holds a table that grows with the corpus.
"""

from __future__ import annotations

import hashlib
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


class Walked:
    """The permutation of ``range(n)`` of one epoch, evaluated at the positions asked for: a
    keyed Feistel network over the smallest even number of bits that covers ``n``, applied again
    while it lands at ``n`` or above (cycle walking: a permutation of ``range(n)``, fewer than
    four rounds on average). Its memory does not grow with ``n`` (up to 2**62)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        self.half = (max(2, (n - 1).bit_length()) + 1) // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=4 * self.ROUNDS).digest()
        self.keys = [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4)]

    def _round(self, right: torch.Tensor, key: int) -> torch.Tensor:
        # 32-bit mixing in int64 arithmetic that never overflows (constants below 2**31).
        h = ((right ^ key) * 0x2545F491) & 0xFFFFFFFF
        h = h ^ (h >> 15)
        h = (h * 0x6F4F2A35) & 0xFFFFFFFF
        return (h ^ (h >> 13)) & self.mask

    def _permute(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __getitem__(self, where: slice) -> torch.Tensor:
        x = self._permute(torch.arange(where.start, where.stop, dtype=torch.int64))
        while bool((out := x >= self.n).any()):
            x[out] = self._permute(x[out])
        return x


def _order(n: int, seed: int, epoch: int, lazy: bool) -> torch.Tensor | Walked:
    return Walked(n, seed, epoch) if lazy else epoch_order(n, seed, epoch)


def steps_per_epoch(n: int, batch: int) -> int:
    return n // batch


def global_batch(n: int, batch: int, seed: int, step: int, *, lazy: bool = False) -> torch.Tensor:
    """Indices of the global batch of training ``step`` (epochs follow each other)."""
    spe = steps_per_epoch(n, batch)
    if spe == 0:
        raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
    epoch, t = divmod(step, spe)
    return _order(n, seed, epoch, lazy)[t * batch : (t + 1) * batch]


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
    shard: Shard, n: int, batch: int, seed: int, steps: int, *, start: int = 0, lazy: bool = False
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
    order: torch.Tensor | Walked = torch.empty(0, dtype=torch.long)
    epoch = -1
    for step in range(start, steps):
        if step // spe != epoch:
            epoch = step // spe
            order = _order(n, seed, epoch, lazy)
        t = step % spe
        yield from shard.micro_indices(order[t * batch : (t + 1) * batch] + epoch * n)


def stream_indices(
    shard: Shard, batch: int, steps: int, *, start: int = 0
) -> Iterator[torch.Tensor]:
    """A stream's windows (``--dataset hf``) in the order they come: step ``s`` trains on windows
    ``s*batch .. (s+1)*batch - 1``; this replica's of every micro-batch of steps ``start ..``."""
    for step in range(start, steps):
        yield from shard.micro_indices(torch.arange(step * batch, (step + 1) * batch))
