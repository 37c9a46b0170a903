"""``python -m bundle.data prepare``: text files, .jsonl(.gz), .parquet and saved datasets
tokenized once (bytes, or a tokenizer.json trained here) into shards that read back as each
document followed by end-of-text, split by the hash rule, the same with any number of workers;
a bad input is one line naming it, and nothing is left behind."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re

import pytest

from bundle.data import prepare as prep
from bundle.data import tokenizer
from bundle.data.__main__ import main
from bundle.data.prepare import Options, is_val, prepare
from bundle.data.shards import Index, TokenStream
from bundle.errors import ConfigError
from tests.support.tokenizers import byte_level_bpe

SENTENCE = "the quick brown fox jumps over the lazy dog and a lazy dog sleeps in the sun"
WORDS = SENTENCE.split()


def texts(n, seed):
    """``n`` documents of a few lines each, some with non-ASCII characters."""
    return [
        "\n".join(
            " ".join(WORDS[(seed + i * 7 + j * 3 + k) % len(WORDS)] for k in range(3 + j % 4))
            + (" é" if (i + j) % 5 == 0 else "")
            for j in range(1 + i % 4)
        )
        + "\n"
        for i in range(n)
    ]


@pytest.fixture
def inputs(tmp_path):
    """(input paths, their documents in order): two text files, a .jsonl and a .jsonl.gz."""
    src = tmp_path / "src"
    src.mkdir()
    docs = texts(2, 0) + texts(9, 1) + texts(8, 2)
    (src / "a.txt").write_text(docs[0])
    (src / "b.txt").write_text(docs[1])
    (src / "c.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": 1}) + "\n" for d in docs[2:11])
    )
    with gzip.open(src / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[11:]))
    names = ("a.txt", "b.txt", "c.jsonl", "d.jsonl.gz")
    return [str(src / n) for n in names], docs


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE of 300 tokens trained on the test text, ``<|endoftext|>`` among them."""
    return byte_level_bpe(tmp_path_factory.mktemp("bpe"), texts(30, 0))


def expected(docs, fraction, tok=None):
    """Each split's tokens as the rule says: every document's tokens, then end-of-text."""
    words = tokenizer.load(tok)
    eot = tokenizer.end_of_text(words)
    out = {"train": [], "val": []}
    for d, text in enumerate(docs):
        out["val" if is_val(d, fraction) else "train"] += [*words.encode(text), eot]
    return out


def read_back(out):
    index = Index.read(str(out))
    index.verify()
    return index, {s: TokenStream(index, s).read(0, index.tokens(s)).tolist() for s in index.splits}


def run(*argv):
    """main(argv) -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_the_validation_split_is_the_hash_rule():
    def rule(d, f):
        h = hashlib.blake2b(f"{d}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < f

    for f in (0.0, 0.001, 0.3):
        assert [is_val(d, f) for d in range(2000)] == [rule(d, f) for d in range(2000)]
    assert not any(is_val(d, 0.0) for d in range(2000))
    assert 500 < sum(is_val(d, 0.3) for d in range(2000)) < 700


def test_byte_level_shards_are_each_document_then_nul_split_by_the_hash(inputs, tmp_path):
    paths, docs = inputs
    summary = prepare(Options(inputs=tuple(paths), out=str(tmp_path / "out"), val_fraction=0.3))
    index, got = read_back(tmp_path / "out")
    want = expected(docs, 0.3)
    assert got == want and want["val"] and want["train"]
    assert index.dtype.name == "uint8" and index.tokenizer["end_of_text"] == 0
    meta = json.loads((tmp_path / "out" / "index.json").read_text())
    assert [i["documents"] for i in meta["inputs"]] == [1, 1, 9, 8]
    assert summary.documents == 19 and summary.tokens == {s: len(want[s]) for s in want}
    assert not (tmp_path / "out.partial").exists()


def test_a_tokenizer_json_prepares_uint16_ids_ended_by_its_end_of_text(inputs, bpe, tmp_path):
    paths, docs = inputs
    prepare(
        Options(inputs=tuple(paths), out=str(tmp_path / "out"), tokenizer=bpe, val_fraction=0.3)
    )
    index, got = read_back(tmp_path / "out")
    assert index.tokenizer["end_of_text"] == tokenizer.load(bpe).tok.token_to_id("<|endoftext|>")
    assert got == expected(docs, 0.3, bpe)
    assert index.dtype.name == "uint16" and index.tokenizer["kind"] == "tokenizer.json"
    assert len(got["train"]) < sum(len(d.encode()) for d in docs)  # merges: fewer tokens than bytes


def test_parquet_files_and_saved_datasets_are_documents_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    docs = texts(12, 3)
    pq.write_table(
        pa.table({"body": docs[:7], "n": list(range(7))}), tmp_path / "a.parquet", row_group_size=3
    )
    datasets.Dataset.from_dict({"body": docs[7:]}).save_to_disk(str(tmp_path / "saved"))
    prepare(
        Options(
            inputs=(str(tmp_path / "a.parquet"), str(tmp_path / "saved")),
            out=str(tmp_path / "out"),
            text_field="body",
            val_fraction=0.2,
        )
    )
    assert read_back(tmp_path / "out")[1] == expected(docs, 0.2)


def test_small_shards_hold_whole_documents_and_read_across_their_boundaries(inputs, tmp_path):
    paths, docs = inputs
    prepare(
        Options(inputs=tuple(paths), out=str(tmp_path / "out"), val_fraction=0, shard_tokens=100)
    )
    index, got = read_back(tmp_path / "out")
    shards = index.splits["train"]["shards"]
    assert len(shards) > 5 and index.splits["val"]["shards"] == []
    assert got["train"] == expected(docs, 0)["train"]
    stream, at = TokenStream(index, "train"), 0
    for shard in shards:  # each shard ends a document, and a window across its end reads on
        at += shard["tokens"]
        assert stream.read(at - 1, 1).tolist() == [0]
        if at < len(stream):
            assert stream.read(at - 3, 6).tolist() == got["train"][at - 3 : at + 3]
        assert shard["tokens"] <= 100 or shard["documents"] == 1


def test_the_files_are_byte_identical_with_no_pool_and_two_workers(
    inputs, bpe, tmp_path, monkeypatch
):
    paths, _ = inputs
    monkeypatch.setattr(prep, "_BATCH_ITEMS", 2)  # many batches in flight at once
    for workers in (0, 2):
        prepare(
            Options(
                inputs=tuple(paths),
                out=str(tmp_path / f"w{workers}"),
                tokenizer=bpe,
                val_fraction=0.3,
                workers=workers,
                shard_tokens=50,
            )
        )
    names = sorted(p.name for p in (tmp_path / "w0").iterdir())
    assert len(names) > 4 and names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    for name in names:
        assert (tmp_path / "w0" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_a_large_text_file_is_read_in_chunks_at_line_ends_as_one_document(
    tmp_path, bpe, monkeypatch
):
    monkeypatch.setattr(prep, "CHUNK", 64)
    text = "".join(texts(40, 5))
    (tmp_path / "big.txt").write_text(text)
    with open(tmp_path / "big.txt", "rb") as f:
        chunks = list(prep._chunks(f))
    assert len(chunks) > 20 and all(c.endswith(b"\n") for c in chunks)
    assert b"".join(chunks) == text.encode()
    for tok in (None, bpe):
        out = tmp_path / f"out-{tok is None}"
        prepare(
            Options(
                inputs=(str(tmp_path / "big.txt"),), out=str(out), tokenizer=tok, val_fraction=0
            )
        )
        assert read_back(out)[1]["train"] == expected([text], 0, tok)["train"]


def test_a_line_longer_than_the_limit_is_cut_between_characters(monkeypatch):
    monkeypatch.setattr(prep, "CHUNK", 5)
    monkeypatch.setattr(prep, "_LONG_LINE", 8)
    raw = "ééééééééé\nab".encode()  # 2-byte characters, no line end for 19 bytes
    chunks = list(prep._chunks(io.BytesIO(raw)))
    assert b"".join(chunks) == raw and len(chunks) > 2
    assert all(c.decode() for c in chunks)  # every piece is whole characters


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', r"bad.jsonl:3: not JSON"),
        ("bad.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"bad.jsonl:2: no field 'text'"),
        ("bad.jsonl", '{"text": "a"}\n["text"]\n', r"bad.jsonl:2: a JSON list, not an object"),
        ("bad.jsonl", '{"text": 3}\n', r"bad.jsonl:1: field 'text' is int, not text"),
        ("bad.jsonl", '{"text": "a\\u0000b"}\n', r"bad.jsonl:1: a NUL byte"),
        ("bad.txt", "one\ntwo\x00\n", r"bad.txt:2: a NUL byte"),
        ("bad.jsonl.gz", None, r"bad.jsonl.gz: cannot be read after line \d+ \(Compressed file"),
        ("bad.parquet", None, r"bad.parquet: not a readable parquet file"),
        ("missing.txt", "", r"missing.txt: no such file"),
        ("plain", "", r"plain is a directory, not a dataset saved with datasets' save_to_disk"),
    ],
)
def test_a_bad_input_is_one_line_naming_it_and_nothing_is_left(tmp_path, name, content, message):
    good = tmp_path / "good.txt"
    good.write_text("a good document\n")
    bad = tmp_path / name
    if name.endswith(".gz"):
        whole = gzip.compress(
            "".join(json.dumps({"text": t}) + "\n" for t in texts(50, 1)).encode()
        )
        bad.write_bytes(whole[: len(whole) - 40])
    elif name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
        bad.write_bytes(b"PAR1 not really parquet")
    elif name == "plain":
        bad.mkdir()
    elif name != "missing.txt":
        bad.write_text(content)
    out = tmp_path / "out"
    code, stdout, stderr = run("prepare", str(good), str(bad), "--out", str(out), "--workers", "0")
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith("python -m bundle.data prepare: error: ")
    assert re.search(message, stderr), stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_the_first_bad_document_is_the_one_reported_with_two_workers(tmp_path, monkeypatch):
    """The bad line is still being tokenized when the reader finds the next input truncated:
    the line, first in the input, is the error reported, as without a pool."""
    monkeypatch.setattr(prep, "_BATCH_ITEMS", 1)
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n' * 5 + "not json\n")
    whole = gzip.compress(b'{"text": "b"}\n' * 1000)
    (tmp_path / "b.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    for workers in ("0", "2"):
        code, _, stderr = run(
            "prepare",
            str(tmp_path / "a.jsonl"),
            str(tmp_path / "b.jsonl.gz"),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            workers,
        )
        assert code == 2 and "a.jsonl:6: not JSON" in stderr, stderr


def test_an_existing_out_is_refused(inputs, tmp_path):
    (tmp_path / "out").mkdir()
    code, _, stderr = run("prepare", *inputs[0], "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"--out {tmp_path / 'out'}: exists; remove it or choose another --out" in stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_a_partial_left_by_a_killed_run_is_no_corpus_and_a_new_prepare_replaces_it(
    inputs, tmp_path
):
    paths, docs = inputs
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "train-00000.bin").write_bytes(b"half a shard")
    with pytest.raises(Exception, match="no index.json"):
        Index.read(str(partial))
    code, stdout, _ = run("prepare", *paths, "--out", str(tmp_path / "out"), "--workers", "0")
    assert code == 0 and not partial.exists()
    assert read_back(tmp_path / "out")[1] == expected(docs, 0.001)


def test_the_cli_says_what_it_wrote_in_one_line(inputs, tmp_path):
    paths, _ = inputs
    code, stdout, stderr = run(
        "prepare", *paths, "--out", str(tmp_path / "out"), "--workers", "0", "--val-fraction", "0"
    )
    assert code == 0 and stderr == ""
    assert stdout.count("\n") == 1 and stdout.startswith(
        f"prepared {tmp_path / 'out'}: 19 documents"
    )
    assert "val 0 tokens in 0 shards" in stdout and "tokens/s" in stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--val-fraction", "1"], "--val-fraction: 1.0 is not valid"),
        (["--workers", "-1"], "--workers: -1 is not valid"),
        (["--shard-tokens", "0"], "--shard-tokens: 0 is not valid"),
        (["--tokenizer", "/nonexistent"], "no such directory or tokenizer.json"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, flags, message):
    (tmp_path / "a.txt").write_text("a")
    code, _, stderr = run("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), *flags)
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "o").exists()


def test_a_missing_out_flag_is_argparses_usage_and_exit_2(tmp_path):
    assert run("prepare", str(tmp_path))[0] == 2


def test_options_refuse_no_inputs():
    with pytest.raises(ConfigError, match="INPUT"):
        Options(inputs=(), out="x")


def test_the_progress_bar_counts_every_input_byte(inputs, tmp_path):
    paths, _ = inputs
    bar = io.StringIO()
    summary = prepare(Options(inputs=tuple(paths), out=str(tmp_path / "out")), progress=bar)
    total = sum(os.path.getsize(p) for p in paths)
    assert summary.bytes_read == total
    assert total < 1000 and f"prepare: 100%|##########| {total}/{total} [" in bar.getvalue()


@pytest.mark.parametrize("package", ["pyarrow", "datasets"])
def test_an_input_that_needs_a_missing_package_names_it(tmp_path, monkeypatch, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    if package == "pyarrow":
        (tmp_path / "a.parquet").write_bytes(b"PAR1")
        source = tmp_path / "a.parquet"
    else:
        source = tmp_path / "saved"
        source.mkdir()
        (source / "state.json").write_text("{}")
    code, _, stderr = run("prepare", str(source), "--out", str(tmp_path / "out"))
    assert code == 2 and f"needs {package} (pip install {package})" in stderr, stderr


def test_a_saved_dataset_with_splits_is_refused_naming_them(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = {s: datasets.Dataset.from_dict({"text": ["a", "b"]}) for s in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    code, _, stderr = run("prepare", str(tmp_path / "saved"), "--out", str(tmp_path / "out"))
    assert code == 2 and "holds splits train, test; give one" in stderr, stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
