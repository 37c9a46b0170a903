"""bundle/launch/handoff.py and its supervisor side: a survivor's state written whole and read
once, taken only between steps (``StepGuard``), the process ended with ``EXIT_HANDOFF``, and its
supervisor starting the rank again at once (not a failure). The path runs end to end under
nccl-emu in tests/integration/test_bundle_faults.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from bundle.collectives.device_audit import DEVICE, MARK, DeviceAudit
from bundle.launch import handoff
from bundle.launch.handoff import EXIT_HANDOFF, Carried, Handoff, StepGuard, state_onto_params
from bundle.launch.supervisor import End, Outcome, Recovery, watch
from tests.unit.test_supervisor import Worker


def _handoff(step: int = 7) -> Handoff:
    carried = Carried(
        step=step,
        model={"w": torch.arange(4.0)},
        optimizer={"state": {0: {"momentum_buffer": torch.ones(4)}}, "param_groups": []},
        extra={"scale": torch.tensor(2.0)},
    )
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
    assert got.carried.step == 7 and torch.equal(got.carried.model["w"], torch.arange(4.0))
    assert torch.equal(got.carried.optimizer["state"][0]["momentum_buffer"], torch.ones(4))
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


def test_optimizer_state_received_on_the_host_goes_to_the_device_under_the_audit():
    """Found under nccl-emu: after a heal with momentum, the update mixed a host momentum buffer
    with device tensors (torch's load_state_dict moves the state where the audit cannot see)."""
    with DeviceAudit() as audit:
        layer = nn.Linear(3, 2).to(MARK)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        layer(torch.randn(4, 3).to(MARK)).sum().backward()
        opt.step()
        sent = Carried(0, {}, opt.state_dict(), {}).on_cpu().optimizer
        fresh = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        fresh.load_state_dict(sent)
        state_onto_params(fresh)
        buf = fresh.state[layer.weight]["momentum_buffer"]
        assert audit.on_device(buf) is DEVICE
        layer(torch.randn(4, 3).to(MARK)).sum().backward()
        fresh.step()  # refused as a host/device mix without it


class _Planted:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_real_stage_and_optimizer_state_go_through_the_handoff_as_data(tmp_path, optimizer):
    model = torch.nn.Linear(3, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    )
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    carried = Carried(step=3, model=model.state_dict(), optimizer=opt.state_dict(), extra={})
    Handoff(carried, 1, (0,), {0: 0}, 0, 0, "why").write(str(tmp_path / "h.pt"))
    got = Handoff.read(str(tmp_path / "h.pt")).carried
    again = type(opt)(model.parameters(), lr=0.5)
    again.load_state_dict(got.optimizer)
    assert again.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_a_handoff_file_that_holds_code_is_refused_without_running_it(tmp_path):
    path, marker = tmp_path / "rank0.pt", tmp_path / "ran"
    torch.save({"carried": _Planted(marker)}, path)
    with pytest.raises(RuntimeError, match=f"{path} holds no handoff"):
        Handoff.read(str(path))
    assert not marker.exists()
