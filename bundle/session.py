"""The body of one training process, once its process group exists: build, train, evaluate, report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bundle import data, log
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.manager import Checkpointer
from bundle.config import RunConfig
from bundle.engine import nccl_emu, precision
from bundle.engine.grad_sync import Collectives, FlatSync, GradSync, HierarchicalSync
from bundle.engine.precision import Policy
from bundle.engine.stage_engine import StageRunner, boundary_metas, build_stages, eval_rows
from bundle.engine.transport import Transport, post_with_torch
from bundle.errors import DataError
from bundle.lr_schedule import LRSchedule
from bundle.observe import build as observe
from bundle.observe import timing
from bundle.observe.timing import Mark
from bundle.runtime.devices import resolve_backend
from bundle.runtime.preemption import Stopped, StopRequest, StopVote, maybe_fail
from bundle.runtime.watchdog import group_timeout
from bundle.topology import Coord, Topology


def _groups(
    topo: Topology, coord: Coord, strategy: str, *, async_save: bool, timeout: float
) -> dict:
    """Create every group on every rank in the same order (new_group is collective).

    ``control`` spans the job on gloo whatever the training backend: the per-step stop vote and
    checkpoint coordination (CPU tensors, pickled plans) run there, apart from the training traffic.
    ``async`` does the same for the writes of asynchronous saves, which run in a thread of their own.
    Every group gets ``--timeout`` (``timeout``; NCCL's a little more, see bundle/watchdog.py):
    without it, NCCL's sub-groups wait 10 minutes.
    """
    on_gloo = group_timeout("gloo", timeout)
    training = group_timeout(dist.get_backend(), timeout)
    mine: dict = {"control": dist.new_group(backend="gloo", timeout=on_gloo)}
    if async_save:
        mine["async"] = dist.new_group(backend="gloo", timeout=on_gloo)
    for s in range(topo.num_stages):
        g = dist.new_group(list(topo.stage_group(s)), timeout=training)
        if s == coord.stage:
            mine["stage"] = g
        if strategy != "hierarchical":
            continue
        for b in range(topo.num_bundles):
            g = dist.new_group(list(topo.bundle_stage_group(b, s)), timeout=training)
            if (b, s) == (coord.bundle, coord.stage):
                mine["bundle"] = g
        g = dist.new_group(list(topo.masters_group(s)), timeout=training)
        if s == coord.stage:
            mine["masters"] = g
    return mine


def _make_sync(
    cfg: RunConfig,
    topo: Topology,
    coord: Coord,
    stage: torch.nn.Module,
    groups: dict,
    device,
    comm: Collectives | None,
) -> GradSync:
    if len(topo.stage_group(coord.stage)) == 1:
        return GradSync(stage)
    if cfg.parallel.grad_sync == "flat":
        return FlatSync(stage, groups["stage"], device, bucket_mb=cfg.parallel.bucket_mb, comm=comm)
    # Start from identical weights without relying on every process's initialisation agreeing.
    members = topo.stage_group(coord.stage)
    for p in stage.parameters():
        dist.broadcast(p.data, src=members[0], group=groups["stage"])
    width = topo.shape[coord.stage]
    return HierarchicalSync(
        stage,
        bundle_group=groups["bundle"] if width > 1 else None,
        bundle_master=topo.stage_master(coord.bundle, coord.stage),
        masters_group=groups["masters"] if topo.num_bundles > 1 else None,
        is_master=coord.replica == 0,
        bucket_mb=cfg.parallel.bucket_mb,
        comm=comm,
    )


@dataclass
class Session:
    """Everything one process built for training: its stage, runner and data."""

    runner: StageRunner
    stage: torch.nn.Module
    splits: data.DataSplits
    coord: Coord
    groups: dict
    optimizer: torch.optim.Optimizer
    layout: dict

    @property
    def last_group(self) -> dist.ProcessGroup | None:
        """The last stage's group (losses and accuracy are summed there); None elsewhere."""
        return self.groups["stage"] if self.coord.stage == len(self.layout["stages"]) - 1 else None


def build_session(
    cfg: RunConfig, topo: Topology, rank: int, device: torch.device, *, arrive=None
) -> Session:
    """Build this rank's stage, groups, gradient sync, transport, optimizer and runner.

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
    layout = {
        "shape": list(topo.shape),
        "num_bundles": topo.num_bundles,
        "stages": [s.names[0] for s in stages],
    }
    stage = policy.prepare_stage(stages[coord.stage].to(device))
    del stages
    if device.type == "cuda":
        precision.set_tf32(cfg.compute.tf32)
    arrive("model built")
    groups = _groups(
        topo,
        coord,
        cfg.parallel.grad_sync,
        async_save=cfg.checkpoint.async_save,
        timeout=cfg.launch.timeout,
    )
    emu = nccl_emu.for_session(cfg.launch, rank) if resolve_backend(cfg) == "nccl-emu" else None
    sync = _make_sync(cfg, topo, coord, stage, groups, device, emu)
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
    optimizer = torch.optim.SGD(
        stage.parameters(),
        lr=cfg.train.lr,
        momentum=cfg.train.momentum,
        weight_decay=cfg.train.weight_decay,
        nesterov=cfg.train.nesterov,
    )
    runner = StageRunner(
        topo=topo,
        coord=coord,
        sync=sync,
        transport=transport,
        optimizer=optimizer,
        schedule=cfg.parallel.schedule,
        device=device,
        stage=stage,
        policy=policy,
        # The skip decision spans the job: the default group holds every rank.
        scaler=policy.make_scaler(device),
        timer=timing.make_timer(device),
        label_smoothing=cfg.train.label_smoothing,
        # gloo alone lets a receive progress on its own: there it is posted ahead (bundle.p2p).
        early_receives=resolve_backend(cfg) == "gloo",
    )
    arrive("ready to train")
    return Session(runner, stage, splits, coord, groups, optimizer, layout)


def _shard(topo: Topology, coord: Coord, micro_batches: int) -> data.Shard:
    return data.Shard(
        num_bundles=topo.num_bundles,
        micro_batches=micro_batches,
        width=topo.shape[coord.stage],
        bundle=coord.bundle,
        replica=coord.replica,
    )


def _pins(device: torch.device | None) -> bool:
    """Pinned batches only for a CUDA process: pinning opens a CUDA context even on gloo."""
    return device is not None and device.type == "cuda"


def _reads_data(topo: Topology, coord: Coord) -> bool:
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
):
    """Per step, this replica's M micro-batches: inputs on stage 0, labels on the last stage.

    The loader pins its batches only for a CUDA ``device``.
    """
    coord = session.coord
    if not _reads_data(topo, coord):
        while True:
            yield None
    n = len(session.splits.train)
    lists = data.replica_indices(
        _shard(topo, coord, topo.micro_batches), n, topo.global_batch, seed, total, start=start
    )
    stream = data.stage_micro_batches(
        session.splits.train,
        lists,
        first=coord.stage == 0,
        workers=workers,
        pin_memory=_pins(device),
    )
    while True:
        yield [next(stream) for _ in range(topo.micro_batches)]


def settings(cfg: RunConfig, session: Session) -> dict:
    """What a checkpoint records of the run that wrote it (checked again on resume)."""
    return {
        **ckpt.run_settings(cfg),
        "format": ckpt.FORMAT,
        "num_classes": session.splits.num_classes,
        "input_shape": list(session.splits.input_shape),
        "layout": session.layout,
        "torch": torch.__version__,
    }


def make_checkpointer(cfg: RunConfig, topo: Topology, rank: int, session: Session) -> Checkpointer:
    return Checkpointer(
        cfg.checkpoint,
        topo=topo,
        coord=session.coord,
        rank=rank,
        stage=session.stage,
        optimizer=session.optimizer,
        group=session.groups["control"],
        stage_group=session.groups["stage"],
        settings=settings(cfg, session),
        steps_per_epoch=data.steps_per_epoch(len(session.splits.train), cfg.train.batch_size),
        async_group=session.groups.get("async"),
        extra=session.runner.scaler.state() if session.runner.scaler else None,
    )


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of everything random in one step of one rank (dropout): resumes draw the same."""
    return ((seed * 1_000_003 + step) * 1_009 + rank) % 2**63


def run(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    device: torch.device,
    *,
    progress=None,
    where: dict | None = None,
    arrive=None,
    attempt: int = 0,
    resume: str | None = None,
    stop: StopRequest | None = None,
    store=None,
) -> dict | None:
    """Train and evaluate; the reporting rank returns the summary, every other rank None.

    ``progress`` (a shared integer) gets the current step for the node supervisor; ``where`` gets
    the runner, whose ``where`` names the action in progress when an error escapes. ``resume`` is
    the checkpoint to start from, ``attempt`` counts restarts, and ``stop`` carries stop signals;
    when the job stops for one, every rank raises ``Stopped`` after the checkpoint is written.
    ``store`` (the job's) serves to line up the clocks of a ``--trace``.
    """
    session = build_session(cfg, topo, rank, device, arrive=arrive)
    runner, coord = session.runner, session.coord
    if where is not None:
        where["runner"] = runner
    reporter = observe.reporter_rank(topo)
    B = cfg.train.batch_size
    spe = data.steps_per_epoch(len(session.splits.train), B)
    if spe == 0:
        raise DataError(
            f"the training set has {len(session.splits.train)} samples, fewer than one batch of {B}"
        )
    total = cfg.train.steps or cfg.train.epochs * spe
    lr_schedule = LRSchedule.of(cfg.train, steps_per_epoch=spe, total=total)
    saver = make_checkpointer(cfg, topo, rank, session)
    runner.where = "resume"
    start = saver.restore(resume)
    batches = train_stream(
        session, topo, cfg.train.seed, total, cfg.data.workers, start=start, device=device
    )
    timer = runner.timer
    timer.trace = cfg.observe.trace_range(start, total)
    profiler = observe.make_profiler(cfg, rank, device)
    report = observe.make_progress(
        cfg, topo, rank, session, total=total, steps_per_epoch=spe, start=start, device=device
    )
    vote = StopVote(stop or StopRequest(), session.groups["control"], cfg.launch.timeout)
    if rank == reporter:
        log.get().info(
            f"training {cfg.model.name}: shape {','.join(map(str, topo.shape))} x {topo.num_bundles} bundle(s), "
            f"{topo.world_size} processes, batch {B} in {topo.micro_batches} micro-batch(es), "
            f"{cfg.parallel.schedule}, {cfg.parallel.grad_sync} sync, {precision.describe(cfg.compute)}, "
            f"steps {start + 1}..{total} ({spe}/epoch)"
        )
    summary: dict = {}
    t_start = time.perf_counter()
    for step in range(start, total):
        if progress is not None:
            progress.value = step
        maybe_fail(rank, step, attempt)
        timer.begin(step)
        vote.begin()
        torch.manual_seed(step_seed(cfg.train.seed, step, rank))
        lr_schedule.apply(session.optimizer, step)
        profiler.before(step)
        timer.lap(Mark.OTHER)
        micro_data = next(batches)
        timer.lap(Mark.DATA)
        loss = runner.train_step(step, micro_data)
        done = step + 1
        # The vote was cast when the step began; its result is only read here.
        signum = vote.decided()
        saver.poll()
        timer.lap(Mark.OTHER)
        timer.end()
        profiler.after(step)
        report.step(done, loss)
        if cfg.train.eval and (done % spe == 0 or done == total):
            runner.where = f"evaluation after step {done}"
            top1, top5, seen = evaluate(
                runner,
                session.splits.val,
                topo,
                coord,
                B,
                cfg.data.workers,
                session.last_group,
                device,
                session.splits.num_classes,
            )
            summary.update(val_accuracy=top1, val_top5=top5, val_samples=seen)
            report.evaluated(done, top1, top5, seen)
        if saver.due(done, total, stopping=bool(signum)):
            report.flush(done)
            runner.where = f"checkpoint after step {done}"
            saver.save(done, block=bool(signum) or done == total)
        if signum and done < total:
            profiler.close()
            raise Stopped(signum, done, saver.last_saved)
    elapsed = time.perf_counter() - t_start
    profiler.close()
    runner.where = "trace"
    observe.finish_trace(cfg, topo, rank, session, store)
    # --checkpoint is a path on node 0 (other nodes may not name one): rank 0 decides.
    final = [cfg.train.checkpoint]
    dist.broadcast_object_list(final, src=0, group=session.groups["control"])
    if final[0]:
        runner.where = "checkpoint"
        ckpt.save_distributed(final[0], session.stage, topo, coord, group=session.groups["control"])
    if rank != reporter:
        report.finish(None)
        return None
    summary.update(
        summary=True,
        steps=total,
        start_step=start,
        attempt=attempt,
        samples_per_s=round(report.meter.samples_per_s, 2),
        elapsed_s=round(elapsed, 3),
        save_stall_s=saver.stalls,
        world_size=topo.world_size,
        shape=list(topo.shape),
        num_bundles=topo.num_bundles,
        micro_batches=topo.micro_batches,
        schedule=cfg.parallel.schedule,
        grad_sync=cfg.parallel.grad_sync,
        model=cfg.model.name,
        peak_in_flight=runner.peak_in_flight,
        precision=cfg.compute.precision,
        recompute=cfg.compute.recompute,
        channels_last=cfg.compute.channels_last,
        final_loss=report.final_loss,
    )
    if runner.scaler is not None:
        summary.update(skipped_steps=runner.scaler.skipped, loss_scale=runner.scaler.scale)
    if runner.device.type == "cuda":  # the reporting process's own peak (make gpu-check reads it)
        peak = torch.cuda.max_memory_allocated(runner.device)
        summary["peak_memory_mib"] = round(peak / 2**20, 1)
    if cfg.predicted_samples_per_s is not None:
        # The planner chose this plan (--bundle-shape/--partition auto): its prediction beside
        # the measured samples_per_s.
        summary["predicted_samples_per_s"] = cfg.predicted_samples_per_s
    summary.setdefault("val_accuracy", None)
    summary.setdefault("val_top5", None)
    if cfg.observe.trace:
        summary["trace"] = cfg.observe.trace
    return report.finish(summary)


def evaluate(
    runner: StageRunner,
    dataset,
    topo: Topology,
    coord: Coord,
    batch: int,
    workers: int,
    last_group,
    device,
    num_classes: int,
) -> tuple[float, float | None, int]:
    """Top-1 and top-5 accuracy (top-5 None with 5 classes or fewer) over the validation set in
    global batches of ``batch`` rows, pipelined forward-only."""
    stage = runner.sync.module
    stage.eval()
    n = len(dataset)
    batches = [torch.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    usable = [(ix, eval_rows(len(ix), topo, coord.bundle)) for ix in batches]
    usable = [(ix, rows) for ix, rows in usable if rows is not None]
    stream = None
    if _reads_data(topo, coord):
        shard = _shard(topo, coord, 1)
        lists = [shard.micro_indices(ix)[0] for ix, _ in usable]
        stream = data.stage_micro_batches(
            dataset, lists, first=coord.stage == 0, workers=workers, pin_memory=_pins(device)
        )
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    label = runner.where
    for i, (_ix, rows) in enumerate(usable):
        # Each batch moves the position the step watchdog reads: a long evaluation is not a stall.
        runner.where = f"{label}, batch {i + 1} of {len(usable)}"
        counts += runner.eval_batch(rows, next(stream) if stream else None)
    stage.train()
    if last_group is None:
        return 0.0, None, 0
    dist.all_reduce(counts, group=last_group)
    top1, top5, total = counts.tolist()
    if not total:
        return 0.0, None, 0
    # With 5 classes or fewer every row is in its top 5: no figure worth reporting.
    return top1 / total, (top5 / total if num_classes > 5 else None), int(total)
