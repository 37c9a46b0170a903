"""The emulated stream's waits, without processes: a wait names the call its stream is stuck at,
and what waits behind a call that stalled names that call (what the user must fix), even once it
has left the queue."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from bundle.collectives.nccl_emu import Emulator


@pytest.fixture
def emu():
    e = Emulator(dist.HashStore(), 0, timeout=0.5)
    yield e
    e.close()


def _stalls(call, deadline: float) -> None:
    raise TimeoutError("lonely: waiting for its peer")


def test_a_stall_report_names_the_call_that_broke_the_stream_even_once_it_left(emu):
    """A call behind a stall whose own timeout fires just after the stalled call failed (a
    loaded machine) names the stalled call, not itself."""
    stream = emu._p2p
    stream.post("lonely", _stalls)
    behind = stream.post("all_reduce", lambda call, deadline: None)
    with pytest.raises(RuntimeError, match="lonely: waiting for its peer"):
        behind.wait()
    assert stream.status(behind._call).endswith("is stuck at call 0 (lonely)")
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


def test_a_stalled_collective_names_the_ranks_that_never_started_it(monkeypatch):
    """Ranks 0 and 1 reach the second collective on the world; rank 2 (stopped) reached only the
    first: the report names rank 2, as the job names it, and only rank 2."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    store, release = dist.HashStore(), threading.Event()
    emus = [
        Emulator(store, r, timeout=0.5, name_rank=lambda r: f"rank {r} (stage {r})")
        for r in range(3)
    ]
    try:
        for e in emus:
            assert e.collective("all_reduce", [], None, lambda: None).wait()
        works = [e.collective("all_reduce", [], None, lambda: release.wait(5.0)) for e in emus[:2]]
        time.sleep(0.1)  # both have started it
        with pytest.raises(RuntimeError) as stalled:
            works[0].wait()
        assert str(stalled.value).endswith(
            "stuck at call 1 (all_reduce on the world); no matching call running on rank 2 (stage 2)"
        ), stalled.value
    finally:
        release.set()
        for e in emus:
            e.close()
