"""Validation accuracy after every epoch and at the end (``--eval``), pipelined forward-only."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bundle.data import loader, samples
from bundle.engine.loss import EVAL_COUNTS, eval_rows
from bundle.engine.stage_engine import MicroBatch, StageEngine
from bundle.observe.metrics import Reporter, Validation
from bundle.runtime.phase import Phase
from bundle.session import Session, pins, reads_data, shard
from bundle.topology import Topology


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """When and over what an ``Evaluator`` evaluates: global batches of ``batch`` rows, every
    ``every`` steps (an epoch) and after the last, ``total``; ``enabled`` (--eval) turns it on,
    ``limit`` (--val-batches) caps the global batches (0: all)."""

    batch: int
    every: int
    total: int
    enabled: bool
    limit: int = 0


class Evaluator:
    """Top-1 and top-5 accuracy, loss and (for tokens) perplexity over the validation set, in
    global batches of ``plan.batch`` rows.

    ``maybe_run(step)`` evaluates when the plan makes it due; each batch names the process's
    phase (a long evaluation is not a stall).
    """

    def __init__(
        self,
        session: Session,
        topo: Topology,
        *,
        plan: EvalPlan,
        workers: int,
        reporter: Reporter,
        phase: Phase,
        device: torch.device,
    ) -> None:
        self.engine: StageEngine = session.engine
        self.stage = session.stage  # the named inputs its pieces read (Stage.side)
        self.dataset: Any = session.splits.val
        self.num_classes = session.splits.num_classes
        self.coord, self.group = session.coord, session.groups.last_stage
        self.comm = session.comm
        self.topo, self.workers, self.device = topo, workers, device
        self.batch, self.every, self.total = plan.batch, plan.every, plan.total
        self.enabled, self.limit = plan.enabled, plan.limit
        self.reporter, self.phase = reporter, phase

    def maybe_run(self, step: int) -> None:
        """After ``step``: evaluate if due and report the result."""
        if not self.enabled or (step % self.every and step != self.total):
            return
        self.reporter.evaluated(step, self.run(f"evaluation after step {step}"))

    def now(self, step: int) -> None:
        """Evaluate the model as it stands after ``step`` (if validation is on) and report it."""
        if self.enabled:
            self.reporter.evaluated(step, self.run(f"evaluation after step {step}"))

    def run(self, label: str) -> Validation:
        """Accuracy, loss and perplexity over the validation set (collective)."""
        modules = [c.sync.module for c in self.engine.chunks]
        for m in modules:
            m.eval()
        usable = self._batches()
        stream = self._stream([ix for ix, _ in usable])
        counts = torch.zeros(EVAL_COUNTS, dtype=torch.float64, device=self.device)
        for i, (_ix, rows) in enumerate(usable):
            where = f"{label}, batch {i + 1} of {len(usable)}"
            self.phase.enter(f"data loading ({where})")
            batch = next(stream) if stream else None
            self.phase.enter(where)
            counts += self.engine.eval_batch(rows, batch)
        for m in modules:
            m.train()
        if self.group is None:
            return Validation(None, None, None, None, 0)
        self.comm.all_reduce(counts, self.group).wait()
        top1, top5, positions, loss, rows = counts.tolist()
        if not rows:
            return Validation(None, None, None, None, 0)
        mean = loss / rows
        return Validation(
            top1=top1 / positions if positions else None,
            # With 5 classes or fewer every row is in its top 5: no figure worth reporting.
            top5=top5 / positions if positions and self.num_classes > 5 else None,
            loss=mean,
            # Labels per row beyond one (tokens): a language model's perplexity.
            perplexity=math.exp(min(mean, 700.0)) if positions > rows else None,
            seen=int(rows),
        )

    def _batches(self) -> list[tuple[torch.Tensor, int]]:
        """Each global batch's indices and this bundle's rows of it; a batch too small to give
        every replica a row is left out."""
        n = samples.size(self.dataset)
        batches = [torch.arange(i, min(i + self.batch, n)) for i in range(0, n, self.batch)]
        usable = [(ix, eval_rows(len(ix), self.topo, self.coord.bundle)) for ix in batches]
        kept = [(ix, rows) for ix, rows in usable if rows is not None]
        return kept[: self.limit] if self.limit else kept

    def _stream(self, batches: list[torch.Tensor]) -> Iterator[MicroBatch] | None:
        if not reads_data(self.topo, self.coord, self.stage):
            return None
        mine = shard(self.topo, self.coord, 1, job_rows=False)  # every row, by those present
        lists = [mine.micro_indices(ix)[0] for ix in batches]
        return loader.stage_micro_batches(
            self.dataset,
            lists,
            first=self.coord.stage == 0,
            workers=self.workers,
            pin_memory=pins(self.device),
            side=self.stage.side,
        )
