"""A corpus tokenized once into token shards (``python -m bundle.data prepare``; format: ``shards``).

The inputs, in order, are one sequence of documents: a text file is one (read in chunks cut at
line ends: it may be larger than memory), a ``.jsonl(.gz)`` line, a ``.parquet`` row or a row of
a ``datasets`` ``save_to_disk`` directory one each. Document ``d`` (counted across inputs) is
validation iff ``blake2b(str(d))`` as a fraction of 2**64 is below ``val_fraction``. Batches are
tokenized in a pool and taken back in the order sent, so the files are the same, byte for byte,
with any number of workers. All is written into ``OUT.partial``, renamed ``OUT`` once its
``index.json`` is there: a directory named ``OUT`` is always a finished corpus.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from bundle.data import shards
from bundle.data import tokenizer as tokenizers
from bundle.errors import ConfigError, DataError

CHUNK = 1 << 20  # a text file is read this much at a time, cut at its last line end
_LONG_LINE = 64 << 20  # a "line" longer than this is cut at a character boundary instead
_BATCH_BYTES = 1 << 20  # text sent to a worker at a time: large enough to outweigh the pickling
_BATCH_ITEMS = 4096
_ROWS = 1024  # rows read at a time from a parquet file or a saved dataset

# A reader yields pieces (payload, how, line, ends, done): a document's text or a piece of it,
# how the worker finds its text ("text": a file's bytes, "json": a JSON line, "value": a column's
# value), where it is (line or row), whether the document ends with it, and the bytes of the
# input read so far (progress). The encoder gets (payload, how, path, line, ends).
Piece = tuple[Any, str, int, bool, int]
Item = tuple[Any, str, str, int, bool]
Meta = list[tuple[str, bool]]  # each piece's split and whether its document ends with it


@dataclass(frozen=True, kw_only=True)
class Options:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str | None = None
    text_field: str = "text"
    val_fraction: float = 0.001
    workers: int = 0
    shard_tokens: int = 100_000_000

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("INPUT", "", "give at least one text, .jsonl, .parquet or dataset")
        if not (math.isfinite(self.val_fraction) and 0 <= self.val_fraction < 1):
            raise ConfigError("--val-fraction", self.val_fraction, "a fraction 0 <= F < 1")
        if self.workers < 0:
            raise ConfigError("--workers", self.workers, "0 or more (0 and 1: no pool)")
        if self.shard_tokens < 1:
            raise ConfigError("--shard-tokens", self.shard_tokens, "1 or more")
        if not self.text_field:
            raise ConfigError("--text-field", self.text_field, "a field name")


@dataclass(frozen=True)
class Summary:
    """What ``prepare`` wrote (``python -m bundle.data`` says it in one line)."""

    out: str
    documents: int
    tokens: dict[str, int]
    shards: dict[str, int]
    bytes_read: int
    bytes_written: int
    seconds: float


def is_val(document: int, fraction: float) -> bool:
    """Document ``document`` (its index in the whole input) belongs to the validation split."""
    h = hashlib.blake2b(f"{document}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def kind(path: str) -> str:
    """How an input is read: "dataset", "parquet", "jsonl" or "text"; one line if it cannot be."""
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
            _needs("datasets", path, "a dataset saved with save_to_disk")
            return "dataset"
        raise DataError(f"{path} is a directory, not a dataset saved with datasets' save_to_disk")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if path.endswith(".parquet"):
        _needs("pyarrow", path, "a .parquet file")
        return "parquet"
    return "jsonl" if path.endswith((".jsonl", ".jsonl.gz")) else "text"


def _needs(package: str, path: str, what: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise DataError(f"{path}: reading {what} needs {package} (pip install {package})")


def input_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _chunks(f: Any) -> Iterator[bytes]:
    """A binary file in pieces of about ``CHUNK`` bytes, each ending at a line end."""
    parts: list[bytes] = []
    held = 0
    while block := f.read(CHUNK):
        cut = block.rfind(b"\n") + 1
        if cut == 0 and held + len(block) < _LONG_LINE:
            parts.append(block)
            held += len(block)
            continue
        if cut == 0:
            cut = _char_boundary(block)
        yield b"".join(parts) + block[:cut]
        parts, held = [block[cut:]], len(block) - cut
    if held:
        yield b"".join(parts)


def _char_boundary(block: bytes) -> int:
    """Where ``block`` can be cut without splitting a UTF-8 character (its end if nowhere)."""
    cut = len(block)
    while cut > 0 and block[cut - 1] & 0xC0 == 0x80:  # continuation bytes
        cut -= 1
    if cut > 0 and block[cut - 1] >= 0xC0:  # the lead byte of the character they continue
        cut -= 1
    return cut or len(block)


def _text_pieces(path: str) -> Iterator[Piece]:
    line, done, held = 1, 0, None
    with open(path, "rb") as f:
        for chunk in _chunks(f):
            if held is not None:
                yield held, "text", line, False, done
                line += held.count(b"\n")
            done += len(chunk)
            held = chunk
    yield held or b"", "text", line, True, done


def _jsonl_pieces(path: str) -> Iterator[Piece]:
    number = 0
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
        try:
            for number, line in enumerate(f, 1):  # noqa: B007 - the last number names an error
                if line.strip():
                    yield line, "json", number, True, raw.tell()
        except (EOFError, OSError, zlib.error) as exc:
            raise DataError(f"{path}: cannot be read after line {number} ({exc})") from None


def _parquet_pieces(path: str, field: str) -> Iterator[Piece]:
    pq = importlib.import_module("pyarrow.parquet")  # optional, and untyped: Any
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are many: say which file
        raise DataError(f"{path}: not a readable parquet file ({_first(exc)})") from None
    _has_column(path, field, pf.schema_arrow.names)
    batches = pf.iter_batches(batch_size=_ROWS, columns=[field])
    rows = (b.column(0).to_pylist() for b in batches)
    yield from _values(path, rows, os.path.getsize(path), pf.metadata.num_rows)


def _dataset_pieces(path: str, field: str) -> Iterator[Piece]:
    datasets = importlib.import_module("datasets")  # optional, and untyped: Any
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - datasets' errors are many: say which directory
        raise DataError(f"{path}: not a readable saved dataset ({_first(exc)})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path} holds splits {', '.join(ds)}; give one: {path}/{next(iter(ds))}")
    _has_column(path, field, ds.column_names)
    rows = (b[field] for b in ds.select_columns([field]).iter(batch_size=_ROWS))
    # Rows count as bytes of the directory: one bar, and one ETA, for any mix of inputs.
    yield from _values(path, rows, input_bytes(path), len(ds))


def _has_column(path: str, field: str, names: list[str]) -> None:
    if field not in names:
        raise DataError(f"{path}: no column {field!r} (--text-field; columns: {', '.join(names)})")


def _values(path: str, batches: Iterator[list[Any]], size: int, rows: int) -> Iterator[Piece]:
    """Each value of a column read in batches of rows, a document each."""
    row = 0
    try:
        for values in batches:
            for value in values:
                row += 1
                yield value, "value", row, True, size * row // max(rows, 1)
    except Exception as exc:  # noqa: BLE001 - a corrupt page: say where
        raise DataError(f"{path}: cannot be read after row {row} ({_first(exc)})") from None


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# How each kind of input is read (``kind`` names them).
_READERS: dict[str, Callable[[str, str], Iterator[Piece]]] = {
    "text": lambda path, field: _text_pieces(path),
    "jsonl": lambda path, field: _jsonl_pieces(path),
    "parquet": _parquet_pieces,
    "dataset": _dataset_pieces,
}


@dataclass(frozen=True)
class Encoder:
    """A batch of pieces tokenized (in a pool worker, or in the process): their tokens in one
    array, each document's last piece followed by end-of-text, and each piece's length in it."""

    tokenizer: str | None
    field: str
    end_of_text: int
    dtype: str

    def __call__(self, batch: list[Item]) -> tuple[np.ndarray, list[int]]:
        tok = tokenizers.load(self.tokenizer) if self.tokenizer else None
        out: Any = bytearray() if tok is None else []  # the bytes themselves are the tokens
        lengths = []
        for payload, how, path, line, ends in batch:
            text = self._text(payload, how, path, line)
            before = len(out)
            if tok is None:
                out += self._bytes(text, how, path, line)
            else:  # a text file's bytes, as --dataset text reads them
                out.extend(
                    tok.encode(text if isinstance(text, str) else text.decode(errors="replace"))
                )
            if ends:
                out.append(self.end_of_text)
            lengths.append(len(out) - before)
        if tok is None:
            return np.frombuffer(bytes(out), dtype=np.uint8), lengths
        return np.array(out, dtype=self.dtype), lengths

    def _bytes(self, text: str | bytes, how: str, path: str, line: int) -> bytes:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        if b"\0" in raw:  # the separator of byte-level documents: text never holds one
            at = line + raw.count(b"\n", 0, raw.index(b"\0")) if how == "text" else line
            raise DataError(
                f"{_where(path, how, at)}: a NUL byte, the end-of-text token of byte-level "
                "tokens (remove it, or give --tokenizer)"
            )
        return raw

    def _text(self, payload: Any, how: str, path: str, line: int) -> str | bytes:
        if how == "json":
            try:
                obj = json.loads(payload)
            except ValueError as exc:
                raise DataError(f"{path}:{line}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{line}: a JSON {type(obj).__name__}, not an object")
            if self.field not in obj:
                raise DataError(f"{path}:{line}: no field {self.field!r} (--text-field)")
            payload = obj[self.field]
        if not isinstance(payload, str | bytes):
            raise DataError(
                f"{_where(path, how, line)}: field {self.field!r} is "
                f"{type(payload).__name__}, not text"
            )
        return payload


def _where(path: str, how: str, line: int) -> str:
    return f"{path}: row {line}" if how == "value" else f"{path}:{line}"


def _encoded(
    batches: Iterable[tuple[list[Item], Meta, int]], encoder: Encoder, workers: int
) -> Iterator[tuple[Meta, int, tuple[np.ndarray, list[int]]]]:
    """(splits, progress, encoder(batch)) for each batch, in order; a pool of ``workers`` when
    more than one, at most ``2 * workers`` batches ahead of the writer (memory stays bounded)."""
    if workers <= 1:
        for batch, meta, done in batches:
            yield meta, done, encoder(batch)
        return
    # fork: the workers start at once, with the tokenizer loaded (spawn would import torch again).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(workers) as pool:
        pending: deque[tuple[Meta, int, Any]] = deque()
        it = iter(batches)
        while True:
            try:
                batch, meta, done = next(it)
            except StopIteration:
                break
            except DataError:
                for _, _, result in pending:  # a bad batch before it is the error to report
                    result.get()
                raise
            pending.append((meta, done, pool.apply_async(encoder, (batch,))))
            if len(pending) > 2 * workers:
                meta, done, result = pending.popleft()
                yield meta, done, result.get()
        while pending:
            meta, done, result = pending.popleft()
            yield meta, done, result.get()


def _batches(
    opts: Options, kinds: list[str], documents: list[int]
) -> Iterator[tuple[list[Item], Meta, int]]:
    """The pieces of every input in batches for the encoder, each with (split, ends) per piece
    and the input bytes it covers; counts each input's documents into ``documents``."""
    batch: list[Item] = []
    meta: Meta = []
    held = progress = d = 0
    split, starts = "train", True
    for i, (path, how) in enumerate(zip(opts.inputs, kinds, strict=True)):
        before = 0
        try:
            for payload, what, line, ends, done in _READERS[how](path, opts.text_field):
                if starts:
                    split = "val" if is_val(d, opts.val_fraction) else "train"
                    d, documents[i] = d + 1, documents[i] + 1
                starts = ends
                batch.append((payload, what, path, line, ends))
                meta.append((split, ends))
                held += len(payload) if isinstance(payload, str | bytes) else 0
                progress, before = progress + done - before, done
                if held >= _BATCH_BYTES or len(batch) >= _BATCH_ITEMS:
                    yield batch, meta, progress
                    batch, meta, held, progress = [], [], 0, 0
        except OSError as exc:
            raise DataError(f"{path}: {exc.strerror or exc}") from None
        progress += input_bytes(path) - before  # the bar ends each input at its size
    if batch or progress:
        yield batch, meta, progress


def _write(
    opts: Options, kinds: list[str], identity: dict[str, Any], directory: str, bar: Any
) -> tuple[list[int], dict[str, Any]]:
    """Every input tokenized into ``directory``'s shards: (documents per input, the splits)."""
    dtype = shards.dtype_for(identity["vocab"])
    writers = {s: shards.ShardWriter(directory, s, dtype, opts.shard_tokens) for s in shards.SPLITS}
    encoder = Encoder(opts.tokenizer, opts.text_field, identity["end_of_text"], dtype.name)
    documents = [0] * len(opts.inputs)
    batches = _batches(opts, kinds, documents)
    try:
        for meta, done, (tokens, lengths) in _encoded(batches, encoder, opts.workers):
            at = 0
            for (split, ends), n in zip(meta, lengths, strict=True):
                writers[split].add(tokens[at : at + n], ends)
                at += n
            if bar is not None:
                bar.update(done)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    if not sum(documents):
        raise DataError(f"{', '.join(opts.inputs)}: no documents (--text-field {opts.text_field})")
    return documents, {s: w.finish() for s, w in writers.items()}


@contextlib.contextmanager
def _bar(progress: TextIO | None, total: int) -> Iterator[Any]:
    """A tqdm bar over the input bytes on ``progress`` (None: no bar)."""
    if progress is None:
        yield None
        return
    from tqdm import tqdm

    style = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "dynamic_ncols": True}
    with tqdm(total=total, desc="prepare", file=progress, **style) as bar:
        yield bar


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def prepare(opts: Options, *, progress: TextIO | None = None) -> Summary:
    """Tokenize ``opts.inputs`` into shards in ``opts.out`` (through ``OUT.partial``); a bar on
    ``progress`` when given. Any failure leaves neither ``OUT`` nor ``OUT.partial``."""
    started = time.monotonic()
    kinds = [kind(p) for p in opts.inputs]
    out = opts.out.rstrip("/") or opts.out
    if os.path.lexists(out):
        raise DataError(f"--out {out}: exists; remove it or choose another --out")
    identity = shards.tokenizer_identity(opts.tokenizer)
    partial = out + ".partial"
    sizes = [input_bytes(p) for p in opts.inputs]
    with _bar(progress, sum(sizes)) as bar:
        try:
            _remove(partial)  # a run that was killed: never finished, so never read
            os.makedirs(partial)
            documents, splits = _write(opts, kinds, identity, partial, bar)
            inputs = [
                {"path": os.path.abspath(p), "bytes": b, "documents": n}
                for p, b, n in zip(opts.inputs, sizes, documents, strict=True)
            ]
            shards.write_index(
                partial, identity, opts.text_field, opts.val_fraction, inputs, splits
            )
            if os.path.lexists(out):
                raise DataError(f"--out {out}: exists; remove it or choose another --out")
            os.rename(partial, out)
        except BaseException as exc:
            _remove(partial)
            if isinstance(exc, OSError):
                raise DataError(f"--out {out}: {exc.strerror or exc}") from None
            raise
    _sync(os.path.dirname(os.path.abspath(out)))
    written = sum(e.stat().st_size for e in os.scandir(out))
    tokens = {s: splits[s]["tokens"] for s in shards.SPLITS}
    files = {s: len(splits[s]["shards"]) for s in shards.SPLITS}
    return Summary(
        out, sum(documents), tokens, files, sum(sizes), written, time.monotonic() - started
    )


def _sync(directory: str) -> None:
    """The rename itself is durable once the directory holding it is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
