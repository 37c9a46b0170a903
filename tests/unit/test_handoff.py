"""bundle/launch/ft/handoff.py and its supervisor side: a survivor's state written whole and read
once, taken only between steps (``StepGuard``), the process ended with ``EXIT_HANDOFF``, and its
supervisor starting the rank again at once (not a failure). The path runs end to end under
nccl-emu in tests/integration/test_bundle_faults.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from bundle.checkpoint.state import PARTS, RankState
from bundle.launch.ft import handoff
from bundle.launch.ft.handoff import EXIT_HANDOFF, Carried, Handoff, StepGuard
from bundle.launch.supervisor import End, Outcome, Recovery, watch
from tests.unit.test_rank_state import assert_same_state, stage_and_optimizer
from tests.unit.test_supervisor import Worker


def _handoff(step: int = 7) -> Handoff:
    state = {part: {} for part in PARTS}
    state["model"] = {"w": torch.arange(4.0)}
    state["optim"] = {"w.momentum_buffer": torch.ones(4)}
    state["extra"] = {"scale": torch.tensor(2.0)}
    carried = Carried(step=step, state=state)
    return Handoff(carried, 2, (0, 2), {0: 0, 2: 1}, 1, 1, "bundle(s) 1 marked lost")


def test_a_handoff_is_read_back_as_written_and_only_once(tmp_path):
    path = str(tmp_path / "rank3.pt")
    _handoff().write(path)
    assert not (tmp_path / "rank3.pt.tmp").exists()  # written whole, then renamed
    got = Handoff.read(path)
    assert (got.epoch, got.members, got.incs, got.failures, got.heals) == (
        2,
        (0, 2),
        {0: 0, 2: 1},
        1,
        1,
    )
    assert got.carried.step == 7 and torch.equal(got.carried.state["model"]["w"], torch.arange(4.0))
    assert torch.equal(got.carried.state["optim"]["w.momentum_buffer"], torch.ones(4))
    assert not (tmp_path / "rank3.pt").exists()  # a later process of the rank never reads it again


def test_the_state_is_taken_only_between_steps():
    votes: list[int] = []
    guard = StepGuard(3, votes.append, cuda=False)
    with guard.held(0) as between:
        assert between
    guard.commit(3)  # the vote passed: the update is being enqueued
    assert votes == [3]
    with guard.held(0.05) as between:
        assert not between  # a handoff now would carry half an update
    guard.updated(3)
    assert guard.committed == 4
    with guard.held(0) as between:
        assert between

    def lost(step: int) -> None:
        raise RuntimeError("Connection closed by peer")

    failing = StepGuard(4, lost, cuda=False)
    with pytest.raises(RuntimeError):
        failing.commit(4)
    with failing.held(0) as between:  # nobody stepped: the state is the committed one
        assert between and failing.committed == 4


def test_a_watch_thread_waits_for_the_update_to_be_enqueued():
    guard = StepGuard(0, lambda step: None, cuda=False)
    guard.commit(0)
    seen: list[tuple[bool, int]] = []

    def take() -> None:
        with guard.held(5.0) as between:
            seen.append((between, guard.committed))

    t = threading.Thread(target=take)
    t.start()
    guard.updated(0)
    t.join(5)
    assert seen == [(True, 1)]


def test_leaving_writes_the_state_and_ends_the_process_unless_there_is_none(tmp_path, monkeypatch):
    ended: list[int] = []

    def exit_(code: int) -> None:
        ended.append(code)

    monkeypatch.setattr(handoff.os, "_exit", exit_)
    said: list[str] = []
    path = str(tmp_path / "rank0.pt")
    handoff.leave(path, lambda: None, said.append)
    assert ended == [] and said == [] and not (tmp_path / "rank0.pt").exists()
    handoff.leave(path, _handoff, said.append)
    assert ended == [EXIT_HANDOFF] and Handoff.read(path).carried.step == 7
    assert said == ["bundle(s) 1 marked lost: this process hands its state (step 7) to a new one"]


def test_a_survivor_that_handed_off_goes_on_in_a_new_worker_and_the_job_is_not_failed():
    went_on: list[int] = []

    def go_on(rank: int) -> dict[int, Worker]:
        went_on.append(rank)
        return {rank: Worker(0, polls=2)}

    posted: list[str] = []
    outcome = watch(
        {0: Worker(EXIT_HANDOFF), 1: Worker(0, polls=1)},
        step_of=lambda rank: 3,
        describe=lambda rank: f"rank {rank}",
        check=lambda: None,
        post=lambda m: posted.append(m) or m,
        wait=lambda fds, s: None,
        recovery=Recovery(
            lose=lambda rank, what: pytest.fail(f"a handoff is no loss: {what}"), go_on=go_on
        ),
    )
    assert outcome == Outcome(End.DONE) and went_on == [0] and posted == []


class _Planted:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_real_stage_and_optimizer_state_go_through_the_handoff_as_data(tmp_path, optimizer):
    trained, parts = stage_and_optimizer(optimizer)
    carried = Carried(step=3, state=RankState(trained).state_dict())
    Handoff(carried, 1, (0,), {0: 0}, 0, 0, "why").write(str(tmp_path / "h.pt"))
    got = Handoff.read(str(tmp_path / "h.pt")).carried
    RankState(parts).load_state_dict(got.state)
    assert_same_state(RankState(parts), RankState(trained))


def test_a_handoff_whose_state_is_not_tensors_by_name_is_refused(tmp_path):
    path = tmp_path / "rank0.pt"
    _handoff().write(str(path))
    plain = torch.load(path, weights_only=True)
    plain["carried"]["state"]["optim"] = {"w.step": 3}
    torch.save(plain, path)
    with pytest.raises(RuntimeError, match="part optim is not names to tensors"):
        Handoff.read(str(path))


def test_a_handoff_file_that_holds_code_is_refused_without_running_it(tmp_path):
    path, marker = tmp_path / "rank0.pt", tmp_path / "ran"
    torch.save({"carried": _Planted(marker)}, path)
    with pytest.raises(RuntimeError, match=f"{path} holds no handoff"):
        Handoff.read(str(path))
    assert not marker.exists()
