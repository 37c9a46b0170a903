"""bundle/launch/supervisor.py and liveness.py: how an attempt of a node's workers ends, from
their exit codes, their signs of life and the job's store, with fake workers (no processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bundle.launch.liveness import frozen, frozen_limit, unless_paused
from bundle.launch.process import beat
from bundle.launch.supervisor import End, Outcome, watch


class Worker:
    """Exits with ``code`` after ``polls`` looks (None: runs until the test ends)."""

    def __init__(self, code: int | None, polls: int = 0, pid: int | None = None) -> None:
        self.code, self.polls, self.sentinel, self.pid = code, polls, 0, pid

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


def test_a_stopped_worker_is_named_before_its_peers_time_out():
    """Rank 1's beats stopped 4 s ago (SIGSTOP): it is the failure, with its process state;
    rank 0 beat just now, rank 2 has not beaten yet (start-up): neither is named."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        procs = {0: Worker(None, pid=os.getpid()), 1: Worker(None, pid=child.pid), 2: Worker(None)}
        beats = {0: 99.5, 1: 96.0, 2: 0.0}
        posted = []
        post = lambda r, m: posted.append(m) or posted[0]  # noqa: E731
        got = frozen(
            procs, beats.__getitem__, lambda r: f"rank {r}", 3.0, post, clock=lambda: 100.0
        )
        assert got == (
            "rank 1 stopped responding: no sign of life for 4s "
            "(its process is stopped (SIGSTOP or Ctrl-Z))"
        )
        beats[1] = 98.0  # within the limit: nothing to say
        assert frozen(procs, beats.__getitem__, str, 3.0, post, clock=lambda: 100.0) is None
        procs[1].code = 0  # a worker that exited is watched by its exit code, not its beats
        beats[1] = 50.0
        assert frozen(procs, beats.__getitem__, str, 3.0, post, clock=lambda: 100.0) is None
    finally:
        child.kill()
        child.wait()
    assert frozen_limit(5.0) == 3.0 and frozen_limit(600.0) == 300.0


def test_a_worker_beats_while_its_main_thread_waits():
    class Shared:
        value = 0.0

    alive = Shared()
    beat(alive, every=0.01)
    time.sleep(0.2)  # the main thread blocks, as in a collective: the beats go on
    assert time.monotonic() - alive.value < 0.1


def test_a_job_stopped_and_continued_as_a_whole_is_not_a_frozen_worker():
    """Ctrl-Z stops the supervisor with its workers: the first look after they continue comes
    long after the previous one and is skipped (the beats are stale for that reason alone)."""
    now, calls = [0.0], []
    look = unless_paused(lambda: calls.append(now[0]), 1.5, clock=lambda: now[0])
    for t in (0.5, 1.0, 60.0, 60.5):
        now[0] = t
        look()
    assert calls == [0.5, 1.0, 60.5]


def _start_method(rank: int, world: int) -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


def test_a_forked_worker_starts_its_own_children_as_its_parent_would():
    """A child of the forkserver would start its loader workers through the forkserver too, and
    they would outlive it (torch's loader workers watch for their parent's death): it takes the
    start method, environment and directory of the process that asked for it."""
    import multiprocessing

    from bundle.launch.localworld import run_world

    assert run_world(1, _start_method) == [multiprocessing.get_start_method()]


def test_a_worker_forked_from_the_preloaded_forkserver_imports_nothing_more_of_torch_to_train():
    """What a worker's first optimizer imports (torch._dynamo, 2.5 s of CPU) is in PRELOAD, so
    each worker forked from the forkserver starts with it instead of importing it again."""
    from bundle.launch import localworld, process

    for preload in (process.PRELOAD, localworld.PRELOAD):
        probe = (
            f"import importlib, sys, torch\n"
            f"for m in {preload!r}: importlib.import_module(m)\n"
            "before = set(sys.modules)\n"
            "w = torch.nn.Parameter(torch.zeros(2))\n"
            "torch.optim.SGD([w], lr=0.1).step(); torch.optim.AdamW([w]).step()\n"
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.strip() == "[]", out.stdout
