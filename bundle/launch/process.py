"""One training process, self-spawned by the node supervisor or started by torchrun: its logger,
stop signals, store, watchdogs and process group around the session, and how it reports failing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeAlias

import torch
import torch.distributed as dist

from bundle import log
from bundle.config import RunConfig
from bundle.errors import ConfigError, ExitCode
from bundle.launch.context import Counters, ProcessContext, SharedFloat, StoreAt, WorkerStart
from bundle.launch.ft.epochs import train_on
from bundle.launch.ft.membership import EXIT_LEFT, BundleLeft, TooFewBundles
from bundle.launch.throttle import own_quota
from bundle.models.cut import Capture
from bundle.observe.build import reporter_rank
from bundle.observe.metrics import Summary
from bundle.runtime import keys
from bundle.runtime.devices import (
    device_for,
    prepare_backend_env,
    resolve_backend,
    survivable_nccl,
    torch_backend,
)
from bundle.runtime.phase import Phase
from bundle.runtime.preemption import Stopped, StopRequest, exit_code, stop_line
from bundle.runtime.store import (
    exchange_config,
    open_generation,
    open_store,
    post_abort,
    read_abort,
    start_abort_watch,
    store_barrier,
)
from bundle.runtime.watchdog import StepWatchdog, group_timeout, watch_limit
from bundle.session import build_session
from bundle.topology import Topology
from bundle.trainer import Links, build_trainer

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

# How the node supervisor starts its workers (``worker_context``).
WorkerContext: TypeAlias = "SpawnContext | ForkServerContext"

BEAT_S = 0.25  # a worker's signs of life to its node supervisor (``beat``)


def start_step_watchdog(
    store: dist.Store,
    me: str,
    phase: Phase,
    backend: str,
    timeout: float,
    *,
    exit: Callable[[int], None] = os._exit,
) -> StepWatchdog:
    """End this process, reporting where, when training stops moving (bundle/runtime/watchdog.py)."""

    def report(message: str) -> None:
        log.get().error(post_abort(store, message))

    return StepWatchdog(
        me=me,
        position=lambda: str(phase),
        limit=watch_limit(backend, timeout),
        report=report,
        exit=exit,
    ).start()


def beat(alive: SharedFloat, every: float = BEAT_S) -> None:
    """A daemon thread that writes the monotonic clock into ``alive`` every ``every`` seconds:
    the node supervisor tells a stopped or frozen process (no beats) from one that waits on its
    peers (a collective or a transfer releases the interpreter, so the beats go on)."""

    def run() -> None:
        while True:
            alive.value = time.monotonic()
            time.sleep(every)

    threading.Thread(target=run, name="bundle-alive", daemon=True).start()


# -- one worker process --------------------------------------------------------------------------


def worker_main(start: WorkerStart) -> int:
    """Body of every training process; returns its exit code (128 + signal when stopped by one).

    ``start.counters``: what it shares with its node supervisor (None under torchrun: each
    process then says for itself when it stops); ``start.store_at.serve``: this process serves
    the job's store (torchrun's rank 0 when its agent serves none).
    """
    cfg, topo, rank = start.cfg, start.topo, start.rank
    if start.counters.alive is not None:
        beat(start.counters.alive)
    c = topo.coord(rank)
    log.setup(f"[rank {rank} b{c.bundle} s{c.stage}]", verbose=rank == reporter_rank(topo))
    # A supervised worker leaves saying so to its supervisor; under torchrun each one says it.
    shared = start.counters.stop
    stop = StopRequest(shared=shared, announce=shared is None)
    stop.install(on_second=lambda signum: os._exit(exit_code(signum)))
    backend = torch_backend(resolve_backend(cfg))
    share = topo.cpu_share(rank) if backend == "gloo" else None
    at = start.store_at
    prepare_backend_env(backend, at.host, at.port, topo.procs_per_node, cpu_share=share)
    store = _job_store(start)
    me = topo.describe(rank)
    start_abort_watch(store, rank, me)
    phase = Phase()
    watchdog = start_step_watchdog(store, me, phase, backend, cfg.launch.timeout)
    proc = ProcessContext(start=start, backend=backend, store=store, phase=phase, stop=stop)
    try:
        if cfg.launch.fault_tolerance == "bundle":
            summary = train_on(
                proc,
                join=lambda layout, me, prefix: _join(cfg, layout, me, backend, store, prefix),
                arrive=lambda layout, name: _arrive(cfg, layout, store, name),
            )
        else:
            summary = _train(proc)
        if summary is not None:
            print(summary.line(), flush=True)
        return ExitCode.OK
    except BundleLeft as left:  # a process of this bundle failed: the others train on
        watchdog.stop()
        log.get().warning(f"{me}: {left}; this process leaves")
        return EXIT_LEFT
    except Stopped as stopped:
        watchdog.stop()
        _say_stopped(cfg, start.local_rank, stopped)
        return stopped.code
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other processes
        watchdog.stop()  # this error is the report
        return _report_failure(store, me, rank, phase, exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(proc: ProcessContext) -> Summary | None:
    """The ordinary run: one world, from the first step to the last."""
    start, phase, stop, store = proc.start, proc.phase, proc.stop, proc.store
    cfg, topo, rank, capture = start.cfg, start.topo, start.rank, start.capture
    attempt, resume, step_now = start.attempt, start.resume, start.counters.step_now
    device = _join(cfg, topo, rank, proc.backend, store)
    session = build_session(
        cfg,
        topo,
        rank,
        device,
        arrive=lambda name: _arrive(cfg, topo, store, name),
        capture=capture,
    )
    phase.follow(session.engine)
    trainer = build_trainer(
        cfg,
        topo,
        rank,
        session,
        links=Links(phase=phase, attempt=attempt, stop=stop, store=store, step_now=step_now),
        resume=resume,
    )
    summary = trainer.train()
    session.comm.barrier()  # the world group: in order with the point-to-point calls
    return summary


def _job_store(start: WorkerStart) -> dist.Store:
    cfg, topo, rank, at = start.cfg, start.topo, start.rank, start.store_at
    timeout = cfg.launch.init_timeout
    base = open_store(
        at.host, at.port, server=at.serve, timeout=timeout, nodes=cfg.launch.num_nodes
    )
    if not cfg.launch.torchrun:
        # Every attempt of a restarted job keeps its keys apart: the store outlives the attempts.
        return dist.PrefixStore(keys.attempt(start.attempt), base)
    # torchrun's groups of workers (restarts, nodes lost or joined) are numbered in the store
    # itself: the agents' restart counts need not agree (bundle/runtime/store.py).
    generation = open_generation(base, rank, topo.world_size, timeout)
    store = dist.PrefixStore(keys.generation(generation), base)
    # No node supervisor compared settings: every process compares its own.
    exchange_config(store, cfg, rank, topo.world_size, timeout, what="rank")
    return store


def _arrive(cfg: RunConfig, topo: Topology, store: dist.Store, name: str) -> None:
    store_barrier(store, name, topo.world_size, cfg.launch.init_timeout)


def _join(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    backend: str,
    store: dist.Store,
    prefix: str = keys.GROUP,
) -> torch.device:
    """Wait for every process, take this process's device and create the default group (its
    keys under ``prefix``: a fresh one for each world of --fault-tolerance bundle)."""
    _arrive(cfg, topo, store, "start" if prefix == keys.GROUP else f"{prefix}/start")
    # --share-gpus sets NCCL's multi-rank switch here, in the worker itself (self-spawned or
    # under torchrun alike), before NCCL first reads its environment.
    device = device_for(backend, topo.device_index(rank), share_gpus=cfg.launch.share_gpus)
    if backend == "nccl" and cfg.launch.fault_tolerance == "bundle":
        survivable_nccl()
    # With NCCL, naming the device forms the world communicator now, with every rank: the
    # first batch_isend_irecv on the default group may then involve only two ranks (NCCL
    # requires all of a group's ranks in its first call otherwise), and sub-groups are split
    # from it instead of being bootstrapped one by one.
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=topo.world_size,
        timeout=group_timeout(backend, cfg.launch.timeout),
        device_id=device if backend == "nccl" else None,
    )
    return device


def _say_stopped(cfg: RunConfig, local_rank: int, stopped: Stopped) -> None:
    """Under torchrun one process per node says how to resume (a supervisor does it otherwise)."""
    if cfg.launch.torchrun and local_rank == 0:
        launcher = "torchrun [the same torchrun options]"
        print(
            stop_line(stopped.signum, stopped.step, stopped.checkpoint, sys.argv[1:], launcher),
            file=sys.stderr,
            flush=True,
        )


def _report_failure(store: dist.Store, me: str, rank: int, phase: Phase, exc: BaseException) -> int:
    """Post this failure to the job unless another process's came first (then say that one)."""
    # Too few bundles left is the job's failure, not this healthy process's: said as such.
    mine = (
        f"the job has too few bundles: {exc}"
        if isinstance(exc, TooFewBundles)
        else f"{me} failed at {phase}: {type(exc).__name__}: {exc}"
    )
    deadline = time.monotonic() + 2.0
    cause = None
    try:
        while cause is None and time.monotonic() < deadline:
            cause = read_abort(store)
            time.sleep(0.1) if cause is None else None
        if cause is None:
            cause = post_abort(store, mine)
    except RuntimeError:  # the store's host is gone (it died first): say this failure alone
        cause = mine
    if cause == mine:
        log.get().error(cause)
        if not isinstance(exc, Exception):
            raise exc
    else:
        log.get().error(f"stopping rank {rank}: {cause}")
    return ExitCode.FAILED


# What every worker imports: the node supervisor's forkserver imports it once, and each worker it
# forks starts with it (a spawned worker spends a second or two of CPU importing these, at every
# start, restart and heal). Nothing of it runs: no torch op, no thread pool, no CUDA. torch's
# optimizers import torch._dynamo when they take their first parameters (Optimizer.add_param_group
# is torch._disable_dynamo's): 2.5 s of CPU in every worker unless the forkserver has it.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "bundle.launch.process"]


def worker_context() -> WorkerContext:
    """How the node supervisor starts its workers: forked from a forkserver that has ``PRELOAD``
    (a fresh interpreter's start-up, without its imports), else spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


Place = tuple[dict[str, str], str, str]


def where_we_are() -> Place:
    """This process's environment, working directory and default start method, for a child of a
    forkserver to take: it would have the forkserver's, as they were when it started, and the
    forkserver as its own default, under which the loader workers it starts would outlive it
    (torch's loader workers watch for their parent's death, and the forkserver is theirs)."""
    return dict(os.environ), os.getcwd(), mp.get_start_method()


def take_place(place: Place) -> None:
    environ, cwd, method = place
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    mp.set_start_method(method, force=True)


def spawned(start: WorkerStart, place: Place | None = None) -> None:
    """Entry of a worker process started by the node supervisor (``place``: ``where_we_are()``)."""
    if place is not None:
        take_place(place)
    os._exit(worker_main(start))


# -- torchrun --------------------------------------------------------------------------------


def torchrun_env() -> dict[str, str] | None:
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in names):
        return None
    env = {k: os.environ[k] for k in names}
    # "False" when the agent serves no store at MASTER_ADDR:MASTER_PORT (as with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): rank 0 serves it, as torch's env:// does.
    env["TORCHELASTIC_USE_AGENT_STORE"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True")
    return env


def run_torchrun(
    cfg: RunConfig,
    topo: Topology,
    env: dict[str, str],
    resume: str | None,
    capture: Capture | None = None,
) -> NoReturn:
    """One worker of a torchrun job; torchrun's own restarts (``--max-restarts``) resume with
    ``--resume auto``, and ``TORCHELASTIC_RESTART_COUNT`` numbers the attempt. Under
    ``--nnodes MIN:MAX`` every restart is a new job to this process: the shape was planned for
    the ``WORLD_SIZE`` of this rendezvous round, and the newest checkpoint is read at that shape."""
    if int(env["WORLD_SIZE"]) != topo.world_size:
        raise ConfigError(
            "WORLD_SIZE",
            env["WORLD_SIZE"],
            f"shape {','.join(map(str, topo.shape))} x {topo.num_bundles} bundle(s) needs {topo.world_size} processes",
        )
    # No supervisor owns this process's CPU quota (an emulated slower device): it takes its own.
    job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}.{os.getpid()}"
    rank = int(env["RANK"])
    quota = own_quota(topo, rank, torch_backend(resolve_backend(cfg)), job)
    serve = rank == 0 and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    start = WorkerStart(
        cfg=cfg,
        topo=topo,
        rank=rank,
        local_rank=int(env["LOCAL_RANK"]),
        store_at=StoreAt(host=env["MASTER_ADDR"], port=int(env["MASTER_PORT"]), serve=serve),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        resume=resume,
        capture=capture,
        counters=Counters(),
    )
    code = worker_main(start)
    quota.release()
    # Leave as a self-spawned worker does, without interpreter teardown: it may destroy the store
    # client while the abort-watch thread is inside a call on it (std::terminate, SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
