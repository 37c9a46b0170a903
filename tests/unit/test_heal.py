"""A node supervisor's side of --fault-tolerance bundle (bundle.launch.heal), with fake workers
and a ``HashStore``: a lost bundle marked, started again once all its workers exited, given up
when no heal is left."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from bundle.launch.heal import Healer
from bundle.launch.membership import dead_key, healing_key
from bundle.topology import Topology

JOB = Topology(shape=(1, 1), num_bundles=3, procs_per_node=6, global_batch=12, micro_batches=1)


def _store():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    return store


class _Proc:
    def __init__(self, rank: int) -> None:
        self.pid, self.killed = 1000 + rank, False

    def kill(self) -> None:
        self.killed = True


def test_the_supervisor_marks_a_lost_bundle_and_starts_it_again_once_all_its_workers_exited():
    store = _store()
    started: list[tuple[int, int]] = []

    def start(rank: int, inc: int) -> _Proc:
        started.append((rank, inc))
        return _Proc(rank)

    healer = Healer(JOB, 0, store, heals=1, start=start)
    assert healer.lose(3, "rank 3 was killed by SIGKILL during step 4") is None
    assert store.get(dead_key(1)).decode() == "rank 3 was killed by SIGKILL during step 4"
    assert healer.restart(3) == {}  # rank 2 of bundle 1 still runs
    assert healer.lose(2, "") is None  # it left with its bundle (exit code 3)
    new = healer.restart(2)
    assert sorted(new) == [2, 3] and started == [(2, 1), (3, 1)]
    assert store.get(healing_key(1)).decode() == "1"
    # The healed bundle fails again: marked under incarnation 1; no heal left.
    procs = {3: _Proc(3)}
    assert healer.frozen(procs)(3, "rank 3 stopped responding") is None and procs[3].killed
    assert store.check([dead_key(1, 1)])
    healer.lose(2, "")
    assert healer.restart(2) == {} and len(started) == 2


def test_every_bundle_lost_without_heals_fails_the_job():
    store = _store()
    healer = Healer(JOB, 0, store, heals=0, start=lambda r, i: None)
    assert healer.lose(1, "rank 1 killed") is None and healer.lose(3, "rank 3 killed") is None
    assert healer.lose(5, "rank 5 killed") == "every bundle failed (the last: rank 5 killed)"
