"""Benchmark Bundle's data-parallel options through ``main.py``: ZeRO-1, gradient compression,
bundle sync and robust aggregation, each part's numbers measured in one invocation.

    python scripts/bench_dp.py                          # every part (~10-20 min on 2 cores)
    python scripts/bench_dp.py --only robust --quick    # one part, tiny step counts (the test's)
    python scripts/bench_dp.py --json dp.json           # also write the report to a file

Every case is one ``main.py`` run on this machine (gloo on CPU, a free port each), one at a time;
its numbers are read from the JSON summary ``main.py`` prints as its last stdout line.

- ``zero``: data parallelism only (shape ``W``, one bundle) for W in (2, 4), ``gpt`` on the bytes
  of ``--data-file`` (``--dataset text``), adamw, no evaluation: ``optimizer_bytes`` (rank 0's
  optimizer state) with ``--zero 1`` against ``--zero 0`` (expect about 1/W), and samples/s of
  the two, run interleaved (A B A B ...; ``--reps`` pairs) and compared as the ratio of their
  medians. ZeRO-1 is exact, so both must end at the same loss.
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


@dataclass(frozen=True)
class Sizes:
    """Step counts and repetitions of one mode (None: main.py's default epochs)."""

    widths: tuple[int, ...] = (2, 4)
    zero_steps: int = 30
    reps: int = 2  # interleaved (zero 0, zero 1) pairs per width
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


# -- parts ------------------------------------------------------------------------------------


def bench_zero(run: Runner, sizes: Sizes, data_file: Path) -> dict:
    """Optimizer bytes and samples/s of ZeRO-1 against none, per width, runs interleaved."""
    out: dict = {"model": "gpt", "optimizer": "adamw", "steps": sizes.zero_steps, "widths": {}}
    for w in sizes.widths:
        base = ["--bundle-shape", str(w), "--num-bundle", "1", "--model", "gpt"]
        base += ["--dataset", "text", "--data-file", str(data_file), "--optimizer", "adamw"]
        base += ["--lr", "0.001", "--no-eval", *_steps(sizes.zero_steps)]
        runs: dict[int, list[dict | None]] = {0: [], 1: []}
        for rep in range(sizes.reps):
            for z in (0, 1) if rep % 2 == 0 else (1, 0):  # A B, B A, ...: neither always first
                runs[z].append(run([*base, "--zero", str(z)]))
        ok = {z: [s for s in rs if s is not None] for z, rs in runs.items()}
        sps = {z: [s["samples_per_s"] for s in ok[z]] for z in ok}
        med = {z: statistics.median(v) if v else None for z, v in sps.items()}
        nbytes = {z: ok[z][0]["optimizer_bytes"] if ok[z] else None for z in ok}
        losses = {s["final_loss"] for z in ok for s in ok[z]}
        out["widths"][str(w)] = {
            "optimizer_bytes": {"zero0": nbytes[0], "zero1": nbytes[1]},
            "optimizer_ratio": _ratio(nbytes[1], nbytes[0]),
            "expected_ratio": 1 / w,
            "samples_per_s": {"zero0": sps[0], "zero1": sps[1]},
            "throughput_ratio": _ratio(med[1], med[0]),
            "same_final_loss": len(losses) == 1 if ok[0] and ok[1] else None,
            "final_loss": sorted(losses),
        }
    return out


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


def _table(title: str, header: list[str], rows: list[list[object]]) -> str:
    cells = [header, *([_fmt(v) for v in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(lines)


def render(report: dict) -> str:
    """One table per part that ran."""
    out = []
    if "zero" in report:
        z = report["zero"]
        rows = []
        for w, r in z["widths"].items():
            sps = r["samples_per_s"]
            rows.append(
                [w, r["optimizer_bytes"]["zero0"], r["optimizer_bytes"]["zero1"]]
                + [r["optimizer_ratio"], r["expected_ratio"]]
                + [_fmt(statistics.median(sps["zero0"]), 1) if sps["zero0"] else None]
                + [_fmt(statistics.median(sps["zero1"]), 1) if sps["zero1"] else None]
                + [r["throughput_ratio"], r["same_final_loss"]]
            )
        header = ["width", "opt_bytes z0", "opt_bytes z1", "ratio", "1/w"]
        header += ["samples/s z0", "samples/s z1", "speed z1/z0", "same loss"]
        title = f"ZeRO-1 ({z['model']}, {z['optimizer']}, {z['steps']} steps, medians)"
        out.append(_table(title, header, rows))
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
    p.add_argument("--reps", type=int, metavar="N", help="zero: interleaved pairs per width")
    p.add_argument(
        "--data-file",
        type=Path,
        default=DEFAULT_TEXT if DEFAULT_TEXT.is_file() else REPO / "README.md",
        help="zero: the text gpt trains on (default: %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per main.py run")
    p.add_argument("--json", metavar="PATH", help="also write the report here")
    return p.parse_args(argv)


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
    report = _finite(report)
    print(render(report))
    print(f"wall time {report['wall_s']:.1f} s; failed runs: {len(run.failures)}")
    line = json.dumps(report, allow_nan=False)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(line, flush=True)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
