"""main.py as a process: bad input is one line and exit 2 before any process starts.

Each command line runs in a process of its own, forked from one interpreter that has imported
what main.py imports (tests/support/forked_main.py): main.py's start is paid once, not per case."""

from __future__ import annotations

import socket

import pytest

from tests.support.forked_main import run_mains

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


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield str(s.getsockname()[1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An empty data directory, weights that fit no model, an empty text file."""
    import torch

    root = tmp_path_factory.mktemp("main")
    for split in ("train", "val"):
        (root / "empty" / split).mkdir(parents=True)
    torch.save({"fc.weight": torch.zeros(3, 3)}, root / "w.pt")
    (root / "empty.txt").write_text("")
    return root


def _more(files, port) -> dict[str, tuple[list[str], str]]:
    return {
        "an empty data dir": ([str(files / "empty")], "missing or empty"),
        "a port in use": (["--portNum", port], f"--portNum {port}"),
        "weights that do not fit": (
            ["--model", "mlp", "--weights", str(files / "w.pt")],
            "does not fit the model",
        ),
        "an empty text file": (
            ["--model", "gpt", "--dataset", "text", "--data-file", str(files / "empty.txt")],
            "holds 0 bytes",
        ),
    }


MORE = ["an empty data dir", "a port in use", "weights that do not fit", "an empty text file"]


@pytest.fixture(scope="module")
def outcomes(files, busy_port) -> dict[str, tuple[dict, str]]:
    """Every case's run of main.py, and the text its one line must hold."""
    cases = {**BAD, **_more(files, busy_port)}
    runs = run_mains([args for args, _ in cases.values()])
    return {
        name: (run, needle) for (name, (_, needle)), run in zip(cases.items(), runs, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD) + MORE)
def test_bad_input_is_one_line_and_exit_2(name, outcomes):
    r, needle = outcomes[name]
    assert r["code"] == 2, r["stderr"]
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r["stderr"]
    assert lines[0].startswith("main.py: error:")
    assert "started ranks" not in r["stderr"]


@pytest.mark.slow
def test_port_in_use_names_it(outcomes, busy_port):
    r, _ = outcomes["a port in use"]
    assert "in use" in r["stderr"], r["stderr"]


def test_a_case_that_does_not_fail_is_seen_as_such():
    """The forked runs report what main.py did: --help exits 0 with its usage on stdout."""
    (r,) = run_mains([["--help"]])
    assert r["code"] == 0 and "usage: main.py" in r["stdout"], r
