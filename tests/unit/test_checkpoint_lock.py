"""One job per save directory: the lock on ``SAVE_DIR/.bundle.lock``, without processes (a flock
conflicts between two opens of the file, in one process as between two)."""

from __future__ import annotations

import json
import os

import pytest

from bundle.checkpoint.lock import NAME, DirLock, Holder
from bundle.errors import CheckpointError


def test_a_second_job_is_refused_naming_the_holder(tmp_path):
    first = DirLock(str(tmp_path / "ckpt"), "job-a")
    assert first.acquire() is None  # the directory is made for it
    with pytest.raises(CheckpointError) as refused:
        DirLock(str(tmp_path / "ckpt"), "job-b").acquire()
    line = str(refused.value)
    assert "\n" not in line and f"--save-dir {tmp_path / 'ckpt'} is in use by another job" in line
    assert f"pid {os.getpid()}" in line and f"host {first.me.host}" in line
    first.release()
    assert DirLock(str(tmp_path / "ckpt"), "job-b").acquire() is None  # released: no note


def test_the_lock_of_a_job_that_is_gone_is_taken_over_with_a_note(tmp_path):
    gone = Holder("node7", 4242, "2026-01-01 00:00:00 UTC", "job-a")
    (tmp_path / NAME).write_text(json.dumps(gone.__dict__))  # its holder died holding it
    lock = DirLock(str(tmp_path), "job-b")
    note = lock.acquire()
    assert note == (
        f"took over {tmp_path / NAME} from a job that is gone "
        "(host node7, pid 4242, started 2026-01-01 00:00:00 UTC)"
    )
    assert json.loads((tmp_path / NAME).read_text())["job"] == "job-b"


def test_a_restarted_attempt_of_the_same_job_takes_it_back_silently(tmp_path):
    gone = Holder("node0", 1, "2026-01-01 00:00:00 UTC", "torchrun:run-1")
    (tmp_path / NAME).write_text(json.dumps(gone.__dict__))
    assert DirLock(str(tmp_path), "torchrun:run-1").acquire() is None


def test_a_save_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        CheckpointError, match=r"--save-dir .*/file/ckpt: cannot open \.bundle\.lock"
    ):
        DirLock(str(tmp_path / "file" / "ckpt"), "job").acquire()


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / NAME).symlink_to(target)
    with pytest.raises(CheckpointError, match=r"cannot open \.bundle\.lock \(a symbolic link\)"):
        DirLock(str(save_dir), "job").acquire()
    assert target.read_text() == "keep me"


def test_a_save_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    import bundle.checkpoint.lock as lock

    monkeypatch.setattr(lock.os, "geteuid", lambda: os.stat(tmp_path).st_uid + 4242)
    with pytest.raises(CheckpointError, match=r"is owned by uid \d+, not by this user") as err:
        DirLock(str(tmp_path), "job").acquire()
    assert "\n" not in str(err.value) and not (tmp_path / NAME).exists()


@pytest.mark.parametrize("mode,refused", [(0o777, True), (0o1777, False), (0o755, False)])
def test_a_save_dir_anyone_may_write_to_needs_the_sticky_bit(tmp_path, mode, refused):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    save_dir.chmod(mode)
    lock = DirLock(str(save_dir), "job")
    if refused:
        with pytest.raises(CheckpointError, match=r"may be written by any user \(drwxrwxrwx\)"):
            lock.acquire()
    else:
        assert lock.acquire() is None
        lock.release()


def test_a_lock_file_of_another_kind_is_refused(tmp_path):
    (tmp_path / NAME).mkdir()
    with pytest.raises(CheckpointError, match=r"\.bundle\.lock"):
        DirLock(str(tmp_path), "job").acquire()
