"""A corrupt image in an ImageFolder, end to end: the run stops naming it, or ``--skip-bad-samples``
replaces it, counts it in the summary, and a killed run still resumes bit-identical."""

from __future__ import annotations

import json
import os

import pytest

from bundle.launch.localworld import free_port
from tests.integration.test_resume import assert_identical, losses
from tests.support.processes import finish, start

pytestmark = pytest.mark.slow

# 8 training samples (the corrupt one is index 3: class0 sorts 0.png, 1.png, 2.png, bad.jpg), in
# batches of 4: 2 steps an epoch, so 6 steps draw it 3 times; the validation set (5 samples, one
# corrupt) is evaluated after every epoch, 3 times. The loader worker makes the replacements in
# another process than the one that counts them.
STEPS = 6
RUN = [
    "--model", "mlp", "--image-size", "8", "--batch-size", "4", "--itr", str(STEPS),
    "--workers", "1", "--log-every", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    for split, count in (("train", 4), ("val", 2)):
        for c, color in enumerate(((200, 30, 30), (30, 30, 200))):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(count - (c == 0 and split == "train")):
                Image.new("RGB", (10 + i, 9), color).save(d / f"{i}.png")
    (root / "train" / "class0" / "bad.jpg").write_bytes(b"\x00garbage, no JPEG" * 8)
    (root / "val" / "class1" / "bad.jpg").write_bytes(b"\xff\xd8 truncated")
    return root


def run(folder, out, *extra, env=None):
    return finish(
        start(
            "main.py",
            str(folder),
            *RUN,
            *extra,
            "--checkpoint",
            str(out / "final.pt"),
            "--metrics-out",
            str(out / "m.jsonl"),
            "--portNum",
            str(free_port()),
            env={**os.environ, **(env or {})},
        )
    )


def summary(out) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_a_corrupt_image_stops_the_run_naming_its_path_and_index(folder, tmp_path):
    code, _, err = run(folder, tmp_path)
    bad = folder / "train" / "class0" / "bad.jpg"
    assert code != 0, err
    failed = [line for line in err.splitlines() if "job failed:" in line]
    assert len(failed) == 1, err
    assert "failed at data loading (step " in failed[0], err
    assert f"DataError: train sample 3 ({bad}) cannot be read: UnidentifiedImageError" in failed[0]
    assert "--skip-bad-samples" in failed[0] and "Traceback" not in err, err


@pytest.fixture(scope="module")
def skipping(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    code, stdout, err = run(folder, out, "--skip-bad-samples", "--save-dir", str(out / "ckpt"))
    assert code == 0, err
    return out, summary(stdout), err


def test_skip_bad_samples_replaces_them_counts_them_and_names_each_once(folder, skipping):
    out, s, err = skipping
    assert s["replaced_samples"] == 3 + 3, s  # 3 epochs of training, 3 evaluations
    record = json.loads((out / "m.jsonl").read_text().splitlines()[-1])
    assert record["summary"] and record["replaced_samples"] == 6
    # train: class0 is 0..3 (bad.jpg last), class1 4..7; val: class0 0..1, class1 2..4.
    for split, cls, index, stand_in in (("train", 0, 3, 0), ("val", 1, 4, 2)):
        bad = folder / split / f"class{cls}" / "bad.jpg"
        named = [line for line in err.splitlines() if f"{split} sample {index} ({bad})" in line]
        assert len(named) == 1, err
        assert f"; {split} sample {stand_in} (" in named[0], named[0]
        assert named[0].endswith("stands in for it (--skip-bad-samples)"), named[0]


def test_skip_bad_samples_resumes_bit_identical_after_a_kill(folder, skipping, tmp_path):
    out, _, _ = skipping
    code, stdout, err = run(
        folder,
        tmp_path,
        "--skip-bad-samples",
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--save-every",
        "2",
        "--max-restarts",
        "1",
        env={"BUNDLE_FAULT": "0:4"},  # rank 0, the one that reads images, dies as step 4 begins
    )
    assert code == 0, err
    assert "killed by SIGKILL during step 4" in err and "restart 1 of 1" in err, err
    s = summary(stdout)
    assert s["attempt"] == 1 and s["start_step"] == 2, s
    # The count is this attempt's: steps 3..6 draw the bad sample twice, and evaluate twice.
    assert s["replaced_samples"] == 4, s
    assert_identical(out / "final.pt", tmp_path / "final.pt")
    assert losses(tmp_path / "m.jsonl") == losses(out / "m.jsonl")
