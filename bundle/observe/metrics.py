"""What a run reports: the throughput meter, the JSON-lines metrics file, the ``Reporter`` of loss
windows and validations, and the run's ``Summary`` (the metrics file's last line)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bundle.collectives.comm import Collectives, Comm
from bundle.config import is_reference
from bundle.observe.board import Board
from bundle.observe.console import Console
from bundle.observe.timing import Breakdown, table


class Meter:
    """Samples per second over steps after the first ``warmup`` ones (start-up is not throughput)."""

    def __init__(self, *, warmup: int = 1) -> None:
        self.warmup, self.steps, self.samples = warmup, 0, 0
        self.t0: float | None = None
        self.t_last = time.perf_counter()

    def step(self, samples: int) -> None:
        self.steps += 1
        now = time.perf_counter()
        if self.steps == self.warmup:
            self.t0 = now
        elif self.steps > self.warmup:
            self.samples += samples
        self.t_last = now

    @property
    def samples_per_s(self) -> float:
        if self.t0 is None or self.t_last <= self.t0:
            return 0.0
        return self.samples / (self.t_last - self.t0)


class MetricsFile:
    """Appends one JSON object per line; a ``None`` path writes nothing.

    A run resumed at step ``start`` keeps the records of steps up to ``start`` (those of an attempt
    that went further and failed are dropped), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str | None, *, start: int = 0) -> None:
        self.path = path
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if start and os.path.exists(path):
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
            kept = [r for r in records if not r.get("summary") and r.get("step", 0) <= start]
        with open(path, "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")


# The keyword arguments by which a factory is told which model to build: timm.create_model's
# model_name, torchvision.models.get_model's name.
_MODEL_NAME_ARGS = ("model_name", "name")


def model_label(name: str, kwargs: Mapping[str, Any]) -> str:
    """The model a run trains, as its start line and summary name it: ``--model``, or for a
    factory (``package.module:function``) the model its ``--model-args`` ask it for by name
    (``timm:create_model`` with ``model_name=resnet18``: ``resnet18``)."""
    if is_reference(name):
        for key in _MODEL_NAME_ARGS:
            value = kwargs.get(key)
            if isinstance(value, str) and value:
                return value
    return name


@dataclass(frozen=True)
class RunFacts:
    """What the training loop knows of the run it finished, for its summary."""

    model: str  # model_label: the model, not the factory that built it
    shape: list[int]
    num_bundles: int
    world_size: int
    micro_batches: int
    schedule: str
    grad_sync: str
    precision: str
    recompute: str
    channels_last: bool
    steps: int
    start_step: int
    attempt: int
    elapsed_s: float
    save_stall_s: list[float]
    peak_in_flight: int
    # Bytes the reporting process holds at the end, of a sharded tensor its shard: its stage's
    # parameters, the gradients it holds at the optimizer step (one per parameter that trains,
    # of its size and dtype), its optimizer state.
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    # The largest over the job's processes: each of the three above (not always the reporting
    # process's: stages differ), seconds its steps waited for their data, and its peak resident
    # memory (MiB; the corpus of --dataset tokens is mapped, not read into it).
    most_param_bytes: int
    most_grad_bytes: int
    most_optimizer_bytes: int
    data_wait_s: float
    peak_rss_mib: float
    # Gradient (and, meeting every H steps, parameter) bytes the reporting process sent in its
    # stage's sync over the run, against the same sync in fp32 every step: 1.0 exact, 0.5 bf16.
    grad_wire_ratio: float
    # Gradient bytes the reporting process handed its stage's sync per step of this attempt
    # (its chunks' together; --zero 3: what FSDP reduce-scatters): what a frozen base saves.
    grad_sync_bytes: int
    # Of the whole model (a weight tied across stages counted once per stage holding it), as
    # PEFT's print_trainable_parameters counts them: what trains, and every parameter.
    trainable_params: int
    all_params: int
    # Present only where they apply: loss scaling, a CUDA process, a planned run, a trace.
    skipped_steps: int | None = None
    loss_scale: float | None = None
    peak_memory_mib: float | None = None
    predicted_samples_per_s: float | None = None
    trace: str | None = None
    # --skip-bad-samples: the samples that could not be read and were replaced, in this attempt's
    # steps (start_step + 1 on) and evaluations, summed over every process that reads inputs; a
    # sample drawn in two epochs counts twice.
    replaced_samples: int | None = None
    # The factory (--model package.module:function) that built ``model``, where that is not
    # ``model`` itself.
    factory: str | None = None
    # --fault-tolerance bundle: the job's bundles that trained the last step, and how many
    # bundles left the job during the run (this attempt).
    bundles_in_step: list[int] | None = None
    bundle_failures: int | None = None
    heals: int | None = None
    # Steps trained again because a failure restarted the whole job from a checkpoint: the
    # committed steps past the checkpoint each restart resumed from, summed (node 0's workers'
    # view; None under torchrun's restarts, which nothing counts).
    lost_steps: int | None = None
    # --compile: the longest time a process of the job spent compiling its blocks (s: in the
    # first step, which with the S after it the throughput leaves out, and the first evaluation).
    compile_s: float | None = None


_OPTIONAL = (
    "skipped_steps",
    "loss_scale",
    "peak_memory_mib",
    "predicted_samples_per_s",
    "trace",
    "replaced_samples",
    "factory",
    "bundles_in_step",
    "bundle_failures",
    "heals",
    "lost_steps",
    "compile_s",
)


@dataclass(frozen=True)
class Validation:
    """One pass over the validation set: accuracy (None where outputs are no class logits; top-5
    None with 5 classes or fewer), the mean loss, perplexity (token-level tasks), rows counted."""

    top1: float | None
    top5: float | None
    loss: float | None
    perplexity: float | None
    seen: int

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"val_accuracy": self.top1, "val_top5": self.top5}
        if self.loss is not None:
            out["val_loss"] = self.loss
        if self.perplexity is not None:
            out["val_perplexity"] = self.perplexity
        return {**out, "val_samples": self.seen}

    def text(self) -> str:
        parts = []
        if self.top1 is not None:
            parts.append(f"accuracy {self.top1:.4f}")
        if self.top5 is not None:
            parts.append(f"top-5 {self.top5:.4f}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.perplexity is not None:
            parts.append(f"perplexity {self.perplexity:.2f}")
        return f"validation {', '.join(parts)} on {self.seen} samples"


@dataclass(frozen=True)
class Summary:
    """The run's last record: the metrics file's last line (with the per-stage breakdown) and the
    one JSON line the reporting process prints (without it, floats to 4 significant digits)."""

    run: RunFacts
    samples_per_s: float
    final_loss: float | None
    val_accuracy: float | None = None
    val_top5: float | None = None
    val_samples: int | None = None  # present only when the run evaluated
    breakdown: dict[str, Any] | None = field(default=None, repr=False)
    val_loss: float | None = None
    val_perplexity: float | None = None  # token-level tasks

    def record(self) -> dict[str, Any]:
        """The metrics file's summary record, every figure as measured."""
        out: dict[str, Any] = {"summary": True, **asdict(self.run)}
        for key in _OPTIONAL:
            if out[key] is None:
                del out[key]
        out.update(
            samples_per_s=self.samples_per_s,
            final_loss=self.final_loss,
            val_accuracy=self.val_accuracy,
            val_top5=self.val_top5,
            breakdown=self.breakdown,
        )
        if self.val_samples is not None:
            out["val_samples"] = self.val_samples
        for key in ("val_loss", "val_perplexity"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def line(self) -> str:
        """The printed summary: the record's keys but the breakdown, floats to 4 significant digits."""
        record = self.record()
        del record["breakdown"]
        return json.dumps(_significant(record), sort_keys=True)


def _significant(value: Any, digits: int = 4) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_significant(v, digits) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class ReportPlan:
    """When a ``Reporter`` closes its loss windows: every ``log_every`` steps and after the last,
    ``total``; ``batch``: the samples of a step (throughput); ``start``: the step a resumed run
    goes on from (the metrics file keeps the records up to it); ``warmup``: the first steps the
    throughput leaves out."""

    log_every: int
    total: int
    batch: int
    start: int = 0
    warmup: int = 1


@dataclass(frozen=True, kw_only=True)
class LossSum:
    """Where the loss windows are summed: the last stage's group (None on other stages), its
    collectives (the last stage's group is an NCCL one on GPUs), the device of the window."""

    group: dist.ProcessGroup | None
    device: torch.device
    comm: Comm | None = None


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """Where a ``Reporter`` writes: only the ``reporting`` rank writes the metrics file
    (``path``; None: none), TensorBoard and the console."""

    reporting: bool
    path: str | None = None
    board: Board | None = None
    console: Console | None = None


class Reporter:
    """The last stage's loss windows and what a run reports of them: progress on the console,
    metrics records, TensorBoard scalars, the per-stage time breakdown and the summary.

    A window closes every ``plan.log_every`` steps, at the end, and at every checkpoint, so a
    resumed run logs the same losses as an uninterrupted one. ``step``, ``flush`` and ``finish``
    are called by every rank (the breakdown is gathered from all of them); only the reporting
    rank writes.
    """

    def __init__(
        self,
        *,
        plan: ReportPlan,
        loss: LossSum,
        outputs: Outputs,
        breakdown: Breakdown | None = None,
        lr: Callable[[], float] | None = None,  # the learning rate now
        bundles: list[int] | None = None,  # --fault-tolerance bundle: the job's bundles training
    ) -> None:
        self.log_every, self.total, self.batch = plan.log_every, plan.total, plan.batch
        self.group, self.reporting = loss.group, outputs.reporting
        self.comm = loss.comm or Collectives()
        self.metrics = MetricsFile(outputs.path if outputs.reporting else None, start=plan.start)
        self.breakdown, self.lr, self.bundles = breakdown, lr, bundles
        self.board = outputs.board or Board(None)
        self.console = outputs.console or Console(
            total=plan.total,
            start=plan.start,
            steps_per_epoch=plan.total,
            enabled=outputs.reporting,
        )
        self.meter = Meter(warmup=plan.warmup)
        self.window, self.steps = torch.zeros((), device=loss.device), 0
        self.final_loss: float | None = None
        self.validation: Validation | None = None  # the latest

    def step(self, done: int, loss) -> None:
        """After step ``done`` (1-based): add this replica's share of the loss."""
        self.window += loss
        self.steps += 1
        self.meter.step(self.batch)
        self.console.advance(done)
        if done % self.log_every == 0 or done == self.total:
            self.flush(done)

    def flush(self, done: int) -> None:
        """Close the loss window: sum it over the last stage's replicas and report it."""
        times = self.breakdown.window() if self.breakdown is not None and self.steps else None
        if self.steps and self.group is not None:
            self.comm.all_reduce(self.window, self.group).wait()
            record: dict[str, Any] = {
                "step": done,
                "loss": self.window.item() / self.steps,
                "samples_per_s": round(self.meter.samples_per_s, 2),
            }
            if self.lr is not None:
                record["lr"] = self.lr()
            if self.bundles is not None:
                record["bundles_in_step"] = self.bundles
            if times is not None:
                record["breakdown"] = times
            self.final_loss = record["loss"]
            self._emit(record)
            self.console.window(done, record)
        self.window.zero_()
        self.steps = 0

    def evaluated(self, done: int, result: Validation) -> None:
        self.validation = result
        if self.group is not None:
            self._emit({"step": done, **result.record()})
        self.console.line(f"step {done}: {result.text()}")

    def finish(self, run: RunFacts) -> Summary | None:
        """The run's breakdown (every rank takes part); the reporting rank writes the summary,
        shows the breakdown as a table and returns the summary; every other rank None."""
        times = self.breakdown.run() if self.breakdown is not None else None
        self.console.close()
        self.board.close()  # the summary adds no scalars: its figures have no step of their own
        if not self.reporting:
            return None
        v = self.validation
        summary = Summary(
            run=run,
            samples_per_s=self.meter.samples_per_s,
            final_loss=self.final_loss,
            val_accuracy=v.top1 if v else None,
            val_top5=v.top5 if v else None,
            val_samples=v.seen if v else None,
            breakdown=times,
            val_loss=v.loss if v else None,
            val_perplexity=v.perplexity if v else None,
        )
        self.metrics.write(summary.record())
        if times is not None:
            self.console.line("where each step's time went, per stage:")
            for line in table(times):
                self.console.line(line)
        return summary

    def _emit(self, record: dict) -> None:
        if self.reporting:
            self.metrics.write(record)
            self.board.write(record)
