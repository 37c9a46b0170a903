"""Several named inputs per batch: a masked BERT classifier (``input_ids``, ``attention_mask``,
``token_type_ids``, padded rows of uneven lengths) trained at shapes 1,1 and 2,1, under a plain
and an interleaving-free recomputing schedule, equals one process training the unsplit model on
the same batches (1e-5). Every stage after the first reads the mask from the data, rows aligned
with what it receives; the mask must matter: the same run without it is farther off than the
tolerance."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from bundle import preflight
from bundle.config import RunConfig
from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.support.reference import STEPS, TOL, equivalence_config, reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BERT = (
    "hidden_size=16,num_hidden_layers=2,num_attention_heads=2,intermediate_size=32,"
    "vocab_size=40,max_position_embeddings=16,hidden_dropout_prob=0.0,"
    "attention_probs_dropout_prob=0.0,initializer_range=0.5"
)
# (schedule, micro-batches, recompute)
VARIANTS = [("gpipe", 1, "never"), ("1f1b", 3, "always")]


def _config(shape, bundles, schedule, micro, recompute, dataset="masked_text") -> RunConfig:
    cfg = equivalence_config(
        shape,
        bundles,
        schedule,
        micro,
        "flat",
        "transformers:BertForSequenceClassification",
        recompute=recompute,
        sections={"data": {"dataset": f"tests.support.user_data:{dataset}", "num_classes": None}},
    )
    return replace(cfg, model=replace(cfg.model, args=BERT))


def _hybrid(rank: int, world: int, shape, bundles, captures) -> list[str]:
    failures = []
    for (schedule, micro, recompute), capture in zip(VARIANTS, captures, strict=True):
        cfg = _config(shape, bundles, schedule, micro, recompute)
        topo = Topology.from_config(cfg)
        session = build_session(cfg, topo, rank, torch.device("cpu"), capture=capture)
        reads = set(session.stage.side)
        batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
        for step in range(STEPS):
            session.engine.train_step(step, next(batches))
        mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((topo.coord(rank), mine, reads), gathered, dst=0)
        if rank != 0:
            continue
        ref = reference(_config((1,), 1, "gpipe", 1, "never"))
        unmasked = reference(_config((1,), 1, "gpipe", 1, "never", "masked_text_unmasked"))
        name = f"{shape} x{bundles} {schedule} M={micro} recompute {recompute}"
        seen: set[str] = set()
        for coord, params, reads in gathered:
            if coord.stage > 0 and "attention_mask" not in reads:
                failures.append(f"{name} {coord}: the stage reads no mask from the data")
            for key, value in params.items():
                if key not in ref:
                    continue  # a buffer (position ids)
                seen.add(key)
                err = (value - ref[key]).abs().max().item()
                if err > TOL:
                    failures.append(f"{name} {coord}: {key} off by {err:.2e}")
        if seen != set(ref):
            failures.append(f"{name}: parameters not covered: {set(ref) - seen}")
        off = max((unmasked[k] - ref[k]).abs().max().item() for k in ref)
        if off <= 10 * TOL:
            failures.append(
                f"{name}: the mask changes nothing ({off:.1e}); the test proves nothing"
            )
    return failures


@pytest.mark.parametrize(("shape", "bundles"), [((1, 1), 1), ((2, 1), 2)])
def test_a_masked_bert_classifier_equals_one_process(shape, bundles):
    # The split is made once by the launch's checks (with the data's example row), as a run does.
    captures = [preflight.check_model(_config(shape, bundles, *v), len(shape))[1] for v in VARIANTS]
    results = run_world(sum(shape) * bundles, _hybrid, shape, bundles, captures)
    assert results[0] == []
