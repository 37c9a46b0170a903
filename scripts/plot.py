"""Plot a run: loss, validation accuracy, throughput, where each stage's time goes, the timeline.

    python scripts/plot.py metrics.jsonl [--trace trace.json] [-o run.png] [--steps A:B]

One PNG (matplotlib's Agg canvas) from a run's ``--metrics-out`` file: curves against the step, and
each stage's mean ms per step by category with its bubble (the summary's breakdown, else the last
window's). Given its ``--trace``, a timeline below: a row per rank, a bar per action coloured by
category, ms from the first slice; ``--steps A:B`` keeps trace steps A to B. Bad input: one line
on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

# One colour per category, shared by the timeline and the breakdown bars, in legend order.
CATEGORY_COLORS = {
    "data": "#ccb974",
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "copy": "#da8bc3",
    "post": "#64b5cd",
    "wait_act": "#b0b0b0",
    "wait_grad": "#6e6e6e",
    "send": "#8172b3",
    "engine": "#937860",  # the engine's own work on a send or a receive
    "sync": "#c44e52",
    "optimizer": "#55a868",
    "other": "#e4e4e4",  # the training loop's own work: stop vote, checkpoint polls
}
# Figure geometry in inches: a fixed row of curves, a timeline row that grows with the ranks.
WIDTH_IN, CURVES_IN, TIMELINE_IN, RANK_IN, DPI = 16.0, 4.0, 1.4, 0.35, 100


class PlotError(ValueError):
    """Unusable input; the message names the file and what is wrong with it."""


def figure_size(ranks: int) -> tuple[float, float]:
    """Width and height in inches for a timeline of ``ranks`` rows (0: no timeline)."""
    return WIDTH_IN, CURVES_IN + (TIMELINE_IN + RANK_IN * ranks if ranks else 0.0)


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise PlotError(f"{what} {path}: {e.strerror or e}") from None


def load_metrics(path: str) -> list[dict]:
    """The records of a metrics JSON-lines file, in file order."""
    records = []
    for n, line in enumerate(_read(path, "metrics file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"metrics file {path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not (
            record.get("summary") or isinstance(record.get("step"), int)
        ):
            raise PlotError(f"metrics file {path} line {n}: not a record with an integer 'step'")
        records.append(record)
    if not records:
        raise PlotError(f"metrics file {path} holds no records")
    return records


def load_trace(path: str, steps: tuple[int, int] | None = None) -> tuple[list[str], list[dict]]:
    """The rank rows' names in display order, and the slices (``ph`` X) with a ``row`` index."""
    try:
        data = json.loads(_read(path, "trace"))
    except json.JSONDecodeError as e:
        raise PlotError(f"trace {path}: not JSON ({e.msg})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise PlotError(f"trace {path}: no 'traceEvents' list")
    names, order, slices = {}, {}, []
    for e in events:
        if not isinstance(e, dict) or "pid" not in e:
            raise PlotError(f"trace {path}: an event without a pid: {str(e)[:80]}")
        kind, args = e.get("ph"), e.get("args") or {}
        if kind == "M" and e.get("name") == "process_name":
            names[e["pid"]] = str(args.get("name", e["pid"]))
        elif kind == "M" and e.get("name") == "process_sort_index":
            order[e["pid"]] = args.get("sort_index", e["pid"])
        elif kind == "X":
            if not all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur")):
                raise PlotError(f"trace {path}: a slice without numeric ts/dur: {str(e)[:80]}")
            if steps is None or steps[0] <= args.get("step", -1) <= steps[1]:
                slices.append(e)
    if not slices:
        within = f" in steps {steps[0]}:{steps[1]}" if steps else ""
        raise PlotError(f"trace {path}: no slices{within}")
    pids = sorted(names.keys() | {s["pid"] for s in slices}, key=lambda p: (order.get(p, p), p))
    row = {pid: i for i, pid in enumerate(pids)}
    for s in slices:
        s["row"] = row[s["pid"]]
    return [names.get(pid, f"rank {pid}") for pid in pids], slices


def _legend(ax: Axes, categories: list[str]) -> None:
    """A colour key for ``categories``, outside the panel's right edge."""
    handles = [Patch(color=CATEGORY_COLORS[c], label=c.replace("_", " ")) for c in categories]
    ax.legend(handles=handles, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1, 1))


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _curve(ax: Axes, records: list[dict], key: str, **style) -> bool:
    """Plot ``key`` against the step where present; whether there was anything to plot."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        ax.plot(*zip(*points, strict=True), **style)
    return bool(points)


def draw_loss(ax: Axes, windows: list[dict]) -> None:
    ax.set(title="training loss", xlabel="step")
    if not _curve(ax, windows, "loss", color="#4c72b0"):
        _note(ax, "no training windows")


def draw_accuracy(ax: Axes, validations: list[dict]) -> None:
    ax.set(title="validation accuracy", xlabel="step", ylim=(0, 1.02))
    _curve(ax, validations, "val_accuracy", label="top-1", marker="o", markersize=3)
    _curve(ax, validations, "val_top5", label="top-5", marker="s", markersize=3, linestyle="--")
    if ax.lines:
        ax.legend(fontsize=8, loc="lower right")
    else:
        _note(ax, "no validation records")


def draw_throughput(ax: Axes, windows: list[dict], summary: dict | None) -> None:
    """Samples/s per window, and the run's overall rate from the summary as a dashed line."""
    ax.set(title="throughput", xlabel="step", ylabel="samples/s")
    _curve(ax, windows, "samples_per_s", color="#55a868")
    if summary and summary.get("samples_per_s"):
        rate = summary["samples_per_s"]
        ax.axhline(rate, color="grey", linestyle="--", linewidth=1, label=f"run {rate:.0f}/s")
        ax.legend(fontsize=8, loc="lower right")
    if not ax.lines:
        _note(ax, "no throughput")


def draw_breakdown(ax: Axes, breakdown: dict, title: str) -> None:
    """Stacked bars: each stage's mean ms per step by category, its measured bubble on top."""
    stages = breakdown.get("stages", [])
    present = [c for c in CATEGORY_COLORS if any(c in s.get("seconds", {}) for s in stages)]
    xs = [s["stage"] for s in stages]
    bottom = [0.0] * len(stages)
    for category in present:
        means = [(s.get("seconds", {}).get(category) or {}).get("mean") for s in stages]
        ms = [1000 * (m or 0.0) for m in means]
        ax.bar(xs, ms, bottom=bottom, color=CATEGORY_COLORS[category], width=0.6)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    for x, top, s in zip(xs, bottom, stages, strict=True):
        bubble = (s.get("bubble") or {}).get("mean")
        if bubble is not None:
            ax.text(x, top, f"bubble {bubble:.0%}", ha="center", va="bottom", fontsize=8)
    ideal = breakdown.get("ideal_bubble")
    ax.set(title=title + (f" (ideal bubble {ideal:.0%})" if ideal is not None else ""))
    ax.set(xlabel="stage", ylabel="ms per step", xticks=xs)
    ax.margins(y=0.15)
    _legend(ax, present)


def draw_timeline(ax: Axes, rows: list[str], slices: list[dict]) -> None:
    """One row per rank (top to bottom in display order), one bar per slice, ms from the first."""
    t0 = min(s["ts"] for s in slices)
    spans = defaultdict(list)
    for s in slices:
        category = s.get("cat") if s.get("cat") in CATEGORY_COLORS else "other"
        spans[s["row"], category].append(((s["ts"] - t0) / 1000, s["dur"] / 1000))
    for (row, category), bars in spans.items():
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=CATEGORY_COLORS[category], linewidth=0)
    starts: dict[int, float] = {}
    for s in slices:
        step = (s.get("args") or {}).get("step")
        if step is not None:
            starts[step] = min(starts.get(step, s["ts"]), s["ts"])
    for step, ts in sorted(starts.items()):
        x = (ts - t0) / 1000
        ax.axvline(x, color="black", linestyle=":", linewidth=0.8)
        ax.text(x, 1.0, f" step {step}", transform=ax.get_xaxis_transform(), va="bottom")
    ax.set_yticks(range(len(rows)), labels=rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, 1.01 * max(start + dur for bars in spans.values() for start, dur in bars))
    ax.set_xlabel("ms")
    ax.set_title("pipeline timeline", loc="left", pad=16)  # above the step labels
    drawn = {c for _, c in spans}
    _legend(ax, [c for c in CATEGORY_COLORS if c in drawn])


def build_figure(records: list[dict], rows: list[str], slices: list[dict]) -> Figure:
    """The run's figure: the curves (and breakdown) on top, the timeline below given rank rows."""
    summary = next((r for r in records if r.get("summary")), None)
    steps = [r for r in records if not r.get("summary")]
    windows = [r for r in steps if "loss" in r]
    validations = [r for r in steps if "val_accuracy" in r]
    breakdown, title = (summary or {}).get("breakdown"), "time per step, whole run"
    if not breakdown and any(r.get("breakdown") for r in windows):
        last = [r for r in windows if r.get("breakdown")][-1]
        breakdown, title = last["breakdown"], f"time per step, window to step {last['step']}"

    width, height = figure_size(len(rows))
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ratios = [CURVES_IN, height - CURVES_IN] if rows else None
    grid = fig.add_gridspec(2 if rows else 1, 4 if breakdown else 3, height_ratios=ratios)
    draw_loss(fig.add_subplot(grid[0, 0]), windows)
    draw_accuracy(fig.add_subplot(grid[0, 1]), validations)
    draw_throughput(fig.add_subplot(grid[0, 2]), windows, summary)
    if breakdown:
        draw_breakdown(fig.add_subplot(grid[0, 3]), breakdown, title)
    if rows:
        draw_timeline(fig.add_subplot(grid[1, :]), rows, slices)
    return fig


def _step_range(text: str) -> tuple[int, int]:
    try:
        first, last = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two integers), got {text!r}") from None
    if first > last:
        raise argparse.ArgumentTypeError(f"first step {first} is after last step {last}")
    return first, last


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plot.py", description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="the run's metrics JSON lines (--metrics-out)")
    p.add_argument("--trace", help="the run's Chrome trace (--trace): adds the timeline")
    p.add_argument("-o", "--output", default="run.png", help="PNG to write (default: run.png)")
    p.add_argument(
        "--steps", type=_step_range, metavar="A:B", help="draw trace steps A to B (inclusive)"
    )
    args = p.parse_args(argv)
    if args.steps and not args.trace:
        p.error("--steps selects trace steps; it needs --trace")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        records = load_metrics(args.metrics)
        rows, slices = load_trace(args.trace, args.steps) if args.trace else ([], [])
    except PlotError as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    build_figure(records, rows, slices).savefig(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
