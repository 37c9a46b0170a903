"""scripts/plan_validate.py's rounds and rows with a fake measurement (no processes, no clock):
a configuration is measured again until its rounds agree, and compared at their median."""

from __future__ import annotations

from dataclasses import replace

import plan_validate
import pytest

SPEC = replace(plan_validate.SMOKE, rounds=3, max_rounds=6, spread=0.10)
MLP = plan_validate.Config("mlp", (1, 1), 4, "1f1b")


def _fake(series: dict[str, list[float]]):
    """A measurement whose n-th round of a name gives its n-th value; the names asked, per round."""
    asked: list[list[str]] = []
    seen = {n: 0 for n in series}

    def measure(r: int, names: list[str]) -> dict[str, float]:
        assert r == len(asked)
        asked.append(list(names))
        out = {}
        for n in names:
            out[n] = series[n][seen[n]]
            seen[n] += 1
        return out

    return measure, asked


def test_a_row_is_measured_until_its_rounds_agree_or_the_rounds_run_out():
    measure, asked = _fake(
        {
            "steady": [100.0, 102.0, 99.0],  # within 10 % after the 3 rounds it needs
            "noisy": [100.0, 150.0, 70.0, 120.0, 95.0, 160.0],  # its quartiles never close
            "late": [100.0, 140.0, 100.0, 101.0, 99.0],  # one outlier: left out from 5 rounds
        }
    )
    done = plan_validate.repeat(measure, ["steady", "noisy", "late"], SPEC)
    assert done == {"steady": True, "noisy": False, "late": True}
    assert asked == [["steady", "noisy", "late"]] * 3 + [["noisy", "late"]] * 2 + [["noisy"]]


def test_every_process_goes_on_with_the_names_agreed():
    measure, asked = _fake({"a": [1.0, 5.0, 9.0, 1.0], "b": [1.0, 9.0, 1.0, 5.0]})
    done = plan_validate.repeat(
        measure, ["a", "b"], replace(SPEC, max_rounds=4), agree=lambda pending: pending[:1]
    )
    assert asked == [["a", "b"], ["a"], ["a"], ["a"]]
    assert done == {"a": False, "b": False}  # b stopped where rank 0 said, unsettled


def test_the_least_rounds_are_run_even_when_the_first_agree():
    measure, asked = _fake({"a": [100.0] * 5})
    assert plan_validate.repeat(measure, ["a"], replace(SPEC, rounds=5, max_rounds=5)) == {
        "a": True
    }
    assert len(asked) == 5
    assert not plan_validate.settled([100.0, 100.0], 0.1, 2)  # too few to judge a spread


def test_rows_compare_medians_and_the_report_counts_each_side():
    slow = plan_validate.compare(MLP, 64, [110.0, 130.0, 120.0], [100.0, 80.0, 90.0], True)
    assert slow["predicted_samples_per_s"] == 120.0 and slow["measured_samples_per_s"] == 90.0
    assert slow["error"] == pytest.approx(1 / 3, abs=1e-4) and slow["rounds"] == 3
    assert slow["measured_range"] == pytest.approx(20 / 90, abs=1e-4)
    fast = plan_validate.compare(replace(MLP, micro=8), 64, [90.0], [100.0], False)
    fast["name"] = "other"
    report = plan_validate.summarize([slow, fast], SPEC)
    assert (report["optimistic"], report["pessimistic"]) == (1, 1)
    assert report["median_abs_error"] == pytest.approx((1 / 3 + 0.1) / 2, abs=1e-4)
    assert report["unsettled"] == ["other"]
    text = plan_validate.render(report).splitlines()
    assert text[2].rstrip().endswith("1*") and "1 of 2 predicted faster" in text[3]
    assert text[4].startswith("* spread above 10% after 6 rounds: 1 configuration(s)")


def _record(passes: list[tuple[list[float], list[float], float]]) -> dict:
    return {"rows": 8, "passes": [list(p) for p in passes], "optimizer_per_param": 1e-9}


def test_each_stage_is_timed_on_the_processes_that_run_it():
    """A pipeline's stage takes its blocks from its own process's passes, not from whichever
    process was slower over the whole model; replicas of one stage take the slower per pass."""
    # Rank 0 is slow on blocks 0-1, rank 1 on blocks 2-3 (and slower over the whole model).
    fast, slow = [1.0, 1.0], [3.0, 3.0]
    rank0 = _record([(slow + fast, slow + fast, 0.5)] * 3)
    rank1 = _record([(fast + slow, fast + slow, 2.0)] * 3)
    piped = plan_validate.slowest_timings([rank0, rank1], (0, 2), (1, 1))
    assert piped.fwd[0] == (3.0, 3.0, 3.0, 3.0) and piped.loss == (2.0,)
    # Data parallel: per pass, the replica slower over the whole stage (rank 1 here), all blocks.
    replicas = plan_validate.slowest_timings([rank0, rank1], (0,), (2,))
    assert replicas.fwd[0] == (1.0, 1.0, 3.0, 3.0) and replicas.loss == (2.0,)
    assert plan_validate.slowest_timings([rank0]).fwd[0] == (3.0, 3.0, 1.0, 1.0)
