"""Checkpoints: the final weights as one state dict, and resumable ``step-N`` directories (DCP).

A resumable checkpoint is the directory ``SAVE_DIR/step-N`` (N = training steps done)::

    step-N/
      __R_0.distcp     what global rank R wrote (torch.distributed.checkpoint, every rank at once)
      .metadata        DCP's index of every entry, written last
      bundle.json      the step, the settings of the run that wrote it, and the size and SHA-256
                       of every other file (``files``)

It is written as ``step-N.tmp`` and renamed when all three are there. A checkpoint is trusted only
once verified (``damage``): ``.metadata`` and ``bundle.json`` present and readable, every file
``bundle.json`` lists there with its size and checksum. ``--resume auto`` passes over a damaged one
to the newest whole one; naming a damaged one is refused. Entries are keyed by
full-model names, so any shape, partition or node count reads them (DCP hands every rank the keys
its stage asks for, from whichever files hold them):

    model.<name>              parameters (replicas agree, DCP keeps one copy) and the buffers of
                              the canonical replica (bundle 0, replica 0 of each stage)
    optim.<name>.<state>      optimizer state, e.g. ``optim.fc.weight.momentum_buffer``
    replica.<rank>.<name>     the buffers of every other replica (BatchNorm statistics differ
                              between replicas); read back only under the same layout

``python -m bundle.checkpoint export SAVE_DIR/step-N model.pt`` writes the ``--checkpoint`` format.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from bundle.config import RunConfig
from bundle.errors import CheckpointError
from bundle.partition import Stage
from bundle.topology import Coord, Topology

INFO = "bundle.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def save(path: str, state: dict[str, torch.Tensor]) -> None:
    """Write to a temporary file beside ``path`` and rename, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, Exception):
            raise CheckpointError(f"cannot write {path}: {cause_of(exc)}") from exc
        raise


def cause_of(exc: BaseException) -> str:
    """The root of a failed write in a few words: ``no space left on device`` rather than DCP's
    wrapper or the zip writer's ``unexpected pos`` (what a full disk looks like to torch.save)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            where = f" ({seen.filename})" if seen.filename else ""
            return f"{os.strerror(seen.errno).lower()}{where}"
        failures = getattr(seen, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                return cause_of(inner)
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().splitlines()
    if "unexpected pos" in str(exc) or "file write failed" in str(exc):
        return f"{os.strerror(errno.ENOSPC).lower()} (a write stopped short)"
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def load(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _unwrap(stage: nn.Module) -> Stage:
    return cast(Stage, getattr(stage, "module", stage))  # a stage, or DDP around one


def save_distributed(
    path: str, stage: nn.Module, topo: Topology, coord: Coord, *, group: dist.ProcessGroup
) -> None:
    """Bundle 0's stage masters send their stage to rank 0, which writes the whole model.

    ``group`` spans the job on gloo (the control group): on the default group of an NCCL job,
    gather_object would pickle through CUDA tensors on the training communicator.
    """
    mine = None
    if coord.bundle == 0 and coord.replica == 0:
        mine = {k: v.detach().cpu() for k, v in _unwrap(stage).full_state_dict().items()}
    parts: list | None = [None] * topo.world_size if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if parts is not None:
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            if part:
                state.update(part)
        save(path, state)


# -- step-N directories --------------------------------------------------------------------------


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step-{step}")


def is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in (".metadata", INFO))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(path: str) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file in checkpoint directory ``path`` but ``bundle.json``."""
    return {
        entry.name: {"bytes": entry.stat().st_size, "sha256": _sha256(entry.path)}
        for entry in sorted(os.scandir(path), key=lambda e: e.name)
        if entry.is_file() and entry.name != INFO and not entry.name.startswith(".info-")
    }


def damage(path: str) -> str | None:
    """Why checkpoint ``path`` cannot be trusted (None: whole): a file missing, unreadable, of
    another size or checksum than ``bundle.json`` records. Reads every file once."""
    for name in (".metadata", INFO):
        if not os.path.isfile(os.path.join(path, name)):
            return f"no {name}"
    try:
        info = read_info(path)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{path}: ")
    recorded = info.get("files")
    if not isinstance(recorded, dict):
        if "files" in info:
            return f"{INFO} lists no files"
        recorded = {}  # written before checksums were recorded: the index must still read
    for name, want in sorted(recorded.items()):
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
            if size != want.get("bytes"):
                return f"{name} is {size} bytes, {want.get('bytes')} when written"
            if _sha256(file) != want.get("sha256"):
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
    try:
        entries(path)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{path}/")
    return None


def checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Every ``step-N`` directory in ``save_dir`` (complete or not), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for entry in os.scandir(save_dir):
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry.path))
    return sorted(found)


def latest(save_dir: str) -> tuple[str | None, list[str]]:
    """The newest whole checkpoint, and a note for each newer one passed over (and why)."""
    skipped: list[str] = []
    for _step, path in reversed(checkpoints(save_dir)):
        why = damage(path)
        if why is None:
            return path, skipped
        skipped.append(f"skipping damaged checkpoint {path} ({why})")
    return None, skipped


def resolve(resume: str | None, save_dir: str | None) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from (None: start fresh) and warnings to show."""
    if resume is None:
        return None, []
    if resume == "auto":
        path, notes = latest(save_dir or "")
        if path is None:
            notes.append(f"no complete checkpoint in {save_dir}: starting from step 0")
        return path, notes
    if not os.path.isdir(resume):
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    why = damage(resume)
    if why is not None:
        raise CheckpointError(f"--resume {resume}: damaged checkpoint ({why}); not loaded")
    return resume, []


def size_of(path: str) -> int:
    """Bytes of the files in checkpoint directory ``path``."""
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def clean_debris(save_dir: str) -> list[str]:
    """Remove what an interrupted save left (``step-N.tmp``, half-written weights files); only
    the holder of the directory's lock may, since a running save writes exactly these."""
    removed: list[str] = []
    if not os.path.isdir(save_dir):
        return removed
    for entry in os.scandir(save_dir):
        if entry.name.startswith("step-") and entry.name.endswith(".tmp"):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
        elif entry.name.startswith(".ckpt-") and entry.is_file():
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed


def prune(save_dir: str, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; drop older ones and leftovers of crashes.

    Called between saves (which are collective), so no ``step-N.tmp`` is being written.
    """
    found = checkpoints(save_dir)
    kept = [p for _s, p in found if is_complete(p)][-keep:]
    for _step, path in found:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for entry in os.scandir(save_dir):
        if entry.name.startswith("step-") and entry.name.endswith(".tmp"):
            shutil.rmtree(entry.path, ignore_errors=True)


def publish(tmp: str, final: str, info: dict, files: dict | None = None) -> None:
    """Rank 0, once DCP has written ``tmp``: add ``bundle.json`` with the size and checksum of
    every file (``files``, or read now) and rename ``tmp`` to ``final``."""
    info = {**info, "files": files if files is not None else file_records(tmp)}
    fd, part = tempfile.mkstemp(prefix=".info-", dir=tmp)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(part, 0o644)
    os.replace(part, os.path.join(tmp, INFO))
    if os.path.exists(final):  # the same step written again after a restart
        shutil.rmtree(final)
    os.replace(tmp, final)


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """The training settings a checkpoint records of the run that wrote it: those RunConfig marks
    recorded (the model, data, batch, optimizer, learning-rate schedule and compute policy)."""
    return cfg.run_settings()


def read_info(path: str) -> dict:
    try:
        with open(os.path.join(path, INFO)) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read {INFO} ({exc})") from exc
    if not isinstance(info, dict) or not isinstance(info.get("step"), int):
        raise CheckpointError(f"{path}: cannot read {INFO} (no step recorded)")
    return info


# -- reading DCP metadata without unpickling arbitrary code ---------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its index; accept only the classes such an index is made of."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
            ("collections", "OrderedDict"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),  # a layout by name
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
        ):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def safe_reader(path: str) -> Any:
    """DCP's file reader of checkpoint ``path``, its index read by an unpickler that admits
    only what an index holds (``_MetadataUnpickler``)."""
    return _safe_reader_class()(path)


@functools.cache
def _safe_reader_class() -> type:
    # torch.distributed.checkpoint is imported when a checkpoint is first read or written:
    # with DTensor it is a second of every process's start-up.
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                try:
                    meta = _MetadataUnpickler(f).load()
                except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle raises
                    raise CheckpointError(
                        f"{self.path}/.metadata: {type(exc).__name__}: {exc}"
                    ) from exc
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = dcp.metadata.StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader


def entries(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor entry of a checkpoint: key -> (shape, dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = safe_reader(path).read_metadata()
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def check_fits(path: str, model_name: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Refuse, before anything starts, a checkpoint of another model or with entries that do not fit."""
    info = read_info(path)
    if info.get("model") != model_name:
        raise CheckpointError(
            f"--resume {path}: the checkpoint is of model {info.get('model')!r}, not {model_name!r}"
        )
    stored = entries(path)
    for name, shape in shapes.items():
        got = stored.get(f"model.{name}")
        if got is None:
            raise CheckpointError(f"--resume {path}: the checkpoint has no entry for {name}")
        if got[0] != tuple(shape):
            raise CheckpointError(
                f"--resume {path}: {name} is {list(got[0])} in the checkpoint but {list(shape)} "
                "in this model (another --num-classes, --image-size or dataset?)"
            )
    return info


# -- export ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the file, how many tensors it holds, its size in bytes."""

    out: str
    tensors: int
    bytes: int


def weights(path: str) -> dict[str, torch.Tensor]:
    """The model's weights in checkpoint ``path``, by full-model name, once it is verified."""
    why = damage(path) if os.path.isdir(path) else "no such checkpoint directory"
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    want = {
        k: torch.empty(shape, dtype=dtype)
        for k, (shape, dtype) in entries(path).items()
        if k.startswith("model.")
    }
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process on purpose: no "assuming single process" note
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(want, storage_reader=safe_reader(path), no_dist=True)
    return {k.removeprefix("model."): v for k, v in want.items()}


def export(path: str, out: str) -> Exported:
    """Write the canonical weights of checkpoint ``path`` as one ``--checkpoint``-format file,
    once the checkpoint is verified (``damage``); what it wrote."""
    try:
        state = weights(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    save(out, state)
    return Exported(out, len(state), os.path.getsize(out))
