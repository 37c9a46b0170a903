"""scripts/bench_lora.py's arithmetic and its jobs, from literal summaries (no main.py runs)."""

from __future__ import annotations

from pathlib import Path

import bench_lora
import pytest


def _summary(sync: int, optim: int, rate: float | None) -> dict:
    return {"grad_sync_bytes": sync, "optimizer_bytes": optim, "steady_samples_per_s": rate}


def test_compare_gives_each_case_its_medians_and_its_ratio_to_full():
    runs = {
        "full": [_summary(1000, 2000, 10.0), _summary(1000, 2000, 30.0)],
        "lora": [_summary(20, 40, 40.0), _summary(20, 40, None)],
    }
    out = bench_lora.compare(runs)
    assert out["median"]["full"]["steady_samples_per_s"] == 20.0
    assert out["median"]["lora"]["steady_samples_per_s"] == 40.0  # a run without one left out
    assert out["vs_full"]["lora"]["grad_sync_bytes"] == pytest.approx(0.02)
    assert out["vs_full"]["lora"]["optimizer_bytes"] == pytest.approx(0.02)
    assert out["vs_full"]["lora"]["steady_samples_per_s"] == pytest.approx(2.0)
    assert "full" not in out["vs_full"] and out["vs_full"]["lora"]["final_loss"] is None


def test_every_case_runs_the_same_job_and_lora_adds_only_its_flags():
    args = bench_lora.parse_args(["--r", "4", "--base-dtype", "bf16"])
    base = bench_lora.job(bench_lora.PRESETS["quick"], Path("t.txt"))
    assert base[base.index("--bundle-shape") + 1] == "2,1" and "--lora" not in base
    assert args.r == 4 and args.base_dtype == "bf16"
