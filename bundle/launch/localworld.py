"""Run a function on N loopback processes, gloo/CPU or NCCL/CUDA: the test and benchmark harness.

Every child is joined or, past the timeout, killed by its own handle; a child's exception comes
back to the caller with its traceback. Results come back through a pipe of each child's own,
never through a file.

Children are forked from a forkserver that has imported torch and the engine once (``PRELOAD``):
a spawned child spends a second or two of CPU importing them, every world again. Each child
takes the caller's environment and working directory as they are when the world starts, as a
spawned one would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# Imported once by the forkserver (never run: no torch op, no thread pool, no CUDA), so that its
# children start with them; torch._dynamo as the supervisor's forkserver has it (process.PRELOAD).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "bundle.session",
    "bundle.trainer",
]


# From the OS, not the process's seeded generator: processes seeded alike would draw alike.
_DRAW = random.SystemRandom()


def free_port() -> int:
    """An unused TCP port on loopback, for a store bound moments later by another process.

    Drawn below the kernel's ephemeral range (``ip_local_port_range``), whose ports every
    outgoing connection (gloo's, a store client's) takes as its source: a port the kernel
    offered from that range can be taken by such a connection before the store binds it.
    """
    low, _ = _ephemeral_range()
    first = max(1024, low - 12000)
    for _ in range(64):
        port = _DRAW.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that band is full: one the kernel offers
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (Linux); elsewhere the IANA range."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _bind_gpu(rank: int, world: int, device: str | None) -> torch.device:
    """An NCCL child's device, made current before its process group exists.

    ``device`` puts every child on that one GPU; without it, children go round-robin over the
    visible ones. Children that share a GPU need NCCL's multi-rank mode (bundle.runtime.devices).
    """
    import torch

    from bundle.runtime.devices import allow_shared_gpu

    count = torch.cuda.device_count()
    if device is None:
        dev = torch.device("cuda", rank % count)
        shared = world > count
    else:
        dev = torch.device(device)
        shared = world > 1
    if shared:
        allow_shared_gpu()
    torch.cuda.set_device(dev)
    return dev


@dataclass(frozen=True, kw_only=True)
class _World:
    """What every child of a world is started with: ``fn`` and its ``args``, the world's size,
    the store's port on loopback, the backend, the device (``_bind_gpu``) and ``place``: the
    caller's environment, working directory and default start method
    (bundle.launch.process.where_we_are)."""

    fn: Callable
    size: int
    port: int
    args: tuple
    backend: str
    device: str | None
    place: tuple[dict[str, str], str, str]


def _entry(w: _World, rank: int, out: Connection) -> None:
    """One child: one thread, a process group, ``fn``, its result sent to the parent (``out``:
    the sending end of its pipe)."""
    environ, cwd, method = w.place
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    mp.set_start_method(method, force=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, backend = w.size, w.backend
    try:
        store = dist.TCPStore(
            "127.0.0.1", w.port, world, is_master=rank == 0, timeout=timedelta(seconds=120)
        )
        # Naming the device forms NCCL's world communicator with every rank now, as a job's
        # workers do (bundle.launch.process.worker_main): point-to-point between two ranks may come first.
        dist.init_process_group(
            "gloo" if backend == "nccl-emu" else backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            device_id=_bind_gpu(rank, world, w.device) if backend == "nccl" else None,
        )
        result: tuple = ("ok", w.fn(rank, world, *w.args))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    try:  # plain pickle (Connection.send would share tensors through this child, which ends)
        sent = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - a result that does not pickle: say so instead
        sent = pickle.dumps(("error", f"its result does not pickle:\n{traceback.format_exc()}"))
    out.send_bytes(sent)
    out.close()


def run_world(
    world: int,
    fn: Callable,
    *args,
    timeout: float = 600.0,
    start_method: str = "forkserver",
    backend: str = "gloo",
    device: str | None = None,
) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; their results in rank order, or an error.

    ``start_method``: "forkserver" (children of one that imported ``PRELOAD``), "spawn", or
    "fork", only from a parent that has run no torch op and holds no process group.

    ``backend="nccl"`` binds each child to a CUDA device before its group is created: ``device``
    (e.g. ``"cuda:0"``, every child on one GPU) or round-robin over the visible GPUs; ``fn``
    finds it as the current device (several children on one GPU: bundle.runtime.devices).
    A child that fails ends the world at once: the others are killed rather than left waiting on
    it until their group's timeout, and the first failure is raised.
    ``backend="nccl-emu"`` runs gloo underneath; a session whose config says ``nccl-emu`` adds
    NCCL's ordering (bundle.collectives.nccl_emu).
    """
    if backend not in ("gloo", "nccl", "nccl-emu"):
        raise ValueError(f"backend: {backend!r} is not valid; choose gloo, nccl or nccl-emu")
    # Typed as the base context, whose stubs lack Process; every concrete context has it.
    ctx: Any = mp.get_context(
        start_method if start_method in mp.get_all_start_methods() else "spawn"
    )
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first world's
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # (receiving, sending) per child
    place = (dict(os.environ), os.getcwd(), mp.get_start_method())
    w = _World(fn=fn, size=world, port=port, args=args, backend=backend, device=device, place=place)
    procs = [ctx.Process(target=_entry, args=(w, r, pipes[r][1])) for r in range(world)]
    for p in procs:
        p.start()
    for _, sending in pipes:
        sending.close()  # the child holds its own: a child gone without a word ends its pipe
    found: dict[int, tuple | None] = {}
    receiving = [conn for conn, _ in pipes]
    try:
        _join_or_first_failure(procs, receiving, found, time.monotonic() + timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        _collect(receiving, found)
        for conn in receiving:
            conn.close()
    return _results(procs, found)


def _collect(receiving: list, found: dict[int, tuple | None]) -> None:
    """Take every result that has arrived (a child blocks in its send until it is read); a pipe
    that ended without one is None."""
    for r, conn in enumerate(receiving):
        if r in found:
            continue
        try:
            if conn.poll():  # this parent's own child, through the pipe it made
                found[r] = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            found[r] = None


def _failed(r: int, proc: Any, found: dict[int, tuple | None]) -> bool:
    """Whether child ``r`` ended without success: an error result, or it ended without an ``ok``."""
    if r in found:
        return found[r] is None or found[r][0] != "ok"  # type: ignore[index]
    return not proc.is_alive() and proc.exitcode != 0


def _join_or_first_failure(
    procs: list, receiving: list, found: dict[int, tuple | None], deadline: float
) -> None:
    """Wait until every child ended, one failed, or the deadline passed."""
    pause = 0.01
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        _collect(receiving, found)
        if any(_failed(r, p, found) for r, p in enumerate(procs)):
            return
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def _results(procs: list, found: dict[int, tuple | None]) -> list:
    """The children's results in rank order. A rank that reported an error is raised before one
    without a result (killed for the first, or dead without a word)."""
    got = {r: v for r, v in found.items() if v is not None}
    for r, (status, value) in sorted(got.items()):
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
    for r, p in enumerate(procs):
        if r not in got:
            raise RuntimeError(f"rank {r} produced no result (exit code {p.exitcode})")
    return [got[r][1] for r in range(len(procs))]
