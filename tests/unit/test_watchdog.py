"""bundle/watchdog.py: a training process that stops moving for the limit reports where, once,
and ends; NCCL's groups time out after it, so that it reports first."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from bundle.launch import process
from bundle.runtime import store as job_store
from bundle.runtime.groups import ProcessGroups
from bundle.runtime.phase import Phase
from bundle.runtime.watchdog import NCCL_GRACE_S, StepWatchdog, group_timeout, watch_limit
from bundle.topology import Topology

ME = "rank 2 (node 0, bundle 0, stage 1, replica 1)"


def _dog(positions, limit=30.0):
    now = [0.0]
    posted, exits = [], []
    dog = StepWatchdog(
        me=ME,
        position=lambda: positions[0],
        limit=limit,
        report=posted.append,
        exit=exits.append,
        clock=lambda: now[0],
    )
    return dog, now, posted, exits


def test_a_position_that_never_changes_is_reported_once_and_ends_the_process():
    positions = ["step 3 recv_act1"]
    dog, now, posted, exits = _dog(positions)
    for t in (0.0, 10.0, 29.9):
        now[0] = t
        assert not dog.check()
    now[0] = 30.0
    assert dog.check()
    assert posted == [f"{ME} stalled at step 3 recv_act1: no progress in 30s"]
    assert exits == [1]
    now[0] = 100.0
    assert not dog.check() and len(posted) == 1  # once


def test_progress_restarts_the_clock():
    positions = ["step 3 recv_act1"]
    dog, now, posted, exits = _dog(positions)
    for t in range(0, 300, 20):
        now[0] = float(t)
        positions[0] = f"step {t} forward0"
        dog.check()
    assert posted == [] and exits == []


def test_start_up_restore_and_saves_are_not_watched_and_stop_disarms():
    for at in (None, "set-up", "resume", "checkpoint after step 4", "checkpoint"):
        dog, now, posted, exits = _dog([at])
        dog.check()
        now[0] = 1e6
        assert not dog.check() and not posted and not exits, at
    dog, now, posted, exits = _dog(["evaluation after step 4, batch 2 of 9"])
    dog.check()
    dog.stop()
    now[0] = 1e6
    assert not dog.check() and not posted


def test_nccl_groups_time_out_after_the_watchdog_gloo_groups_before_it():
    assert group_timeout("nccl", 5) == timedelta(seconds=5 + NCCL_GRACE_S)
    assert watch_limit("nccl", 5) == 5
    # gloo: the transport's timed waits (at 5 s, naming the peer), then the groups, then the dog
    assert (
        timedelta(seconds=5) < group_timeout("gloo", 5) < timedelta(seconds=watch_limit("gloo", 5))
    )


def test_the_worker_watchdog_posts_the_abort_to_the_store_and_exits():
    """The process's wiring: the position read from its phase, the line posted to the store
    (the other processes' abort watches stop them), exit code 1."""
    store = dist.HashStore()
    exited = threading.Event()
    codes = []

    def exit(code):
        codes.append(code)
        exited.set()

    phase = Phase()
    dog = process.start_step_watchdog(store, ME, phase, "nccl", 0.3, exit=exit)
    try:
        assert not exited.wait(1.0)  # no engine yet: start-up is not watched
        phase.follow(SimpleNamespace(position="step 3 recv_act1"))
        phase.training()
        assert exited.wait(5.0)
    finally:
        dog.stop()
    assert codes == [1]
    assert job_store.read_abort(store) == f"{ME} stalled at step 3 recv_act1: no progress in 0.3s"


def test_every_sub_group_gets_the_timeout(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(kw) or object())
    topo = Topology(shape=(2, 1), num_bundles=2, procs_per_node=6, global_batch=8, micro_batches=2)
    ProcessGroups.build(topo, topo.coord(0), hierarchical=True, async_save=True, timeout=7)
    assert len(made) == 2 + 2 + 2 * 2 + 2  # control, async; stage, bundle and masters groups
    gloo = [kw["timeout"] for kw in made if kw.get("backend") == "gloo"]
    training = [kw["timeout"] for kw in made if "backend" not in kw]
    assert gloo == [group_timeout("gloo", 7)] * 2
    assert training == [timedelta(seconds=7 + NCCL_GRACE_S)] * 8
