"""scripts/bench_hetero.py: which plans it runs and how it scores them (as data), its planner part
skipped with a reason, and a smoke run of main.py under CPU quotas that leaves no cgroup behind."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bundle.launch import throttle
from bundle.plan.profile import NOT_CACHED

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = throttle.available()


def _load():
    sys.path.insert(0, str(REPO / "scripts"))  # it imports bench_dp beside it
    spec = importlib.util.spec_from_file_location(
        "bench_hetero", REPO / "scripts" / "bench_hetero.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_hetero"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load()


def _plan(shape: str, bundles: int, micro: int, weights: str = "", sched: str = "1f1b") -> dict:
    run = {"bundle_shape": shape, "num_bundle": bundles, "micro_batches": micro}
    run.update(schedule=sched, row_weights=weights)
    return {"shape": [int(w) for w in shape.split(",")], "num_bundles": bundles, "run": run}


def test_picks_the_best_then_other_shapes_then_other_configurations():
    plans = [
        _plan("2", 2, 1),
        _plan("2", 2, 1),  # the same run options as the best (a mirror placement): never run
        _plan("2", 2, 2, "2.5:1"),
        _plan("4", 1, 2, "2.5:2.5:1:1"),
        _plan("4", 1, 2, "2.5:2.5:1:1", "gpipe"),
        _plan("1,1", 2, 4),
    ]
    assert bench.pick_plans(plans, 1) == [0]
    assert bench.pick_plans(plans, 3) == [0, 3, 5]
    assert bench.pick_plans(plans, 5) == [0, 3, 5, 2, 4]
    assert bench.pick_plans(plans, 10) == [0, 3, 5, 2, 4]
    assert bench.pick_plans([], 3) == []


def test_errors_are_relative_to_the_measured_figure():
    rows = [
        {"predicted_here": 150.0, "measured_samples_per_s": 100.0},
        {"predicted_here": 50.0, "measured_samples_per_s": 100.0},
        {"predicted_here": 80.0, "measured_samples_per_s": None},  # a failed run
    ]
    assert bench.abs_errors(rows) == [0.5, 0.5]


def test_shares_are_scaled_to_fit_the_cpus():
    place = [{"node": 0, "cpu": c} for c in (1.0, 1.0, 0.4, 0.4)]
    doc = {"plans": [{"placement": place}], "uniform_plan": {"placement": place}}
    fitted, scale = bench.fit_shares(doc, 2.0)
    assert scale == pytest.approx(2 / 2.8)
    shares = [r["cpu"] for r in fitted["plans"][0]["placement"]]
    assert shares == pytest.approx([0.7143, 0.7143, 0.2857, 0.2857], abs=1e-4)
    assert doc["plans"][0]["placement"][0]["cpu"] == 1.0  # the planner's file is left as it was
    assert bench.fit_shares(doc, 4.0) == (doc, 1.0)
    row = bench._row(0, {"predicted_samples_per_s": 280.0, "run": {}}, scale, 150.0, 0.02)
    assert row["predicted_here"] == pytest.approx(200.0) and row["spread"] == 0.02


def test_a_plan_runs_again_until_its_runs_agree():
    def runs(values):
        it = iter(values)
        return lambda args: {"samples_per_s": next(it)}

    # Three runs that agree are enough; noisy ones run again up to the most allowed.
    assert bench.steady(runs([100, 101, 100, 1, 1, 1]), [], (3, 6)) == [100, 101, 100]
    got = bench.steady(runs([100, 150, 60, 100, 101, 99]), [], (3, 6))
    assert got == [100, 150, 60, 100, 101]  # the middle half within 5 %: an outlier is kept out
    got = bench.steady(runs([100, 150, 60, 130, 80, 99, 500]), [], (3, 6))
    assert got == [100, 150, 60, 130, 80, 99]  # never steady: the most allowed
    assert bench.steady(runs([7, 8]), [], (1, 1)) == [7]  # --quick: once


def test_a_busy_machine_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(bench.throttle, "available", lambda: None)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(bench, "Runner", pytest.fail)
    assert bench.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_hetero.py: this machine is busy (load average 9.0 on ")
    assert "--allow-busy" in err and "\n" not in err


def test_the_planner_part_says_why_it_was_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "CLUSTER", REPO / "clusters" / "no_such_cluster.yaml")

    def no_runs(args):
        raise AssertionError(f"nothing should run: {args}")

    got = bench.bench_planner(no_runs, bench.PRESETS["quick"], tmp_path, 10.0, 2.0)
    assert got == {"skipped": "clusters/no_such_cluster.yaml does not exist"}
    assert bench.headline({"planner": got})["planner_skipped"] == got["skipped"]
    assert bench.headline({"planner": got})["planner_vs_uniform"] is None


def _fake_planner(monkeypatch, notes: list[list[str]]) -> list[list[str]]:
    """plan.py replaced: each call writes plans whose profile notes are the next of ``notes``."""
    calls: list[list[str]] = []

    def run(cmd, **_):
        out = Path(cmd[cmd.index("--json") + 1])
        plan = {"run": {}, "placement": [], "predicted_samples_per_s": 1.0}
        profiles = notes[len(calls)]
        out.write_text(json.dumps({"plans": [plan], "uniform_plan": plan, "profiles": profiles}))
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    return calls


def test_a_profile_measured_while_the_machine_was_unsteady_is_measured_again(
    monkeypatch, tmp_path, capsys
):
    unsteady = (
        "timings profile measured now while its repetitions spread 148% around their median: "
        f"{NOT_CACHED}; plan on a quiet machine"
    )
    steady = "timings profile measured now, load 0.1 on 2 CPU(s)"
    calls = _fake_planner(monkeypatch, [[unsteady], [steady]])
    doc, why = bench.make_plans(bench.PRESETS["quick"], tmp_path, 10.0)
    assert why is None and doc["profiles"] == [steady] and len(calls) == 2
    assert "plan 1 of 3: timings profile measured now while" in capsys.readouterr().err
    # Unsteady every time: refused, not reported as the planner's error.
    calls = _fake_planner(monkeypatch, [[unsteady]] * bench.PLAN_TRIES)
    doc, why = bench.make_plans(bench.PRESETS["quick"], tmp_path, 10.0)
    assert doc is None and len(calls) == bench.PLAN_TRIES
    assert why.startswith("profiles unsteady in 3 tries (the machine is noisy): timings profile")


def test_each_plan_is_reported_as_its_runs_end(monkeypatch, tmp_path, capsys):
    """A long run stopped early still says what it measured: each plan's line on stderr, and the
    part so far handed on (main writes it to --json) after every plan."""
    plans = [
        {"run": {"bundle_shape": "2,2", "micro_batches": 2}, "predicted_samples_per_s": 300.0},
        {"run": {"bundle_shape": "4"}, "predicted_samples_per_s": 200.0},
    ]
    doc = {"plans": plans, "uniform_plan": plans[1]}
    monkeypatch.setattr(bench, "make_plans", lambda *a: (doc, None))
    speeds = iter([250.0, 200.0, 260.0])  # plan 0, plan 1, then the uniform plan (one rep)
    parts = []
    got = bench.bench_planner(
        lambda args: {"samples_per_s": next(speeds)},
        replace(bench.PRESETS["quick"], plans=2),
        tmp_path,
        10.0,
        2.0,
        lambda part: parts.append([r["index"] for r in part["plans"]]),
    )
    assert parts == [[0], [0, 1]]  # after each plan, the plans so far
    save = bench._saver(str(tmp_path / "report.json"), {"mode": "full"})
    save({"partial": True, "plans": got["plans"][:1]})  # what main hands bench_planner (--json)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["mode"] == "full" and written["planner"]["partial"] is True
    assert bench._saver(None, {}) is None
    assert [r["index"] for r in got["plans"]] == [0, 1, "uniform"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == (
        "plan 0 (2,2 x1 M=2): predicted 300.0, measured 250.0 samples/s over 1 run(s), error +20.0%"
    )
    assert lines[1].startswith("plan 1 (4 x1 M=1): predicted 200.0, measured 200.0 ")
    assert lines[-1].endswith("measured 260.0 samples/s over 1 run(s), error -23.1%")


def test_without_cgroups_it_exits_2_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(bench.throttle, "available", lambda: "cgroup v1 at /x is read-only")
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "bench_hetero.py: cannot emulate slower devices here: cgroup v1 at /x is read-only"
    )


def _cgroups() -> set[str]:
    found = throttle.find()
    if isinstance(found, str):
        return set()
    return {p.name for p in found.parent.glob("bundle-*-rank*")}


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=f"no CPU quota cgroups: {WHY_NOT}")
def test_quick_weighted_run_reports_a_ratio_and_cleans_up(tmp_path: Path) -> None:
    before = _cgroups()
    out = tmp_path / "hetero.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_hetero.py"), "--quick"]
    cmd += ["--only", "weighted", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ratio = report["weighted_vs_even"]
    assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, report
    for key in ("planner_median_abs_error", "planner_max_abs_error", "planner_vs_uniform"):
        assert key in report and report[key] is None, key
    w = report["weighted"]
    assert len(w["samples_per_s"]["even"]) == len(w["samples_per_s"]["weighted"]) == 1
    assert _cgroups() <= before  # every quota cgroup of the runs is gone
