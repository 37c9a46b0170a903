"""A profile records the conditions it was measured under; the cache passes over (and never keeps)
one measured while the process was crowded out, on a busy machine, or with scattered repetitions,
and says which entries a plan used. Fake clocks and loads: nothing here depends on this machine."""

from __future__ import annotations

import json
import sys
import time

import pytest

from bundle.plan import conditions as cond
from bundle.plan import profile as prof
from bundle.plan.conditions import Conditions, Watch

QUIET = Conditions(1000.0, 0.3, 2, 0.99, 0.02, "2.14.1", "cpu:x:1 thread(s)", 1)


def _with(**kw) -> Conditions:
    return Conditions(**{**QUIET.to_json(), **kw})


def test_what_makes_a_measurement_untrustworthy():
    assert QUIET.trouble() is None
    assert "got 40% of the CPU time" in _with(cpu_share=0.4, load=9.0).trouble()
    assert _with(load=9.0).trouble() is None  # the process got its CPU: the load lags behind
    assert _with(cpu_share=None, load=9.0).trouble() == "load average 9.0 on 2 CPU(s)"
    assert _with(cpu_share=None, load=1.5).trouble() is None
    assert "repetitions spread 40%" in _with(spread=0.4).trouble()
    text = QUIET.describe(now=1000.0 + 2 * 3600)
    assert text.startswith("measured 2 h ago, load 0.3 on 2 CPU(s), 99% of the CPU")
    assert cond.spread([1.0, 1.0, 1.0, 1.0, 1.0]) == 0.0
    assert cond.spread([1.0, 2.0, 2.0, 2.0, 3.0]) == pytest.approx(0.0)  # the ends do not count
    assert cond.spread([1.0, 1.0, 2.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert cond.spread([1.0, 2.0]) is None


def test_the_share_is_time_on_a_cpu_against_time_waiting_for_one():
    reads = iter([{"1": (0, 0)}, {"1": (int(1e9), int(1e9)), "2": (int(1e9), 0)}])
    with Watch(load=lambda: 9.0, sched=lambda: next(reads), clock=lambda: 5.0) as w:
        w.repeats([1.0, 1.0, 1.1, 1.2, 1.2])
    seen = w.conditions("cpu:x", 2, "2.14.1")
    assert seen.cpu_share == pytest.approx(2 / 3, abs=1e-3) and seen.load == 9.0
    assert seen.measured_at == 5.0 and seen.spread == pytest.approx(0.2 / 1.1, abs=1e-3)
    assert "got 67% of the CPU time" in seen.trouble()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's schedstat")
def test_this_machine_reports_a_share():
    with Watch() as w:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    assert 0.0 < w.share() <= 1.0


def test_the_cache_uses_a_good_entry_and_says_so(tmp_path):
    cache = prof.ProfileCache(tmp_path)
    cache.put("timings", {"model": "m"}, {"v": 1}, QUIET)
    assert cache.get("timings", {"model": "m"}, now=1000.0 + 90) == {"v": 1}
    put, note = cache.notes  # every profile a plan uses is named, with its conditions
    assert put.startswith("timings profile measured now, load 0.3 on 2 CPU(s), 99% of the CPU")
    assert note.startswith("timings profile from the cache, measured 2 min ago, load 0.3")
    assert str(tmp_path) in note


def test_a_poor_measurement_is_not_cached_and_a_poor_entry_is_measured_again(tmp_path):
    cache = prof.ProfileCache(tmp_path)
    cache.put("timings", {"model": "m"}, {"v": 1}, _with(cpu_share=0.3))
    assert not list(tmp_path.iterdir())
    assert "not cached, and plans made from it may be off" in cache.notes[-1]
    # An entry written under load by an older release (or by hand): passed over, by name.
    cache.put("timings", {"model": "m"}, {"v": 1}, QUIET)
    (path,) = tmp_path.iterdir()
    doc = json.loads(path.read_text())
    doc["conditions"]["cpu_share"] = 0.3
    path.write_text(json.dumps(doc))
    assert cache.get("timings", {"model": "m"}) is None
    assert cache.notes[-1] == (
        f"timings profile {path} not used: measured while the process got 30% of the CPU time "
        "it was ready to use (load average 0.3 on 2 CPU(s))"
    )


def test_reprofile_measures_afresh_and_counted_entries_need_no_conditions(tmp_path):
    cache = prof.ProfileCache(tmp_path)
    cache.put("timings", {"model": "m"}, {"v": 1}, QUIET)
    cache.put("anatomy", {"model": "m"}, {"blocks": 3})
    fresh = prof.ProfileCache(tmp_path, refresh=True)
    assert fresh.get("timings", {"model": "m"}) is None
    assert "measured afresh (--reprofile)" in fresh.notes[-1]
    assert prof.ProfileCache(tmp_path).get("anatomy", {"model": "m"}) == {"blocks": 3}


def test_timings_measured_on_a_crowded_machine_are_measured_again_next_time(tmp_path, monkeypatch):
    calls = []
    real = prof.measure_timings

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    busy = iter([{"1": (0, 0)}, {"1": (int(1e8), int(4e8))}] * 2 + [{"1": (0, 0)}] * 4)
    monkeypatch.setattr(prof, "measure_timings", counted)
    monkeypatch.setattr(prof, "Watch", lambda: Watch(load=lambda: 0.0, sched=lambda: next(busy)))
    cache = prof.ProfileCache(tmp_path)
    args = (prof.ModelSpec("mlp", (3, 2, 2), 10), cache)
    for _ in range(2):  # crowded out (20% of the CPU): used for this plan, never kept
        prof.timings(*args, rows=(1,), repeats=1)
    assert len(calls) == 2 and not list(tmp_path.glob("timings-*"))
    assert "got 20% of the CPU time" in cache.notes[-1]
    for _ in range(2):  # quiet: kept, then read
        prof.timings(*args, rows=(1,), repeats=1)
    assert len(calls) == 3 and cache.notes[-1].startswith("timings profile from the cache")
