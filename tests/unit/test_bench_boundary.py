"""scripts/bench_boundary.py's arithmetic and table, from literal summary breakdowns (no main.py
runs): the columns are the breakdown's categories summed, per message by the schedule's count."""

from __future__ import annotations

import bench_boundary
import pytest

from bundle.observe.timing import CATEGORIES


def _stage(stage: int, step: float, **ms: float) -> dict:
    """One stage of a breakdown: ``ms`` per step by category (the rest 0), the mean as its max."""
    secs = {c: {"mean": ms.get(c, 0.0) / 1e3, "max": ms.get(c, 0.0) / 1e3} for c in CATEGORIES}
    return {"stage": stage, "processes": 1, "step_s": {"mean": step / 1e3}, "seconds": secs}


BREAKDOWN = {
    "stages": [
        _stage(
            0,
            100.0,
            forward=30.0,
            backward=50.0,
            copy=1.0,
            post=4.0,
            wait_grad=8.0,
            engine=2.0,
            optimizer=5.0,
        ),  # fmt: skip
        _stage(
            1,
            100.0,
            forward=20.0,
            backward=40.0,
            post=2.0,
            wait_act=30.0,
            send=1.0,
            engine=2.0,
            data=1.0,
            optimizer=4.0,
        ),  # fmt: skip
    ]
}


def test_1f1b_at_1_1_sends_and_receives_one_message_each_way_per_micro_batch():
    assert bench_boundary.messages(0, 4) == {"messages": 8, "receives": 4}
    assert bench_boundary.messages(1, 1) == {"messages": 2, "receives": 1}


def test_stage_rows_sum_the_categories_and_divide_by_the_messages():
    front, rear = bench_boundary.stage_rows(BREAKDOWN, micro=4)
    assert front["compute_ms"] == pytest.approx(80.0) and front["copy_ms"] == pytest.approx(1.0)
    assert front["wait_ms"] == pytest.approx(8.0) and rear["wait_ms"] == pytest.approx(30.0)
    assert rear["rest_ms"] == pytest.approx(5.0) and rear["send_ms"] == pytest.approx(1.0)
    # Every column of a stage adds up to its step, as the breakdown's categories do.
    cols = [f"{c}_ms" for c in bench_boundary.COLUMNS]
    assert sum(front[c] for c in cols) == pytest.approx(front["step_ms"])
    assert front["post_us_per_message"] == pytest.approx(500.0)  # 4 ms over 8 messages
    assert rear["wait_us_per_receive"] == pytest.approx(7500.0)  # 30 ms over 4 receives
    # (M + S - 1) micro-batches of the slower stage's 81 ms / 4, over the 100 ms step.
    assert bench_boundary.bound([front, rear], 4) == pytest.approx(5 * 81 / 4 / 100)


def test_the_median_run_is_shown_whole_and_a_case_without_runs_says_so():
    runs = [
        {"samples_per_s": 30.0, "breakdown": BREAKDOWN},
        {"samples_per_s": 10.0, "breakdown": None},
        {"samples_per_s": 20.0, "breakdown": BREAKDOWN},
    ]
    assert bench_boundary.median_run(runs)["samples_per_s"] == 20.0
    assert bench_boundary.median_run(runs[:2])["samples_per_s"] == 10.0  # the lower middle
    case = bench_boundary.case_report(runs, 4)
    assert case["median_samples_per_s"] == 20.0 and len(case["stages"]) == 2
    empty = bench_boundary.case_report([], 8)
    text = bench_boundary.render({"cases": [case, empty]})
    lines = text.splitlines()
    assert "post/msg" in lines[0] and len(lines) == 4
    assert lines[1].split()[:3] == ["4", "0", "100.00"]
    assert float(lines[1].split()[-1]) == pytest.approx(1.0125, abs=1e-3)  # the bound, on stage 0
    assert lines[3].split() == ["8", "(no", "run", "finished)"]


def test_the_metrics_files_last_record_is_read_only_when_it_is_the_summary(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 10}\n{"summary": true, "breakdown": {"stages": []}}\n')
    assert bench_boundary.last_record(path) == {"summary": True, "breakdown": {"stages": []}}
    path.write_text('{"step": 10}\n')
    assert bench_boundary.last_record(path) is None
    assert bench_boundary.last_record(tmp_path / "none.jsonl") is None
