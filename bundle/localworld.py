"""Run a function on N gloo/CPU processes on loopback: the harness of tests and benchmarks.

Every child is joined or, past the timeout, killed by its own handle; a child's exception comes
back to the caller with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out_dir: str, args: tuple) -> None:
    """One child: one thread, a gloo group, ``fn``, its result pickled to disk."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        result: tuple = ("ok", fn(rank, world, *args))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_world(
    world: int, fn: Callable, *args, timeout: float = 600.0, start_method: str = "spawn"
) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; their results in rank order, or an error.

    ``start_method="fork"`` saves re-importing torch in every child (seconds each on a loaded
    machine); only use it from a parent that has run no torch op and holds no process group.
    """
    ctx = mp.get_context(start_method if start_method in mp.get_all_start_methods() else "spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, out, args)) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(deadline - time.monotonic(), 0.1))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(out, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} produced no result (exit code {p.exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
