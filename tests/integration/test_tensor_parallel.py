"""Tensor parallelism, exact: a stage's layers split over its replica's processes
(``--tensor-parallel``) train as one process trains the unsplit model.

One world of four processes runs every layout of four: data parallel with TP 2 in each of two
bundles (Bundle's GPT, also under ZeRO-1, and a Hugging Face Llama by its own
``base_model_tp_plan``), two replicas of TP 2 in one bundle (uneven rows), pipelines with TP 2 on both stages (hierarchical sync; interleaved
1F1B), and two pipelines whose stages have different degrees (TP 1 then TP 2 under GPipe, TP 2
then TP 1 under nccl-emu in strict mode: a boundary between a group of one and a group of two,
both ways). After 3 steps of SGD with momentum every process's parameters (a split one against
its shard of the reference) are where one process's are (1e-5). A checkpoint written at TP 2,2
resumes at the same shape without tensor parallelism and as data parallel at TP 2, each then
where one process is after 5 steps. That the layers' sums are needed at all is shown in
tests/unit/test_tp.py (a rowwise layer without its sum is off by far more)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle.ir.schedule import REGISTRY
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from tests.integration.test_any_model import text as text  # the module's corpus fixture
from tests.support.reference import STEPS, TOL, equivalence_config, reference, runnable_micro

pytestmark = pytest.mark.slow

MODELS = {
    "gpt": {"name": "gpt", "args": "layers=3,width=16,heads=2"},
    "hf-llama": {"name": "tests.support.user_models:llama_tp"},
}
# (model, shape, bundles, degrees, schedule, sync, backend)
LAYOUTS = [
    ("gpt", (1,), 2, (2,), "1f1b", "flat", "gloo"),
    ("hf-llama", (1,), 2, (2,), "gpipe", "flat", "gloo"),
    ("gpt", (1, 1), 1, (2, 2), "1f1b", "hierarchical", "gloo"),
    ("gpt", (2, 1), 1, (1, 2), "gpipe", "flat", "gloo"),
    ("gpt", (1, 2), 1, (2, 1), "1f1b", "flat", "nccl-emu-strict"),
    ("gpt", (1, 1), 1, (2, 2), "interleaved-1f1b", "flat", "gloo"),
    ("gpt", (1,), 2, (2,), "1f1b", "flat", "gloo", {"zero": 1, "bucket_mb": 25.0}),
    ("gpt", (2,), 1, (2,), "1f1b", "hierarchical", "gloo"),
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
    return replace(
        cfg,
        parallel=replace(cfg.parallel, tensor_parallel=degrees, **(more or {})),
        launch=replace(cfg.launch, backend="nccl-emu" if strict else backend, emu_strict=strict),
    )


# A checkpoint written at the first layout (step 3 of 5) resumes at the others: whole tensors
# in the checkpoint, each process's shard taken on restore (momentum too).
RESUMES = [
    ("gpt", (1, 1), 1, (2, 2), "1f1b", "flat", "gloo"),
    ("gpt", (2, 2), 1, (1, 1), "1f1b", "flat", "gloo"),
    ("gpt", (1,), 2, (2,), "gpipe", "flat", "gloo"),
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
    mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
    coord = topo.coord(rank)
    return topo, (coord, topo.tp_of(coord.stage), mine, dict(session.split.specs))


def _layouts(rank: int, world: int, text: str, save_dir: str) -> list[str]:
    failures: list[str] = []
    refs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    runs = [(layout, range(STEPS), {}) for layout in LAYOUTS]
    resume = {"resume": f"{save_dir}/step-{STEPS}"}
    runs.append((RESUMES[0], range(STEPS + 2), {"save_dir": save_dir}))
    runs += [(layout, range(STEPS, STEPS + 2), resume) for layout in RESUMES[1:]]
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
