"""Resume under another layout: a checkpoint of shape 2,1 x 2 bundles read at 1,1,1, 3 and DP.

Parameters and SGD momentum must arrive bit-identical on every rank of the new layout, and K more
steps there must land where one process training the unsplit model for all the steps lands (1e-5),
as in the gradient-equivalence test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bundle.config import CheckpointConfig, RunConfig
from bundle.runtime.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import TOL, equivalence_config, reference

SAVED_AT = 3
MORE = 3  # steps 3..5 cross the epoch boundary (128 samples, batch 23: 5 steps per epoch)
TARGETS = {
    "1,1,1": ((1, 1, 1), 1, "flat"),
    "3": ((3,), 1, "hierarchical"),
    "dp-only": ((2,), 1, "flat"),
}


def _cfg(shape, bundles, sync, steps: int, save_dir: str) -> RunConfig:
    cfg = equivalence_config(shape, bundles, "1f1b", 3, sync, "mlp")
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=steps),
        checkpoint=CheckpointConfig(save_dir=save_dir),
    )


def _state(session) -> tuple[dict, dict]:
    stage, opt = session.stage, session.optimizer
    params = {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}
    momenta = {
        stage.full_name(n): opt.state[p]["momentum_buffer"].clone()
        for n, p in stage.named_parameters()
        if "momentum_buffer" in opt.state.get(p, {})
    }
    return params, momenta


def _train(cfg: RunConfig, rank: int, resume: str | None, until: int):
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    saver = make_checkpointer(cfg, topo, rank, session)
    start = saver.restore(resume)
    loaded = _state(session)
    batches = train_stream(session, topo, cfg.train.seed, until, 0, start=start)
    for step in range(start, until):
        session.engine.train_step(step, next(batches))
    return session, saver, start, loaded


def _save(rank: int, world: int, save_dir: str):
    cfg = _cfg((2, 1), 2, "flat", SAVED_AT, save_dir)
    session, saver, _, _ = _train(cfg, rank, None, SAVED_AT)
    saver.save(SAVED_AT)
    return saver.last_saved, _state(session)


def _resume(rank: int, world: int, target: str, path: str, save_dir: str):
    shape, bundles, sync = TARGETS[target]
    cfg = _cfg(shape, bundles, sync, SAVED_AT + MORE, save_dir)
    session, _, start, loaded = _train(cfg, rank, path, SAVED_AT + MORE)
    return start, loaded, _state(session)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("reshape"))
    results = run_world(6, _save, save_dir)
    path = results[0][0]
    params, momenta = {}, {}
    for _, (p, m) in results:
        params.update(p)
        momenta.update(m)
    return save_dir, path, params, momenta


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_under_another_layout(saved, target):
    save_dir, path, params, momenta = saved
    shape, bundles, sync = TARGETS[target]
    assert path.endswith(f"step-{SAVED_AT}")
    assert momenta and set(momenta) == set(params)  # SGD momentum is part of what is checked
    results = run_world(sum(shape) * bundles, _resume, target, path, save_dir)
    ref = reference(_cfg(shape, bundles, sync, SAVED_AT + MORE, save_dir))
    seen = set()
    for rank, (start, (got_params, got_momenta), final) in enumerate(results):
        assert start == SAVED_AT
        for name, value in got_params.items():
            assert torch.equal(value, params[name]), f"rank {rank}: {name} not loaded exactly"
        for name, value in got_momenta.items():
            assert torch.equal(value, momenta[name]), f"rank {rank}: momentum of {name} differs"
        assert set(got_momenta) == set(got_params), f"rank {rank}: momentum missing"
        for name, value in final.items():
            seen.add(name)
            err = (value - ref[name]).abs().max().item()
            assert err <= TOL, f"rank {rank}: {name} off by {err:.2e} after {MORE} more steps"
    assert seen == set(ref)
