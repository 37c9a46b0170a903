"""Benchmark ``--lora`` against full fine-tuning through ``main.py``: the same model, shape, data
and optimizer, runs interleaved; what a step syncs, what the optimizer holds, memory and speed.

    python scripts/bench_lora.py                     # GPT-2 small's size, 2 pairs (~10 min, 2 cores)
    python scripts/bench_lora.py --quick             # a tiny GPT-2: a smoke run
    python scripts/bench_lora.py --json lora.json

Every case is one ``main.py`` run on this machine (gloo on CPU, a free port each; bench_dp.py's
runner), one at a time: ``transformers:GPT2LMHeadModel`` (GPT-2 small's layers and width: 12 x
768; the vocabulary is the 256 byte-level tokens of ``--data-file``), ``--bundle-shape 2,1
--num-bundle 2`` (6 processes), 2 micro-batches, AdamW, no evaluation. ``full`` trains every
weight; ``lora`` trains adapters of rank ``--r`` on GPT-2's ``c_attn`` (PEFT's default for
GPT-2), everything else frozen; with ``--base-dtype``, a third case keeps the frozen base so.

How to read it (each a ratio lora / full of the medians, from the runs' summaries):

- ``grad_sync_bytes``: gradient bytes the reporting process (a replica of the last stage)
  handed its stage's sync per step;
- ``optimizer_bytes`` / ``most_optimizer_bytes``: the reporting process's optimizer state, and
  the largest over the job's processes; ``grad_bytes`` the same for gradients held at the step;
- ``peak_rss_mib``: the job's largest peak resident memory (one process: the frozen base is
  still held whole by each stage's processes);
- ``samples_per_s``: each run's steady speed over the steps after the first ``settle``;
- ``trainable_params`` / ``all_params``: as PEFT's print_trainable_parameters counts them.

It prints one table, then the report as one JSON line. A run that fails is printed (command and
stderr tail) to stderr and listed under ``failures``; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_compile import conditions, measured
from bench_dp import Runner, _fmt, _table, add_run_flags, interleaved, publish


@dataclass(frozen=True)
class Sizes:
    """The model and step counts of one mode."""

    model_args: str = "n_layer=12,n_embd=768,n_head=12"
    seq_len: int = 64
    batch: int = 8
    steps: int = 8
    reps: int = 2  # interleaved (full, lora) pairs
    settle: int = 2  # steps left out of the steady speed (and main.py's --log-every)


PRESETS = {
    "full": Sizes(),
    "quick": Sizes(model_args="n_layer=2,n_embd=64,n_head=2", seq_len=16, steps=4, reps=1),
}
KEYS = (
    "grad_sync_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "most_optimizer_bytes",
    "param_bytes",
    "most_param_bytes",
    "peak_rss_mib",
    "steady_samples_per_s",
    "trainable_params",
    "all_params",
    "final_loss",
)


def job(sizes: Sizes, data_file: Path) -> list[str]:
    """main.py's arguments shared by every case."""
    args = ["--bundle-shape", "2,1", "--num-bundle", "2", "--micro-batches", "2"]
    args += ["--model", "transformers:GPT2LMHeadModel", "--model-args", sizes.model_args]
    args += ["--dataset", "text", "--data-file", str(data_file), "--seq-len", str(sizes.seq_len)]
    args += ["--optimizer", "adamw", "--lr", "0.0002", "--no-eval"]
    return [*args, "--batch-size", str(sizes.batch), "--itr", str(sizes.steps)]


def _median(values: list) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return statistics.median(numbers) if numbers else None


def compare(runs: dict[str, list[dict]]) -> dict:
    """Each case's medians of ``KEYS`` and every other case's ratio to ``full``'s."""
    med = {case: {k: _median([s.get(k) for s in rs]) for k in KEYS} for case, rs in runs.items()}
    full = med.get("full", {})
    ratios = {
        case: {
            k: round(v / full[k], 6) if v is not None and full.get(k) else None
            for k, v in values.items()
        }
        for case, values in med.items()
        if case != "full"
    }
    return {"median": med, "vs_full": ratios}


def render(report: dict) -> str:
    """One row per case, then the ratios to full fine-tuning."""
    r, c, s = report["result"], report["conditions"], report["sizes"]
    header = ["case", *KEYS]
    rows = [[case, *(r["median"][case][k] for k in KEYS)] for case in r["median"]]
    rows += [[f"{case}/full", *(v[k] for k in KEYS)] for case, v in r["vs_full"].items()]
    title = (
        f"--lora {report['lora']} vs full fine-tuning (GPT-2 {s['model_args']}, seq-len "
        f"{s['seq_len']}, batch {s['batch']}, shape 2,1 x 2, medians of {s['reps']} interleaved "
        "runs)"
    )
    return "\n".join(
        [
            _table(title, header, rows),
            f"{c['cpus']} CPUs, {c['processes']} processes x {c['threads_per_process']} threads, "
            f"torch {c['torch']}, load {c['load_before']} -> {c['load_after']}",
            f"runs failed: {len(report['failures'])}; wall {_fmt(report['wall_s'], 1)} s",
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny GPT-2, 4 steps, one pair")
    p.add_argument("--r", type=int, default=8, help="the adapters' rank (default 8)")
    p.add_argument("--base-dtype", help="a third case: --lora with this --base-dtype")
    add_run_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the cases interleaved, print the table and the report as one JSON line."""
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    sizes = PRESETS[mode]
    run = Runner(args.timeout)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    lora = f"r={args.r},alpha={2 * args.r},targets=c_attn"
    cases = {"full": [], "lora": ["--lora", lora]}
    if args.base_dtype:
        cases[f"lora-{args.base_dtype}"] = ["--lora", lora, "--base-dtype", args.base_dtype]
    runs = interleaved(measured(run, sizes.settle), job(sizes, args.data_file), cases, sizes.reps)
    first = next((rs[0] for rs in runs.values() if rs), {})
    report: dict = {
        "mode": mode,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "lora": lora,
        "sizes": sizes.__dict__,
        "conditions": {
            **conditions(first.get("world_size")),
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "result": compare(runs),
        "failures": run.failures,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    publish(report, render, args.json)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
