"""LoRA exact against PEFT: an adapter PEFT saved goes in with ``--lora-init``, and Bundle's
hybrid training of it on a frozen base ends where one process training ``peft.PeftModel`` on the
same global batches ends, with AdamW, for a tiny Llama and a tiny GPT-2 (whose ``Conv1D``
PEFT adapts transposed): the first step's gradient of every adapter within 1e-5, and after
3 steps every adapter within 1e-5 and every frozen weight exactly where it started.

The variants cover the shapes (1,1; 2,1 x 2 bundles; 1,2), both syncs, ZeRO-1 and ZeRO-3 (which
shards the frozen base too), 1F1B, GPipe, interleaving and ZBV (whose weight half has only the
adapters to compute), on gloo and under nccl-emu with its communicators one call at a time. A
world runs several variants, each a fresh session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bundle.checkpoint import format as ckpt
from bundle.engine.sharded import full
from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.integration.test_any_model import first_grads
from tests.support.reference import TOL, equivalence_config

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

USER = "tests.support.user_models"
MODELS = {"llama": ("q_proj", "v_proj", "down_proj"), "gpt2": ("c_attn", "c_proj")}
STEPS = 3
# (model, schedule, sync, zero, backend[, where stage 1 begins]) per world, by (shape, bundles).
# Stage 1 beginning at the first block leaves stage 0 the embeddings alone, nothing to train:
# no gradient reaches it, and stage 1 sends none back (bundle.ir.p2p.without_gradients).
WORLDS = {
    ((2, 1), 2): [
        ("llama", "1f1b", "flat", 0, "gloo"),
        ("gpt2", "zb-h1", "hierarchical", 1, "gloo", "transformer.h.0"),
        ("gpt2", "1f1b", "flat", 3, "gloo"),
    ],
    ((1, 1), 1): [
        ("llama", "gpipe", "flat", 0, "nccl-emu"),
    ],
    ((1, 2), 1): [
        ("gpt2", "zbv", "flat", 1, "strict"),
        ("llama", "1f1b", "hierarchical", 3, "strict", "model.layers.0"),
        ("llama", "interleaved-1f1b", "flat", 0, "strict"),
    ],
}


def lora_config(model, shape, bundles, schedule, sync, zero, backend, text, adapter, part=None):
    chunks = 2 if schedule in ("interleaved-1f1b", "zbv") else 1
    micro = 4 if chunks > 1 else 3
    cfg = equivalence_config(
        shape,
        bundles,
        schedule,
        micro,
        sync,
        "mlp",
        chunks=chunks,
        sections={
            "model": {"name": f"{USER}:{model}", "lora_init": adapter, "partition": part},
            "data": {"dataset": "text", "seq_len": 8, "data_file": text},
            "train": {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1, "momentum": 0.0},
            "parallel": {"zero": zero},
            "launch": {
                "backend": "nccl-emu" if backend == "strict" else backend,
                "emu_strict": backend == "strict",
            },
        },
    )
    return cfg


def variants(shape, bundles, setup) -> dict[str, tuple[str, object]]:
    """The world's variants by name: (model, config)."""
    text, adapters, _ = setup
    out = {}
    for model, schedule, sync, zero, backend, *part in WORLDS[(tuple(shape), bundles)]:
        name = f"{model} {schedule} {sync} zero{zero} {backend} {part}"
        out[name] = (
            model,
            lora_config(
                model, shape, bundles, schedule, sync, zero, backend, text, adapters[model], *part
            ),
        )
    return out


def captures(shape, bundles, setup) -> dict[str, object]:
    """Each variant's graph split, made once here as main.py's checks make it before launch,
    so that the world's processes load it instead of capturing the model each."""
    from bundle.preflight import check_model
    from bundle.topology import Topology as Topo

    made = {name: cfg for name, (_, cfg) in variants(shape, bundles, setup).items()}
    if (tuple(shape), bundles) in RESHAPE:
        made["reshape"] = reshape_config(shape, bundles, setup, "")
    return {
        name: check_model(cfg, Topo.from_config(cfg).num_stages * cfg.parallel.virtual_stages)[1]
        for name, cfg in made.items()
    }


def _world(
    rank: int, world: int, shape, bundles, setup, reshape, made
) -> tuple[list[str], str | None]:
    """Every variant of the world's shape against PEFT (from the graph splits ``made``); then
    the reshape's save (at 2,1 x 2) or its resume (at 1,1). Rank 0 returns the mismatches, and
    the checkpoint saved."""
    _, _, refs_file = setup
    failures: list[str] = []
    refs = torch.load(refs_file, weights_only=True)
    for name, (model, cfg) in variants(shape, bundles, setup).items():
        part = cfg.model.partition is not None  # stage 0: the embeddings alone, frozen
        topo = Topology.from_config(cfg)
        session = build_session(cfg, topo, rank, torch.device("cpu"), capture=made[name])
        grads = first_grads(session)
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.engine.train_step(step, next(batches))
        mine = {k: full(v).detach().clone() for k, v in session.stage.full_state_dict().items()}
        grads = {k: full(v) for k, v in grads.items()}
        if part and session.coord.stage == 0 and session.engine.runs_backward[0]:
            failures.append(f"{name}: the frozen stage 0 ran a backward")
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), mine, grads), gathered, dst=0)
        if rank != 0:
            continue
        init, ref, ref_grads = refs[model]
        covered: set[str] = set()
        for coord, params, got_grads in gathered:
            covered |= set(got_grads)
            for key, value in params.items():
                want = ref[key] if key in ref_grads else init[key]
                tol = TOL if key in ref_grads else 0.0
                err = (value - want).abs().max().item()
                if err > tol:
                    failures.append(f"{name} {coord}: {key} off by {err:.2e}")
            for key, value in got_grads.items():
                err = (value - ref_grads[key]).abs().max().item() if key in ref_grads else 1.0
                if err > TOL:
                    failures.append(f"{name} {coord}: gradient of {key} off by {err:.2e}")
        if covered != set(ref_grads):
            failures.append(f"{name}: trained {sorted(covered)[:3]}, PEFT {sorted(ref_grads)[:3]}")
    saved = _reshape(rank, world, shape, bundles, setup, reshape, refs["llama"], failures, made)
    return failures, saved


# The reshape: llama's adapters saved after SAVED steps at 2,1 x 2 bundles (1F1B, flat), resumed
# at 1,1 (GPipe, hierarchical) to STEPS: what trains and AdamW's state arrive bit for bit, the
# base's digests agree, and the end is PEFT's (1e-5) with the frozen base untouched.
SAVED = 2
RESHAPE = {((2, 1), 2): ("1f1b", "flat", SAVED), ((1, 1), 1): ("gpipe", "hierarchical", STEPS)}


def reshape_config(shape, bundles, setup, save_dir: str):
    """The reshape's run at ``shape``: llama, saving to (or resuming from) ``save_dir``."""
    from dataclasses import replace

    from bundle.config import CheckpointConfig

    text, adapters, _ = setup
    schedule, sync, steps = RESHAPE[(tuple(shape), bundles)]
    cfg = lora_config("llama", shape, bundles, schedule, sync, 0, "gloo", text, adapters["llama"])
    return replace(
        cfg, train=replace(cfg.train, steps=steps), checkpoint=CheckpointConfig(save_dir=save_dir)
    )


def _reshape(rank, world, shape, bundles, setup, reshape, refs, failures, made) -> str | None:
    from bundle.session import make_checkpointer

    if (tuple(shape), bundles) not in RESHAPE:
        return None
    save_dir, path = reshape
    cfg = reshape_config(shape, bundles, setup, save_dir)
    steps = cfg.train.steps
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"), capture=made["reshape"])
    saver = make_checkpointer(cfg, topo, rank, session)
    start = saver.restore(path)
    state = saver.state()  # what the checkpoint holds of this rank, as loaded
    loaded = {k: v.detach().clone() for k, v in state.items() if not k.startswith("base.")}
    batches = train_stream(session, topo, cfg.train.seed, steps, 0, start=start)
    for step in range(start, steps):
        session.engine.train_step(step, next(batches))
    if path is None:
        saver.save(steps)
        stored = ckpt.weights(saver.last_saved)
        stage = session.stage
        frozen = [stage.full_name(n) for n, p in stage.named_parameters() if not p.requires_grad]
        held = [k for k in frozen if k in stored]
        if not frozen or held:
            failures.append(f"reshape: frozen {len(frozen)}, in the checkpoint: {held[:2]}")
        return saver.last_saved
    init, ref, ref_grads = refs
    if start != SAVED:
        failures.append(f"reshape: resumed at step {start}, not {SAVED}")
    want = ckpt_entries(path)
    for k, v in loaded.items():
        if k in want and not torch.equal(v, want[k]):
            failures.append(f"reshape rank {rank}: {k} not loaded bit for bit")
    for name, value in session.stage.full_state_dict().items():
        target, tol = (ref[name], TOL) if name in ref_grads else (init[name], 0.0)
        err = (value - target).abs().max().item()
        if err > tol:
            failures.append(f"reshape rank {rank}: {name} off by {err:.2e} after resuming")
    return None


def ckpt_entries(path: str) -> dict[str, torch.Tensor]:
    """Every entry of checkpoint ``path`` (the model's, the optimizer's, the digests)."""
    import torch.distributed.checkpoint as dcp

    want = {k: torch.empty(s, dtype=d) for k, (s, d) in ckpt.entries(path).items()}
    dcp.load(want, storage_reader=ckpt.safe_reader(path), no_dist=True)
    return want


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The corpus, a PEFT adapter per model, and PEFT's run of each (init, end, first grads)."""
    from tests.support.lora_reference import peft_reference, save_adapter

    root = tmp_path_factory.mktemp("lora")
    text = root / "corpus.txt"
    text.write_text(Path(torch.__file__).with_name("functional.py").read_text()[:20000])
    adapters, refs = {}, {}
    for model, targets in MODELS.items():
        cfg = lora_config(model, (1,), 1, "gpipe", "flat", 0, "gloo", str(text), None)
        adapters[model] = save_adapter(cfg, str(root / model), r=4, alpha=8, targets=targets)
        cfg = lora_config(model, (1,), 1, "gpipe", "flat", 0, "gloo", str(text), adapters[model])
        grads: dict = {}
        ref = peft_reference(cfg, adapters[model], grads=grads)
        init = peft_reference(cfg, adapters[model], steps=0)
        moved = max((ref[k] - init[k]).abs().max().item() for k in grads)
        assert moved > 1e3 * TOL, f"{model}: PEFT's run hardly moved the adapters ({moved:.1e})"
        refs[model] = (init, ref, grads)
    torch.save(refs, root / "refs.pt")  # read by the world's rank 0 (no tensors through a pipe)
    return str(text), adapters, str(root / "refs.pt")


def test_lora_equals_peft_at_every_shape_and_resumes_under_another(setup, tmp_path):
    """The worlds in order: 2,1 x 2 (saving the reshape's checkpoint), 1,1 (resuming it), 1,2."""
    save_dir, path = str(tmp_path / "ckpt"), None
    for shape, bundles in WORLDS:
        made = captures(shape, bundles, setup)
        args = (shape, bundles, setup, (save_dir, path), made)
        results = run_world(sum(shape) * bundles, _world, *args)
        failures, saved = results[0]
        assert failures == [], "\n".join(failures)
        path = saved or path
    assert path is not None and path.endswith(f"step-{SAVED}")
