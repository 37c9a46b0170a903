"""``--dataset hf --label-field NAME``: the rows of JSON lines or Parquet files as text
classification samples, a row each: its ``--text-field`` tokenized when it is read, cut or padded
to ``--seq-len`` tokens with an attention mask, and its label.

Rows are counted across the files (every path ``--data-files`` matches, sorted) as the stream
counts documents, and row ``d`` is held out for validation by the same hash of its number, one
row in ten (``VAL_FRACTION``: a labelled set is thousands of rows, not a stream's millions of
documents, and one in a thousand would leave it a handful to validate on). A label is a class index
(an integer >= 0, taken as it is) or a class name (indexed in the names' sorted order:
``classes``), never a mix. Only the two columns are kept: the texts as one Arrow string array
(no Python object per row: forked loader workers share it without copying it), the labels as a
tensor (``targets``: the loss's stage reads them without tokenizing a row).

::

    {"text": "a fine", "label": "pos"}  ->  input_ids      [97 32 102 105 110 101 0 0]
                                            attention_mask [ 1  1   1   1   1   1 0 0]
                                            label          1  (classes: neg, pos; --seq-len 8)
"""

from __future__ import annotations

import gzip
import importlib
import json
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from bundle.config import DataConfig
from bundle.data import data_files, tokenizer
from bundle.data.prepare import is_val
from bundle.data.splits import DataSplits
from bundle.errors import DataError, shown
from bundle.models.inputs import of_sample

NAMES = ("input_ids", "attention_mask")  # a sample's inputs, the primary first
VAL_FRACTION = 0.1  # rows held out for validation
# Pad tokens a tokenizer.json may name when it sets no padding of its own.
_PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _arrow() -> Any:
    """pyarrow (what ``datasets`` reads with): imported when rows are read, one line if absent."""
    try:
        return importlib.import_module("pyarrow")  # optional, and untyped: Any
    except ImportError:
        raise DataError(
            "--label-field reads --data-files with the pyarrow package (pip install datasets)"
        ) from None


def pad_id(tok: tokenizer.Tokenizer) -> int:
    """The id padding is made of: a transformers tokenizer's ``pad_token_id``, a tokenizer.json's
    padding or pad token, else 0. Padded positions are masked out, so any id of the vocabulary
    serves; the tokenizer's own is what a pretrained model saw."""
    inner = getattr(tok, "tok", None)  # the library's tokenizer behind bundle's
    pad = getattr(inner, "pad_token_id", None)
    padding = getattr(inner, "padding", None)  # tokenizers.Tokenizer: None, or its settings
    if pad is None and isinstance(padding, dict):
        pad = padding.get("pad_id")
    if pad is None and callable(token_to_id := getattr(inner, "token_to_id", None)):
        pad = next((i for n in _PAD_TOKENS if (i := token_to_id(n)) is not None), None)
    return pad if isinstance(pad, int) and 0 <= pad < tok.vocab else 0


def _json_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row, value) of each row: a JSON line (.gz too; blank lines are none), or an item of the
    list a .json file holds."""
    row = 0
    try:
        with open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
            if path.endswith(".json") and f.peek(64).lstrip()[:1] == b"[":
                yield from enumerate(json.load(f), 1)
                return
            for line in f:
                if not line.strip():
                    continue
                row += 1
                try:
                    value = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}: row {row}: not JSON ({_first(exc)})") from None
                yield row, value
    except DataError:
        raise
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        after = f" after row {row}" if row else ""
        raise DataError(f"{path}: cannot be read{after} ({_first(exc)})") from None


def _json(path: str, text: str | None, label: str) -> tuple[list[Any] | None, list[Any]]:
    """The ``text`` (None: not read) and ``label`` values of a JSON file's rows (None: absent)."""
    texts: list[Any] = []
    labels: list[Any] = []
    for row, obj in _json_rows(path):
        if not isinstance(obj, dict):
            raise DataError(f"{path}: row {row}: a JSON {type(obj).__name__}, not an object")
        if text is not None:
            texts.append(obj.get(text))
        labels.append(obj.get(label))
    return (texts if text is not None else None), labels


def _parquet(path: str, text: str | None, label: str) -> tuple[Any, list[Any]]:
    """The ``text`` column (an Arrow array; None: not read) and the ``label`` values of a
    Parquet file; a column it lacks is its first row's missing field."""
    pa, pq = _arrow(), importlib.import_module("pyarrow.parquet")
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        for name, flag in ((text, "--text-field"), (label, "--label-field")):
            if name is not None and name not in names and pf.metadata.num_rows:
                raise DataError(
                    f"{path}: row 1: no field {name!r} ({flag}; its columns: {', '.join(names)})"
                )
        columns = [label] if text is None else [text, label]
        table = pf.read(columns=columns) if pf.metadata.num_rows else None
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are many: say which file
        raise DataError(f"{path}: cannot be read ({_first(exc)})") from None
    if table is None:
        return (pa.array([], pa.large_string()) if text is not None else None), []
    labels = table.column(label).to_pylist()
    if text is None:
        return None, labels
    col = table.column(text)
    kind = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: row 1: field {text!r} is {col.type}, not text (--text-field)")
    if col.null_count:
        row = col.to_pylist().index(None) + 1
        raise DataError(f"{path}: row {row}: no field {text!r} (--text-field)")
    return col.cast(pa.large_string()).combine_chunks(), labels


def _texts(values: list[Any], path: str, field: str) -> Any:
    """A JSON file's texts, checked, as one Arrow array."""
    for row, value in enumerate(values, 1):
        if value is None:
            raise DataError(f"{path}: row {row}: no field {field!r} (--text-field)")
        if not isinstance(value, str):
            raise DataError(
                f"{path}: row {row}: field {field!r} is {type(value).__name__}, not text"
            )
    return _arrow().array(values, _arrow().large_string())


class _Labels:
    """The labels as they are read, checked: class indices or class names, never both."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.values: list[int | str] = []
        self.first: dict[type, str] = {}  # where the first index and the first name are

    def add(self, values: list[Any], path: str) -> None:
        for row, value in enumerate(values, 1):
            if value is None:
                raise DataError(f"{path}: row {row}: no field {self.field!r} (--label-field)")
            index = isinstance(value, int) and not isinstance(value, bool)
            if not (isinstance(value, str) or (index and value >= 0)):
                raise DataError(
                    f"{path}: row {row}: label {shown(value)} is neither a class index (an "
                    "integer >= 0) nor a class name (a string)"
                )
            self.first.setdefault(type(value), f"{path}: row {row}")
        if len(self.first) > 1:
            raise DataError(
                f"--label-field {self.field!r}: labels mix class indices ({self.first[int]}) and "
                f"class names ({self.first[str]}); give one kind"
            )
        self.values.extend(values)

    def indexed(self) -> tuple[torch.Tensor, list[str] | None]:
        """The labels as class indices, and the class names (None: they were indices)."""
        if str not in self.first:
            return torch.tensor(self.values, dtype=torch.long), None
        classes = sorted({str(v) for v in self.values})
        index = {name: i for i, name in enumerate(classes)}
        return torch.tensor([index[str(v)] for v in self.values], dtype=torch.long), classes


class Rows(NamedTuple):
    """Every row of the files, in order: its text (None: not read) and its class index."""

    texts: Any  # a pyarrow large_string array
    targets: torch.Tensor
    classes: list[str] | None
    num_classes: int


def read(cfg: DataConfig, *, with_text: bool = True) -> Rows:
    """The rows of ``--data-files``: the labels always, the texts ``with_text`` (else only the
    label column is kept; a Parquet file's text column is not even read)."""
    label = cfg.label_field or ""
    text = cfg.text_field if with_text else None
    texts: list[Any] = []
    labels = _Labels(label)
    for path in data_files.files_of(cfg.data_files or ""):
        if data_files.builder_of(path) == "parquet":
            got, values = _parquet(path, text, label)
        else:
            raw, values = _json(path, text, label)
            got = None if raw is None or text is None else _texts(raw, path, text)
        labels.add(values, path)
        texts.append(got)
    targets, classes = labels.indexed()
    if not len(targets):
        raise DataError(f"--data-files {cfg.data_files}: no rows to train on (the files hold none)")
    joined = _arrow().concat_arrays(texts) if with_text else None
    return Rows(joined, targets, classes, _num_classes(cfg, targets, classes))


def _num_classes(cfg: DataConfig, targets: torch.Tensor, classes: list[str] | None) -> int:
    """The names' count, or one more than the largest index; ``--num-classes`` must match the
    names, and may exceed the indices (a class no row has) but not fall short of them."""
    found = len(classes) if classes is not None else int(targets.max()) + 1
    given = cfg.num_classes
    if given is None:
        return found
    if given < found or (classes is not None and given != found):
        has = f"{found} class names" if classes is not None else f"class index {found - 1}"
        raise DataError(
            f"--num-classes {given}: --label-field {cfg.label_field!r} has {has}; leave "
            "--num-classes out to use its count"
        )
    return given


class TextClasses(Dataset[Sample]):
    """One split: row ``i``'s text tokenized when it is read (never the whole corpus up front),
    cut or padded to ``seq_len`` tokens, with a mask of its real tokens, and its class index."""

    def __init__(self, rows: Rows, index: torch.Tensor, cfg: DataConfig) -> None:
        self.texts = rows.texts.take(_arrow().array(index.numpy()))
        self.targets = rows.targets[index]  # every label, as the loss's stage reads them
        self.classes, self.num_classes = rows.classes, rows.num_classes
        self.seq_len, self.tokenizer = cfg.seq_len, cfg.tokenizer
        self.pad = pad_id(tokenizer.load(cfg.tokenizer))

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> Sample:
        tok, t = tokenizer.load(self.tokenizer), self.seq_len
        text = self.texts[int(i)].as_py()
        if isinstance(tok, tokenizer.Bytes):
            text = text[:t]  # a character is a byte or more: the first t bytes are all in there
        ids = tok.encode(text)[:t]
        n = len(ids)
        input_ids = torch.full((t,), self.pad, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(t, dtype=torch.long)
        mask[:n] = 1
        return {"input_ids": input_ids, "attention_mask": mask}, self.targets[int(i)]


def held_out(n: int) -> torch.Tensor:
    """Which of ``n`` rows validate: the stream's hash rule, one row in ten."""
    return torch.tensor([is_val(d, VAL_FRACTION) for d in range(n)], dtype=torch.bool)


def splits(cfg: DataConfig, needs_val: bool) -> DataSplits:
    """The training rows and the held-out ones (none without ``needs_val``), with the first
    training sample's tensors as the example of the named inputs."""
    rows = read(cfg)
    held = held_out(len(rows.targets))
    train_rows, val_rows = (~held).nonzero().flatten(), held.nonzero().flatten()
    if not len(train_rows):
        raise DataError(
            f"--data-files {cfg.data_files}: no rows to train on ({len(held)} rows, every one "
            "held out for validation)"
        )
    if needs_val and not len(val_rows):
        raise DataError(
            f"--data-files {cfg.data_files}: no row is held out for validation (one in "
            f"{round(1 / VAL_FRACTION)}, by a hash of its number; {len(held)} rows hold "
            "none); --no-eval trains without one"
        )
    train = TextClasses(rows, train_rows, cfg)
    val = TextClasses(rows, val_rows if needs_val else val_rows[:0], cfg)
    inputs = of_sample(train[0][0], f"--dataset hf --label-field {cfg.label_field}")
    return DataSplits(train, val, rows.num_classes, (cfg.seq_len,), inputs=inputs)


def spec(cfg: DataConfig) -> tuple[int, tuple[int, ...]]:
    """(classes, input shape), reading the label column alone."""
    return read(cfg, with_text=False).num_classes, (cfg.seq_len,)


def train_size(cfg: DataConfig) -> int:
    """Rows in the training split, reading the label column alone."""
    return int((~held_out(len(read(cfg, with_text=False).targets))).sum())


def check(cfg: DataConfig, *, needs_val: bool) -> None:
    """Before any process starts: every row has its text and a label, a row trains, and
    (``needs_val``) a row validates; one sample is tokenized."""
    splits(cfg, needs_val)
