"""Gradient equivalence: hybrid training == one process training the unsplit model on the same batches.

For every shape x bundles x registered schedule x micro-batches x sync strategy, K steps of SGD with momentum
and weight decay give the same parameters (1e-5) on every replica of every stage. Global batches
are chosen so that bundle, micro-batch and replica row splits are uneven.

Every shape also runs mixed precision against a single process under the same autocast (fp16
with ``torch.amp.GradScaler``), and recompute against the same fp32 reference at 1e-5. Mixed
precision cannot match to 1e-5: the hybrid rounds each micro-batch's (and each replica's) weight
gradient to the compute dtype before the fp32 sum, where one process rounds once over the whole
batch. Those differences are a few units of the dtype's roundoff ``u`` of each step's update, so
the parameters must agree within ``8 u`` of how far training moved them (u = 2^-8 for bf16, 2^-11
for fp16; measured: at most 1.4 u). A hybrid that did not compute in the dtype at all is caught by
``_autocast_took_effect``: its distance from the fp32 reference must exceed the fp32 tolerance.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle import data, models
from bundle.collectives.nccl_emu import Emulator
from bundle.ir.schedule import REGISTRY, SCHEDULES
from bundle.launch.localworld import run_world
from bundle.row_weights import parse_row_weights
from bundle.session import build_session, train_stream
from bundle.topology import Topology, split_sizes
from tests.support.reference import STEPS, TOL, equivalence_config, reference, runnable_micro

SHAPES = [(1,), (2,), (1, 1), (2, 1), (1, 2), (2, 3), (1, 1, 1), (2, 2, 1)]
# (schedule, micro-batches, sync, precision, recompute)
VARIANTS = [
    *(
        (sch, m, sync, "fp32", "never")
        for sch, m, sync in itertools.product(SCHEDULES, (1, 3), ("flat", "hierarchical"))
        # One micro-batch is no case for chunks: ZBV runs it as 3 (2S - 1), interleaving as a
        # chain of chunks that M = 3 covers too.
        if m > 1 or not REGISTRY[sch].chunks
    ),
    ("1f1b", 3, "flat", "bf16", "never"),
    ("1f1b", 3, "hierarchical", "bf16", "except-last"),
    ("gpipe", 3, "flat", "fp16", "never"),
    ("1f1b", 3, "hierarchical", "fp32", "always"),
    ("zb-h1", 3, "flat", "fp32", "always"),  # a split backward recomputes for each half
    ("interleaved-1f1b", 3, "flat", "bf16", "except-last"),  # per chunk: its own keep list
    ("zbv", 3, "hierarchical", "fp32", "always"),  # the V's turn handed over recomputed
]
# Model chunks per stage of the schedules that interleave (--virtual-stages).
CHUNKS = 2
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
STRICT = "nccl-emu-strict"  # nccl-emu with --nccl-emu-strict


def _hybrid(
    rank: int,
    world: int,
    shape,
    bundles,
    backend: str = "auto",
    row_weights: str = "",
    variants=VARIANTS,
) -> list[str]:
    """Runs every variant in one world of processes; rank 0 returns the mismatches found."""
    failures, refs = [], {}
    for schedule, micro, sync, precision, recompute in variants:
        chunks = CHUNKS if REGISTRY[schedule].chunks else 1
        if chunks > 1 and len(shape) < 2:
            continue  # interleaving needs stages to interleave over
        micro = runnable_micro(schedule, len(shape), micro, chunks)
        # skip_mlp's 5 blocks carry two tensors across boundaries; mlp has 6 for 6 pieces.
        skips = len(shape) > 1 and micro == 3 and len(shape) * chunks <= 5
        model = "skip_mlp" if skips else "mlp"
        cfg = equivalence_config(
            shape, bundles, schedule, micro, sync, model, precision, recompute, chunks=chunks
        )
        strict = backend == STRICT  # nccl-emu, its communicators one call at a time
        cfg = replace(
            cfg,
            launch=replace(
                cfg.launch, backend="nccl-emu" if strict else backend, emu_strict=strict
            ),
            parallel=replace(cfg.parallel, row_weights=row_weights),
        )
        name = f"{schedule} V={chunks} M={micro} {sync} {precision} recompute {recompute} {model}"
        name += f" rows {row_weights}" if row_weights else ""
        topo = Topology.from_config(cfg)
        session = build_session(cfg, topo, rank, torch.device("cpu"))
        emulated = isinstance(
            getattr(session.engine.transport._post_call, "__self__", None), Emulator
        )
        assert emulated == backend.startswith("nccl-emu"), f"{backend}: emulated is {emulated}"
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.engine.train_step(step, next(batches))
        mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), mine), gathered, dst=0)
        if rank != 0:
            continue
        for key in {(model, "fp32"), (model, precision), (model, "init")} - set(refs):
            fp = "fp32" if key[1] == "init" else key[1]
            refs[key] = reference(
                equivalence_config((1,), 1, "gpipe", 1, "flat", model, fp),
                0 if key[1] == "init" else None,
            )
        ref, init = refs[(model, precision)], refs[(model, "init")]
        tol = TOL
        if precision in UNIT_ROUNDOFF:
            moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
            tol = 8 * UNIT_ROUNDOFF[precision] * moved
        hybrid = {}
        for coord, params in gathered:
            for key, value in params.items():
                hybrid.setdefault(key, value)
                err = (value - ref[key]).abs().max().item()
                if err > tol:
                    failures.append(f"{name} {coord}: {key} off by {err:.2e} (tolerance {tol:.2e})")
        if set(hybrid) != set(ref):
            failures.append(f"{name}: parameters not covered: {set(ref) - set(hybrid)}")
        elif precision != "fp32" and not _autocast_took_effect(hybrid, refs[(model, "fp32")]):
            failures.append(f"{name}: matches the fp32 reference; the compute dtype was not used")
    return failures


def _autocast_took_effect(hybrid: dict, fp32_ref: dict) -> bool:
    return max((hybrid[k] - fp32_ref[k]).abs().max().item() for k in fp32_ref) > TOL


@pytest.mark.slow
@pytest.mark.parametrize("bundles", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: ",".join(map(str, s)))
def test_hybrid_equals_single_process(shape, bundles):
    results = run_world(sum(shape) * bundles, _hybrid, shape, bundles)
    assert results[0] == [], "\n".join(results[0])


# Under NCCL's ordering (bundle.collectives.nccl_emu): uneven widths, three stages and several bundles, with
# every variant above (every registered schedule, both syncs, skip connections, bf16 and fp16 on the wire); two
# of the cases with each process's communicators one call at a time (--nccl-emu-strict), as NCCL
# may run them.
EMU_CASES = [((1, 1), 2, "nccl-emu"), ((2, 3), 1, STRICT), ((1, 1, 1), 1, "nccl-emu")]
EMU_CASES += [((2, 2, 1), 2, STRICT)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,bundles,backend",
    EMU_CASES,
    ids=[f"{','.join(map(str, s))}-{b}{'-strict' if e == STRICT else ''}" for s, b, e in EMU_CASES],
)
def test_hybrid_equals_single_process_under_nccl_emu(shape, bundles, backend):
    results = run_world(sum(shape) * bundles, _hybrid, shape, bundles, backend)
    assert results[0] == [], "\n".join(results[0])


# Model chunks under NCCL's ordering at four micro-batches (two rounds of interleaving; ZBV past
# its 2S - 1): the lockstep calls, the wrap from the last stage to the first, the V's turn.
CHUNKED_VARIANTS = [
    (name, 4, sync, "fp32", "never")
    for name, s in REGISTRY.items()
    if s.chunks
    for sync in ("flat", "hierarchical")
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1), (2, 1)], ids=["1,1", "2,1"])
def test_model_chunks_equal_single_process_under_nccl_emu_at_four_micro_batches(shape):
    results = run_world(sum(shape), _hybrid, shape, 1, "nccl-emu", "", CHUNKED_VARIANTS)
    assert results[0] == [], "\n".join(results[0])


# Rows by speed (--row-weights): each replica's share of a micro-batch follows its weight, so the
# row ranges differ from the even split on every boundary (4 rows at 3:1 -> 3/1, at 1:1:2 -> 1/1/2,
# 4 rows at 1:2 -> 1/3), through every registered schedule and both syncs with three micro-batches of 4/4/3 rows
# (two row plans per boundary); the wider case under NCCL's ordering, communicators one at a time.
WEIGHTED_CASES = [((2, 1), "3:1,1", "auto"), ((3, 2), "1:1:2,1:2", STRICT)]
WEIGHTED_VARIANTS = [v for v in VARIANTS if v[1] == 3 and v[3] == "fp32" and v[4] == "never"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,weights,backend", WEIGHTED_CASES, ids=[f"{w}-{b}" for _, w, b in WEIGHTED_CASES]
)
def test_weighted_rows_equal_single_process(shape, weights, backend):
    topo = Topology(
        shape=shape,
        num_bundles=2,
        procs_per_node=1,
        global_batch=23,
        micro_batches=3,
        row_weights=parse_row_weights(weights, shape),
    )
    for stage, width in enumerate(shape):  # the weights move rows on every stage
        assert topo.stage_sizes(stage, 4) != split_sizes(4, width) or width == 1
    results = run_world(sum(shape) * 2, _hybrid, shape, 2, backend, weights, WEIGHTED_VARIANTS)
    assert results[0] == [], "\n".join(results[0])


def test_reference_moves_parameters():
    """The comparison is not vacuous: training changes the parameters well beyond the tolerance."""
    cfg = equivalence_config((1,), 1, "gpipe", 1, "flat", "mlp")
    splits = data.load(cfg.data, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    init = dict(
        models.build(
            "mlp", num_classes=splits.num_classes, input_shape=splits.input_shape
        ).named_parameters()
    )
    trained = reference(cfg)
    assert max((trained[k] - init[k]).abs().max().item() for k in init) > 1e3 * TOL
