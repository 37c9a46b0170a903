"""Run one measurement in a spawned child process and hand its result back to the caller.

The planner profiles the model on the device the job will use. Done in ``main.py``'s own process
(the node supervisor, which lives as long as the job), a CUDA profile would initialise CUDA there
and keep its context and cached memory on cuda:0 for the whole run. In a child, all of it goes
when the child exits. The child is joined with a timeout and, past it, killed by its own pid; an
error in the child comes back as one line in the caller's typed error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from bundle.errors import BundleError, LaunchError

_POLL_S = 0.5


def _entry(fn: Callable, args: tuple, kwargs: dict, results) -> None:
    try:
        results.put(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        at = f" (at {os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
        try:  # a typed error goes back whole, to be raised again as it was
            whole = pickle.dumps(exc) if isinstance(exc, BundleError) else None
        except Exception:  # noqa: BLE001 - an error that does not pickle goes back as its line
            whole = None
        results.put(("error", f"{type(exc).__name__}: {exc}{at}", whole))


def _result(child, results, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=_POLL_S)
        except queue.Empty:
            pass
        if not child.is_alive():
            try:  # what the child put just before it ended may still be in the pipe
                return results.get(timeout=1.0)
            except queue.Empty:
                raise LaunchError(
                    f"{what} ended without a result (exit code {child.exitcode})"
                ) from None
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} did not finish within {timeout:.0f}s; stopped it")


def run_in_child(
    fn: Callable[..., Any],
    *args: Any,
    what: str,
    timeout: float,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process; its return value (which must pickle).

    Raises ``LaunchError`` naming ``what`` when the child fails, dies or outlives ``timeout``
    seconds (then it is killed); a typed error the child raised (a ``BundleError``) is raised
    again as it was.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Not a daemon: the measurement may start processes of its own (the loopback calibration).
    child = ctx.Process(target=_entry, args=(fn, args, kwargs, results), name=what)
    child.start()
    try:
        got = _result(child, results, what, timeout)
        child.join(timeout=30)
    finally:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        results.close()
    if got[0] == "ok":
        return got[1]
    _, line, whole = got
    if whole is not None:
        raise pickle.loads(whole)
    raise LaunchError(f"{what} failed: {line}")
