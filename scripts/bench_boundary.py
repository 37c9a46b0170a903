"""Where a pipelined step's time goes at a stage boundary: 1F1B on shape 1,1 at M = 1, 4, 8.

    python scripts/bench_boundary.py                       # mlp_wide, batch 512, 30 steps a run
    python scripts/bench_boundary.py --micro 1,4,8 --reps 3 --json boundary.json

Every case is one ``main.py`` run on this machine (gloo on CPU, one process per stage with the
threads main.py gives it: one each on two cores; synthetic data, no evaluation), one run at a
time, the cases interleaved over ``--reps`` rounds (1 4 8, 8 4 1, ...). The numbers are each
run's own summary breakdown (the ``--metrics-out`` file's last record: the step timer's laps, over
the steps after the first; ``bundle.observe.timing``), the same the run prints at its end; of a
case's rounds the table shows the run with the median samples/s, whole, so its columns still add
up to its step.

Per case and stage, ms per step: ``compute`` (forward + backward), ``copy`` (outputs into wire
form), ``post`` (posting the calls), ``wait`` (receives waiting: ``wait_act + wait_grad``), ``send``
(the step's sends completing after its last action), ``engine`` (the engine's own work on sends
and receives), ``rest`` (data, gradient sync, optimizer, the loop's own work); then per message
(every send and every receive of the stage's schedule) the µs of ``post`` and ``engine``, and per
receive the µs of ``wait``. ``bound`` is 1F1B's bound from the run's own compute over its step,
``(M + S - 1) * max_s(compute_s + copy_s) / M / step``: what ``scripts/bench.py``'s
``pipeline_efficiency`` measures with lone-stage timings instead.

It prints the table, then the report as one JSON line (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_dp import Runner, publish

from bundle.ir.p2p import COMM, RECVS
from bundle.ir.schedule import actions

SCHEDULE = "1f1b"
SHAPE = (1, 1)
MICRO = (1, 4, 8)
# bench.py's MLP case: mlp_wide on 3x18x18 inputs, batch 512, SGD with momentum.
JOB = [
    *("--model", "mlp_wide", "--dataset", "synthetic", "--image-size", "18"),
    *("--num-classes", "10", "--synthetic-size", "1024", "--batch-size", "512"),
    *("--lr", "0.01", "--momentum", "0.9", "--seed", "0", "--no-eval"),
]
COLUMNS = ("compute", "copy", "post", "wait", "send", "engine", "rest")
# Each column's categories of the summary breakdown (bundle.observe.timing.CATEGORIES).
PARTS = {
    "compute": ("forward", "backward"),
    "copy": ("copy",),
    "post": ("post",),
    "wait": ("wait_act", "wait_grad"),
    "send": ("send",),
    "engine": ("engine",),
    "rest": ("data", "sync", "optimizer", "other"),
}


def messages(stage: int, micro: int, schedule: str = SCHEDULE, stages: int = len(SHAPE)) -> dict:
    """The sends and receives of one stage's step (its schedule's communication actions)."""
    ops = [a.op for a in actions(schedule, stage, stages, micro) if a.op in COMM]
    return {"messages": len(ops), "receives": sum(op in RECVS for op in ops)}


def stage_rows(breakdown: dict, micro: int, schedule: str = SCHEDULE) -> list[dict]:
    """Per stage of a summary breakdown: ms per step in each column, and per message."""
    stages = len(breakdown["stages"])
    rows = []
    for st in breakdown["stages"]:
        ms = {c: sum(st["seconds"][k]["mean"] for k in PARTS[c]) * 1e3 for c in COLUMNS}
        n = messages(st["stage"], micro, schedule, stages)
        rows.append(
            {
                "stage": st["stage"],
                "step_ms": st["step_s"]["mean"] * 1e3,
                **{f"{c}_ms": v for c, v in ms.items()},
                **n,
                "post_us_per_message": _us_each(ms["post"], n["messages"]),
                "engine_us_per_message": _us_each(ms["engine"], n["messages"]),
                "wait_us_per_receive": _us_each(ms["wait"], n["receives"]),
            }
        )
    return rows


def _us_each(ms: float, count: int) -> float:
    return ms * 1e3 / count if count else 0.0


def bound(rows: list[dict], micro: int) -> float | None:
    """1F1B's bound over the step: ``(M + S - 1)`` micro-batches of the slower stage's compute
    (and copy) per micro-batch, over the slowest stage's step; None without a step."""
    step = max(r["step_ms"] for r in rows)
    if step <= 0:
        return None
    slower = max(r["compute_ms"] + r["copy_ms"] for r in rows) / micro
    return (micro + len(rows) - 1) * slower / step


def median_run(runs: list[dict]) -> dict | None:
    """The run with the median samples/s (the lower of the middle two); None without runs."""
    ok = sorted((r for r in runs if r.get("samples_per_s")), key=lambda r: r["samples_per_s"])
    return ok[(len(ok) - 1) // 2] if ok else None


def case_report(runs: list[dict], micro: int) -> dict:
    """One case: its median run's breakdown as rows, the bound, and the rounds' samples/s."""
    chosen = median_run(runs)
    out: dict = {"micro_batches": micro, "samples_per_s": [r.get("samples_per_s") for r in runs]}
    if chosen is None or not chosen.get("breakdown"):
        return {**out, "stages": [], "bound": None}
    rows = stage_rows(chosen["breakdown"], micro)
    return {
        **out,
        "median_samples_per_s": chosen["samples_per_s"],
        "stages": rows,
        "bound": bound(rows, micro),
    }


def render(report: dict) -> str:
    """The cases as one table: ms per step by column, µs per message, the bound."""
    heads = ["M", "stage", "step", *COLUMNS, "msgs", "post/msg", "engine/msg", "wait/recv", "bound"]
    lines = ["  ".join(f"{h:>10}" for h in heads) + "   (ms per step; per message in µs)"]
    for case in report["cases"]:
        for r in case["stages"]:
            cells = [str(case["micro_batches"]), str(r["stage"]), f"{r['step_ms']:.2f}"]
            cells += [f"{r[f'{c}_ms']:.2f}" for c in COLUMNS]
            cells += [str(r["messages"]), f"{r['post_us_per_message']:.0f}"]
            cells += [f"{r['engine_us_per_message']:.0f}", f"{r['wait_us_per_receive']:.0f}"]
            cells.append(
                f"{case['bound']:.3f}" if case["bound"] is not None and r["stage"] == 0 else ""
            )
            lines.append("  ".join(f"{c:>10}" for c in cells))
        if not case["stages"]:
            lines.append(f"{case['micro_batches']:>10}  (no run finished)")
    return "\n".join(lines)


def last_record(path: Path) -> dict | None:
    """The metrics file's summary record (its last line), or None."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        record = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("summary") else None


def run_case(run: Runner, micro: int, steps: int, where: Path) -> dict | None:
    """One main.py run of the case: its stdout summary with the metrics file's breakdown."""
    metrics = where / f"m{micro}-{time.monotonic_ns()}.jsonl"
    args = [*JOB, "--bundle-shape", ",".join(map(str, SHAPE)), "--schedule", SCHEDULE]
    args += ["--micro-batches", str(micro), "--steps", str(steps), "--log-every", str(steps)]
    summary = run([*args, "--metrics-out", str(metrics)])
    record = last_record(metrics)
    if summary is None or record is None:
        return None
    return {**summary, "breakdown": record.get("breakdown")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro", default=",".join(map(str, MICRO)), help="micro-batch counts")
    p.add_argument("--steps", type=int, default=30, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="interleaved rounds of every case")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per main.py run")
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    micro = [int(m) for m in args.micro.split(",")]
    run, start = Runner(args.timeout), time.perf_counter()
    runs: dict[int, list[dict]] = {m: [] for m in micro}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for m in micro if rep % 2 == 0 else micro[::-1]:
                got = run_case(run, m, args.steps, Path(tmp))
                if got is not None:
                    runs[m].append(got)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "schedule": SCHEDULE,
        "shape": list(SHAPE),
        "cases": [case_report(runs[m], m) for m in micro],
        "wall_s": round(time.perf_counter() - start, 1),
        "failures": run.failures,
    }
    publish(report, render, args.json)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
