"""Resume under another layout: a checkpoint of shape 2,1 x 2 bundles (1F1B) read at 1,1,1, 3, DP,
and under schedules that run two model chunks per stage (interleaved 1F1B, ZBV).

Parameters and SGD momentum must arrive bit-identical on every rank of the new layout, and K more
steps there must land where one process training the unsplit model for all the steps lands (1e-5),
as in the gradient-equivalence test. A GPT trained with AdamW, saved at 2,1 x 2 bundles and read
at 1,1,1, must arrive with its parameters, moments and step counts bit-identical too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bundle.config import CheckpointConfig, RunConfig
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.reference import TOL, equivalence_config, reference

SAVED_AT = 3
MORE = 3  # steps 3..5 cross the epoch boundary (128 samples, batch 23: 5 steps per epoch)
# name -> (shape, bundles, sync, schedule, chunks per stage)
TARGETS = {
    "1,1,1": ((1, 1, 1), 1, "flat", "1f1b", 1),
    "3": ((3,), 1, "hierarchical", "1f1b", 1),
    "dp-only": ((2,), 1, "flat", "1f1b", 1),
    "interleaved-1,1": ((1, 1), 1, "flat", "interleaved-1f1b", 2),
    "zbv-1,2": ((1, 2), 1, "hierarchical", "zbv", 2),
}


def _cfg(
    shape,
    bundles,
    sync,
    steps: int,
    save_dir: str,
    text: str | None = None,
    schedule: str = "1f1b",
    chunks: int = 1,
) -> RunConfig:
    sections = None
    if text is not None:  # the language model, with AdamW
        sections = {
            "model": {"name": "gpt", "args": "layers=2,width=16,heads=2"},
            "data": {"dataset": "text", "data_file": text, "seq_len": 8},
            "train": {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1},
        }
    cfg = equivalence_config(
        shape, bundles, schedule, 3, sync, "mlp", sections=sections, chunks=chunks
    )
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=steps),
        checkpoint=CheckpointConfig(save_dir=save_dir),
    )


def _state(session) -> tuple[dict, dict]:
    """Parameters, and every optimizer state tensor (momentum; Adam's moments and step)."""
    stage, opt = session.stage, session.optimizer
    params = {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}
    momenta = {
        stage.full_name(n): {k: v.clone() for k, v in opt.state[p].items()}
        for n, p in stage.named_parameters()
        if opt.state.get(p)
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


def _save(rank: int, world: int, save_dir: str, text: str | None = None):
    cfg = _cfg((2, 1), 2, "flat", SAVED_AT, save_dir, text)
    session, saver, _, _ = _train(cfg, rank, None, SAVED_AT)
    saver.save(SAVED_AT)
    return saver.last_saved, _state(session)


def _resume(rank: int, world: int, target: str, path: str, save_dir: str, text=None):
    shape, bundles, sync, schedule, chunks = TARGETS[target]
    cfg = _cfg(shape, bundles, sync, SAVED_AT + MORE, save_dir, text, schedule, chunks)
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
    shape, bundles, sync, _, _ = TARGETS[target]
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
            assert torch.equal(value["momentum_buffer"], momenta[name]["momentum_buffer"]), name
        assert set(got_momenta) == set(got_params), f"rank {rank}: momentum missing"
        for name, value in final.items():
            seen.add(name)
            err = (value - ref[name]).abs().max().item()
            assert err <= TOL, f"rank {rank}: {name} off by {err:.2e} after {MORE} more steps"
    assert seen == set(ref)


@pytest.mark.slow
def test_adam_state_arrives_bit_identical_under_another_layout(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(Path(dataclasses.__file__).read_text())
    save_dir = str(tmp_path / "ckpt")
    saved = run_world(6, _save, save_dir, str(text))
    path = saved[0][0]
    params, state = {}, {}
    for _, (p, s) in saved:
        params.update(p)
        state.update(s)
    assert set(state) == set(params)
    assert all(set(s) == {"exp_avg", "exp_avg_sq", "step"} for s in state.values())
    results = run_world(3, _resume, "1,1,1", path, save_dir, str(text))
    covered = set()
    for rank, (start, (got_params, got_state), final) in enumerate(results):
        assert start == SAVED_AT
        for name, value in got_params.items():
            covered.add(name)
            assert torch.equal(value, params[name]), f"rank {rank}: {name} not loaded exactly"
            for key, want in state[name].items():
                got = got_state[name][key]
                assert torch.equal(got, want) and got.dtype == want.dtype, f"{name}.{key}"
        assert all(torch.isfinite(v).all() for v in final.values())
    assert covered == set(params)
