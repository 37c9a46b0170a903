"""The measured slowdown of CPU-share devices (bundle/plan/shares.py) and where the cost model
uses it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bundle.launch import throttle
from bundle.plan import mixed, shares
from bundle.plan import profile as prof
from bundle.plan.cluster import DeviceType
from bundle.plan.conditions import Watch
from bundle.plan.mixed import uniform_cost
from bundle.plan.plans import evaluate
from tests.support.plan_fixtures import literal_cost

INF = float("inf")


def _cost(penalties=(1.0, 1.0)):
    """One block of 1 s forward and 2 s backward per row; a node of a 0.5 and a 0.25 CPU share."""
    cost = literal_cost([1.0], [2.0])
    types = (
        DeviceType("half", "half", INF, None, 0.5, penalties[0]),
        DeviceType("quarter", "quarter", INF, None, 0.25, penalties[1]),
    )
    cluster = replace(cost.cluster, devices_per_node=2, types=types, kinds=(("half", "quarter"),))
    return cost.like(cluster)


def test_a_penalty_slows_compute_beyond_the_share():
    free, held = _cost(), _cost((1.2, 1.5))
    assert free.on("half").forward(0, 1, 1) == pytest.approx(2.0)
    assert held.on("half").forward(0, 1, 1) == pytest.approx(2.0 * 1.2)
    assert held.on("quarter").backward(0, 1, 1, recompute=False) == pytest.approx(8.0 * 1.5)
    assert held.on("quarter").host(1.0) == pytest.approx(4.0 * 1.5)  # the engine's own work too
    # The plan chosen as if devices were alike: the average share, slowed by the average penalty.
    assert uniform_cost(held, 1, 2).forward(0, 1, 1) == pytest.approx(1.35 / 0.375)


def _cache_with(tmp_path, cluster, penalties):
    """A profile cache that already holds ``penalties`` for ``cluster``'s devices (no measuring)."""
    cache = prof.ProfileCache(tmp_path)
    calls = []

    def fake(shares_, hierarchy):
        calls.append(list(shares_))
        return penalties

    return cache, calls, fake


def test_penalties_are_measured_once_per_set_of_shares_and_cached(tmp_path, monkeypatch):
    cluster = _cost().cluster
    cache, calls, fake = _cache_with(tmp_path, cluster, [1.1, 1.3])
    monkeypatch.setattr(shares, "measure", fake)
    monkeypatch.setattr(throttle, "find", lambda: throttle.Hierarchy(1, tmp_path))
    # A quiet machine, whatever runs beside the test (test_plan_conditions judges the readings).
    monkeypatch.setattr(shares, "Watch", lambda sched: Watch(load=lambda: 0.0, sched=sched))
    got = shares.with_penalties(cluster, cache)
    assert [t.penalty for t in got.types] == [1.1, 1.3]
    assert calls == [[0.5, 0.25]]
    again = shares.with_penalties(cluster, prof.ProfileCache(tmp_path))
    assert [t.penalty for t in again.types] == [1.1, 1.3]
    assert calls == [[0.5, 0.25]]  # read from the cache, not measured again


def test_a_type_takes_the_median_of_its_devices(tmp_path, monkeypatch):
    cluster = _cost().cluster
    cluster = replace(cluster, devices_per_node=4, kinds=(("half", "quarter", "half", "half"),))
    cache, _, fake = _cache_with(tmp_path, cluster, [1.1, 1.4, 1.5, 1.2])
    monkeypatch.setattr(shares, "measure", fake)
    monkeypatch.setattr(throttle, "find", lambda: throttle.Hierarchy(1, tmp_path))
    got = shares.with_penalties(cluster, cache)
    assert [t.penalty for t in got.types] == [1.2, 1.4]


def test_without_cgroups_nothing_is_measured_and_a_note_says_so(tmp_path, monkeypatch):
    cluster = _cost().cluster
    cache = prof.ProfileCache(tmp_path)
    monkeypatch.setattr(throttle, "find", lambda: "no writable cgroup cpu controller")
    got = shares.with_penalties(cluster, cache)
    assert got == cluster
    assert cache.notes == [
        "CPU shares' slowdown not measured (no writable cgroup cpu controller): penalty 1.0 assumed"
    ]


def test_devices_without_a_share_are_not_measured(tmp_path, monkeypatch):
    cost = literal_cost([1.0], [2.0])
    monkeypatch.setattr(shares, "measure", lambda *a: pytest.fail("measured"))
    assert shares.with_penalties(cost.cluster, prof.ProfileCache(tmp_path)) == cost.cluster


def test_each_round_is_judged_against_the_free_step_timed_before_it(monkeypatch):
    """The machine slows down twofold between two rounds, free and held processes alike: the
    penalty is the held time over the free time of the same round (1.0 and 1.25 here), not
    over the fastest free time of the measurement (which would say 1.5 and 1.875)."""
    free, quarter, half = [1.0, 2.0, 2.0], [4.0, 8.0, 8.0], [2.5, 5.0, 5.0]
    monkeypatch.setattr(shares, "_rounds", lambda s, h: (free, [quarter, half]))
    assert shares.measure([0.25, 0.5], None) == [1.0, 1.25]


@pytest.mark.skipif(throttle.available() is not None, reason=str(throttle.available()))
def test_measured_under_real_quotas(monkeypatch):
    """Two children held to a quarter of a CPU each: each computes at most a quarter as fast as a
    free process (a penalty of at least 1), and not absurdly slower."""
    monkeypatch.setattr(shares, "WINDOW_S", 0.3)
    monkeypatch.setattr(shares, "ROUNDS", 2)
    found = throttle.find()
    assert not isinstance(found, str)
    got = shares.measure([0.25, 0.25], found)
    assert len(got) == 2
    assert all(1.0 <= p < 3.0 for p in got), got
    assert not list(found.parent.glob("bundle-penalty-*"))  # its cgroups removed


def test_a_plan_that_leaves_devices_waiting_meets_less_of_the_penalty():
    """Even rows on a 0.5 and a 0.25 share (penalty 1.4 each, measured with both busy): the half
    share computes 8.4 s of a 16.8 s step, so the machine is busy (0.5 x 0.5 + 0.25 x 1) / 0.75
    = 2/3 of what the penalty was measured at, and the penalty's excess shrinks to 2/3 of 0.4."""
    cost = _cost((1.4, 1.4))
    even = evaluate(cost, mixed.data_parallel(cost, 1, 2, 2, weighted=False), 2)
    assert even.sim.step_time == pytest.approx(12.0 * 1.4)
    eased = mixed.contended(cost, even, 2)
    assert eased.sim.step_time == pytest.approx(12.0 * (1.0 + 0.4 * 2 / 3))
    # Rows 2:1 keep both busy the whole step: the penalty as measured.
    weighted = evaluate(cost, mixed.data_parallel(cost, 1, 2, 3, weighted=True), 3)
    assert weighted.sim.step_time == pytest.approx(12.0 * 1.4)
    assert mixed.contended(cost, weighted, 3).sim.step_time == pytest.approx(12.0 * 1.4)
    # Without penalties nothing is simulated again.
    free = evaluate(_cost(), mixed.data_parallel(_cost(), 1, 2, 2, weighted=False), 2)
    assert mixed.contended(_cost(), free, 2) is free
