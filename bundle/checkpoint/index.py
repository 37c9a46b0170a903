"""A checkpoint's DCP index (``.metadata``) read as data, never as code.

DCP pickles its index and reads it back with ``pickle.load``, which runs whatever a planted
``.metadata`` names. Here it is read by an unpickler that admits an exact list of
``(module, name)`` pairs, the classes a DCP index is made of: never a prefix (a prefix admits
every function of the modules under it) and never a dotted name (protocol 4 resolves
``("torch.distributed.checkpoint.filesystem", "os.system")`` through attributes to ``os.system``).
What the index then points at is checked too: every entry is a tensor (DCP reads a "bytes" entry
with ``torch.load(weights_only=False)``), and every file it names is a plain name inside the
checkpoint's own directory.
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

import torch

from bundle.errors import CheckpointError

_DCP = "torch.distributed.checkpoint"
# Everything a DCP index (torch 2.10 .. 2.14) pickles, as (module, name).
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name
        # The path DCP records; Python 3.13 pickles it from the module that defines it.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
)
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in ALLOWED:
                return super().find_class(module, name)
            # A dtype, layout or memory format by name (torch.float32): values, not callables.
            if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def read(path: str) -> Any:
    """The index of checkpoint directory ``path``, once it is known to hold only tensor entries
    in files of that directory; a ``CheckpointError`` naming what is wrong otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    where = os.path.join(path, ".metadata")
    try:
        with open(where, "rb") as f:
            meta = _IndexUnpickler(f).load()
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or planted pickle raises
        raise CheckpointError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{where}: holds a {type(meta).__name__}, not a DCP index")
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{where}: entry {key!r} is not a tensor")
    for info in (meta.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not plain_name(name):
            raise CheckpointError(f"{where}: names a file outside the checkpoint ({name!r})")
    return meta


def plain_name(name: str) -> bool:
    """Whether ``name`` is a file directly inside a checkpoint directory (no ``/``, no ``..``)."""
    return bool(name) and os.path.basename(name) == name and name not in (".", "..")


def reader(path: str) -> Any:
    """DCP's file reader of checkpoint ``path``, its index read by ``read``."""
    return _reader_class()(path)


@functools.cache
def _reader_class() -> type:
    # torch.distributed.checkpoint is imported when a checkpoint is first read or written:
    # with DTensor it is a second of every process's start-up.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = read(str(self.path))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = dcp.metadata.StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

        def read_data(self, plan: Any, planner: Any) -> Any:
            # A bytes entry is unpickled whole by DCP's planner; the index cannot hold one (read
            # refuses it), and nothing else may ask for one.
            if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
                raise CheckpointError(f"{self.path}: a bytes entry is never read from a checkpoint")
            return super().read_data(plan, planner)

    return SafeReader


def entries(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor entry of a checkpoint: key -> (shape, dtype)."""
    meta = read(path)
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()}


def files(path: str) -> set[str]:
    """The data files the index of checkpoint ``path`` reads its entries from."""
    return {info.relative_path for info in (read(path).storage_data or {}).values()}
