"""The loss a stage computes and what evaluation counts: pure functions of its outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bundle.topology import Topology, split_sizes

# What eval_batch counts: top-1 and top-5 hits, the label positions they are out of (rows, or
# tokens), the loss summed over rows, the rows.
EVAL_COUNTS = 5

# A loss as torch's losses compute by default: the mean over the micro-batch it is given.
Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def cross_entropy(label_smoothing: float = 0.0) -> Loss:
    """Cross-entropy over the last dimension: per row for (rows, classes) logits, per token for
    (rows, tokens, vocabulary) ones; the mean over every label of the micro-batch."""

    def loss(logits: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, tuple):  # a model with several outputs: its first is the logits
            logits = logits[0]
        return F.cross_entropy(
            logits.flatten(0, -2), labels.flatten(), label_smoothing=label_smoothing
        )

    return loss


def as_float(out: tuple[torch.Tensor, ...]) -> Any:
    """What a loss gets: the last stage's one output (or all of them), in fp32 (outside autocast)."""
    floats = tuple(o.float() if o.is_floating_point() else o for o in out)
    return floats[0] if len(floats) == 1 else floats


def classifies(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether outputs are logits over classes for integer labels (accuracy means something)."""
    return (
        not labels.is_floating_point()
        and logits.dim() == labels.dim() + 1
        and logits.shape[:-1] == labels.shape
    )


def top_k_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """For each k, the rows whose label is among their k highest logits (float64, on the device).

    A k beyond the number of classes counts every row.
    """
    top = logits.topk(min(max(ks), logits.shape[1]), dim=1).indices
    hit = top == labels[:, None]
    return torch.stack([hit[:, :k].any(dim=1).sum() for k in ks]).to(torch.float64)


def eval_rows(batch_len: int, topo: Topology, bundle: int) -> int | None:
    """Rows of one bundle in an evaluation batch, or None where it cannot give every replica a row."""
    sizes = split_sizes(batch_len, topo.num_bundles)
    return sizes[bundle] if all(topo.rows_fit(n) for n in sizes) else None
