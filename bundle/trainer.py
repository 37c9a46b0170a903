"""The training loop of one process: a ``Trainer`` built once from its session and components,
whose ``train()`` runs the steps and lets each component act when it is due."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from bundle import data, log
from bundle.checkpoint import final as final_weights
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.manager import Checkpointer
from bundle.config import RunConfig, parse_bundle_sync
from bundle.data import samples
from bundle.engine import compiled, optim, precision
from bundle.engine.stage_engine import MicroBatch
from bundle.errors import DataError
from bundle.evaluate import EvalPlan, Evaluator
from bundle.lr_schedule import LRSchedule
from bundle.observe import build as observe
from bundle.observe.metrics import Reporter, RunFacts, Summary, model_label
from bundle.observe.timing import Mark
from bundle.observe.trace import KernelProfiler
from bundle.runtime import keys
from bundle.runtime.phase import Phase
from bundle.runtime.preemption import Regroup, Stopped, StopRequest, StopVote, maybe_fail
from bundle.session import Session, make_checkpointer, param_counts, train_stream
from bundle.topology import Topology


@dataclass(frozen=True)
class Run:
    """Where one process stands in the job: its rank, the attempt, the steps it trains."""

    cfg: RunConfig
    topo: Topology
    rank: int
    attempt: int
    start: int
    total: int
    steps_per_epoch: int


class StepCounter(Protocol):
    """A shared integer (a ``multiprocessing.Value``): the node supervisor reads the step in
    progress from it."""

    value: int


@dataclass(frozen=True, kw_only=True)
class Links:
    """What the launching side ties a process's loop to, alike in each of its epochs: the
    process's phase, the attempt (the job's restarts), the stop request, the job's store, the step
    counter its node supervisor reads, and (--fault-tolerance bundle, ``asks``) the bundles'
    requests to join, agreed on in the stop vote at the engine's commit."""

    phase: Phase
    attempt: int = 0
    stop: StopRequest | None = None
    store: dist.Store | None = None
    step_now: StepCounter | None = None
    asks: Callable[[], list[int]] | None = None


@dataclass(frozen=True, kw_only=True)
class JobLink:
    """What ties the loop to the job around it: the process's phase, the job-wide stop vote, the
    job's store (the merged trace, the steps lost to restarts) and the step counter its node
    supervisor reads (None under torchrun)."""

    phase: Phase
    vote: StopVote
    store: dist.Store | None = None
    step_now: StepCounter | None = None


@dataclass(frozen=True, kw_only=True)
class Reporting:
    """What the loop reports through: validation, loss windows and the summary, kernel traces."""

    evaluator: Evaluator
    reporter: Reporter
    profiler: KernelProfiler


class Trainer:
    """Trains one rank's session from ``run.start`` to ``run.total``."""

    def __init__(
        self,
        run: Run,
        session: Session,
        *,
        batches: Iterator[list[MicroBatch] | None],
        lr_schedule: LRSchedule,
        checkpointer: Checkpointer,
        reporting: Reporting,
        job: JobLink,
    ) -> None:
        self.run, self.session, self.engine = run, session, session.engine
        self.batches, self.lr_schedule, self.checkpointer = batches, lr_schedule, checkpointer
        self.evaluator, self.reporter = reporting.evaluator, reporting.reporter
        self.profiler, self.vote, self.phase = reporting.profiler, job.vote, job.phase
        self.store, self.step_now = job.store, job.step_now
        # Steps whose update this process took (--fault-tolerance bundle carries it over a
        # change of members), and the bundles that left the job so far (its summary).
        self.committed = run.start
        self.data_wait = 0.0  # seconds the steps waited for their micro-batches
        self.bundle_failures: int | None = None
        self.heals: int | None = None

    def train(self) -> Summary | None:
        """Train, evaluating and saving when due; then the trace and the final weights.

        The reporting rank returns the run's summary, every other rank None. When the job stops
        for a signal, every rank raises ``Stopped`` once the checkpoint is written.
        """
        run = self.run
        self._announce()
        clock = time.perf_counter()
        only = run.cfg.train.eval_only
        if only or run.start >= run.total:
            # Nothing to train: the model as it stands, evaluated (a run resumed at its end too).
            self.evaluator.now(run.start)
        for step in range(run.start, run.start if only else run.total):
            signum = self._step(step)
            done = step + 1
            self.evaluator.maybe_run(done)
            self.checkpointer.maybe_save(done, stopping=bool(signum))
            if signum and done < run.total:
                self.profiler.close()
                raise Stopped(signum, done, self.checkpointer.last_saved)
            if self._may_regroup(step, done) and (joining := self.vote.agreed()):
                self.profiler.close()
                raise Regroup(joining, done)
        elapsed = time.perf_counter() - clock
        self.profiler.close()
        self.phase.enter("trace")
        observe.finish_trace(run.cfg, run.topo, run.rank, self.session, self.store)
        self._save_final_weights()
        return self.reporter.finish(self._facts(elapsed, self._replaced_samples()))

    def _may_regroup(self, step: int, done: int) -> bool:
        """Whether bundles may be taken back in after ``step`` (--fault-tolerance bundle): not
        after the last step, and with --bundle-sync local|diloco only after a meeting, where
        every bundle holds the same parameters (the new one's are a peer's copy)."""
        outer = self.engine.outer
        return (
            self.vote.asks is not None
            and done < self.run.total
            and (outer is None or outer.due(step))
        )

    def _step(self, step: int) -> int:
        """One step with what surrounds it; returns the signal the job stops for after it (0: none)."""
        self.phase.training()
        if self.step_now is not None:
            self.step_now.value = step
        maybe_fail(self.run.topo.job_rank(self.run.rank), step, self.run.attempt)
        timer = self.engine.timer
        timer.begin(step)
        self.vote.begin()
        # Seeded by the job's rank: the same when bundles leave (--fault-tolerance bundle).
        torch.manual_seed(
            samples.step_seed(self.run.cfg.train.seed, step, self.run.topo.job_rank(self.run.rank))
        )
        self.lr_schedule.apply(self.session.optimizer, step)
        self.profiler.before(step)
        timer.lap(Mark.OTHER)
        self.phase.enter(f"data loading (step {step + 1})")
        waited = time.perf_counter()
        micro_data = next(self.batches)
        self.data_wait += time.perf_counter() - waited
        self.phase.training()
        timer.lap(Mark.DATA)
        loss = self.engine.train_step(step, micro_data)
        self.committed = step + 1
        # The vote was cast when the step began (under --fault-tolerance bundle: at the engine's
        # commit); its result is only read here.
        signum = self.vote.decided()
        self.checkpointer.poll()
        timer.lap(Mark.OTHER)
        timer.end()
        self.profiler.after(step)
        self.reporter.step(step + 1, loss)
        return signum

    def _announce(self) -> None:
        run, cfg, topo = self.run, self.run.cfg, self.run.topo
        if run.rank != observe.reporter_rank(topo):
            return
        label = model_label(cfg.model.name, cfg.model.kwargs)
        built_by = f" ({cfg.model.name})" if label != cfg.model.name else ""
        doing = "evaluating" if cfg.train.eval_only else "training"
        log.get().info(
            f"{doing} {label}{built_by}: shape {','.join(map(str, topo.shape))}"
            f"{' tensor-parallel ' + ','.join(map(str, topo.tp)) if topo.tp else ''} x "
            f"{topo.num_bundles} bundle(s), {topo.world_size} processes, batch "
            f"{cfg.train.batch_size} in {topo.micro_batches} micro-batch(es), "
            f"{cfg.parallel.schedule}, {cfg.parallel.grad_sync} sync{_data_parallel(cfg)}, "
            f"{_mixed(cfg, topo)}{precision.describe(cfg.compute)}, steps {run.start + 1}..{run.total} "
            f"({run.steps_per_epoch}/epoch)"
        )

    def _save_final_weights(self) -> None:
        # --checkpoint is a path on node 0 (other nodes may not name one): rank 0 decides.
        groups = self.session.groups
        final = [self.run.cfg.train.checkpoint]
        dist.broadcast_object_list(final, src=0, group=groups.control)
        if final[0]:
            self.phase.enter("checkpoint")
            session, lora = self.session, self.run.cfg.model.lora is not None
            args = (final[0], session.stage, self.run.topo, session.coord, session.split)
            final_weights.save_distributed(*args, group=groups.control, trained_only=lora)

    def _replaced_samples(self) -> int | None:
        """--skip-bad-samples: the job's replaced samples, summed over every rank (collective)."""
        if not self.run.cfg.data.skip_bad_samples:
            return None
        splits = self.session.splits
        count = torch.tensor([samples.replaced(splits.train) + samples.replaced(splits.val)])
        dist.all_reduce(count, group=self.session.groups.control)
        return int(count.item())

    def _most(self, held: tuple[int, ...]) -> tuple[float, float, tuple[int, ...]]:
        """The largest data wait (s), peak resident memory (MiB) and each of this process's
        counts ``held`` (bytes, compile milliseconds) over the job (collective)."""
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        # float64 holds byte counts exactly up to 2**53 (8 PiB).
        most = torch.tensor([self.data_wait, rss_mib, *held], dtype=torch.float64)
        if dist.is_initialized():  # (a lone Trainer, as some tests build one, reports its own)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.session.groups.control)
        return round(float(most[0]), 3), round(float(most[1]), 1), tuple(int(b) for b in most[2:])

    def _facts(self, elapsed: float, replaced_samples: int | None = None) -> RunFacts:
        cfg, topo, engine = self.run.cfg, self.run.topo, self.engine
        params = list(self.session.stage.parameters())
        held = (  # parameters, their gradients at the step (cleared after it), optimizer state
            sum(optim.local_bytes(p) for p in params),
            sum(optim.local_bytes(p) for p in params if p.requires_grad),
            optim.state_bytes(self.session.optimizer),
        )
        # --compile: seconds spent compiling, apart from step time (the job's longest).
        spent = compiled.seconds() if cfg.compute.compile else 0.0
        data_wait, rss, most = self._most((*held, int(spent * 1e3)))
        most, compile_ms = most[:-1], most[-1]
        counts = param_counts(self.session)
        scaler, device = engine.scaler, engine.device
        # The reporting process's own peak (make gpu-check reads it).
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        label = model_label(cfg.model.name, cfg.model.kwargs)
        return RunFacts(
            model=label,
            factory=cfg.model.name if label != cfg.model.name else None,
            shape=list(topo.shape),
            num_bundles=topo.num_bundles,
            world_size=topo.world_size,
            micro_batches=topo.micro_batches,
            schedule=cfg.parallel.schedule,
            grad_sync=cfg.parallel.grad_sync,
            precision=cfg.compute.precision,
            recompute=cfg.compute.recompute,
            channels_last=cfg.compute.channels_last,
            steps=self.run.total,
            start_step=self.run.start,
            attempt=self.run.attempt,
            elapsed_s=elapsed,
            save_stall_s=self.checkpointer.stalls,
            peak_in_flight=engine.peak_in_flight,
            param_bytes=held[0],
            grad_bytes=held[1],
            optimizer_bytes=held[2],
            most_param_bytes=most[0],
            most_grad_bytes=most[1],
            most_optimizer_bytes=most[2],
            data_wait_s=data_wait,
            peak_rss_mib=rss,
            grad_wire_ratio=round(engine.sync.wire.ratio, 4),
            grad_sync_bytes=sum(c.sync.wire.sent for c in engine.chunks)
            // max(1, self.run.total - self.run.start),
            trainable_params=counts[0],
            all_params=counts[1],
            skipped_steps=scaler.skipped if scaler else None,
            loss_scale=scaler.scale if scaler else None,
            peak_memory_mib=round(peak / 2**20, 1) if peak is not None else None,
            # The planner chose this plan (auto): its prediction beside the measured figure.
            predicted_samples_per_s=cfg.predicted_samples_per_s,
            trace=cfg.observe.trace or None,
            replaced_samples=replaced_samples,
            bundles_in_step=list(topo.bundles) if self.bundle_failures is not None else None,
            bundle_failures=self.bundle_failures,
            heals=self.heals,
            lost_steps=self._lost_steps(),
            compile_s=compile_ms / 1e3 if cfg.compute.compile else None,
        )

    def _lost_steps(self) -> int | None:
        """What node 0's supervisor counted before this attempt (a restarted job); 0 under
        --fault-tolerance bundle before any restart; else None (not reported)."""
        store = self.store
        if store is not None and store.check([keys.LOST_STEPS]):
            return int(store.get(keys.LOST_STEPS).decode())
        return 0 if self.bundle_failures is not None and self.run.attempt == 0 else None


def _data_parallel(cfg: RunConfig) -> str:
    """The data-parallel options a run departs from the defaults with (docs/data-parallel.md)."""
    par, said = cfg.parallel, []
    if par.zero:
        said.append(f"ZeRO-{par.zero}")
    if par.grad_compression != "none":
        said.append(f"{par.grad_compression} gradients")
    mode, every = parse_bundle_sync(par.bundle_sync)
    if mode != "step":
        said.append(f"{'DiLoCo' if mode == 'diloco' else 'local SGD'} every {every} steps")
    if par.aggregate != "mean":
        said.append(f"{par.aggregate} of bundles")
    return f" ({', '.join(said)})" if said else ""


def _mixed(cfg: RunConfig, topo: Topology) -> str:
    """Rows by speed and a plan's device types per stage (docs/mixed-devices.md), if any."""
    said = [f"rows {cfg.parallel.row_weights}"] if cfg.parallel.row_weights else []
    if any(p.kind or p.cpu for p in topo.placement):
        for s in range(topo.num_stages):
            kinds = [topo.placement[topo.rank(0, s, r)] for r in range(topo.shape[s])]
            said.append(f"stage {s} on " + "+".join(p.kind or f"cpu {p.cpu:g}" for p in kinds))
    return "".join(f"{x}, " for x in said)


def _epoch_steps(cfg: RunConfig, session: Session) -> int:
    """Steps in an epoch; a training set smaller than one batch is one line."""
    batch = cfg.train.batch_size
    spe = data.epoch_steps(session.splits.train, batch, cfg.train.steps)
    if spe == 0:
        raise DataError(
            f"the training set has {data.size(session.splits.train)} samples, fewer than one "
            f"batch of {batch}"
        )
    return spe


def data_position(resume: str | None) -> dict | None:
    """Where a stream stood at the checkpoint ``resume`` (its ``bundle.json``), if recorded."""
    got = ckpt.read_info(resume).get("data_position") if resume else None
    return got if isinstance(got, dict) else None


def _evaluator(
    cfg: RunConfig,
    topo: Topology,
    session: Session,
    reporter: Reporter,
    phase: Phase,
    *,
    epoch_steps: int,
    total: int,
) -> Evaluator:
    """Validation after every epoch and after the last step (--eval)."""
    return Evaluator(
        session,
        topo,
        plan=EvalPlan(
            batch=cfg.train.batch_size,
            every=epoch_steps,
            total=total,
            enabled=cfg.train.eval,
            limit=cfg.train.val_batches,
        ),
        workers=cfg.data.workers,
        reporter=reporter,
        phase=phase,
        device=session.engine.device,
    )


def build_trainer(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    session: Session,
    *,
    links: Links,
    resume: str | None = None,
    start: int | None = None,
) -> Trainer:
    """The loop's components for this rank; restores ``resume`` (collective) to learn the start,
    unless ``start`` is given (the state is carried in memory: --fault-tolerance bundle)."""
    phase, asks, spe = links.phase, links.asks, _epoch_steps(cfg, session)
    total = cfg.train.steps or cfg.train.epochs * spe
    checkpointer = make_checkpointer(cfg, topo, rank, session, total=total)
    if start is None:
        phase.enter("resume")
        start = checkpointer.restore(resume)
    run = Run(cfg, topo, rank, links.attempt, start, total, spe)
    if session.engine.outer is not None:
        session.engine.outer.total = total  # bundles meet after the last step too
    device = session.engine.device
    session.engine.timer.trace = cfg.observe.trace_range(start, total)
    reporter = observe.make_reporter(
        cfg, topo, rank, session, total=total, steps_per_epoch=spe, start=start, device=device
    )
    # Before a save the loss window closes, so a resumed run logs the same windows.
    checkpointer.before_save += [
        reporter.flush,
        lambda step: phase.enter(f"checkpoint after step {step}"),
    ]
    return Trainer(
        run,
        session,
        batches=train_stream(
            session,
            topo,
            cfg.train.seed,
            total,
            cfg.data.workers,
            start=start,
            device=device,
            position=data_position(resume),
        ),
        lr_schedule=LRSchedule.of(cfg.train, steps_per_epoch=spe, total=total),
        checkpointer=checkpointer,
        reporting=Reporting(
            evaluator=_evaluator(cfg, topo, session, reporter, phase, epoch_steps=spe, total=total),
            reporter=reporter,
            profiler=observe.make_profiler(cfg, rank, device),
        ),
        job=JobLink(
            phase=phase,
            # Under --fault-tolerance bundle (``asks``) the vote is cast at the engine's commit.
            vote=StopVote(
                links.stop or StopRequest(),
                session.groups.control,
                cfg.launch.timeout,
                asks,
                at_commit=asks is not None,
            ),
            store=links.store,
            step_now=links.step_now,
        ),
    )
