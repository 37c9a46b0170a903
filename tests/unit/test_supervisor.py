"""bundle/runtime/supervisor.py: how an attempt of a node's workers ends, from their exit codes
and the job's store, with fake workers (no processes)."""

from __future__ import annotations

import signal

from bundle.runtime.supervisor import End, Outcome, watch


class Worker:
    """Exits with ``code`` after ``polls`` looks (None: runs until the test ends)."""

    def __init__(self, code: int | None, polls: int = 0) -> None:
        self.code, self.polls, self.sentinel = code, polls, 0

    @property
    def exitcode(self) -> int | None:
        if self.code is None or self.polls > 0:
            self.polls -= 1
            return None
        return self.code


def _watch(procs, *, failure=None, steps=None):
    posted = []

    def post(message: str) -> str:
        posted.append(message)
        return posted[0]  # the job's first failure wins

    outcome = watch(
        procs,
        step_of=lambda rank: (steps or {}).get(rank, -1),
        describe=lambda rank: f"rank {rank}",
        check=lambda: failure,
        post=post,
        wait=lambda fds, s: None,
    )
    return outcome, posted


def test_every_worker_exiting_0_is_done():
    assert _watch({0: Worker(0), 1: Worker(0, polls=3)}) == (Outcome(End.DONE), [])


def test_workers_stopped_by_a_signal_make_a_stopped_attempt():
    term, intr = 128 + signal.SIGTERM, 128 + signal.SIGINT
    outcome, posted = _watch({0: Worker(term), 1: Worker(intr, polls=2), 2: Worker(0)})
    assert outcome == Outcome(End.STOPPED, signum=max(signal.SIGTERM, signal.SIGINT))
    assert posted == []


def test_a_worker_that_dies_is_posted_with_its_rank_and_step():
    procs = {0: Worker(None), 1: Worker(-signal.SIGKILL, polls=1)}
    outcome, posted = _watch(procs, steps={1: 6})
    assert posted == ["rank 1 was killed by SIGKILL during step 7"]
    assert outcome == Outcome(End.FAILED, why=posted[0])
    outcome, posted = _watch({0: Worker(3)})
    assert posted == ["rank 0 exited with code 3 during start-up"]


def test_a_failure_elsewhere_in_the_job_ends_the_attempt():
    outcome, posted = _watch({0: Worker(None)}, failure="node 1 stopped responding for 20s")
    assert outcome == Outcome(End.FAILED, why="node 1 stopped responding for 20s")
    assert posted == []
