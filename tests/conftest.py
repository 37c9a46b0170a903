"""Fixtures every tier shares, and the session's end: what tests left running is ended
(``tests.support.leftovers``); the helpers themselves live in tests/support/."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from bundle.config import RunConfig
from tests.support import leftovers
from tests.support.config import make_config

_EXIT_GRACE_S = 30.0
_STATUS = pytest.StashKey[int]()
_START = pytest.StashKey[tuple[float, tuple[int, int] | None]]()


def pytest_configure(config: pytest.Config) -> None:
    leftovers.mark_session()
    config.stash[_START] = (time.monotonic(), _cpu_jiffies())


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, all) clock ticks of every CPU of the machine since boot (None: not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # all but idle and iowait


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The suite's cost: wall time, and the CPU time the machine spent meanwhile (this suite and
    everything it started, and whatever else ran beside it) as core-seconds and a share."""
    if hasattr(config, "workerinput") or _START not in config.stash:
        return
    t0, cpu0 = config.stash[_START]
    wall, cpu1 = time.monotonic() - t0, _cpu_jiffies()
    line = f"suite: {wall:.0f} s wall"
    if cpu0 is not None and cpu1 is not None and cpu1[1] > cpu0[1]:
        cores = os.cpu_count() or 1
        busy = (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
        line += f"; CPU {busy * wall * cores:.0f} core-s ({busy:.0%} of {cores} cores busy)"
    terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Processes a test left running are named and killed (by id) before the summary."""
    session.config.stash[_STATUS] = int(exitstatus)
    if session.config.pluginmanager.hasplugin("dsession"):
        return  # pytest-xdist's controller runs no test: each worker ends what its tests left
    ended = leftovers.end_processes()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if ended and reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(f"killed {len(ended)} process(es) that tests left running:", red=True)
        for line in ended:
            reporter.write_line(f"  {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """A thread that would keep the interpreter open is named, and the suite exits anyway."""
    deadline = time.monotonic() + _EXIT_GRACE_S
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(max(deadline - time.monotonic(), 0.0))
    stuck = leftovers.threads()
    if stuck:
        sys.stderr.write(
            f"threads still running {_EXIT_GRACE_S:.0f}s after the session: {', '.join(stuck)}; "
            "exiting without them\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(config.stash.get(_STATUS, 1))


@pytest.fixture
def config() -> Callable[..., RunConfig]:
    """The config factory (``tests.support.config.make_config``): ``config(train={"steps": 3})``."""
    return make_config


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    """This process as a job of one rank on gloo (for what needs a default group), and a group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seeded() -> Any:
    """Every test starts from the same global RNG state, whatever ran before it."""
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.random.set_rng_state(state)


@pytest.fixture(autouse=True)
def _logger_restored() -> Any:
    """A test that sets up the process's logger (bundle.log.setup) leaves it as it found it."""
    import logging

    logger = logging.getLogger("bundle")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
