"""What a run shows of itself, built once per process from the config: the progress reporter
(console, metrics file, TensorBoard, per-stage breakdown), the kernel profiler, and at the end the
merged trace."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from bundle.config import RunConfig, parse_steps
from bundle.observe import timing
from bundle.observe.board import Board
from bundle.observe.console import Console
from bundle.observe.metrics import LossSum, Outputs, Reporter, ReportPlan
from bundle.observe.trace import KernelProfiler, write_trace
from bundle.topology import Topology

if TYPE_CHECKING:
    from bundle.collectives.comm import Comm
    from bundle.runtime.groups import ProcessGroups


class Timed(Protocol):
    @property
    def timer(self) -> timing.StepTimer: ...


class Observed(Protocol):
    """What this reads of a rank's ``bundle.session.Session``, named by shape rather than imported:
    the session is floors above this one (tests/unit/test_house.py FLOORS)."""

    @property
    def engine(self) -> Timed: ...

    @property
    def groups(self) -> ProcessGroups: ...

    @property
    def comm(self) -> Comm: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


def reporter_rank(topo: Topology) -> int:
    """The process that reports: replica 0 of the loss's stage of bundle 0 (it sees the loss)."""
    return topo.rank(0, topo.loss_stage, 0)


def make_reporter(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    session: Observed,
    *,
    total: int,
    steps_per_epoch: int,
    start: int,
    device: torch.device,
) -> Reporter:
    reporting = rank == reporter_rank(topo)
    return Reporter(
        plan=ReportPlan(
            log_every=cfg.train.log_every,
            total=total,
            batch=cfg.train.batch_size,
            start=start,
            # --compile: a stage compiles its backward in its first step, which the stages
            # after it wait for in their second; the first S + 1 steps are start-up.
            warmup=topo.num_stages + 1 if cfg.compute.compile else 1,
        ),
        loss=LossSum(group=session.groups.last_stage, device=device, comm=session.comm),
        outputs=Outputs(
            reporting=reporting,
            path=cfg.metrics_out,
            board=Board(cfg.observe.tensorboard if reporting else None, start=start),
            console=Console(
                total=total, start=start, steps_per_epoch=steps_per_epoch, enabled=reporting
            ),
        ),
        breakdown=timing.Breakdown(
            session.engine.timer,
            group=session.groups.control,
            rank=rank,
            reporter=reporter_rank(topo),
            stage_of=[topo.coord(r).stage for r in range(topo.world_size)],
            ideal=timing.ideal_bubble(
                topo.num_stages,
                topo.micro_batches,
                cfg.parallel.schedule,
                cfg.parallel.virtual_stages,
            ),
        ),
        lr=lambda: session.optimizer.param_groups[0]["lr"],
        bundles=list(topo.bundles) if cfg.launch.fault_tolerance == "bundle" else None,
    )


def make_profiler(cfg: RunConfig, rank: int, device: torch.device) -> KernelProfiler:
    steps = parse_steps("--profile-steps", cfg.observe.profile_steps)
    return KernelProfiler(steps, cfg.observe.profile_dir, rank, device)


def finish_trace(
    cfg: RunConfig, topo: Topology, rank: int, session: Observed, store: dist.Store | None
) -> None:
    """Collective when tracing: every rank sends its traced slices to rank 0, which writes them."""
    timer = session.engine.timer
    if timer.trace is None:
        return
    write_trace(
        cfg.observe.trace,
        timer.slices,
        rank=rank,
        topo=topo,
        group=session.groups.control,
        store=store,
        timeout=cfg.launch.timeout,
        info={
            "shape": list(topo.shape),
            "num_bundles": topo.num_bundles,
            "micro_batches": topo.micro_batches,
            "schedule": cfg.parallel.schedule,
            "steps": list(timer.trace),
        },
    )
