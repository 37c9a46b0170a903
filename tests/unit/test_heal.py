"""A node supervisor's side of --fault-tolerance bundle (bundle.launch.ft.heal), with fake workers
and a ``HashStore``: a lost bundle marked, started again once all its workers exited, given up
when no heal is left."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from bundle.launch import nodes, supervisor
from bundle.launch.ft.heal import Healer
from bundle.launch.ft.membership import mark_dead
from bundle.runtime import keys
from bundle.runtime.store import read_abort
from bundle.topology import Topology

JOB = Topology(shape=(1, 1), num_bundles=3, procs_per_node=6, global_batch=12, micro_batches=1)


def _store():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    return store


class _Proc:
    def __init__(self, rank: int) -> None:
        self.pid, self.killed, self.exitcode = 1000 + rank, False, None

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9


def test_the_supervisor_marks_a_lost_bundle_and_starts_it_again_once_all_its_workers_exited():
    store = _store()
    started: list[tuple[int, int]] = []

    def start(rank: int, inc: int, handed=None) -> _Proc:
        started.append((rank, inc))
        return _Proc(rank)

    healer = Healer(JOB, 0, store, heals=1, start=start)
    assert healer.lose(3, "rank 3 was killed by SIGKILL during step 4") is None
    assert store.get(keys.dead(1)).decode() == "rank 3 was killed by SIGKILL during step 4"
    assert healer.restart(3) == {}  # rank 2 of bundle 1 still runs
    assert healer.lose(2, "") is None  # it left with its bundle (exit code 3)
    new = healer.restart(2)
    assert sorted(new) == [2, 3] and started == [(2, 1), (3, 1)]
    assert store.get(keys.healing(1)).decode() == "1"
    # The healed bundle fails again: marked under incarnation 1; no heal left.
    procs = {3: _Proc(3)}
    assert healer.frozen(procs)(3, "rank 3 stopped responding") is None and procs[3].killed
    assert store.check([keys.dead(1, 1)])
    healer.lose(2, "")
    assert healer.restart(2) == {} and len(started) == 2


def test_a_dead_bundles_other_processes_are_killed_at_once_and_only_theirs():
    # Over NCCL a survivor of the dead bundle can wait on its lost peer until its own watchdog
    # reports a stall, which would fail the job (seen on a GPU): its supervisor kills it.
    store = _store()
    healer = Healer(JOB, 0, store, heals=1, start=lambda r, i, h: _Proc(r))
    procs = {r: _Proc(r) for r in range(6)}
    healer.reap(procs)
    assert not any(p.killed for p in procs.values())  # nothing marked
    procs[3].exitcode = -9
    healer.lose(3, "rank 3 was killed by SIGKILL during step 4")
    healer.reap(procs)
    assert [r for r, p in procs.items() if p.killed] == [2]
    # Marked by another node's supervisor (or by a process that left): the same.
    procs[2].killed = False
    mark_dead(store, 2, 0, "rank 5 (node 1) was killed")
    healer.reap(procs)
    assert sorted(r for r, p in procs.items() if p.killed) == [4, 5]


def test_every_bundle_lost_without_heals_fails_the_job():
    store = _store()
    healer = Healer(JOB, 0, store, heals=0, start=lambda r, i, h: None)
    assert healer.lose(1, "rank 1 killed") is None and healer.lose(3, "rank 3 killed") is None
    assert healer.lose(5, "rank 5 killed") == "every bundle failed (the last: rank 5 killed)"


# Two nodes of three processes: node 0 runs bundle 0 and bundle 1's front, node 1 bundle 1's
# rear and bundle 2.
TWO_NODES = Topology(
    shape=(1, 1), num_bundles=3, procs_per_node=3, global_batch=12, micro_batches=1
)


def test_a_silent_node_takes_its_bundles_out_for_good_and_node_0_stops_waiting_for_it():
    store, base = _store(), _store()
    healer = Healer(TWO_NODES, 0, store, heals=1, start=lambda r, i, h: _Proc(r))
    beats: dict[int, tuple[int, float]] = {}
    lose = healer.lose_node
    assert nodes.heartbeat(base, store, 0, 2, beats, lose) is None  # node 1 seen at 0
    beats[1] = (beats[1][0], time.monotonic() - 60)  # ... and silent since
    assert nodes.heartbeat(base, store, 0, 2, beats, lose, stale_s=90) is None
    assert not store.check([keys.dead(1)])  # silent for less than stale_s: still in
    assert nodes.heartbeat(base, store, 0, 2, beats, lose) is None  # not the job's end
    why = "node 1 stopped responding for 20s"
    assert store.get(keys.dead(1)).decode() == why and store.get(keys.dead(2)).decode() == why
    assert not store.check([keys.dead(0)]) and read_abort(store) is None
    assert nodes.heartbeat(base, store, 0, 2, beats, lose) is None  # once
    # Bundle 1's front (rank 2, node 0) leaves with its bundle and is not started again.
    assert healer.lose(2, "") is None and healer.restart(2) == {}
    # Node 0 finishes without node 1's "done".
    store.set("bundle/done/0", "1")
    assert nodes.wait_done(store, 2, timeout=5.0) is None
    # Bundle 0 could still be healed: the job goes on; without heals it would be over.
    assert healer.lose(0, "rank 0 killed") is None
    ended = Healer(TWO_NODES, 0, store, heals=0, start=lambda r, i, h: _Proc(r))
    assert ended.lose(1, "rank 1 killed") == "every bundle failed (the last: rank 1 killed)"


def test_without_bundle_fault_tolerance_a_silent_node_fails_the_job():
    store, base = _store(), _store()
    beats: dict[int, tuple[int, float]] = {}
    nodes.heartbeat(base, store, 0, 2, beats)
    beats[1] = (beats[1][0], time.monotonic() - 60)
    assert nodes.heartbeat(base, store, 0, 2, beats) == "node 1 stopped responding for 20s"
    assert read_abort(store) == "node 1 stopped responding for 20s"


def test_node_0_finds_a_node_silent_while_it_waits_for_the_others_to_finish():
    """Training may end before the heartbeat marked the node (the survivors dropped its bundles
    after twice --timeout): node 0's wait for the others keeps the heartbeat going."""
    store, base = _store(), _store()
    healer = Healer(TWO_NODES, 0, store, heals=0, start=lambda r, i, h: _Proc(r))
    beats: dict[int, tuple[int, float]] = {}
    nodes.heartbeat(base, store, 0, 2, beats, healer.lose_node)
    beats[1] = (beats[1][0], time.monotonic() - 60)
    store.set("bundle/done/0", "1")

    def heartbeat():
        return nodes.heartbeat(base, store, 0, 2, beats, healer.lose_node)

    assert nodes.wait_done(store, 2, timeout=5.0, check=heartbeat) is None
    assert store.check([keys.dead(1), keys.dead(2)])
    # Without the heartbeat it would wait for node 1 to the end.
    assert nodes.wait_done(_store(), 2, timeout=0.3) == (
        "not every node reported completion within 0s"
    )


def test_a_restart_counts_the_committed_steps_it_trains_again(monkeypatch):
    """The step in progress (0-based ``reached``: as many as were committed) less the step the
    checkpoint holds; from scratch, every committed step."""
    monkeypatch.setattr(supervisor.ckpt, "read_info", lambda path: {"step": path.split("-")[-1]})
    assert supervisor._trained_again(150, "ckpt/step-100") == 50
    assert supervisor._trained_again(6, "ckpt/step-6") == 0
    assert supervisor._trained_again(6, None) == 6
    assert supervisor._trained_again(-1, None) == 0  # failed before its first step
