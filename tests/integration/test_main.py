"""main.py as a process: bad input is one line and exit 2 before any process starts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_main(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "main.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield str(s.getsockname()[1])


ZOO = ["--model", "mobilenet_v3_small", "--dataset", "synthetic", "--image-size", "32"]
BAD = {
    "shape zero": (["--bundle-shape", "0,1"], "--bundle-shape"),
    "shape letters": (["--bundle-shape", "a,b"], "--bundle-shape"),
    "shape empty": (["--bundle-shape", ""], "--bundle-shape"),
    "more processes than devices": (["--backend", "nccl"], "--nproc-per-node"),
    "batch too small": (["--bundle-shape", "4,2", "--batch-size", "3"], "--batch-size"),
    "unknown model": (["--model", "resnet9000"], "--model"),
    "unknown partition": (["--partition", "nope"], "--partition"),
    "partition for another model": (["--partition", "mlp_2stage"], "mlp"),
    "missing data dir": (["/nonexistent/data"], "does not exist"),
    "rank beyond world": (["--rank", "2", "--world-size", "2"], "--rank"),
    "bad schedule": (["--schedule", "zigzag"], "--schedule"),
    "bad precision": (["--precision", "fp8"], "--precision"),
    "channels-last on an MLP": (["--model", "mlp", "--channels-last"], "--channels-last"),
    "unimportable factory": (["--model", "no_such_pkg_xyz:build"], "cannot import"),
    "factory returns no module": (
        ["--model", "tests.support.user_models:not_a_model"],
        "not an nn.Module",
    ),
    "split point that does not exist": (
        [*ZOO, "--partition", "features.99"],
        "unknown split point 'features.99': no such module",
    ),
    "split point inside a whole module": (
        [*ZOO, "--partition", "features.0.1"],
        "runs inside 'features.0', which runs whole",
    ),
    "a forward of two inputs": (
        ["--model", "tests.support.user_models:two_inputs"],
        "its forward must take one input (its other arguments need defaults), not 2 (x, y)",
    ),
    "text without a file": (["--dataset", "text"], "--data-file"),
    "a language model on images": (["--model", "gpt"], "takes token ids"),
    "traced steps beyond the run": (
        ["--itr", "3", "--trace", "t.json", "--trace-steps", "3:4"],
        "--trace-steps",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(name):
    args, needle = BAD[name]
    r = run_main(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert lines[0].startswith("main.py: error:")
    assert "started ranks" not in r.stderr


@pytest.mark.slow
def test_empty_data_dir_is_exit_2(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    r = run_main(str(tmp_path))
    assert r.returncode == 2 and "missing or empty" in r.stderr


@pytest.mark.slow
def test_port_in_use_is_exit_2(busy_port):
    r = run_main("--portNum", busy_port)
    assert r.returncode == 2, r.stderr
    assert f"--portNum {busy_port}" in r.stderr and "in use" in r.stderr


@pytest.mark.slow
def test_weights_that_do_not_fit_and_an_empty_text_file_are_exit_2(tmp_path):
    import torch

    torch.save({"fc.weight": torch.zeros(3, 3)}, tmp_path / "w.pt")
    r = run_main("--model", "mlp", "--weights", str(tmp_path / "w.pt"))
    assert r.returncode == 2 and "--weights" in r.stderr and "does not fit the model" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "empty.txt").write_text("")
    r = run_main("--model", "gpt", "--dataset", "text", "--data-file", str(tmp_path / "empty.txt"))
    assert r.returncode == 2 and "holds 0 bytes" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
