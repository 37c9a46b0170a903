"""The node supervisor of a self-spawned job: start, watch, restart and stop this node's workers.

    main.py (node supervisor) --spawn--> one worker per local process, per attempt
      node 0 also hosts the job's TCPStore at --IP:--portNum (on one node without --portNum,
      a free port if 29500 is busy); every node's supervisor checks
      the config fingerprints there, heartbeats, and watches its workers.

An attempt ends in one of three ways. *Done*: every worker exited 0. *Stopped*: a stop signal
reached the job, every worker saved and exited 128 + signal; the supervisor says how to resume
and exits with the same code. *Failed*: a worker died or raised (recorded in the attempt's
``abort`` key, which every node watches); every supervisor stops its workers, and while
``--max-restarts`` allows, waits until every node has done so and starts the next attempt from the
newest complete checkpoint. Each attempt's keys live under their own prefix of the one store.

Why not torch.distributed.elastic's agent (which torchrun runs, and which Bundle supports as is):
the original flags promise static node ranks and one command per node with no rendezvous
service; this supervisor reports a failure by rank, stage and step on every node, detects a
stalled node by heartbeat in 20 s (under --fault-tolerance bundle in --timeout, and only its
bundles leave) and a stopped or frozen worker by its own beats (before its peers' timeouts blame
whoever waited first), and compares the nodes' settings field by field.
"""

from __future__ import annotations

import enum
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from bundle import log
from bundle.checkpoint import format as ckpt
from bundle.config import RunConfig
from bundle.errors import ExitCode, LaunchError, PeerFailure
from bundle.launch import nodes
from bundle.launch.context import (
    Counters,
    Incarnation,
    SharedFloat,
    SharedInt,
    StoreAt,
    WorkerStart,
)
from bundle.launch.ft.handoff import EXIT_HANDOFF, file_of, handoff_directory
from bundle.launch.ft.heal import Healer
from bundle.launch.ft.membership import EXIT_LEFT
from bundle.launch.liveness import Worker, liveness_check
from bundle.launch.process import WorkerContext, spawned, where_we_are, worker_context
from bundle.launch.throttle import NodeQuotas, ThrottleError, cpu_shares
from bundle.models.cut import Capture
from bundle.runtime import keys
from bundle.runtime.devices import resolve_backend, torch_backend
from bundle.runtime.preemption import StopRequest, exit_code, stop_line
from bundle.runtime.store import (
    exchange_config,
    open_job_store,
    post_abort,
    read_abort,
    store_barrier,
)
from bundle.topology import Topology

_POLL_S = 0.5
_KILL_GRACE_S = 5.0


class End(enum.Enum):
    DONE = "done"  # every worker exited 0
    STOPPED = "stopped"  # a stop signal: every worker saved and exited 128 + signal
    FAILED = "failed"  # a worker died or raised, or a node stopped responding


@dataclass(frozen=True)
class Outcome:
    """How one attempt of this node's workers ended: ``signum`` when stopped, ``why`` when failed."""

    end: End
    signum: int = 0
    why: str = ""
    reached: int = 0  # the furthest step this node's workers had begun (0-based)


def _trained_again(reached: int, resume: str | None) -> int:
    """The committed steps a restart trains again: the ``reached`` steps before the one in
    progress when the attempt failed (0-based: as many as were committed) past the checkpoint
    ``resume`` (None: from the start)."""
    start = int(ckpt.read_info(resume)["step"]) if resume else 0
    return max(0, reached - start)


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def supervise(
    cfg: RunConfig, topo: Topology, resume: str | None, capture: Capture | None = None
) -> int:
    """Self-spawn launch of this node's processes; returns the node's exit code. ``capture``:
    the model's graph split made by the launch's checks, handed to every worker."""
    lc = cfg.launch
    node = lc.node_rank
    logger = log.setup(f"[node {node}]")
    store, port = open_job_store(lc, node=node, nodes=topo.num_nodes)
    exchange_config(store, cfg, node, topo.num_nodes, lc.init_timeout)
    ctx = worker_context()
    running: dict[int, BaseProcess] = {}

    def kill_now(signum: int) -> None:
        for p in running.values():
            p.kill()
        os.write(2, f"{signal.Signals(signum).name} again: stopped at once\n".encode())
        os._exit(exit_code(signum))

    stop = StopRequest(shared=ctx.Value("i", 0, lock=False))
    stop.install(on_second=kill_now)
    here = Node(cfg=cfg, topo=topo, store=store, port=port, spawn=ctx, stop=stop, running=running)
    again = 0  # steps trained again after restarts so far
    try:
        for attempt in range(lc.max_restarts + 1):
            outcome = _attempt(here, attempt, resume=resume, capture=capture)
            if outcome.end is End.DONE:
                return ExitCode.OK
            if outcome.end is End.STOPPED or stop.value:
                return _stopped(cfg, outcome.signum or stop.value)
            if attempt == lc.max_restarts:
                logger.error(f"job failed: {outcome.why}")
                return ExitCode.FAILED
            logger.warning(
                f"attempt {attempt + 1} failed: {outcome.why}; restart {attempt + 1} of "
                f"{lc.max_restarts} from the newest checkpoint"
            )
            try:  # every node has stopped this attempt's workers: no one starts the next alone
                restart = keys.restart_barrier(attempt)
                store_barrier(store, restart, topo.num_nodes, lc.init_timeout)
            except PeerFailure as exc:
                logger.error(f"job failed: {outcome.why}; no restart: {exc}")
                return ExitCode.FAILED
            resume, notes = ckpt.resolve(
                "auto" if cfg.checkpoint.save_dir else None, cfg.checkpoint.save_dir
            )
            for note in notes:
                logger.warning(note)
            again += _trained_again(outcome.reached, resume)
            if node == 0:
                next_keys = dist.PrefixStore(keys.attempt(attempt + 1), store)
                next_keys.set(keys.LOST_STEPS, str(again))
        return ExitCode.FAILED
    except (RuntimeError, LaunchError) as exc:  # a store call failed: its host, node 0, is gone
        store_at = f"the job's store at {lc.master_addr}:{port}"
        lost = f"lost contact with node 0 ({store_at})" if node else store_at
        logger.error(f"job failed: {lost}: {exc}")
        return ExitCode.FAILED


@dataclass(frozen=True, kw_only=True)
class Node:
    """What every attempt of this node's workers is started with (``supervise``): the job's
    store (each attempt's keys under a prefix of their own) and its port, how workers start,
    the supervisor's stop request (shared with them), and the workers that run now (``running``,
    killed at once on a second signal)."""

    cfg: RunConfig
    topo: Topology
    store: dist.Store
    port: int
    spawn: WorkerContext
    stop: StopRequest
    running: dict[int, BaseProcess]


def _attempt(node: Node, attempt: int, *, resume: str | None, capture: Capture | None) -> Outcome:
    """Run one attempt of this node's workers until they are done, stopped, or one failed;
    ``resume``: the checkpoint they start from, ``capture``: the model's graph split."""
    cfg, topo, ctx, running = node.cfg, node.topo, node.spawn, node.running
    lc = cfg.launch
    store = dist.PrefixStore(keys.attempt(attempt), node.store)
    ranks = topo.node_ranks(lc.node_rank)
    step_now: dict[int, SharedInt] = {rank: ctx.Value("q", -1, lock=False) for rank in ranks}
    alive: dict[int, SharedFloat] = {rank: ctx.Value("d", 0.0, lock=False) for rank in ranks}
    counters = {
        r: Counters(step_now=step_now[r], alive=alive[r], stop=node.stop.shared) for r in ranks
    }
    handoffs = handoff_directory(lc.node_rank) if lc.fault_tolerance == "bundle" else None
    process = _factory(node, counters, handoffs, attempt=attempt, resume=resume, capture=capture)
    procs = {rank: process(rank) for rank in ranks}
    # Emulated slower devices: the supervisor owns its workers' CPU quotas (launch/throttle.py).
    backend = torch_backend(resolve_backend(cfg))
    quotas = NodeQuotas(cpu_shares(topo, procs, backend), f"{node.port}.{os.getpid()}")
    for p in procs.values():
        p.start()
    running.clear()
    running.update(procs)
    log.get().info(
        f"started ranks {min(procs)}..{max(procs)} (pids {', '.join(str(p.pid) for p in procs.values())})"
        + (f", attempt {attempt + 1}" if attempt else "")
    )
    healer = None
    if lc.fault_tolerance == "bundle":

        def start_again(rank: int, incarnation: int, handed: bool = False) -> BaseProcess:
            p = procs[rank] = running[rank] = process(rank, incarnation, handed)
            p.start()
            quotas.admit({rank: p.pid})
            return p

        healer = Healer(topo, lc.node_rank, store, heals=lc.max_restarts, start=start_again)

    def job_failure() -> str | None:
        if healer is not None:
            healer.reap(procs)  # a dead bundle's other processes here
        return stopped_workers() or heartbeat() or read_abort(store)

    heartbeat = nodes.heartbeat_check(
        node.store, store, lc.node_rank, topo.num_nodes, lc.timeout, healer
    )
    stopped_workers = liveness_check(
        procs, alive, topo, lc.timeout, store, healer.frozen(procs) if healer else None
    )
    outcome = Outcome(End.FAILED, why="the node supervisor lost its workers")
    try:
        quotas.admit({rank: p.pid for rank, p in procs.items()})
        outcome = watch(
            procs,
            step_of=lambda rank: int(step_now[rank].value),
            describe=topo.describe,
            check=job_failure,
            post=lambda message: post_abort(store, message),
            recovery=Recovery(lose=healer.lose, restart=healer.restart, go_on=healer.go_on)
            if healer
            else None,
        )
        outcome = _finished(cfg, topo, store, outcome, heartbeat)
    except ThrottleError as exc:
        outcome = Outcome(End.FAILED, why=post_abort(store, str(exc)))
    finally:
        _stop(procs.values(), grace=_KILL_GRACE_S if outcome.end is End.FAILED else 0.0)
        running.clear()
        quotas.release()
        if handoffs is not None:
            shutil.rmtree(handoffs, ignore_errors=True)
    return replace(outcome, reached=max(int(v.value) for v in step_now.values()))


def _finished(
    cfg: RunConfig,
    topo: Topology,
    store: dist.Store,
    outcome: Outcome,
    heartbeat: Callable[[], str | None],
) -> Outcome:
    """This node's workers are done: say so; node 0, whose store the job uses, keeps it up until
    every node has finished with it."""
    lc = cfg.launch
    if outcome.end is End.FAILED:
        return outcome
    store.set(keys.done(lc.node_rank), "1")
    if lc.node_rank != 0:
        return outcome
    failure = nodes.wait_done(store, topo.num_nodes, lc.timeout + lc.init_timeout, check=heartbeat)
    return Outcome(End.FAILED, why=failure) if failure else outcome


class NewWorker(Protocol):
    def __call__(self, rank: int, incarnation: int = 0, handed: bool = False) -> BaseProcess: ...


def _factory(
    node: Node,
    counters: Mapping[int, Counters],
    handoffs: Path | None,
    *,
    attempt: int,
    resume: str | None,
    capture: Capture | None,
) -> NewWorker:
    """``process(rank, incarnation=0, handed=False)``: a new (unstarted) worker for one of this
    node's ranks (``handed``: it reads the state its previous process left in ``handoffs``)."""
    topo, at = node.topo, StoreAt(host=node.cfg.launch.master_addr, port=node.port)

    def process(rank: int, incarnation: int = 0, handed: bool = False) -> BaseProcess:
        here = str(file_of(handoffs, rank)) if handoffs else None
        alive = counters[rank].alive
        if alive is not None:
            alive.value = 0.0  # a new worker is not watched for beats before its first
        start = WorkerStart(
            cfg=node.cfg,
            topo=topo,
            rank=rank,
            local_rank=topo.local_rank(rank),
            store_at=at,
            attempt=attempt,
            resume=resume,
            capture=capture,
            counters=counters[rank],
            incarnation=Incarnation(
                number=incarnation, handoff_to=here, handed=here if handed else None
            ),
        )
        return node.spawn.Process(
            target=spawned,
            args=(start, where_we_are()),
            name=f"bundle-rank{rank}" + (f".{incarnation}" if incarnation else ""),
        )

    return process


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """Under --fault-tolerance bundle, what ``watch`` does with a worker that exited (the node's
    ``Healer``): ``lose(rank, what)`` takes a failed worker's bundle out of the job (``what`` is
    empty for a worker that left with its bundle) and returns the job's failure only when no
    bundle is left; ``restart(rank)`` returns the workers started again in its place, and
    ``go_on(rank)`` the new worker a survivor that handed its state over (``EXIT_HANDOFF``) goes
    on in."""

    lose: Callable[[int, str], str | None]
    restart: Callable[[int], Mapping[int, Worker]] | None = None
    go_on: Callable[[int], Mapping[int, Worker]] | None = None


def watch(
    procs: Mapping[int, Worker],
    *,
    step_of: Callable[[int], int],
    describe: Callable[[int], str],
    check: Callable[[], str | None],
    post: Callable[[str], str],
    wait: Callable[[list[int], float], object] = lambda fds, s: wait_sentinels(fds, timeout=s),
    recovery: Recovery | None = None,
) -> Outcome:
    """Watch this node's workers (rank -> process) until all have exited or the job failed.

    A worker exiting 128 + SIGTERM/SIGINT stopped for a signal; any other non-zero exit is a
    failure, posted (``post``, which returns the job's first failure) with its rank and step
    (``step_of``: the last step it began, -1 before the first). ``check`` returns the job's
    failure once there is one (another node's, a stalled heartbeat). Under --fault-tolerance
    bundle, ``recovery`` takes a failed worker's bundle out of the job instead, and starts
    workers again in its place (``Recovery``).
    """
    lose = recovery.lose if recovery else None
    restart = recovery.restart if recovery else None
    go_on = recovery.go_on if recovery else None
    stop_codes = {exit_code(s) for s in (signal.SIGTERM, signal.SIGINT)}
    live, stopped = dict(procs), 0
    while live:
        wait([p.sentinel for p in live.values()], _POLL_S)
        for rank, p in list(live.items()):
            if p.exitcode is None:
                continue
            del live[rank]
            if p.exitcode in stop_codes:
                stopped = max(stopped, p.exitcode - 128)
            elif p.exitcode == EXIT_HANDOFF and go_on is not None:
                live.update(go_on(rank))
            elif p.exitcode != 0:
                step = step_of(rank)
                at = f"step {step + 1}" if step >= 0 else "start-up"
                what = f"{describe(rank)} {_exit_text(p.exitcode)} during {at}"
                if lose is not None:  # --fault-tolerance bundle: its bundle leaves, unless all did
                    failed = lose(rank, "" if p.exitcode == EXIT_LEFT else what)
                    if failed is None:
                        live.update(restart(rank) if restart else {})
                        continue
                    return Outcome(End.FAILED, why=post(failed))
                return Outcome(End.FAILED, why=post(what))
        failure = check()
        if failure is not None:
            return Outcome(End.FAILED, why=failure)
    return Outcome(End.STOPPED, signum=stopped) if stopped else Outcome(End.DONE)


def _stopped(cfg: RunConfig, signum: int) -> int:
    """Say where the checkpoint is and how to resume; the exit code is 128 + signal."""
    path = None
    if cfg.checkpoint.save_dir:
        path, _ = ckpt.latest(cfg.checkpoint.save_dir)
    step = int(ckpt.read_info(path)["step"]) if path else None
    print(stop_line(signum, step, path, sys.argv[1:], "python"), file=sys.stderr, flush=True)
    return exit_code(signum)


def _stop(procs: Iterable[BaseProcess], *, grace: float) -> None:
    """Join every child; after ``grace`` seconds kill the ones still running, by pid.

    Not SIGTERM first: a worker takes SIGTERM as a request to finish its step and save.
    """
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
