"""One rank's session, built once: its stage cut from the model, its process groups, gradient
sync, transport, optimizer and engine, and the data it reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from bundle import data, loader
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.manager import Checkpointer
from bundle.config import RunConfig
from bundle.engine import nccl_emu, precision
from bundle.engine.grad_sync import Comm, FlatSync, GradSync, HierarchicalSync
from bundle.engine.optim import make_optimizer
from bundle.engine.precision import Policy
from bundle.engine.stage_engine import (
    Loss,
    MicroBatch,
    StageEngine,
    boundary_metas,
    build_stages,
    cross_entropy,
)
from bundle.engine.transport import Transport, post_with_torch
from bundle.observe import timing
from bundle.partition import Stage
from bundle.runtime.devices import resolve_backend
from bundle.runtime.groups import ProcessGroups
from bundle.topology import Coord, Topology


@dataclass(frozen=True)
class Layout:
    """Where the stages of a run begin and how wide they are (a checkpoint records it)."""

    shape: list[int]
    num_bundles: int
    stages: list[str]  # the first block of each stage

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Session:
    """Everything one process built for training: its stage, engine, groups and data."""

    engine: StageEngine
    stage: Stage
    splits: data.DataSplits
    coord: Coord
    groups: ProcessGroups
    optimizer: torch.optim.Optimizer
    layout: Layout


def build_session(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    device: torch.device,
    *,
    arrive: Callable[[str], None] | None = None,
) -> Session:
    """Build this rank's stage, groups, gradient sync, transport, optimizer and engine.

    ``arrive(name)``, when given, waits (with the start-up timeout) until every process reaches
    the same point, so uneven start-up is never charged to the per-operation ``--timeout``.
    """
    arrive = arrive or (lambda name: None)
    coord = topo.coord(rank)
    S = topo.num_stages
    splits = data.load(cfg.data, cfg.train.seed)
    stages = build_stages(cfg, S, splits.input_shape, splits.num_classes)
    policy = Policy.of(cfg.compute, device)
    metas = boundary_metas(stages, splits.input_shape, policy)
    layout = Layout(list(topo.shape), topo.num_bundles, [s.names[0] for s in stages])
    stage = policy.prepare_stage(stages[coord.stage].to(device))
    del stages
    if device.type == "cuda":
        precision.set_tf32(cfg.compute.tf32)
    arrive("model built")
    groups = ProcessGroups.build(
        topo,
        coord,
        hierarchical=cfg.parallel.grad_sync == "hierarchical",
        async_save=cfg.checkpoint.async_save,
        timeout=cfg.launch.timeout,
    )
    backend = resolve_backend(cfg)
    emu = nccl_emu.for_session(cfg.launch, rank) if backend == "nccl-emu" else None
    transport = Transport(
        topo=topo,
        bundle=coord.bundle,
        stage=coord.stage,
        replica=coord.replica,
        in_meta=metas[coord.stage - 1] if coord.stage > 0 else (),
        out_meta=metas[coord.stage] if coord.stage < S - 1 else (),
        device=device,
        timeout=cfg.launch.timeout,
        post=emu.batch_isend_irecv if emu is not None else post_with_torch,
    )
    optimizer = make_optimizer(cfg.train, stage)
    engine = StageEngine(
        topo=topo,
        coord=coord,
        sync=_make_sync(cfg, topo, coord, stage, groups, device, emu),
        transport=transport,
        optimizer=optimizer,
        schedule=cfg.parallel.schedule,
        device=device,
        stage=stage,
        policy=policy,
        # The skip decision spans the job: the default group holds every rank.
        scaler=policy.make_scaler(device),
        timer=timing.make_timer(device),
        loss=make_loss(cfg),
        # gloo alone lets a receive progress on its own: there it is posted ahead (bundle.engine.p2p).
        early_receives=backend == "gloo",
    )
    arrive("ready to train")
    return Session(engine, stage, splits, coord, groups, optimizer, layout)


def make_loss(cfg: RunConfig) -> Loss:
    """``--loss module:function``, else cross-entropy (with ``--label-smoothing``)."""
    if cfg.model.loss:
        from models import load_callable

        return load_callable(cfg.model.loss, "--loss")
    return cross_entropy(cfg.train.label_smoothing)


def _make_sync(
    cfg: RunConfig,
    topo: Topology,
    coord: Coord,
    stage: Stage,
    groups: ProcessGroups,
    device: torch.device,
    comm: Comm | None,
) -> GradSync:
    if len(topo.stage_group(coord.stage)) == 1:
        return GradSync(stage)
    if cfg.parallel.grad_sync == "flat":
        return FlatSync(stage, groups.stage, device, bucket_mb=cfg.parallel.bucket_mb, comm=comm)
    # Start from identical weights without relying on every process's initialisation agreeing.
    members = topo.stage_group(coord.stage)
    for p in stage.parameters():
        dist.broadcast(p.data, src=members[0], group=groups.stage)
    return HierarchicalSync(
        stage,
        bundle_group=groups.bundle if topo.shape[coord.stage] > 1 else None,
        bundle_master=topo.stage_master(coord.bundle, coord.stage),
        masters_group=groups.masters if topo.num_bundles > 1 else None,
        is_master=coord.replica == 0,
        bucket_mb=cfg.parallel.bucket_mb,
        comm=comm,
    )


# -- the data a rank reads ---------------------------------------------------------------------


def shard(topo: Topology, coord: Coord, micro_batches: int) -> data.Shard:
    """This replica's rows of every batch."""
    return data.Shard(
        num_bundles=topo.num_bundles,
        micro_batches=micro_batches,
        width=topo.shape[coord.stage],
        bundle=coord.bundle,
        replica=coord.replica,
    )


def pins(device: torch.device | None) -> bool:
    """Pinned batches only for a CUDA process: pinning opens a CUDA context even on gloo."""
    return device is not None and device.type == "cuda"


def reads_data(topo: Topology, coord: Coord) -> bool:
    """Stage 0 reads inputs, the last stage labels; middle stages read nothing."""
    return coord.stage in (0, topo.num_stages - 1)


def train_stream(
    session: Session,
    topo: Topology,
    seed: int,
    total: int,
    workers: int,
    *,
    start: int = 0,
    device: torch.device | None = None,
) -> Iterator[list[MicroBatch] | None]:
    """Per step, this replica's M micro-batches: inputs on stage 0, labels on the last stage.

    The loader pins its batches only for a CUDA ``device``.
    """
    coord = session.coord
    if not reads_data(topo, coord):
        while True:
            yield None
    n = data.size(session.splits.train)
    lists = data.replica_indices(
        shard(topo, coord, topo.micro_batches), n, topo.global_batch, seed, total, start=start
    )
    stream = loader.stage_micro_batches(
        session.splits.train,
        lists,
        first=coord.stage == 0,
        workers=workers,
        pin_memory=pins(device),
    )
    while True:
        yield [next(stream) for _ in range(topo.micro_batches)]


# -- what a checkpoint of this session records ----------------------------------------------------


def checkpoint_settings(cfg: RunConfig, session: Session) -> dict[str, object]:
    """What a checkpoint records of the run that wrote it (checked again on resume)."""
    return {
        **ckpt.run_settings(cfg),
        "format": ckpt.FORMAT,
        "num_classes": session.splits.num_classes,
        "input_shape": list(session.splits.input_shape),
        "layout": session.layout.as_dict(),
        "torch": torch.__version__,
    }


def make_checkpointer(
    cfg: RunConfig, topo: Topology, rank: int, session: Session, *, total: int = 0
) -> Checkpointer:
    """This rank's checkpointer; ``total`` (the run's last step) is always saved when given."""
    scaler = session.engine.scaler
    return Checkpointer(
        cfg.checkpoint,
        topo=topo,
        coord=session.coord,
        rank=rank,
        stage=session.stage,
        optimizer=session.optimizer,
        group=session.groups.control,
        stage_group=session.groups.stage,
        settings=checkpoint_settings(cfg, session),
        steps_per_epoch=data.steps_per_epoch(data.size(session.splits.train), cfg.train.batch_size),
        total=total,
        async_group=session.groups.async_save,
        extra=scaler.state() if scaler else None,
    )
