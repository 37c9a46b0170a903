"""Benchmark mixed devices emulated on this machine's CPU: speed-weighted rows against even rows,
and the planner's predicted samples/s against measured runs, every run one ``main.py --plan``.

    python scripts/bench_hetero.py                          # both parts (~40 min on 2 cores)
    python scripts/bench_hetero.py --quick                  # smoke run (~1 min: 5 launches)
    python scripts/bench_hetero.py --only weighted --reps 5 --json hetero.json

A slower device is a process held to a fraction of one CPU by a cgroup quota (a plan's placement
``cpu`` share; bundle/launch/throttle.py), running one thread. Every run is one ``main.py``
process tree (gloo on CPU, a free port each), one at a time, ``--no-eval``; samples/s is read from
the JSON summary ``main.py`` prints last (the steps after the first).

- ``weighted``: data parallelism only (shape ``2``, one bundle), ``mlp_wide`` on synthetic 3x18x18
  inputs at a batch where compute dominates, rank 0 at 1.0 CPU and rank 1 at 0.5: rows 2:1 (``--row-weights`` in the
  plan) against even rows, run interleaved (even, weighted, even, weighted ...; ``--reps`` pairs),
  compared as the ratio of their medians, ``weighted_vs_even`` (ideal 1.5: even rows wait on the
  slow replica's half of the batch at half speed).
- ``planner``: ``scripts/plan.py --cluster clusters/cpu_mixed_emulated.yaml`` (two processes at
  0.5 CPU, two at 0.2: speeds 1 and 0.4) ranks plans; ``--plans`` of them (the best first, then the most different
  configurations) and the file's ``uniform_plan`` (the best plan chosen as if all devices were
  alike, on the real devices) each run with ``main.py --plan FILE:i``. Reported:
  ``planner_median_abs_error`` and ``planner_max_abs_error`` of |predicted - measured| / measured,
  and ``planner_vs_uniform``, the measured samples/s of the best plan over the uniform plan's (the
  two run interleaved ``--reps`` times, medians). Each plan runs at least 3 times and again, up
  to 6, until the middle half of its runs lies within 5 % of their median (``STEADY``); its
  median is the measurement and its spread is reported beside it. Without the cluster file, or
  when plan.py fails, the part is skipped and the report says why (``planner_skipped``).

A machine busier than its CPUs (1-minute load average above them) is refused before anything
runs, one line, exit 2: its noise would be reported as the planner's error (``--allow-busy``
measures anyway; ``--quick`` is a smoke run and does not ask); the report records the load.
A profile ``plan.py`` measured while its repetitions disagreed (its note: "not cached") is
measured again, ``plan.py`` run up to PLAN_TRIES times; unsteady every time, the planner part
is skipped with the reason, for the same cause.

The CPUs promised must exist: shares adding up to more CPUs than the machine has would give a
balanced plan (every process busy at once) less than its share, while a plan that leaves the fast
processes waiting lets the slow ones reach their quota, which flatters the unbalanced plan. The
cluster file's shares add up to 1.4 CPUs (room on two cores for the supervisor and the data);
on a machine with fewer than ``--cpus`` the planner part scales every share down to fit
(``cpu_scale``; the speed ratios stay those of the file) and compares measurements with the
prediction times that scale (``predicted_here``). Every process runs one thread, and quota
processes are weighted above other work on the machine (bundle/launch/throttle.py), so a busy
neighbour slows them less.

What the emulation can show: the effect of unequal speeds on a synchronous step (the step waits
on the slowest replica), whether row weights and a plan balance them, and how far the planner's
figures are from runs (the planner costs a CPU share's communication and engine overheads slowed
by the share, as they are here, and the slowdown a share shows beside its neighbours, measured
in bundle/plan/shares.py and eased by how busy each plan keeps the machine). What it cannot: a quota slows a process in 2 to 5 ms slices (run, then
wait) rather than evenly; communication and Python overheads are slowed as much as compute,
unlike on a slower accelerator; memory sizes and bandwidths of real devices are not emulated. The
``weighted`` part asks for 1.5 CPUs of two. Quotas need a writable cgroup cpu controller (cgroup
v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``, usually root): without one the script exits 2 with the
reason, one line.

While the planner part runs, each plan's figures go to stderr as its runs end, and ``--json``
is rewritten after each plan with the part so far (``partial``), so a run stopped early still
says what it measured. At the end it prints one table per part, then the report as one JSON
line; a run that fails is printed (command and stderr tail) to stderr and listed under
``failures``, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench_dp import Runner, _finite, _fmt, _ratio, _table

from bundle.launch import throttle
from bundle.plan.conditions import spread
from bundle.plan.profile import NOT_CACHED

REPO = Path(__file__).resolve().parent.parent
PARTS = ("weighted", "planner")
CLUSTER = REPO / "clusters" / "cpu_mixed_emulated.yaml"
# Compute dominates a step of mlp_wide on 3x18x18 inputs (as in scripts/bench.py): the engine's
# overheads and the data pipeline, which no quota emulates faithfully, stay small beside it.
MODEL = "mlp_wide"
DATA = ["--image-size", "18", "--num-classes", "10"]
SHARES = (1.0, 0.5)  # the weighted part's two replicas
WEIGHTS = "2:1"


@dataclass(frozen=True)
class Sizes:
    """Batch, steps and repetitions of one mode."""

    batch: int = 512  # planner
    # weighted: a batch where compute, which the weights balance, dominates the all-reduce,
    # which they do not (it runs at the slower replica's share either way)
    weighted_batch: int = 1024
    steps: int = 60
    reps: int = 3  # weighted: interleaved pairs; planner: best/uniform pairs
    plans: int = 8  # planner: plans run (the best among them)
    plan_steps: int = 60
    # planner: each plan runs at least the first, at most the second number of times, until
    # the spread of its runs is at most STEADY
    plan_runs: tuple[int, int] = (3, 6)


PRESETS = {
    "full": Sizes(),
    "quick": Sizes(
        batch=128, weighted_batch=128, steps=6, reps=1, plans=1, plan_steps=4, plan_runs=(1, 1)
    ),
}
STEADY = 0.05  # (third quartile - first) / median of a plan's runs before its median is taken


def busy() -> str | None:
    """Why this machine is too busy for its timings to be the plans' own (its 1-minute load
    average above its CPUs), or None."""
    load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    return f"load average {load:.1f} on {cpus} CPU(s)" if load > cpus else None


def steady(run: Runner, args: list[str], runs: tuple[int, int]) -> list[float]:
    """samples/s of ``args`` run again until their spread is at most STEADY (at least
    ``runs[0]`` runs, at most ``runs[1]``)."""
    got: list[float] = []
    for i in range(runs[1]):
        sps = _sps(run(args))
        if sps is not None:
            got.append(sps)
        if i + 1 >= runs[0] and (len(got) < 3 or (spread(got) or 0.0) <= STEADY):
            break
    return got


def _common(batch: int, steps: int) -> list[str]:
    data = ["--dataset", "synthetic", *DATA, "--synthetic-size", str(4 * batch)]
    return [
        *("--model", MODEL, "--batch-size", str(batch), "--itr", str(steps), "--no-eval"),
        *data,
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _sps(summary: dict | None) -> float | None:
    value = None if summary is None else summary.get("samples_per_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


# -- weighted rows against even rows ----------------------------------------------------------


def dp_plan(weights: str) -> dict:
    """One bundle of shape 2 whose replicas are held to SHARES of a CPU, with these row weights."""
    run = {"bundle_shape": "2", "num_bundle": 1, "micro_batches": 1, "row_weights": weights}
    placement = [{"node": 0, "device": None, "type": f"cpu{s:g}", "cpu": s} for s in SHARES]
    return {"run": run, "placement": placement}


def bench_weighted(run: Runner, sizes: Sizes, work: Path) -> dict:
    """samples/s of rows 2:1 against even rows on replicas at 1.0 and 0.5 CPU, interleaved."""
    files = {}
    for case, weights in (("even", ""), ("weighted", WEIGHTS)):
        files[case] = work / f"dp_{case}.json"
        files[case].write_text(json.dumps(dp_plan(weights)))
    sps: dict[str, list[float]] = {"even": [], "weighted": []}
    for _ in range(sizes.reps):
        for case in ("even", "weighted"):
            got = _sps(
                run(["--plan", str(files[case]), *_common(sizes.weighted_batch, sizes.steps)])
            )
            if got is not None:
                sps[case].append(got)
    med = {case: _median(v) for case, v in sps.items()}
    return {
        "shape": "2",
        "cpu_shares": list(SHARES),
        "row_weights": WEIGHTS,
        "batch": sizes.weighted_batch,
        "steps": sizes.steps,
        "samples_per_s": sps,
        "median_samples_per_s": med,
        "weighted_vs_even": _ratio(med["weighted"], med["even"]),
        "ideal": 1.5,
    }


# -- the planner's predictions against measured runs ------------------------------------------


def _config(plan: dict) -> tuple:
    run = plan.get("run", {})
    return tuple(sorted((k, str(v)) for k, v in run.items()))


def pick_plans(plans: list[dict], count: int) -> list[int]:
    """Indices of ``count`` plans: the best first, then one per shape and bundle count not yet
    taken, then one per configuration not yet run (micro-batches, schedule, sync, weights), in
    rank order; mirror images of a taken configuration (the same run options) are skipped."""
    chosen: list[int] = []
    seen_runs: set[tuple] = set()

    def take(i: int) -> None:
        chosen.append(i)
        seen_runs.add(_config(plans[i]))

    if plans and count > 0:
        take(0)
    for key in (
        lambda p: (tuple(p.get("shape", ())), p.get("num_bundles")),
        lambda p: _config(p),
    ):
        taken = {key(plans[i]) for i in chosen}
        for i, p in enumerate(plans):
            if len(chosen) >= count:
                return chosen
            if i not in chosen and key(p) not in taken and _config(p) not in seen_runs:
                take(i)
                taken.add(key(p))
    return chosen


def abs_errors(rows: list[dict]) -> list[float]:
    """|predicted - measured| / measured of every row with both numbers (the prediction at the
    shares the runs were given)."""
    out = []
    for r in rows:
        pred, meas = r.get("predicted_here"), r.get("measured_samples_per_s")
        if isinstance(pred, (int, float)) and isinstance(meas, (int, float)) and meas > 0:
            out.append(abs(pred - meas) / meas)
    return out


def _describe(plan: dict) -> str:
    run = plan.get("run", {})
    shape = run.get("bundle_shape", "?")
    text = f"{shape} x{run.get('num_bundle', 1)} M={run.get('micro_batches', 1)}"
    text += f" {run.get('schedule', '')} {run.get('grad_sync', '')}".rstrip()
    return text + (f" w={run['row_weights']}" if run.get("row_weights") else "")


# plan.py notes a profile measured while its repetitions disagreed (NOT_CACHED): plans made from
# it are off by what the machine did then, which would be reported as the planner's error.
PLAN_TRIES = 3  # plan.py runs until its profiles are steady, at most


def make_plans(sizes: Sizes, work: Path, timeout: float) -> tuple[dict | None, str | None]:
    """plan.py's JSON for the emulated cluster, or None and why not. A profile measured while the
    machine was unsteady is measured again (plan.py again; the steady ones are cached), up to
    PLAN_TRIES runs; then the part is refused."""
    if not CLUSTER.is_file():
        return None, f"{CLUSTER.relative_to(REPO)} does not exist"
    out = work / "plans.json"
    cmd = [sys.executable, str(REPO / "scripts" / "plan.py"), "--cluster", str(CLUSTER)]
    cmd += ["--model", MODEL, *DATA, "--batch-size", str(sizes.batch)]
    # Profiles of its own, measured in this run: a cache from another time says nothing of now.
    cmd += ["--top", "40", "--json", str(out), "--profile-cache", str(work / "profiles")]
    for attempt in range(1, PLAN_TRIES + 1):
        doc, why = _plan_once(cmd, out, timeout)
        if doc is None:
            return None, why
        unsteady = [n for n in doc.get("profiles", []) if NOT_CACHED in n]
        if not unsteady:
            return doc, None
        print(f"plan {attempt} of {PLAN_TRIES}: {unsteady[0]}", file=sys.stderr, flush=True)
    return None, f"profiles unsteady in {PLAN_TRIES} tries (the machine is noisy): {unsteady[0]}"


def _plan_once(cmd: list[str], out: Path, timeout: float) -> tuple[dict | None, str | None]:
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"scripts/plan.py took longer than {timeout:.0f} s"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"scripts/plan.py exited {p.returncode}: {tail[0]}"
    doc = json.loads(out.read_text())
    plans = doc.get("plans") or []
    missing = [
        k for k in ("run", "placement", "predicted_samples_per_s") if plans and k not in plans[0]
    ]
    if not plans or missing:
        return None, f"scripts/plan.py wrote no plans with {', '.join(missing) or 'run options'}"
    if not isinstance(doc.get("uniform_plan"), dict):
        return None, "scripts/plan.py wrote no uniform_plan (is the cluster mixed?)"
    return doc, None


def fit_shares(doc: dict, cpus: float) -> tuple[dict, float]:
    """The plans with every CPU share scaled so that the largest placement asks for at most
    ``cpus`` CPUs, and the scale (1.0: they fit as planned)."""
    placements = [p.get("placement") or [] for p in [*doc["plans"], doc["uniform_plan"]]]
    asked = max(sum(r.get("cpu") or 0.0 for r in rows) for rows in placements)
    scale = min(1.0, cpus / asked) if asked else 1.0
    out = copy.deepcopy(doc)
    rows = {
        id(r): r for p in [*out["plans"], out["uniform_plan"]] for r in p.get("placement") or []
    }
    for r in rows.values():  # each once, though plans may share rows
        if r.get("cpu") is not None:
            r["cpu"] = round(r["cpu"] * scale, 4)
    return out, scale


def _row(
    index: int | str, plan: dict, scale: float, measured: float | None, runs_spread: float | None
) -> dict:
    predicted = plan.get("predicted_samples_per_s")
    here = predicted * scale if isinstance(predicted, (int, float)) else None
    return {
        "index": index,
        "config": _describe(plan),
        "predicted_samples_per_s": predicted,
        "predicted_here": here,  # at the shares scaled to fit this machine's CPUs
        "measured_samples_per_s": measured,  # the median of its runs
        "spread": runs_spread,  # of its runs (None: fewer than 3)
    }


def bench_planner(
    run: Runner,
    sizes: Sizes,
    work: Path,
    timeout: float,
    cpus: float,
    on_plan: Callable[[dict], None] | None = None,
) -> dict:
    """Predicted against measured samples/s of the planner's plans; the best against uniform.

    Each plan's figures are printed to stderr as its runs end, and ``on_plan`` is given the part
    so far (``partial``: true), so a run stopped early still says what it measured."""
    planned, why = make_plans(sizes, work, timeout)
    if planned is None:
        print(f"planner part skipped: {why}", file=sys.stderr, flush=True)
        return {"skipped": why}
    doc, scale = fit_shares(planned, cpus)
    plans_file, uniform_file = work / "plans_here.json", work / "uniform.json"
    plans_file.write_text(json.dumps(doc))
    uniform_file.write_text(json.dumps(doc["uniform_plan"]))
    common = _common(sizes.batch, sizes.plan_steps)
    rows = []
    best_sps: list[float] = []
    uniform_sps: list[float] = []
    for i in pick_plans(doc["plans"], sizes.plans):
        got = steady(run, ["--plan", f"{plans_file}:{i}", *common], sizes.plan_runs)
        if i == 0:
            best_sps.extend(got)
        rows.append(_row(i, doc["plans"][i], scale, _median(got), spread(got)))
        _say(rows[-1], got)
        if on_plan is not None:
            on_plan({"partial": True, "cpu_scale": scale, "plans": rows})
    # Interleaved with the best: its run above pairs with the first uniform run.
    for rep in range(sizes.reps):
        spec = [f"{plans_file}:0", str(uniform_file)] if rep else [str(uniform_file)]
        for f in spec:
            got = _sps(run(["--plan", f, *common]))
            if got is not None:
                (uniform_sps if f == str(uniform_file) else best_sps).append(got)
    rows.append(
        _row("uniform", doc["uniform_plan"], scale, _median(uniform_sps), spread(uniform_sps))
    )
    _say(rows[-1], uniform_sps)
    errors = abs_errors(rows)
    return {
        "cluster": str(CLUSTER.relative_to(REPO)),
        "batch": sizes.batch,
        "steps": sizes.plan_steps,
        "cpus": cpus,
        "cpu_scale": scale,
        "plans": rows,
        "best_samples_per_s": best_sps,
        "uniform_samples_per_s": uniform_sps,
        "planner_median_abs_error": _median(errors),
        "planner_max_abs_error": max(errors) if errors else None,
        "planner_vs_uniform": _ratio(_median(best_sps), _median(uniform_sps)),
        # (third quartile - first) / median of the repeated runs: the noise beside the errors
        "best_spread": spread(best_sps),
        "uniform_spread": spread(uniform_sps),
        "profiles": planned.get("profiles", []),
        "predicted_vs_uniform": doc.get("speedup_over_uniform"),
    }


def _say(row: dict, runs: list[float]) -> None:
    """One plan's figures on stderr, as soon as its runs end."""
    pred, meas = row["predicted_here"], row["measured_samples_per_s"]
    error = f", error {(pred - meas) / meas:+.1%}" if abs_errors([row]) else ""
    print(
        f"plan {row['index']} ({row['config']}): predicted {_fmt(pred, 1)}, measured "
        f"{_fmt(meas, 1)} samples/s over {len(runs)} run(s){error}",
        file=sys.stderr,
        flush=True,
    )


# -- output -----------------------------------------------------------------------------------


def render(report: dict) -> str:
    """One table per part that ran."""
    out = []
    if "weighted" in report:
        w = report["weighted"]
        med = w["median_samples_per_s"]
        rows = [[c, _fmt(med[c], 1), len(w["samples_per_s"][c])] for c in ("even", "weighted")]
        rows.append(["weighted / even", w["weighted_vs_even"], f"ideal {w['ideal']}"])
        title = (
            f"rows by speed (shape 2, CPU shares {w['cpu_shares']}, {MODEL} batch {w['batch']}, "
            f"{w['steps']} steps, medians)"
        )
        out.append(_table(title, ["rows", "samples/s", "runs"], rows))
    if "planner" in report:
        p = report["planner"]
        if "skipped" in p:
            out.append(f"planner: skipped ({p['skipped']})")
        else:
            rows = [
                [r["index"], r["config"], r["predicted_samples_per_s"]]
                + [_fmt(r["predicted_here"], 1), r["measured_samples_per_s"]]
                + [_fmt(r.get("spread"))]
                for r in p["plans"]
            ]
            header = ["plan", "configuration", "predicted", "x scale", "measured", "spread"]
            title = f"planner on {p['cluster']} (samples/s; CPU shares x {p['cpu_scale']:.3f})"
            out.append(_table(title, header, rows))
            out.append(
                f"abs error median {_fmt(p['planner_median_abs_error'])}, "
                f"max {_fmt(p['planner_max_abs_error'])}; best / uniform measured "
                f"{_fmt(p['planner_vs_uniform'])} (predicted {_fmt(p['predicted_vs_uniform'])}); "
                f"spread of repeated runs: best {_fmt(p.get('best_spread'))}, "
                f"uniform {_fmt(p.get('uniform_spread'))}"
            )
            out.extend(f"profile: {n}" for n in p.get("profiles", []))
    return "\n\n".join(out)


def headline(report: dict) -> dict:
    """The report's top-level ratios (None where a part did not run or was skipped)."""
    w, p = report.get("weighted", {}), report.get("planner", {})
    return {
        "weighted_vs_even": w.get("weighted_vs_even"),
        "planner_median_abs_error": p.get("planner_median_abs_error"),
        "planner_max_abs_error": p.get("planner_max_abs_error"),
        "planner_vs_uniform": p.get("planner_vs_uniform"),
        "planner_skipped": p.get("skipped") if p else "not asked for (--only)",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny batch and steps, one pair, one plan")
    p.add_argument("--only", choices=PARTS, help="run only this part")
    p.add_argument("--reps", type=int, metavar="N", help="interleaved pairs (default 3)")
    p.add_argument("--plans", type=int, metavar="N", help="planner: plans run (default 8)")
    p.add_argument(
        "--cpus",
        type=float,
        default=float(os.cpu_count() or 1),
        help="planner: CPUs the plans' shares are scaled to fit in (default: this machine's)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per main.py run")
    p.add_argument(
        "--allow-busy",
        action="store_true",
        help="measure on a machine busier than its CPUs (refused otherwise, but for --quick)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    return p.parse_args(argv)


def _saver(path: str | None, report: dict) -> Callable[[dict], None] | None:
    """Writes the report with the planner part so far to ``path`` (--json) after each plan."""
    if not path:
        return None
    return lambda part: Path(path).write_text(
        json.dumps(_finite({**report, "planner": part}), indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for, print their tables and the report as one JSON line."""
    args = parse_args(argv)
    why = throttle.available()
    if why is not None:
        print(f"bench_hetero.py: cannot emulate slower devices here: {why}", file=sys.stderr)
        return 2
    crowded = busy()
    if crowded is not None and not (args.quick or args.allow_busy):
        print(
            f"bench_hetero.py: this machine is busy ({crowded}): its noise would be reported as "
            "the planner's error; run it on a quiet machine (--allow-busy measures anyway)",
            file=sys.stderr,
        )
        return 2
    mode = "quick" if args.quick else "full"
    sizes = PRESETS[mode]
    if args.reps:
        sizes = replace(sizes, reps=args.reps)
    if args.plans:
        sizes = replace(sizes, plans=args.plans)
    run = Runner(args.timeout)
    start = time.perf_counter()
    report: dict = {"mode": mode, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    report["busy_at_start"] = crowded  # None: the load average was within the CPUs
    with tempfile.TemporaryDirectory(prefix="bench_hetero.") as tmp:
        for part in [args.only] if args.only else PARTS:
            if part == "weighted":
                report[part] = bench_weighted(run, sizes, Path(tmp))
            else:
                report[part] = bench_planner(
                    run, sizes, Path(tmp), args.timeout, args.cpus, _saver(args.json, report)
                )
    report = {**headline(report), **report}
    report["failures"] = run.failures
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report = _finite(report)
    print(render(report))
    print(f"wall time {report['wall_s']:.1f} s; failed runs: {len(run.failures)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, allow_nan=False), flush=True)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
