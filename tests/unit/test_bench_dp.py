"""scripts/bench_dp.py's arithmetic, from literal summaries: interleaving, the ratio of medians, the
loss checks and the ZeRO report (no main.py runs; tests/integration/test_bench.py starts it)."""

from __future__ import annotations

import math

import bench_dp
import pytest


def _summary(sps: float, loss: float, *sizes: int) -> dict:
    held = dict(zip(bench_dp.HELD, sizes, strict=True))
    most = {f"most_{k}": v for k, v in held.items()}
    return {"samples_per_s": sps, "final_loss": loss, **held, **most}


def test_interleaved_rounds_alternate_their_order_and_leave_failed_runs_out():
    calls = []

    def run(args):
        calls.append(args[-1])
        return None if len(calls) == 4 else {"call": len(calls)}

    got = bench_dp.interleaved(run, ["--x"], {"a": ["A"], "b": ["B"], "c": ["C"]}, reps=2)
    assert calls == ["A", "B", "C", "C", "B", "A"]
    assert got == {
        "a": [{"call": 1}, {"call": 6}],
        "b": [{"call": 2}, {"call": 5}],
        "c": [{"call": 3}],
    }


def test_median_ratio_compares_medians_and_needs_both_sides():
    assert bench_dp.median_ratio([1.0, 9.0, 4.0], [2.0, 2.0]) == 2.0
    assert bench_dp.median_ratio([], [2.0]) is None
    assert bench_dp.median_ratio([1.0], [0.0]) is None


def test_losses_agree_is_exact_at_zero_tolerance_and_relative_otherwise():
    assert bench_dp.losses_agree([2.5, 2.5], [2.5]) is True
    assert bench_dp.losses_agree([2.5], [2.501]) is False
    assert bench_dp.losses_agree([2.5], [2.504], rel_tol=2e-3) is True
    assert bench_dp.losses_agree([2.5], [2.51], rel_tol=2e-3) is False
    assert bench_dp.losses_agree([math.nan], [math.nan], rel_tol=1.0) is False
    assert bench_dp.losses_agree([], [2.5]) is None


def test_zero_row_reports_zero3_bytes_against_zero0_and_its_loss_within_tolerance():
    runs = {
        "zero0": [_summary(100.0, 4.000, 400, 400, 800), _summary(110.0, 4.000, 400, 400, 800)],
        "zero1": [_summary(90.0, 4.000, 400, 400, 400)],
        "zero3": [_summary(60.0, 4.004, 200, 200, 400)],
    }
    row = bench_dp.zero_row(runs, width=2)
    assert row["total_bytes"] == {"zero0": 1600, "zero1": 1200, "zero3": 800}
    assert row["zero3_ratios"] == {
        "param": 0.5,
        "grad": 0.5,
        "optimizer": 0.5,
        "total": 0.5,
        "most_total": 0.5,
    }
    assert row["optimizer_ratio"] == 0.5 and row["expected_ratio"] == 0.5
    assert row["throughput_ratio"] == pytest.approx(90 / 105)
    assert row["zero3_vs_zero1"] == pytest.approx(60 / 90)
    assert row["zero3_vs_zero0"] == pytest.approx(60 / 105)
    assert row["same_final_loss"] is True and row["zero3_loss_agrees"] is True
    runs["zero3"] = [_summary(60.0, 4.02, 200, 200, 400)]  # 0.5 %: past ZERO3_REL_TOL
    runs["zero1"] = [_summary(90.0, 4.001, 400, 400, 400)]  # ZeRO-1 must be exact
    row = bench_dp.zero_row(runs, width=2)
    assert row["zero3_loss_agrees"] is False and row["same_final_loss"] is False


def test_zero_row_leaves_a_case_without_runs_as_none():
    runs = {"zero0": [_summary(100.0, 4.0, 400, 400, 800)], "zero1": [], "zero3": []}
    row = bench_dp.zero_row(runs, width=4)
    assert row["zero3_ratios"]["total"] is None and row["zero3_vs_zero0"] is None
    assert row["same_final_loss"] is None and row["zero3_loss_agrees"] is None
    assert bench_dp.render(
        {
            "zero": {
                "model": "gpt",
                "optimizer": "adamw",
                "steps": 4,
                "zero3_rel_tol": 2e-3,
                "widths": {"4": row},
            }
        }
    )
