"""``--dataset tokens``: a corpus prepared once (``python -m bundle.data prepare``), read through
memory maps, so no process holds the corpus: windows of ``--seq-len`` tokens (labels the same
shifted by one, as ``--dataset text`` draws them), in an order that is a pure function of
``(seed, epoch, global index)`` without a table that grows with the corpus (``order.Walked``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from bundle.config import DataConfig
from bundle.errors import DataError

# What bundle.data.loader asks of a dataset it may read from a background thread (no RNG, no
# state shared with training), and the order of its samples (bundle.data.order.Walked).
THREAD_SAFE = "thread_safe"
LAZY_ORDER = "lazy_order"


class TokenWindows(Dataset[Any]):
    """Window ``i`` of a split: inputs tokens ``i*T .. i*T+T-1``, labels ``i*T+1 .. i*T+T``."""

    thread_safe = True
    lazy_order = True

    def __init__(self, stream: Any, seq_len: int) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.n = max(0, (len(stream) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def _windows(self, keys: torch.Tensor) -> torch.Tensor:
        t = self.seq_len
        rows = [self.stream.read(int(k) % self.n * t, t + 1) for k in keys.tolist()]
        return torch.stack([torch.from_numpy(r) for r in rows]) if rows else torch.empty(0, t + 1)

    def __getitem__(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._windows(torch.tensor([key]))[0]
        return w[:-1], w[1:]

    def fetch(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, labels) of the windows named by ``keys``, as one batch."""
        w = self._windows(keys)
        return w[:, :-1], w[:, 1:]

    def fetch_labels(self, keys: torch.Tensor) -> torch.Tensor:
        """The labels alone (the loss's stage), read as the inputs are: never the whole split."""
        return self._windows(keys)[:, 1:]


def _index(cfg: DataConfig) -> Any:
    from bundle.data import shards

    return shards.Index.read(cfg.data_dir or "")


def corpus_digest(cfg: DataConfig) -> str:
    """The prepared corpus's identity: its index's digest (its shards' checksums among it)."""
    return str(_index(cfg).digest)


def tokenizer_of(cfg: DataConfig) -> str | None:
    """The tokenizer a run of ``--dataset tokens`` reads text with (the one its corpus was
    prepared with): ``--tokenizer`` where given, which must be the same tokenizer, else the one
    the corpus records (None: byte-level)."""
    from bundle.data import shards

    recorded = _index(cfg).tokenizer
    if cfg.tokenizer is None:
        return recorded.get("path")
    if shards.tokenizer_digest(cfg.tokenizer) != recorded.get("sha256"):
        was = recorded.get("path") or "byte-level tokens"
        raise DataError(
            f"--tokenizer {cfg.tokenizer}: {cfg.data_dir} was prepared with another tokenizer "
            f"({was}); give that one, or none"
        )
    return os.path.abspath(cfg.tokenizer)


def spec(cfg: DataConfig) -> tuple[int, tuple[int, ...]]:
    """(vocabulary, input shape), from the corpus's index alone."""
    return int(_index(cfg).tokenizer["vocab"]), (cfg.seq_len,)


def windows(cfg: DataConfig, split: str) -> TokenWindows:
    from bundle.data import shards

    index = _index(cfg)
    return TokenWindows(shards.TokenStream(index, split), cfg.seq_len)


def check(cfg: DataConfig, *, needs_val: bool) -> None:
    """Before any process starts: the corpus reads, and holds a window to train on (and one to
    validate with, where the run evaluates)."""
    tokenizer_of(cfg)
    for split in ("train", "val") if needs_val else ("train",):
        if len(windows(cfg, split)) == 0:
            hint = " (--no-eval trains without one)" if split == "val" else ""
            raise DataError(
                f"--data-dir {cfg.data_dir}: its {split} split holds no window of "
                f"--seq-len {cfg.seq_len} + 1 tokens{hint}"
            )
