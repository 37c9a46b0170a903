"""The planner's prediction of each ``bench_tp.py`` case, for the measured runs beside it.

Each case is costed as ``scripts/plan.py`` costs a plan for this machine (no ``--cluster``): the
model's blocks timed here at every batch size the plans need, the engine's overheads and the
loopback links measured (``bundle.plan.planner.cost_model``, cached under ``--profile-cache``
as plan.py's are), then the case's own layout simulated (``bundle.plan.plans.evaluate``): its
shape, TP degrees, the engine's split of ``gpt`` (``models.partition.resolve``) and main.py's
default of one micro-batch, AdamW. Each case is profiled with the threads each of its processes
has (a lone process every core's, as main.py runs it). The planner knows processes, not cores: a
case with more processes than the machine has cores (``pipe`` on two) runs slower than it
predicts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bundle import models
from bundle.config import parse_model_args
from bundle.models import partition
from bundle.plan import planner
from bundle.plan import profile as prof
from bundle.plan.plans import Plan, evaluate

VOCAB = 256  # --dataset text: byte-level tokens


def layouts(degree: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each ``bench_tp.cases`` case as (shape, degrees)."""
    return {
        "one": ((1,), ()),
        "tp": ((1,), (degree,)),
        "dp": ((degree,), ()),
        "pipe": ((1, 1), (degree, 1)),
        "rear": ((1, 1), (1, degree)),
    }


def _starts(model_args: str, seq_len: int, stages: int) -> tuple[int, ...]:
    """Where the engine cuts ``gpt`` into ``stages`` without ``--partition``."""
    with torch.device("meta"):
        model = models.build(
            "gpt", num_classes=VOCAB, input_shape=(seq_len,), args=parse_model_args(model_args)
        )
    return partition.resolve(None, models.blocks(model), stages, "gpt")


def predict(model_args: str, seq_len: int, batch: int, degree: int, cache_dir: str) -> dict:
    """Predicted samples/s of each case (``layouts``), planned for this machine."""
    out = {}
    for case, (shape, tp) in layouts(degree).items():
        procs = sum(w * t for w, t in zip(shape, tp or (1,) * len(shape), strict=True))
        request = planner.Request(
            model="gpt",
            batch=batch,
            nodes=1,
            per_node=procs,  # a lone process profiled with every core's threads, as it runs
            input_shape=(seq_len,),
            num_classes=VOCAB,
            optimizer="adamw",
            model_args=model_args,
        )
        cache = prof.ProfileCache(cache_dir or None)
        cost = planner.cost_model(request, cluster=None, cache=cache, progress=_say)
        plan = Plan(
            shape=shape,
            num_bundles=1,
            starts=_starts(model_args, seq_len, len(shape)),
            micro_batches=1,
            procs_per_node=procs,
            tp=tp,
        )
        out[case] = float(evaluate(cost, plan, batch).samples_per_s)
    return out


def _say(line: str) -> None:
    print(f"{Path(sys.argv[0]).name}: {line}", file=sys.stderr, flush=True)
