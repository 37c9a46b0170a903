"""A prepared corpus on disk: token shards and the ``index.json`` that names and checks them.

``python -m bundle.data prepare`` writes a directory of raw little-endian token ids::

    DIR/train-00000.bin  train-00001.bin ...  val-00000.bin ...  index.json (written last)

Every document's tokens end with the tokenizer's end-of-text token, and no document is split
across shards. ``index.json`` records the tokenizer (kind, vocabulary, end-of-text id and a digest
of its files), each shard's documents, tokens and SHA-256, and a digest of all of it:

    {"format": "bundle-tokens", "version": 1, "dtype": "uint16", "tokenizer": {...},
     "text_field": "text", "val_fraction": 0.001, "inputs": [{"path", "bytes", "documents"}],
     "splits": {"train": {"documents", "tokens", "shards": [{"file", "documents", "tokens",
     "sha256"}]}, "val": {...}}, "digest": "sha256:..."}

``Index.read`` trusts nothing in it (JSON only, digest, plain shard names, every shard's size);
``TokenStream`` reads one split as one sequence through ``numpy.memmap``: only the pages a
window touches are read, and a DataLoader worker opens its own maps.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from bundle.data import tokenizer as tokenizers
from bundle.errors import DataError

FORMAT = "bundle-tokens"
VERSION = 1
INDEX = "index.json"
SPLITS = ("train", "val")
_DTYPES = ("uint8", "uint16", "uint32")
# A shard is named by prepare ("train-00000.bin"); anything else (a path, "..") is refused, so an
# index can never make a reader open a file outside its directory.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# index.json is a few hundred bytes a shard: a file larger than this is not one.
_INDEX_LIMIT = 64 << 20
_HASH_CHUNK = 8 << 20


def dtype_for(vocab: int) -> np.dtype[Any]:
    """The smallest unsigned dtype that holds every id ``0 .. vocab - 1``."""
    for name in _DTYPES:
        if vocab - 1 <= np.iinfo(name).max:
            return np.dtype(name)
    raise DataError(f"a vocabulary of {vocab} tokens does not fit in uint32 token ids")


def _tokenizer_files(path: str) -> tuple[str, list[str]]:
    """(kind, the files that define it), as ``tokenizer.load`` reads ``path``."""
    if os.path.isfile(path):
        return "tokenizer.json", [path]
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json", [os.path.join(path, "tokenizer.json")]
    # What transformers reads for a tokenizer; a model directory's weights are not part of it.
    names = sorted(
        e.name
        for e in os.scandir(path)
        if e.is_file()
        and (
            e.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens"))
            or e.name.endswith((".model", ".tiktoken"))
        )
    )
    return "transformers", [os.path.join(path, n) for n in names]


def tokenizer_digest(path: str | None) -> str | None:
    """SHA-256 over the files that define the tokenizer at ``path``, sorted by name (each as
    its name, size and bytes); None for byte-level tokens."""
    if not path:
        return None
    h = hashlib.sha256()
    for file in _tokenizer_files(path)[1]:
        h.update(os.path.basename(file).encode() + b"\0")
        h.update(os.path.getsize(file).to_bytes(8, "little"))
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(path: str | None) -> dict[str, Any]:
    """The ``tokenizer`` record of an index for ``--tokenizer path`` (None: bytes); a tokenizer
    with no end-of-text token is refused: documents could not be told apart."""
    tok = tokenizers.load(path)
    eot = tokenizers.end_of_text(tok)
    if eot is None:
        raise DataError(
            f"--tokenizer {path!r} has no end-of-text token (eos_token_id, <|endoftext|>, "
            "</s> or <eos>) to end each document with"
        )
    return {
        "kind": _tokenizer_files(path)[0] if path else "bytes",
        "path": os.path.abspath(path) if path else None,
        "vocab": int(tok.vocab),
        "end_of_text": int(eot),
        "sha256": tokenizer_digest(path),
    }


def content_digest(meta: dict[str, Any]) -> str:
    """``sha256:`` of the canonical JSON of everything in ``meta`` but its digest."""
    rest = {k: v for k, v in meta.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def write_index(
    directory: str,
    tokenizer: dict[str, Any],
    text_field: str,
    val_fraction: float,
    inputs: list[dict[str, Any]],
    splits: dict[str, Any],
) -> None:
    """``index.json`` with its digest, synced: the last file a prepared corpus gets."""
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype_for(tokenizer["vocab"]).name,
        "tokenizer": tokenizer,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "inputs": inputs,
        "splits": splits,
    }
    text = json.dumps({**meta, "digest": content_digest(meta)}, indent=1, sort_keys=True) + "\n"
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ShardWriter:
    """One split's shards, written a piece of a document at a time.

    A shard holds at most ``shard_tokens`` tokens, unless it is one document longer than that:
    a document that would take a shard past the limit begins the next one. A document comes in
    pieces (a large text file in chunks), so its pieces are held until it ends or is known not to
    fit: at most ``shard_tokens`` tokens in memory.
    """

    def __init__(self, directory: str, split: str, dtype: np.dtype[Any], shard_tokens: int):
        self.directory, self.split, self.dtype, self.limit = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._name = ""
        self._hash = hashlib.sha256()
        self._tokens = self._documents = 0  # of the open shard
        self._held: list[np.ndarray] = []
        self._held_tokens = 0
        self._streaming = False  # the document under way has a shard to itself: write through

    def add(self, tokens: np.ndarray, ends: bool) -> None:
        """The next piece of the document under way; ``ends``: its last (it ends in the
        end-of-text token)."""
        if not self._streaming:
            self._held.append(tokens)
            self._held_tokens += len(tokens)
            if not ends and self._tokens + self._held_tokens <= self.limit:
                return
            if self._tokens and self._tokens + self._held_tokens > self.limit:
                self._close()
            for held in self._held:
                self._write(held)
            self._held, self._held_tokens = [], 0
            self._streaming = not ends
        else:
            self._write(tokens)
            self._streaming = not ends
        if ends:
            self._documents += 1

    def finish(self) -> dict[str, Any]:
        """Close the last shard; the split's record for the index."""
        if self._held or self._streaming:
            raise DataError(f"{self.split}: the last document was never ended")
        self._close()
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }

    def _write(self, tokens: np.ndarray) -> None:
        if self._file is None:
            name = f"{self.split}-{len(self.shards):05d}.bin"
            self._file = open(os.path.join(self.directory, name), "wb")  # noqa: SIM115
            self._name = name
        raw = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes()
        self._file.write(raw)
        self._hash.update(raw)
        self._tokens += len(tokens)

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append(
            {
                "file": self._name,
                "documents": self._documents,
                "tokens": self._tokens,
                "sha256": self._hash.hexdigest(),
            }
        )
        self._file, self._hash, self._tokens, self._documents = None, hashlib.sha256(), 0, 0

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _count(value: object, what: str, *, least: int = 0) -> int:
    if type(value) is not int or value < least:
        raise DataError(f"{what} is {value!r}, not a count (an integer >= {least})")
    return value


def _load(directory: str) -> dict[str, Any]:
    """index.json as a dict, its digest, format and version checked."""
    path = os.path.join(directory, INDEX)
    try:
        with open(path, "rb") as f:
            raw = f.read(_INDEX_LIMIT + 1)
    except FileNotFoundError:
        partial = " (a .partial directory is a prepare that did not finish)" * directory.endswith(
            ".partial"
        )
        raise DataError(f"{directory}: no {INDEX}, not a prepared corpus{partial}") from None
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > _INDEX_LIMIT:
        raise DataError(f"{path} is over {_INDEX_LIMIT} bytes: not an index of token shards")
    try:
        meta = json.loads(raw, parse_constant=lambda c: _refuse(path, c))
    except ValueError as exc:
        raise DataError(f"{path} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path} is not an index of token shards (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise DataError(
            f"{path}: version {meta.get('version')!r} is unknown; this Bundle reads version "
            f"{VERSION} (prepare the corpus again with it)"
        )
    if meta.get("digest") != content_digest(meta):
        raise DataError(f"{path}: its digest does not match its contents (the index was changed)")
    return meta


def _refuse(path: str, constant: str) -> None:
    raise DataError(f"{path}: {constant} is not JSON")


def _check_split(directory: str, name: str, split: object, itemsize: int) -> None:
    """A split's record is well formed and each shard file is there, of its exact size."""
    if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
        raise DataError(f"{directory}/{INDEX}: split {name!r} has no list of shards")
    total = 0
    for shard in split["shards"]:
        file = shard.get("file") if isinstance(shard, dict) else None
        if not isinstance(file, str) or not _PLAIN_NAME.fullmatch(file):
            raise DataError(
                f"{directory}/{INDEX}: shard {file!r} of {name!r} is not a plain file name"
            )
        tokens = _count(shard.get("tokens"), f"{file}'s tokens", least=1)
        _count(shard.get("documents"), f"{file}'s documents", least=1)
        if not isinstance(shard.get("sha256"), str) or not _HEX64.fullmatch(shard["sha256"]):
            raise DataError(f"{directory}/{INDEX}: {file} has no SHA-256")
        path = os.path.join(directory, file)
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise DataError(f"shard {path}: {exc.strerror or exc}") from None
        if size != tokens * itemsize:
            raise DataError(
                f"shard {path} is {size} bytes, expected {tokens * itemsize} ({tokens} tokens "
                f"of {itemsize} bytes): truncated or not this index's"
            )
        total += tokens
    if _count(split.get("tokens"), f"split {name!r}'s tokens") != total:
        raise DataError(
            f"{directory}/{INDEX}: split {name!r} says {split['tokens']} tokens, "
            f"its shards hold {total}"
        )


@dataclass(frozen=True)
class Index:
    """A prepared corpus: its directory, token dtype, tokenizer record and splits."""

    directory: str
    dtype: np.dtype[Any]
    tokenizer: dict[str, Any]
    splits: dict[str, Any]
    digest: str

    @classmethod
    def read(cls, directory: str) -> Index:
        """The index of ``directory``, checked: JSON, digest, format and version, plain shard
        names, and every shard present with exactly its tokens' bytes (not their hashes:
        ``verify``)."""
        meta = _load(directory)
        if meta.get("dtype") not in _DTYPES:
            raise DataError(
                f"{directory}/{INDEX}: dtype {meta.get('dtype')!r} is not one of "
                f"{', '.join(_DTYPES)}"
            )
        dtype = np.dtype(meta["dtype"])
        tok = meta.get("tokenizer")
        if not isinstance(tok, dict):
            raise DataError(f"{directory}/{INDEX} has no tokenizer record")
        vocab = _count(tok.get("vocab"), "the tokenizer's vocab", least=1)
        if _count(tok.get("end_of_text"), "end_of_text") >= vocab or dtype != dtype_for(vocab):
            raise DataError(
                f"{directory}/{INDEX}: {dtype} ids or end-of-text do not fit vocab {vocab}"
            )
        splits = meta.get("splits")
        if not isinstance(splits, dict) or set(splits) != set(SPLITS):
            raise DataError(f"{directory}/{INDEX}: splits must be {' and '.join(SPLITS)}")
        for name in SPLITS:
            _check_split(directory, name, splits[name], dtype.itemsize)
        return cls(directory, dtype, tok, splits, meta["digest"])

    def verify(self) -> None:
        """Every shard's SHA-256 against the index; the first that differs is named."""
        for name in SPLITS:
            for shard in self.splits[name]["shards"]:
                h = hashlib.sha256()
                path = os.path.join(self.directory, shard["file"])
                with open(path, "rb") as f:
                    while chunk := f.read(_HASH_CHUNK):
                        h.update(chunk)
                if h.hexdigest() != shard["sha256"]:
                    raise DataError(f"shard {path}: its SHA-256 differs from the index's")

    def tokens(self, split: str) -> int:
        return int(self._split(split)["tokens"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.splits:
            raise DataError(f"{self.directory}: no split {split!r} (it has {', '.join(SPLITS)})")
        return dict(self.splits[split])


class TokenStream:
    """One split's shards as one sequence of tokens, read through memory maps.

    A shard is mapped for one read and unmapped after it: a map kept open keeps every page it
    touched in the process's resident memory, which then grows with the corpus as training draws
    windows from all over it (nanoGPT maps its file anew for every batch for the same reason).
    """

    def __init__(self, index: Index, split: str) -> None:
        shards = index._split(split)["shards"]
        self.dtype = index.dtype.newbyteorder("<")
        self.paths = [os.path.join(index.directory, s["file"]) for s in shards]
        self.starts = list(itertools.accumulate([0] + [s["tokens"] for s in shards[:-1]]))
        self.total = int(sum(s["tokens"] for s in shards))
        self.shard_tokens = [int(s["tokens"]) for s in shards]

    def __len__(self) -> int:
        return self.total

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length - 1`` as int64, across shard boundaries."""
        if start < 0 or length < 0 or start + length > self.total:
            raise IndexError(f"tokens {start}..{start + length} are outside 0..{self.total}")
        out = np.empty(length, dtype=np.int64)
        done = 0
        shard = bisect.bisect_right(self.starts, start) - 1
        while done < length:
            at = start + done - self.starts[shard]
            n = min(length - done, self.shard_tokens[shard] - at)
            out[done : done + n] = self._read(shard, at, n)
            done += n
            shard += 1
        return out

    def _read(self, shard: int, at: int, n: int) -> np.ndarray:
        """Tokens ``at .. at + n - 1`` of one shard, through a map of just them, closed after."""
        mapped = np.memmap(
            self.paths[shard],
            dtype=self.dtype,
            mode="r",
            offset=at * self.dtype.itemsize,
            shape=(n,),
        )
        try:
            return np.array(mapped)
        finally:
            mapped._mmap.close()  # type: ignore[attr-defined]  # now, not when collected
