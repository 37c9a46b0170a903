"""scripts/bench_faults.py's reading of a run's console: the times it reports, from literal lines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_faults.py"
spec = importlib.util.spec_from_file_location("bench_faults", SCRIPT)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_faults"] = bench  # its dataclass looks its module up
spec.loader.exec_module(bench)


def _line(step: int) -> str:
    return f"[rank 1 b0 s1] step {step}/100  loss 2.3  900.0 samples/s  lr 0.05"


def test_a_bundle_run_reports_the_next_step_the_rejoin_and_the_rates():
    run = bench.Run(fault_at=10.5, code=0, summary={"val_accuracy": 0.9, "heals": 1})
    run.lines = [(1.0, _line(10)), (10.0, _line(20)), (11.5, _line(30)), (13.5, _line(40))]
    run.lines += [(14.0, "[rank 1 b0 s1] bundle(s) 1 rejoin after step 44: bundles 0, 1, 2")]
    run.lines += [(15.0, _line(50)), (16.0, _line(60)), (17.0, _line(70))]
    got = bench.report("bundle", run)
    assert got["to_next_step_s"] == 1.0 and got["to_rejoin_s"] == 3.5
    assert got["samples_per_s_before"] == round(10 * 48 / 9.0, 1)
    assert got["samples_per_s_missing"] == 240.0 and got["samples_per_s_after"] == 480.0
    assert got["heals"] == 1 and "steps_redone" not in got


def test_a_restart_run_counts_the_steps_done_twice():
    run = bench.Run(fault_at=5.0, code=0)
    run.lines = [(1.0, _line(200)), (4.0, _line(290)), (14.0, _line(210)), (15.0, _line(220))]
    got = bench.report("restart", run)
    assert got["steps_redone"] == 81 and got["to_next_step_s"] == 9.0


def test_the_fault_hits_replica_0_of_bundle_1_s_last_stage():
    assert bench.victim("1,1") == 3 and bench.victim("2,1") == 5 and bench.victim("2,2,1") == 9
