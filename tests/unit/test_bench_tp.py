"""scripts/bench_tp.py's flags, its hand count of what TP splits, and its report, from a tiny GPT
and literal summaries (no main.py runs)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_tp
import pytest

from bundle.models import tp
from bundle.models.gpt import GPT


def _summary(sps: float, param: int, grad: int, optim: int, world: int) -> dict:
    return {
        "steady_samples_per_s": sps,
        "most_param_bytes": param,
        "most_grad_bytes": grad,
        "most_optimizer_bytes": optim,
        "world_size": world,
        "final_loss": 3.4,
    }


def _runs() -> dict[str, list[dict]]:
    return {
        "one": [_summary(30.0, 400, 400, 800, 1), _summary(20.0, 400, 400, 800, 1)],
        "tp": [_summary(12.0, 220, 220, 440, 2), _summary(10.0, 220, 220, 440, 2)],
        "dp": [_summary(50.0, 400, 400, 800, 2)],
        "pipe": [_summary(9.0, 300, 300, 600, 3), _summary(None, 300, 300, 600, 3)],  # type: ignore[arg-type]
    }


def test_flags_replace_the_modes_sizes_and_a_degree_below_2_is_refused():
    args = bench_tp.parse_args(["--quick", "--steps", "8", "--degree", "4"])
    sizes = bench_tp.sizes_of(args)
    assert (sizes.batch, sizes.steps, sizes.reps, args.degree) == (16, 8, 3, 4)
    assert bench_tp.sizes_of(bench_tp.parse_args([])) == bench_tp.Sizes()
    with pytest.raises(SystemExit):
        bench_tp.parse_args(["--degree", "1"])


def test_every_case_runs_the_same_job_and_differs_only_in_its_placement():
    base = bench_tp.job(bench_tp.Sizes(), Path("t.txt"))
    assert base[base.index("--batch-size") + 1] == "32" and "--no-eval" in base
    assert "--bundle-shape" not in base and "--tensor-parallel" not in base
    c = bench_tp.cases(2)
    assert c["tp"] == ["--bundle-shape", "1", "--tensor-parallel", "2"]
    assert c["pipe"] == ["--bundle-shape", "1,1", "--tensor-parallel", "2,1"]
    assert c["rear"] == ["--bundle-shape", "1,1", "--tensor-parallel", "1,2"]
    assert bench_tp.processes(2) == {"one": 1, "tp": 2, "dp": 2, "pipe": 3, "rear": 3}


def test_the_hand_count_is_what_tp_apply_leaves_on_one_process():
    model = GPT(vocab=16, seq_len=8, layers=2, width=16, heads=4)
    got = bench_tp.split_count(model, 2)
    # Per layer: q|k|v 16x48 + 48 and mlp.0 16x64 + 64 split with their biases; proj 16x16
    # and mlp.2 64x16 split without theirs.
    assert got["split_params"] == 2 * (16 * 48 + 48 + 16 * 16 + 16 * 64 + 64 + 64 * 16)
    assert got["replicated_params"] == got["all_params"] - got["split_params"]
    tp.apply(model, tp.plan_of(model), rank=0, size=2, all_reduce=lambda t: None)
    assert got["per_process_params"] == sum(p.numel() for p in model.parameters())
    assert got["ratio"] == pytest.approx(got["per_process_params"] / got["all_params"])


def test_a_degree_the_heads_do_not_take_is_refused_by_the_count():
    with pytest.raises(tp.TPError, match="does not divide heads"):
        bench_tp.split_count(GPT(vocab=16, seq_len=8, layers=1, width=12, heads=3), 2)


def test_the_report_compares_tp_with_one_process_and_dp_by_medians():
    rows = bench_tp.summarize(_runs(), bench_tp.processes(2))
    assert rows["one"]["median_samples_per_s"] == 25.0
    assert rows["pipe"]["median_samples_per_s"] == 9.0  # a run without a steady speed left out
    assert rows["tp"]["most_total_bytes"] == 880 and rows["one"]["most_total_bytes"] == 1600
    got = bench_tp.compare(rows, {"ratio": 0.55})
    assert got["bytes_tp_vs_one"]["most_total_bytes"] == pytest.approx(0.55)
    assert got["bytes_tp_vs_one"]["most_param_bytes"] == pytest.approx(0.55)
    assert got["speed_tp_vs_one"] == pytest.approx(11 / 25)
    assert got["speed_tp_vs_dp"] == pytest.approx(11 / 50)
    rows["dp"] = bench_tp.summarize({"dp": []}, {"dp": 2})["dp"]  # every dp run failed
    assert bench_tp.compare(rows, {"ratio": 0.55})["speed_tp_vs_dp"] is None


def _report() -> dict:
    count = {"degree": 2, "all_params": 1000, "split_params": 900, "replicated_params": 100}
    count |= {"per_process_params": 550.0, "ratio": 0.55}
    rows = bench_tp.summarize(_runs(), bench_tp.processes(2))
    return {
        "command": "bench_tp.py --quick",
        "sizes": bench_tp.PRESETS["quick"].__dict__,
        "conditions": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "load_start": [1.5, 1, 0.5]},
        "cases": bench_tp.cases(2),
        "expected": count,
        "rows": rows,
        "result": bench_tp.compare(rows, count),
        "failures": [],
        "wall_s": 1.0,
    }


def test_render_prints_the_conditions_both_ratios_and_the_oversubscribed_pipeline():
    text = bench_tp.render(_report())
    assert "Test CPU, 2 cores, torch 2.x, load average at start 1.50 1.00 0.50" in text
    assert "command: bench_tp.py --quick" in text
    assert (
        "measured 0.5500" in text and "expected 0.5500 = (100 replicated + 900 split / 2)" in text
    )
    assert "TP 2 / one process 0.440; TP 2 / DP 2 0.220" in text
    assert "not expected to beat DP" in text
    assert "pipe: 3 processes on 2 cores oversubscribe" in text
    tp_row = next(line for line in text.splitlines() if line.lstrip().startswith("tp "))
    assert "shape 1 tp 2" in tp_row and "12.0 10.0" in tp_row and "0.5500" in tp_row


def test_render_says_nothing_of_oversubscription_with_cores_enough():
    report = _report()
    report["conditions"]["cores"] = 16
    assert "oversubscribe" not in bench_tp.render(report)


def test_publish_writes_the_report_as_json(tmp_path, capsys):
    path = tmp_path / "tp.json"
    bench_tp.publish(_report(), bench_tp.render, str(path))
    written = json.loads(path.read_text())
    assert written["result"]["speed_tp_vs_one"] == pytest.approx(0.44)
    assert written["rows"]["pipe"]["samples_per_s"] == [9.0, None]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == written


def test_a_case_whose_runs_spread_widely_is_flagged_and_a_steady_one_is_not():
    rows = bench_tp.summarize(_runs(), bench_tp.processes(2))
    assert bench_tp.noisy(rows) == []  # one: 30 / 20 = 1.5, not past NOISY_SPREAD
    rows["one"]["samples_per_s"] = [72.8, 6.9, 16.4]
    (line,) = bench_tp.noisy(rows)
    assert line.strip().startswith("noisy: one's runs range 6.9..72.8 samples/s (10.6x)")
