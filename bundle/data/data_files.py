"""``--data-files``: the files its globs match, in the order a stream reads them, the ``datasets``
builder that reads each (``datasets`` imported only when one is read), and their digest, which a
stream's recorded position is counted in: apart from the stream, as ``classify`` reads the same
files row by row."""

from __future__ import annotations

import glob
import hashlib
import importlib
import json
import os
from typing import Any

from bundle.errors import DataError

# How each kind of file is read (datasets' packaged builders), longest ending first.
BUILDERS = ((".jsonl.gz", "json"), (".jsonl", "json"), (".json", "json"), (".parquet", "parquet"))


def datasets_package() -> Any:
    """The ``datasets`` package, or one line saying to install it."""
    try:
        datasets = importlib.import_module("datasets")  # optional, and untyped: Any
    except ImportError:
        raise DataError(
            "--dataset hf streams --data-files with the datasets package (pip install datasets)"
        ) from None
    # load_dataset pings the Hub to count a download of "json" or "parquet" at every call (a
    # file opened, a seek): up to 3 s each where there is no network, and local files are read.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def builder_of(path: str) -> str:
    """The ``datasets`` builder that reads ``path`` ("json" or "parquet"); one line if none."""
    if not os.path.isfile(path):
        raise DataError(f"--data-files: {path} is not a file")
    for ending, builder in BUILDERS:
        if path.endswith(ending):
            return builder
    raise DataError(f"--data-files: {path} is not .jsonl, .jsonl.gz, .json or .parquet")


def files_of(globs: str) -> list[str]:
    """Every path the comma-separated ``globs`` match, sorted: the order of the stream."""
    found: set[str] = set()
    for pattern in (g.strip() for g in globs.split(",")):
        if pattern:
            found.update(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not found:
        raise DataError(f"--data-files {globs}: no file matches")
    files = sorted(found)
    for path in files:
        builder_of(path)
    return files


def files_digest(files: list[str]) -> str:
    """What a position is counted in: the files' names (under their common directory, so a
    corpus moved whole still matches) and sizes, in order."""
    paths = [os.path.abspath(f) for f in files]
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    named = [[os.path.relpath(p, root), os.path.getsize(p)] for p in paths]
    return hashlib.blake2b(json.dumps(named).encode(), digest_size=8).hexdigest()
