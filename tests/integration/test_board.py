"""bundle/board.py writes the metrics records as TensorBoard scalars, read back from the event files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bundle.observe.board import Board

REPO = Path(__file__).resolve().parents[2]
CATEGORIES = ("data", "forward", "backward", "wait_act", "wait_grad", "send", "sync", "optimizer")


def _stats(mean: float) -> dict:
    return {"mean": mean, "max": mean * 1.5}


def _breakdown(scale: float) -> dict:
    """A two-stage breakdown whose values differ per stage, category and window."""
    return {
        "ideal_bubble": 0.2,
        "stages": [
            {
                "stage": s,
                "processes": 2 - s,
                "step_s": _stats(0.03 * scale),
                "bubble": {"mean": 0.1 + 0.05 * s, "max": 0.3 + 0.05 * s},
                "seconds": {
                    c: _stats(scale * (s + 1) * (i + 1) / 1000)
                    for i, c in enumerate((*CATEGORIES, "other"))
                },
            }
            for s in range(2)
        ],
    }


def _window(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "samples_per_s": 800.0 + step, **extra}


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _assert_series(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_records_become_tagged_scalars(tmp_path: Path) -> None:
    """Windows, validation records and the summary give exactly the documented tags and values."""
    board = Board(str(tmp_path))
    board.write(_window(10, 2.5, lr=0.05, breakdown=_breakdown(1.0)))
    board.write({"step": 10, "val_accuracy": 0.5, "val_top5": 0.9, "val_samples": 360})
    board.write(_window(20, 1.5, lr=0.025, breakdown=_breakdown(2.0)))
    board.write({"step": 20, "val_accuracy": 0.75, "val_top5": None, "val_samples": 360})
    summary = {"summary": True, "steps": 20, "samples_per_s": 1.0, "final_loss": 9.0}
    board.write({**summary, "val_accuracy": 0.1, "breakdown": _breakdown(5.0)})
    board.close()

    got = _scalars(tmp_path)
    stage_tags = {
        f"stage{s}/{name}"
        for s in range(2)
        for name in (*(f"{c}_s" for c in (*CATEGORIES, "other")), "step_s", "bubble", "bubble_max")
    }
    train = {"train/loss", "train/samples_per_s", "train/lr", "val/top1", "val/top5"}
    assert set(got) == train | stage_tags | {"pipeline/ideal_bubble"}
    _assert_series(got["train/loss"], [(10, 2.5), (20, 1.5)])
    _assert_series(got["train/samples_per_s"], [(10, 810.0), (20, 820.0)])
    _assert_series(got["train/lr"], [(10, 0.05), (20, 0.025)])
    _assert_series(got["val/top1"], [(10, 0.5), (20, 0.75)])
    _assert_series(got["val/top5"], [(10, 0.9)])  # a null top-5 writes no point
    _assert_series(got["pipeline/ideal_bubble"], [(10, 0.2), (20, 0.2)])
    _assert_series(got["stage1/backward_s"], [(10, 0.006), (20, 0.012)])  # (s+1)(i+1)/1000
    _assert_series(got["stage0/other_s"], [(10, 0.009), (20, 0.018)])
    _assert_series(got["stage1/step_s"], [(10, 0.03), (20, 0.06)])
    _assert_series(got["stage1/bubble"], [(10, 0.15), (20, 0.15)])
    _assert_series(got["stage1/bubble_max"], [(10, 0.35), (20, 0.35)])


def test_window_without_breakdown_or_lr(tmp_path: Path) -> None:
    """An old-format window (no lr, no breakdown) writes only loss and throughput."""
    board = Board(str(tmp_path))
    board.write(_window(5, 3.0))
    board.close()
    assert set(_scalars(tmp_path)) == {"train/loss", "train/samples_per_s"}


def test_resume_hides_steps_after_start(tmp_path: Path) -> None:
    """A run resumed at step 20 replaces the step-30 point an earlier attempt wrote."""
    first = Board(str(tmp_path))
    for step in (10, 20, 30):
        first.write(_window(step, float(step)))
    first.close()
    resumed = Board(str(tmp_path), start=20)
    resumed.write(_window(30, 0.5))
    resumed.close()
    _assert_series(_scalars(tmp_path)["train/loss"], [(10, 10.0), (20, 20.0), (30, 0.5)])


def test_no_logdir_writes_and_imports_nothing(tmp_path: Path) -> None:
    """Board(None) accepts records, creates no file, and never loads tensorboard."""
    code = (
        "import sys\n"
        "from bundle.observe.board import Board\n"
        "board = Board(None)\n"
        "board.write({'step': 1, 'loss': 1.0, 'samples_per_s': 2.0})\n"
        "board.flush(); board.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert list(tmp_path.iterdir()) == []
