"""One training process, self-spawned by the node supervisor or started by torchrun: its logger,
stop signals, store, watchdogs and process group around the session, and how it reports failing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist

from bundle import log
from bundle.config import RunConfig
from bundle.errors import ConfigError
from bundle.runtime.devices import device_for, prepare_backend_env, resolve_backend, torch_backend
from bundle.runtime.preemption import Stopped, StopRequest, exit_code, stop_line
from bundle.runtime.store import (
    attempt_prefix,
    exchange_config,
    open_store,
    post_abort,
    read_abort,
    start_abort_watch,
    store_barrier,
)
from bundle.runtime.watchdog import StepWatchdog, group_timeout, watch_limit
from bundle.topology import Topology


def start_step_watchdog(
    store: dist.Store, me: str, where: dict, backend: str, timeout: float, *, exit=os._exit
) -> StepWatchdog:
    """End this process, reporting where, when training stops moving (bundle/watchdog.py)."""

    def report(message: str) -> None:
        log.get().error(post_abort(store, message))

    return StepWatchdog(
        me=me,
        position=lambda: where["runner"].where if "runner" in where else None,
        limit=watch_limit(backend, timeout),
        report=report,
        exit=exit,
    ).start()


# -- one worker process --------------------------------------------------------------------------


def worker_main(
    cfg: RunConfig,
    topo: Topology,
    rank: int,
    local_rank: int,
    host: str,
    port: int,
    progress=None,
    *,
    attempt: int = 0,
    resume: str | None = None,
    stop_shared=None,
) -> int:
    """Body of every training process; returns its exit code (128 + signal when stopped by one)."""
    from bundle import session as worker

    c = topo.coord(rank)
    log.setup(
        f"[rank {rank} b{c.bundle} s{c.stage}]",
        verbose=rank == topo.rank(0, topo.num_stages - 1, 0),
    )
    # A supervised worker leaves saying so to its supervisor; under torchrun each one says it.
    stop = StopRequest(shared=stop_shared, announce=stop_shared is None)
    stop.install(on_second=lambda signum: os._exit(exit_code(signum)))
    backend = torch_backend(resolve_backend(cfg))
    prepare_backend_env(backend, host, port, topo.procs_per_node)
    # Every attempt of a restarted job keeps its keys apart: the store outlives the attempts.
    store = dist.PrefixStore(
        attempt_prefix(attempt),
        open_store(host, port, server=False, timeout=cfg.launch.init_timeout),
    )
    if cfg.launch.torchrun:
        # No node supervisor compared settings: every process compares its own.
        exchange_config(store, cfg, rank, topo.world_size, cfg.launch.init_timeout)
    me = topo.describe(rank)
    start_abort_watch(store, rank, me)
    where: dict = {}
    watchdog = start_step_watchdog(store, me, where, backend, cfg.launch.timeout)
    try:
        store_barrier(store, "start", topo.world_size, cfg.launch.init_timeout)
        # --share-gpus sets NCCL's multi-rank switch here, in the worker itself (self-spawned or
        # under torchrun alike), before NCCL first reads its environment.
        device = device_for(backend, local_rank, share_gpus=cfg.launch.share_gpus)
        # With NCCL, naming the device forms the world communicator now, with every rank: the
        # first batch_isend_irecv on the default group may then involve only two ranks (NCCL
        # requires all of a group's ranks in its first call otherwise), and sub-groups are split
        # from it instead of being bootstrapped one by one.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("bundle/pg", store),
            rank=rank,
            world_size=topo.world_size,
            timeout=group_timeout(backend, cfg.launch.timeout),
            device_id=device if backend == "nccl" else None,
        )
        summary = worker.run(
            cfg,
            topo,
            rank,
            device,
            progress=progress,
            where=where,
            arrive=lambda name: store_barrier(
                store, name, topo.world_size, cfg.launch.init_timeout
            ),
            attempt=attempt,
            resume=resume,
            stop=stop,
            store=store,
        )
        dist.barrier()
        if summary is not None:
            print(json.dumps(summary, sort_keys=True), flush=True)
        return 0
    except Stopped as stopped:
        watchdog.stop()
        if cfg.launch.torchrun and local_rank == 0:
            launcher = "torchrun [the same torchrun options]"
            print(
                stop_line(stopped.signum, stopped.step, stopped.checkpoint, sys.argv[1:], launcher),
                file=sys.stderr,
                flush=True,
            )
        return stopped.code
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other processes
        watchdog.stop()  # this error is the report
        deadline = time.monotonic() + 2.0
        cause = None
        while cause is None and time.monotonic() < deadline:
            cause = read_abort(store)
            time.sleep(0.1) if cause is None else None
        if cause is None:
            at = where["runner"].where if "runner" in where else "start-up"
            cause = post_abort(store, f"{me} failed at {at}: {type(exc).__name__}: {exc}")
        if cause.startswith(me):
            log.get().error(cause)
            if not isinstance(exc, Exception):
                raise
        else:
            log.get().error(f"stopping rank {rank}: {cause}")
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawned(*args, **kwargs) -> None:
    """Entry of a worker process started by the node supervisor."""
    os._exit(worker_main(*args, **kwargs))


# -- torchrun --------------------------------------------------------------------------------


def torchrun_env() -> dict[str, str] | None:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {k: os.environ[k] for k in keys}


def run_torchrun(
    cfg: RunConfig, topo: Topology, env: dict[str, str], resume: str | None
) -> NoReturn:
    """One worker of a torchrun job; torchrun's own restarts (``--max-restarts``) resume with
    ``--resume auto``, and ``TORCHELASTIC_RESTART_COUNT`` numbers the attempt."""
    if int(env["WORLD_SIZE"]) != topo.world_size:
        raise ConfigError(
            "WORLD_SIZE",
            env["WORLD_SIZE"],
            f"shape {','.join(map(str, topo.shape))} x {topo.num_bundles} bundle(s) needs {topo.world_size} processes",
        )
    code = worker_main(
        cfg,
        topo,
        int(env["RANK"]),
        int(env["LOCAL_RANK"]),
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        resume=resume,
    )
    # Leave as a self-spawned worker does, without interpreter teardown: it may destroy the store
    # client while the abort-watch thread is inside a call on it (std::terminate, SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
