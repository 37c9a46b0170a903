"""bundle/plan/isolate.py: a measurement in a spawned child; its result, its typed error, or a
one-line LaunchError when it fails or outlives its timeout (then it is killed by its pid)."""

from __future__ import annotations

import os
import time

import pytest

from bundle.errors import ConfigError, LaunchError
from bundle.plan.isolate import run_in_child


# Child entries: module-level, so that a spawned child finds them by name.
def _pid_and(value: int) -> tuple[int, int]:
    return os.getpid(), value * 2


def _refuse() -> None:
    raise ConfigError("--model", "nope", "choose one of: mlp")


def _crash() -> None:
    raise RuntimeError("CUDA out of memory\nsecond line")


def _hang(pid_file: str) -> None:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


@pytest.mark.slow
def test_the_result_comes_back_from_another_process():
    pid, doubled = run_in_child(_pid_and, 21, what="doubling", timeout=60)
    assert doubled == 42 and pid != os.getpid()


@pytest.mark.slow
def test_a_typed_error_is_raised_again_as_it_was():
    with pytest.raises(ConfigError) as caught:
        run_in_child(_refuse, what="profiling", timeout=60)
    assert (caught.value.key, caught.value.value) == ("--model", "nope")


@pytest.mark.slow
def test_any_other_error_is_a_launch_error_naming_the_work():
    with pytest.raises(LaunchError, match="^profiling mlp failed: RuntimeError: CUDA out of"):
        run_in_child(_crash, what="profiling mlp", timeout=60)


@pytest.mark.slow
def test_a_child_past_its_timeout_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within 2s"):
        run_in_child(_hang, str(pid_file), what="profiling", timeout=2)
    assert time.monotonic() - start < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped
