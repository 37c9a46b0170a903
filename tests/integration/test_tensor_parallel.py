"""Tensor parallelism, exact: a stage's layers split over its replica's processes
(``--tensor-parallel``) train as one process trains the unsplit model.

One world of four processes runs every layout of four: data parallel with TP 2 in each of two
bundles (Bundle's GPT and a Hugging Face Llama, its own ``base_model_tp_plan``), a pipeline with
TP 2 on both stages (hierarchical sync), and two pipelines whose stages have different degrees
(TP 1 then TP 2, TP 2 then TP 1: a boundary between a group of one and a group of two, both
ways), under GPipe and 1F1B, one also under nccl-emu in strict mode. After 3 steps of SGD with
momentum every process's parameters (a split one against its shard of the reference) are where
one process's are (1e-5). That the layers' sums are needed at all is shown in
tests/unit/test_tp.py (a rowwise layer without its sum is off by far more)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.integration.test_any_model import text as text  # the module's corpus fixture
from tests.support.reference import STEPS, TOL, equivalence_config, reference

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
]


def _config(text: str, model: str, shape, bundles, degrees, schedule, sync, backend):
    data = {"dataset": "text", "seq_len": 8, "data_file": text}
    sections = {"model": MODELS[model], "data": data}
    cfg = equivalence_config(shape, bundles, schedule, 3, sync, "mlp", sections=sections)
    strict = backend == "nccl-emu-strict"
    return replace(
        cfg,
        parallel=replace(cfg.parallel, tensor_parallel=degrees),
        launch=replace(cfg.launch, backend="nccl-emu" if strict else backend, emu_strict=strict),
    )


def _layouts(rank: int, world: int, text: str) -> list[str]:
    failures: list[str] = []
    refs: dict[str, dict[str, torch.Tensor]] = {}
    for layout in LAYOUTS:
        cfg = _config(text, *layout)
        topo = Topology.from_config(cfg)
        assert topo.world_size == world, layout
        session = build_session(cfg, topo, rank, torch.device("cpu"))
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.engine.train_step(step, next(batches))
        mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
        specs = dict(session.split.specs)
        degree = topo.tp_of(topo.coord(rank).stage)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), degree, mine, specs), gathered, dst=0)
        if rank != 0:
            continue
        case = layout[0]
        if case not in refs:
            refs[case] = reference(cfg)
        failures += _compare(f"{layout}", refs[case], gathered)
    return failures


def _compare(name: str, ref: dict[str, torch.Tensor], gathered) -> list[str]:
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
    if not split:
        failures.append(f"{name}: no parameter was split")
    return failures


def test_tensor_parallel_layouts_equal_one_process(text):
    results = run_world(4, _layouts, text)
    assert results[0] == [], "\n".join(results[0])
