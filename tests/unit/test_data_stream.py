"""``--dataset hf``: .jsonl, .jsonl.gz and .parquet files streamed, tokenized (bytes, or a
tokenizer.json trained here) and packed into windows that are exactly the training documents'
tokens, each followed by end-of-text, pass after pass; a recorded position resumes the same
windows as reading through; bad positions and rows are one line; the held-out documents are the
validation split. Files of a few dozen rows in tmp_path."""

from __future__ import annotations

import gzip
import json
import sys
import threading

import pytest
import torch

from bundle import data
from bundle.config import DataConfig
from bundle.data import stream, tokenizer
from bundle.data.prepare import is_val
from bundle.errors import DataError
from tests.support.tokenizers import byte_level_bpe

T = 8
FRACTION = 0.2  # a fifth held out, so a few dozen documents hold some (the run's is 0.001)
DROP = "a key left out"  # a malformed position's change that removes the key
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "that", "sleeps"]


def texts(n: int) -> list[str]:
    """``n`` documents from 1 to about 60 bytes: windows span several, and split others."""
    return [
        " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(1 + i * 7 % 11)) for i in range(n)
    ]


@pytest.fixture(autouse=True)
def held_out(monkeypatch):
    monkeypatch.setattr(stream, "VAL_FRACTION", FRACTION)


@pytest.fixture
def corpus(tmp_path):
    """(glob, documents in stream order): a .jsonl, a .jsonl.gz and a .parquet."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = texts(40)
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": d, "n": 1}) + "\n" for d in docs[:12])
    )
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[12:25]))
    pq.write_table(pa.table({"n": list(range(15)), "text": docs[25:]}), tmp_path / "c.parquet")
    return f"{tmp_path}/*.jsonl*,{tmp_path}/*.parquet", docs


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE of 300 tokens with ``<|endoftext|>``, trained on the test's words."""
    return byte_level_bpe(tmp_path_factory.mktemp("bpe"), texts(40))


def cfg_of(files: str, tok: str | None = None) -> DataConfig:
    return DataConfig(dataset="hf", data_files=files, seq_len=T, tokenizer=tok)


def packed(docs: list[str], tok: str | None, held: bool = False) -> list[int]:
    """The documents' tokens, each followed by end-of-text: the training ones (``held``: the
    held-out ones), by the hash rule."""
    words = tokenizer.load(tok)
    eot = tokenizer.end_of_text(words)
    out: list[int] = []
    for d, text in enumerate(docs):
        if is_val(d, FRACTION) == held:
            out += [*words.encode(text), eot]
    return out


def window(tokens: list[int], w: int) -> list[int]:
    """Window ``w`` of the endless stream ``tokens``, ``tokens``, ...: its T + 1 tokens."""
    return [tokens[i % len(tokens)] for i in range(w * T, w * T + T + 1)]


def windows(cfg: DataConfig, keys: list[int], *, at: int = 0, position=None, every=1):
    """(inputs, labels) of ``keys`` read by a fresh reader sought to window ``at``."""
    train = stream.StreamWindows(cfg)
    train.seek(at, position, every)
    return train.fetch(torch.tensor(keys))


@pytest.mark.parametrize("tok", [None, "bpe"])
def test_the_windows_are_the_training_documents_packed_across_files_and_passes(corpus, bpe, tok):
    files, docs = corpus
    tok = bpe if tok else None
    tokens = packed(docs, tok)
    assert any(is_val(d, FRACTION) for d in range(len(docs)))  # some are left out
    n = 2 * len(tokens) // T + 3  # past the end of the files: a second pass and more
    x, y = windows(cfg_of(files, tok), list(range(n)))
    want = torch.tensor([window(tokens, w) for w in range(n)])
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    assert x.dtype == y.dtype == torch.int64


def test_keys_that_skip_windows_read_as_slices_of_the_stream(corpus):
    files, docs = corpus
    tokens = packed(docs, None)
    keys = [1, 2, 5, 9, 10, 40, 41, 90, 200]
    train = stream.StreamWindows(cfg_of(files))
    train.seek(0, None, 4)
    x, y = train.fetch(torch.tensor(keys[:4]))
    labels = train.fetch_labels(torch.tensor(keys[4:]))
    want = torch.tensor([window(tokens, w) for w in keys])
    assert torch.equal(x, want[:4, :-1]) and torch.equal(y, want[:4, 1:])
    assert torch.equal(labels, want[4:, 1:])
    assert train.fetch(torch.tensor([], dtype=torch.long))[0].shape == (0, T)


def test_a_key_behind_the_reader_is_refused_in_one_line(corpus):
    train = stream.StreamWindows(cfg_of(corpus[0]))
    train.seek(0, None, 1)
    train.fetch(torch.tensor([5]))
    with pytest.raises(DataError, match="window 3 asked for at window 6: a stream is read forward"):
        train.fetch(torch.tensor([3]))


@pytest.mark.parametrize("tok", [None, "bpe"])
def test_a_recorded_position_resumes_the_windows_of_the_uninterrupted_stream(corpus, bpe, tok):
    files, docs = corpus
    cfg, every = cfg_of(files, bpe if tok else None), 3
    tokens = packed(docs, cfg.tokenizer)
    n = 3 * len(tokens) // (2 * T)  # into the second pass
    whole = torch.tensor([window(tokens, w) for w in range(n + 10)])
    recorder = stream.StreamWindows(cfg)
    recorder.seek(0, None, every)
    positions = {}
    for w in range(0, n, every):  # asked before the reader gets there: it moves on to it
        positions[w] = recorder.position(w)
        assert recorder.fetch(torch.tensor([w + 1, w + 2]))[0].shape == (2, T)
    assert {p["pass"] for p in positions.values()} == {0, 1}
    for w, position in positions.items():
        x, y = windows(cfg, list(range(w, w + 10)), at=w, position=position, every=every)
        assert torch.equal(x, whole[w : w + 10, :-1]), f"window {w} from {position}"
        assert torch.equal(y, whole[w : w + 10, 1:])
    for w in (0, 9, n // 2, n - n % every):  # the scan from the start: the same windows
        x, _ = windows(cfg, list(range(w, w + 10)), at=w, every=every)
        assert torch.equal(x, whole[w : w + 10, :-1])


def test_a_position_the_reader_has_passed_is_the_one_it_remembered(corpus):
    cfg = cfg_of(corpus[0])
    asked = stream.StreamWindows(cfg)
    asked.seek(6, None, 6)
    want = {w: asked.position(w) for w in (6, 12, 18, 24)}
    ahead = stream.StreamWindows(cfg)
    ahead.seek(6, None, 6)
    ahead.fetch(torch.tensor([7, 20]))  # a fetching thread a few steps ahead of the checkpoint
    assert [ahead.position(w) for w in (6, 12, 18)] == [want[6], want[12], want[18]]
    assert ahead.position(24) == want[24]  # ahead of it again: moved on to
    assert want[12] == {**want[12], "window": 12, "files": stream.files_digest(ahead.source.files)}


def test_a_checkpoint_waits_a_bounded_time_for_a_busy_reader(corpus, monkeypatch):
    monkeypatch.setattr(stream, "WAIT", 0.2)
    train = stream.StreamWindows(cfg_of(corpus[0]))
    train.seek(0, None, 4)
    held, release = threading.Event(), threading.Event()

    def fetch_forever():
        with train._lock:  # a fetch that never ends
            held.set()
            release.wait(10)

    thread = threading.Thread(target=fetch_forever)
    thread.start()
    held.wait(10)
    try:
        assert train.position(8) is None
    finally:
        release.set()
        thread.join()
    assert train.position(8)["window"] == 8  # the reader free: found


def test_a_position_from_other_files_is_refused_in_one_line(corpus, tmp_path):
    files, docs = corpus
    train = stream.StreamWindows(cfg_of(files))
    train.seek(0, None, 1)
    position = train.position(5)
    info = {"data_position": position}
    assert data.check_resume(cfg_of(files), info) == []  # before any process starts: the same files
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "one more"}) + "\n")
    more = stream.StreamWindows(cfg_of(f"{files},{tmp_path}/d.jsonl"))
    with pytest.raises(DataError) as err:
        more.seek(5, position, 1)
    assert str(err.value) == stream.OTHER_FILES
    with pytest.raises(DataError, match=stream.OTHER_FILES):
        data.check_resume(cfg_of(f"{files},{tmp_path}/d.jsonl"), info)


@pytest.mark.parametrize(
    "change",
    [
        {"row": "3"},
        {"offset": -1},
        {"file": True},
        {"document": 2.0},
        {"pass": None},
        {"file": 7},
        {"offset": 10_000},
        {"extra": 1},
        {"files": 12},
        {"window": DROP},
    ],
)
def test_a_malformed_position_is_refused_in_one_line(corpus, change):
    train = stream.StreamWindows(cfg_of(corpus[0]))
    train.seek(0, None, 1)
    position = {k: v for k, v in {**train.position(5), **change}.items() if v is not DROP}
    with pytest.raises(DataError, match="data_position is malformed") as err:
        stream.StreamWindows(cfg_of(corpus[0])).seek(5, position, 1)
    assert "\n" not in str(err.value)


def test_a_position_that_is_no_dict_is_refused_in_one_line(corpus):
    train = stream.StreamWindows(cfg_of(corpus[0]))
    with pytest.raises(DataError, match="malformed"):
        train.seek(5, [5, 0, 0], 1)  # type: ignore[arg-type]


def test_a_row_without_the_text_field_names_its_file_and_row(tmp_path):
    rows = [{"text": "first document"}, {"text": "second"}, {"body": "no text here"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = stream.StreamWindows(cfg_of(f"{tmp_path}/a.jsonl"))
    train.seek(0, None, 1)
    with pytest.raises(DataError) as err:
        train.fetch(torch.arange(6))
    assert str(err.value) == f"{tmp_path}/a.jsonl: row 3: no field 'text' (--text-field)"
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["a column of another name"]}), tmp_path / "b.parquet")
    train = stream.StreamWindows(cfg_of(f"{tmp_path}/b.parquet"))
    with pytest.raises(DataError) as err:
        train.seek(1, None, 1)  # read up to window 1: the first row
    assert str(err.value) == f"{tmp_path}/b.parquet: row 1: no field 'text' (--text-field)"


def test_the_validation_split_holds_the_held_out_documents_windows(corpus, bpe):
    files, docs = corpus
    held = packed(docs, bpe, held=True)
    splits = data.load(cfg_of(files, bpe), seed=0)
    n = (len(held) - 1) // T
    assert n > 2
    x, y = splits.val.tensors
    want = torch.tensor([held[w * T : w * T + T + 1] for w in range(n)])
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    assert splits.num_classes == tokenizer.load(bpe).vocab and splits.input_shape == (T,)
    assert getattr(splits.train, "endless", False)
    assert len(data.load(cfg_of(files), seed=0, needs_val=False).val) == 0


def test_the_validation_split_stops_at_its_windows(corpus, monkeypatch):
    monkeypatch.setattr(stream, "VAL_WINDOWS", 3)
    files, docs = corpus
    held = packed(docs, None, held=True)
    x, _ = data.load(cfg_of(files), seed=0).val.tensors
    assert torch.equal(x, torch.tensor([held[w * T : w * T + T] for w in range(3)]))


def test_a_stream_has_a_vocabulary_and_a_shape_but_no_size(corpus, bpe):
    cfg = cfg_of(corpus[0], bpe)
    assert data.input_spec(cfg) == (tokenizer.load(bpe).vocab, (T,))
    with pytest.raises(DataError, match="a stream: it has no size"):
        data.train_size(cfg)
    data.check_data(cfg, needs_val=True)


def test_the_checks_refuse_what_cannot_be_streamed_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"--data-files .*/none\*\.jsonl: no file matches"):
        data.check_data(cfg_of(f"{tmp_path}/none*.jsonl"))
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(DataError, match=r"notes.txt is not .jsonl, .jsonl.gz, .json or .parquet"):
        data.check_data(cfg_of(f"{tmp_path}/*"))
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    monkeypatch.setattr(stream, "VAL_FRACTION", 0.001)
    with pytest.raises(DataError, match="no held-out document .* --no-eval trains without one"):
        data.check_data(cfg_of(f"{tmp_path}/one.jsonl"), needs_val=True)
    data.check_data(cfg_of(f"{tmp_path}/one.jsonl"), needs_val=False)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet: cannot be read"):
        data.check_data(cfg_of(f"{tmp_path}/bad.parquet"), needs_val=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"pip install datasets"):
        data.check_data(cfg_of(f"{tmp_path}/one.jsonl"), needs_val=False)
