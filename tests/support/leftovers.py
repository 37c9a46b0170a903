"""What a test session leaves running, found and ended before pytest exits.

Every process a test starts inherits ``BUNDLE_TEST_SESSION`` (set once, to the pytest process's
id), also once its parent has died and it has been re-parented. At the end of the session the
processes carrying this session's mark are named and killed by their ids, and threads that would
keep the interpreter from exiting are named, so that a defect in one test cannot hold the suite
(and whoever reads its output) open after the summary has been printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

MARK = "BUNDLE_TEST_SESSION"
# multiprocessing's own helpers end with the interpreter that started them.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def mark_session() -> None:
    os.environ[MARK] = str(os.getpid())


def _carries_mark(pid: int, mark: bytes) -> bool:
    try:
        return mark in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def _command(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]


def processes() -> dict[int, str]:
    """pid -> command line of each live process this session started (directly or not)."""
    session = os.environ.get(MARK)
    if session is None or not Path("/proc").is_dir():
        return {}
    mark = f"{MARK}={session}".encode()
    me = os.getpid()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited; its parent reaps it
        except (OSError, IndexError):
            continue
        if _carries_mark(pid, mark):
            command = _command(pid)
            if not any(helper in command for helper in _HELPERS):
                found[pid] = command
    return found


def end_processes() -> list[str]:
    """Kill (SIGKILL, by id) every live process this session started; one line for each."""
    found = processes()
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"pid {pid}: {cmd}" for pid, cmd in sorted(found.items())]


def threads() -> list[str]:
    """The live non-daemon threads besides this one: each would keep the interpreter open."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
