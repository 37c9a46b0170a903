"""``--bundle-shape auto`` and ``--partition auto``: the planner's choice, made before launch.

Every process of a job must run the same plan, and nodes compare their configurations at start,
so the plan is resolved into an ordinary configuration (shape, bundles, micro-batches, schedule,
sync, inline split points) before any process starts; the data-parallel options
(``--grad-compression``, ``--bundle-sync``, ``--aggregate``, ``--zero``) are costed as given,
except that ``--bundle-shape auto`` runs ``--zero 3`` where no plan fits in device memory without
it (``search.search_fitting``; the plan's line says so):

- one node, self-spawned: ``main.py`` plans before it starts its workers, from a quick profile
  measured here in a child process (block timings, engine overheads, and a CPU's loopback links;
  a GPU's links are the nominal NVLink/InfiniBand ones; all cached);
- several nodes, or torchrun (every process plans for itself): from the model's FLOP and byte
  counts against nominal device speeds (``cluster.NOMINAL``), arithmetic that gives every
  process the same plan. Its predicted throughput is then only indicative.

``--bundle-shape auto`` uses every process the job has; ``--partition auto`` with a given shape
places the split points by time (the planner's dynamic program) rather than by parameter count.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from bundle import data
from bundle.config import AUTO_SHAPE, RunConfig
from bundle.errors import ConfigError
from bundle.ir.schedule import REGISTRY, SCHEDULES
from bundle.plan import planner, tensor
from bundle.plan import profile as prof
from bundle.plan.anatomy import count
from bundle.plan.cluster import nominal
from bundle.plan.cost import CostModel
from bundle.plan.dataparallel import DataParallel
from bundle.plan.plans import Evaluated, Plan, evaluate
from bundle.plan.search import search_fitting
from bundle.plan.split import Splitter

AUTO = "auto"


def _processes(cfg: RunConfig) -> tuple[int, int]:
    """(nodes, processes per node) of this job, as the launcher will start them."""
    lc = cfg.launch
    if lc.nproc_per_node:
        return lc.num_nodes, lc.nproc_per_node
    if torch.cuda.is_available() and lc.backend != "gloo":
        return lc.num_nodes, torch.cuda.device_count()
    return lc.num_nodes, os.cpu_count() or 1


def _device_type(cfg: RunConfig) -> str:
    """What the job's processes compute on: CUDA under nccl (or auto, with a GPU here)."""
    if cfg.launch.backend in ("auto", "nccl") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _request(cfg: RunConfig, nodes: int, per_node: int) -> planner.Request:
    classes, shape = data.input_spec(cfg.data)
    return planner.Request(
        model=cfg.model.name,
        batch=cfg.train.batch_size,
        nodes=nodes,
        per_node=per_node,
        input_shape=shape,
        num_classes=classes,
        precision=cfg.compute.precision,
        recompute=cfg.compute.recompute,
        bucket_mb=cfg.parallel.bucket_mb,
        optimizer=cfg.train.optimizer,
        momentum=cfg.train.momentum,
        model_args=cfg.model.args,
        lora=cfg.model.lora,
        lora_train=cfg.model.lora_train,
        dp=DataParallel.of(cfg.parallel),
    )


def _cost(cfg: RunConfig, request: planner.Request) -> tuple[CostModel, str]:
    """The cost model, and how it was made (for the log line)."""
    if cfg.launch.torchrun or request.nodes > 1:
        kind = _device_type(cfg)
        cluster = nominal(kind, request.nodes, request.per_node)
        anatomy = count(request.spec)
        cost = CostModel(
            anatomy=anatomy,
            cluster=cluster,
            execution=request.execution(overlap=kind != "cpu"),
        )
        cost = tensor.Splittable.of(cost, tensor.split_of(request.spec, cost.n))
        return cost, "FLOP and byte counts against nominal speeds, the same on every process"
    cache = prof.ProfileCache(prof.default_cache_dir())
    # A fresh profile takes tens of seconds: say what is going on before it starts.
    print(
        f"main.py: planning {request.model} for {request.nodes * request.per_node} process(es): "
        f"profiling it on this {_device_type(cfg)} (block timings, engine overheads"
        + (", loopback links" if _device_type(cfg) == "cpu" else "")
        + f"), or reading them from {cache.directory}",
        file=sys.stderr,
        flush=True,
    )
    # Measured in a child process: CUDA, once initialised here, would hold memory on cuda:0
    # for as long as the job runs.
    cost = planner.cost_model(
        request, cluster=None, cache=cache, repeats=3, device_type=_device_type(cfg)
    )
    for note in cache.notes:  # which cached profiles were used, and which were not
        print(f"main.py: {note}", file=sys.stderr, flush=True)
    return cost, f"a profile measured on this machine (cached in {cache.directory})"


def _plan_shape(cfg: RunConfig, request: planner.Request, cost: CostModel) -> Evaluated:
    if cfg.model.partition not in (None, AUTO):
        raise ConfigError(
            "--partition",
            cfg.model.partition,
            "with --bundle-shape auto the planner chooses the split: leave --partition out",
        )
    # A compiled block's one backward cannot be split (bundle.engine.compiled).
    schedules = tuple(
        name for name in SCHEDULES if not (cfg.compute.compile and REGISTRY[name].split_backward)
    )
    ranked = search_fitting(
        cost,
        workload=request.workload,
        limits=request.limits,
        exact=True,
        schedules=schedules,
    )
    fitting = [e for e in ranked if e.fits]
    if not fitting:
        raise ConfigError(
            "--bundle-shape", AUTO, "no plan for these processes fits in device memory"
        )
    return fitting[0]


def _plan_split(cfg: RunConfig, request: planner.Request, cost: CostModel) -> Evaluated:
    """Time-balanced split points for the given shape, micro-batches and bundles."""
    p = cfg.parallel
    bundle_rows = request.batch // p.num_bundles
    starts, _ = Splitter(cost, cost.cluster.intra.bandwidth, cost.cluster.intra.latency).split(
        p.shape, -(-bundle_rows // p.micro_batches)
    )
    ppn = cfg.procs_per_node
    sched = REGISTRY[p.schedule]
    pipe = sched.pipe(len(p.shape), p.virtual_stages)
    if pipe.chunks > 1:  # the pieces of every chunk, each at its stage's width
        widths = tuple(p.shape[pipe.place(j)[0]] for j in range(pipe.pieces))
        starts, _ = Splitter(cost, cost.cluster.intra.bandwidth, cost.cluster.intra.latency).split(
            widths, -(-bundle_rows // p.micro_batches)
        )
    plan = Plan(
        p.shape,
        p.num_bundles,
        starts,
        p.micro_batches,
        ppn,
        p.schedule,
        p.grad_sync,
        request.dp,
        chunks=p.virtual_stages,
    )
    return evaluate(cost, plan, request.batch)


def resolve(cfg: RunConfig) -> RunConfig:
    """The configuration with the planner's choices in place of ``auto``; logs the plan."""
    if not cfg.planned:
        return cfg
    shape_auto = cfg.parallel.shape == AUTO_SHAPE
    if shape_auto:
        nodes, per_node = _processes(cfg)
    else:
        nodes, per_node = cfg.launch.num_nodes, cfg.procs_per_node
    request = _request(cfg, nodes, per_node)
    planner.check(request, None)
    cost, how = _cost(cfg, request)
    if cfg.compute.compile or cfg.launch.fault_tolerance == "bundle" or not shape_auto:
        cost = tensor.without(cost)  # what --tensor-parallel does not combine with yet
    best = _plan_shape(cfg, request, cost) if shape_auto else _plan_split(cfg, request, cost)
    p = best.plan
    costed = " ".join(request.dp.flags())  # what the run asked for; a --zero 3 chosen is named
    names = cost.anatomy.names
    split = ",".join(names[i] for i in p.starts) if len(p.shape) > 1 else None
    resolved = replace(
        cfg,
        parallel=replace(
            cfg.parallel,
            shape=p.shape,
            num_bundles=p.num_bundles,
            micro_batches=p.micro_batches,
            schedule=p.schedule,
            virtual_stages=p.chunks,
            tensor_parallel=p.tp,  # () : none; the planner's per-stage degrees
            grad_sync=p.grad_sync,
            zero=p.dp.zero,  # --zero 3 where no plan fits in device memory without it
        ),
        model=replace(cfg.model, partition=split),
        launch=replace(cfg.launch, nproc_per_node=p.procs_per_node) if shape_auto else cfg.launch,
        predicted_samples_per_s=round(best.samples_per_s, 1),
    )
    print(
        f"main.py: plan: --bundle-shape {','.join(map(str, p.shape))} --num-bundle {p.num_bundles} "
        f"--micro-batches {p.micro_batches} --schedule {p.schedule} --grad-sync {p.grad_sync}"
        + (f" --virtual-stages {p.chunks}" if p.chunks > 1 else "")
        + (f" --tensor-parallel {','.join(map(str, p.tp))}" if p.tp else "")
        + (f" --partition {split}" if split else "")
        + (f" --zero {p.dp.zero} (no plan fits without it)" if p.dp != request.dp else "")
        + (f" (costed with {costed})" if costed else "")
        + f"; predicted {best.samples_per_s:.1f} samples/s from {how}",
        file=sys.stderr,
        flush=True,
    )
    return resolved
