"""The data-parallel side against its yardsticks.

- ``--zero 1`` trains exactly as without it (one process on the unsplit model, 1e-5), flat and
  hierarchical, at two shapes, with SGD+momentum and AdamW; each replica holds only its share.
- A ``--zero 1`` checkpoint resumes bit-identical at its shape, and at another shape without
  ZeRO its Adam state arrives bit-identical and training lands on the yardstick (within 1e-4:
  AdamW magnifies fp32 rounding near zero gradients).
- ``--bundle-sync local:1`` with SGD is the every-step sync (bundles of equal batches), which pins
  each bundle's own-mean gradient and the averaging; a ``diloco`` run stopped mid-round resumes
  bit-identical, and at another shape within 1e-5.
- Compression: one step's gradient is within a stated bound of the exact one.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from bundle.config import CheckpointConfig, RunConfig
from bundle.engine import aggregate
from bundle.engine.optim import holder, state_bytes
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.support.processes import finish, start
from tests.support.reference import TOL, equivalence_config, reference


def _cfg(shape, bundles, sync="flat", *, steps=3, save_dir=None, **changes) -> RunConfig:
    """The equivalence job (uneven rows everywhere) with ``parallel``/``train`` changes."""
    cfg = equivalence_config(shape, bundles, "1f1b", 3, sync, "mlp")
    par = {k: v for k, v in changes.items() if hasattr(cfg.parallel, k)}
    train = {k: v for k, v in changes.items() if k not in par}
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **par),
        train=dataclasses.replace(cfg.train, steps=steps, **train),
        checkpoint=CheckpointConfig(save_dir=save_dir),
    )


def _params(session) -> dict[str, torch.Tensor]:
    stage = session.stage
    return {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}


def _optim_state(session) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state this rank holds, by full-model name."""
    stage, opt = session.stage, holder(session.optimizer)
    return {
        stage.full_name(n): {k: v.clone() for k, v in opt.state[p].items()}
        for n, p in stage.named_parameters()
        if opt.state.get(p)
    }


def _run(cfg: RunConfig, rank: int, *, resume=None, until=None, save_at=None):
    """Train ``cfg`` from ``resume`` (or scratch) to ``until``, saving after ``save_at``."""
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    until = until or cfg.train.steps
    if session.engine.outer is not None:
        session.engine.outer.total = cfg.train.steps
    saver = make_checkpointer(cfg, topo, rank, session)
    start = saver.restore(resume)
    loaded = (_params(session), _optim_state(session))
    batches = train_stream(session, topo, cfg.train.seed, cfg.train.steps, 0, start=start)
    for step in range(start, until):
        session.engine.train_step(step, next(batches))
        if step + 1 == save_at:
            saver.save(save_at)
            saver.saved_state = _optim_state(session)
    return session, saver, loaded


ADAMW_TOL = 1e-4

# -- ZeRO-1 ---------------------------------------------------------------------------------------

ZERO_VARIANTS = [
    ("flat", {}),
    ("hierarchical", {}),
    ("flat", {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}),
    # Two model chunks per stage: one optimizer, sharded, over both chunks' parameters.
    ("hierarchical", {"schedule": "interleaved-1f1b", "virtual_stages": 2}),
]


def _zero_variants(shape) -> list:
    """The variants a shape runs (interleaving needs two stages or more)."""
    return [v for v in ZERO_VARIANTS if len(shape) > 1 or "virtual_stages" not in v[1]]


def _zero(rank: int, world: int, shape, bundles) -> list:
    """Per variant: parameters with ZeRO, whether they equal those without it bit for bit, the
    names this rank holds state of, its optimizer bytes and those without ZeRO."""
    out = []
    for sync, train in _zero_variants(shape):
        plain, _, _ = _run(_cfg(shape, bundles, sync, **train), rank)
        sharded, _, _ = _run(_cfg(shape, bundles, sync, zero=1, **train), rank)
        a, b = _params(plain), _params(sharded)
        same = all(torch.equal(a[n], b[n]) for n in a)
        held = (state_bytes(sharded.optimizer), state_bytes(plain.optimizer))
        out.append((b, same, set(_optim_state(sharded)), held))
    return out


@pytest.mark.parametrize("shape,bundles", [((2, 1), 2), ((3,), 1)], ids=["2,1x2", "3x1"])
def test_zero_trains_exactly_as_one_process_and_shards_the_state(shape, bundles):
    results = run_world(sum(shape) * bundles, _zero, shape, bundles)
    topo = Topology.from_config(_cfg(shape, bundles))
    for v, (sync, train) in enumerate(_zero_variants(shape)):
        for stage in range(topo.num_stages):
            ranks = topo.stage_group(stage)
            owned = [results[r][v][2] for r in ranks]
            names = set(results[ranks[0]][v][0])
            # Each parameter's state on exactly one replica of the stage, and less than all on each.
            assert sorted(n for o in owned for n in o) == sorted(names), (sync, stage)
            assert all(len(o) < len(names) for o in owned), f"{sync}: stage {stage} not sharded"
            held = [results[r][v][3] for r in ranks]
            assert sum(h for h, _ in held) == held[0][1], f"{sync}: stage {stage} state bytes"
        for rank, per_variant in enumerate(results):
            assert per_variant[v][1], f"{sync} {train}: rank {rank} differs from without --zero"
        if "optimizer" in train:
            continue  # AdamW magnifies fp32 rounding near zero gradients: bit-exact to plain
        ref = reference(_cfg(shape, bundles, sync, **train))
        for rank, per_variant in enumerate(results):
            for name, value in per_variant[v][0].items():
                err = (value - ref[name]).abs().max().item()
                assert err <= TOL, f"{sync}: rank {rank} {name} off by {err:.2e}"


def _zero_resume(rank: int, world: int, save_dir: str):
    adamw = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}
    # Stage 0 has 4 replicas: summed in another order, a bucket laid out otherwise would round
    # differently (the flat sync fixes DDP's layout before the first step for this).
    cfg = _cfg((2, 1), 2, zero=1, steps=6, save_dir=save_dir, **adamw)
    whole, saver, _ = _run(cfg, rank, save_at=3)
    resumed, _, _ = _run(cfg, rank, resume=saver.last_saved)
    a, b = _params(whole), _params(resumed)
    same = all(torch.equal(a[n], b[n]) for n in a)
    return saver.last_saved, same, saver.saved_state


def _other_shape(rank: int, world: int, path: str, save_dir: str):
    adamw = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}
    cfg = _cfg((1, 1, 1), 1, steps=6, save_dir=save_dir, **adamw)
    session, _, (_, loaded) = _run(cfg, rank, resume=path)
    return loaded, _params(session)


@pytest.mark.slow
def test_a_zero_checkpoint_resumes_bit_identical_and_at_another_shape_without_zero(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_world(6, _zero_resume, save_dir)
    path = results[0][0]
    assert all(same for _, same, _ in results), "resumed --zero 1 run differs from the whole run"
    saved: dict[str, dict] = {}
    for _, _, state in results:
        saved.update(state)
    moved = run_world(3, _other_shape, path, str(tmp_path / "other"))
    adamw = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}
    ref = reference(_cfg((1, 1, 1), 1, steps=6, **adamw))
    covered = set()
    for loaded, final in moved:
        for name, slots in loaded.items():
            covered.add(name)
            for slot, value in slots.items():
                assert torch.equal(value, saved[name][slot]), f"{name}.{slot} not loaded exactly"
        for name, value in final.items():
            # AdamW divides by the root of tiny second moments: fp32 rounding of the uneven rows
            # grows to ~3e-5 in three steps; a lost or reset moment moves it by ~1e-3.
            assert (value - ref[name]).abs().max().item() <= ADAMW_TOL, name
    assert covered == set(ref) == set(saved)


# -- bundles that meet every H steps --------------------------------------------------------------


def _local(rank: int, world: int) -> dict:
    # 24 rows: two bundles of 12, so each bundle's own mean averages to the global mean.
    cfg = _cfg((2, 1), 2, bundle_sync="local:1", momentum=0.0, batch_size=24)
    session, _, _ = _run(cfg, rank)
    return _params(session)


def test_local_sgd_meeting_every_step_is_the_every_step_sync():
    results = run_world(6, _local)
    ref = reference(_cfg((2, 1), 2, momentum=0.0, batch_size=24))
    for rank, params in enumerate(results):
        for name, value in params.items():
            err = (value - ref[name]).abs().max().item()
            assert err <= TOL, f"rank {rank}: {name} off by {err:.2e}"


def _diloco(rank: int, world: int, save_dir: str, shape, resume: str | None):
    cfg = _cfg(shape, 2, bundle_sync="diloco:2", steps=5, save_dir=save_dir)
    session, saver, _ = _run(cfg, rank, resume=resume, save_at=None if resume else 3)
    state = {k: v.clone() for k, v in saver.state().items() if k.startswith("outer.")}
    return saver.last_saved, _params(session), session.coord.bundle, state


@pytest.mark.slow
def test_diloco_stopped_mid_round_resumes_bit_identical_and_at_another_shape(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    whole = run_world(4, _diloco, save_dir, (1, 1), None)
    path = whole[0][0]
    assert path.endswith("step-3") and whole[0][3], "the outer state is saved"
    again = run_world(4, _diloco, str(tmp_path / "same"), (1, 1), path)
    for (_, a, _, _), (_, b, _, _) in zip(whole, again, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name}: resumed diloco run differs"
    wider = run_world(6, _diloco, str(tmp_path / "wider"), (2, 1), path)
    final = {(bundle, n): v for _, params, bundle, _ in whole for n, v in params.items()}
    for _, params, bundle, _ in wider:
        for name, value in params.items():
            err = (value - final[(bundle, name)]).abs().max().item()
            assert err <= TOL, f"bundle {bundle}: {name} off by {err:.2e} at shape 2,1"


# -- compression ------------------------------------------------------------------------------------

# Per tensor, max |compressed - exact| <= BOUND x max |exact| after one step: each share rounds
# once to the dtype (unit roundoff u: 2^-9 bf16, 2^-12 fp16) and the 4-way sum rounds at most
# twice more, so 2^-5 (bf16) and 2^-8 (fp16) leave room for cancellation. PowerSGD projects the
# summed gradient on a rank-R subspace: the error never exceeds the gradient itself.
BOUND = {"bf16": 2.0**-5, "fp16": 2.0**-8}


def _compressed(rank: int, world: int, kind: str):
    plain = {"momentum": 0.0, "weight_decay": 0.0}
    cfg = _cfg((4,), 1, steps=1, grad_compression=kind, compression_warmup=0, **plain)
    session, _, _ = _run(cfg, rank)
    return _params(session), session.engine.sync.wire.ratio


def _one_step(kind: str) -> tuple[list, dict, dict]:
    """Each rank's parameters and wire ratio after one compressed step; the exact gradients."""
    results = run_world(4, _compressed, kind)
    cfg = _cfg((4,), 1, steps=1, momentum=0.0, weight_decay=0.0)
    init, grads = reference(cfg, 0), {}
    reference(cfg, 1, grads)
    lr = cfg.train.lr
    got = [({n: (init[n] - v) / lr for n, v in params.items()}, ratio) for params, ratio in results]
    return got, grads, init


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_one_half_precision_step_is_within_its_bound_of_exact(kind):
    got, exact, _ = _one_step(kind)
    for grads, ratio in got:
        assert ratio == 0.5
        for name, value in grads.items():
            err = (value - exact[name]).abs().max().item()
            scale = exact[name].abs().max().item()
            assert err <= BOUND[kind] * scale, f"{kind}: {name} off by {err:.2e} of {scale:.2e}"
    assert any((g[n] - exact[n]).abs().max() > 0 for g, _ in got for n in g), "nothing rounded"


def test_one_powersgd_step_projects_the_gradient():
    got, exact, _ = _one_step("powersgd")
    compressed = 0
    for grads, ratio in got:
        assert ratio < 0.5
        for name, value in grads.items():
            err = (value - exact[name]).norm().item()
            assert err <= exact[name].norm().item() * (1 + 1e-5) + 1e-7, name
            compressed += err > 1e-3 * exact[name].norm().item()
    assert compressed, "no tensor was approximated"


# -- a faulty bundle, end to end ------------------------------------------------------------------


@pytest.mark.slow
def test_a_bundle_sending_noise_is_outvoted_by_the_trimmed_mean(tmp_path):
    """4 bundles on digits, bundle 3's gradients replaced by noise from step 10: the mean is
    thrown off, the trimmed mean trains as if it were not there."""
    job = ["main.py", "--bundle-shape", "1,1", "--num-bundle", "4", "--itr", "80"]
    env = {**os.environ, aggregate.BYZANTINE_ENV: "3:noise:10"}
    accuracy = {}
    for rule in ("mean", "trimmed:1"):
        code, out, err = finish(start(*job, "--aggregate", rule, env=env), timeout=300)
        assert code == 0, err
        accuracy[rule] = json.loads(out.strip().splitlines()[-1])["val_accuracy"]
    assert accuracy["trimmed:1"] >= 0.85, accuracy
    assert accuracy["mean"] < accuracy["trimmed:1"] - 0.2, accuracy


# -- under NCCL's ordering --------------------------------------------------------------------------

EMU_VARIANTS = [
    ("flat", {"zero": 1, "grad_compression": "bf16", "compression_warmup": 1}),
    ("hierarchical", {"grad_compression": "powersgd", "compression_warmup": 1}),
    ("flat", {"aggregate": "median"}),
    ("flat", {"bundle_sync": "diloco:2"}),
]


def _every_hop(rank: int, world: int, backend: str) -> list:
    out = []
    for sync, changes in EMU_VARIANTS:
        cfg = _cfg((2, 1), 3, sync, **changes)
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, backend=backend))
        session, _, _ = _run(cfg, rank)
        out.append(_params(session))
    return out


@pytest.mark.slow
def test_every_hop_runs_alike_under_nccl_emu():
    """ZeRO, compression, robust aggregation and meetings every H steps post their collectives
    in an order NCCL's in-order streams complete, and compute what they compute on gloo."""
    emulated = run_world(9, _every_hop, "nccl-emu", backend="nccl-emu")
    plain = run_world(9, _every_hop, "gloo")
    for rank, (a, b) in enumerate(zip(emulated, plain, strict=True)):
        for v, (pa, pb) in enumerate(zip(a, b, strict=True)):
            for name in pa:
                assert torch.equal(pa[name], pb[name]), f"{EMU_VARIANTS[v]}: rank {rank} {name}"
