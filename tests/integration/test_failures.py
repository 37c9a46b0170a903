"""When the state around a run goes wrong: a damaged newest checkpoint, a full disk, two jobs on
one save directory, a job that died holding it. main.py runs as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from bundle.checkpoint import format as ckpt
from bundle.checkpoint.__main__ import export
from bundle.checkpoint.lock import NAME
from bundle.launch.localworld import free_port
from tests.integration.test_resume import assert_identical
from tests.support.forked_main import run_mains
from tests.support.processes import SMALL, finish, start

pytestmark = pytest.mark.slow

# shape 1,2: three ranks write shards, two of them replicas of one stage.
RUN = [*SMALL, "--bundle-shape", "1,2", "--itr", "6", "--save-every", "3"]


def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


DAMAGE = {
    "truncated shard": ("__0_0.distcp", _truncate),
    "truncated index": (".metadata", _truncate),
    "garbage bundle.json": ("bundle.json", lambda p: p.write_text("\x00garbage")),
}


def test_a_damaged_newest_checkpoint_is_passed_over_and_the_run_ends_bit_identical(tmp_path):
    code, _, err = finish(
        start(
            "main.py",
            *RUN,
            "--save-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint",
            str(tmp_path / "a.pt"),
            "--portNum",
            str(free_port()),
        )
    )
    assert code == 0, err
    for i, (_, (file, harm)) in enumerate(DAMAGE.items()):
        save_dir = tmp_path / f"damaged-{i}"
        shutil.copytree(tmp_path / "ckpt", save_dir)
        harm(save_dir / "step-6" / file)
    # Named directly: refused before anything starts, in one line naming the file.
    named = [tmp_path / f"damaged-{i}" / "step-6" for i in range(len(DAMAGE))]
    refused = run_mains([[*RUN, "--resume", str(step), "--portNum", "1"] for step in named])
    for i, (kind, (file, _)) in enumerate(DAMAGE.items()):
        save_dir = tmp_path / f"damaged-{i}"
        code, err = refused[i]["code"], refused[i]["stderr"]
        assert code == 2 and len(err.strip().splitlines()) == 1, (kind, err)
        assert f"--resume {save_dir / 'step-6'}: damaged checkpoint (" in err, (kind, err)
        assert (file if file != "__0_0.distcp" else "__0_0.distcp is") in err, (kind, err)
    # auto: step-6 is passed over, saying why; the run from step-3 ends where the first did.
    code, _, err = finish(
        start(
            "main.py",
            *RUN,
            "--save-dir",
            str(tmp_path / "damaged-0"),
            "--resume",
            "auto",
            "--checkpoint",
            str(tmp_path / "b.pt"),
            "--portNum",
            str(free_port()),
        )
    )
    assert code == 0, err
    skipped = tmp_path / "damaged-0" / "step-6"
    assert f"skipping damaged checkpoint {skipped} (__0_0.distcp is " in err, err
    assert f"resumed from {tmp_path / 'damaged-0' / 'step-3'} (step 3)" in err, err
    assert_identical(tmp_path / "a.pt", tmp_path / "b.pt")


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs with room for one small checkpoint's files, not two (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    # Inodes, not bytes, run out: the size check before a save passes and a write itself fails.
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=9", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_ends_the_job_in_one_line_and_keeps_the_checkpoint_before(small_disk):
    save_dir = small_disk / "ckpt"
    run = [*SMALL, "--itr", "3", "--save-every", "1", "--save-dir", str(save_dir)]
    code, _, err = finish(start("main.py", *run, "--portNum", str(free_port())))
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith("[node 0] job failed: ")
        and (f"CheckpointError: cannot save {save_dir / 'step-2'}: no space left on device (")
        in last
    ), err
    assert last.endswith("earlier checkpoints untouched"), last
    assert sorted(os.listdir(save_dir)) == [NAME, "step-1"]  # no step-2.tmp left behind
    assert ckpt.damage(str(save_dir / "step-1")) is None
    export(str(save_dir / "step-1"), str(small_disk.parent / "step-1.pt"))


def _holder(save_dir, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads((save_dir / NAME).read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise AssertionError(f"no lock in {save_dir} after {timeout}s")


def test_a_second_job_on_one_save_dir_is_refused_and_a_dead_jobs_lock_taken_over(tmp_path):
    save_dir = tmp_path / "ckpt"
    run = [*SMALL, "--itr", "1000", "--save-every", "500", "--save-dir", str(save_dir)]
    first = start("main.py", *run, "--portNum", str(free_port()))
    try:
        holder = _holder(save_dir)
        assert holder["pid"] == first.pid
        code, _, err = finish(start("main.py", *run, "--portNum", str(free_port())), 60)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--save-dir {save_dir} is in use by another job (host {holder['host']}, " in err
        assert f"pid {first.pid}, started {holder['started']})" in err, err
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the first job dies holding the directory
        first.wait(30)
    (save_dir / "step-7.tmp").mkdir()  # and a save of it was cut short
    short = [*SMALL, "--itr", "2", "--save-dir", str(save_dir), "--portNum", str(free_port())]
    code, _, err = finish(start("main.py", *short))
    assert code == 0, err
    assert f"took over {save_dir / NAME} from a job that is gone (host {holder['host']}, " in err
    assert "removed step-7.tmp (left by an interrupted save)" in err, err
    assert not (save_dir / "step-7.tmp").exists()
