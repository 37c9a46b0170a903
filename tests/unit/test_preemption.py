"""bundle/runtime/preemption.py: the stop vote agrees on one signal for the whole job, read after
the step it was cast in (a fake all-reduce stands in for the control group)."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

from bundle.runtime import preemption
from bundle.runtime.preemption import StopRequest, StopVote


class Job:
    """Every rank's vote flag, combined with MAX when all have voted (one all-reduce)."""

    def __init__(self, ranks: int) -> None:
        self.flags: list[torch.Tensor] = []
        self.ranks = ranks

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.flags.append(tensor)
        job = self

        class Work:
            def wait(self, timeout=None) -> bool:
                top = max(int(f.item()) for f in job.flags)
                tensor.fill_(top)
                return True

        return Work()


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(monkeypatch):
    job = Job(3)
    monkeypatch.setattr(preemption.dist, "all_reduce", job.all_reduce)
    requests = [StopRequest() for _ in range(3)]
    votes = [StopVote(r, group=None, timeout=5.0) for r in requests]
    decided = []
    for step in range(4):
        if step == 2:
            requests[1].signum = signal.SIGTERM  # arrives on rank 1 during step 2
        job.flags = []
        for v in votes:
            v.begin()
        decided.append([v.decided() for v in votes])
    assert decided == [[0, 0, 0], [0, 0, 0], [signal.SIGTERM] * 3, [signal.SIGTERM] * 3]


def test_the_vote_carries_the_strongest_signal(monkeypatch):
    job = Job(2)
    monkeypatch.setattr(preemption.dist, "all_reduce", job.all_reduce)
    requests = [StopRequest(), StopRequest()]
    requests[0].signum, requests[1].signum = signal.SIGINT, signal.SIGTERM
    votes = [StopVote(r, group=None, timeout=5.0) for r in requests]
    for v in votes:
        v.begin()
    assert {v.decided() for v in votes} == {max(signal.SIGINT, signal.SIGTERM)}


def test_the_stop_vote_agrees_on_the_flags_every_process_raised():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        vote = StopVote(StopRequest(), dist.group.WORLD, 5.0, asks=lambda: [0, 1, 0])
        vote.begin()
        assert vote.decided() == 0 and vote.agreed() == [1]
    finally:
        dist.destroy_process_group()


def test_a_vote_cast_at_the_commit_is_cast_and_waited_for_there():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        vote = StopVote(StopRequest(), dist.group.WORLD, 5.0, asks=lambda: [1], at_commit=True)
        vote.begin()
        with pytest.raises(RuntimeError, match="before the vote was cast"):
            vote.decided()  # a step whose engine never reached its commit
        vote.commit(0)
        assert vote.decided() == 0 and vote.agreed() == [0]
    finally:
        dist.destroy_process_group()
