"""Checkpoint files without processes: which step-N is complete, pruning, the safe index reader,
fit checks, export, the fault hook, the stop line, and path checks before start."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bundle import cli
from bundle.checkpoint import final as final_weights
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.__main__ import export
from bundle.checkpoint.__main__ import main as export_command
from bundle.errors import CheckpointError, ConfigError
from bundle.runtime.preemption import parse_fault, parse_heal_fault, resume_command, stop_line

# The files are written and read in this one process on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def write(save_dir, step: int, state: dict | None = None, *, complete: bool = True) -> str:
    """A step-N directory as the engine writes it (one process, no process group)."""
    state = state or {"model.fc.weight": torch.full((2, 3), float(step))}
    tmp = ckpt.step_dir(str(save_dir), step) + ".tmp"
    os.makedirs(tmp)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    final = ckpt.step_dir(str(save_dir), step)
    ckpt.publish(tmp, final, {"step": step, "model": "net"})
    if not complete:
        os.unlink(os.path.join(final, ".metadata"))
    return final


def test_latest_skips_incomplete_and_orders_steps_numerically(tmp_path):
    write(tmp_path, 9)
    newest = write(tmp_path, 10)
    damaged = write(tmp_path, 12, complete=False)
    (tmp_path / "step-13.tmp").mkdir()  # a save killed mid-write
    (tmp_path / "notes").mkdir()
    assert ckpt.latest(str(tmp_path)) == (
        newest,
        [f"skipping damaged checkpoint {damaged} (no .metadata)"],
    )
    path, notes = ckpt.resolve("auto", str(tmp_path))
    assert path == newest and notes == [f"skipping damaged checkpoint {damaged} (no .metadata)"]


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _garbage(path: str) -> None:
    with open(path, "w") as f:
        f.write("{ not json")


@pytest.mark.parametrize(
    "file,harm,why",
    [
        ("__0_0.distcp", _truncate, r"__0_0.distcp is \d+ bytes, \d+ when written"),
        ("__0_0.distcp", _flip_a_byte, "__0_0.distcp does not match its checksum"),
        (".metadata", _truncate, r".metadata is \d+ bytes, \d+ when written"),
        ("bundle.json", _garbage, "cannot read bundle.json"),
        ("__0_0.distcp", os.unlink, "__0_0.distcp: No such file or directory"),
    ],
    ids=["truncated-shard", "flipped-byte", "truncated-index", "garbage-info", "missing-shard"],
)
def test_a_damaged_checkpoint_is_passed_over_by_auto_and_refused_by_name(tmp_path, file, harm, why):
    whole = write(tmp_path, 4)
    damaged = write(tmp_path, 6)
    assert ckpt.damage(whole) is None and ckpt.damage(damaged) is None
    harm(os.path.join(damaged, file))
    assert re.search(why, ckpt.damage(damaged)), ckpt.damage(damaged)
    path, notes = ckpt.resolve("auto", str(tmp_path))
    assert (
        path == whole
        and len(notes) == 1
        and notes[0].startswith(f"skipping damaged checkpoint {damaged} (")
    )
    with pytest.raises(CheckpointError, match=f"--resume {damaged}: damaged checkpoint") as err:
        ckpt.resolve(damaged, None)
    assert "\n" not in str(err.value) and re.search(why, str(err.value))


def test_a_checkpoint_records_the_size_and_checksum_of_every_file(tmp_path):
    path = write(tmp_path, 3)
    files = ckpt.read_info(path)["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    with open(os.path.join(path, "__0_0.distcp"), "rb") as f:
        assert files["__0_0.distcp"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert ckpt.size_of(path) == sum(r["bytes"] for r in files.values()) + os.path.getsize(
        os.path.join(path, "bundle.json")
    )


def test_a_checkpoint_without_recorded_checksums_still_reads(tmp_path):
    """Written before checksums were recorded: trusted if its index and settings read."""
    path = write(tmp_path, 3)
    info = ckpt.read_info(path)
    del info["files"]
    with open(os.path.join(path, "bundle.json"), "w") as f:
        json.dump(info, f)
    assert ckpt.damage(path) is None
    _truncate(os.path.join(path, ".metadata"))
    assert ckpt.damage(path).startswith(".metadata: ")


def test_debris_of_an_interrupted_save_is_cleared(tmp_path):
    kept = write(tmp_path, 2)
    (tmp_path / "step-3.tmp").mkdir()
    (tmp_path / "step-3.tmp" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".ckpt-abc").write_bytes(b"half")
    assert sorted(ckpt.recover(str(tmp_path))) == [
        "removed .ckpt-abc (left by an interrupted save)",
        "removed step-3.tmp (left by an interrupted save)",
    ]
    assert sorted(os.listdir(tmp_path)) == ["step-2"] and ckpt.damage(kept) is None


def test_auto_without_checkpoints_starts_fresh_and_says_so(tmp_path):
    assert ckpt.resolve("auto", str(tmp_path / "none")) == (
        None,
        [f"no complete checkpoint in {tmp_path / 'none'}: starting from step 0"],
    )
    assert ckpt.resolve(None, None) == (None, [])


def test_an_explicit_incomplete_checkpoint_is_refused(tmp_path):
    damaged = write(tmp_path, 4, complete=False)
    with pytest.raises(CheckpointError, match="damaged checkpoint \\(no .metadata\\)"):
        ckpt.resolve(damaged, None)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        ckpt.resolve(str(tmp_path / "step-99"), None)


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (2, 4, 6, 8, 10):
        write(tmp_path, step)
    write(tmp_path, 12, complete=False)
    (tmp_path / "step-14.tmp").mkdir()
    ckpt.prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-8"]


def test_publishing_a_step_again_replaces_it(tmp_path):
    write(tmp_path, 3)
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    dcp.save(
        {"model.fc.weight": torch.ones(2, 3)},
        storage_writer=dcp.FileSystemWriter(str(tmp)),
        no_dist=True,
    )
    ckpt.publish(str(tmp), str(tmp_path / "step-3"), {"step": 3, "model": "net"})
    out = tmp_path / "w.pt"
    export(str(tmp_path / "step-3"), str(out))
    assert torch.equal(torch.load(out, weights_only=True)["fc.weight"], torch.ones(2, 3))


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_the_index_is_read_without_unpickling_code(tmp_path):
    path = write(tmp_path, 1)
    assert ckpt.entries(path) == {"model.fc.weight": ((2, 3), torch.float32)}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Boom(), f)
    with pytest.raises(CheckpointError, match="posix.system is not allowed"):
        ckpt.entries(path)


def test_check_fits_names_what_differs(tmp_path):
    path = write(tmp_path, 5)
    assert ckpt.check_fits(path, "net", {"fc.weight": (2, 3)})["step"] == 5
    with pytest.raises(CheckpointError, match="of model 'net', not 'other'"):
        ckpt.check_fits(path, "other", {"fc.weight": (2, 3)})
    with pytest.raises(
        CheckpointError, match=r"fc.weight is \[2, 3\] in the checkpoint but \[4, 3\]"
    ):
        ckpt.check_fits(path, "net", {"fc.weight": (4, 3)})
    with pytest.raises(CheckpointError, match="no entry for fc.bias"):
        ckpt.check_fits(path, "net", {"fc.weight": (2, 3), "fc.bias": (2,)})


def test_export_writes_the_model_entries_by_their_names(tmp_path):
    state = {
        "model.fc.weight": torch.randn(2, 3),
        "model.bn.running_mean": torch.randn(3),
        "optim.fc.weight.momentum_buffer": torch.randn(2, 3),
        "replica.3.bn.running_mean": torch.randn(3),
    }
    path = write(tmp_path, 7, {k: v.clone() for k, v in state.items()})
    out = tmp_path / "model.pt"
    export(path, str(out))
    got = torch.load(out, weights_only=True)
    assert set(got) == {"fc.weight", "bn.running_mean"}
    assert torch.equal(got["fc.weight"], state["model.fc.weight"])
    assert json.loads((tmp_path / "step-7" / "bundle.json").read_text())["step"] == 7


def test_the_export_command_says_in_one_line_what_it_wrote(tmp_path, capsys):
    state = {"model.fc.weight": torch.randn(2, 3), "model.fc.bias": torch.randn(2)}
    path = write(tmp_path, 4, {**state, "optim.fc.weight.momentum_buffer": torch.randn(2, 3)})
    out = tmp_path / "model.pt"
    assert export_command(["export", path, str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    size = out.stat().st_size
    assert (
        captured.out == f"wrote {out}: 2 tensors, {size / 1024:.1f} KiB (the weights of {path})\n"
    )
    assert set(torch.load(out, weights_only=True)) == {"fc.weight", "fc.bias"}


def test_the_export_command_refuses_a_missing_or_damaged_checkpoint_in_one_line(tmp_path, capsys):
    damaged = write(tmp_path, 5, complete=False)
    out = tmp_path / "model.pt"
    for path, why in (
        (str(tmp_path / "step-9"), "no such checkpoint directory"),
        (damaged, "no .metadata"),
    ):
        assert export_command(["export", path, str(out)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert captured.out == "" and len(lines) == 1, captured
        assert lines[0] == f"python -m bundle.checkpoint: error: {path}: {why}; nothing exported"
    assert not out.exists()
    assert export_command(["export", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m bundle.checkpoint export")


def test_the_final_export_gathers_on_the_group_it_is_given(tmp_path, monkeypatch):
    """The --checkpoint export gathers on the group passed (the gloo control group), never on
    the default group, which is NCCL's on GPUs."""
    from bundle.topology import Topology

    class Stage(torch.nn.Module):
        def full_state_dict(self):
            return {"fc.weight": torch.ones(2, 3)}

    calls = []

    def gather_object(obj, parts, dst=0, group=None):
        calls.append((dst, group))
        parts[0] = obj

    control = object()
    monkeypatch.setattr(final_weights.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(final_weights.dist, "gather_object", gather_object)
    topo = Topology(shape=(1,), num_bundles=1, procs_per_node=1, global_batch=2, micro_batches=1)
    out = tmp_path / "model.pt"
    final_weights.save_distributed(str(out), Stage(), topo, topo.coord(0), group=control)
    assert calls == [(0, control)]
    assert torch.equal(torch.load(out, weights_only=True)["fc.weight"], torch.ones(2, 3))


def test_fault_hook_is_checked_before_start():
    assert parse_fault({}) is None
    assert parse_fault({"BUNDLE_FAULT": "1:7"}) == (1, 7, signal.SIGKILL)
    assert parse_fault({"BUNDLE_FAULT": "3:4:stop"}) == (3, 4, signal.SIGSTOP)
    for bad in ("1", "a:2", "1:0", "1:2:3", "1:2:hang"):
        with pytest.raises(ConfigError, match="BUNDLE_FAULT"):
            parse_fault({"BUNDLE_FAULT": bad})
    assert parse_heal_fault({}) is None
    assert parse_heal_fault({"BUNDLE_HEAL_FAULT": "3:1"}) == (3, 1)
    for bad in ("3", "3:0", "x:1"):
        with pytest.raises(ConfigError, match="BUNDLE_HEAL_FAULT"):
            parse_heal_fault({"BUNDLE_HEAL_FAULT": bad})


def test_stop_line_names_the_checkpoint_and_the_resume_command():
    argv = ["--itr", "100", "--resume", "d/step-3", "--save-dir", "my dir", "--resume=auto"]
    assert resume_command(argv, "python") == (
        "python main.py --itr 100 --save-dir 'my dir' --resume auto"
    )
    line = stop_line(15, 42, "d/step-42", argv, "python")
    assert line.startswith("stopped by SIGTERM after step 42; checkpoint d/step-42; resume with: ")
    assert "\n" not in line
    assert "no checkpoint written" in stop_line(2, 5, None, argv, "python")


@pytest.mark.parametrize("flag", ["--save-dir", "--checkpoint", "--metrics-out"])
def test_unwritable_paths_are_exit_2_before_start(tmp_path, flag, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = str(blocker / "sub") if flag == "--save-dir" else str(blocker / "sub" / "out")
    assert cli.main([flag, path, "--itr", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "writable directory" in err, err


def test_resume_auto_needs_a_save_dir():
    with pytest.raises(ConfigError, match="--resume"):
        cli.parse(["--resume", "auto"], env={})


def test_max_restarts_under_torchrun_points_to_torchrun():
    env = {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(ConfigError, match="torchrun --max-restarts N"):
        cli.parse(["--max-restarts", "1"], env=env)


def test_a_failed_write_is_named_by_its_cause():
    """What a full disk looks like from DCP (its exception wraps each rank's) and from the zip
    writer of torch.save (a short write) both read as "no space left on device"."""
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-6.tmp/__1_0.distcp")
    wrapped = CheckpointException("save failed", {1: (full, None)})
    assert ckpt.cause_of(wrapped) == "no space left on device (/ckpt/step-6.tmp/__1_0.distcp)"
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert ckpt.cause_of(short) == "no space left on device (a write stopped short)"
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/ckpt/step-6.tmp")
        except OSError as exc:
            raise RuntimeError("writer failed") from exc
    except RuntimeError as outer:
        assert ckpt.cause_of(outer) == "permission denied (/ckpt/step-6.tmp)"
    assert ckpt.cause_of(ValueError("odd\nsecond line")) == "ValueError: odd"


def test_the_final_weights_on_a_full_disk_are_one_line_and_no_debris(tmp_path, monkeypatch):
    def full(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(str(tmp_path / "model.pt"), {"w": torch.zeros(2)})
    assert str(err.value) == (
        f"cannot write {tmp_path / 'model.pt'}: no space left on device (a write stopped short)"
    )
    assert os.listdir(tmp_path) == []
