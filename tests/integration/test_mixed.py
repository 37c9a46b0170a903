"""Mixed devices end to end: a saved plan (shape, row weights, placement) runs as main.py --plan,
and speed-weighted rows train and evaluate as even rows do (same batches, same arithmetic)."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import finish, start

pytestmark = pytest.mark.slow


def _summary(path) -> dict:
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["summary"] is True
    return last


def test_a_saved_plan_with_row_weights_trains_and_evaluates_as_even_rows(tmp_path):
    plan = tmp_path / "plans.json"
    run = {"bundle_shape": "2,1", "micro_batches": 2, "row_weights": "3:1,1", "schedule": "gpipe"}
    # Ranks on the node's devices in another order than their local ranks (gloo: the CPU).
    placement = [{"node": 0, "device": d, "type": t} for d, t in ((2, "a"), (0, "b"), (1, "a"))]
    plan.write_text(json.dumps({"plans": [{"run": run, "placement": placement}]}))
    common = ["main.py", "--itr", "12"]
    results = {}
    for name, extra in (
        ("plan", ["--plan", str(plan)]),
        ("even", ["--bundle-shape", "2,1", "--micro-batches", "2", "--schedule", "gpipe"]),
    ):
        metrics = tmp_path / f"{name}.jsonl"
        code, _, err = finish(start(*common, *extra, "--metrics-out", str(metrics)))
        assert code == 0, err
        results[name] = (_summary(metrics), err)
    (planned, log), (even, _) = results["plan"], results["even"]
    assert "rows 3:1,1, stage 0 on a+b, stage 1 on a" in log
    assert planned["shape"] == [2, 1] and planned["val_samples"] == even["val_samples"] > 0
    assert planned["final_loss"] == pytest.approx(even["final_loss"], abs=1e-4)
    assert planned["val_loss"] == pytest.approx(even["val_loss"], abs=1e-4)
    assert planned["val_accuracy"] == pytest.approx(even["val_accuracy"], abs=1e-3)
