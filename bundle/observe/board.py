"""TensorBoard scalars of a run: loss, accuracy, throughput, learning rate, per-stage breakdown.

``Board`` reads the same records the metrics JSON-lines file holds (training windows, validation
records, the run summary) and writes each as scalars at the record's ``step``, so the file and the
event files never disagree. Tags:

    train/loss  train/samples_per_s  train/lr            a training window
    val/top1  val/top5                                   a validation record
    stage{s}/{category}_s                                mean seconds per step in a category
    stage{s}/step_s  stage{s}/bubble  stage{s}/bubble_max
    pipeline/ideal_bubble                                the schedule's, e.g. (S - 1) / (M + S - 1)

The run summary adds nothing: its figures are the run's totals (they have no step of their own),
and its final validation already came as a validation record at its step.
"""

from __future__ import annotations

from typing import Any


class Board:
    """TensorBoard event files under ``logdir``; ``None`` writes nothing and imports nothing.

    A run resumed at step ``start`` hides the events of steps after ``start`` that an earlier
    attempt wrote (TensorBoard's purge step), as the metrics file drops those records.
    """

    def __init__(self, logdir: str | None, *, start: int = 0) -> None:
        self._writer = None
        if logdir:
            # Imported here so a run without --tensorboard never loads tensorboard.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=logdir, purge_step=start + 1 if start else None)

    def write(self, record: dict[str, Any]) -> None:
        """Write one metrics record's scalars at its step (the summary record writes none)."""
        if self._writer is None or record.get("summary"):
            return
        step = record["step"]
        self._scalars(
            step,
            {
                "train/loss": record.get("loss"),
                "train/samples_per_s": record.get("samples_per_s"),
                "train/lr": record.get("lr"),
                "val/top1": record.get("val_accuracy"),
                "val/top5": record.get("val_top5"),
                "val/loss": record.get("val_loss"),
                "val/perplexity": record.get("val_perplexity"),
            },
        )
        if record.get("breakdown"):
            self._scalars(step, breakdown_scalars(record["breakdown"]))

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def breakdown_scalars(breakdown: dict[str, Any]) -> dict[str, float | None]:
    """A record's ``breakdown`` as ``{tag: value}``: means per stage, the bubble's max, the ideal."""
    values: dict[str, float | None] = {"pipeline/ideal_bubble": breakdown.get("ideal_bubble")}
    for entry in breakdown.get("stages", []):
        prefix = f"stage{entry['stage']}"
        for category, stats in entry.get("seconds", {}).items():
            values[f"{prefix}/{category}_s"] = _stat(stats, "mean")
        values[f"{prefix}/step_s"] = _stat(entry.get("step_s"), "mean")
        values[f"{prefix}/bubble"] = _stat(entry.get("bubble"), "mean")
        values[f"{prefix}/bubble_max"] = _stat(entry.get("bubble"), "max")
    return values


def _stat(stats: dict[str, float | None] | None, key: str) -> float | None:
    return stats.get(key) if stats else None
