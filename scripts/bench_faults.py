"""Benchmark a lost bundle: what a fault costs under ``--fault-tolerance bundle`` (the bundle
leaves, heals and rejoins) against ``--fault-tolerance restart`` (the whole job restarts from its
newest checkpoint), and against the same run uninterrupted.

    python scripts/bench_faults.py                    # SIGKILL a worker of bundle 1 (~2 min)
    python scripts/bench_faults.py --fault stop       # SIGSTOP it instead (a frozen process)
    python scripts/bench_faults.py --shape 2,1 --bundles 2 --json faults.json
    python scripts/bench_faults.py --backend nccl --runs bundle,restart
    sudo python scripts/bench_faults.py --fault node  # a lost node (network namespaces, root)
    python scripts/bench_faults.py --model digits_cnn --batch-size 768 \
        --runs uninterrupted_restart,uninterrupted    # what the commit vote costs on larger steps
    python scripts/bench_faults.py --runs uninterrupted,bundle --job-secret
                                      # with the store's control keys sealed (BUNDLE_JOB_SECRET)

Three bundles of shape ``1,1`` (six processes, gloo; ``--shape``, ``--bundles``; ``--backend nccl``
puts every rank on the machine's GPUs with ``--share-gpus``), ``mlp`` on
digits, batch 48, one ``main.py`` at a time. Once the run has logged step ``--fault-at``, replica 0
of bundle 1's last stage (rank 3) gets the signal; the times are read from the console lines as
they arrive:

- ``to_next_step_s``: from the signal to the first step logged after it (the survivors');
- ``to_rejoin_s`` (bundle): from the signal until the healed bundle trains again;
- ``steps_redone`` (restart): steps trained twice, from the checkpoint to the fault;
- samples/s over the logged windows before, while the bundle is missing, and after it rejoined;
- the final validation accuracy of each run, the uninterrupted ones' beside them;
- ``bundle_vs_restart_uninterrupted``: samples/s of the two modes when nothing fails (what the
  per-step commit vote costs).

``--fault node`` loses a whole node instead: two "hosts" (network namespaces joined by a veth
pair, tests/support/netns.py), one bundle of shape ``1,1`` on each (``--timeout 5``); once node 0
has logged step ``--fault-at``, node 1's link goes down (so no connection closes, as when a
machine dies) and its processes are killed. Runs ``bundle`` and ``restart`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bundle.launch.localworld import free_port  # noqa: E402
from bundle.runtime.preemption import FAULT_SIGNALS  # noqa: E402
from tests.support.netns import NetnsPair, node_env  # noqa: E402

BASE = ["--dataset", "digits", "--log-every", "10", "--timeout", "10"]
STEP = re.compile(r"step (\d+)/\d+ .* ([\d.]+) samples/s")


@dataclass
class Run:
    """One main.py run: its console lines with the time each arrived, its summary."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    fault_at: float | None = None
    code: int | None = None
    batch: int = 48  # rows per step, while every bundle trains

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if t > after and re.search(pattern, line)), None)

    def follow(self, stream, clock: float, on_line: Callable[[str], None]) -> threading.Thread:
        """A started thread that records ``stream``'s lines (and the summary) as they arrive."""

        def read() -> None:
            for line in stream:
                self.lines.append((time.monotonic() - clock, line.rstrip()))
                if line.startswith("{"):
                    self.summary = json.loads(line)
                on_line(line)

        thread = threading.Thread(target=read)
        thread.start()
        return thread

    @staticmethod
    def reached(line: str, step: int) -> bool:
        """Whether ``line`` logs step ``step`` or a later one."""
        return (m := STEP.search(line)) is not None and int(m.group(1)) >= step

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in self.lines if (m := STEP.search(line))]


def victim(shape: str) -> int:
    """Replica 0 of the last stage of bundle 1: the rank the fault hits."""
    widths = [int(w) for w in shape.split(",")]
    return sum(widths) + sum(widths[:-1])


RUNS = ("uninterrupted_restart", "uninterrupted", "bundle", "restart")


def run(
    mode: str,
    layout: list[str],
    steps: int,
    fault: str | None,
    fault_at: int,
    workdir: Path,
    env: dict[str, str] | None = None,
) -> Run:
    args = [*BASE, *layout, "--itr", str(steps), "--fault-tolerance", mode, "--max-restarts", "1"]
    if mode == "restart":
        args += ["--save-dir", str(workdir / f"ckpt-{fault}"), "--save-every", "100"]
    cmd = [sys.executable, str(ROOT / "main.py"), *args, "--portNum", str(free_port())]
    out = Run(batch=int(layout[layout.index("--batch-size") + 1]))
    clock = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    pids: list[int] = []
    target = victim(layout[layout.index("--bundle-shape") + 1])  # the rank the fault hits

    def on_line(line: str) -> None:
        m = re.search(r"started ranks 0\.\.\d+ \(pids ([\d, ]+)\)", line)
        if m and not pids:  # the first attempt's: the one the fault hits
            pids[:] = [int(p) for p in m.group(1).split(", ")]
        if fault and out.fault_at is None and out.reached(line, fault_at) and pids:
            os.kill(pids[target], FAULT_SIGNALS[fault])
            out.fault_at = time.monotonic() - clock

    readers = [out.follow(s, clock, on_line) for s in (proc.stdout, proc.stderr)]
    try:
        out.code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in readers:
            r.join(10)
        if fault == "stop" and pids:  # a stopped worker its supervisor did not kill: ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[target], signal.SIGKILL)
    return out


NODE_PORT = 29581  # inside the namespaces: nothing else listens there


def run_nodes(mode: str, steps: int, fault_at: int, workdir: Path, model: str, batch: int) -> Run:
    """``--fault node``: bundle b on node b of two namespaces; node 1 lost once node 0 logged
    step ``fault_at`` (its link down first, then its processes killed)."""
    args = [
        *BASE, "--model", model, "--batch-size", str(batch), "--bundle-shape", "1,1",
        "--num-bundle", "2", "--itr", str(steps),
        "--fault-tolerance", mode, "--max-restarts", "1", "--timeout", "5",
        "--init-timeout", "30", "--world-size", "2", "--nproc-per-node", "2",
    ]  # fmt: skip
    if mode == "restart":
        args += ["--save-dir", str(workdir / "ckpt-node"), "--save-every", "100"]
    out, procs = Run(batch=batch), []
    with NetnsPair() as hosts:
        clock = time.monotonic()
        for node, ns in enumerate((hosts.a, hosts.b)):
            where = ["--IP", hosts.addr_a, "--portNum", str(NODE_PORT), "--rank", str(node)]
            procs.append(
                hosts.run_in(
                    ns,
                    [sys.executable, str(ROOT / "main.py"), *args, *where],
                    env=node_env(hosts.ifname(ns)),
                    cwd=ROOT,
                    stdout=subprocess.PIPE if node == 0 else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

        def on_line(line: str) -> None:
            if out.fault_at is None and out.reached(line, fault_at):
                subprocess.run(["ip", "-n", hosts.b, "link", "set", hosts.if_b, "down"], check=True)
                os.killpg(procs[1].pid, signal.SIGKILL)
                out.fault_at = time.monotonic() - clock

        reader = out.follow(procs[0].stdout, clock, on_line)
        try:
            out.code = procs[0].wait(timeout=600)
        finally:
            reader.join(10)
    return out


def rate(points: list[tuple[float, int]], start: float, stop: float, batch: int) -> float | None:
    """Samples/s between the first and the last logged step inside ``[start, stop]``."""
    inside = [(t, s) for t, s in points if start <= t <= stop]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return round((s1 - s0) * batch / (t1 - t0), 1)


def report(name: str, r: Run) -> dict:
    fault = r.fault_at or 0.0
    points = r.steps()
    after = [(t, s) for t, s in points if t > fault]
    out: dict = {
        "exit_code": r.code,
        "val_accuracy": r.summary.get("val_accuracy"),
        "bundle_failures": r.summary.get("bundle_failures"),
        "heals": r.summary.get("heals"),
        "attempt": r.summary.get("attempt"),
    }
    if r.fault_at is None:
        out["samples_per_s"] = rate(points, 0.0, float("inf"), r.batch)
        return out
    out["to_next_step_s"] = round(after[0][0] - fault, 2) if after else None
    before = [s for t, s in points if t <= fault]
    out["samples_per_s_before"] = rate(points, 0.0, fault, r.batch)
    rejoin = r.first(r"rejoin after step", fault)
    if rejoin is not None:
        out["to_rejoin_s"] = round(rejoin - fault, 2)
        out["samples_per_s_missing"] = rate(points, fault, rejoin, r.batch)
        out["samples_per_s_after"] = rate(points, rejoin, float("inf"), r.batch)
    else:
        out["samples_per_s_after"] = rate(points, fault, float("inf"), r.batch)
    if name == "restart" and after and before:
        out["steps_redone"] = max(before) - after[0][1] + 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fault", choices=("kill", "stop", "node"), default="kill")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--fault-at", type=int, default=300, help="the step after which to signal")
    p.add_argument("--shape", default="1,1", help="--bundle-shape of the runs")
    p.add_argument("--bundles", type=int, default=3, help="--num-bundle of the runs")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("--backend", choices=("gloo", "nccl-emu", "nccl"), default="gloo")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which of {', '.join(RUNS)}")
    p.add_argument("--model", default="mlp", help="a model that trains on digits (digits_cnn)")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument(
        "--job-secret",
        action="store_true",
        help="set BUNDLE_JOB_SECRET (a random one) for every run: the control keys are sealed",
    )
    a = p.parse_args(argv)
    env = {**os.environ, "BUNDLE_JOB_SECRET": secrets.token_hex(32)} if a.job_secret else None
    layout = ["--model", a.model, "--bundle-shape", a.shape, "--num-bundle", str(a.bundles)]
    layout += ["--backend", a.backend, "--batch-size", str(a.batch_size)]
    layout += ["--share-gpus"] if a.backend == "nccl" else []
    wanted = a.runs.split(",")
    if unknown := set(wanted) - set(RUNS):
        p.error(f"--runs: {', '.join(sorted(unknown))} unknown (choose from {', '.join(RUNS)})")
    how = {
        "uninterrupted_restart": ("restart", None),
        "uninterrupted": ("bundle", None),
        "bundle": ("bundle", a.fault),
        "restart": ("restart", a.fault),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if a.fault == "node":
            runs = {
                m: run_nodes(m, a.steps, a.fault_at, Path(tmp), a.model, a.batch_size)
                for m in ("bundle", "restart")
            }
        else:
            runs = {
                name: run(mode, layout, a.steps, fault, a.fault_at, Path(tmp), env)
                for name, (mode, fault) in how.items()
                if name in wanted
            }
    result = {
        "command": "python scripts/bench_faults.py " + " ".join(argv or sys.argv[1:]),
        "fault": a.fault,
        "shape": a.shape if a.fault != "node" else "1,1",
        "bundles": a.bundles if a.fault != "node" else 2,
        "backend": a.backend,
        "job_secret": a.job_secret,
        "model": a.model,
        "batch_size": a.batch_size,
        "fault_rank": victim(a.shape) if a.fault != "node" else "node 1 (ranks 2, 3)",
        "steps": a.steps,
        "fault_at_step": a.fault_at,
        "cpus": os.cpu_count(),
        **{name: report(name, r) for name, r in runs.items()},
    }
    plain, voted = result.get("uninterrupted_restart", {}), result.get("uninterrupted", {})
    if plain.get("samples_per_s") and voted.get("samples_per_s"):
        # What the per-step commit vote and join check cost while nothing fails.
        result["bundle_vs_restart_uninterrupted"] = round(
            voted["samples_per_s"] / plain["samples_per_s"], 3
        )
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0 if all(r.code == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
