"""scripts/gpu_check.py without a GPU: the no-CUDA exit, the plan, and the report from a fake runner."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bundle import cli
from bundle.config import GRAD_SYNCS, SCHEDULES

# The NCCL tests, a training run per schedule and sync, the benchmark.

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check", SCRIPT)
CHECKS = 2 + len(SCHEDULES) * len(GRAD_SYNCS) + len(gpu_check.EXTRA_RUNS)
INFO = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "gpus": 1,
    "torch": "2.14.1",
    "cuda": "13.0",
    "nccl": "2.30.7",
    "platform": "Linux",
}


def _plan(gpus: int, tmp_path: Path) -> list:
    return gpu_check.plan(gpus, tmp_path, lambda: 29555)


def _train_checks(gpus: int, tmp_path: Path) -> list:
    return [c for c in _plan(gpus, tmp_path) if c.kind == "train"]


def test_without_cuda_it_exits_2_with_one_line_before_anything_else(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a GPU machine
    report = tmp_path / "report.md"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(report)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device here" in lines[0], p.stderr
    assert not report.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_plan_covers_every_schedule_and_sync_and_shares_gpus_only_when_too_few(tmp_path, gpus):
    checks = _plan(gpus, tmp_path)
    runs = len(SCHEDULES) * len(GRAD_SYNCS) + len(gpu_check.EXTRA_RUNS)
    assert [c.kind for c in checks] == ["pytest"] + ["train"] * runs + ["bench"]
    assert checks[0].argv == ("-m", "pytest", "-q", "-ra", "tests/integration/test_nccl.py")
    assert checks[-1].argv[0] == "scripts/bench_gpu.py" and "--json" in checks[-1].argv
    train = checks[1:-1]
    assert {(c.schedule, c.grad_sync) for c in train} == set(
        itertools.product(SCHEDULES, GRAD_SYNCS)
    )
    assert {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"} <= set(SCHEDULES)
    for c in train:
        argv = list(c.argv)
        bundles = int(argv[argv.index("--num-bundle") + 1])
        assert argv[argv.index("--bundle-shape") + 1] == "1,1" and bundles >= 2
        assert ("--share-gpus" in argv) == (2 * bundles > gpus)
        assert argv[argv.index("--schedule") + 1] == c.schedule
        assert argv[argv.index("--grad-sync") + 1] == c.grad_sync
    if gpus == 1:
        assert all("--share-gpus" in c.argv for c in train)
    # --compile and --zero 3 run too, each on its own and together.
    extras = [
        tuple(a for a in c.argv[c.argv.index("--portNum") + 2 :] if a != "--share-gpus")
        for c in train
    ]
    assert ("--compile",) in extras and ("--zero", "3") in extras
    assert ("--zero", "3", "--compile") in extras


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_every_planned_command_parses_with_its_own_parser(tmp_path, gpus):
    """The flags cannot rot: main.py's commands through cli.parse, bench_gpu's through its own."""
    for c in _train_checks(gpus, tmp_path):
        assert c.argv[0] == "main.py"
        cfg = cli.parse(list(c.argv[1:]), {})
        assert cfg.launch.backend == "nccl" and cfg.parallel.shape == (1, 1)
        assert (cfg.parallel.schedule, cfg.parallel.grad_sync) == (c.schedule, c.grad_sync)
        assert cfg.parallel.micro_batches == 4 and cfg.train.steps > 0
        assert cfg.launch.share_gpus == (cfg.procs_per_node > gpus)
    bench = _plan(gpus, tmp_path)[-1]
    bench_gpu = _load("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert bench_gpu.parse_args(list(bench.argv[1:])).json == bench.json_out


def _summary(argv: tuple[str, ...]) -> str:
    flag = dict(zip(argv, argv[1:], strict=False))
    return json.dumps(
        {
            "summary": True,
            "samples_per_s": 1234.5,
            "schedule": flag["--schedule"],
            "grad_sync": flag["--grad-sync"],
            "final_loss": 0.25,
            "world_size": 4,
        },
        sort_keys=True,
    )


def fake_runner(fail: str | None = None, hang: str | None = None):
    """Canned outcomes; ``fail``/``hang``: the schedule-sync ("gpipe hierarchical") that exits 1
    or times out."""

    def run(argv: tuple[str, ...], timeout_s: float):
        if argv[0] == "-m":
            return gpu_check.Outcome(0, 30.0, "......\n6 passed in 29.50s\n", "")
        if argv[0] == "scripts/bench_gpu.py":
            report = {
                "images_per_s": {"bundle": 700.0, "plain": 710.0},
                "ratio": 700.0 / 710.0,
                "target_ratio": 0.97,
                "meets_target": True,
                "peak_memory_mib": {"bundle": 5120.04, "plain": 5000.0},
            }
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(report))
            return gpu_check.Outcome(0, 60.0, "images/s: bundle 700.0\n", "")
        flag = dict(zip(argv, argv[1:], strict=False))
        which = f"{flag['--schedule']} {flag['--grad-sync']}"
        if "--zero" in argv or "--compile" in argv:  # the extra runs pass
            which = ""
        if which == hang:
            return gpu_check.Outcome(None, timeout_s, "", "step 3 of 40\n")
        if which == fail:
            return gpu_check.Outcome(1, 5.0, "", "progress\nmain.py: error: rank 1 died\n")
        return gpu_check.Outcome(0, 8.0, "progress\n" + _summary(argv) + "\n", "log line\n")

    return run


def _run_main(monkeypatch, tmp_path, runner) -> tuple[int, Path, Path]:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: dict(INFO))
    monkeypatch.setattr(gpu_check, "run_command", runner)
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    return gpu_check.main(["--report", str(md), "--json", str(js)]), md, js


def test_report_table_json_and_exit_0_when_every_check_passes(monkeypatch, tmp_path, capsys):
    code, md, js = _run_main(monkeypatch, tmp_path, fake_runner())
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert (
        out[-2].startswith(f"report: {md}") and out[-1] == f"gpu-check: all {CHECKS} checks passed"
    )
    text = md.read_text()
    assert "NVIDIA H100 80GB HBM3 x 1" in text and "NCCL 2.30.7" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "`python" in ln]
    assert len(rows) == CHECKS
    assert rows[0] == (
        "| nccl tests | `python -m pytest -q -ra tests/integration/test_nccl.py` | pass | - | - | 30.0 |"
    )
    train = rows[1].split(" | ")
    assert train[0] == "| train gpipe flat" and train[1].startswith("`python main.py ")
    assert "--share-gpus" in train[1] and train[2:] == ["pass", "1,234.5", "-", "8.0 |"]
    assert rows[-1].endswith("| pass | 700.0 | 5,120.0 | 60.0 |")
    assert "ratio 0.986 (target 0.97: met)" in text and "6 passed in 29.50s" in text
    data = json.loads(js.read_text())
    assert data["passed"] is True and data["machine"] == INFO
    assert data["verdict"] == f"gpu-check: all {CHECKS} checks passed"
    assert [c["name"] for c in data["checks"]] == [
        "nccl tests",
        *(f"train {s} {y}" for s in SCHEDULES for y in ("flat", "hierarchical")),
        *(f"train {s} {y} {name}" for name, s, y, _ in gpu_check.EXTRA_RUNS),
        "bench_gpu",
    ]
    first_train = data["checks"][1]
    assert first_train["samples_per_s"] == 1234.5 and first_train["returncode"] == 0
    assert first_train["details"]["schedule"] == "gpipe" and first_train["output_tail"]
    assert data["checks"][-1]["details"]["ratio"] == pytest.approx(700 / 710)
    assert data["checks"][-1]["peak_memory_mib"] == 5120.0


def test_a_failed_and_a_hung_run_fail_the_check_with_exit_1(monkeypatch, tmp_path, capsys):
    runner = fake_runner(fail="gpipe hierarchical", hang="1f1b flat")
    code, md, js = _run_main(monkeypatch, tmp_path, runner)
    assert code == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict == (
        f"gpu-check: 2 of {CHECKS} checks FAILED: train gpipe hierarchical, train 1f1b flat"
    )
    text = md.read_text()
    assert "| train gpipe hierarchical | `python main.py" in text
    assert text.count("| **FAIL** |") == 2
    tail = text.split("## train gpipe hierarchical: output tail", 1)[1]
    assert tail.startswith("\n\n```\n--- stderr ---\nprogress\nmain.py: error: rank 1 died\n```")
    assert "timed out after 300 s; process group killed" in text
    checks = {c["name"]: c for c in json.loads(js.read_text())["checks"]}
    assert checks["train gpipe hierarchical"]["returncode"] == 1
    hung = checks["train 1f1b flat"]
    assert hung["timed_out"] is True and hung["returncode"] is None and not hung["passed"]
    assert checks["train gpipe flat"]["passed"] and checks["bench_gpu"]["passed"]


def test_an_unwritable_report_path_exits_2_before_any_check(monkeypatch, tmp_path, capsys):
    def never(argv, timeout_s):
        raise AssertionError("a check ran")

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda: dict(INFO))
    monkeypatch.setattr(gpu_check, "run_command", never)
    missing = tmp_path / "no-such-dir" / "r.json"
    assert gpu_check.main(["--report", str(tmp_path / "r.md"), "--json", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0]


def test_skips_missing_summaries_and_missing_bench_reports_are_failures(tmp_path):
    tests, train, *_, bench = _plan(1, tmp_path)
    skipped = gpu_check.Outcome(0, 1.0, "ss..\n2 passed, 3 skipped in 1.00s\n", "")
    assert not gpu_check.evaluate(tests, skipped).passed
    no_summary = gpu_check.Outcome(0, 1.0, "progress only\n", "")
    result = gpu_check.evaluate(train, no_summary)
    assert not result.passed and "no JSON summary line" in result.notes
    wrong = gpu_check.Outcome(0, 1.0, _summary(train.argv).replace("gpipe", "1f1b") + "\n", "")
    assert not gpu_check.evaluate(train, wrong).passed
    assert not gpu_check.evaluate(bench, gpu_check.Outcome(0, 1.0, "", "")).passed


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` ends within ``within_s`` (a signal is delivered, not awaited)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:  # killed, not yet reaped by its new parent
            return True
        time.sleep(0.05)
    return False


def test_run_command_kills_the_process_group_of_a_hang(monkeypatch):
    """A child that hangs and its grandchild (same group) both end at the timeout."""
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(g.pid, flush=True); time.sleep(60)"
    )
    monkeypatch.setattr(gpu_check, "TERM_GRACE_S", 2.0)
    outcome = gpu_check.run_command(("-c", code), timeout_s=3.0)
    assert outcome.returncode is None and outcome.seconds < 30
    assert _gone(int(outcome.stdout.strip()))


def test_make_gpu_check_runs_the_script_in_the_test_venv_and_the_docs_show_it():
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    assert "gpu-check" in phony and "make gpu-check" in makefile.split("\n\n", 1)[0]
    recipe = re.search(r"^gpu-check: (.*)\n\t(.*)", makefile, re.M)
    assert recipe.group(1) == "$(VENV)/.gpu"
    assert recipe.group(2).startswith("$(RUN) scripts/gpu_check.py ")
    page = (REPO / "docs" / "gpu.md").read_text()
    section = page.split("## On a GPU: `make gpu-check`", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    assert block.strip() == "make gpu-check"
    ignored = (REPO / ".gitignore").read_text().split()
    assert {"gpu-check-report.md", "gpu-check-report.json"} <= set(ignored)


def test_run_command_notes_and_kills_what_a_finished_child_left_running():
    code = (
        "import subprocess, sys; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(g.pid, flush=True)"
    )
    outcome = gpu_check.run_command(("-c", code), timeout_s=30.0)
    assert outcome.returncode == 0 and outcome.left_running
    assert _gone(int(outcome.stdout.strip()))
    clean = gpu_check.run_command(("-c", "print('done')"), timeout_s=30.0)
    assert (clean.returncode, clean.stdout, clean.left_running) == (0, "done\n", False)


def test_a_smoke_on_the_cpu_is_not_graded():
    import torch

    bench_gpu = _load("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert bench_gpu.grade(2.0, cpu) is None and bench_gpu.grade(0.1, cpu) is None
    assert bench_gpu.grade(bench_gpu.TARGET_RATIO, gpu) is True
    assert bench_gpu.grade(bench_gpu.TARGET_RATIO - 0.01, gpu) is False
    assert bench_gpu.GRADES[None].startswith("not graded")
