"""The emulated stream's waits, without processes: a wait names the call its stream is stuck at;
torch's own collectives held behind a call that stalls report that stall (what the user must
fix), however late the stalled call notices its own deadline."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from bundle.engine.nccl_emu import Emulator

LAG = 0.3  # how long after its deadline the stalled call notices (a loaded machine)


def _stalls(call, deadline: float) -> None:
    time.sleep(max(deadline - time.monotonic(), 0.0) + LAG)
    raise TimeoutError("lonely: waiting for its peer")


@pytest.fixture
def emu():
    e = Emulator(dist.HashStore(), 0, timeout=0.5)
    yield e
    e.close()


def test_what_torch_runs_behind_a_stalled_call_reports_that_call(emu):
    emu._p2p.post("lonely", _stalls)
    stalled = pytest.raises(RuntimeError, match="DDP's start-up could not start: .*lonely: waiting")
    with stalled, emu.exclusive(None, "DDP's start-up"):
        pass


def test_a_wait_names_the_call_its_stream_is_stuck_at(emu):
    release = threading.Event()
    emu._p2p.post("lonely", lambda call, deadline: release.wait(5.0))
    work = emu._p2p.post("all_reduce", lambda call, deadline: None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"has not started call 1 \(all_reduce\): 1 call\(s\) "):
        work.wait()
    assert time.monotonic() - t0 < 2.0  # its own timeout
    release.set()
    assert work.wait()


def test_torchs_collectives_run_once_the_calls_ahead_end(emu):
    emu._p2p.post("quick", lambda call, deadline: time.sleep(0.1))
    with emu.exclusive(None, "PowerSGD's rounds"):
        pass
