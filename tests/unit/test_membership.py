"""Which bundles train on after a failure and which rejoin (bundle.launch.ft.membership), agreed
through a store: the processes of three bundles of shape 1,1 check in from threads, as they would
after a failure."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bundle.errors import PeerFailure
from bundle.launch.ft.epochs import LossWatch
from bundle.launch.ft.membership import (
    BundleLeft,
    Membership,
    TooFewBundles,
    is_peer_loss,
    mark_dead,
)
from bundle.runtime import keys
from bundle.topology import Topology

JOB = Topology(shape=(1, 1), num_bundles=3, procs_per_node=6, global_batch=12, micro_batches=1)


def _agree(store, ranks, committed=None, timeout=5.0, min_bundles=1):
    """Every rank in ``ranks`` agrees at once; returns rank -> members or the error raised."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        m = Membership(store, JOB, rank, timeout, min_bundles=min_bundles)
        try:
            out[rank] = m.agree((committed or {}).get(rank, 3))
            out[rank, "layout"] = (m.layout.num_bundles, m.my_rank, m.epoch, m.failures)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _store():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    return store


def test_the_complete_bundles_train_on_once_the_dead_one_is_marked():
    store = _store()
    store.set(keys.dead(1), "rank 3 was killed")
    out = _agree(store, [0, 1, 2, 4, 5])  # rank 3 is dead; rank 2 of bundle 1 still runs
    assert out[0] == out[1] == out[4] == out[5] == (0, 2)
    assert isinstance(out[2], BundleLeft)
    # Bundle 2's processes are ranks 2 and 3 of the new world; one bundle has left.
    assert out[4, "layout"] == (2, 2, 1, 1) and out[1, "layout"] == (2, 1, 1, 1)


def test_a_bundle_that_never_completes_is_dropped_at_the_deadline():
    out = _agree(_store(), [0, 1, 2, 4, 5], timeout=0.3)  # no supervisor marked bundle 1
    assert out[0] == out[5] == (0, 2) and isinstance(out[2], BundleLeft)


def test_all_bundles_but_one_lost_the_last_trains_on_alone():
    store = _store()
    mark_dead(store, 0, 0, "rank 1 was killed")
    mark_dead(store, 1, 0, "rank 3 was killed")
    out = _agree(store, [4, 5])
    assert out[4] == out[5] == (2,)
    # A world of one bundle: its two processes are ranks 0 and 1; two bundles have left.
    assert out[4, "layout"] == (1, 0, 1, 2) and out[5, "layout"] == (1, 1, 1, 2)


def test_below_min_bundles_or_on_different_steps_the_job_fails():
    store = _store()
    store.set(keys.dead(1), "gone")
    out = _agree(store, [0, 1, 4, 5], min_bundles=3)
    assert all(isinstance(out[r], TooFewBundles) for r in (0, 1, 4, 5))
    # Said as the job's failure, naming the lost bundle and the step, not the process saying it.
    assert str(out[4]) == (
        "bundle(s) 1 lost after step 3: 2 bundle(s) remain (0,2), fewer than --min-bundles 3"
    )
    cause = _said_by(out[4])
    assert cause == f"the job has too few bundles: {out[4]}" and "rank 4" not in cause
    store = _store()
    store.set(keys.dead(1), "gone")
    out = _agree(store, [0, 1, 4, 5], committed={0: 3, 1: 3, 4: 4, 5: 4})
    assert "committed different steps ([3, 4])" in str(out[0])


def test_peer_losses_are_told_from_a_process_own_faults():
    assert is_peer_loss(PeerFailure("recv_act1 from rank 3 did not complete"))
    assert is_peer_loss(RuntimeError("[pair.cc:545] Read error: Connection reset by peer"))
    assert is_peer_loss(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 13000ms for recv"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("Connection closed"))


@pytest.mark.parametrize("members", [(0, 2), (1, 2), (0,)])
def test_a_kept_layout_keeps_each_bundle_s_ranks_devices_and_rows(members):
    job = Topology(shape=(2, 1), num_bundles=3, procs_per_node=3, global_batch=23, micro_batches=2)
    kept = job.keep(members)
    assert kept.num_bundles == len(members) and kept.whole is job
    assert kept.global_batch == sum(job.bundle_batches[b] for b in members)
    for k, b in enumerate(members):
        assert kept.micro_sizes(k) == job.micro_sizes(b)
        for s, width in enumerate(job.shape):
            for r in range(width):
                mine, theirs = kept.rank(k, s, r), job.rank(b, s, r)
                assert kept.job_rank(mine) == theirs and kept.job_bundle(k) == b
                assert kept.node_of(mine) == job.node_of(theirs)
                assert kept.device_index(mine) == job.device_index(theirs)
                assert kept.describe(mine) == job.describe(theirs)
                for m in range(2):
                    assert kept.global_rows(k, m, s, r) == job.global_rows(b, m, s, r)
    assert job.keep((0, 1, 2)) is job
    assert kept.keep((len(members) - 1,)).members == (members[-1],)  # from a kept layout


def test_a_new_incarnation_is_seen_ready_taken_in_and_told_where_to_start():
    store = _store()
    store.set(keys.dead(1), "gone")
    survivors = {r: Membership(store, JOB, r, 5.0) for r in (0, 1, 4, 5)}
    out = _agree(store, [0, 1, 4, 5])
    assert out[0] == (0, 2)
    for m in survivors.values():  # as agree left them
        m.epoch, m.members, m.failures = 1, (0, 2), 1
    healing = {r: Membership(store, JOB, r, 5.0, incarnation=1) for r in (2, 3)}
    store.set(keys.healing(1), "1")
    assert survivors[0].joining() == [0, 0, 0]  # none has checked in yet
    got: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda r=r: got.update({r: healing[r].ask_to_join(10.0)}))
        for r in healing
    ]
    for t in threads:
        t.start()
    while survivors[0].joining() != [0, 1, 0]:  # both new processes have checked in
        pass
    for m in survivors.values():
        m.admit([1], 57)
    for t in threads:
        t.join(10)
    assert got == {2: 57, 3: 57}
    for m in [*survivors.values(), *healing.values()]:
        assert (m.epoch, m.members, m.incs) == (2, (0, 1, 2), {0: 0, 1: 1, 2: 0})
    assert survivors[0].heals == 1 and healing[3].my_rank == 3
    # The new processes learn the job's counts too: one of them may be the one that reports.
    assert all((m.failures, m.heals) == (1, 1) for m in healing.values())
    # The new incarnation fails: its bundle is dead again under its own key, not the old one's.
    assert healing[2].leave().args[0] == "bundle 1 left the job at epoch 2"
    assert store.check([keys.dead(1, 1)])


def test_a_process_waiting_to_join_a_finished_run_goes_home():
    store = _store()
    store.set(keys.FT_DONE, "1")
    assert Membership(store, JOB, 2, 5.0, incarnation=1).ask_to_join(5.0) == -1


def test_a_loss_watch_acts_once_a_member_is_marked_dead_and_not_after_it_ended():
    """On NCCL a wait on a dead peer never ends: the watch hands the survivor's state over. A
    mark of what is no member (an incarnation not yet taken in) leaves the epoch alone."""
    store = _store()
    members = Membership(store, JOB, 0, 5.0, members=(0, 2), incs={0: 0, 2: 0})
    aborted: list[int] = []
    watch = LossWatch(members, on_loss=lambda why: aborted.append(1))
    assert not watch.check() and watch.fired is None
    assert mark_dead(store, 1, 1, "rank 3 was killed") == "rank 3 was killed"  # not a member
    assert not watch.check() and aborted == []
    assert mark_dead(store, 2, 0, "rank 5 was killed") == "rank 5 was killed"
    assert mark_dead(store, 2, 0, "rank 4 left") == "rank 5 was killed"  # the first reason stays
    assert watch.check() and aborted == [1] and watch.fired == "bundle(s) 2 marked lost"
    assert not watch.check() and aborted == [1]  # once

    ended = LossWatch(members, on_loss=lambda why: aborted.append(2))
    ended.stop()
    mark_dead(store, 0, 0, "rank 1 was killed")
    assert not ended.check() and aborted == [1] and ended.fired is None
    # As a thread it looks every poll.
    live = LossWatch(members, on_loss=lambda why: aborted.append(3), poll_s=0.01).start()
    mark_dead(store, 0, 0, "again")
    deadline = time.monotonic() + 5
    while live.fired is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted == [1, 3] and live.fired == "bundle(s) 0, 2 marked lost"


def test_a_process_waiting_to_join_leaves_once_its_sibling_in_the_heal_failed():
    """Rank 3 of heal 1 died as it started (its supervisor marked the incarnation): rank 2 of
    the same heal stops waiting at once, so that the next heal can start."""
    store = _store()
    mark_dead(store, 1, 1, "rank 3 was killed by SIGKILL")
    t0 = time.monotonic()
    with pytest.raises(BundleLeft):
        Membership(store, JOB, 2, 5.0, incarnation=1).ask_to_join(5.0)
    assert time.monotonic() - t0 < 1.0


def _said_by(exc: BaseException) -> str:
    """What a process that raised ``exc`` posts to the job as its cause (bundle.launch.process)."""
    from bundle.launch.process import _report_failure
    from bundle.runtime.phase import Phase
    from bundle.runtime.store import read_abort

    store = _store()
    _report_failure(store, "rank 4 (node 0, bundle 2, stage 0, replica 0)", 4, Phase(), exc)
    return read_abort(store)


def test_a_lost_peer_is_said_in_one_line_without_the_backend_s_source():
    from bundle.launch.ft.epochs import _loss_text

    gloo = (
        "Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/"
        "third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:3456: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs "
        "in the application. Check the logs of the remote worker."
    )
    said = _loss_text(RuntimeError(gloo))
    assert said == "a peer was lost: Read error [127.0.0.1]:3456: Connection reset by peer"
    assert _loss_text(RuntimeError("Timed out waiting 33000ms")).endswith(
        ": Timed out waiting 33000ms"
    )


def test_the_rejoin_digest_reads_adam_s_zero_dimensional_step_counts():
    """Found by hand: the digest viewed each tensor as bytes, which a 0-d tensor cannot be."""
    from bundle.launch.ft.epochs import _digest

    state = {"optim": {"w.step": torch.tensor(3.0), "w.exp_avg": torch.ones(2)}}
    other = {"optim": {"w.step": torch.tensor(4.0), "w.exp_avg": torch.ones(2)}}
    assert not torch.equal(_digest(state, ("optim",)), _digest(other, ("optim",)))
