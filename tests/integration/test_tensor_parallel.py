"""Tensor parallelism, exact: a stage's layers split over its replica's processes
(``--tensor-parallel``) train as one process trains the unsplit model.

One world of four processes runs every layout of four: data parallel with TP 2 in each of two
bundles (Bundle's GPT, also under ZeRO-1, and a Hugging Face Llama by its own
``base_model_tp_plan``), two replicas of TP 2 in one bundle (uneven rows), pipelines with TP 2
on both stages (interleaved 1F1B; ``--compile`` with hierarchical sync under nccl-emu strict),
and two pipelines whose stages have different degrees (TP 1 then TP 2 under GPipe, TP 2 then TP 1
under nccl-emu in strict mode: a boundary between a group of one and a group of two, both ways), the Llama in a pipeline, cut at its own modules (``models.hf_chain``: TP 2,2 with its
embedding tied to its head across the stages, and TP 2,1 under nccl-emu strict), and
``--zero 3`` over TP 2 (FSDP over the replicas' processes of one TP index: two
replicas under nccl-emu strict, HSDP over two bundles). After 3 steps of SGD with momentum
every process's parameters (a split one against its shard of the reference) are where one
process's are (1e-5). A checkpoint written at TP 2,2
resumes at the same shape without tensor parallelism and as data parallel at TP 2, each then
where one process is after 5 steps; it resumes under ``--zero 3`` too, and one written at TP 2
under ``--zero 3`` resumes without either. With ``--lora`` (adapters split with their layers),
GPT as data parallel at TP 2 and the Llama cut at its modules at TP 2,1 (nccl-emu strict) end
where one process training the unsplit adapted model does, and a LoRA checkpoint written at TP 2
resumes without it, one written without it at TP 2. That the layers' sums are needed at all is
shown in tests/unit/test_tp.py and tests/unit/test_tp_lora.py (a rowwise layer without its sum,
a colwise layer's LoRA A without its gradient's sum, are off by far more).

A second world of ten processes runs the largest layout, `2,1` at degrees `2,1` in two bundles
(gloo; nccl-emu strict with hierarchical sync; ZeRO-1; ``--zero 3`` over HSDP; the Llama cut at its
modules), and GPT's checkpoint
resumes as three stages and as data parallel, both without tensor parallelism."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle.engine.sharded import full
from bundle.ir.schedule import REGISTRY
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.integration.test_any_model import text as text  # the module's corpus fixture
from tests.support.reference import STEPS, TOL, equivalence_config, reference, runnable_micro

pytestmark = pytest.mark.slow

MODELS = {
    "gpt": {"name": "gpt", "args": "layers=3,width=16,heads=2"},
    "gpt-1": {"name": "gpt", "args": "layers=1,width=16,heads=2"},  # compiled: one block to compile
    "hf-llama": {"name": "tests.support.user_models:llama_tp"},
    "hf-llama-tied": {"name": "tests.support.user_models:llama_tp_tied"},
    # --lora: adapters split with their layers (qkv packed, proj rowwise, mlp.0 colwise; a
    # split layer trained whole); the Llama's on every linear layer.
    "gpt-lora": {
        "name": "gpt",
        "args": "layers=3,width=16,heads=2",
        "lora": "r=4,alpha=16,targets=qkv,proj,mlp.0",
        "lora_train": "layers.2.mlp.2",
    },
    "hf-llama-lora": {
        "name": "tests.support.user_models:llama_tp",
        "lora": "r=4,alpha=64,targets=all-linear",
    },
}
# (model, shape, bundles, degrees, schedule, sync, backend)
LAYOUTS = [
    ("gpt", (1,), 2, (2,), "1f1b", "flat", "gloo"),
    ("hf-llama", (1,), 2, (2,), "gpipe", "flat", "gloo"),
    # Pipelined, cut at its modules (models.hf_chain): tied embedding and head across stages.
    ("hf-llama-tied", (1, 1), 1, (2, 2), "1f1b", "hierarchical", "gloo"),
    ("hf-llama", (1, 2), 1, (2, 1), "1f1b", "flat", "nccl-emu-strict"),
    ("gpt", (2, 1), 1, (1, 2), "gpipe", "flat", "gloo"),
    ("gpt", (1, 2), 1, (2, 1), "1f1b", "flat", "nccl-emu-strict"),
    ("gpt", (1, 1), 1, (2, 2), "interleaved-1f1b", "flat", "gloo"),
    ("gpt", (1,), 2, (2,), "1f1b", "flat", "gloo", {"zero": 1, "bucket_mb": 25.0}),
    ("gpt", (2,), 1, (2,), "1f1b", "hierarchical", "gloo"),
    # --zero 3: FSDP over the replicas' processes of the same TP index (strict: FSDP's gathers
    # and the layers' sums in one order on every communicator); HSDP over 2 bundles x 1.
    ("gpt", (2,), 1, (2,), "1f1b", "flat", "nccl-emu-strict", {"zero": 3}),
    ("gpt", (1,), 2, (2,), "1f1b", "hierarchical", "gloo", {"zero": 3}),
    ("gpt-lora", (1,), 2, (2,), "1f1b", "flat", "gloo"),
    ("hf-llama-lora", (1, 2), 1, (2, 1), "1f1b", "flat", "nccl-emu-strict"),
]


def _config(text: str, model: str, shape, bundles, degrees, schedule, sync, backend, more=None):
    data = {"dataset": "text", "seq_len": 8, "data_file": text}
    sections = {"model": MODELS[model], "data": data}
    chunks = 2 if REGISTRY[schedule].chunks else 1
    micro = runnable_micro(schedule, len(shape), 3, chunks)
    cfg = equivalence_config(
        shape, bundles, schedule, micro, sync, "mlp", sections=sections, chunks=chunks
    )
    strict = backend == "nccl-emu-strict"
    more = more or {}
    compute = {k: v for k, v in more.items() if hasattr(cfg.compute, k)}  # --compile
    return replace(
        cfg,
        parallel=replace(
            cfg.parallel, tensor_parallel=degrees, **{k: more[k] for k in more if k not in compute}
        ),
        compute=replace(cfg.compute, **compute),
        launch=replace(cfg.launch, backend="nccl-emu" if strict else backend, emu_strict=strict),
    )


# --compile: each stage's blocks compiled with their split layers in them, under nccl-emu's
# strict order (a one-block GPT: compiling is most of its cost). Run last, after the resumes.
COMPILED = (
    "gpt-1",
    (1, 1),
    1,
    (2, 2),
    "1f1b",
    "hierarchical",
    "nccl-emu-strict",
    {"compile": True, "compile_backend": "aot_eager"},
)

# A checkpoint written at the first layout (step 3 of 5) resumes at the others: whole tensors
# in the checkpoint, each process's shard taken on restore (momentum too).
RESUMES = [
    ("gpt", (1, 1), 1, (2, 2), "1f1b", "flat", "gloo"),
    ("gpt", (2, 2), 1, (1, 1), "1f1b", "flat", "gloo"),
    ("gpt", (1,), 2, (2,), "gpipe", "flat", "gloo"),
    ("gpt", (2,), 1, (2,), "gpipe", "flat", "gloo", {"zero": 3}),
]
# And a checkpoint written at TP 2 under --zero 3 (HSDP, 1 bundle x 2) resumes without either.
ZERO3_RESUMES = [
    ("gpt", (2,), 1, (2,), "gpipe", "hierarchical", "gloo", {"zero": 3}),
    ("gpt", (2, 2), 1, (1, 1), "1f1b", "flat", "gloo"),
]
# --lora: a checkpoint written at TP 2 resumes without it, and one written without it at TP 2
# (whole adapters and their momentum; the frozen base's digests are of its whole tensors).
LORA_RESUMES = [
    ("gpt-lora", (1,), 2, (2,), "gpipe", "flat", "gloo"),
    ("gpt-lora", (2, 2), 1, (1, 1), "1f1b", "flat", "gloo"),
]
LORA_RESUMES_BACK = [
    ("gpt-lora", (2, 2), 1, (1, 1), "1f1b", "flat", "gloo"),
    ("gpt-lora", (1, 1), 1, (2, 2), "1f1b", "hierarchical", "gloo"),
]


def _train(cfg, rank: int, steps: range, *, save_dir: str = "", resume: str = ""):
    topo = Topology.from_config(cfg)
    if save_dir:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, save_dir=save_dir))
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    if resume:
        make_checkpointer(cfg, topo, rank, session).restore(resume)
    batches = train_stream(session, topo, cfg.train.seed, steps.stop, 0, start=steps.start)
    for step in steps:
        session.engine.train_step(step, next(batches))
        if save_dir and step + 1 == STEPS:
            make_checkpointer(cfg, topo, rank, session).save(STEPS)
    # Whole over FSDP's mesh under --zero 3 (collective: every replica alike), the TP shard.
    mine = {k: full(v.detach()) for k, v in session.stage.full_state_dict().items()}
    coord = topo.coord(rank)
    return topo, (coord, topo.tp_of(coord.stage), mine, dict(session.split.specs))


def _layouts(rank: int, world: int, text: str, save_dir: str) -> list[str]:
    runs = [(layout, range(STEPS), {}) for layout in LAYOUTS]
    for i, chain in enumerate((RESUMES, ZERO3_RESUMES, LORA_RESUMES, LORA_RESUMES_BACK)):
        resume = {"resume": f"{save_dir}/{i}/step-{STEPS}"}
        runs.append((chain[0], range(STEPS + 2), {"save_dir": f"{save_dir}/{i}"}))
        runs += [(layout, range(STEPS, STEPS + 2), resume) for layout in chain[1:]]
    return _checked(rank, world, text, [*runs, (COMPILED, range(STEPS), {})])


def _checked(rank: int, world: int, text: str, runs: list) -> list[str]:
    """Each (layout, steps, how) of ``runs`` trained in turn, every process's parameters
    compared on rank 0 with one process's after as many steps."""
    failures: list[str] = []
    refs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for layout, steps, how in runs:
        cfg = _config(text, *layout)
        topo, mine = _train(cfg, rank, steps, **how)
        assert topo.world_size == world, layout
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            continue
        key = (layout[0], steps.stop)
        if key not in refs:
            refs[key] = reference(cfg, steps.stop)
        failures += _compare(f"{layout} {how or ''}", refs[key], gathered, max(layout[3]) > 1)
    return failures


def _compare(name: str, ref: dict[str, torch.Tensor], gathered, splits: bool) -> list[str]:
    failures, covered, split = [], set(), 0
    for coord, degree, params, specs in gathered:
        for key, value in params.items():
            want = ref[key]
            if key in specs:
                want, split = specs[key].local(want, coord.tp, degree), split + 1
            err = (value - want).abs().max().item() if value.shape == want.shape else float("inf")
            if err > TOL:
                failures.append(f"{name} {coord}: {key} off by {err:.2e}")
            covered.add(key)
    if covered != set(ref):
        failures.append(f"{name}: not covered: {sorted(set(ref) - covered)[:3]}")
    if splits and not split:
        failures.append(f"{name}: no parameter was split")
    return failures


def test_tensor_parallel_layouts_equal_one_process_and_resume_under_others(text, tmp_path):
    results = run_world(4, _layouts, text, str(tmp_path))
    assert results[0] == [], "\n".join(results[0])


# The largest layout: `2,1` at degrees `2,1` in two bundles (ten processes: two replicas of a
# TP-2 front and a rear of one, twice), under gloo, nccl-emu strict with hierarchical sync,
# ZeRO-1 and --zero 3 (HSDP), and the Llama cut at its modules; GPT's checkpoint resumed as
# three stages without tensor parallelism (three processes) and as data parallel without it
# (two).
TEN = [
    ("gpt", (2, 1), 2, (2, 1), "1f1b", "flat", "gloo"),
    ("gpt", (2, 1), 2, (2, 1), "1f1b", "hierarchical", "nccl-emu-strict"),
    ("gpt", (2, 1), 2, (2, 1), "gpipe", "flat", "gloo", {"zero": 1, "bucket_mb": 25.0}),
    ("gpt", (2, 1), 2, (2, 1), "1f1b", "hierarchical", "gloo", {"zero": 3}),
    ("hf-llama", (2, 1), 2, (2, 1), "1f1b", "flat", "gloo"),
]
TEN_RESUMES = [
    ("gpt", (1, 1, 1), 1, (1, 1, 1), "1f1b", "flat", "gloo"),
    ("gpt", (2,), 1, (1,), "1f1b", "flat", "gloo"),
]


def test_ten_processes_equal_one_process_and_resume_without_tensor_parallelism(text, tmp_path):
    saved = {"save_dir": str(tmp_path)}
    runs = [(layout, range(STEPS), {}) for layout in TEN] + [(TEN[0], range(STEPS + 2), saved)]
    failures = run_world(10, _checked, text, runs)[0]
    resume = {"resume": f"{tmp_path}/step-{STEPS}"}
    for layout in TEN_RESUMES:
        world = sum(layout[1]) * layout[2]
        failures += run_world(world, _checked, text, [(layout, range(STEPS, STEPS + 2), resume)])[0]
    assert failures == [], "\n".join(failures)
