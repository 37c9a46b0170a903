"""bundle/checkpoint/manager.py: when a save is due, what happens before one, pruning, and a
save read back, in one process (a world of one on gloo)."""

from __future__ import annotations

import os

import pytest
import torch

from bundle import models
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.manager import Checkpointer
from bundle.checkpoint.parts import RankParts, SaveSettings
from bundle.config import CheckpointConfig, TrainConfig
from bundle.engine.optim import make_optimizer
from bundle.engine.stage import split_model
from bundle.errors import CheckpointError
from bundle.models.partition import resolve
from bundle.runtime.groups import ProcessGroups
from bundle.topology import Topology

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

INPUT = (1, 4, 4)
TOPO = Topology(shape=(1,), num_bundles=1, procs_per_node=1, global_batch=4, micro_batches=1)


def _checkpointer(
    save_dir, *, every=3, total=8, keep=2, group=None, seed=0, optimizer="sgd"
) -> Checkpointer:
    torch.manual_seed(seed)
    model = models.build("mlp", num_classes=3, input_shape=INPUT)
    (stage,) = split_model(model, resolve(None, models.blocks(model), 1, "mlp"))
    opt = make_optimizer(TrainConfig(optimizer=optimizer, lr=0.1, weight_decay=0.01), stage)
    config = CheckpointConfig(
        save_dir=str(save_dir) if save_dir else None, save_every=every, keep=keep
    )
    return Checkpointer(
        SaveSettings(
            config=config, settings={"layout": {"stages": ["0"]}}, steps_per_epoch=5, total=total
        ),
        topo=TOPO,
        coord=TOPO.coord(0),
        rank=0,
        parts=RankParts(stage=stage, optimizer=opt),
        groups=ProcessGroups(control=group, stage=group),
    )


def test_a_save_is_due_on_the_cadence_at_the_end_and_when_stopping(tmp_path):
    saver = _checkpointer(tmp_path, every=3, total=8)
    assert [s for s in range(1, 9) if saver.due(s)] == [3, 6, 8]
    assert saver.due(4, stopping=True)
    # Without --save-every the cadence is an epoch; without --save-dir nothing is ever due.
    assert [s for s in range(1, 12) if _checkpointer(tmp_path, every=0, total=11).due(s)] == [
        5,
        10,
        11,
    ]
    assert not any(_checkpointer(None).due(s, stopping=True) for s in range(1, 9))


def test_maybe_save_runs_the_hooks_first_and_blocks_only_at_the_end_or_a_stop(tmp_path):
    saver = _checkpointer(tmp_path, every=3, total=8)
    calls = []
    saver.before_save += [
        lambda s: calls.append(("flush", s)),
        lambda s: calls.append(("phase", s)),
    ]
    saver.save = lambda step, *, block=True: calls.append(("save", step, block))
    saved = [s for s in range(1, 9) if saver.maybe_save(s, stopping=s == 7)]
    assert saved == [3, 6, 7, 8]
    assert calls == [
        ("flush", 3), ("phase", 3), ("save", 3, False),
        ("flush", 6), ("phase", 6), ("save", 6, False),
        ("flush", 7), ("phase", 7), ("save", 7, True),
        ("flush", 8), ("phase", 8), ("save", 8, True),
    ]  # fmt: skip


def test_saves_keep_the_newest_and_read_back_exactly(tmp_path, world_of_one):
    saver = _checkpointer(tmp_path, every=1, total=4, keep=2, group=world_of_one)
    params = list(saver.stage.parameters())
    for step in range(1, 5):
        saver.stage(torch.randn(2, *INPUT))[0].sum().backward()
        saver.optimizer.step()
        saver.optimizer.zero_grad()
        assert saver.maybe_save(step)
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]
    assert saver.last_saved == ckpt.step_dir(str(tmp_path), 4)

    fresh = _checkpointer(tmp_path, group=world_of_one, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(params, fresh.stage.parameters(), strict=True))
    assert fresh.restore(saver.last_saved) == 4
    for a, b in zip(params, fresh.stage.parameters(), strict=True):
        assert torch.equal(a, b)
        momentum = saver.optimizer.state[a]["momentum_buffer"]
        assert torch.equal(momentum, fresh.optimizer.state[b]["momentum_buffer"])


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_adam_moments_and_step_counts_read_back_exactly(tmp_path, world_of_one, optimizer):
    saver = _checkpointer(tmp_path, every=1, total=3, group=world_of_one, optimizer=optimizer)
    for step in range(1, 4):
        saver.stage(torch.randn(2, *INPUT))[0].sum().backward()
        saver.optimizer.step()
        saver.optimizer.zero_grad()
        saver.maybe_save(step)
    fresh = _checkpointer(tmp_path, group=world_of_one, seed=1, optimizer=optimizer)
    assert fresh.restore(saver.last_saved) == 3
    for a, b in zip(saver.stage.parameters(), fresh.stage.parameters(), strict=True):
        want, got = saver.optimizer.state[a], fresh.optimizer.state[b]
        assert set(got) == {"step", "exp_avg", "exp_avg_sq"} == set(want)
        assert all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want)
        assert got["step"].device.type == "cpu" and float(got["step"]) == 3.0
    # The next step is the same step.
    x = torch.randn(2, *INPUT)
    for s in (saver, fresh):
        s.stage(x)[0].sum().backward()
        s.optimizer.step()
    for a, b in zip(saver.stage.parameters(), fresh.stage.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_first_save_creates_a_save_dir_that_does_not_exist_yet(tmp_path, world_of_one):
    """The room is measured where the directory will be (its nearest existing parent)."""
    save_dir = tmp_path / "runs" / "ckpt"
    saver = _checkpointer(save_dir, every=1, total=1, group=world_of_one)
    saver.save(1)
    assert os.listdir(save_dir) == ["step-1"]
    assert ckpt.damage(ckpt.step_dir(str(save_dir), 1)) is None


def test_a_save_that_will_not_fit_is_refused_before_writing(tmp_path, world_of_one, monkeypatch):
    """The ranks add up what they will write (here one rank: the model and its momentum) and
    compare it with the free space, before ``step-N.tmp`` exists; then the last save's size."""
    import shutil

    from bundle.checkpoint import manager

    saver = _checkpointer(tmp_path, every=1, total=4, group=world_of_one)
    saver.save(1)
    size = ckpt.size_of(ckpt.step_dir(str(tmp_path), 1))
    assert saver.last_bytes == size
    real = shutil.disk_usage
    monkeypatch.setattr(
        manager.shutil,
        "disk_usage",
        lambda p: real(p)._replace(free=size),  # no margin left
    )
    with pytest.raises(CheckpointError) as refused:
        saver.save(2)
    line = str(refused.value)
    assert line.startswith(f"cannot save {ckpt.step_dir(str(tmp_path), 2)}: it needs about ")
    assert line.endswith("MiB free (no space left on device); nothing written"), line
    assert os.listdir(tmp_path) == ["step-1"]
    assert ckpt.damage(ckpt.step_dir(str(tmp_path), 1)) is None
