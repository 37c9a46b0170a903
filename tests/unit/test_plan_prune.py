"""What makes the search quick without changing its answer: the stage groups' nodes counted from
the layout (``estimate._group_nodes``), the step's lower bound (``simulate.lower_bound``), and
the plans left unsimulated because that bound cannot reach the best (``plans.evaluate_many``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bundle.errors import TopologyError
from bundle.ir.schedule import SCHEDULES
from bundle.plan import plans as plans_module
from bundle.plan import tensor
from bundle.plan.cluster import Link
from bundle.plan.estimate import _group_nodes
from bundle.plan.plans import Plan, evaluate, evaluate_many, rank
from bundle.plan.search import EXACT_TOP, Workload, search
from bundle.plan.simulate import lower_bound
from bundle.topology import Topology
from tests.support.plan_fixtures import literal_cost
from tests.unit.test_plan_tp import PARAMS, SPLIT, _cost

LINK = Link(bandwidth=20.0, latency=0.01)


def _cases() -> list[Plan]:
    """Plans of a small search: every shape, bundle count, split, schedule and sync it simulated,
    tensor-parallel degrees per stage among them."""
    work = Workload(nodes=2, per_node=4, batch=32)
    return [e.plan for e in search(_cost(memory_bytes=40_000), workload=work)]


def test_the_stage_groups_nodes_are_the_topologys():
    rng = random.Random(0)
    for _ in range(200):
        stages = rng.randint(1, 4)
        degrees = tuple(rng.choice((1, 2)) for _ in range(stages))
        shape = tuple(rng.randint(1, 3) for _ in range(stages))
        bundles, ppn = rng.randint(1, 3), rng.choice((1, 2, 4))
        plan = Plan(shape, bundles, tuple(range(stages)), 1, ppn, tp=degrees)
        if plan.processes % ppn:
            continue
        try:
            topo = Topology(
                shape=shape,
                num_bundles=bundles,
                procs_per_node=ppn,
                global_batch=64,
                micro_batches=1,
                tp=degrees,
            )
        except TopologyError:  # a TP group across nodes
            continue
        for s in range(stages):
            groups = (topo.stage_group(s), topo.bundle_stage_group(0, s), topo.masters_group(s))
            want = tuple([topo.node_of(r) for r in g] for g in groups)
            assert _group_nodes(plan, s) == want


def test_no_simulated_step_is_shorter_than_its_lower_bound():
    costs = [
        _cost(),
        tensor.Splittable.of(
            literal_cost([1.0, 3.0, 0.5, 2.0], [2.0, 5.0, 1.0, 4.0], params=PARAMS, p2p=LINK), SPLIT
        ),
    ]
    plans = _cases()
    plans += [replace(p, schedule="gpipe") for p in plans if p.chunks == 1]
    assert {p.schedule for p in plans} == set(SCHEDULES) and any(len(set(p.tp)) > 1 for p in plans)
    for cost in costs:
        for plan in plans:
            step = evaluate(cost, plan, 32).sim.step_time
            assert lower_bound(plan.layout(32), cost) <= step * (1 + 1e-9), plan


def _best(evaluated):
    return [(e.plan, e.samples_per_s) for e in rank(evaluated)[:EXACT_TOP]]


def test_plans_left_unsimulated_are_never_among_the_best(monkeypatch):
    """The ten best of all plans simulated are those of the plans ``evaluate_many`` simulates,
    which leaves some out; a bound that overstates (here tripled) loses some of them, so the
    comparison would see a rule that discards a plan it should keep."""
    cost, plans = _cost(memory_bytes=40_000), _cases()
    every = [evaluate(cost, p, 32) for p in plans]
    some = evaluate_many(cost, plans, 32, keep=EXACT_TOP)
    assert len(some) < len(every)
    assert _best(some) == _best(every)
    one = evaluate_many(cost, plans, 32, keep=1)
    assert _best(one)[0] == _best(every)[0] and len(one) < len(some)
    real = plans_module.lower_bound
    monkeypatch.setattr(plans_module, "lower_bound", lambda layout, c: 3 * real(layout, c))
    assert _best(evaluate_many(cost, plans, 32, keep=EXACT_TOP)) != _best(every)


def test_known_plans_count_toward_the_best_kept():
    cost, plans = _cost(memory_bytes=40_000), _cases()
    every = [evaluate(cost, p, 32) for p in plans]
    best = rank(every)[0]
    rest = evaluate_many(cost, plans, 32, keep=1, known=[best])
    assert len(rest) <= len(evaluate_many(cost, plans, 32, keep=1))
    assert _best([best, *rest])[0] == _best(every)[0]


@pytest.mark.parametrize("sync", ["flat", "hierarchical"])
def test_a_run_shared_by_two_syncs_gives_what_each_simulated_alone(sync):
    cost = _cost()
    plan = Plan((2, 1), 2, (0, 2), 4, 4, grad_sync=sync, tp=(1, 2))
    other = Plan((2, 1), 2, (0, 2), 4, 4, grad_sync="flat" if sync != "flat" else "hierarchical")
    other = Plan(**{**vars(other), "tp": (1, 2)})
    runs: dict = {}
    evaluate(cost, other, 16, runs=runs)
    shared = evaluate(cost, plan, 16, runs=runs)
    alone = evaluate(cost, plan, 16)
    assert len(runs) == 1 and shared.sim.step_time == alone.sim.step_time
    assert shared.sim.sync == alone.sim.sync
