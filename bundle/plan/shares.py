"""How much slower than its share an emulated device computes: CPU processes held to shares of a
CPU (a cluster file's ``cpu``), measured together, as a plan runs them.

A process held to 0.2 of a CPU does not do a fifth of the work of a free process: beside the
other processes of the machine it shares caches and memory bandwidth with them, and each quota
period starts it anew. The planner would otherwise divide a free process's timings by the share
and predict every such plan too fast (measured here: 1.12 to 1.21 beside three neighbours on two
cores, 1.07 to 1.10 alone).

``penalties`` starts one child process per device of the cluster, all at once, each a single
thread held to its device's share (``bundle.launch.throttle``, the quotas ``main.py`` applies),
and times the same small MLP forward and backward in each; a device's *penalty* is its time per
step times its share over the time a free process takes alone: 1.0 would be the share exactly.
The penalty of a device type is the median over its devices. Measured once per set of shares and
cached with the conditions it was measured under; where no cgroup can be written it is not
measured (1.0, and a note says so). It is the contention of every device busy at once: each plan
meets it in proportion to how busy it keeps the machine (``bundle.plan.mixed.contended``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from bundle.launch import throttle
from bundle.plan import profile as prof
from bundle.plan.cluster import Cluster
from bundle.plan.conditions import Watch

ROWS, WIDTH, INPUT = 128, 1024, 972  # mlp_wide on 3x18x18: tens of milliseconds a step
WINDOW_S = 1.0  # seconds each child computes, all at once, per round
ROUNDS = 4  # rounds of the window; a device's time per step is their median
MAX_DEVICES = 32  # more emulated devices than this are not measured (one process each)
WAIT_S = 120.0  # the most any child is waited for


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(INPUT, WIDTH), torch.nn.ReLU()]
    layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()] * 2
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10)), torch.randn(ROWS, INPUT)


def _steps(model: torch.nn.Module, x: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        model(x).sum().backward()
    return time.perf_counter() - start


def free_step() -> float:
    """Seconds of one step in this process, one thread, nothing held (the best of three)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x = _model()
        _steps(model, x, 3)
        return min(_steps(model, x, 5) for _ in range(3)) / 5
    finally:
        torch.set_num_threads(threads)


def _child(conn) -> None:  # pragma: no cover - runs in a child process
    torch.set_num_threads(1)
    model, x = _model()
    _steps(model, x, 2)
    conn.send("ready")
    for _ in range(ROUNDS):  # the parent has put this process under its quota between messages
        if not conn.poll(WAIT_S):
            return
        conn.recv()
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < WINDOW_S:
            _steps(model, x, 1)
            steps += 1
        conn.send((time.perf_counter() - start) / steps)


def measure(shares: Sequence[float], hierarchy: throttle.Hierarchy) -> list[float]:
    """Each device's penalty, all devices computing at once under their quotas."""
    before = free_step()
    per_step = _per_step(shares, hierarchy)
    free = min(before, free_step())  # the free baseline before and after, the faster
    return [max(1.0, t * s / free) for t, s in zip(per_step, shares, strict=True)]


def _per_step(shares: Sequence[float], hierarchy: throttle.Hierarchy) -> list[float]:
    """Each device's seconds per step under its quota (the median of the rounds)."""
    ctx = mp.get_context("spawn")
    children, quotas = [], []
    try:
        for _ in shares:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child,), daemon=True)
            proc.start()
            children.append((proc, parent))
        for proc, conn in children:  # started free: importing torch under 0.2 of a CPU is slow
            if not conn.poll(WAIT_S):
                raise TimeoutError(f"penalty child {proc.pid} not ready in {WAIT_S:g} s")
            conn.recv()
        for i, ((proc, _), share) in enumerate(zip(children, shares, strict=True)):
            name = f"bundle-penalty-{os.getpid()}-{i}"
            quotas.append(throttle.Quota(hierarchy, name, share).create())
            assert proc.pid is not None  # started above
            quotas[-1].add(proc.pid)
        per_step: list[list[float]] = [[] for _ in children]
        for _ in range(ROUNDS):
            for _, conn in children:  # all start at once, and compute for the same window
                conn.send("go")
            for i, (proc, conn) in enumerate(children):
                if not conn.poll(WAIT_S):
                    raise TimeoutError(f"penalty child {proc.pid} gave no time in {WAIT_S:g} s")
                per_step[i].append(conn.recv())
        return [statistics.median(t) for t in per_step]
    finally:
        for proc, _ in children:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for q in quotas:
            q.remove()


def _devices(cluster: Cluster) -> list[str]:
    return [kind for node in cluster.kinds for kind in node]


def with_penalties(cluster: Cluster, cache: prof.ProfileCache) -> Cluster:
    """``cluster`` with each CPU-share device type's penalty: cached, or measured now."""
    devices = _devices(cluster)
    share = {t.key: t.cpu for t in cluster.types if t.cpu}
    if not devices or not all(k in share for k in devices):
        return cluster
    found = throttle.find()
    if isinstance(found, str):
        cache.notes.append(f"CPU shares' slowdown not measured ({found}): penalty 1.0 assumed")
        return cluster
    if len(devices) > MAX_DEVICES:
        cache.notes.append(
            f"CPU shares' slowdown not measured: {len(devices)} emulated devices, more than "
            f"{MAX_DEVICES}; penalty 1.0 assumed"
        )
        return cluster
    shares = [share[k] for k in devices]
    key = {
        "device": prof.device_name(torch.device("cpu")),
        "torch": torch.__version__,
        "shares": shares,
        "periods_us": [throttle.period_us(s) for s in shares],
        "cpus": os.cpu_count(),
    }
    doc = cache.get("cpu_shares", key)
    if doc is None:
        # The children contend with each other by design: the load as they start is judged.
        with Watch(sched=lambda: None) as watch:
            measured = measure(shares, found)
        doc = {"penalties": measured}
        cache.put("cpu_shares", key, doc, prof.watched(watch, torch.device("cpu")))
    by_kind: dict[str, list[float]] = {}
    for kind, p in zip(devices, doc["penalties"], strict=True):
        by_kind.setdefault(kind, []).append(p)
    types = tuple(
        replace(t, penalty=round(statistics.median(by_kind[t.key]), 4)) if t.key in by_kind else t
        for t in cluster.types
    )
    return replace(cluster, types=types)
