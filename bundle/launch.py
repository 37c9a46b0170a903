"""One training process of a job and the store it shares with the others: start-up, the
rendezvous, failure reporting; started by the node supervisor (bundle/supervisor.py) or torchrun.

Failure path: a worker that raises writes ``abort`` (rank, stage, step, error) to the store; a
worker that dies is reported by its supervisor; a node that stops heart-beating is reported by
node 0. Every worker polls ``abort`` and exits non-zero; supervisors kill what is left by pid.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from bundle import log
from bundle.config import RunConfig
from bundle.errors import ConfigError, LaunchError, PeerFailure
from bundle.preemption import Stopped, StopRequest, exit_code, stop_line
from bundle.topology import Topology
from bundle.watchdog import StepWatchdog, group_timeout, watch_limit

ABORT_KEY = "bundle/abort"
MULTI_RANK_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
_POLL_S = 0.5


def resolve_backend(cfg: RunConfig) -> str:
    if cfg.launch.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return cfg.launch.backend


def torch_backend(backend: str) -> str:
    """The torch.distributed backend under ours: nccl-emu is gloo with NCCL's ordering on top."""
    return "gloo" if backend == "nccl-emu" else backend


def check_devices(cfg: RunConfig, topo: Topology) -> None:
    """More processes per node than devices is an input error, found before anything starts,
    unless ``--share-gpus`` asks for several processes on one device (for testing)."""
    if resolve_backend(cfg) != "nccl":
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0 or (topo.procs_per_node > found and not cfg.launch.share_gpus):
        allowed = f"the nccl backend drives one CUDA device per process and this node has {found}"
        if found:
            allowed += "; --share-gpus runs several processes per GPU (to test with fewer GPUs)"
        raise ConfigError("--nproc-per-node", topo.procs_per_node, allowed)


def _interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (Linux ioctl, no packets sent)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if got == address:
                return name
    return None


def pin_gloo_interface(master: str, port: int) -> None:
    """Unless set, point GLOO_SOCKET_IFNAME at the interface that routes to the master.

    Gloo otherwise binds to whatever the hostname resolves to, often 127.0.1.1 or a container
    bridge, and peers on other hosts cannot connect back.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), port))  # UDP connect: a route lookup only
            local = s.getsockname()[0]
    except OSError:
        return
    name = _interface_of(local)
    if name and not local.startswith("127."):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def prepare_backend_env(backend: str, host: str, port: int, procs_per_node: int) -> None:
    """Per-process settings made before any process group exists.

    The CPU threads are shared out only on gloo (the process computes on the CPU). The gloo
    interface is pinned whatever the backend: an NCCL job creates gloo groups too (the control
    and async groups), and those fail to connect across nodes the same way.
    """
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs_per_node))
    pin_gloo_interface(host, port)


def allow_shared_gpu() -> None:
    """Let NCCL place several ranks of one communicator on one GPU (NCCL 2.30 and later).

    NCCL otherwise refuses two ranks on one device at communicator creation. With
    NCCL_MULTI_RANK_GPU_ENABLE=1 they share it, point-to-point through CUDA IPC; it is not
    compatible with NCCL_NVLS_ENABLE=1. Before 2.30 the way was a distinct NCCL_HOSTID per process,
    which makes NCCL take every peer for another host and use its socket transport. NCCL reads its
    environment when it first initialises, so this must run in the worker before the process
    group is created; a value the user set is kept.
    """
    os.environ.setdefault(MULTI_RANK_GPU_ENV, "1")


def device_for(backend: str, local_rank: int, *, share_gpus: bool = False) -> torch.device:
    """This process's device, made current: ``cuda:local_rank`` with nccl; with ``share_gpus``,
    ``cuda:(local_rank % devices)`` (round-robin, NCCL's multi-rank mode allowed); else the CPU.
    """
    if backend != "nccl":
        return torch.device("cpu")
    index = local_rank
    if share_gpus:
        allow_shared_gpu()
        index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# -- the store --------------------------------------------------------------------------------


def open_store(host: str, port: int, *, server: bool, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            host, port, is_master=server, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        if server:
            raise LaunchError(
                f"--portNum {port}: cannot listen on port {port} ({exc}); is it in use?"
            ) from exc
        raise LaunchError(
            f"cannot reach the master at {host}:{port} within {timeout:.0f}s ({exc})"
        ) from exc


def read_abort(store: dist.Store) -> str | None:
    return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None


def post_abort(store: dist.Store, message: str) -> str:
    """Record the job's first failure; returns whichever message won."""
    return store.compare_set(ABORT_KEY, "", message).decode() or message


def _differences(mine: dict, theirs: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} vs {b!r}")
    return out


def exchange_config(store: dist.Store, cfg: RunConfig, me: int, peers: int, timeout: float) -> None:
    """Every node publishes its config; any difference is reported by field, not left to hang.

    Node 0 hosts the store, so it waits until every node has read the others before it goes on
    (or exits with the error), and every node reports the same mismatch.
    """
    mine = cfg.shared_view()
    store.set(f"bundle/config/{me}", json.dumps(mine))
    try:
        store.wait([f"bundle/config/{i}" for i in range(peers)], timedelta(seconds=timeout))
        problems = []
        for i in range(peers):
            diff = _differences(mine, json.loads(store.get(f"bundle/config/{i}")))
            if diff:
                problems.append(f"node {me} vs node {i}: {'; '.join(diff)}")
        store.set(f"bundle/config-read/{me}", "1")
        if me == 0:
            store.wait(
                [f"bundle/config-read/{i}" for i in range(peers)], timedelta(seconds=timeout)
            )
    except RuntimeError as exc:
        raise LaunchError(
            f"not every node joined the job at the master within {timeout:.0f}s ({exc})"
        ) from exc
    if problems:
        raise LaunchError(f"the nodes were started with different settings: {problems[0]}")


def store_barrier(store: dist.Store, name: str, world: int, timeout: float) -> None:
    """Wait until ``world`` processes reached ``name``, up to ``timeout`` seconds (start-up only)."""
    key = f"bundle/arrived/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while (arrived := store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise PeerFailure(
                f"only {arrived} of {world} processes reached '{name}' within {timeout:.0f}s"
            )
        time.sleep(0.05)


def start_abort_watch(store: dist.Store, rank: int, me: str) -> None:
    """A daemon thread that ends this process once any other process has recorded a failure."""

    def watch() -> None:
        misses = 0
        while True:
            time.sleep(_POLL_S)
            try:
                msg = read_abort(store)
                misses = 0
            except Exception:  # noqa: BLE001 - the store's host is gone: the job is over
                misses += 1
                if misses < 10:
                    continue
                msg = "lost contact with the job's store (node 0 is gone)"
            if msg is not None and not msg.startswith(me):
                log.get().error(f"stopping rank {rank}: {msg}")
                os._exit(1)

    threading.Thread(target=watch, name="bundle-abort-watch", daemon=True).start()


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
    from bundle import worker

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


def attempt_prefix(attempt: int) -> str:
    return f"bundle/attempt{attempt}"


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
