"""End-to-end runs of main.py as users start it: default, two nodes, torchrun, DP-only, failures."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bundle import models
from bundle.engine.stage import split_model
from bundle.launch.localworld import free_port
from bundle.models import partition
from tests.support.processes import SMALL, finish, image_folder, runtime_only, start, start_logged

pytestmark = pytest.mark.slow


def two_nodes_on_loopback(port: str) -> list[str]:
    """main.py and the original launch flags shared by both nodes (each adds its --rank)."""
    return ["main.py", *SMALL, "--world-size", "2", "--IP", "127.0.0.1", "--portNum", port]


def summary(path) -> dict:
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert lines[-1]["summary"] is True
    return lines[-1]


def test_embedded_default_trains_digits_to_90_percent(tmp_path):
    """With only what requirements.txt installs importable, as on a new user's machine."""
    metrics = tmp_path / "m.jsonl"
    t0 = time.monotonic()
    code, out, err = finish(start("main.py", "--metrics-out", str(metrics), env=runtime_only()))
    assert code == 0, err
    s = summary(metrics)
    assert s["val_accuracy"] >= 0.90, s
    assert (
        s["steps"] > 0 and s["samples_per_s"] > 0 and s["shape"] == [1, 1] and s["world_size"] == 2
    )
    assert "validation accuracy" in err and "loss" in err  # progress is visible
    # The reporting process (the rear stage) holds SGD's momentum: one float32 per parameter.
    model = models.build("digits_cnn", num_classes=10, input_shape=(1, 8, 8))
    stages = split_model(model, partition.resolve(None, models.blocks(model), 2, "digits_cnn"))
    held = [4 * sum(p.numel() for p in stage.parameters()) for stage in stages]
    assert s["optimizer_bytes"] == s["param_bytes"] == s["grad_bytes"] == held[1]
    # The largest over both processes: the stages hold different parameters.
    assert held[0] != held[1]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert s[f"most_{key}"] == max(held), key
    # The printed summary: the record's keys but the per-stage breakdown, to 4 significant digits.
    printed = json.loads(out.strip().splitlines()[-1])
    assert set(printed) == set(s) - {"breakdown"}
    assert printed["val_accuracy"] == float(f"{s['val_accuracy']:.4g}")
    assert printed["steps"] == s["steps"] and printed["shape"] == s["shape"]
    assert time.monotonic() - t0 < 150


def test_nccl_emu_trains_and_evaluates_the_default_job_as_gloo_does(tmp_path):
    """The default job (digits, 1,1) with evaluation, a short run under each backend: the same
    loss and accuracy, since the emulation changes when messages move, never what they carry."""
    runs = {}
    for backend in ("gloo", "nccl-emu"):
        metrics = tmp_path / f"{backend}.jsonl"
        argv = ["--itr", "30", "--micro-batches", "3", "--backend", backend]
        code, _, err = finish(start("main.py", *argv, "--metrics-out", str(metrics)))
        assert code == 0, err
        runs[backend] = summary(metrics)
    gloo, emu = runs["gloo"], runs["nccl-emu"]
    assert gloo["val_samples"] > 0
    assert (emu["final_loss"], emu["val_accuracy"]) == (gloo["final_loss"], gloo["val_accuracy"])


def test_two_nodes_from_the_original_flags(tmp_path):
    port = str(free_port())
    common = [
        *two_nodes_on_loopback(port),
        "--itr",
        "4",
        "--bundle-shape",
        "1,1",
        "--num-bundle",
        "2",
    ]
    node1 = start(*common, "--rank", "1")
    node0 = start(*common, "--rank", "0", "--metrics-out", str(tmp_path / "m.jsonl"))
    (c0, _, e0), (c1, _, e1) = finish(node0), finish(node1)
    assert c0 == 0 and c1 == 0, e0 + e1
    s = summary(tmp_path / "m.jsonl")
    assert (s["world_size"], s["num_bundles"], s["steps"]) == (4, 2, 4)
    assert "started ranks 2..3" in e1


def test_torchrun_launch(tmp_path):
    code, _, err = finish(
        start(
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "main.py",
            *SMALL,
            "--itr",
            "3",
            "--bundle-shape",
            "2,1",
            "--precision",
            "fp16",
            "--recompute",
            "except-last",
            "--micro-batches",
            "2",
            "--metrics-out",
            str(tmp_path / "m.jsonl"),
        )
    )
    assert code == 0, err
    s = summary(tmp_path / "m.jsonl")
    assert (s["world_size"], s["shape"]) == (3, [2, 1])
    assert (s["precision"], s["recompute"], s["skipped_steps"]) == ("fp16", "except-last", 0)


def test_dp_only(tmp_path):
    """Also: the speed and memory options from a YAML file."""
    config = tmp_path / "run.yaml"
    config.write_text("precision: bf16\nchannels-last: true\nrecompute: always\n")
    code, _, err = finish(
        start(
            "main.py",
            "--DP-ONLY",
            "--epochs",
            "2",
            "--config",
            str(config),
            "--metrics-out",
            str(tmp_path / "m.jsonl"),
        )
    )
    assert code == 0, err
    s = summary(tmp_path / "m.jsonl")
    assert s["shape"] == [2] and s["val_accuracy"] > 0.5
    assert (s["precision"], s["channels_last"], s["recompute"]) == ("bf16", True, "always")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "sig,backend",
    [(signal.SIGKILL, "gloo"), (signal.SIGSTOP, "gloo"), (signal.SIGSTOP, "nccl-emu")],
    ids=["killed", "stalled", "stalled-nccl-emu"],
)
def test_a_dead_or_stalled_worker_ends_the_job_with_a_clear_error(sig, backend, tmp_path):
    metrics, log = tmp_path / "m.jsonl", tmp_path / "err.log"
    p = start_logged(
        log,
        "main.py",
        *SMALL,
        "--backend",
        backend,
        "--itr",
        "100000",
        "--bundle-shape",
        "1,2",
        "--timeout",
        "5",
        "--portNum",
        str(free_port()),
        "--metrics-out",
        str(metrics),
    )
    try:
        _wait_for(lambda: "(pids " in log.read_text(), 120, "the workers to start")
        workers = [int(x) for x in log.read_text().split("(pids ")[1].split(")")[0].split(", ")]
        assert len(workers) == 3
        _wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 180, "training"
        )
        t0 = time.monotonic()
        os.kill(workers[2], sig)  # rank 2: replica 1 of the rear stage
        code = p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = log.read_text()
    assert code != 0
    assert took < 30, f"took {took:.0f}s to stop"
    assert "job failed" in err and "rank 2 (" in err and "stage 1, replica 1" in err, err
    if sig == signal.SIGKILL:
        assert "SIGKILL" in err and "during step" in err, err
        assert "stopping rank 0" in err  # the survivors say why they stop
    else:  # named by its supervisor before a peer's timeout blames whoever waited first
        assert "stopped responding: no sign of life for" in err, err
        assert "its process is stopped (SIGSTOP or Ctrl-Z)" in err, err
    assert not [w for w in workers if _alive(w)], "orphan worker processes"


def test_nodes_with_different_settings_are_told_which(tmp_path):
    port = str(free_port())
    common = [*two_nodes_on_loopback(port), "--itr", "2"]
    node1 = start(*common, "--rank", "1", "--lr", "0.2")
    node0 = start(*common, "--rank", "0")
    (c0, _, e0), (c1, _, e1) = finish(node0, 120), finish(node1, 120)
    assert c0 == 2 and c1 == 2, e0 + e1
    for err in (e0, e1):
        assert "different settings" in err and "train.lr" in err, err
    assert "started ranks" not in e0 + e1


def test_image_folder_resnet_with_a_partition_loader_workers_and_checkpoint(tmp_path):
    image_folder(tmp_path / "data")
    ckpt, metrics = tmp_path / "model.pt", tmp_path / "m.jsonl"
    code, _, err = finish(
        start(
            "main.py",
            str(tmp_path / "data"),
            "--model",
            "resnet18",
            "--partition",
            "resnet18_2stage",
            "--image-size",
            "32",
            "--batch-size",
            "8",
            "--micro-batches",
            "2",
            "--epochs",
            "1",
            "--workers",
            "1",
            "--checkpoint",
            str(ckpt),
            "--metrics-out",
            str(metrics),
        ),
        timeout=240,
    )
    assert code == 0, err
    s = summary(metrics)
    assert s["steps"] == 4 and s["val_samples"] == 12 and 0.0 <= s["val_accuracy"] <= 1.0
    import torch

    from bundle import models

    state = torch.load(ckpt, weights_only=True)
    expected = models.build("resnet18", num_classes=3, input_shape=(3, 32, 32)).state_dict()
    assert set(state) == set(expected)


USER_MODEL = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, channels):
        super().__init__()
        self.stem = nn.Conv2d(channels, 8, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        s = torch.relu(self.stem(x))
        return self.head((self.body(s) + s).mean(dim=(2, 3)))


def build(num_classes, input_shape):
    return Net(num_classes, input_shape[0])
"""


def test_a_users_factory_a_zoo_model_a_language_model_and_the_example_train(tmp_path):
    (tmp_path / "mynet.py").write_text(USER_MODEL)
    image = ["--dataset", "synthetic", "--image-size", "16", "--synthetic-size", "128"]
    image += ["--batch-size", "16", "--micro-batches", "2", "--itr", "3"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(json.__file__).read_text() + "\n") * 3)
    runs = {
        "factory": ["--model", f"{tmp_path}/mynet.py:build", "--partition", "body", *image],
        "zoo": ["--model", "mobilenet_v3_small", "--image-size", "32", *image[:2], *image[4:]],
        "gpt": [
            "--model", "gpt", "--model-args", "layers=2,width=32,heads=2", "--dataset", "text",
            "--data-file", str(corpus), "--seq-len", "16", "--batch-size", "8", "--itr", "4",
            "--micro-batches", "2", "--optimizer", "adamw", "--lr", "0.003",
            "--save-dir", str(tmp_path / "gpt-ckpt"),
        ],
    }  # fmt: skip
    procs = {}
    for name, args in runs.items():
        m = tmp_path / f"{name}.jsonl"
        code, _, err = finish(
            start("main.py", *args, "--bundle-shape", "2,1", "--metrics-out", str(m),
                  "--portNum", str(free_port()))
        )  # fmt: skip
        assert code == 0, f"{name}: {err[-3000:]}"
        procs[name] = summary(m)
    assert procs["gpt"]["val_perplexity"] > 1 and procs["gpt"]["val_accuracy"] is not None
    # gpt's first stage (the embedding and a layer) holds more than the reporting last one: the
    # summary's largest are another process's.
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert procs["gpt"][f"most_{key}"] > procs["gpt"][key] > 0, key
    assert procs["zoo"]["model"] == "mobilenet_v3_small" and procs["factory"]["steps"] == 3
    # After training: the run resumed at its last step still reports its validation, and an
    # evaluation-only run of the checkpoint (two batches of it) reports loss and perplexity.
    for name, extra in (("again", []), ("eval-only", ["--eval-only", "--val-batches", "1"])):
        m = tmp_path / f"{name}.jsonl"
        code, _, err = finish(
            start("main.py", *runs["gpt"], "--bundle-shape", "2,1", "--metrics-out", str(m),
                  "--resume", "auto", *extra, "--portNum", str(free_port()))
        )  # fmt: skip
        assert code == 0, f"{name}: {err[-3000:]}"
        procs[name] = summary(m)
    assert procs["again"]["val_loss"] == procs["gpt"]["val_loss"], procs["again"]
    only = procs["eval-only"]
    assert only["val_perplexity"] > 1 and 0 < only["val_samples"] < procs["gpt"]["val_samples"]
    code, out, err = finish(
        start("examples/custom_model.py", "--steps", "4", "--port", str(free_port()))
    )
    assert code == 0 and "validation accuracy" in out, err[-3000:]
