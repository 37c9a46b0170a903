"""Checkpoints: the final weights as one state dict, and resumable ``step-N`` directories (DCP).

A resumable checkpoint is the directory ``SAVE_DIR/step-N`` (N = training steps done)::

    step-N/
      __R_0.distcp     what global rank R wrote (torch.distributed.checkpoint, every rank at once)
      .metadata        DCP's index of every entry, written last
      bundle.json      the step and the settings of the run that wrote it

It is written as ``step-N.tmp`` and renamed when all three are there, so a ``step-N`` without
``.metadata`` or ``bundle.json`` was damaged after the fact and is skipped. Entries are keyed by
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

import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
    except BaseException:
        os.unlink(tmp)
        raise


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
    """The newest complete checkpoint, and the newer incomplete ones passed over."""
    skipped: list[str] = []
    for _step, path in reversed(checkpoints(save_dir)):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def resolve(resume: str | None, save_dir: str | None) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from (None: start fresh) and warnings to show."""
    if resume is None:
        return None, []
    if resume == "auto":
        path, skipped = latest(save_dir or "")
        notes = [f"skipping incomplete checkpoint {p} (no .metadata or {INFO})" for p in skipped]
        if path is None:
            notes.append(f"no complete checkpoint in {save_dir}: starting from step 0")
        return path, notes
    if not is_complete(resume):
        raise CheckpointError(
            f"--resume {resume}: not a complete checkpoint (a step-N directory with .metadata and {INFO})"
        )
    return resume, []


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


def publish(tmp: str, final: str, info: dict) -> None:
    """Rank 0, once DCP has written ``tmp``: add ``bundle.json`` and rename ``tmp`` to ``final``."""
    fd, part = tempfile.mkstemp(prefix=".info-", dir=tmp)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
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
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read {INFO} ({exc})") from exc


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


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            try:
                meta = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError) as exc:
                raise CheckpointError(f"{self.path}/.metadata: {exc}") from exc
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp.metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


def entries(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor entry of a checkpoint: key -> (shape, dtype)."""
    meta = SafeReader(path).read_metadata()
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, dcp.metadata.TensorStorageMetadata)
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


def export(path: str, out: str) -> None:
    """Write the canonical weights of checkpoint ``path`` as one ``--checkpoint``-format file."""
    want = {
        k: torch.empty(shape, dtype=dtype)
        for k, (shape, dtype) in entries(path).items()
        if k.startswith("model.")
    }
    with warnings.catch_warnings():  # one process on purpose: no "assuming single process" note
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(want, storage_reader=SafeReader(path), no_dist=True)
    save(out, {k.removeprefix("model."): v for k, v in want.items()})
