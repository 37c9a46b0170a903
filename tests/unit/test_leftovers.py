"""The session's end finds what tests left running by the mark they inherited, and only that."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from tests.support import leftovers

_SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _gone(p: subprocess.Popen, timeout: float = 10.0) -> bool:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_a_process_started_in_the_session_is_found_and_killed_even_re_parented():
    # A shell starts the sleeper in the background and exits: the sleeper outlives its parent.
    shell = subprocess.run(
        ["sh", "-c", f'"{_SLEEP[0]}" -c "import time; time.sleep(60)" >/dev/null 2>&1 & echo $!'],
        capture_output=True, text=True, check=True, start_new_session=True,
    )  # fmt: skip
    orphan = int(shell.stdout)
    try:
        assert orphan in leftovers.processes()
        assert any(line.startswith(f"pid {orphan}: ") for line in leftovers.end_processes())
        deadline = time.monotonic() + 10
        while orphan in leftovers.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan not in leftovers.processes()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, 9)


def test_a_process_without_the_mark_is_left_alone():
    env = {k: v for k, v in os.environ.items() if k != leftovers.MARK}
    other = subprocess.Popen(_SLEEP, env=env)
    try:
        time.sleep(0.2)  # its environment is readable once it has started
        assert other.pid not in leftovers.processes()
        leftovers.end_processes()
        assert other.poll() is None
    finally:
        other.kill()
        assert _gone(other)
