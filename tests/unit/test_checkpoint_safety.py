"""Checkpoints are data: a planted index, a rewritten bundle.json or a half-done re-save never runs
code or loses a step; files are written as the user's umask says."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import index
from bundle.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def write(save_dir, step: int, value: float | None = None) -> str:
    tmp = ckpt.step_dir(str(save_dir), step) + ".tmp"
    os.makedirs(tmp)
    state = {"model.fc.weight": torch.full((2, 3), float(step if value is None else value))}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    final = ckpt.step_dir(str(save_dir), step)
    ckpt.publish(tmp, final, {"step": step, "model": "net", "format": ckpt.FORMAT})
    return final


def rerecord(path: str, **changes) -> None:
    """What someone who can write the directory can do: any file, with a record to match."""
    info = {**ckpt.read_info(path), **changes}
    info["files"] = ckpt.file_records(path)
    info["digest"] = ckpt._info_digest(info)
    with open(os.path.join(path, ckpt.INFO), "w") as f:
        json.dump(info, f)


def _index_of(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # written by this test: trusted here


def _plant(path: str, meta) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    rerecord(path)


def global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of ``module.name(arg)``: ``name`` may be dotted (resolved through
    attributes by the standard unpickler)."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + struct.pack("<B", len(raw)) + raw  # SHORT_BINUNICODE

    return (
        b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85" + b"R" + b"."
    )  # PROTO 4, STACK_GLOBAL, TUPLE1, REDUCE, STOP


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),  # a dotted name
        ("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),  # under the prefix
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    ],
    ids=["dotted", "dcp-function", "dotted-allowed-class"],
)
def test_a_planted_index_runs_nothing_and_its_step_is_passed_over(tmp_path, module, name):
    whole = write(tmp_path, 1)
    planted = tmp_path / "step-99"
    planted.mkdir()
    marker = tmp_path / "owned"
    (planted / ".metadata").write_bytes(global_call(module, name, f"touch {marker}"))
    (planted / ckpt.INFO).write_text(json.dumps({"step": 99, "model": "net"}))
    path, notes = ckpt.resolve("auto", str(tmp_path))
    assert path == whole and not marker.exists()
    assert notes == [
        f"skipping damaged checkpoint {planted} (.metadata: UnpicklingError: "
        f"{module}.{name} is not allowed in a checkpoint index)"
    ]
    with pytest.raises(CheckpointError, match="is not allowed in a checkpoint index"):
        ckpt.weights(str(planted))
    assert not marker.exists()


def test_the_payload_is_real_the_standard_unpickler_runs_the_dotted_name():
    payload = global_call("torch.distributed.checkpoint.filesystem", "os.path.basename", "a/b")
    assert pickle.loads(payload) == "b"  # os.path.basename, reached through the DCP module
    with pytest.raises(pickle.UnpicklingError, match="os.path.basename is not allowed"):
        index._IndexUnpickler(io.BytesIO(payload)).load()


def test_an_index_with_a_bytes_entry_or_a_path_outside_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = write(tmp_path, 1)
    meta = _index_of(path)
    meta.state_dict_metadata["model.fc.weight"] = BytesStorageMetadata()
    _plant(path, meta)
    assert "BytesStorageMetadata is not allowed" in ckpt.damage(path)

    other = write(tmp_path, 2)
    meta = _index_of(other)
    for info in meta.storage_data.values():
        info.relative_path = "../step-1/__0_0.distcp"
    _plant(other, meta)
    assert "names a file outside the checkpoint ('../step-1/__0_0.distcp')" in ckpt.damage(other)


def test_a_rewritten_bundle_json_is_damage_and_a_whole_one_reads(tmp_path):
    path = write(tmp_path, 1)
    assert ckpt.damage(path) is None
    info = ckpt.read_info(path)
    assert info["digest"].startswith("sha256:") and info["format"] == ckpt.FORMAT
    info.update(model="os:system", model_args="command='touch x'")
    with open(os.path.join(path, ckpt.INFO), "w") as f:
        json.dump(info, f)
    assert ckpt.damage(path) == "bundle.json does not match its digest"
    assert ckpt.resolve("auto", str(tmp_path))[0] is None


def test_a_file_the_index_reads_must_be_one_the_record_lists(tmp_path):
    path = write(tmp_path, 1)
    info = ckpt.read_info(path)
    del info["files"]["__0_0.distcp"]
    info["digest"] = ckpt._info_digest(info)
    with open(os.path.join(path, ckpt.INFO), "w") as f:
        json.dump(info, f)
    assert ckpt.damage(path) == "its index reads __0_0.distcp, which bundle.json does not list"


def test_a_checkpoint_of_the_format_before_digests_still_reads(tmp_path):
    path = write(tmp_path, 1)
    info = ckpt.read_info(path)
    del info["digest"]
    info["format"] = 1
    with open(os.path.join(path, ckpt.INFO), "w") as f:
        json.dump(info, f)
    assert ckpt.damage(path) is None
    assert torch.equal(ckpt.weights(path)["fc.weight"], torch.full((2, 3), 1.0))


def _killed_at(monkeypatch, failing_call: int):
    """os.replace inside publish that dies (as a kill would) at its ``failing_call``-th call."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == failing_call:
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)


@pytest.mark.parametrize("killed_at", [2, 3], ids=["old-moved-aside", "before-new-renamed"])
def test_a_re_save_killed_halfway_loses_neither_copy(tmp_path, monkeypatch, killed_at):
    write(tmp_path, 3, value=1.0)  # the step as first written
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    dcp.save({"model.fc.weight": torch.full((2, 3), 2.0)},
             storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)  # fmt: skip
    # publish's renames: bundle.json in place (1), step-3 aside (2), step-3.tmp in (3)
    _killed_at(monkeypatch, killed_at)
    with pytest.raises(KeyboardInterrupt):
        ckpt.publish(str(tmp), str(tmp_path / "step-3"), {"step": 3, "model": "net", "format": 2})
    monkeypatch.undo()
    notes = ckpt.recover(str(tmp_path))  # the next job's first process
    ckpt.prune(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-3"]
    assert "step-3.tmp was whole: it is step-3" in notes
    path, _ = ckpt.resolve("auto", str(tmp_path))
    assert torch.equal(ckpt.weights(path)["fc.weight"], torch.full((2, 3), 2.0))  # the newer one


def test_a_copy_moved_aside_comes_back_when_the_new_one_is_not_whole(tmp_path):
    write(tmp_path, 3, value=1.0)
    os.replace(tmp_path / "step-3", tmp_path / "step-3.old")
    (tmp_path / "step-3.tmp").mkdir()  # the new one, half written
    notes = ckpt.recover(str(tmp_path))
    assert notes == [
        "removed step-3.tmp (left by an interrupted save)",
        "step-3.old was whole: it is step-3",
    ]
    assert torch.equal(ckpt.weights(str(tmp_path / "step-3"))["fc.weight"], torch.ones(2, 3))


def test_re_saving_a_step_replaces_it_and_leaves_nothing_aside(tmp_path):
    write(tmp_path, 3, value=1.0)
    os.rename(tmp_path / "step-3", tmp_path / "keep")
    write(tmp_path, 3, value=2.0)
    os.rename(tmp_path / "keep", tmp_path / "step-3.tmp")  # publish again over step-3
    ckpt.publish(str(tmp_path / "step-3.tmp"), str(tmp_path / "step-3"), {"step": 3, "model": "n"})
    assert sorted(os.listdir(tmp_path)) == ["step-3"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_are_written_as_the_umask_says(tmp_path, umask):
    old = os.umask(umask)
    try:
        ckpt.save(str(tmp_path / "w.pt"), {"fc.weight": torch.zeros(1)})
        path = write(tmp_path, 1)
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert os.stat(tmp_path / "w.pt").st_mode & 0o777 == want
    assert os.stat(os.path.join(path, ckpt.INFO)).st_mode & 0o777 == want


def test_the_allow_list_is_exact_names_without_dots():
    assert all("." not in name and not module.endswith(".") for module, name in index.ALLOWED)


def test_a_run_resumes_from_the_step_a_killed_rename_left_aside(tmp_path, monkeypatch):
    """The job's first process puts the step right before the checkpoint is chosen."""
    from bundle import cli, preflight
    from bundle.launch import supervisor

    save_dir = tmp_path / "ckpt"
    argv = ["--model", "mlp", "--save-dir", str(save_dir), "--resume", "auto", "--itr", "1"]
    cfg = cli.parse(argv, {})
    shapes, _ = preflight.check_model(cfg, 2)
    tmp = save_dir / "step-3.tmp"
    tmp.mkdir(parents=True)
    state = {f"model.{k}": torch.zeros(shape) for k, shape in shapes.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    ckpt.publish(str(tmp), str(save_dir / "step-3"), {"step": 3, "model": "mlp", "format": 2})
    os.replace(save_dir / "step-3", tmp)  # killed before its rename: only step-3.tmp is whole
    started: list[str | None] = []
    monkeypatch.setattr(
        supervisor, "supervise", lambda cfg, topo, resume, cap: started.append(resume) or 0
    )
    assert cli.main(argv) == 0
    assert started == [str(save_dir / "step-3")] and sorted(os.listdir(save_dir)) == [
        ".bundle.lock",
        "step-3",
    ]
