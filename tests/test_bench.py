"""scripts/bench.py runs end to end in smoke mode and reports every key with a usable value."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RATIOS = ("pipeline_efficiency", "vs_torch_pipelining", "dp_vs_ddp", "hierarchical_vs_flat")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_bench_smoke_reports_every_key(tmp_path: Path) -> None:
    """The smoke run writes every headline key: finite positive ratios, exact peaks, both sweeps."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--smoke", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline_efficiency" in proc.stdout
    report = json.loads(out.read_text())

    for key in RATIOS:
        assert _positive(report[key]), (key, report[key])
    assert report["peak_inflight_1f1b"] == 2
    assert report["peak_inflight_gpipe"] == 8

    for key in ("sweep_mlp", "sweep_cnn"):
        rows = report[key]
        assert rows, key
        for row in rows:
            assert isinstance(row["micro_batches"], int) and row["micro_batches"] >= 1, row
            assert _positive(row["samples_per_s"]), row
            assert _positive(row["efficiency"]), row
    assert [r["micro_batches"] for r in report["sweep_mlp"]] == [1, 2, 4, 8, 16]

    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["platform"]
    assert "bench.py" in report["command"] and "--smoke" in report["command"]
    assert report["raw"], "per-measurement numbers are missing"
    for name, entry in report["raw"].items():
        assert entry["step_s"] and all(_positive(t) for t in entry["step_s"]), name
