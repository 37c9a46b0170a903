"""Benchmark Bundle on gloo/CPU against torch.distributed.pipelining and DDP, as ratios from one run.

Every process runs one thread (``torch.set_num_threads(1)``) and talks gloo over loopback. Two
worlds are started, one after the other:

- ``pipeline`` (2 processes): shape 1,1 with Bundle 1F1B over a sweep of micro-batch counts for an
  MLP and a small CNN, Bundle GPipe and ZB-H1, and torch.distributed.pipelining (ScheduleGPipe,
  Schedule1F1B, ScheduleInterleavedZeroBubble: ZB-H1 with one stage per rank) on the same split,
  global batch and micro-batches; then Bundle data-parallel only
  (shape 2, flat sync, one micro-batch) against a plain DistributedDataParallel loop on the same
  model and global batch;
- ``bundles`` (4 processes): two bundles of shape 1,1 with flat against hierarchical gradient sync,
  and the flat sync posting its last gradient send before it waits for the stage's all-reduce
  against waiting first (``flat_send_first_vs_waited``).

The ``pipeline`` world also times bf16 against fp32 (small_resnet and the MLP), and recompute=always
and channels-last against neither (small_resnet), at shape 1,1, 1F1B, M = 8, in groups of their
own; after its timed rounds ``bench_memory`` counts exactly, on separate untimed steps, the bytes
each stage holds saved for backward at their peak over a step, for small_resnet under GPipe and
1F1B with the recompute modes.

Inside a world the cases come in groups: the cases compared with each other (Bundle and torch
pipelining at M = 8; Bundle data-parallel and DDP; flat and hierarchical sync; small_resnet fp32,
bf16, recompute and channels-last; MLP fp32 and bf16) form one group, every other case a group of
its own. Each round runs every group once, in an order reversed every other round; a group runs untimed warm-up steps of each case, then its cases' timed steps
interleaved step by step, in an order that alternates (A B, B A, ...), so the steps compared meet
the same moment of a shared machine. Step time is the median of the timed steps of the first rank
(stage 0 of bundle 0), and throughput is global batch / median step time. After its steps every
Bundle case times a copy of each rank's stage alone (no p2p, no gradient sync) on one
micro-batch's forward+backward, one rank at a time while the others wait idle: ``t_s`` is the
median of those repetitions.

Headline ratios are paired: a throughput ratio is the median over the ratios of two steps run
side by side; pipeline efficiency is the median over rounds of ``(M + S - 1) * max_s t_s`` / the
round's median step time, with ``t_s`` timed in that round. A burst of load from a neighbour then
slows both sides of a pair, or falls out as one outlying pair, instead of landing on one side only.
Ratios above 1 mean Bundle is faster (bf16_vs_fp32: bf16 faster; channels_last_vs_default:
channels-last faster; recompute_cost is a step-time ratio, above 1 when recomputing is slower).

Every rank also records its CPU seconds per step (process time, all threads) and the stage
probes their thread CPU time, to read results taken on a busy shared machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import bench_memory
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_report import build_report, render, summarize
from torch import nn

from bundle import data, models
from bundle.config import (
    ComputeConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from bundle.engine.stage_engine import build_stages
from bundle.engine.transport import TensorMeta
from bundle.ir.schedule import REGISTRY
from bundle.launch import localworld
from bundle.observe.timing import Mark, StepTimer
from bundle.session import Session, build_session, train_stream
from bundle.topology import (
    Topology,
    split_sizes,
)

CPU = torch.device("cpu")
# The schedules that run model chunks: benchmarked with two per stage, against torch's.
CHUNKED = tuple(n for n, s in REGISTRY.items() if s.chunks)
NUM_CLASSES = 10
LR, MOMENTUM = 0.01, 0.9
SEED = 0
DATA_STEPS = 4  # distinct global batches fetched before timing and cycled through
# The shipped small_resnet split [stem, res.0, res.1 | res.2, ...]: about equal halves on a CPU at
# the sweep's small micro-batches (the automatic, parameter-balanced cut puts nearly all of the
# convolution time in stage 0).
CNN_PARTITION = "small_resnet_2stage"


@dataclass(frozen=True)
class Sizes:
    """Every size the benchmark uses; fixed per mode so that runs are comparable."""

    # mlp_wide: 4 hidden layers of width 1024; a 3x18x18 input (972 features) makes the automatic
    # split [flatten, hidden.0, hidden.1 | hidden.2, hidden.3, head] balanced (about 2M
    # parameters each side), and a micro-batch's compute large next to one p2p message.
    mlp_model: str = "mlp_wide"
    mlp_image: int = 18
    mlp_batch: int = 512
    mlp_micro: tuple[int, ...] = (1, 2, 4, 8, 16)
    cnn_batch: int = 64
    cnn_micro: tuple[int, ...] = (1, 2, 4, 8, 16)
    compare_micro: int = 8  # micro-batches of the Bundle-vs-torch and flat-vs-hierarchical cases
    # Fewer micro-batches, where 1F1B's bubble is a larger part of the step (1/5 at M=4 on two
    # stages): ZB-H1 against 1F1B there too, in the sweep (which runs 1F1B at every M above).
    few_micro: int = 4
    rounds: int = 8
    warmup: int = 1  # untimed steps per case per round (one more in the first round)
    steps: int = 15  # timed steps per case per round
    stage_reps: int = 9  # lone-stage timings per case per round (after one untimed)


PRESETS = {
    "full": Sizes(),
    "quick": Sizes(rounds=4, steps=10, stage_reps=5),
    "smoke": Sizes(
        mlp_model="mlp",
        mlp_image=11,
        mlp_batch=256,
        cnn_batch=16,
        cnn_micro=(1, 8),
        rounds=1,
        steps=2,
        stage_reps=2,
    ),
}


# -- process worlds ---------------------------------------------------------------------------


def run_world(world: int, fn: Callable, *args, timeout: float = 600.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo processes, forked: this parent runs no torch op."""
    return localworld.run_world(world, fn, *args, timeout=timeout, start_method="fork")


# -- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One measured configuration on this rank: a training step and an optional stage probe."""

    name: str
    step: Callable[[int], None]
    probe: Callable[[], tuple[float, float]] | None = None
    session: Session | None = None
    info: dict = field(default_factory=dict)


def make_cfg(
    sizes: Sizes,
    model: str,
    *,
    micro: int,
    shape: tuple[int, ...] = (1, 1),
    bundles: int = 1,
    schedule: str = "1f1b",
    sync: str = "flat",
    spec: str | None = None,
    precision: str = "fp32",
    recompute: str = "never",
    channels_last: bool = False,
    chunks: int = 1,
) -> RunConfig:
    """The run configuration of one case (synthetic data, no evaluation); ``chunks``: model
    chunks per stage (--virtual-stages)."""
    if model == sizes.mlp_model:
        image, batch = sizes.mlp_image, sizes.mlp_batch
    else:
        image, batch = 32, sizes.cnn_batch
    return RunConfig(
        parallel=ParallelConfig(
            shape=shape,
            num_bundles=bundles,
            micro_batches=micro,
            schedule=schedule,
            virtual_stages=chunks,
            grad_sync=sync,
        ),
        model=ModelConfig(name=model, partition=spec),
        data=DataConfig(
            dataset="synthetic",
            image_size=image,
            num_classes=NUM_CLASSES,
            synthetic_size=2 * batch,
        ),
        train=TrainConfig(
            batch_size=batch, steps=DATA_STEPS, lr=LR, momentum=MOMENTUM, seed=SEED, eval=False
        ),
        compute=ComputeConfig(
            precision=precision, recompute=recompute, channels_last=channels_last
        ),
    )


def _fake(rows: int, meta: TensorMeta) -> torch.Tensor:
    """A tensor of ``rows`` rows shaped like one boundary tensor."""
    if meta.dtype.is_floating_point:
        return torch.randn((rows, *meta.tail), dtype=meta.dtype)
    return torch.zeros((rows, *meta.tail), dtype=meta.dtype)


def stage_probe(session: Session) -> Callable[[], tuple[float, float]]:
    """(wall, thread CPU) seconds of one micro-batch's fwd+bwd through a copy of this rank's stage."""
    runner, coord = session.engine, session.coord
    topo, tp = runner.topo, runner.transport
    module = copy.deepcopy(session.stage)
    rows = split_sizes(runner.sizes[0], topo.shape[coord.stage])[coord.replica]
    first, last = runner.first[0], runner.last[0]  # the benchmark's stages run one chunk each
    if first:
        xs: tuple[torch.Tensor, ...] = (torch.randn(rows, *session.splits.input_shape),)
    else:
        xs = tuple(_fake(rows, m) for m in tp.in_meta)
    labels = torch.randint(0, session.splits.num_classes, (rows,))
    out_grads = tuple(_fake(rows, m) for m in tp.out_meta if m.has_grad)
    inv_batch = 1.0 / topo.global_batch

    def once() -> tuple[float, float]:
        """One timed forward+backward, without p2p or gradient sync."""
        inputs = tuple(
            x.detach().requires_grad_() if not first and x.is_floating_point() else x for x in xs
        )
        start, cpu = time.perf_counter(), time.thread_time()
        out = module(*inputs)
        if last:
            (F.cross_entropy(out[0], labels, reduction="sum") * inv_batch).backward()
        else:
            floats = [o for o in out if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, out_grads, strict=True) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return time.perf_counter() - start, time.thread_time() - cpu

    return once


class NoTimer(StepTimer):
    """Step timing off: the baseline of ``timer_overhead``."""

    def begin(self, step: int) -> None:
        pass

    def lap(self, mark: Mark, micro: int = -1) -> None:
        pass

    def end(self) -> None:
        pass


def bundle_case(
    name: str, cfg: RunConfig, rank: int, *, probe: bool = True, timed: bool = True
) -> Case:
    """A Bundle run on this rank: its session, with data fetched ahead of the timed steps.

    ``timed=False`` runs it without the per-action step timer every run has.
    """
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, CPU)
    if not timed:
        session.engine.timer = NoTimer()
    stream = train_stream(session, topo, cfg.train.seed, DATA_STEPS, 0)
    batches = [next(stream) for _ in range(DATA_STEPS)]
    runner = session.engine

    def step(i: int) -> None:
        """One synchronous Bundle training step."""
        runner.train_step(i, batches[i % DATA_STEPS])

    info = {
        "micro_batches": topo.micro_batches,
        "stages": topo.num_stages,
        "batch": topo.global_batch,
        "stage_blocks": list(session.stage.names),
    }
    return Case(name, step, stage_probe(session) if probe else None, session, info)


def global_batches(cfg: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches a Bundle run of ``cfg`` trains on, whole."""
    splits = data.load(cfg.data, cfg.train.seed)
    x, y = splits.train.tensors
    n, batch = len(y), cfg.train.batch_size
    out = []
    for t in range(DATA_STEPS):
        ix = data.global_batch(n, batch, cfg.train.seed, t)
        out.append((x[ix], y[ix]))
    return out


class SingleOutput(nn.Module):
    """A Bundle stage whose forward returns a bare tensor when it has one output."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self.stage(*xs)
        return out[0] if len(out) == 1 else out


def torch_pipeline_case(name: str, cfg: RunConfig, rank: int, schedule: str) -> Case:
    """torch.distributed.pipelining on the split, batch and micro-batches of ``cfg`` (shape 1,..,1)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    num_stages = len(cfg.parallel.shape)
    # With model chunks, the same pieces on the same ranks as Bundle's (looped, or a V for ZBV).
    pipe = REGISTRY[schedule].pipe(num_stages, cfg.parallel.virtual_stages)
    input_shape = (3, cfg.data.image_size, cfg.data.image_size)
    stages = build_stages(cfg, pipe.pieces, input_shape, cfg.data.num_classes)
    mine = [pipe.piece(rank, c) for c in range(pipe.chunks)]
    modules = [SingleOutput(stages[j]) for j in mine]
    del stages
    pieces = [PipelineStage(m, j, pipe.pieces, CPU) for m, j in zip(modules, mine, strict=True)]
    stage = pieces[0]
    inv_batch = 1.0 / cfg.train.batch_size

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Bundle's scaling: each micro-batch's summed loss over the global batch size."""
        return F.cross_entropy(out, y, reduction="sum") * inv_batch

    # torch's zero-bubble schedule with one stage per rank is ZB-H1 (the same action lists).
    cls, arg = {
        "gpipe": (ScheduleGPipe, stage),
        "1f1b": (Schedule1F1B, stage),
        "zb-h1": (ScheduleInterleavedZeroBubble, [stage]),
        "interleaved-1f1b": (ScheduleInterleaved1F1B, pieces),
        "zbv": (ScheduleZBVZeroBubble, pieces),
    }[schedule]
    sched = cls(arg, n_microbatches=cfg.parallel.micro_batches, loss_fn=loss_fn, scale_grads=False)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=cfg.train.lr, momentum=cfg.train.momentum)
    batches = global_batches(cfg)
    first, last = 0 in mine, pipe.pieces - 1 in mine

    def step(i: int) -> None:
        """One schedule step, then the optimizer."""
        x, y = batches[i % DATA_STEPS]
        args = (x,) if first else ()
        if last:
            sched.step(*args, target=y, return_outputs=False)
        else:
            sched.step(*args, return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)

    info = {"micro_batches": cfg.parallel.micro_batches, "batch": cfg.train.batch_size}
    return Case(name, step, None, None, info)


def ddp_case(name: str, cfg: RunConfig, rank: int, world: int) -> Case:
    """A plain DDP loop: the whole model, this rank's share of each global batch, mean loss."""
    from torch.nn.parallel import DistributedDataParallel

    input_shape = (3, cfg.data.image_size, cfg.data.image_size)
    torch.manual_seed(cfg.train.seed)
    model = models.build(cfg.model.name, num_classes=cfg.data.num_classes, input_shape=input_shape)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum)
    sizes = split_sizes(cfg.train.batch_size, world)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    batches = [(x[lo:hi].contiguous(), y[lo:hi].contiguous()) for x, y in global_batches(cfg)]

    def step(i: int) -> None:
        """Forward, backward (DDP averages), optimizer."""
        x, y = batches[i % DATA_STEPS]
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Case(name, step, None, None, {"micro_batches": 1, "batch": cfg.train.batch_size})


def build_groups(job: str, rank: int, world: int, sizes: Sizes) -> list[list[Case]]:
    """Every case of one world, grouped: the cases of a group are compared with each other."""
    cm = sizes.compare_micro
    if job == "pipeline":
        ref = make_cfg(sizes, sizes.mlp_model, micro=cm)
        headline = [
            bundle_case(f"mlp bundle 1f1b M={cm}", ref, rank),
            torch_pipeline_case(f"mlp torch 1f1b M={cm}", ref, rank, "1f1b"),
            bundle_case(
                f"mlp bundle gpipe M={cm}",
                make_cfg(sizes, sizes.mlp_model, micro=cm, schedule="gpipe"),
                rank,
            ),
            torch_pipeline_case(f"mlp torch gpipe M={cm}", ref, rank, "gpipe"),
            bundle_case(
                f"mlp bundle zb-h1 M={cm}",
                make_cfg(sizes, sizes.mlp_model, micro=cm, schedule="zb-h1"),
                rank,
            ),
            torch_pipeline_case(f"mlp torch zb-h1 M={cm}", ref, rank, "zb-h1"),
        ]
        for name in CHUNKED:  # two model chunks per stage, the model cut in four pieces
            chunked = make_cfg(sizes, sizes.mlp_model, micro=cm, schedule=name, chunks=2)
            headline += [
                # The stage probe times one piece of the model: none for several chunks.
                bundle_case(f"mlp bundle {name} M={cm}", chunked, rank, probe=False),
                torch_pipeline_case(f"mlp torch {name} M={cm}", chunked, rank, name),
            ]
        sweep = [
            bundle_case(f"mlp bundle 1f1b M={m}", make_cfg(sizes, sizes.mlp_model, micro=m), rank)
            for m in sizes.mlp_micro
            if m != cm
        ]
        sweep.append(
            bundle_case(
                f"mlp bundle zb-h1 M={sizes.few_micro}",
                make_cfg(sizes, sizes.mlp_model, micro=sizes.few_micro, schedule="zb-h1"),
                rank,
            )
        )
        sweep += [  # where the bubble is larger: two chunks per stage against 1F1B at few M
            bundle_case(
                f"mlp bundle {name} M={sizes.few_micro}",
                make_cfg(sizes, sizes.mlp_model, micro=sizes.few_micro, schedule=name, chunks=2),
                rank,
                probe=False,
            )
            for name in CHUNKED
        ]
        sweep += [
            bundle_case(
                f"cnn bundle 1f1b M={m}",
                make_cfg(sizes, "small_resnet", micro=m, spec=CNN_PARTITION),
                rank,
            )
            for m in sizes.cnn_micro
        ]
        dp = make_cfg(sizes, sizes.mlp_model, micro=1, shape=(world,))
        ddp = [bundle_case("bundle dp", dp, rank), ddp_case("torch ddp", dp, rank, world)]
        # New groups only, no stage probes: the groups above stay as they were.
        cnn = {"model": "small_resnet", "micro": cm, "spec": CNN_PARTITION}
        compute = [
            bundle_case(f"cnn bundle fp32 M={cm}", make_cfg(sizes, **cnn), rank, probe=False),
            bundle_case(
                f"cnn bundle bf16 M={cm}",
                make_cfg(sizes, **cnn, precision="bf16"),
                rank,
                probe=False,
            ),
            bundle_case(
                f"cnn bundle recompute M={cm}",
                make_cfg(sizes, **cnn, recompute="always"),
                rank,
                probe=False,
            ),
            bundle_case(
                f"cnn bundle channels-last M={cm}",
                make_cfg(sizes, **cnn, channels_last=True),
                rank,
                probe=False,
            ),
        ]
        mlp_bf16 = [
            bundle_case(
                f"mlp bundle {p} M={cm}",
                make_cfg(sizes, sizes.mlp_model, micro=cm, precision=p),
                rank,
                probe=False,
            )
            for p in ("fp32", "bf16")
        ]
        mlp = make_cfg(sizes, sizes.mlp_model, micro=cm)
        timers = [
            bundle_case(f"mlp bundle timers on M={cm}", mlp, rank, probe=False),
            bundle_case(f"mlp bundle timers off M={cm}", mlp, rank, probe=False, timed=False),
        ]
        return [headline, *([c] for c in sweep), ddp, compute, mlp_bf16, timers]
    if job == "bundles":
        cases = [
            bundle_case(
                f"bundle {sync} M={cm}",
                make_cfg(sizes, sizes.mlp_model, micro=cm, bundles=2, sync=sync),
                rank,
                probe=False,
            )
            for sync in ("flat", "hierarchical", "flat")
        ]
        # The flat sync as it was: DDP waits for the stage's sums inside the last backward, so
        # the last gradient send (and the stage upstream) waits for the cross-bundle all-reduce.
        cases[2].name = f"bundle flat waited M={cm}"
        assert cases[2].session is not None
        cases[2].session.engine.sync.defer = False  # type: ignore[attr-defined]
        return [cases]
    raise ValueError(f"unknown job {job!r}")


def _memory_case(rank: int, sizes: Sizes) -> Callable[[str, str], Case]:
    """Builds the small_resnet Case bench_memory counts, for a schedule and recompute mode."""

    def case_for(schedule: str, recompute: str) -> Case:
        cfg = make_cfg(
            sizes,
            "small_resnet",
            micro=sizes.compare_micro,
            spec=CNN_PARTITION,
            schedule=schedule,
            recompute=recompute,
        )
        return bundle_case(f"{schedule} {recompute}", cfg, rank, probe=False)

    return case_for


def world_main(rank: int, world: int, job: str, sizes: Sizes) -> dict:
    """Run every group of ``job`` in rounds, its cases' steps interleaved; this rank's timings."""
    torch.set_num_threads(1)
    groups = build_groups(job, rank, world, sizes)
    cases = [c for g in groups for c in g]
    wall: dict[str, list[float]] = {c.name: [] for c in cases}
    cpu: dict[str, list[float]] = {c.name: [] for c in cases}
    stage: dict[str, list[tuple[float, float]]] = {c.name: [] for c in cases if c.probe}
    for r in range(sizes.rounds):
        for group in groups if r % 2 == 0 else groups[::-1]:  # ABBA: no group always goes first
            dist.barrier()
            for c in group:
                for i in range(sizes.warmup + (1 if r == 0 else 0)):
                    c.step(i)
            for i in range(sizes.steps):
                # Step i of every case of the group back to back, in an order that alternates:
                # the cases compared see the same moment of a shared machine.
                for c in group if (r + i) % 2 == 0 else group[::-1]:
                    w0, c0 = time.perf_counter(), time.process_time()
                    c.step(i)
                    wall[c.name].append(time.perf_counter() - w0)
                    cpu[c.name].append(time.process_time() - c0)
            for c in group:
                if c.probe is None:
                    continue
                for turn in range(world):  # one rank at a time: the others wait, idle, in a barrier
                    dist.barrier()
                    if rank == turn:
                        c.probe()
                        stage[c.name] += [c.probe() for _ in range(sizes.stage_reps)]
                dist.barrier()
    peak = {c.name: c.session.engine.peak_in_flight for c in cases if c.session is not None}
    return {
        "wall": wall,
        "cpu": cpu,
        "stage": stage,
        "peak": peak,
        "info": {c.name: c.info for c in cases},
        "activation": bench_memory.count(_memory_case(rank, sizes)) if job == "pipeline" else {},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="fewer rounds and steps (about 9 min on 2 cores)"
    )
    mode.add_argument("--smoke", action="store_true", help="tiny sizes: proves every key appears")
    p.add_argument("--json", metavar="PATH", help="write the report here")
    p.add_argument("--steps", type=int, metavar="N", help="timed steps per case per round")
    p.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds per world")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run both worlds, print the table, write the JSON report."""
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = PRESETS[mode]
    if args.steps:
        sizes = replace(sizes, steps=args.steps)
    if args.rounds:
        sizes = replace(sizes, rounds=args.rounds)
    torch.set_num_threads(1)
    start, load_start = time.perf_counter(), os.getloadavg()
    results = {
        job: run_world(world, world_main, job, sizes)
        for job, world in (("pipeline", 2), ("bundles", 4))
    }
    cases: dict[str, dict] = {}
    for res in results.values():
        cases.update(summarize(res, sizes.rounds))
    # Each pipeline rank counted its own stage: stage 0 first.
    activation = bench_memory.report([r["activation"] for r in results["pipeline"]])
    wall = time.perf_counter() - start
    report = build_report(mode, sizes, cases, activation, wall, load_start)
    print(render(report, cases))
    print(f"wall time {report['wall_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    floats = [*report.items(), *report["bf16_vs_fp32"].items()]
    bad = [k for k, v in floats if isinstance(v, float) and not math.isfinite(v)]
    return 1 if bad else 0


def _jsonable(value: object) -> object:
    """JSON fallback: tuples as lists."""
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


if __name__ == "__main__":
    sys.exit(main())
