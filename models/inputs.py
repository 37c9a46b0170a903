"""A batch of several named inputs (``input_ids``, ``attention_mask``, ``token_type_ids``): what a
dataset's sample may give instead of one tensor, and how a model is called with it.

A sample's input is either one tensor or a mapping of names to tensors. Named, the model is
called with them as keyword arguments (``model(input_ids=..., attention_mask=...)``); the first
name is the batch's *primary* input, the one the first stage is built around. A stage after the
first reads the other names it needs from the data itself, rows aligned with what it receives
(``bundle.data.loader``), so a mask goes to every stage that reads it and never travels
between stages. The forward is captured with one sample of the data, repeated: its values are
valid for the model by construction (a token type, a mask), which zeros need not be.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bundle.errors import DataError

# What a stage is handed for its batch's inputs: one tensor, or named tensors.
Batch = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Inputs:
    """A batch's named inputs, in order (the primary first), with one row of the data each: the
    example the model's forward is captured with."""

    names: tuple[str, ...]
    rows: tuple[torch.Tensor, ...]

    @property
    def side(self) -> tuple[str, ...]:
        """The names a stage after the first reads from the data (all but the primary)."""
        return self.names[1:]

    def key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """What a capture depends on: names, shapes and dtypes, not the example's values."""
        return tuple(
            (n, tuple(r.shape), str(r.dtype)) for n, r in zip(self.names, self.rows, strict=True)
        )

    def example(self, rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """The example row of each input, ``rows`` times, on ``device``."""
        return tuple(r.unsqueeze(0).expand(rows, *r.shape).clone().to(device) for r in self.rows)


def of_sample(x: Any, where: str) -> Inputs | None:
    """The named inputs of one sample's input (None: it is one tensor); names that cannot be a
    forward's keyword arguments, or values that are no tensors, are one line naming ``where``."""
    if not isinstance(x, Mapping):
        return None
    if not x:
        raise DataError(f"{where}: a sample's input is an empty mapping; give it named tensors")
    names = tuple(x)
    bad = [
        n for n in names if not isinstance(n, str) or not n.isidentifier() or keyword.iskeyword(n)
    ]
    if bad:
        raise DataError(
            f"{where}: a sample's input names {bad[0]!r}, which is no keyword argument of a "
            "forward; name each input as the model's forward does (input_ids, attention_mask)"
        )
    rows = []
    for n in names:
        try:
            rows.append(torch.as_tensor(x[n]))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{where}: a sample's input {n!r} is not a tensor ({exc})") from None
    return Inputs(names, tuple(rows))


def stack(samples: Sequence[Any]) -> Batch:
    """Samples' inputs as one batch: tensors stacked, named ones name by name."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {n: torch.stack([torch.as_tensor(s[n]) for s in samples]) for n in first}
    return torch.stack([torch.as_tensor(s) for s in samples])


def rows_of(batch: Batch) -> int:
    """How many rows a batch holds."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch)
