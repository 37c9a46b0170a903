"""What a tensor-parallel sum costs inside a step on this machine, fitted on the engine.

The calibration's two gloo processes (``bundle.plan.calibrate``) also run Bundle's GPT (``SPEC``:
2 layers of width 128, 32 tokens, 16 rows) as one replica split over both (shape ``1`` at
``--tensor-parallel 2``), each step started together and alternating with profile passes of the
unsplit model on both processes at once (so the profile meets the load the step does). The
planner charges each of a split block's sums its ring all-reduce over the collective link
(``bundle.plan.tensor``) and ``Overheads.tp_sum`` on top: the cost per sum that makes the
simulated step as slow as the measured one (``fit_tp_sum``).

Why a sum costs more in a step than between idle processes: its two processes come to it busy,
each from its own matmul, so a sum waits for the slower one and for both sides' gloo threads to
get a core; on two cores a 1 MB sum measured 2.5-3.3 ms inside TP steps against 0.67 ms after a
barrier (docs/tensor-parallel.md).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from bundle.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from bundle.plan import profile as prof
from bundle.plan import tensor
from bundle.plan.anatomy import ModelSpec, count
from bundle.plan.cluster import Cluster
from bundle.plan.cost import CostModel, Execution, Overheads
from bundle.plan.simulate import Layout, simulate
from bundle.topology import Topology

DEGREE = 2
VOCAB = 256  # --dataset text: byte-level tokens
SEQ = 32
ROWS = 16
ARGS = "layers=2,width=128,heads=4"
SPEC = ModelSpec("gpt", (SEQ,), VOCAB, ARGS)
_CPU = torch.device("cpu")


def _corpus(folder: str) -> str:
    """A text file of seeded printable bytes for ``--dataset text`` (this rank's own)."""
    gen = torch.Generator().manual_seed(0)
    data = bytes(torch.randint(32, 127, (64 * ROWS * SEQ,), generator=gen).tolist())
    path = os.path.join(folder, "corpus.txt")
    with open(path, "wb") as f:
        f.write(data)
    return path


class TensorSteps:
    """The engine running ``SPEC`` at shape ``1``, ``--tensor-parallel 2``; on ranks 0 and 1."""

    def __init__(self, rank: int) -> None:
        from bundle.session import build_session, train_stream

        with tempfile.TemporaryDirectory(prefix="bundle-tp-probe-") as folder:
            cfg = RunConfig(
                parallel=ParallelConfig(shape=(1,), tensor_parallel=(DEGREE,)),
                model=ModelConfig(name=SPEC.name, args=ARGS),
                data=DataConfig(dataset="text", data_file=_corpus(folder), seq_len=SEQ),
                train=TrainConfig(batch_size=ROWS, steps=2, eval=False),
            )
            topo = Topology.from_config(cfg)
            session = build_session(cfg, topo, rank, _CPU)
            stream = train_stream(session, topo, cfg.train.seed, cfg.train.steps, 0)
            self.batches = [next(stream) for _ in range(cfg.train.steps)]
        self.runner = session.engine
        torch.manual_seed(0)  # the unsplit model's passes, as ``profile`` times them
        self.passes = prof.Passes(SPEC.build(), SPEC.input_shape, VOCAB, ROWS, _CPU)

    def step(self, i: int) -> None:
        self.runner.train_step(i, self.batches[i % len(self.batches)])

    def measure(self, reps: int = 11, warmup: int = 2) -> dict:
        """Steps from a common start, each after a profile pass on both processes."""
        times = []
        for i in range(warmup + reps):
            self.passes()
            dist.barrier()
            t0 = time.perf_counter()
            self.step(i)
            times.append(time.perf_counter() - t0)
        del self.passes.passes[:warmup]
        timings = self.passes.timings()
        return {"step": statistics.median(times[warmup:]), "timings": asdict(timings)}


def fit_tp_sum(overheads: Overheads, cluster: Cluster, measured: dict) -> Overheads:
    """``overheads`` with the cost per TP sum (beyond its all-reduce over ``cluster``'s links) that
    makes the simulated probe step as slow as ``measured`` (``TensorSteps.measure``'s)."""
    anatomy = count(SPEC)
    timings = prof.Timings(**measured["timings"])
    split = tensor.split_of(SPEC, len(anatomy.blocks))
    layout = Layout((1,), 1, (0,), 1, "1f1b", "flat", ROWS, DEGREE, tp=(DEGREE,))

    def step(per_sum: float) -> float:
        cost = CostModel(
            anatomy=anatomy,
            cluster=cluster,
            timings=timings,
            overheads=replace(overheads, tp_sum=per_sum),
            execution=Execution(overlap=False),
        )
        return simulate(layout, tensor.Splittable.of(cost, split)).step_time

    return replace(overheads, tp_sum=matching(step, measured["step"], 0.02))


def matching(step: Callable[[float], float], target: float, most: float) -> float:
    """The cost in [0, ``most``] at which ``step`` (growing with it) reaches ``target``: bisected;
    0 where the step is slower than ``target`` without it."""
    low, high = 0.0, most
    if step(low) >= target:
        return 0.0
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < target else (low, mid)
    return low
