"""The emulated stream's waits, without processes: a call queued behind one that stalls reports
that stall (what the user must fix), however late the stalled call notices its own deadline."""

from __future__ import annotations

import threading
import time

import pytest

from bundle.engine.nccl_emu import _Stream

LAG = 0.3  # how long after its deadline the stalled call notices (a loaded machine)


def _stalls(call, deadline: float) -> None:
    time.sleep(max(deadline - time.monotonic(), 0.0) + LAG)
    raise TimeoutError("lonely: waiting for its peer")


@pytest.fixture
def stream():
    s = _Stream("world (point-to-point)", 0, timeout=0.5)
    yield s
    s.close()


def test_a_wait_behind_a_stalled_call_reports_that_call(stream):
    stream.post("lonely", _stalls)
    work = stream.post("all_reduce", lambda call, deadline: None)
    with pytest.raises(RuntimeError, match="lonely: waiting for its peer"):
        work.wait()


def test_a_call_that_never_starts_behind_nothing_times_out(stream):
    started = threading.Event()
    work = stream.post("all_reduce", lambda call, deadline: started.wait(5.0))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no completion within 0s; .* is stuck at call 0"):
        work.wait()
    assert time.monotonic() - t0 < 2.0  # its own timeout, not extended: nothing was ahead
    started.set()


def test_a_call_behind_a_finished_one_waits_its_own_timeout_only(stream):
    stream.post("quick", lambda call, deadline: None).wait()
    done = threading.Event()
    work = stream.post("slow", lambda call, deadline: done.wait(5.0))
    assert not stream.settle(work._call, work._call.done, 0.2)
    done.set()
    assert work.wait()
