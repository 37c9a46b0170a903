"""The tensor-parallel probe's fit (``bundle.plan.calibrate_tp``) recovers the cost per sum that
made a step: a step simulated with a known cost from made-up timings (no processes, no clock) is
fitted back to it."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from bundle.plan import calibrate, calibrate_tp, tensor
from bundle.plan import profile as prof
from bundle.plan.anatomy import count
from bundle.plan.cluster import Link
from bundle.plan.cost import CostModel, Execution, Overheads
from bundle.plan.simulate import Layout, simulate

LINK = Link(2e9, 5e-5)
PAIR = calibrate.loopback(LINK, LINK, devices=2, memory_bytes=float("inf"))
BASE = Overheads(compute_action=2e-5, send_call=5e-5, recv_call=6e-5)


def timings(n: int, rows: int, per_block: float) -> dict:
    """A profile of ``n`` blocks at ``rows``, each ``per_block`` s forward and twice that back."""
    return asdict(
        prof.Timings(
            device="cpu",
            precision="fp32",
            rows=(rows,),
            fwd=((per_block,) * n,),
            bwd=((2 * per_block,) * n,),
            loss=(per_block / 10,),
            optimizer_per_param=1e-9,
        )
    )


def tp_step(overheads: Overheads, profile: dict) -> float:
    anatomy = count(calibrate_tp.SPEC)
    cost = CostModel(
        anatomy=anatomy,
        cluster=PAIR,
        timings=prof.Timings(**profile),
        overheads=overheads,
        execution=Execution(overlap=False),
    )
    split = tensor.split_of(calibrate_tp.SPEC, cost.n)
    layout = Layout((1,), 1, (0,), 1, "1f1b", "flat", calibrate_tp.ROWS, 2, tp=(2,))
    return simulate(layout, tensor.Splittable.of(cost, split)).step_time


def test_the_tp_probe_fit_recovers_the_cost_of_each_sum():
    """Each split block's sums are charged ``tp_sum`` on top of their all-reduce: two blocks of
    two rowwise layers, summed in the forward and in the backward, make eight a step."""
    n = len(count(calibrate_tp.SPEC).blocks)
    profile = timings(n, calibrate_tp.ROWS, 1e-3)
    without = tp_step(BASE, profile)
    made = replace(BASE, tp_sum=2.5e-3)
    step = tp_step(made, profile)
    sums = sum(tensor.split_of(calibrate_tp.SPEC, n).reduces) * 2
    assert sums == 8
    assert step - without == pytest.approx(sums * made.tp_sum, rel=1e-6)
    found = calibrate_tp.fit_tp_sum(BASE, PAIR, {"step": step, "timings": profile})
    assert found.tp_sum == pytest.approx(made.tp_sum, rel=1e-6)
    # A step faster than the sums' all-reduces alone: nothing on top.
    assert calibrate_tp.fit_tp_sum(BASE, PAIR, {"step": 0.0, "timings": profile}).tp_sum == 0.0
