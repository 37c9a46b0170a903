"""Checkpoints: the final weights as one state dict, and resumable ``step-N`` directories (DCP).

A resumable checkpoint is the directory ``SAVE_DIR/step-N`` (N = training steps done)::

    step-N/
      __R_0.distcp     what global rank R wrote (torch.distributed.checkpoint, every rank at once)
      .metadata        DCP's index of every entry, written last
      bundle.json      the step, the settings of the run that wrote it, the size and SHA-256 of
                       every other file (``files``) and the SHA-256 of itself (``digest``)

It is written as ``step-N.tmp`` and renamed when all three are there; a step written again is
swapped in (``publish``) so that a whole copy of it exists at every moment, and what a kill leaves
is put right by the next job's first process (``recover``). A checkpoint is trusted only once
verified (``damage``): ``.metadata`` and ``bundle.json`` present and readable, ``bundle.json``
matching its digest, every file it lists there with its size and checksum, and the index made only
of what a DCP index holds (an exact allow-list: a checkpoint is data, never code; see
docs/security.md). ``--resume auto`` passes over a damaged one to the newest whole one; naming a
damaged one is refused. Entries are keyed by full-model names, so any shape, partition or node
count reads them (DCP hands every rank the keys its stage asks for, from whichever files hold
them):

    model.<name>              parameters (replicas agree, DCP keeps one copy) and the buffers of
                              the canonical replica (bundle 0, replica 0 of each stage)
    optim.<name>.<state>      optimizer state, e.g. ``optim.fc.weight.momentum_buffer``
    replica.<rank>.<name>     the buffers of every other replica (BatchNorm statistics differ
                              between replicas); read back only under the same layout
    base.<name>               a --lora run's frozen base tensor's SHA-256 (the base is not kept)

``python -m bundle.checkpoint export SAVE_DIR/step-N model.pt`` writes the ``--checkpoint`` format.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bundle.checkpoint import index
from bundle.config import RunConfig
from bundle.errors import CheckpointError

INFO = "bundle.json"
# 2: bundle.json carries its own digest. Format 1 (older) is read as before, by its file checksums.
FORMAT = 2
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ASIDE = re.compile(r"^step-(\d+)\.(tmp|old)$")  # a save not yet renamed, a copy moved aside
# What a file of a checkpoint may be called: a plain name in its directory, nothing above it.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$|^\.metadata$")


def save(path: str, state: dict[str, torch.Tensor]) -> None:
    """Write to a temporary file beside ``path`` and rename, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        honour_umask(tmp)
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


def honour_umask(path: str, mode: int = 0o666) -> None:
    """Give ``path`` the permissions a plain ``open`` would have (``mode`` less the umask):
    ``mkstemp`` makes every file 0600, whatever the user asked their umask for."""
    os.chmod(path, mode & ~_umask())


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for a moment, for every thread)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def _info_digest(info: dict) -> str:
    """The SHA-256 of ``bundle.json``'s content but its digest, as canonical JSON."""
    body = {k: v for k, v in info.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def damage(path: str) -> str | None:
    """Why checkpoint ``path`` cannot be trusted (None: whole): a file missing, unreadable, of
    another size or checksum than ``bundle.json`` records; ``bundle.json`` not matching its
    digest; an index that is not plain data or reads files the record does not list. Reads every
    file once."""
    for name in (".metadata", INFO):
        if not os.path.isfile(os.path.join(path, name)):
            return f"no {name}"
    try:
        info = read_info(path)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{path}: ")
    if info.get("format", 1) >= 2 and info.get("digest") != _info_digest(info):
        return f"{INFO} does not match its digest"
    recorded = info.get("files")
    if not isinstance(recorded, dict) and "files" in info:
        return f"{INFO} lists no files"
    # Without records (written before checksums were), the index must still read.
    return _files_damage(path, recorded if isinstance(recorded, dict) else None)


def _files_damage(path: str, recorded: dict | None) -> str | None:
    """What differs between the files of checkpoint ``path`` and their ``recorded`` size and
    checksum, or files its index reads that the record does not list (None: nothing)."""
    for name, want in sorted((recorded or {}).items()):
        if not index.plain_name(name) or not isinstance(want, dict):
            return f"{INFO} lists {name!r}, not a file of the checkpoint"
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
        read = index.files(path)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{path}/")
    unlisted = sorted(read - set(recorded)) if recorded is not None else []
    return f"its index reads {unlisted[0]}, which {INFO} does not list" if unlisted else None


def checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Every ``step-N`` directory in ``save_dir`` (complete or not), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for entry in os.scandir(save_dir):
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False):
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


def step_or_newest(path: str, say: Callable[[str], None]) -> str:
    """``path`` where it is a step directory (or no directory); a save directory's newest whole
    step, each newer one passed over and the one chosen said through ``say``."""
    is_step = any(os.path.exists(os.path.join(path, f)) for f in (INFO, ".metadata"))
    if not os.path.isdir(path) or is_step or not checkpoints(path):
        return path
    found, notes = latest(path)
    for note in notes:
        say(note)
    if found is None:
        raise CheckpointError(f"{path}: holds no whole checkpoint")
    say(f"{found} (the newest whole checkpoint)")
    return found


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


def recover(save_dir: str) -> list[str]:
    """Put right what an interrupted save left, saying what was done; only the holder of the
    directory's lock may (a running save writes exactly these).

    ``step-N.tmp`` that is whole (its ``bundle.json`` written) was a finished save killed before
    its rename: it becomes ``step-N`` unless a whole ``step-N`` is there. ``step-N.old`` is the
    copy a re-save of step N moved aside (``publish``): it comes back where no whole ``step-N``
    or ``step-N.tmp`` took its place. Anything else is removed, as are half-written weights files.
    """
    notes: list[str] = []
    if not os.path.isdir(save_dir):
        return notes
    aside: dict[int, dict[str, str]] = {}
    for entry in os.scandir(save_dir):
        if (m := _ASIDE.match(entry.name)) and entry.is_dir(follow_symlinks=False):
            aside.setdefault(int(m.group(1)), {})[m.group(2)] = entry.path
        elif entry.name.startswith(".ckpt-") and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            notes.append(f"removed {entry.name} (left by an interrupted save)")
    for step, copies in sorted(aside.items()):
        final = step_dir(save_dir, step)
        if (tmp := copies.get("tmp")) is not None:
            if damage(tmp) is None:  # the newer copy of the step: it wins
                _swap_in(tmp, final)
                notes.append(f"{os.path.basename(tmp)} was whole: it is {os.path.basename(final)}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                notes.append(f"removed {os.path.basename(tmp)} (left by an interrupted save)")
        if (old := copies.get("old")) is not None and os.path.isdir(old):
            if (not os.path.isdir(final) or damage(final) is not None) and damage(old) is None:
                shutil.rmtree(final, ignore_errors=True)  # a damaged step-N
                os.replace(old, final)
                notes.append(f"{os.path.basename(old)} was whole: it is {os.path.basename(final)}")
            else:
                shutil.rmtree(old, ignore_errors=True)
                notes.append(f"removed {os.path.basename(old)} (left by an interrupted save)")
    _sync_dir(save_dir)
    return notes


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
        if _ASIDE.match(entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)


def publish(tmp: str, final: str, info: dict, files: dict | None = None) -> None:
    """Rank 0, once DCP has written ``tmp``: add ``bundle.json`` with the size and checksum of
    every file (``files``, or read now) and its own digest, and rename ``tmp`` to ``final``.

    A step written again (after a restart) is swapped in: the old ``final`` is moved aside to
    ``step-N.old`` and removed only once the new one is in place, so a whole copy of step N
    exists at every moment (``recover`` finds it after a kill).
    """
    info = {**info, "files": files if files is not None else file_records(tmp)}
    info["digest"] = _info_digest(info)
    fd, part = tempfile.mkstemp(prefix=".info-", dir=tmp)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    honour_umask(part)
    os.replace(part, os.path.join(tmp, INFO))
    _swap_in(tmp, final)


def _swap_in(tmp: str, final: str) -> None:
    """``tmp`` (whole) becomes ``final``; a ``final`` already there is moved aside first and
    removed last, so that one whole copy of the step exists at every moment."""
    old = f"{final}.old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _sync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


def _sync_dir(path: str) -> None:
    """Make renames in directory ``path`` durable (a crash after a publish keeps it)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory: the rename stands as they keep it
    finally:
        os.close(fd)


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
    if not isinstance(info.get("format", 1), int):
        raise CheckpointError(f"{path}: cannot read {INFO} (format {info.get('format')!r})")
    return info


# The index is read as data, never as code (bundle.checkpoint.index).
safe_reader = index.reader
entries = index.entries


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
