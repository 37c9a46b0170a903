"""Exact resume end to end: a killed worker, a restart, a SIGTERM, torchrun's restarts, two nodes.

Every run here is compared with the same run uninterrupted: the final ``--checkpoint`` must be
bit-identical (``torch.equal``), and the loss of every step the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bundle import cli, generate
from bundle.checkpoint import format as ckpt
from bundle.launch.localworld import free_port
from bundle.lr_schedule import LRSchedule
from tests.support.forked_main import run_mains
from tests.support.processes import SMALL, finish, image_folder, start, start_logged

pytestmark = pytest.mark.slow

STEPS = 10
# A recipe whose rate changes every step: 4 warm-up steps (16 steps per epoch), then cosine.
RECIPE = ["--lr-schedule", "cosine", "--warmup-epochs", "0.25", "--nesterov"]
RECIPE += ["--label-smoothing", "0.1"]
# shape 1,2: the rear stage has two replicas, so their agreement check and DCP's de-duplication
# of replicated entries are both exercised.
RUN = [*SMALL, "--bundle-shape", "1,2", "--itr", str(STEPS), "--save-every", "3", *RECIPE]


def records(path, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r and not r.get("summary")}


def losses(path) -> dict[int, float]:
    return records(path, "loss")


def assert_identical(a, b) -> None:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert set(sa) == set(sb)
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"not bit-identical: {different}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = finish(
        start(
            "main.py",
            *RUN,
            "--save-dir",
            str(d / "ckpt"),
            "--checkpoint",
            str(d / "a.pt"),
            "--metrics-out",
            str(d / "m.jsonl"),
            "--portNum",
            str(free_port()),
        )
    )
    assert code == 0, err
    return d


@pytest.mark.parametrize(
    "saving",
    [[], ["--async-save"], ["--backend", "nccl-emu"]],
    ids=["sync", "async", "sync-nccl-emu"],
)
def test_a_killed_worker_restarts_from_the_checkpoint_bit_identical(
    uninterrupted, tmp_path, saving
):
    t0 = time.monotonic()
    code, out, err = finish(
        start(
            "main.py",
            *RUN,
            *saving,
            "--save-dir",
            str(tmp_path / "ckpt"),
            "--max-restarts",
            "1",
            "--checkpoint",
            str(tmp_path / "b.pt"),
            "--metrics-out",
            str(tmp_path / "m.jsonl"),
            "--portNum",
            str(free_port()),
            env={**os.environ, "BUNDLE_FAULT": "1:7"},
        )
    )
    assert code == 0, err
    assert "killed by SIGKILL during step 7" in err and "restart 1 of 1" in err, err
    summary = json.loads(out.strip().splitlines()[-1])
    # An asynchronous step-6 may still have been in flight when the worker died: then step-3.
    resumed_at = (3, 6) if "--async-save" in saving else (6,)
    assert summary["attempt"] == 1 and summary["start_step"] in resumed_at, summary
    assert summary["lost_steps"] == 6 - summary["start_step"], summary  # steps 1..6 committed
    assert f"resumed from {tmp_path / 'ckpt'}/step-{summary['start_step']}" in err, err
    assert_identical(uninterrupted / "a.pt", tmp_path / "b.pt")
    assert losses(tmp_path / "m.jsonl") == losses(uninterrupted / "m.jsonl")
    # Both ran every step at its scheduled rate, the resumed one from where it stopped.
    schedule = LRSchedule.of(cli.parse(RUN, {}).train, steps_per_epoch=16, total=STEPS)
    assert schedule.warmup == 4 and len({schedule.at(t) for t in range(STEPS)}) == STEPS
    expected = {t + 1: schedule.at(t) for t in range(STEPS)}
    assert (
        records(tmp_path / "m.jsonl", "lr") == records(uninterrupted / "m.jsonl", "lr") == expected
    )
    print(f"\nkill-and-recover run: {time.monotonic() - t0:.1f}s")


def stop_during_training(sig, tmp_path, *args, to_group=False) -> tuple[int, str]:
    """Start a long run, send ``sig`` once its first checkpoint exists; its exit code and stderr."""
    save_dir, log = tmp_path / "ckpt", tmp_path / "err.log"
    p = start_logged(log, "main.py", *args, "--itr", "1000000", "--save-dir", str(save_dir))
    try:
        deadline = time.monotonic() + 120
        while not any(save_dir.glob("step-*")):  # a checkpoint exists: training is under way
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        (os.killpg if to_group else os.kill)(p.pid, sig)
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = log.read_text()
    assert "Traceback" not in err, err
    return code, err


def test_sigterm_saves_exits_143_and_resumes_bit_identical(tmp_path):
    long_run = [*SMALL, "--bundle-shape", "1,2", "--save-every", "5", "--portNum", str(free_port())]
    code, err = stop_during_training(signal.SIGTERM, tmp_path, *long_run)
    assert code == 143, err
    line = [ln for ln in err.splitlines() if ln.startswith("stopped by SIGTERM after step")]
    assert len(line) == 1, err
    stopped_at = int(line[0].split("after step ")[1].split(";")[0])
    path = tmp_path / "ckpt" / f"step-{stopped_at}"
    assert f"checkpoint {path}; resume with: python main.py" in line[0]
    assert line[0].endswith("--resume auto") and (path / ".metadata").exists()
    # Resume to a few steps past the stop; the same run uninterrupted must end identical.
    total = str(stopped_at + 4)
    for name, extra in (("resumed", ["--resume", "auto"]), ("straight", [])):
        save_dir = tmp_path / ("ckpt" if extra else "other")
        code, _, err = finish(
            start(
                "main.py",
                *long_run,
                "--itr",
                total,
                "--save-dir",
                str(save_dir),
                "--checkpoint",
                str(tmp_path / f"{name}.pt"),
                *extra,
            )
        )
        assert code == 0, err
        assert f"resumed from {path}" in err or not extra, err
    assert_identical(tmp_path / "straight.pt", tmp_path / "resumed.pt")


def test_sigint_to_the_process_group_stops_with_130(tmp_path):
    """Ctrl-C reaches the supervisor and every worker at once: still one stop, one checkpoint."""
    args = [*SMALL, "--save-every", "5", "--portNum", str(free_port())]
    code, err = stop_during_training(signal.SIGINT, tmp_path, *args, to_group=True)
    assert code == 130 and "stopped by SIGINT after step" in err, err
    from bundle.checkpoint import format as ckpt

    newest, skipped = ckpt.latest(str(tmp_path / "ckpt"))
    assert newest is not None and not skipped
    assert f"checkpoint {newest};" in err


def test_torchrun_restarts_resume_bit_identical(uninterrupted, tmp_path):
    code, _, err = finish(
        start(
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "main.py",
            *RUN,
            "--save-dir",
            str(tmp_path / "ckpt"),
            "--resume",
            "auto",
            "--checkpoint",
            str(tmp_path / "t.pt"),
            env={**os.environ, "BUNDLE_FAULT": "2:5"},
        ),
        timeout=240,
    )
    assert code == 0, err
    assert "resumed from" in err, err
    assert_identical(uninterrupted / "a.pt", tmp_path / "t.pt")


def test_two_nodes_on_loopback_recover_from_a_killed_worker_on_node_1(tmp_path):
    port = str(free_port())
    two = [*SMALL, "--bundle-shape", "1,1", "--num-bundle", "2", "--itr", "8", "--save-every", "2"]
    ref = start("main.py", *two, "--checkpoint", str(tmp_path / "ref.pt"), "--portNum", port)
    code, _, err = finish(ref)
    assert code == 0, err
    common = [
        "main.py",
        *two,
        "--world-size",
        "2",
        "--IP",
        "127.0.0.1",
        "--portNum",
        str(free_port()),
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--max-restarts",
        "1",
    ]
    env = {**os.environ, "BUNDLE_FAULT": "3:5"}  # rank 3 lives on node 1
    node1 = start(*common, "--rank", "1", env=env)
    node0 = start(*common, "--rank", "0", "--checkpoint", str(tmp_path / "b.pt"), env=env)
    (c0, _, e0), (c1, _, e1) = finish(node0, 240), finish(node1, 240)
    assert (c0, c1) == (0, 0), e0 + e1
    assert "restart 1 of 1" in e0 and "restart 1 of 1" in e1, e0 + e1
    assert_identical(tmp_path / "ref.pt", tmp_path / "b.pt")


def test_incomplete_newest_is_skipped_and_another_model_is_refused(uninterrupted, tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "ckpt", save_dir)
    newest = max(save_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    damaged = save_dir / f"step-{int(newest.name.split('-')[1]) + 5}"
    shutil.copytree(newest, damaged)
    (damaged / ".metadata").unlink()  # as if killed before DCP wrote its index
    from bundle import preflight

    cfg = cli.parse([*RUN, "--save-dir", str(save_dir), "--resume", "auto"], env={})
    shapes, _ = preflight.check_model(cfg, 2)
    assert preflight.check_resume(cfg, shapes, attempt=0) == str(newest)
    # Another precision resumes, and says so.
    bf16 = cli.parse([*RUN, "--save-dir", str(save_dir), "--precision", "bf16"], env={})
    capsys.readouterr()
    preflight.check_resume(replace(bf16, checkpoint=cfg.checkpoint), shapes, attempt=0)
    assert "resuming with --precision bf16 (the checkpoint was written with fp32)" in (
        capsys.readouterr().err
    )
    # Refused before anything starts, in one line: another model, then another head size.
    refusals = {
        "is of model 'mlp', not 'skip_mlp'": ["--model", "skip_mlp"],
        "in the checkpoint but [7,": ["--num-classes", "7"],
    }
    runs = run_mains(
        [
            [*RUN, *extra, "--save-dir", str(save_dir), "--resume", "auto"]
            for extra in refusals.values()
        ]
    )
    for words, run in zip(refusals, runs, strict=True):
        code, err = run["code"], run["stderr"]
        assert code == 2 and words in err, err
        assert len(err.strip().splitlines()) == 2 and "skipping damaged" in err, err


def test_imagefolder_resnet_with_batchnorm_replicas_and_loader_workers_resumes_exactly(tmp_path):
    """Random crops (seeded per sample), BatchNorm statistics that differ between the two rear
    replicas, loader workers and evaluation, in bf16 with recompute and channels-last: a restarted
    run still ends bit-identical, with the same validation accuracy. (The fp16 loss scale's save
    and restore is tested in test_precision: on two-row BatchNorm batches fp16 skips every step.)"""
    image_folder(tmp_path / "data")
    run = [
        "main.py", str(tmp_path / "data"),
        "--model", "resnet18", "--partition", "resnet18_2stage", "--image-size", "32",
        "--bundle-shape", "1,2", "--batch-size", "8", "--micro-batches", "2", "--workers", "1",
        "--itr", "6", "--save-every", "2",
        "--precision", "bf16", "--recompute", "always", "--channels-last",
    ]  # fmt: skip
    outs = {}
    for name, env in (("straight", {}), ("restarted", {"BUNDLE_FAULT": "2:4"})):
        code, out, err = finish(
            start(
                *run,
                "--save-dir",
                str(tmp_path / name),
                "--max-restarts",
                "1",
                "--checkpoint",
                str(tmp_path / f"{name}.pt"),
                "--metrics-out",
                str(tmp_path / f"{name}.jsonl"),
                "--portNum",
                str(free_port()),
                env={**os.environ, **env},
            ),
            timeout=300,
        )
        assert code == 0, err
        # The metrics file's summary: its figures in full (the printed line has 4 digits).
        outs[name] = json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1])
    assert outs["restarted"]["attempt"] == 1
    assert outs["restarted"]["val_accuracy"] == outs["straight"]["val_accuracy"]
    assert outs["restarted"]["final_loss"] == outs["straight"]["final_loss"]
    assert_identical(tmp_path / "straight.pt", tmp_path / "restarted.pt")
    # The last checkpoints agree entry by entry: momentum, and each rear replica's own statistics.
    straight, restarted = everything(tmp_path / "straight"), everything(tmp_path / "restarted")
    assert set(straight) == set(restarted)
    assert any(k.startswith("replica.2.") and "running_mean" in k for k in straight), straight
    assert any(k.startswith("optim.") for k in straight)
    assert not [k for k in straight if not torch.equal(straight[k], restarted[k])]


def everything(save_dir) -> dict[str, torch.Tensor]:
    """Every entry of the newest checkpoint in ``save_dir``, read in this one process."""
    import torch.distributed.checkpoint as dcp

    newest, _ = ckpt.latest(str(save_dir))
    state = {k: torch.empty(s, dtype=d) for k, (s, d) in ckpt.entries(newest).items()}
    with warnings.catch_warnings():  # read in this one process on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=ckpt.safe_reader(newest), no_dist=True)
    return state


LANGUAGE_MODELS = {
    "gpt": ["--model", "gpt", "--model-args", "layers=2,width=16,heads=2"],
    # Hugging Face GPT-2 by reference: its embedding tied to its head across the two stages;
    # zero-bubble's split backward (the rear's two replicas synced through the weight halves).
    "hf-gpt2-tied": [
        "--model", "transformers:GPT2LMHeadModel", "--model-args",
        "n_layer=2,n_embd=16,n_head=2,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
        "--schedule", "zb-h1",
    ],
    # Interleaved: each stage runs two model chunks (4 pieces), the rear's two replicas synced
    # per chunk; the checkpoint holds each rank's chunks under the full model's names.
    "gpt-interleaved": [
        "--model", "gpt", "--model-args", "layers=2,width=16,heads=2",
        "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("model", sorted(LANGUAGE_MODELS))
def test_a_language_model_with_adamw_and_a_cosine_schedule_resumes_bit_identical(
    model, tmp_path, capsys
):
    """A language model with AdamW: a worker killed mid-run, the job restarted from the newest
    checkpoint, lands bit for bit where the uninterrupted run lands: parameters, Adam's moments
    and step counts (of both rear replicas), every step's loss. Text sampled from its newest
    checkpoint is the same under the same seed."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text() * 2)
    run = [
        "main.py", *LANGUAGE_MODELS[model],
        "--dataset", "text", "--data-file", str(corpus), "--seq-len", "16",
        "--batch-size", "12", "--micro-batches", "3", "--bundle-shape", "1,2", "--itr", "8",
        "--save-every", "3", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1",
        "--no-decay-norm-bias", "--lr-schedule", "cosine", "--warmup-epochs", "0.01",
        "--log-every", "1",
    ]  # fmt: skip
    for name, fault in (("straight", None), ("restarted", "2:5")):
        env = {**os.environ, **({"BUNDLE_FAULT": fault} if fault else {})}
        code, _, err = finish(
            start(
                *run, "--save-dir", str(tmp_path / name), "--max-restarts", "1",
                "--checkpoint", str(tmp_path / f"{name}.pt"),
                "--metrics-out", str(tmp_path / f"{name}.jsonl"),
                "--portNum", str(free_port()), env=env,
            ),
            timeout=300,
        )  # fmt: skip
        assert code == 0, err
        if fault:
            assert "killed by SIGKILL during step 5" in err and "resumed from" in err, err
    assert_identical(tmp_path / "straight.pt", tmp_path / "restarted.pt")
    assert losses(tmp_path / "restarted.jsonl") == losses(tmp_path / "straight.jsonl")
    straight, restarted = everything(tmp_path / "straight"), everything(tmp_path / "restarted")
    adam = [k for k in straight if k.endswith((".exp_avg", ".exp_avg_sq", ".step"))]
    assert any(k.endswith(".exp_avg_sq") for k in adam) and any(k.endswith(".step") for k in adam)
    assert set(straight) == set(restarted)
    assert not [k for k in straight if not torch.equal(straight[k], restarted[k])]
    newest, _ = ckpt.latest(str(tmp_path / "restarted"))
    argv = [str(newest), "--prompt", "import ", "--max-new-tokens", "12", "--seed", "3"]
    capsys.readouterr()
    texts = [(generate.main(argv), capsys.readouterr().out) for _ in range(2)]
    assert texts[0] == texts[1] and texts[0][0] == 0 and texts[0][1].startswith("import "), texts


FORMAT1 = Path(__file__).resolve().parents[1] / "support" / "format1"


def test_a_checkpoint_written_before_bundle_json_had_its_digest_resumes_bit_identical(tmp_path):
    """tests/support/format1: step 6 of a run and its uninterrupted end, both written by the
    release before this format; today's code resumes the one and ends on the other."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(FORMAT1 / "step-6", save_dir / "step-6")
    assert ckpt.read_info(str(save_dir / "step-6"))["format"] == 1
    run = [("skip_mlp" if a == "mlp" else a) for a in RUN]
    code, _, err = finish(
        start(
            "main.py",
            *run,
            "--save-dir",
            str(save_dir),
            "--resume",
            "auto",
            "--checkpoint",
            str(tmp_path / "b.pt"),
            "--portNum",
            str(free_port()),
        )
    )
    assert code == 0 and "resumed from" in err and "(step 6)" in err, err
    # Bit-identical on the CPU that wrote the files; another CPU's kernels round the last bit of
    # the same steps differently (an uninterrupted run on an AMD EPYC differs from final.pt by up
    # to 3e-8, as this resume does), while a piece of state lost on resume (momentum, the
    # schedule's position, the data order) moves weights by far more than 1e-6.
    a, b = (torch.load(p, weights_only=True) for p in (FORMAT1 / "final.pt", tmp_path / "b.pt"))
    assert set(a) == set(b)
    far = {
        k: (a[k] - b[k]).abs().max().item() for k in a if not torch.allclose(a[k], b[k], 0, 1e-6)
    }
    assert not far, f"not the uninterrupted run's weights: {far}"
    newest = ckpt.read_info(str(save_dir / "step-10"))
    assert newest["format"] == ckpt.FORMAT and ckpt.damage(str(save_dir / "step-10")) is None
