"""scripts/plot.py draws the expected panels from a metrics file and a 3-rank trace; bad input exits 2."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

REPO = Path(__file__).resolve().parents[2]


def _load_plot():
    spec = importlib.util.spec_from_file_location("plot", REPO / "scripts" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = _load_plot()

STAGE_CATEGORIES = ("data", "forward", "backward", "wait_act", "wait_grad", "send", "sync")


def _breakdown() -> dict:
    seconds = {
        c: {"mean": 0.001 * (i + 1), "max": 0.002 * (i + 1)} for i, c in enumerate(STAGE_CATEGORIES)
    }
    seconds["optimizer"] = {"mean": 0.0005, "max": 0.0006}
    return {
        "ideal_bubble": 0.2,
        "stages": [
            {
                "stage": s,
                "processes": 2 - s,
                "step_s": {"mean": 0.03, "max": 0.033},
                "bubble": {"mean": 0.18, "max": 0.21},
                "seconds": seconds,
            }
            for s in range(2)
        ],
    }


def _metrics(path: Path) -> Path:
    """Ten training windows with a breakdown, two validations (one without top-5), the summary."""
    records = []
    for step in range(10, 101, 10):
        records.append(
            {
                "step": step,
                "loss": 2.3 / (1 + step / 20),
                "samples_per_s": 700.0 + step,
                "lr": 0.05,
                "breakdown": _breakdown(),
            }
        )
        if step % 50 == 0:
            top5 = 0.95 if step == 100 else None
            records.append(
                {"step": step, "val_accuracy": step / 120, "val_top5": top5, "val_samples": 360}
            )
    records.append(
        {
            "summary": True,
            "steps": 100,
            "samples_per_s": 750.0,
            "final_loss": 0.4,
            "val_accuracy": 0.83,
            "val_top5": 0.95,
            "breakdown": _breakdown(),
        }
    )
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return path


# Shape 2,1, one bundle, M = 2: two stage-0 replicas (ranks 0 and 1) feed one stage-1 rank (2).
# Per step, in each rank's schedule order: (slice name, category, microseconds).
FRONT = [
    ("data", "data", 300), ("forward 0", "forward", 800), ("send act 0", "send", 150),
    ("forward 1", "forward", 800), ("send act 1", "send", 150), ("wait grad 0", "wait_grad", 1500),
    ("backward 0", "backward", 1200), ("wait grad 1", "wait_grad", 300),
    ("backward 1", "backward", 1200), ("sync", "sync", 600), ("optimizer", "optimizer", 400),
]  # fmt: skip
REAR = [
    ("data", "data", 300), ("wait act 0", "wait_act", 1000), ("forward 0", "forward", 800),
    ("backward 0", "backward", 1200), ("send grad 0", "send", 150), ("wait act 1", "wait_act", 200),
    ("forward 1", "forward", 800), ("backward 1", "backward", 1200), ("send grad 1", "send", 150),
    ("optimizer", "optimizer", 400),
]  # fmt: skip
NAMES = ["bundle 0 stage 0 replica 0", "bundle 0 stage 0 replica 1", "bundle 0 stage 1 replica 0"]
STEP_US = 8000.0


def _trace(path: Path, steps: tuple[int, ...] = (3, 4)) -> Path:
    """A Chrome trace in the engine's format: metadata per rank, then each rank's slices."""
    events = []
    for rank, name in enumerate(NAMES):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}}
        )
        # Sort index reverses the pids: the rows must follow it, not the pid.
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": 2 - rank},
            }
        )
    for rank in range(3):
        for i, step in enumerate(steps):
            ts = 1_000_000.0 + i * STEP_US + 7.5 * rank
            for name, category, dur in FRONT if rank < 2 else REAR:
                args = {"step": step}
                if name.split()[-1].isdigit():
                    args["micro"] = int(name.split()[-1])
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": category,
                        "pid": rank,
                        "tid": 0,
                        "ts": ts,
                        "dur": float(dur),
                        "args": args,
                    }
                )
                ts += dur
    other = {
        "shape": [2, 1],
        "num_bundles": 1,
        "micro_batches": 2,
        "schedule": "1f1b",
        "steps": list(steps),
        "clock_offsets_us": {"0": 0.0, "1": -3.2, "2": 1.1},
    }
    path.write_text(
        json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other})
    )
    return path


def _pixels(png: Path) -> np.ndarray:
    """RGB in 0..255 integers, rows top to bottom."""
    return np.rint(imread(png)[..., :3] * 255).astype(int)


def _size_px(ranks: int) -> tuple[int, int]:
    width, height = plot.figure_size(ranks)
    return round(height * plot.DPI), round(width * plot.DPI)


def test_cli_draws_curves_breakdown_and_timeline(tmp_path: Path) -> None:
    """The CLI writes a PNG of the implied size whose timeline holds every category's colour."""
    out = tmp_path / "figs" / "run.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "plot.py"),
            str(_metrics(tmp_path / "m.jsonl")),
            "--trace",
            str(_trace(tmp_path / "t.json")),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    image = _pixels(out)
    assert image.shape[:2] == _size_px(3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 200  # curves, bars, text: not blank
    timeline = image[round(plot.CURVES_IN * plot.DPI) :]
    for category in (*STAGE_CATEGORIES, "optimizer"):
        rgb = np.rint(np.array(to_rgb(plot.CATEGORY_COLORS[category])) * 255).astype(int)
        covered = np.all(timeline == rgb, axis=-1).sum()
        # Beyond a legend swatch (~150 px): the bars themselves were drawn.
        assert covered > 1000, f"{category}: {covered} pixels"


def test_metrics_only_has_no_timeline(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without a trace the figure is the curves' row alone, and still not blank."""
    out = tmp_path / "run.png"
    assert plot.main([str(_metrics(tmp_path / "m.jsonl")), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    image = _pixels(out)
    assert image.shape[:2] == _size_px(0)
    assert _size_px(0)[0] < _size_px(3)[0]
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 100


def test_trace_rows_follow_sort_index_and_steps_filter(tmp_path: Path) -> None:
    """Rows are named from the metadata in sort-index order; --steps keeps only those steps."""
    path = _trace(tmp_path / "t.json", steps=(3, 4, 5))
    rows, slices = plot.load_trace(str(path))
    assert rows == NAMES[::-1]
    assert len(slices) == 3 * (2 * len(FRONT) + len(REAR))
    rows, slices = plot.load_trace(str(path), (4, 4))
    assert rows == NAMES[::-1]
    assert {s["args"]["step"] for s in slices} == {4}
    assert {s["row"] for s in slices if s["pid"] == 0} == {2}
    with pytest.raises(plot.PlotError, match="no slices in steps 7:8"):
        plot.load_trace(str(path), (7, 8))


@pytest.mark.parametrize(
    ("metrics", "trace", "message"),
    [
        (None, None, "metrics file .*missing.jsonl: No such file"),
        ("", None, "metrics file .* holds no records"),
        ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n', None, r"line 2: not JSON"),
        ('{"loss": 2.0}\n', None, "line 1: not a record with an integer 'step'"),
        ('{"step": 1, "loss": 2.0}\n', '{"events": []}', "trace .*t.json: no 'traceEvents' list"),
        (
            '{"step": 1, "loss": 2.0}\n',
            '{"traceEvents": [{"ph": "X", "pid": 0, "ts": 1}]}',
            "numeric ts/dur",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    metrics: str | None,
    trace: str | None,
    message: str,
) -> None:
    path = tmp_path / ("missing.jsonl" if metrics is None else "m.jsonl")
    if metrics is not None:
        path.write_text(metrics)
    argv = [str(path), "-o", str(tmp_path / "run.png")]
    if trace is not None:
        (tmp_path / "t.json").write_text(trace)
        argv += ["--trace", str(tmp_path / "t.json")]
    assert plot.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("plot.py: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "run.png").exists()
