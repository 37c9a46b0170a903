"""Benchmark ``--tensor-parallel`` through ``main.py``: the bytes each process holds under TP
against one process (measured, and counted by hand from the model's plan), and what TP's sums
over gloo cost a step against one process, data parallelism and a pipeline with TP per stage.

    python scripts/bench_tp.py                    # 3 rounds of 5 cases (~4-5 min on 2 cores)
    python scripts/bench_tp.py --quick            # fewer steps and a smaller batch (~3 min)
    python scripts/bench_tp.py --degree 4 --reps 5 --json tp.json

Every case is one ``main.py`` run on this machine (gloo on CPU, a free port each; bench_dp.py's
runner, which kills a run past ``--timeout`` and gives main.py 120 s for any wait on a peer),
one at a time, all with the same job: ``gpt`` (``--model-args``, default 4 layers, width 256,
8 heads) on the bytes of ``--data-file`` (default: a few of Python's own modules, written to a
temporary directory), seq-len 64, the same global batch, AdamW, no evaluation. The cases, with
T = ``--degree`` (default 2), run interleaved (``--reps`` rounds, every other one reversed):

- ``one``: one process (``--bundle-shape 1 --tensor-parallel 1``);
- ``tp``: one replica split over T processes (``--bundle-shape 1 --tensor-parallel T``);
- ``dp``: T replicas, data parallel, on as many processes (``--bundle-shape T``);
- ``pipe``: two stages, the first split over T processes (``--bundle-shape 1,1
  --tensor-parallel T,1``: T + 1 processes, more than the cores on a 2-core machine);
- ``rear``: the same two stages, the second split (``--tensor-parallel 1,T``).

How to read it:

- bytes: each run's ``most_*`` parameter, gradient and AdamW state bytes (the job's largest
  process). ``tp / one`` is measured; ``expected`` counts the model's parameters by hand: the
  layers the GPT's plan splits (``models.tp.plan_of``/``resolve``: q|k|v and the first MLP layer
  colwise, weight and bias; the attention and second MLP projections rowwise, their weight only,
  the bias being added whole) hold 1/T each, everything else (embeddings, norms, head, rowwise
  biases) is replicated, so a process holds ``replicated + split / T`` of them.
- samples/s: each run's steady speed over the steps after the first ``settle`` (from its
  ``--metrics-out`` records), the median over its rounds; ``tp / one`` and ``tp / dp`` are ratios
  of those medians. A TP step sums activations over gloo twice per layer forward and twice
  backward on the cores that compute; data parallelism sums the gradients once per step.

``--predict``: before the runs, the planner predicts each case's samples/s on this machine as
``scripts/plan.py`` would plan it (``tp_predict``: the model profiled here with the threads each
process has, as the planner profiles; cached under ``--profile-cache``); the table then shows
each prediction and its error against the measured median.

It prints the conditions, one table, the ratios, then the report as one JSON line (``--json``
also writes it to a file). A run that fails is printed (command and stderr tail) to stderr and
listed under ``failures``; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import cast

import torch.nn as nn
from bench_compile import measured
from bench_dp import Runner, _fmt, _ratio, _table, interleaved, publish
from tp_predict import predict

from bundle import models
from bundle.config import parse_model_args
from bundle.models import tp
from bundle.plan import profile as prof

HELD = ("param_bytes", "grad_bytes", "optimizer_bytes")
SPLIT_STYLES = ("colwise", "rowwise", "packed_colwise")  # models.tp's styles that cut a layer
# Fastest over slowest run of one case past which its median is flagged; a quiet machine's
# interleaved runs stay well within it.
NOISY_SPREAD = 1.5
VOCAB = 256  # --dataset text: byte-level tokens
# Python's own modules, plain text everywhere Python runs: the default --data-file.
TEXT_MODULES = ("argparse", "textwrap", "statistics", "difflib", "fractions")


@dataclass(frozen=True)
class Sizes:
    """The model, batch and step counts of one mode."""

    model_args: str = "layers=4,width=256,heads=8"
    seq_len: int = 64
    batch: int = 32
    steps: int = 10
    reps: int = 3  # interleaved rounds of every case
    settle: int = 2  # steps left out of the steady speed (and main.py's --log-every)


PRESETS = {"full": Sizes(), "quick": Sizes(batch=16, steps=6)}


def cases(degree: int) -> dict[str, list[str]]:
    """Each case's main.py arguments at tensor-parallel degree ``degree``."""
    t = str(degree)
    return {
        "one": ["--bundle-shape", "1", "--tensor-parallel", "1"],
        "tp": ["--bundle-shape", "1", "--tensor-parallel", t],
        "dp": ["--bundle-shape", t],
        "pipe": ["--bundle-shape", "1,1", "--tensor-parallel", f"{t},1"],
        "rear": ["--bundle-shape", "1,1", "--tensor-parallel", f"1,{t}"],
    }


def processes(degree: int) -> dict[str, int]:
    """The processes each case of ``cases(degree)`` starts."""
    return {"one": 1, "tp": degree, "dp": degree, "pipe": degree + 1, "rear": degree + 1}


def job(sizes: Sizes, data_file: Path) -> list[str]:
    """main.py's arguments shared by every case."""
    args = ["--num-bundle", "1", "--model", "gpt", "--model-args", sizes.model_args]
    args += ["--dataset", "text", "--data-file", str(data_file), "--seq-len", str(sizes.seq_len)]
    args += ["--optimizer", "adamw", "--lr", "0.001", "--no-eval"]
    return [*args, "--batch-size", str(sizes.batch), "--itr", str(sizes.steps)]


def write_text(folder: Path) -> Path:
    """A text file of a few of Python's own modules' source, in ``folder``: data any machine
    with Python has, long enough for every step's batch."""
    parts = [Path(importlib.import_module(m).__file__ or "").read_text() for m in TEXT_MODULES]
    path = folder / "stdlib.txt"
    path.write_text("\n".join(parts))
    return path


# -- expected bytes ----------------------------------------------------------------------------


def split_count(model: nn.Module, degree: int) -> dict:
    """Parameters of ``model`` its tensor-parallel plan splits and leaves whole, and what one
    process of ``degree`` holds of them, counted from the plan (a degree the plan cannot take is
    models.tp's TPError)."""
    plan = tp.plan_of(model)
    tp.check(model, plan, degree)
    split = 0
    for m, style in tp.resolve(model, plan).values():
        if style not in SPLIT_STYLES:
            continue
        linear = cast(nn.Linear, m)  # resolve refuses a split style on anything else
        split += linear.weight.numel()
        if linear.bias is not None and style != "rowwise":  # a rowwise bias is added once, whole
            split += linear.bias.numel()
    total = sum(p.numel() for p in model.parameters())
    per_process = total - split + split / degree
    return {
        "degree": degree,
        "all_params": total,
        "split_params": split,
        "replicated_params": total - split,
        "per_process_params": per_process,
        "ratio": per_process / total,
    }


def expected(sizes: Sizes, degree: int) -> dict:
    """``split_count`` of the GPT that main.py builds for ``sizes`` (random weights)."""
    args = parse_model_args(sizes.model_args)
    model = models.build("gpt", num_classes=VOCAB, input_shape=(sizes.seq_len,), args=args)
    return split_count(model, degree)


# -- the report --------------------------------------------------------------------------------


def _median(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return statistics.median(numbers) if numbers else None


def summarize(runs: dict[str, list[dict]], procs: dict[str, int]) -> dict[str, dict]:
    """Per case: its processes, the steady samples/s of each run and their median, and the
    ``most_*`` bytes of its first run with their sum."""
    rows = {}
    for case, summaries in runs.items():
        first = summaries[0] if summaries else {}
        held = {k: first.get(f"most_{k}") for k in HELD}
        ints = [v for v in held.values() if isinstance(v, int)]
        total = sum(ints) if len(ints) == len(held) else None
        rates = [s.get("steady_samples_per_s") for s in summaries]
        rows[case] = {
            "processes": procs[case],
            "world_size": first.get("world_size"),
            "samples_per_s": rates,
            "median_samples_per_s": _median(rates),
            **{f"most_{k}": v for k, v in held.items()},
            "most_total_bytes": total,
            "final_loss": [s.get("final_loss") for s in summaries],
        }
    return rows


def compare(rows: dict[str, dict], count: dict) -> dict:
    """Bytes per process and speed of ``tp`` against ``one`` (and ``dp``), as ratios; the
    expected bytes ratio from ``count`` (``split_count``) beside the measured one."""
    one, tp, dp = rows.get("one", {}), rows.get("tp", {}), rows.get("dp", {})
    keys = [*(f"most_{k}" for k in HELD), "most_total_bytes"]
    speed = "median_samples_per_s"
    return {
        "bytes_tp_vs_one": {k: _ratio(tp.get(k), one.get(k)) for k in keys},
        "expected_bytes_ratio": count["ratio"],
        "speed_tp_vs_one": _ratio(tp.get(speed), one.get(speed)),
        "speed_tp_vs_dp": _ratio(tp.get(speed), dp.get(speed)),
    }


def conditions(load: tuple[float, float, float]) -> dict:
    """What the numbers were measured on: CPU, cores, torch and the load average ``load``."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count() or 1,
        "torch": version("torch"),
        "python": platform.python_version(),
        "load_start": [round(v, 2) for v in load],
    }


def _header(report: dict) -> list[str]:
    c, s = report["conditions"], report["sizes"]
    end = f", at end {c['load_end']:.2f}" if c.get("load_end") is not None else ""
    return [
        f"conditions: {c['cpu']}, {c['cores']} cores, torch {c['torch']}, load average at start "
        f"{' '.join(f'{v:.2f}' for v in c['load_start'])} (1/5/15 min){end}",
        f"command: {report['command']}",
        f"job: gpt {s['model_args']}, seq-len {s['seq_len']}, global batch {s['batch']}, "
        f"{s['steps']} steps, adamw, no eval; samples/s over steps {s['settle']}..{s['steps']}, "
        f"{s['reps']} interleaved rounds",
    ]


def noisy(rows: dict[str, dict]) -> list[str]:
    """A line for each case whose runs' samples/s spread past ``NOISY_SPREAD`` (fastest over
    slowest): on a busy machine its median, and every ratio that uses it, is not to be trusted."""
    lines = []
    for case, row in rows.items():
        rates = [v for v in row["samples_per_s"] if isinstance(v, int | float) and v > 0]
        if len(rates) > 1 and max(rates) / min(rates) > NOISY_SPREAD:
            lines.append(
                f"  noisy: {case}'s runs range {min(rates):.1f}..{max(rates):.1f} samples/s "
                f"({max(rates) / min(rates):.1f}x): the machine was busy; its ratios are unreliable"
            )
    return lines


def render(report: dict) -> str:
    """The conditions, the table of cases, the bytes and speed ratios, and what they mean."""
    rows, r, e = report["rows"], report["result"], report["expected"]
    t, cores = e["degree"], report["conditions"]["cores"]
    header = ["case", "flags", "procs", "samples/s (runs)", "median", "param B", "grad B"]
    header += ["optim B", "total B", "vs one"]
    predicted = report.get("predicted") or {}
    header += ["predicted", "error"] if predicted else []
    table = []
    for case, row in rows.items():
        runs = " ".join(_fmt(v, 1) for v in row["samples_per_s"]) or "-"
        held = [row[f"most_{k}"] for k in HELD]
        vs = _ratio(row["most_total_bytes"], rows.get("one", {}).get("most_total_bytes"))
        flags = " ".join(report["cases"][case]).replace("--bundle-shape", "shape")
        flags = flags.replace("--tensor-parallel", "tp")
        table.append([case, flags, row["processes"], runs, _fmt(row["median_samples_per_s"], 1)])
        table[-1] += [*held, row["most_total_bytes"], vs]
        if predicted:
            guess, got = predicted.get(case), row["median_samples_per_s"]
            error = _ratio(guess, got)
            table[-1] += [_fmt(guess, 1), f"{error - 1:+.1%}" if error else "-"]
    b = r["bytes_tp_vs_one"]
    lines = [
        *_header(report),
        "",
        _table(
            "cases (bytes: the job's largest process, param + grad + AdamW state)", header, table
        ),
        "",
        f"bytes per process, TP {t} / one process: measured {_fmt(b['most_total_bytes'])} "
        f"(params {_fmt(b['most_param_bytes'])}, grads {_fmt(b['most_grad_bytes'])}, "
        f"optimizer {_fmt(b['most_optimizer_bytes'])})",
        f"  expected {_fmt(e['ratio'])} = ({e['replicated_params']:,} replicated + "
        f"{e['split_params']:,} split / {t}) / {e['all_params']:,} parameters (plan_of/resolve)",
        f"samples/s: TP {t} / one process {_fmt(r['speed_tp_vs_one'], 3)}; "
        f"TP {t} / DP {t} {_fmt(r['speed_tp_vs_dp'], 3)}",
        "  TP on CPU is not expected to beat DP: it sums activations over gloo 4 times per layer "
        "per step, on the cores that compute; it is for a model too big for one process.",
    ]
    for case in ("pipe", "rear"):
        pipe = rows.get(case)
        if pipe and pipe["processes"] > cores:
            lines.append(
                f"  {case}: {pipe['processes']} processes on {cores} cores oversubscribe them; "
                "its samples/s is not comparable with the others'."
            )
    lines += noisy(rows)
    lines.append(f"runs failed: {len(report['failures'])}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; the sizes default to the mode's (``PRESETS``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 16, 6 steps (about 3 minutes)")
    p.add_argument("--degree", type=int, default=2, help="T: the tensor-parallel degree")
    p.add_argument("--model-args", help="gpt's --model-args (default: layers=4,width=256,heads=8)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 64)")
    p.add_argument("--batch", type=int, help="global batch (default 32; --quick 16)")
    p.add_argument("--steps", type=int, help="steps per run (default 10; --quick 6)")
    p.add_argument("--reps", type=int, help="interleaved rounds of every case (default 3)")
    p.add_argument("--data-file", type=Path, help="text to train on (default: Python modules)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per main.py run")
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    p.add_argument("--predict", action="store_true", help="the planner's prediction per case")
    p.add_argument(
        "--profile-cache",
        default=str(prof.default_cache_dir()),
        help="with --predict: the planner's profile cache ('off' or '': measure every time)",
    )
    args = p.parse_args(argv)
    if args.degree < 2:
        p.error(f"--degree must be at least 2, not {args.degree}")
    return args


def sizes_of(args: argparse.Namespace) -> Sizes:
    """The mode's sizes with every size flag given replacing its own."""
    sizes = PRESETS["quick" if args.quick else "full"]
    given = {k: getattr(args, k) for k in ("model_args", "seq_len", "batch", "steps", "reps")}
    return replace(sizes, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Count the expected bytes, run the cases interleaved, print the report."""
    args = parse_args(argv)
    sizes = sizes_of(args)
    count = expected(sizes, args.degree)  # a plan the degree cannot split fails here, not later
    run = Runner(args.timeout)
    start, load = time.perf_counter(), os.getloadavg()
    report: dict = {
        "mode": "quick" if args.quick else "full",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "sizes": sizes.__dict__,
        "conditions": conditions(load),
        "cases": cases(args.degree),
        "expected": count,
    }
    print("\n".join(_header(report)), file=sys.stderr, flush=True)
    if args.predict:  # before the runs: the profile wants the machine to itself
        cache = "" if args.profile_cache == "off" else args.profile_cache
        sz = sizes
        report["predicted"] = predict(sz.model_args, sz.seq_len, sz.batch, args.degree, cache)
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        data = args.data_file or write_text(Path(tmp))
        base = job(sizes, data)
        runs = interleaved(measured(run, sizes.settle), base, report["cases"], sizes.reps)
    report["rows"] = summarize(runs, processes(args.degree))
    report["result"] = compare(report["rows"], count)
    report["conditions"]["load_end"] = round(os.getloadavg()[0], 2)
    report["failures"] = run.failures
    report["wall_s"] = round(time.perf_counter() - start, 1)
    publish(report, render, args.json)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
