"""Benchmark Bundle's data-parallel options through ``main.py``: ZeRO-1 and ZeRO-3, gradient
compression, bundle sync and robust aggregation, each part's numbers measured in one invocation.

    python scripts/bench_dp.py                          # every part (~10-20 min on 2 cores)
    python scripts/bench_dp.py --only robust --quick    # one part, tiny step counts (the test's)
    python scripts/bench_dp.py --json dp.json           # also write the report to a file

Every case is one ``main.py`` run on this machine (gloo on CPU, a free port each), one at a time;
its numbers are read from the JSON summary ``main.py`` prints as its last stdout line.

- ``zero``: data parallelism only (shape ``W``, one bundle) for W in (2, 4), ``gpt`` on the bytes
  of ``--data-file`` (``--dataset text``), adamw, no evaluation, ``--zero`` 0, 1 and 3 run
  interleaved (0 1 3, 3 1 0, ...; ``--reps`` rounds). Bytes: replica 0's parameters, gradients
  and optimizer state under each, their sum, and ratios to zero 0 (about 1/W: ZeRO-1's optimizer
  state, ZeRO-3's every one; ``most_total``: the job's largest process). Speed: ratios of median
  samples/s, zero 1 / zero 0, and zero 3 / zero 1 and / zero 0 (what the gathers cost). ZeRO-1
  must end at zero 0's loss; ZeRO-3 sums in another order (a reduce-scatter per micro-batch), so
  its final loss must lie within ``ZERO3_REL_TOL`` (relative) of zero 0's.
- ``compression``: the default digits job (shape 1,1, two bundles, default epochs) with
  ``--grad-compression`` none, bf16, fp16 and powersgd (rank 4); then powersgd rank 4 on
  ``mlp_wide``. ``grad_wire_ratio`` counts the ``--compression-warmup`` steps, which sync fp32;
  ``steady_wire_ratio`` is derived from it as the ratio of the compressed steps alone,
  ``(ratio * steps - warmup) / (steps - warmup)``.
- ``sync``: digits on four bundles of shape 1,1, the same steps each, with ``--bundle-sync`` step,
  local:8, diloco:8 and diloco:8 with outer momentum 0.5: accuracy, and cross-bundle bytes per
  step relative to step.
- ``robust``: four bundles on digits, bundle 3 adding noise from step 10
  (``BUNDLE_BYZANTINE=3:noise:10``), ``--aggregate`` mean, median and trimmed:1: accuracy
  (expected: mean degrades, median and trimmed:1 reach at least 0.90).

It prints one table per part, then the report as one JSON line (non-finite numbers as null). A run
that fails is printed (command and stderr tail) to stderr and listed under ``failures``; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bundle.launch.localworld import free_port

REPO = Path(__file__).resolve().parent.parent
MAIN = REPO / "main.py"
PARTS = ("zero", "compression", "sync", "robust")
COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
# The last: DiLoCo's outer momentum (0.9) is tuned for hundreds of inner steps; at H=8 on top of
# SGD momentum it overshoots, and a lower one shows the method itself.
SYNCS = ("step", "local:8", "diloco:8", "diloco:8 --outer-momentum 0.5")
AGGREGATES = ("mean", "median", "trimmed:1")
BYZANTINE = "3:noise:10"
POWERSGD_RANK = 4
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_WARMUP = 10  # main.py's --compression-warmup default
ZEROS = (0, 1, 3)
HELD = ("param_bytes", "grad_bytes", "optimizer_bytes")
# One unit of the summary's 4th significant digit is up to 0.1 % of a loss; the reordered sums of
# a few tens of steps move the loss far less than that.
ZERO3_REL_TOL = 2e-3


@dataclass(frozen=True)
class Sizes:
    """Step counts and repetitions of one mode (None: main.py's default epochs)."""

    widths: tuple[int, ...] = (2, 4)
    zero_steps: int = 30
    reps: int = 2  # interleaved rounds (zero 0, 1, 3) per width
    compression_steps: int | None = None
    sync_steps: int = 110  # what the default 5 epochs of digits at batch 64 come to
    robust_steps: int = 110


PRESETS = {
    "full": Sizes(),
    "quick": Sizes(
        widths=(2,), zero_steps=4, reps=1, compression_steps=20, sync_steps=24, robust_steps=30
    ),
}


class Runner:
    """Runs main.py, one process tree at a time, and keeps the failures."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.failures: list[dict] = []

    def __call__(self, args: list[str], env: dict[str, str] | None = None) -> dict | None:
        """main.py's JSON summary for ``args`` (plus ``env``), or None when the run failed."""
        cmd = [sys.executable, str(MAIN), *args, "--portNum", str(free_port()), "--timeout", "120"]
        shown = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd])
        print(f"$ {shown}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                cmd,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                capture_output=True,
                text=True,
                timeout=self.timeout,
            )
            code, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            code, out = None, _text(exc.stdout)
            err = _text(exc.stderr) + f"\n(timed out after {self.timeout:.0f} s)"
        summary = _summary(out) if code == 0 else None
        if summary is None:
            tail = "\n".join((err or out).strip().splitlines()[-15:])
            self.failures.append({"command": shown, "returncode": code, "stderr_tail": tail})
            print(f"FAILED (exit {code}):\n{tail}", file=sys.stderr, flush=True)
            return None
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        return summary


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


def _summary(stdout: str) -> dict | None:
    """The last stdout line, when it is main.py's JSON summary."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if not lines or not lines[-1].startswith("{"):
        return None
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return None


def _get(summary: dict | None, key: str) -> object:
    return None if summary is None else summary.get(key)


def _ratio(a: object, b: object) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return a / b


def _steps(n: int | None) -> list[str]:
    return [] if n is None else ["--itr", str(n)]


def interleaved(
    run: Callable[[list[str]], dict | None], base: list[str], cases: dict[str, list[str]], reps: int
) -> dict[str, list[dict]]:
    """Each case's summaries from ``reps`` rounds of ``base + case`` runs, every other round in
    reverse order (A B, B A, ...), so no case always runs first; failed runs are left out."""
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    order = list(cases)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            summary = run([*base, *cases[name]])
            if summary is not None:
                runs[name].append(summary)
    return runs


def median_ratio(a: list[float], b: list[float]) -> float | None:
    """median(a) / median(b), or None when either side has no value."""
    if not a or not b:
        return None
    return _ratio(statistics.median(a), statistics.median(b))


def losses_agree(a: Sequence[object], b: Sequence[object], rel_tol: float = 0.0) -> bool | None:
    """Whether every loss of ``a`` and ``b`` lies within ``rel_tol`` of the largest in magnitude
    (0: all equal); None when a side has none to compare."""
    if not a or not b:
        return None
    values = [v for v in [*a, *b] if isinstance(v, (int, float)) and math.isfinite(v)]
    if len(values) < len(a) + len(b):
        return False
    return max(values) - min(values) <= rel_tol * max(abs(v) for v in values)


# -- parts ------------------------------------------------------------------------------------


def bench_zero(run: Runner, sizes: Sizes, data_file: Path) -> dict:
    """Bytes per process and samples/s of ZeRO-1 and ZeRO-3 against none, per width, interleaved."""
    out: dict = {"model": "gpt", "optimizer": "adamw", "steps": sizes.zero_steps, "widths": {}}
    out["zero3_rel_tol"] = ZERO3_REL_TOL
    cases = {f"zero{z}": ["--zero", str(z)] for z in ZEROS}
    for w in sizes.widths:
        base = ["--bundle-shape", str(w), "--num-bundle", "1", "--model", "gpt"]
        base += ["--dataset", "text", "--data-file", str(data_file), "--optimizer", "adamw"]
        base += ["--lr", "0.001", "--no-eval", *_steps(sizes.zero_steps)]
        out["widths"][str(w)] = zero_row(interleaved(run, base, cases, sizes.reps), w)
    return out


def _sum(values: list[object]) -> int | None:
    ints = [v for v in values if isinstance(v, int)]
    return sum(ints) if len(ints) == len(values) else None


def zero_row(runs: dict[str, list[dict]], width: int) -> dict:
    """One width's report from each case's summaries (``zero0``, ``zero1``, ``zero3``): the bytes
    the first run of each held, their ratios to zero 0, the speed ratios and the loss checks."""
    first = {case: rs[0] if rs else {} for case, rs in runs.items()}
    keys = (*HELD, *(f"most_{k}" for k in HELD))
    held = {k: {case: first[case].get(k) for case in runs} for k in keys}
    total = {case: _sum([held[k][case] for k in HELD]) for case in runs}
    most = {case: _sum([held[f"most_{k}"][case] for k in HELD]) for case in runs}
    zero3 = {k.removesuffix("_bytes"): _ratio(held[k]["zero3"], held[k]["zero0"]) for k in HELD}
    zero3["total"] = _ratio(total["zero3"], total["zero0"])
    zero3["most_total"] = _ratio(most["zero3"], most["zero0"])
    sps = {case: [s["samples_per_s"] for s in rs] for case, rs in runs.items()}
    losses = {case: [s["final_loss"] for s in rs] for case, rs in runs.items()}
    opt = held["optimizer_bytes"]
    return {
        **held,  # the reporting process's (replica 0), and the job's largest (most_)
        "total_bytes": total,
        "optimizer_ratio": _ratio(opt["zero1"], opt["zero0"]),
        "zero3_ratios": zero3,
        "expected_ratio": 1 / width,
        "samples_per_s": sps,
        "throughput_ratio": median_ratio(sps["zero1"], sps["zero0"]),
        "zero3_vs_zero1": median_ratio(sps["zero3"], sps["zero1"]),
        "zero3_vs_zero0": median_ratio(sps["zero3"], sps["zero0"]),
        "same_final_loss": losses_agree(losses["zero1"], losses["zero0"]),
        "zero3_loss_agrees": losses_agree(losses["zero3"], losses["zero0"], ZERO3_REL_TOL),
        "final_loss": losses,
    }


def _accuracy_row(s: dict | None) -> dict:
    keys = ("val_accuracy", "final_loss", "grad_wire_ratio", "steps", "samples_per_s", "wall_s")
    return {k: _get(s, k) for k in keys}


def _steady(ratio: object, steps: object, warmup: int = DEFAULT_WARMUP) -> float | None:
    """The wire ratio of the compressed steps alone: warm-up steps send fp32 (ratio 1)."""
    if not isinstance(ratio, (int, float)) or not isinstance(steps, int) or steps <= warmup:
        return None
    return (ratio * steps - warmup) / (steps - warmup)


def bench_compression(run: Runner, sizes: Sizes) -> dict:
    """Accuracy and gradient bytes on the wire of each compression on digits; powersgd on mlp_wide."""
    base = ["--bundle-shape", "1,1", "--num-bundle", "2", *_steps(sizes.compression_steps)]
    rank = ["--powersgd-rank", str(POWERSGD_RANK)]
    out: dict = {"powersgd_rank": POWERSGD_RANK, "warmup": DEFAULT_WARMUP, "digits_cnn": {}}
    for c in COMPRESSIONS:
        s = run([*base, "--grad-compression", c, *(rank if c == "powersgd" else [])])
        row = _accuracy_row(s)
        row["steady_wire_ratio"] = _steady(row["grad_wire_ratio"], row["steps"])
        out["digits_cnn"][c] = row
    s = run([*base, "--model", "mlp_wide", "--grad-compression", "powersgd", *rank])
    row = _accuracy_row(s)
    row["steady_wire_ratio"] = _steady(row["grad_wire_ratio"], row["steps"])
    out["mlp_wide_powersgd"] = row
    return out


def bench_sync(run: Runner, sizes: Sizes) -> dict:
    """Accuracy and cross-bundle bytes per step of each --bundle-sync on four digits bundles."""
    base = ["--bundle-shape", "1,1", "--num-bundle", "4", *_steps(sizes.sync_steps)]
    rows = {m: _accuracy_row(run([*base, "--bundle-sync", *m.split()])) for m in SYNCS}
    ref = rows["step"]["grad_wire_ratio"]
    for row in rows.values():
        row["vs_step"] = _ratio(row["grad_wire_ratio"], ref)
    return {"bundles": 4, "steps": sizes.sync_steps, "modes": rows}


def bench_robust(run: Runner, sizes: Sizes) -> dict:
    """Accuracy of each --aggregate with one bundle of four sending noise."""
    base = ["--bundle-shape", "1,1", "--num-bundle", "4", *_steps(sizes.robust_steps)]
    env = {"BUNDLE_BYZANTINE": BYZANTINE}
    rows = {a: _accuracy_row(run([*base, "--aggregate", a], env)) for a in AGGREGATES}
    return {"bundles": 4, "steps": sizes.robust_steps, "byzantine": BYZANTINE, "aggregates": rows}


# -- output -----------------------------------------------------------------------------------


def _fmt(value: object, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def _table(title: str, header: list[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [header, *([_fmt(v) for v in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(lines)


def _render_zero(z: dict) -> list[str]:
    """The bytes table (one row per width and --zero) and the speed table (one row per width)."""
    held, speed = [], []
    for w, r in z["widths"].items():
        for case in r["total_bytes"]:
            total = r["total_bytes"]
            row = [w, case.removeprefix("zero"), *(r[k][case] for k in HELD), total[case]]
            held.append([*row, _ratio(total[case], total["zero0"]), r["expected_ratio"]])
        sps = r["samples_per_s"]
        speed.append(
            [w, *(_fmt(statistics.median(sps[c]), 1) if sps[c] else None for c in sps)]
            + [r["throughput_ratio"], r["zero3_vs_zero1"], r["zero3_vs_zero0"]]
            + [r["same_final_loss"], r["zero3_loss_agrees"]]
        )
    what = f"{z['model']}, {z['optimizer']}, {z['steps']} steps"
    header = ["width", "zero", "param_bytes", "grad_bytes", "opt_bytes", "total", "vs z0", "1/w"]
    tables = [_table(f"ZeRO bytes per process ({what}; replica 0)", header, held)]
    header = ["width", "samples/s z0", "z1", "z3", "z1/z0", "z3/z1", "z3/z0", "z1 same loss"]
    header.append(f"z3 loss within {z['zero3_rel_tol']:g}")
    tables.append(_table(f"ZeRO speed ({what}, medians, runs interleaved)", header, speed))
    return tables


def render(report: dict) -> str:
    """One table per part that ran."""
    out = _render_zero(report["zero"]) if "zero" in report else []
    if "compression" in report:
        c = report["compression"]
        named = [(f"digits_cnn {k}", v) for k, v in c["digits_cnn"].items()]
        named.append((f"mlp_wide powersgd r{c['powersgd_rank']}", c["mlp_wide_powersgd"]))
        rows = [
            [n, r["val_accuracy"], r["grad_wire_ratio"], r["steady_wire_ratio"], r["steps"]]
            for n, r in named
        ]
        header = ["case", "val_accuracy", "wire_ratio", "after warm-up", "steps"]
        title = f"gradient compression (2 bundles x 1,1; {c['warmup']} fp32 warm-up steps)"
        out.append(_table(title, header, rows))
    if "sync" in report:
        s = report["sync"]
        rows = [
            [m, r["val_accuracy"], r["final_loss"], r["grad_wire_ratio"], r["vs_step"], r["steps"]]
            for m, r in s["modes"].items()
        ]
        header = ["bundle-sync", "val_accuracy", "final_loss", "wire_ratio", "vs step", "steps"]
        out.append(_table(f"bundle sync ({s['bundles']} bundles x 1,1)", header, rows))
    if "robust" in report:
        r = report["robust"]
        rows = [
            [a, v["val_accuracy"], v["final_loss"], v["steps"]] for a, v in r["aggregates"].items()
        ]
        title = f"robust aggregation ({r['bundles']} bundles, BUNDLE_BYZANTINE={r['byzantine']})"
        out.append(_table(title, ["aggregate", "val_accuracy", "final_loss", "steps"], rows))
    return "\n\n".join(out)


def _finite(value: object) -> object:
    """The report with NaN and infinities as None, so the JSON line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny step counts, one width, one pair")
    p.add_argument("--only", choices=PARTS, help="run only this part")
    p.add_argument("--reps", type=int, metavar="N", help="zero: interleaved rounds per width")
    add_run_flags(p, "zero: ")
    return p.parse_args(argv)


def add_run_flags(p: argparse.ArgumentParser, part: str = "") -> None:
    """--data-file, --timeout and --json, which every main.py benchmark here takes."""
    p.add_argument(
        "--data-file",
        type=Path,
        default=DEFAULT_TEXT if DEFAULT_TEXT.is_file() else REPO / "README.md",
        help=f"{part}the text gpt trains on (default: %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per main.py run")
    p.add_argument("--json", metavar="PATH", help="also write the report here")


def publish(report: dict, render: Callable[[dict], str], path: str | None) -> dict:
    """Print the report's tables, the wall time and failures, then the report as one JSON line
    (non-finite numbers as null), also written indented to ``path``; returns what was printed."""
    report = _finite(report)  # type: ignore[assignment]
    print(render(report))
    print(f"wall time {report['wall_s']:.1f} s; failed runs: {len(report['failures'])}")
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, allow_nan=False), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for, print their tables and the report as one JSON line."""
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    sizes = PRESETS[mode]
    if args.reps:
        sizes = Sizes(**{**sizes.__dict__, "reps": args.reps})
    run = Runner(args.timeout)
    start = time.perf_counter()
    report: dict = {"mode": mode, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    for part in [args.only] if args.only else PARTS:
        if part == "zero":
            report[part] = bench_zero(run, sizes, args.data_file)
        elif part == "compression":
            report[part] = bench_compression(run, sizes)
        elif part == "sync":
            report[part] = bench_sync(run, sizes)
        else:
            report[part] = bench_robust(run, sizes)
    report["failures"] = run.failures
    report["wall_s"] = round(time.perf_counter() - start, 1)
    publish(report, render, args.json)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
