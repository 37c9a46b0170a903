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
