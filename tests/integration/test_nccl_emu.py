"""The NCCL emulation itself, on two gloo processes: the engine's old order is reported stuck
within the timeout, naming its operations; the crossing of unfused 1F1B sends too; the fused
order completes with the right data; eager sends lift the crossing; separate communicators
progress independently. The same patterns complete on plain gloo, which is why they hid."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from bundle.collectives import nccl_emu
from bundle.launch.localworld import run_world

TIMEOUT = 4.0  # long enough that a loaded 2-core machine posts both sides in time
N = 64  # elements per message: 256 bytes


def _emulator(
    name: str, rank: int, eager_bytes: int = 0, strict: bool = False
) -> nccl_emu.Emulator:
    store = dist.PrefixStore(f"test/{name}", dist.distributed_c10d._get_default_store())
    return nccl_emu.Emulator(store, rank, timeout=TIMEOUT, eager_bytes=eager_bytes, strict=strict)


def _run(emu, calls: list, rank: int, n: int = N) -> tuple[dict, str | None, float]:
    """Post each call ((op, label) pairs; op send/recv with the other rank), waiting for it at
    once where the pattern says ``WAIT`` (its data is needed next); the received data, the error."""
    peer, got, works = 1 - rank, {}, []
    start = time.monotonic()
    try:
        for call in calls:
            wait_now = call[-1] == WAIT
            call = call[:-1] if wait_now else call
            ops, labels, bufs = [], [], {}
            for op, label in call:
                if op == "send":
                    t = torch.full((n,), float(len(label) + 10 * rank))
                    ops.append(dist.P2POp(dist.isend, t, peer))
                else:
                    bufs[label] = torch.zeros(n)
                    ops.append(dist.P2POp(dist.irecv, bufs[label], peer))
                labels.append(f"{label} {'to' if op == 'send' else 'from'} rank {peer}")
            posted = emu.batch_isend_irecv(ops, lambda labels=labels: labels)
            if wait_now:  # waited once only: a gloo work is not to be waited for twice
                for w in posted:
                    w.wait()
                posted = []
            works.append((posted, bufs))
        for posted, bufs in works:
            for w in posted:
                w.wait()
            got.update({k: v[0].item() if len(v) else None for k, v in bufs.items()})
    except RuntimeError as exc:
        return got, str(exc), time.monotonic() - start
    return got, None, time.monotonic() - start


WAIT = "wait"  # the call's data is needed before the next call is posted
OLD = {  # receives posted ahead of the sends (the engine's order before bundle.ir.p2p), 1F1B M=1
    0: [[("recv", "recv_grad0")], [("send", "send_act0")]],
    1: [[("recv", "recv_act0"), WAIT], [("send", "send_grad0")]],
}
CROSSED = {  # 1F1B M=2 with receives posted where they stand, sends unfused
    0: [[("send", "send_act0")], [("send", "send_act1")], [("recv", "recv_grad0"), WAIT]],
    1: [[("recv", "recv_act0"), WAIT], [("send", "send_grad0")], [("recv", "recv_act1"), WAIT]],
}
FUSED = {  # bundle.ir.p2p's calls for the same actions
    0: [[("send", "send_act0")], [("send", "send_act1"), ("recv", "recv_grad0"), WAIT]],
    1: [[("recv", "recv_act0"), WAIT], [("send", "send_grad0"), ("recv", "recv_act1"), WAIT]],
}


def _scenarios(rank: int, world: int) -> dict:
    out = {}
    for name, pattern, eager, n in (
        ("old", OLD, 0, N),
        ("crossed", CROSSED, 0, N),
        ("fused", FUSED, 0, N),
        ("crossed-eager", CROSSED, 4 * N, N),
        ("crossed-zero-bytes", CROSSED, 4 * N, 0),  # eager allowed, but zero bytes rendezvous
    ):
        out[name] = _run(_emulator(name, rank, eager), pattern[rank], rank, n)
        dist.barrier()  # the next scenario starts on both ranks after this one ended on both
    out.update(_behind_a_stuck_receive(rank))

    # A stuck point-to-point stream does not hold up a collective on another communicator.
    emu = _emulator("independent", rank)
    group = dist.new_group([0, 1])
    stuck = emu.batch_isend_irecv(
        [dist.P2POp(dist.irecv, torch.zeros(N), 1 - rank)], lambda: ["lonely"]
    )
    total = torch.ones(N)
    emu.all_reduce(total, group).wait()
    out["collective"] = (total[0].item(), stuck[0].is_completed())
    dist.barrier()
    return out


def _stuck_receive(emu: nccl_emu.Emulator, rank: int) -> None:
    emu.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(N), 1 - rank)], lambda: ["lonely"])


def _error(start) -> str | None:
    try:
        start()
    except RuntimeError as exc:
        return str(exc)
    return None


def _behind_a_stuck_receive(rank: int) -> dict:
    """What waits behind a receive no send will meet: the world group's collectives (one NCCL
    communicator with the point-to-point calls), torch's own collectives run inside
    ``exclusive``, and under ``strict`` another communicator's collectives too."""
    out, group = {}, dist.new_group([0, 1])
    for name, strict, collective in (
        ("world all_reduce", False, lambda emu: emu.all_reduce(torch.ones(N), None).wait()),
        ("world exclusive", False, lambda emu: emu.exclusive(None, "DDP's start-up").__enter__()),
        ("strict all_reduce", True, lambda emu: emu.all_reduce(torch.ones(N), group).wait()),
    ):
        emu = _emulator(name, rank, strict=strict)
        _stuck_receive(emu, rank)
        out[name] = _error(lambda emu=emu, collective=collective: collective(emu))
        dist.barrier()
    # Not strict: torch's collectives on another group run inside ``exclusive`` meanwhile.
    emu = _emulator("other exclusive", rank)
    _stuck_receive(emu, rank)
    total = torch.ones(N)
    with emu.exclusive(group, "PowerSGD's rounds"):
        dist.all_reduce(total, group=group)
    out["other exclusive"] = total[0].item()
    dist.barrier()
    return out


class _Gloo:
    """The emulator's interface straight onto gloo: every operation progresses on its own."""

    def batch_isend_irecv(self, ops, labels):
        return dist.batch_isend_irecv(ops)


def _on_gloo(rank: int, world: int) -> dict:
    return {
        name: _run(_Gloo(), pattern[rank], rank)
        for name, pattern in (("old", OLD), ("crossed", CROSSED))
    }


@pytest.fixture(scope="module")
def scenarios() -> list[dict]:
    return run_world(2, _scenarios, timeout=120)


@pytest.mark.slow
def test_old_order_is_reported_stuck_within_the_timeout_naming_the_operations(scenarios):
    for rank, (other, op) in enumerate(((1, "recv_grad0"), (0, "recv_act0"))):
        got, error, seconds = scenarios[rank]["old"]
        assert got == {} and error is not None
        assert seconds < TIMEOUT + 5.0  # the timeout, not a hang (slack for a loaded machine)
        assert f"{op} from rank {other}: waiting for its peer" in error, error
        assert f"no matching call running on rank {other}" in error, error


@pytest.mark.slow
def test_crossed_sends_are_reported_stuck(scenarios):
    _, error, _ = scenarios[0]["crossed"]
    assert error is not None and "send_act1 to rank 1: waiting for its peer" in error, error
    _, error, _ = scenarios[1]["crossed"]
    assert error is not None and "send_grad0 to rank 0: waiting for its peer" in error, error


@pytest.mark.slow
def test_fused_order_completes_with_the_right_data(scenarios):
    # Each rank fills a send with len(label) + 10 * its rank.
    got, error, _ = scenarios[0]["fused"]
    assert error is None and got == {"recv_grad0": 10.0 + len("send_grad0")}
    got, error, _ = scenarios[1]["fused"]
    assert error is None and got == {"recv_act0": len("send_act0"), "recv_act1": len("send_act1")}


@pytest.mark.slow
def test_eager_sends_lift_the_crossing(scenarios):
    for rank in (0, 1):
        got, error, _ = scenarios[rank]["crossed-eager"]
        assert error is None and len(got) == (1 if rank == 0 else 2)


@pytest.mark.slow
def test_communicators_progress_independently(scenarios):
    for rank in (0, 1):
        assert scenarios[rank]["collective"] == (2.0, False)


@pytest.mark.slow
def test_zero_byte_messages_rendezvous_like_the_rest(scenarios):
    for rank in (0, 1):
        _, error, seconds = scenarios[rank]["crossed-zero-bytes"]
        assert error is not None and "waiting for its peer" in error, error
        assert seconds < TIMEOUT + 5.0


@pytest.mark.slow
def test_what_runs_behind_a_stuck_call_on_the_same_communicator_is_reported_stuck(scenarios):
    for rank in (0, 1):
        for name in ("world all_reduce", "world exclusive", "strict all_reduce"):
            error = scenarios[rank][name]
            assert error is not None and "lonely: waiting for its peer" in error, (name, error)
        assert "DDP's start-up could not start" in scenarios[rank]["world exclusive"]
        assert scenarios[rank]["other exclusive"] == 2.0


@pytest.mark.slow
def test_gloo_completes_both_patterns_which_is_why_they_hid():
    results = run_world(2, _on_gloo, timeout=60)
    assert [results[0][k][:2] for k in ("old", "crossed")] == [({"recv_grad0": 20.0}, None)] * 2
    assert results[1]["crossed"][:2] == ({"recv_act0": 9.0, "recv_act1": 9.0}, None)
