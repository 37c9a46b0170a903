"""One command for the day a GPU is available: the NCCL tests, NCCL training runs and the benchmark.

Each check runs as a subprocess in its own process group with a timeout, so a hang fails that
check (its group is killed) instead of stalling the rest:

1. ``python -m pytest -q -ra tests/integration/test_nccl.py``: gradient equivalence over NCCL against the CPU
   reference (a skipped test counts as a failure here: on a GPU machine it checked nothing);
2. ``main.py`` training ``digits_cnn`` cut in two stages (shape ``1,1``) over NCCL, once per
   schedule x gradient sync: ``max(2, GPUs // 2)`` bundles, so each stage group spans bundles
   and flat and hierarchical sync really differ; with fewer GPUs than processes the ranks share
   them (``--share-gpus``). samples/s come from the run's JSON summary line;
3. ``python scripts/bench_gpu.py`` with its defaults: Bundle against a plain PyTorch loop
   (ResNet-50), its images/s and peak memory.

It writes a Markdown report (the machine; one row per check: command, pass/fail, samples/s, peak
memory, seconds; the output tail of each failure), prints its path and a one-line verdict, and
exits 0 when every check passed, 1 when any failed, 2 without a CUDA device (checked first).

    make gpu-check                                  # the same in the project's .venv (+ --json)
    python scripts/gpu_check.py                     # writes gpu-check-report.md
    python scripts/gpu_check.py --report out.md --json out.json --timeout 900
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from bundle.config import GRAD_SYNCS, SCHEDULES
from bundle.ir.schedule import REGISTRY

REPO = Path(__file__).resolve().parent.parent

NO_CUDA = (
    "gpu-check: no CUDA device here (torch.cuda.is_available() is False); "
    "run it on a machine with an NVIDIA GPU"
)
# A small quick job: real digits data, two stages, enough steps for the schedule to reach its
# steady state; peer waits time out well inside the subprocess's own limit.
TRAIN_FLAGS = (
    "--model", "digits_cnn", "--itr", "40", "--micro-batches", "4", "--backend", "nccl",
    "--log-every", "10", "--timeout", "60", "--init-timeout", "120",
)  # fmt: skip
# Runs beside every schedule and sync: blocks compiled (inductor: Triton), and each stage
# sharded over its replicas in every bundle (--zero 3, FSDP2 over NCCL), both ways of syncing.
EXTRA_RUNS = (
    ("compile", "1f1b", "flat", ("--compile",)),
    ("zero 3", "1f1b", "flat", ("--zero", "3")),
    ("zero 3 compiled", "gpipe", "hierarchical", ("--zero", "3", "--compile")),
)
BATCH_PER_BUNDLE = 32
TIMEOUT_S = {"pytest": 1200.0, "train": 300.0, "bench": 900.0}
TERM_GRACE_S = 10.0  # between SIGTERM and SIGKILL of a timed-out check's process group
TAIL_LINES = 30


@dataclass(frozen=True)
class Check:
    """One command to run: ``python ARGV...`` in the repository."""

    name: str
    kind: str  # "pytest", "train" or "bench": how its outcome is read
    argv: tuple[str, ...]
    timeout_s: float
    schedule: str | None = None  # train: what the summary must report
    grad_sync: str | None = None
    json_out: str | None = None  # bench: where its --json report goes

    @property
    def command(self) -> str:
        return shlex.join(("python", *self.argv))


@dataclass(frozen=True)
class Outcome:
    """What one command did; returncode None: it ran past its timeout and was killed."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    left_running: bool = False  # processes of its group outlived it (then killed)


@dataclass(frozen=True)
class Result:
    """One row of the report."""

    name: str
    command: str
    passed: bool
    returncode: int | None
    timed_out: bool
    seconds: float
    samples_per_s: float | None
    peak_memory_mib: float | None
    notes: str
    output_tail: str
    details: dict | None = None  # train: the run summary; bench: bench_gpu.py's report


def train_argv(
    gpus: int, schedule: str, grad_sync: str, port: int, extra: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """main.py flags for a two-stage run on ``gpus`` GPUs (several ranks per GPU if too few),
    with ``extra`` flags."""
    bundles = max(2, gpus // 2)
    argv = [
        "main.py", *TRAIN_FLAGS,
        "--bundle-shape", "1,1", "--num-bundle", str(bundles),
        "--batch-size", str(BATCH_PER_BUNDLE * bundles),
        "--schedule", schedule, "--grad-sync", grad_sync, "--portNum", str(port),
    ]  # fmt: skip
    if REGISTRY[schedule].chunks:
        argv += ["--virtual-stages", "2"]
    if 2 * bundles > gpus:
        argv.append("--share-gpus")
    return (*argv, *extra)


def plan(
    gpus: int, workdir: Path, free_port: Callable[[], int], timeout_s: float | None = None
) -> list[Check]:
    """The checks, in order, for a node with ``gpus`` GPUs; bench's JSON goes to ``workdir``."""

    def limit(kind: str) -> float:
        return timeout_s if timeout_s is not None else TIMEOUT_S[kind]

    tests = ("-m", "pytest", "-q", "-ra", "tests/integration/test_nccl.py")
    checks = [Check("nccl tests", "pytest", tests, limit("pytest"))]
    for schedule, sync in itertools.product(SCHEDULES, GRAD_SYNCS):
        argv = train_argv(gpus, schedule, sync, free_port())
        checks.append(
            Check(f"train {schedule} {sync}", "train", argv, limit("train"), schedule, sync)
        )
    for name, schedule, sync, extra in EXTRA_RUNS:
        argv = train_argv(gpus, schedule, sync, free_port(), extra)
        checks.append(
            Check(f"train {schedule} {sync} {name}", "train", argv, limit("train"), schedule, sync)
        )
    out = str(workdir / "bench_gpu.json")
    bench = ("scripts/bench_gpu.py", "--json", out)
    return [*checks, Check("bench_gpu", "bench", bench, limit("bench"), json_out=out)]


def run_command(argv: tuple[str, ...], timeout_s: float) -> Outcome:
    """``python ARGV`` in the repository, in a new session; past the timeout its process group is
    sent SIGTERM, then SIGKILL. Output goes to files, which a stuck grandchild cannot block."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, stdout=out, stderr=err, start_new_session=True
        )
        left_running = False
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
            # A clean exit leaves no process of its group behind; one that does stays noted.
            left_running = _running_in_group(proc.pid)
            _kill_leftovers(proc)
        except subprocess.TimeoutExpired:
            returncode = None
            _kill_group(proc)
        seconds = time.perf_counter() - start
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return Outcome(returncode, seconds, *texts, left_running=left_running)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's own group (start_new_session made it the leader), a grace period,
    then SIGKILL to whatever of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=TERM_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_leftovers(proc)
    proc.wait()


def _kill_leftovers(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the child's process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _running_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (Linux /proc). Zombies do not count: an
    orphan that has exited waits there until PID 1 reaps it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z" and int(group) == pgid:
            return True
    return False


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def summary_line(stdout: str) -> dict | None:
    """The run summary: the last stdout line that is a JSON object with ``"summary": true``."""
    for line in reversed(stdout.splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("summary") is True:
                return record
    return None


def _pytest_counts(stdout: str) -> str:
    """pytest -q's last line, e.g. ``4 passed, 1 skipped in 30.1s``."""
    for line in reversed(stdout.splitlines()):
        if any(w in line for w in (" passed", " failed", " skipped", " error", " deselected")):
            return line.strip("= ").strip()
    return ""


def _read_summary(check: Check, summary: dict[str, Any], notes: list[str]) -> bool:
    """Notes from a training run's summary line; whether it ran the schedule and sync asked for."""
    got = (summary.get("schedule"), summary.get("grad_sync"))
    matches = got == (check.schedule, check.grad_sync)
    if not matches:
        notes.append(f"summary reports schedule/sync {got}")
    if summary.get("final_loss") is not None:
        notes.append(f"final loss {summary['final_loss']:.4f}")
    notes.append(f"{summary.get('world_size')} processes")
    return matches


def evaluate(check: Check, outcome: Outcome) -> Result:
    """Pass/fail and the figures of one check from what its command did."""
    ok = outcome.returncode == 0
    samples = peak = details = None
    notes: list[str] = []
    if check.kind == "pytest":
        counts = _pytest_counts(outcome.stdout)
        notes.append(counts)
        if "skipped" in counts:
            ok = False
            notes.append("a skipped test checked nothing on this GPU machine")
    elif check.kind == "train":
        summary = details = summary_line(outcome.stdout)
        if summary is None:
            ok = False
            notes.append("no JSON summary line on stdout")
        else:
            samples, peak = summary.get("samples_per_s"), summary.get("peak_memory_mib")
            ok = _read_summary(check, summary, notes) and ok
    elif check.kind == "bench":
        try:
            report = details = json.loads(Path(check.json_out or "").read_text())
            samples = report["images_per_s"]["bundle"]
            peak = report.get("peak_memory_mib", {}).get("bundle")
            target = "met" if report["meets_target"] else "NOT met"
            notes.append(
                f"plain {report['images_per_s']['plain']:.1f} images/s, "
                f"ratio {report['ratio']:.3f} (target {report['target_ratio']}: {target})"
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ok = False
            notes.append(f"no report from --json ({type(exc).__name__}: {exc})")
    if outcome.returncode is None:
        ok = False
        notes.insert(0, f"timed out after {check.timeout_s:g} s; process group killed")
    elif outcome.returncode != 0:
        notes.insert(0, f"exit code {outcome.returncode}")
    if outcome.left_running:
        notes.append("processes of its group outlived it and were killed")
    parts = [tail(outcome.stdout), tail(outcome.stderr)]
    if parts[1]:
        parts[1] = f"--- stderr ---\n{parts[1]}"
    return Result(
        name=check.name,
        command=check.command,
        passed=ok,
        returncode=outcome.returncode,
        timed_out=outcome.returncode is None,
        seconds=round(outcome.seconds, 1),
        samples_per_s=samples,
        peak_memory_mib=None if peak is None else round(peak, 1),
        notes="; ".join(n for n in notes if n),
        output_tail="\n".join(p for p in parts if p),
        details=details,
    )


def machine() -> dict:
    """The GPUs and software the checks ran on."""
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {
        "gpu": ", ".join(names),
        "gpus": count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if nccl else None,
        "platform": platform.platform(),
    }


def verdict(results: list[Result]) -> str:
    failed = [r.name for r in results if not r.passed]
    if not failed:
        return f"gpu-check: all {len(results)} checks passed"
    return f"gpu-check: {len(failed)} of {len(results)} checks FAILED: {', '.join(failed)}"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def markdown(info: dict, results: list[Result]) -> str:
    lines = [
        "# gpu-check report",
        "",
        f"{verdict(results)}.",
        "",
        f"- GPU: {info['gpu']} x {info['gpus']}",
        f"- torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}",
        f"- {info['platform']}",
        "",
        "| check | command | result | samples/s | peak memory MiB | seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | `{r.command}` | {'pass' if r.passed else '**FAIL**'} | "
            f"{_cell(r.samples_per_s)} | {_cell(r.peak_memory_mib)} | {r.seconds:.1f} |"
        )
    lines += ["", "## Notes", ""]
    lines += [f"- {r.name}: {r.notes}" for r in results if r.notes]
    for r in results:
        if not r.passed:
            lines += ["", f"## {r.name}: output tail", "", "```", r.output_tail, "```"]
    return "\n".join(lines) + "\n"


def write_report(
    info: dict, results: list[Result], report: Path, json_path: Path | None = None
) -> None:
    report.write_text(markdown(info, results))
    if json_path is not None:
        data = {
            "machine": info,
            "passed": all(r.passed for r in results),
            "verdict": verdict(results),
            "checks": [asdict(r) for r in results],
        }
        json_path.write_text(json.dumps(data, indent=2) + "\n")


def run_checks(checks: list[Check]) -> list[Result]:
    results = []
    for i, check in enumerate(checks, 1):
        print(f"[{i}/{len(checks)}] {check.name}: {check.command}", flush=True)
        result = evaluate(check, run_command(check.argv, check.timeout_s))
        print(f"    {'pass' if result.passed else 'FAIL'} in {result.seconds:.1f} s", flush=True)
        results.append(result)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", default="gpu-check-report.md", metavar="PATH", help="Markdown")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds each check may run (default: 1200 for the tests, 300 per training run, "
        "900 for the benchmark)",
    )
    args = p.parse_args(argv)
    if args.timeout is not None and args.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    return args


def unwritable(paths: list[str | None]) -> str | None:
    """The first report path whose directory cannot be written, found before minutes of checks."""
    for path in filter(None, paths):
        folder = Path(path).resolve().parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    bad = unwritable([args.report, args.json])
    if bad is not None:
        print(
            f"gpu-check: cannot write {bad}: its directory is missing or read-only", file=sys.stderr
        )
        return 2
    from bundle.launch.localworld import free_port

    info = machine()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        checks = plan(info["gpus"], Path(tmp), free_port, args.timeout)
        results = run_checks(checks)
    report = Path(args.report)
    write_report(info, results, report, Path(args.json) if args.json else None)
    print(f"report: {report}" + (f" (JSON: {args.json})" if args.json else ""))
    print(verdict(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
