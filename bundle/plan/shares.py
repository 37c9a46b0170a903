"""How much slower than its share an emulated device computes: CPU processes held to shares of a
CPU (a cluster file's ``cpu``), measured together, as a plan runs them.

A process held to 0.2 of a CPU does not do a fifth of the work of a free process: beside the
other processes of the machine it shares caches and memory bandwidth with them, and each quota
period starts it anew. The planner would otherwise divide a free process's timings by the share
and predict every such plan too fast (measured here with the quotas' 2 and 5 ms periods: 1.36 to
1.53 for half a CPU and 1.13 to 1.22 for a fifth, beside three neighbours on two cores).

``penalties`` starts one child process per device of the cluster, all at once, each a single
thread held to its device's share (``bundle.launch.throttle``, the quotas ``main.py`` applies),
and times the same small MLP forward and backward in each; a device's *penalty* is its time per
step times its share over the time a free process takes alone: 1.0 would be the share exactly.
This machine's own speed drifts by 10 to 15 % from minute to minute (a free step took 25 to 30 ms
within ten minutes here), so the free step is timed again before every round, while the children
wait, and each round is judged against its own: a device's penalty is the median of its rounds'.
(Judged against one free time taken before and after, five measurements in a row gave a device
type's penalty 1.20 to 1.55 for a half share and 1.02 to 1.24 for a fifth; judged round by
round, three gave 1.36 to 1.53 and 1.13 to 1.22.)
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
ROUNDS = 6  # rounds of the window; a device's penalty is the median of theirs
FREE_STEPS = 3  # steps of the free timing before each round (the best of two runs of them)
FREE_RUNS = 2
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


class _Free:
    """Times one step of the same model in this process, one thread, nothing held."""

    def __init__(self) -> None:
        self.model, self.x = _model()

    def __call__(self) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _steps(self.model, self.x, 1)
            return (
                min(_steps(self.model, self.x, FREE_STEPS) for _ in range(FREE_RUNS)) / FREE_STEPS
            )
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
    """Each device's penalty, all devices computing at once under their quotas: the median over
    the rounds of its time per step times its share over a free step timed just before."""
    free, held = _rounds(shares, hierarchy)
    return [
        max(1.0, statistics.median(t * s / f for f, t in zip(free, times, strict=True)))
        for times, s in zip(held, shares, strict=True)
    ]


def _rounds(
    shares: Sequence[float], hierarchy: throttle.Hierarchy
) -> tuple[list[float], list[list[float]]]:
    """The free step's seconds before each round, and each device's seconds per step in each
    round under its quota."""
    ctx = mp.get_context("spawn")
    free = _Free()
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
        free_s: list[float] = []
        held: list[list[float]] = [[] for _ in children]
        for _ in range(ROUNDS):
            free_s.append(free())  # the children wait for the word
            for _, conn in children:  # all start at once, and compute for the same window
                conn.send("go")
            for i, (proc, conn) in enumerate(children):
                if not conn.poll(WAIT_S):
                    raise TimeoutError(f"penalty child {proc.pid} gave no time in {WAIT_S:g} s")
                held[i].append(conn.recv())
        return free_s, held
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
