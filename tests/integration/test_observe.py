"""Observing a run: the step timer and its breakdown, the merged trace, TensorBoard, top-5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bundle.ir.p2p import step_plan
from bundle.observe import timing

REPO = Path(__file__).resolve().parents[2]


def _slices(trace: dict) -> dict[int, list[dict]]:
    by_rank: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_rank.setdefault(e["pid"], []).append(e)
    return by_rank


@pytest.mark.slow
def test_a_run_shows_where_its_time_goes(tmp_path):
    """Shape 2,1 (two fronts feed one rear), 1F1B, M = 4: the trace, breakdown and TensorBoard
    files of one run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shape, M, steps, batch = (2, 1), 4, 9, 64
    cmd = [sys.executable, str(REPO / "main.py"), "--bundle-shape", "2,1"]
    cmd += ["--micro-batches", str(M), "--itr", str(steps), "--batch-size", str(batch)]
    # One window, closed after the last step: no reporting inside the steps the meter times.
    cmd += ["--log-every", "100", "--trace", "trace.json", "--trace-steps", "3:4"]
    cmd += ["--tensorboard", "tb", "--metrics-out", "m.jsonl", "--timeout", "60"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "where each step's time went" in out.stderr

    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {
        0: "bundle 0 stage 0 replica 0",
        1: "bundle 0 stage 0 replica 1",
        2: "bundle 0 stage 1 replica 0",
    }
    by_rank = _slices(trace)
    assert sorted(by_rank) == [0, 1, 2]
    stage_of = {0: 0, 1: 0, 2: 1}
    for rank, slices in by_rank.items():
        # Each rank's slices follow its schedule, step by step, on intervals that do not overlap:
        # each action's laps (its calls posted, a receive's wait, a forward's copy; gloo posts
        # receives early).
        expected = []
        for _ in (3, 4):
            s = stage_of[rank]
            plan = step_plan("1f1b", s, len(shape), M, early_receives=True)
            laps = timing.step_laps(plan, wire=[s < len(shape) - 1])
            expected += ["other", "data", *(f"{timing.LABELS[m]} {k}" for m, k in laps)]
            expected += ["send wait", "sync", "optimizer", "other"]
        slices.sort(key=lambda e: e["ts"])
        assert [e["name"] for e in slices] == expected, rank
        assert {e["args"]["step"] for e in slices} == {3, 4}
        for a, b in zip(slices, slices[1:], strict=False):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, (rank, a, b)

    def starts(ranks, name, step):
        """When each of ``ranks`` began the send ``name``: its call's post, the lap before."""
        return [
            by_rank[r][i - 1]["ts"]
            for r in ranks
            for i, e in enumerate(by_rank[r])
            if e["name"] == name and e["args"]["step"] == step
        ]

    # A receive's wait ends after every send it waits for began (clocks lined up by rank 0).
    checked = 0
    for rank, slices in by_rank.items():
        for e in slices:
            kind, _, k = e["name"].rpartition(" ")
            if kind == "wait act":
                senders, send = [0, 1], f"send act {k}"
            elif kind == "wait grad":
                senders, send = [2], f"send grad {k}"
            else:
                continue
            begun = starts(senders, send, e["args"]["step"])
            assert len(begun) == len(senders)
            assert e["ts"] + e["dur"] >= max(begun) - 1e-3, (rank, e, begun)
            checked += 1
    assert checked == 2 * M * 3  # rear: M act waits; each front: M grad waits; 2 steps

    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    windows = [r for r in records if "loss" in r and not r.get("summary")]
    assert [w["step"] for w in windows] == [9]
    assert all(w["lr"] == pytest.approx(0.05) and "breakdown" in w for w in windows)
    summary = records[-1]
    assert summary["summary"] and summary["trace"] == "trace.json"
    assert 0.0 <= summary["val_accuracy"] <= summary["val_top5"] <= 1.0
    report = summary["breakdown"]
    assert report["ideal_bubble"] == pytest.approx((2 - 1) / (M + 2 - 1))
    assert [s["processes"] for s in report["stages"]] == [2, 1]
    for st in report["stages"]:
        # Every second of a step is in exactly one category: they add up to the step's wall time.
        total = sum(v["mean"] for v in st["seconds"].values())
        assert total == pytest.approx(st["step_s"]["mean"], rel=0.05), st
        assert st["seconds"]["forward"]["mean"] > 0 and st["seconds"]["backward"]["mean"] > 0
    # ... and that wall time is the step time the throughput meter saw, measured apart.
    rear = report["stages"][1]["step_s"]["mean"]
    assert rear == pytest.approx(batch / summary["samples_per_s"], rel=0.05)
    assert report["stages"][1]["seconds"]["wait_act"]["mean"] > 0  # the rear waits for the fronts

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    want = {"train/loss", "train/samples_per_s", "train/lr", "val/top1", "val/top5"}
    want |= {f"stage{s}/{c}_s" for s in (0, 1) for c in ("forward", "backward", "wait_act")}
    want |= {"stage1/bubble", "pipeline/ideal_bubble"}
    assert want <= tags, want - tags
    assert [e.step for e in tb.Scalars("train/loss")] == [9]
