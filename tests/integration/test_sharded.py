"""``--zero 3`` and ``--compile`` against their yardsticks.

- ``--zero 3`` trains as one process on the unsplit model (1e-5; AdamW 1e-4, which magnifies the
  rounding of another summation order) at per-stage widths 2,1, 1,2 and 2,2 in two bundles, flat
  and hierarchical, under gloo and under nccl-emu with its device audit; GPT-2's embedding and
  head tied across stages of different widths are summed shard by shard. Every replica holds a
  shard of its stage (the shards' bytes add up to the stage's), a width-1 stage in one bundle
  the whole of it; the final weights file (``--checkpoint``) holds them gathered.
- A ``--zero 3`` checkpoint resumes bit-identical at its shape; at another shape without ZeRO
  training lands on the yardstick, and that checkpoint resumed under ``--zero 3`` too.
- ``--compile`` (aot_eager: the compiled graphs, without generating code; one run with
  inductor) trains as one process (1e-5), with recompute and with ``--zero 3``, and a checkpoint
  saved compiled resumes uncompiled.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bundle.checkpoint import final as final_weights
from bundle.checkpoint import format as ckpt
from bundle.engine.optim import local_bytes
from bundle.engine.sharded import full, is_sharded
from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.integration.test_any_model import case_config
from tests.integration.test_data_parallel import ADAMW_TOL, _cfg, _run
from tests.support.reference import STEPS, TOL, reference

pytestmark = pytest.mark.slow

ADAMW = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}

# (world size, backend) -> the variants one world runs: (shape, sync, changes); "gpt2-tied" runs
# GPT-2 cut across its tied embedding and head at shape 2,1 (flat).
VARIANTS = {
    (6, "gloo"): [((2, 1), "flat", {}), ((1, 2), "hierarchical", ADAMW), "gpt2-tied"],
    # Strict: a rank's calls on all communicators one at a time, FSDP's among them.
    (6, "nccl-emu"): [
        ((2, 1), "hierarchical", {"emu_strict": True}),
        ((1, 2), "flat", {"schedule": "gpipe"}),
    ],
    (8, "gloo"): [((2, 2), "flat", {"schedule": "interleaved-1f1b", "virtual_stages": 2})],
    (8, "nccl-emu"): [((2, 2), "hierarchical", {"recompute": "always"})],
}


def _config(shape, sync, changes, backend, *, bundles=2, **more):
    compute = {k: changes[k] for k in ("recompute", "compile", "compile_backend") if k in changes}
    strict = changes.get("emu_strict", False) and backend == "nccl-emu"  # (the yardstick: gloo)
    launch = {"backend": backend, "emu_strict": strict}
    rest = {k: v for k, v in changes.items() if k not in compute and k != "emu_strict"}
    cfg = _cfg(shape, bundles, sync, **rest, **more)
    return dataclasses.replace(
        cfg,
        compute=dataclasses.replace(cfg.compute, **compute),
        launch=dataclasses.replace(cfg.launch, **launch),
    )


def _whole(session) -> dict[str, torch.Tensor]:
    """The stage's parameters by full-model name, gathered where sharded (collective)."""
    stage = session.stage
    return {stage.full_name(n): full(p.detach()).clone() for n, p in stage.named_parameters()}


def _gpt2(rank: int, backend: str, text: str):
    cfg = case_config("hf-gpt2-tied", (2, 1), 2, "1f1b", text)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=3))
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
    for step in range(STEPS):
        session.engine.train_step(step, next(batches))
    return session


def _widths(rank: int, world: int, backend: str, text: str, weights: str) -> list:
    """Per variant: the parameters (whole), and this rank's parameter bytes (its shards) with
    whether every parameter is a DTensor. The first variant's final weights go to ``weights``
    (--checkpoint), gathered from the shards."""
    out = []
    for v, variant in enumerate(VARIANTS[(world, backend)]):
        if variant == "gpt2-tied":
            session = _gpt2(rank, backend, text)
        else:
            shape, sync, changes = variant
            cfg = _config(shape, sync, {"zero": 3, **changes}, backend)
            session, _, _ = _run(cfg, rank)
            if v == 0:
                topo = Topology.from_config(cfg)
                group = session.groups.control
                final_weights.save_distributed(
                    weights, session.stage, topo, topo.coord(rank), group=group
                )
        params = list(session.stage.parameters())
        held = (sum(local_bytes(p) for p in params), all(is_sharded(p) for p in params))
        out.append((_whole(session), held))
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(Path(torch.__file__).with_name("functional.py").read_text()[:20000])
    return str(path)


@pytest.mark.parametrize("world,backend", list(VARIANTS), ids=[f"{w}-{b}" for w, b in VARIANTS])
def test_zero3_trains_as_one_process_at_every_width(world, backend, text, tmp_path):
    weights = str(tmp_path / "final.pt")
    results = run_world(world, _widths, backend, text, weights, backend=backend)
    # The final weights file holds every parameter whole, as the replicas gathered them.
    saved = ckpt.load(weights)
    gathered = {k: t for r in results for k, t in r[0][0].items()}
    assert set(gathered) <= set(saved) and gathered
    assert all(torch.equal(saved[k], t) for k, t in gathered.items())
    for v, variant in enumerate(VARIANTS[(world, backend)]):
        if variant == "gpt2-tied":
            cfg, tol = case_config("hf-gpt2-tied", (2, 1), 2, "1f1b", text), TOL
        else:
            shape, sync, changes = variant
            cfg = _config(shape, sync, changes, "gloo")
            tol = ADAMW_TOL if "optimizer" in changes else TOL
        ref = reference(cfg)
        topo = Topology.from_config(cfg)
        for rank, per_variant in enumerate(results):
            params, (held, sharded) = per_variant[v]
            assert set(params) <= set(ref) and params, f"{variant}: rank {rank} holds no stage"
            for name, value in params.items():
                err = (value - ref[name]).abs().max().item()
                assert err <= tol, f"{variant}: rank {rank} {name} off by {err:.2e}"
            assert sharded, f"{variant}: rank {rank} holds whole parameters"
        for stage in range(topo.num_stages):
            group = topo.stage_group(stage)
            whole = sum(v.numel() * 4 for v in results[group[0]][v][0].values())
            # Flat: each replica of the stage in every bundle holds a shard; hierarchical: each
            # replica in a bundle (the same replica of every bundle holds the same one).
            shards = len(group) if cfg.parallel.grad_sync == "flat" else topo.shape[stage]
            per_bundle = group if shards == len(group) else group[: topo.shape[stage]]
            assert sum(results[r][v][1][0] for r in per_bundle) == whole, (variant, stage)
            held = [results[r][v][1][0] for r in group]
            assert all(h < whole if shards > 1 else h == whole for h in held), (variant, stage)


def _resume(rank: int, world: int, save_dir: str):
    cfg = _config((2, 1), "flat", {"zero": 3, **ADAMW}, "gloo", steps=6, save_dir=save_dir)
    whole, saver, _ = _run(cfg, rank, save_at=3)
    resumed, _, _ = _run(cfg, rank, resume=saver.last_saved)
    a, b = _whole(whole), _whole(resumed)
    return saver.last_saved, all(torch.equal(a[n], b[n]) for n in a)


def _unsharded(rank: int, world: int, path: str, save_dir: str):
    cfg = _cfg((1, 1, 1), 1, steps=9, save_dir=save_dir, **ADAMW)
    session, saver, _ = _run(cfg, rank, resume=path, until=6, save_at=6)
    return _whole(session), saver.last_saved


def _sharded_again(rank: int, world: int, path: str):
    """``path`` resumed under --zero 3 and without it, at one shape."""
    out = []
    for zero in (3, 0):
        cfg = _config((2, 1), "hierarchical", {"zero": zero, **ADAMW}, "gloo", steps=9)
        session, _, _ = _run(cfg, rank, resume=path)
        out.append(_whole(session))
    return out


def test_a_zero3_checkpoint_resumes_bit_identical_and_at_another_shape_without_zero(tmp_path):
    results = run_world(6, _resume, str(tmp_path / "zero3"))
    assert all(same for _, same in results), "resumed --zero 3 run differs from the whole run"
    moved = run_world(3, _unsharded, results[0][0], str(tmp_path / "plain"))
    ref = reference(_cfg((1, 1, 1), 1, steps=6, **ADAMW))
    covered = set()
    for params, _ in moved:
        covered |= set(params)
        for name, value in params.items():
            assert (value - ref[name]).abs().max().item() <= ADAMW_TOL, name
    assert covered == set(ref)
    # And back: the unsharded checkpoint of step 6 resumed under --zero 3 (hierarchical) trains
    # on as without it. (Against one process, two legs of AdamW amplify the rounding of the
    # first beyond ADAMW_TOL: a checkpoint equal to 1e-4 drifts to 1e-2 in three more steps.)
    back = run_world(6, _sharded_again, moved[0][1])
    for rank, (sharded, plain) in enumerate(back):
        assert set(sharded) == set(plain) and sharded, rank
        for name, value in sharded.items():
            err = (value - plain[name]).abs().max().item()
            assert err <= ADAMW_TOL, f"rank {rank} {name} off by {err:.2e}"


COMPILED = [
    ("flat", {"compile": True, "compile_backend": "aot_eager", "recompute": "always"}),
    ("hierarchical", {"compile": True, "compile_backend": "aot_eager", "zero": 3}),
]


def _compiled(rank: int, world: int, save_dir: str) -> list:
    out = []
    for sync, changes in COMPILED:
        session, _, _ = _run(_config((2, 1), sync, changes, "gloo"), rank)
        out.append(_whole(session))
    # Saved compiled after step 3, resumed and trained on without compiling.
    compiled = _config((2, 1), "flat", COMPILED[0][1], "gloo", steps=6, save_dir=save_dir)
    _, saver, _ = _run(compiled, rank, save_at=3, until=3)
    plain = _cfg((2, 1), 2, steps=6, save_dir=save_dir)
    session, _, _ = _run(plain, rank, resume=saver.last_saved)
    out.append(_whole(session))
    return out


def test_compiled_blocks_train_as_one_process_and_resume_uncompiled(tmp_path):
    results = run_world(6, _compiled, str(tmp_path / "c"))
    refs = [reference(_cfg((2, 1), 2, sync)) for sync, _ in COMPILED]
    refs.append(reference(_cfg((2, 1), 2, steps=6)))
    for rank, per_variant in enumerate(results):
        for v, (params, ref) in enumerate(zip(per_variant, refs, strict=True)):
            for name, value in params.items():
                err = (value - ref[name]).abs().max().item()
                assert err <= TOL, f"variant {v}: rank {rank} {name} off by {err:.2e}"


def _inductor(rank: int, world: int) -> dict:
    changes = {"compile": True, "compile_backend": "inductor"}
    session, _, _ = _run(_config((1, 1), "flat", changes, "gloo", bundles=1), rank)
    return _whole(session)


def test_inductor_compiled_blocks_train_as_one_process():
    results = run_world(2, _inductor)
    ref = reference(_cfg((1, 1), 1))
    for rank, params in enumerate(results):
        for name, value in params.items():
            err = (value - ref[name]).abs().max().item()
            assert err <= TOL, f"rank {rank} {name} off by {err:.2e}"
