"""bundle/engine/outer.py on one process (no peers): when bundles meet, and the outer step's
arithmetic on literal numbers."""

from __future__ import annotations

import torch
from torch import nn

from bundle.engine.hops import HopGroups, Wire
from bundle.engine.outer import Meetings, OuterSync


def _outer(mode: str, every: int = 2, total: int = 5, **kw) -> tuple[OuterSync, nn.Parameter]:
    p = nn.Parameter(torch.zeros(3))
    sync = OuterSync(
        [("w", p)],
        meetings=Meetings(
            mode=mode,
            every=every,
            outer_lr=kw.get("outer_lr", 0.7),
            outer_momentum=kw.get("outer_momentum", 0.9),
            rule="mean",
        ),
        total=total,
        groups=HopGroups(bundle_group=None, bundle_master=0, masters_group=None, bundle=0),
        wire=Wire(),
    )
    return sync, p


def test_bundles_meet_every_h_steps_and_after_the_last():
    sync, _ = _outer("local", every=2, total=5)
    assert [s + 1 for s in range(5) if sync.due(s)] == [2, 4, 5]


def test_local_sgd_restarts_from_the_average_which_alone_is_its_own_average():
    sync, p = _outer("local")
    with torch.no_grad():
        p.copy_(torch.tensor([1.0, -2.0, 0.5]))
    sync.after_step(1)
    assert p.tolist() == [1.0, -2.0, 0.5]
    assert sync.anchor[0].tolist() == [1.0, -2.0, 0.5]


def test_diloco_takes_a_nesterov_step_on_the_drift():
    sync, p = _outer("diloco")
    with torch.no_grad():
        p.fill_(-1.0)  # drift anchor - params = +1
    sync.after_step(1)
    # momentum = 1; update = drift + 0.9 * momentum = 1.9; anchor = 0 - 0.7 * 1.9
    assert torch.allclose(p, torch.full((3,), -1.33))
    with torch.no_grad():
        p.sub_(1.0)  # another drift of +1
    sync.after_step(3)
    # momentum = 0.9 * 1 + 1 = 1.9; update = 1 + 0.9 * 1.9 = 2.71; anchor = -1.33 - 0.7 * 2.71
    assert torch.allclose(p, torch.full((3,), -1.33 - 0.7 * 2.71))
    assert torch.allclose(sync.state()["outer.w.momentum"], torch.full((3,), 1.9))


def test_between_meetings_nothing_changes():
    sync, p = _outer("diloco")
    with torch.no_grad():
        p.fill_(-1.0)
    sync.after_step(0)
    assert p.tolist() == [-1.0] * 3 and sync.anchor[0].tolist() == [0.0] * 3


class _Masters:
    """The other masters of a meeting, as one peer: what they add to an all-reduce (MAX, or
    SUM over ``peers`` of them) and what a broadcast from another master brings."""

    def __init__(self, *, met: bool, rank: int, anchor: float, momentum: float) -> None:
        self.met, self.rank, self.anchor, self.momentum = met, rank, anchor, momentum
        self.me = 0

    def all_reduce(self, tensor, group, op=None):
        if tensor.numel() == 3:  # catch_up's [met, -met, -source]
            theirs = torch.tensor(
                [int(self.met), -int(self.met), -self.rank if self.met else -(1 << 30)]
            )
            tensor.copy_(torch.maximum(tensor, theirs))
        else:  # a meeting's drift: the peer drifted as far as this one
            tensor.mul_(2)
        return _Done()

    def broadcast(self, tensor, src, group):
        if src != self.me:  # [anchor, momentum], flattened
            half = tensor.numel() // 2
            tensor[:half], tensor[half:] = self.anchor, self.momentum
        return _Done()


class _TwoMasters:
    def size(self) -> int:
        return 2


class _Done:
    def wait(self):
        return None


def _after_a_cut_meeting(*, met_here: bool, met_there: bool):
    sync, p = _outer("diloco", every=2, total=6)
    sync.masters_group = _TwoMasters()  # a master of a meeting with another bundle
    masters = _Masters(met=met_there, rank=3, anchor=5.0, momentum=0.5)
    sync.comm = masters
    with torch.no_grad():
        p.fill_(-1.0)  # step 2's drift of +1 from the anchor at 0
    if met_here:
        sync.after_step(1)  # this master finished the meeting before the loss
    anchor_before = sync.anchor[0].clone()
    sync.catch_up(2)
    return sync, p, anchor_before


def test_after_a_loss_a_meeting_every_master_finished_is_left_as_it_is():
    sync, p, before = _after_a_cut_meeting(met_here=True, met_there=True)
    assert torch.equal(sync.anchor[0], before) and torch.equal(p.detach(), before)


def test_after_a_loss_a_meeting_nobody_finished_is_held_again():
    sync, p, before = _after_a_cut_meeting(met_here=False, met_there=False)
    assert before.tolist() == [0.0] * 3
    assert torch.equal(p.detach(), sync.anchor[0]) and sync.anchor[0][0] < 0  # the outer step


def test_after_a_loss_a_master_that_missed_the_meeting_takes_one_that_finished_it():
    sync, p, _ = _after_a_cut_meeting(met_here=False, met_there=True)
    assert sync.anchor[0].tolist() == [5.0] * 3 and p.tolist() == [5.0] * 3
    assert sync.momentum[0].tolist() == [0.5] * 3


def test_no_catching_up_after_a_step_without_a_meeting():
    sync, p = _outer("diloco", every=2, total=6)
    sync.comm = None  # any collective would fail
    with torch.no_grad():
        p.fill_(-1.0)
    sync.catch_up(3)  # step 3 is no meeting's
    sync.catch_up(0)
    assert p.tolist() == [-1.0] * 3
