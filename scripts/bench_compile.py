"""Benchmark ``--compile`` through ``main.py``: a small GPT's samples/s compiled against eager,
runs interleaved, the time spent compiling, and the final losses checked against each other.

    python scripts/bench_compile.py                          # 3 pairs (~5 min on 2 cores)
    python scripts/bench_compile.py --quick                  # tiny model and steps: a smoke run
    python scripts/bench_compile.py --reps 5 --json compile.json

Every case is one ``main.py`` run on this machine (gloo on CPU, a free port each; bench_dp.py's
runner), one at a time: ``gpt`` (4 layers, width 128, 4 heads) on the bytes of ``--data-file``
(``--dataset text``), seq-len 64, batch 64, adamw, no evaluation, one bundle of ``--shape``
(default ``1,1``: two stages, a process each). The same job runs eager and with ``--compile``
(``--backend``, default inductor: each block compiled on its own), interleaved (eager compiled,
compiled eager, ...; ``--reps`` pairs). Each compiled run starts from an empty inductor cache of
its own (``TORCHINDUCTOR_CACHE_DIR``), so every ``compile_s`` is a cold compile; a rerun on a
warm cache compiles faster.

How to read it:

- ``samples_per_s``: each run's steady speed, over the steps after the first ``settle`` (read
  from its ``--metrics-out`` records), the same steps for both cases. The summary's own figure,
  kept as ``summary_samples_per_s``, leaves out the first step (the first S + 1 under
  ``--compile``: a later stage's second step waits for an earlier one's first backward, where
  that stage compiles its backward graphs).
- ``compiled_vs_eager``: median compiled / median eager samples/s. Above 1, a compiled step is
  faster.
- ``compile_s``: per compiled run, the job's longest time spent compiling (s). ``break_even_steps``
  is the median compile_s over the time a compiled step saves (eager minus compiled step time, from
  the medians): the run length from which compiling pays back (None when a step saves nothing).
- ``losses_agree``: the final losses of all runs lie within ``REL_TOL`` (relative) of each other.
  Compiled kernels fuse ops and sum fp32 in another order, so the runs are close, not bit-exact.
- ``conditions``: CPUs (``os.cpu_count()``), processes, threads per process (main.py shares the
  CPUs out among a node's processes on gloo), torch version, load average before and after.

It prints one table, then the report as one JSON line (non-finite numbers as null). A run that fails
is printed (command and stderr tail) to stderr and listed under ``failures``; the exit status is
then 1, as it is when the losses disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

from bench_dp import (
    Runner,
    _fmt,
    _table,
    add_run_flags,
    interleaved,
    losses_agree,
    median_ratio,
    publish,
)

BACKENDS = ("inductor", "aot_eager")
# One unit of the summary's 4th significant digit is up to 0.1 % of a loss; fused kernels reorder
# the fp32 sums of every op of every step (not only the gradient sums), and a hundred AdamW steps
# carry that forward. The runs tried here agreed to the 4 digits printed.
REL_TOL = 5e-3


@dataclass(frozen=True)
class Sizes:
    """The model and step counts of one mode."""

    model_args: str = "layers=4,width=128,heads=4"
    seq_len: int = 64
    batch: int = 64
    steps: int = 100
    reps: int = 3  # interleaved (eager, compiled) pairs
    settle: int = 5  # steps left out of the steady speed (and main.py's --log-every)


PRESETS = {
    "full": Sizes(),
    "quick": Sizes(
        model_args="layers=2,width=32,heads=2", seq_len=32, batch=8, steps=4, reps=1, settle=2
    ),
}


def job(sizes: Sizes, shape: str, data_file: Path) -> list[str]:
    """main.py's arguments shared by both cases."""
    args = ["--bundle-shape", shape, "--num-bundle", "1", "--model", "gpt"]
    args += ["--model-args", sizes.model_args, "--seq-len", str(sizes.seq_len)]
    args += ["--dataset", "text", "--data-file", str(data_file), "--optimizer", "adamw"]
    return [*args, "--lr", "0.001", "--batch-size", str(sizes.batch), "--itr", str(sizes.steps)]


def steady_rate(records: list[dict], settle: int) -> float | None:
    """Samples/s over the steps after ``settle``, from main.py's progress records. A record's
    ``samples_per_s`` at step k is r(k) = (k - 1) B / t(k), with t(k) the seconds since the end of
    step 1 and B the batch; so between records at steps a < b the rate (b - a) B / (t(b) - t(a))
    is (b - a) / ((b - 1) / r(b) - (a - 1) / r(a)), and B cancels out."""
    rates = {r["step"]: r["samples_per_s"] for r in records if "step" in r and "summary" not in r}
    after = [k for k in sorted(rates) if k >= max(settle, 2) and rates[k]]
    if len(after) < 2:
        return None
    a, b = after[0], after[-1]
    seconds = (b - 1) / rates[b] - (a - 1) / rates[a]
    return (b - a) / seconds if seconds > 0 else None


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measured(run: Runner, settle: int) -> Callable[[list[str]], dict | None]:
    """``run``, each run writing its progress to a file of its own, read back into the summary as
    ``steady_samples_per_s``; each compiled run given an empty inductor cache of its own."""

    def call(args: list[str]) -> dict | None:
        with tempfile.TemporaryDirectory(prefix="bench_compile_") as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            args = [*args, "--log-every", str(settle), "--metrics-out", str(metrics)]
            cache = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
            summary = run(args, cache if "--compile" in args else None)
            if summary is not None:
                rate = steady_rate(_records(metrics), settle)
                summary["steady_samples_per_s"] = None if rate is None else round(rate, 2)
            return summary

    return call


def break_even(
    compile_s: float | None, eager: float | None, compiled: float | None, batch: int
) -> float | None:
    """Steps after which ``compile_s`` is paid back by faster steps (samples/s of each case), or
    None when a compiled step is no faster."""
    if compile_s is None or not eager or not compiled:
        return None
    saved = batch / eager - batch / compiled
    return compile_s / saved if saved > 0 else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def compare(runs: dict[str, list[dict]], batch: int) -> dict:
    """The report of the ``eager`` and ``compiled`` runs' summaries: their samples/s, the ratio of
    the medians, compile times, break-even and whether the final losses agree."""
    sps = {case: [s["steady_samples_per_s"] for s in rs] for case, rs in runs.items()}
    sps = {case: [v for v in values if v] for case, values in sps.items()}
    med = {case: _median(v) for case, v in sps.items()}
    spent = [
        s["compile_s"] for s in runs["compiled"] if isinstance(s.get("compile_s"), int | float)
    ]
    losses = {case: [s.get("final_loss") for s in rs] for case, rs in runs.items()}
    return {
        "samples_per_s": sps,
        "median_samples_per_s": med,
        "summary_samples_per_s": {c: [s["samples_per_s"] for s in rs] for c, rs in runs.items()},
        "compiled_vs_eager": median_ratio(sps["compiled"], sps["eager"]),
        "compile_s": spent,
        "break_even_steps": break_even(_median(spent), med["eager"], med["compiled"], batch),
        "final_loss": losses,
        "rel_tol": REL_TOL,
        "losses_agree": losses_agree(losses["eager"], losses["compiled"], REL_TOL),
    }


def conditions(world_size: object) -> dict:
    """What the numbers were measured on; threads as main.py sets them on gloo."""
    cpus = os.cpu_count() or 1
    procs = world_size if isinstance(world_size, int) and world_size > 0 else None
    return {
        "cpus": cpus,
        "processes": procs,
        "threads_per_process": max(1, cpus // procs) if procs else None,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": version("torch"),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def render(report: dict) -> str:
    """The table of both cases and the lines that compare them."""
    r, c = report["result"], report["conditions"]
    rows = []
    for case in ("eager", "compiled"):
        runs = " ".join(_fmt(v, 1) for v in r["samples_per_s"][case]) or "-"
        spent = _median(r["compile_s"]) if case == "compiled" else None
        rows.append([case, runs, _fmt(r["median_samples_per_s"][case], 1), spent])
        rows[-1].append(" ".join(_fmt(v) for v in r["final_loss"][case]) or "-")
    s = report["sizes"]
    title = (
        f"--compile ({report['backend']}; gpt {s['model_args']}, seq-len {s['seq_len']}, "
        f"batch {s['batch']}, shape {report['shape']}, samples/s over steps {s['settle'] + 1}"
        f"..{s['steps']}, runs interleaved)"
    )
    header = ["case", "samples/s (runs)", "median", "compile_s", "final_loss"]
    return "\n".join(
        [
            _table(title, header, rows),
            f"compiled / eager {_fmt(r['compiled_vs_eager'], 3)}; "
            f"break-even after {_fmt(r['break_even_steps'], 0)} steps; "
            f"final losses within {r['rel_tol']:g}: {_fmt(r['losses_agree'])}",
            f"{c['cpus']} CPUs, {c['processes']} processes x {c['threads_per_process']} threads, "
            f"torch {c['torch']}, load {c['load_before']} -> {c['load_after']}",
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 4 steps, one pair")
    p.add_argument("--reps", type=int, metavar="N", help="interleaved pairs (default 3)")
    p.add_argument("--shape", default="1,1", help="--bundle-shape of the job (default: 1,1)")
    p.add_argument("--backend", choices=BACKENDS, default="inductor", help="--compile-backend")
    add_run_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the pairs, print the table and the report as one JSON line."""
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    sizes = PRESETS[mode] if not args.reps else replace(PRESETS[mode], reps=args.reps)
    run = Runner(args.timeout)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    cases = {"eager": [], "compiled": ["--compile", "--compile-backend", args.backend]}
    base = [*job(sizes, args.shape, args.data_file), "--no-eval"]
    runs = interleaved(measured(run, sizes.settle), base, cases, sizes.reps)
    first = next((rs[0] for rs in runs.values() if rs), {})
    report: dict = {
        "mode": mode,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "shape": args.shape,
        "backend": args.backend,
        "sizes": sizes.__dict__,
        "conditions": {
            **conditions(first.get("world_size")),
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "result": compare(runs, sizes.batch),
        "failures": run.failures,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    report = publish(report, render, args.json)
    return 1 if run.failures or report["result"]["losses_agree"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
