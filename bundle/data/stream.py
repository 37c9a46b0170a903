"""``--dataset hf``: JSON lines or Parquet files streamed with ``datasets``, tokenized and packed
on the fly into windows of ``--seq-len`` tokens, and resumed exactly under any shape.

The files (every path ``--data-files`` matches, sorted) are one sequence of documents, a row
each; document ``d`` (counted across the files) is held out for validation by ``prepare``'s hash
rule, so the split is the one ``python -m bundle.data prepare`` would make of the same files. The
training documents' tokens, each document's followed by end-of-text, are one endless stream (after
the last file the first comes again: the next pass). Window ``w`` is tokens ``w*T .. w*T+T``
(inputs the first ``T``, labels the last ``T``, as ``--dataset text``), and step ``s`` trains on
windows ``s*B .. (s+1)*B-1`` (``bundle.data.order.stream_indices``): the order is the files'.

Where window ``w`` begins is a small cursor (pass, file, row, document, offset), recorded in each
checkpoint by rank 0; a resumed run, of any shape, opens that file at that row (``.skip``: the
rows before it are parsed, not tokenized) and goes on from there. Without one it reads the stream
from its start, which gives the same windows, only slower. The files themselves (matched, read
by ``datasets``, digested) are ``data.data_files``'.

::

    file 0: doc 0 | doc 1 (held out) | doc 2 |  file 1: doc 3 | ...  | file 0 again (pass 1)
    tokens: [doc 0 .. EOT][doc 2 ..... EOT][doc 3 ... EOT] ...
    windows: |  w0  |  w1  |  w2  |  w3  | ...   (each T tokens, plus the next one as a label)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from bundle import log
from bundle.config import DataConfig
from bundle.data import tokenizer
from bundle.data.data_files import builder_of, datasets_package, files_digest, files_of
from bundle.data.prepare import Encoder, is_val
from bundle.data.splits import DataSplits
from bundle.errors import DataError, shown

VAL_FRACTION = 0.001  # prepare's default: the same documents are held out
VAL_WINDOWS = 256  # the validation split: this many windows at most, from the stream's start
WAIT = 5.0  # seconds ``position`` waits for a fetch in progress before it gives up
_KEPT = 4096  # window starts remembered: a checkpoint asks for one a few steps behind the reader
# A position's keys: all integers >= 0 but ``files``, the digest of the files it counts in.
KEYS = ("window", "pass", "file", "row", "document", "offset", "files")
OTHER_FILES = "--data-files matches other files than the run the checkpoint was saved from"


class Doc(NamedTuple):
    """One document of the stream: where it is, and its tokens followed by end-of-text."""

    pass_: int
    file: int
    row: int
    document: int
    tokens: torch.Tensor


def check_position(cfg: DataConfig, position: Any) -> None:
    """Before any process starts: a checkpoint's stream position was counted in the files
    ``--data-files`` matches now (what the position holds is checked when it is read)."""
    if not isinstance(position, dict) or "files" not in position:
        return
    if position["files"] != files_digest(files_of(cfg.data_files or "")):
        raise DataError(
            f"{OTHER_FILES}: give it the files it was saved with (names under their common "
            "directory, and sizes), or start afresh without --resume"
        )


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class Source:
    """The files of ``--data-files`` as documents: opened one at a time, tokenized on demand."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg, self.field = cfg, cfg.text_field
        self.files = files_of(cfg.data_files or "")
        self.digest = files_digest(self.files)
        tok = tokenizer.load(cfg.tokenizer)
        eot = tokenizer.end_of_text(tok)
        if eot is None:
            raise DataError(
                f"--tokenizer {cfg.tokenizer!r} has no end-of-text token (eos_token_id, "
                "<|endoftext|>, </s> or <eos>) to end each document with"
            )
        # prepare's encoder: the same tokens, the same one-line errors (text, NUL bytes).
        self.encoder = Encoder(cfg.tokenizer, self.field, eot, "int64")

    def rows(self, file: int, start: int) -> Iterator[Any]:
        """The ``--text-field`` value of each row of file ``file`` from row ``start`` on."""
        path = self.files[file]
        try:
            data = datasets_package().load_dataset(
                builder_of(path), data_files=[path], split="train", streaming=True
            )
            if data.features is not None and self.field in data.features:
                data = data.select_columns([self.field])  # the other columns are never decoded
            it = iter(data.skip(start) if start else data)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - datasets' and pyarrow's errors are many
            raise DataError(f"{path}: cannot be read ({_first(exc)})") from None
        row = start
        while True:
            try:
                got = next(it)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - a corrupt block: say where
                raise DataError(f"{path}: cannot be read after row {row} ({_first(exc)})") from None
            yield got.get(self.field) if isinstance(got, dict) else None
            row += 1

    def encode(self, value: Any, file: int, row: int) -> torch.Tensor:
        """A document's tokens and its end-of-text; a row without the field is one line."""
        path = self.files[file]
        if value is None:
            raise DataError(f"{path}: row {row + 1}: no field {self.field!r} (--text-field)")
        ids, _ = self.encoder([(value, "value", path, row + 1, True)])
        return torch.from_numpy(ids.astype(np.int64))

    def documents(
        self, start: tuple[int, int, int, int], *, held_out: bool, endless: bool
    ) -> Iterator[Doc]:
        """The training documents (``held_out``: the validation ones) from ``start`` = (pass,
        file, row, document) on; ``endless``: pass after pass. Only those are tokenized."""
        pass_, file, row, document = start
        whole, kept = (file, row) == (0, 0), 0
        while True:
            for value in self.rows(file, row):
                if is_val(document, VAL_FRACTION) == held_out:
                    kept += 1
                    yield Doc(pass_, file, row, document, self.encode(value, file, row))
                row, document = row + 1, document + 1
            file, row = file + 1, 0
            if file < len(self.files):
                continue
            if not endless:
                return
            if whole and not kept:  # a pass with nothing in it: the next would be the same
                raise DataError(
                    f"--data-files {self.cfg.data_files}: no document to train on "
                    f"({document} rows, every one held out for validation)"
                )
            pass_, file, document, whole, kept = pass_ + 1, 0, 0, True, 0

    def validation(self, limit: int) -> TensorDataset:
        """Up to ``limit`` windows of the held-out documents, from the stream's start."""
        t = self.cfg.seq_len
        need, have, parts = limit * t + 1, 0, []
        for doc in self.documents((0, 0, 0, 0), held_out=True, endless=False):
            parts.append(doc.tokens)
            have += len(doc.tokens)
            if have >= need:
                break
        tokens = torch.cat(parts)[:need] if parts else torch.empty(0, dtype=torch.long)
        n = max(0, (len(tokens) - 1) // t)
        x, y = tokens[: n * t].view(n, t), tokens[1 : n * t + 1].view(n, t)
        return TensorDataset(x, y)


class Reader:
    """Where the packed stream stands: at the start of window ``window``, which is token
    ``offset`` of the document ``doc`` (None: the next one ``docs`` gives)."""

    def __init__(
        self, docs: Iterator[Doc], window: int, doc: Doc | None = None, offset: int = 0
    ) -> None:
        self.docs, self.window, self.doc, self.offset = docs, window, doc, offset

    def current(self) -> Doc:
        while self.doc is None or self.offset >= len(self.doc.tokens):
            self.doc, self.offset = next(self.docs), 0
        return self.doc

    def here(self, digest: str) -> dict[str, Any]:
        doc = self.current()  # a window that begins where a document ends begins the next one
        where = (self.window, doc.pass_, doc.file, doc.row, doc.document, self.offset, digest)
        return dict(zip(KEYS, where, strict=True))

    def take(self, n: int, keep: bool) -> list[torch.Tensor]:
        """Move ``n`` tokens on; their tokens when ``keep``."""
        out = []
        while n:
            doc = self.current()
            got = min(n, len(doc.tokens) - self.offset)
            if keep:
                out.append(doc.tokens[self.offset : self.offset + got])
            self.offset, n = self.offset + got, n - got
        return out

    def window_tokens(self, seq_len: int) -> torch.Tensor:
        """This window's ``seq_len + 1`` tokens; the reader stops at the next window's start
        (its first token, this one's last label, is read again there)."""
        tokens = self.take(seq_len, keep=True)
        last = self.current().tokens[self.offset : self.offset + 1]
        self.window += 1
        return torch.cat([*tokens, last])


class StreamWindows(Dataset[Any]):
    """The training split of ``--dataset hf``: windows read forward only, by ``fetch``, in the
    order the keys come (``bundle.data.loader`` reads it from one thread ahead of the step)."""

    thread_safe = True  # draws nothing at random; the reader is behind a lock
    endless = True  # no length: one epoch is the run (bundle.data.epoch_steps)

    def __init__(self, cfg: DataConfig, source: Source | None = None) -> None:
        self.source = source or Source(cfg)
        self.seq_len, self.every = cfg.seq_len, 1
        self._lock = threading.Lock()  # the reader: the fetching thread's, or position's
        self._kept_lock = threading.Lock()
        self._kept: dict[int, dict[str, Any]] = {}  # where remembered windows begin
        self._reader: Reader | None = None

    def _fresh(self) -> Reader:
        docs = self.source.documents((0, 0, 0, 0), held_out=False, endless=True)
        return Reader(docs, 0)

    @property
    def reader(self) -> Reader:
        if self._reader is None:
            self._reader = self._fresh()
        return self._reader

    def seek(self, window: int, position: dict | None, every: int) -> None:
        """Read from window ``window`` on, from ``position`` (what ``position(window)`` said
        in an earlier run) when given, else from the stream's start; remember where every
        ``every``-th window begins (a checkpoint asks for those)."""
        if window < 0 or every < 1:
            raise ValueError(f"seek({window}, ..., every={every}): window >= 0, every >= 1")
        with self._lock:
            self.every = every
            with self._kept_lock:
                self._kept.clear()
            at = self.checked(position) if position is not None else None
            if at is not None and at["window"] <= window:
                self._reader = self._resumed(at)
            else:
                if window > 0:
                    log.get().info(
                        f"--dataset hf: no stream position recorded for window {window}: reading "
                        "the stream from its start up to it (the same windows, only slower)"
                    )
                self._reader = self._fresh()
            self._skip_to(window)
            self._remember()

    def checked(self, position: Any) -> dict[str, Any]:
        """``position`` as data: the keys of ``KEYS``, integers >= 0, this run's files."""
        if not isinstance(position, dict) or set(position) != set(KEYS):
            got = list(position) if isinstance(position, dict) else position
            self._malformed(f"keys {shown(got)}")
        for key in KEYS[:-1]:
            value = position[key]
            if type(value) is not int or value < 0:
                self._malformed(f"{key} {shown(value)}")
        if not isinstance(position["files"], str):
            self._malformed(f"files {shown(position['files'])}")
        if position["files"] != self.source.digest:
            raise DataError(OTHER_FILES)
        if position["file"] >= len(self.source.files):
            self._malformed(f"file {position['file']} of {len(self.source.files)}")
        if is_val(position["document"], VAL_FRACTION):
            self._malformed(f"document {position['document']} is held out")
        return position

    @staticmethod
    def _malformed(what: str) -> NoReturn:
        raise DataError(
            f"the checkpoint's data_position is malformed ({what}); expected {', '.join(KEYS)}: "
            "integers >= 0 and the files' digest"
        )

    def _resumed(self, at: dict[str, Any]) -> Reader:
        start = (at["pass"], at["file"], at["row"], at["document"])
        docs = self.source.documents(start, held_out=False, endless=True)
        doc = next(docs)
        if (doc.file, doc.row) != (at["file"], at["row"]):
            path = self.source.files[at["file"]]
            raise DataError(f"{OTHER_FILES} ({path} has no row {at['row'] + 1})")
        if at["offset"] >= len(doc.tokens):
            self._malformed(f"offset {at['offset']}: document {at['document']} has fewer tokens")
        return Reader(docs, at["window"], doc, at["offset"])

    def _remember(self) -> None:
        reader = self.reader
        if reader.window % self.every:
            return
        with self._kept_lock:
            if reader.window not in self._kept:
                self._kept[reader.window] = reader.here(self.source.digest)
                while len(self._kept) > _KEPT:
                    del self._kept[next(iter(self._kept))]  # the oldest: asked for by no one

    def _skip_to(self, window: int) -> None:
        """Move the reader to window ``window`` (tokenized, not kept), remembering on the way."""
        reader = self.reader
        while reader.window < window:
            self._remember()
            stop = min(window, (reader.window // self.every + 1) * self.every)
            reader.take((stop - reader.window) * self.seq_len, keep=False)
            reader.window = stop

    def _windows(self, keys: torch.Tensor) -> torch.Tensor:
        rows = []
        with self._lock:
            for key in keys.tolist():
                if key < self.reader.window:
                    raise DataError(
                        f"--dataset hf: window {key} asked for at window {self.reader.window}: "
                        "a stream is read forward only"
                    )
                self._skip_to(key)
                self._remember()
                rows.append(self.reader.window_tokens(self.seq_len))
        t = self.seq_len
        return torch.stack(rows) if rows else torch.empty(0, t + 1, dtype=torch.long)

    def fetch(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, labels) of windows ``keys`` (increasing, not behind the reader)."""
        w = self._windows(keys)
        return w[:, :-1], w[:, 1:]

    def fetch_labels(self, keys: torch.Tensor) -> torch.Tensor:
        """The labels alone (the loss's stage): the same reading, the inputs dropped."""
        return self._windows(keys)[:, 1:]

    def position(self, window: int) -> dict[str, Any] | None:
        """Where window ``window`` begins (``KEYS``), for a checkpoint: remembered if the reader
        has passed it, else found by moving the reader to it (the fetching thread asks for no
        window before it). None if a fetch in progress holds the reader past ``WAIT`` seconds."""
        deadline = time.monotonic() + WAIT
        got = self._known(window)
        while got is None:
            if self._lock.acquire(timeout=0.05):
                try:
                    got = self._known(window) or self._advanced(window)
                finally:
                    self._lock.release()
            elif (got := self._known(window)) is None and time.monotonic() > deadline:
                log.notice(
                    f"--dataset hf: the stream's reader was busy for {WAIT:g}s: this checkpoint "
                    "records no stream position (a resume from it reads the stream from its start)"
                )
                return None
        with self._kept_lock:  # a later checkpoint asks for a later window
            for old in [w for w in self._kept if w < window]:
                del self._kept[old]
        return dict(got)

    def _known(self, window: int) -> dict[str, Any] | None:
        with self._kept_lock:
            return self._kept.get(window)

    def _advanced(self, window: int) -> dict[str, Any]:
        reader = self.reader
        if reader.window > window:
            raise DataError(
                f"--dataset hf: where window {window} begins was not kept (the reader is at "
                f"window {reader.window}; every {self.every}th window is kept)"
            )
        self._skip_to(window)
        self._remember()
        return self._known(window) or reader.here(self.source.digest)


def spec(cfg: DataConfig) -> tuple[int, tuple[int, ...]]:
    """(vocabulary, input shape), without reading the files."""
    return tokenizer.load(cfg.tokenizer).vocab, (cfg.seq_len,)


def splits(cfg: DataConfig, needs_val: bool) -> DataSplits:
    """The training stream and the validation windows (empty without ``needs_val``)."""
    source = Source(cfg)
    t = cfg.seq_len
    empty = TensorDataset(torch.empty(0, t, dtype=torch.long), torch.empty(0, t, dtype=torch.long))
    val = source.validation(VAL_WINDOWS) if needs_val else empty
    vocab, shape = spec(cfg)
    return DataSplits(StreamWindows(cfg, source), val, vocab, shape)


def check(cfg: DataConfig, *, needs_val: bool) -> None:
    """Before any process starts: ``datasets`` imports, the files match, the first training
    row has ``--text-field``, and (``needs_val``) a held-out window is there."""
    datasets_package()
    source = Source(cfg)
    first = next(source.documents((0, 0, 0, 0), held_out=False, endless=False), None)
    if first is None:
        raise DataError(f"--data-files {cfg.data_files}: no document to train on")
    if needs_val and not len(source.validation(1)):
        raise DataError(
            f"--data-files {cfg.data_files}: no held-out document (one in "
            f"{round(1 / VAL_FRACTION)}) makes a window of --seq-len {cfg.seq_len} + 1 tokens; "
            "--no-eval trains without one (or prepare the corpus: python -m bundle.data prepare)"
        )
