"""Plan one job: check the request, build its cost model (a cluster file's device, or this
machine measured), and search."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from bundle import models
from bundle.config import ModelConfig, TrainConfig
from bundle.errors import ConfigError
from bundle.plan import calibrate, isolate, shares, tensor
from bundle.plan import profile as prof
from bundle.plan.cluster import NOMINAL, Cluster
from bundle.plan.cost import CostModel, Execution, Overheads
from bundle.plan.dataparallel import DataParallel
from bundle.plan.messages import boundary_range
from bundle.plan.mixed import MixedResult, mixed_search
from bundle.plan.plans import Evaluated
from bundle.plan.search import Limits, Workload, search_fitting


@dataclass(frozen=True, kw_only=True)
class Request:
    model: str
    batch: int
    nodes: int
    per_node: int  # devices (processes) per node
    input_shape: tuple[int, ...]
    num_classes: int
    precision: str = "fp32"
    recompute: str = "never"
    bucket_mb: float = 25.0
    optimizer: str = TrainConfig.optimizer  # its state counts in each device's memory
    momentum: float = TrainConfig.momentum
    max_stages: int = 4
    max_micro: int = 64
    per_stage_tp: bool = True  # False (--uniform-tp): every stage at one tensor-parallel degree
    model_args: str | None = None  # --model-args of the model measured
    lora: str | None = None  # --lora: adapters on a frozen base, all that trains
    lora_train: str | None = None  # --lora-train: modules trained whole beside them
    dp: DataParallel = DataParallel()  # costed as given, never searched

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def spec(self) -> prof.ModelSpec:
        """The model profiled: its name, input shape, classes, --model-args and what trains."""
        return prof.ModelSpec(
            self.model,
            self.input_shape,
            self.num_classes,
            self.model_args,
            lora=self.lora,
            lora_train=self.lora_train,
        )

    def execution(self, *, overlap: bool = True) -> Execution:
        """How the job runs, for its costs; ``overlap``: whether its gradient sync runs beside the
        backward."""
        return Execution(
            precision=self.precision,
            recompute=self.recompute,
            bucket_mb=self.bucket_mb,
            overlap=overlap,
            optimizer=self.optimizer,
            momentum=self.momentum,
        )

    @property
    def workload(self) -> Workload:
        """What the search plans for: the devices, the batch, the data-parallel options."""
        return Workload(nodes=self.nodes, per_node=self.per_node, batch=self.batch, dp=self.dp)

    @property
    def limits(self) -> Limits:
        """How far the search looks: --max-stages, --max-micro-batches, --uniform-tp."""
        return Limits(
            max_stages=self.max_stages, max_micro=self.max_micro, per_stage=self.per_stage_tp
        )


def check(request: Request, cluster: Cluster | None) -> None:
    """Input errors, each one ConfigError naming the flag, before anything is measured."""
    if not models.is_known(request.model):
        raise ConfigError(
            "--model",
            request.model,
            f"choose one of: {', '.join(models.available())}, any torchvision classification "
            "model or a factory package.module:function",
        )
    for flag, value in (
        ("--nodes", request.nodes),
        ("--gpus-per-node", request.per_node),
        ("--batch-size", request.batch),
        ("--max-stages", request.max_stages),
        ("--max-micro-batches", request.max_micro),
    ):
        if value < 1:
            raise ConfigError(flag, value, "must be an integer >= 1")
    # An unknown --optimizer or a --momentum out of range, a malformed --lora: the trainer's own
    # ConfigError (a target the model lacks is refused when the model is counted).
    TrainConfig(optimizer=request.optimizer, momentum=request.momentum)
    ModelConfig(name=request.model, lora=request.lora, lora_train=request.lora_train)
    if request.batch < request.devices:
        raise ConfigError(
            "--batch-size",
            request.batch,
            f"must be >= the {request.devices} devices, so that every process holds a row",
        )
    if cluster is None:
        return
    if request.per_node > cluster.devices_per_node:
        raise ConfigError(
            "--gpus-per-node",
            request.per_node,
            f"the cluster '{cluster.name}' has {cluster.devices_per_node} devices per node",
        )
    if request.nodes > cluster.nodes:
        raise ConfigError(
            "--nodes", request.nodes, f"the cluster '{cluster.name}' has {cluster.nodes}"
        )
    if not cluster.mixed:
        cluster.check_precision(request.precision)
        return
    # Only the devices planned on must compute in the precision (--nodes 1: the first node's).
    used = {cluster.kind_of(n, i) for n in range(request.nodes) for i in range(request.per_node)}
    for t in cluster.types:
        if t.key in used:
            t.check_precision(request.precision)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Measure with the threads each worker of the job will have (bundle.runtime.devices sets them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ram_per_process(per_node: int) -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node


# A profile past this is stuck, not slow: resnet101 at batch 256 on two CPU cores takes minutes.
PROFILE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Measured:
    """What the planner measures on this machine (in a child process: ``measure``)."""

    timings: prof.Timings
    overheads: Overheads
    cluster: Cluster
    notes: tuple[str, ...] = ()  # the profile cache's (which entries were used, which were not)
    # Per tensor-parallel degree, one process's part of the split model (a CPU's, measured).
    split_timings: Mapping[int, prof.Timings] = field(default_factory=dict)


def _loopback(
    request: Request, cache: prof.ProfileCache, overheads: Overheads, start_method: str
) -> calibrate.Calibration:
    """This machine's loopback links, its messages fitted at the sizes the model's boundaries
    send (one row to the whole batch, anywhere the model may be cut)."""
    cal = calibrate.calibrate(cache, overheads, start_method=start_method)
    anatomy = prof.anatomy(request.spec, cache)
    rows = (1.0, float(request.batch))
    return cal.for_boundary(boundary_range(anatomy, rows, precision=request.precision))


def measure(
    request: Request,
    *,
    cluster: Cluster | None,
    cache: prof.ProfileCache,
    device_type: str,
    repeats: int = 5,
    start_method: str = "spawn",
) -> Measured:
    """Block timings on the local ``device_type`` (on a CPU without a cluster file, also of the
    model split at each tensor-parallel degree it may take), the engine's overheads and, without
    a cluster file, this machine as the cluster: a CPU's links measured on gloo loopback, a GPU's nominal
    (NVLink within the node, InfiniBand between nodes: gloo on loopback says nothing of them)."""
    overheads = calibrate.engine(cache)
    device = torch.device(device_type)
    threads = max(1, (os.cpu_count() or 1) // request.per_node)

    def timed(degree: int) -> prof.Timings:
        rows = prof.row_grid(request.batch)
        return prof.timings(
            request.spec,
            cache,
            rows=rows,
            precision=request.precision,
            device=device,
            repeats=repeats,
            tp_degree=degree,
        )

    split: dict[int, prof.Timings] = {}
    with _threads(threads if device.type == "cpu" else torch.get_num_threads()):
        timings = timed(1)
        if device.type == "cpu" and cluster is None:
            for t in _split_degrees(request, len(timings.fwd[0])):
                try:
                    split[t] = timed(t)
                except Exception as exc:  # noqa: BLE001 - an estimate falls back, and says so
                    cache.notes.append(
                        f"{request.model} split {t} ways could not be timed ({type(exc).__name__}:"
                        f" {str(exc).splitlines()[0] if str(exc) else ''}): a stage at degree {t}"
                        f" is costed as the whole model's time / {t}"
                    )
    measured = _measure_links(request, cluster, cache, device, timings, overheads, start_method)
    return replace(measured, split_timings=split)


def _split_degrees(request: Request, n_blocks: int) -> tuple[int, ...]:
    """The tensor-parallel degrees whose split model is timed on this CPU (a process's part runs
    slower than 1/t of the whole: smaller matrices, the norms and embeddings every process runs
    whole): the model's, up to the processes on the node."""
    if request.per_node < 2:
        return ()
    degrees = tensor.split_of(request.spec, n_blocks).degrees
    return tuple(t for t in degrees if 1 < t <= request.per_node)


def _measure_links(
    request: Request,
    cluster: Cluster | None,
    cache: prof.ProfileCache,
    device: torch.device,
    timings: prof.Timings,
    overheads: Overheads,
    start_method: str,
) -> Measured:
    """``measure``'s links: the cluster file's, this machine's loopback measured, or nominal."""
    if (
        cluster is not None
        and device.type == "cpu"
        and cluster.types
        and all(t.cpu for t in cluster.types)
    ):
        # CPU processes emulating devices (cpu shares): their links are this machine's loopback,
        # measured; the file's figures stand for nodes this machine does not have.
        cal = _loopback(request, cache, overheads, start_method)
        links = replace(cluster, intra=cal.p2p, collective=cal.collective)
        return Measured(
            timings, cal.overheads, shares.with_penalties(links, cache), tuple(cache.notes)
        )
    if cluster is not None:
        return Measured(timings, overheads, cluster, tuple(cache.notes))
    if device.type == "cuda":
        _, intra, inter = NOMINAL["cuda"]
        name = prof.device_name(device)
        cluster = Cluster(
            name=f"this machine ({name}; nominal NVLink/InfiniBand links)",
            nodes=request.nodes,
            devices_per_node=request.per_node,
            device_name=name,
            memory_bytes=torch.cuda.get_device_properties(device).total_memory,
            speed=None,
            intra=intra,
            inter=inter,
        )
        return Measured(timings, overheads, cluster, tuple(cache.notes))
    cal = _loopback(request, cache, overheads, start_method)
    cluster = replace(
        calibrate.loopback(
            cal.p2p,
            cal.collective,
            devices=request.per_node,
            memory_bytes=_ram_per_process(request.per_node),
        ),
        nodes=request.nodes,
    )
    return Measured(timings, cal.overheads, cluster, tuple(cache.notes))


def cost_model(
    request: Request,
    *,
    cluster: Cluster | None,
    cache: prof.ProfileCache,
    repeats: int = 5,
    start_method: str = "spawn",
    device_type: str | None = None,
    timeout: float = PROFILE_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> CostModel:
    """The cost model of ``request``: on a cluster file's device, or on this machine measured
    (its block timings, engine overheads and links, each cached).

    The measuring runs in a child process (``isolate``): a CUDA profile leaves nothing behind in
    this one, which may be the supervisor of the job that runs the plan.
    """
    anatomy = prof.anatomy(request.spec, cache)
    if cluster is not None and cluster.speed is not None:
        # An estimated accelerator runs its kernels behind the host, asynchronously: the engine's
        # host-side overheads (measured on this CPU) are not counted, nothing is measured here.
        cost = CostModel(anatomy=anatomy, cluster=cluster, execution=request.execution())
        return _splittable(cost, request, cluster)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if progress is not None:
        links = "" if cluster is not None else ", the links between processes"
        progress(
            f"profiling {request.model} on this machine's {device_type}: each block's forward "
            f"and backward at {len(prof.row_grid(request.batch))} batch sizes x {repeats} "
            f"repeats, the engine's overheads{links} (up to a minute or two; what "
            "--profile-cache holds from an earlier run is read instead)"
        )
    measured = isolate.run_in_child(
        measure,
        request,
        cluster=cluster,
        cache=cache,
        device_type=device_type,
        repeats=repeats,
        start_method=start_method,
        what=f"profiling {request.model} on {device_type}",
        timeout=timeout,
    )
    cache.notes.extend(n for n in measured.notes if n not in cache.notes)
    # Gloo on the CPU reduces on the cores the backward runs on: no overlap to count on.
    cost = CostModel(
        anatomy=anatomy,
        cluster=measured.cluster,
        timings=measured.timings,
        overheads=measured.overheads,
        execution=request.execution(overlap=device_type != "cpu"),
    )
    return _splittable(cost, request, cluster, measured.split_timings)


def _splittable(
    cost: CostModel,
    request: Request,
    cluster: Cluster | None,
    timed: Mapping[int, prof.Timings] | None = None,
) -> CostModel:
    """``cost`` with what tensor parallelism splits of the model (``tensor.split_of``) where the
    search may plan it: one device type, more than one device a node; with the split model's
    ``timed`` timings per degree where they were measured."""
    if request.per_node < 2 or (cluster is not None and cluster.types and len(cluster.types) > 1):
        return cost
    return tensor.Splittable.of(cost, tensor.split_of(request.spec, cost.n), timed)


def plan(
    request: Request, cost: CostModel, progress: Callable[[str], None] | None = None
) -> list[Evaluated]:
    """Every plan the search simulated, best first (under ``--zero 3`` where only it fits in
    device memory: ``search_fitting``); ``progress`` is told what it is doing."""
    return search_fitting(cost, workload=request.workload, limits=request.limits, progress=progress)


def plan_mixed(
    request: Request, cost: CostModel, progress: Callable[[str], None] | None = None
) -> MixedResult:
    """A cluster of several device types: placement, widths, split and row weights searched;
    ``progress`` is told what it is doing."""
    return mixed_search(cost, workload=request.workload, limits=request.limits, progress=progress)
