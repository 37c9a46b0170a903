"""scripts/bench_compile.py's arithmetic, from literal progress records and summaries: the steady
speed, break-even and the report of interleaved runs (no main.py runs)."""

from __future__ import annotations

import bench_compile
import pytest


def _records(batch: int, step_s: list[float], every: int) -> list[dict]:
    """main.py's progress records of steps taking ``step_s`` each: samples/s counted from the
    end of step 1, one record every ``every`` steps and at the last."""
    done, out = 0.0, []
    for k, t in enumerate(step_s[1:], start=2):
        done += t
        if k % every == 0 or k == len(step_s):
            out.append({"step": k, "loss": 1.0, "samples_per_s": round(batch * (k - 1) / done, 2)})
    return [*out, {"summary": True, "samples_per_s": 0.0}]


def test_steady_rate_leaves_out_a_slow_second_step_the_summary_counts():
    # Step 2 waits 1 s for the first stage's backward compile; the rest take 0.1 s.
    records = _records(8, [5.0, 1.0, *[0.1] * 8], every=2)
    assert records[-2]["samples_per_s"] == pytest.approx(8 * 9 / 1.8, abs=0.01)  # main.py's
    assert bench_compile.steady_rate(records, settle=2) == pytest.approx(80.0, rel=1e-3)
    assert bench_compile.steady_rate(records, settle=10) is None  # one record left: no interval


def test_break_even_is_compile_time_over_the_time_a_step_saves():
    assert bench_compile.break_even(10.0, 100.0, 200.0, batch=64) == pytest.approx(10 / 0.32)
    assert bench_compile.break_even(10.0, 200.0, 100.0, batch=64) is None  # compiled is slower
    assert bench_compile.break_even(None, 100.0, 200.0, batch=64) is None


def _run(steady: float, loss: float, compile_s: float | None = None) -> dict:
    out = {"steady_samples_per_s": steady, "samples_per_s": steady / 2, "final_loss": loss}
    return out if compile_s is None else {**out, "compile_s": compile_s}


def test_compare_reports_the_ratio_of_medians_and_whether_the_losses_agree():
    runs = {
        "eager": [_run(100.0, 3.000), _run(90.0, 3.000), _run(120.0, 3.000)],
        "compiled": [_run(150.0, 3.010, 20.0), _run(200.0, 3.005, 30.0), _run(0.0, 3.0, 9.0)],
    }
    got = bench_compile.compare(runs, batch=64)
    assert got["median_samples_per_s"] == {"eager": 100.0, "compiled": 175.0}
    assert got["compiled_vs_eager"] == pytest.approx(1.75)
    assert got["compile_s"] == [20.0, 30.0, 9.0]
    assert got["break_even_steps"] == pytest.approx(20.0 / (0.64 - 64 / 175))
    assert got["losses_agree"] is True
    runs["compiled"][0]["final_loss"] = 3.02  # 0.7 %: past REL_TOL
    assert bench_compile.compare(runs, batch=64)["losses_agree"] is False


def test_a_report_without_compiled_runs_renders_with_gaps():
    got = bench_compile.compare({"eager": [_run(100.0, 3.0)], "compiled": []}, batch=64)
    assert got["compiled_vs_eager"] is None and got["losses_agree"] is None
    sizes = bench_compile.PRESETS["quick"].__dict__
    conditions = {**bench_compile.conditions(2), "load_before": 0.1, "load_after": 0.2}
    assert conditions["threads_per_process"] == max(1, conditions["cpus"] // 2)
    report = {"result": got, "conditions": conditions, "sizes": sizes}
    text = bench_compile.render({**report, "backend": "inductor", "shape": "1,1"})
    assert "compiled / eager -" in text and "final losses within 0.005: -" in text
