"""Token shards on disk (``bundle.data.shards``): the smallest dtype, shards cut at documents,
an index that trusts nothing it reads (digest, version, plain names, sizes, hashes), and a stream
that reads one split across its shards through memory maps."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from bundle.data import shards
from bundle.data.prepare import Options, prepare
from bundle.data.shards import Index, ShardWriter, TokenStream, dtype_for
from bundle.errors import DataError

DOCS = [f"document {i}: " + "words " * (i % 5) for i in range(40)]


@pytest.fixture
def corpus(tmp_path):
    """A byte-level corpus of 40 documents in shards of about 60 tokens, a tenth validating."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "corpus"
    prepare(Options(inputs=(str(src),), out=str(out), val_fraction=0.1, shard_tokens=60))
    return out


def rewrite(directory, change):
    """Change index.json's record and give it a matching digest (a well-made but wrong index)."""
    path = directory / "index.json"
    meta = json.loads(path.read_text())
    change(meta)
    meta["digest"] = shards.content_digest(meta)
    path.write_text(json.dumps(meta))


def test_the_dtype_is_the_smallest_that_holds_every_token_id():
    assert dtype_for(256) == np.uint8
    assert dtype_for(257) == np.uint16
    assert dtype_for(65_536) == np.uint16
    assert dtype_for(65_537) == np.uint32
    with pytest.raises(DataError, match="does not fit in uint32"):
        dtype_for(2**32 + 1)


def test_a_writer_cuts_shards_at_documents_and_gives_a_long_one_a_shard_of_its_own(tmp_path):
    writer = ShardWriter(str(tmp_path), "train", np.dtype("uint8"), 10)
    for n in (4, 4, 4):  # 8 fit, the third would make 12: it begins the next shard
        writer.add(np.full(n, n, np.uint8), True)
    for _ in range(5):  # 25 tokens in pieces: known not to fit once past 10, then written through
        writer.add(np.full(5, 25, np.uint8), False)
    writer.add(np.zeros(1, np.uint8), True)
    writer.add(np.full(3, 3, np.uint8), True)
    split = writer.finish()
    got = [(s["file"], s["documents"], s["tokens"]) for s in split["shards"]]
    assert got == [
        ("train-00000.bin", 2, 8),
        ("train-00001.bin", 1, 4),
        ("train-00002.bin", 1, 26),
        ("train-00003.bin", 1, 3),
    ]
    assert (split["documents"], split["tokens"]) == (5, 41)
    assert (tmp_path / "train-00002.bin").read_bytes() == bytes([25] * 25 + [0])


def test_an_index_reads_back_what_prepare_wrote(corpus):
    index = Index.read(str(corpus))
    index.verify()
    assert index.dtype == np.uint8 and index.tokenizer["kind"] == "bytes"
    assert index.tokenizer["end_of_text"] == 0 and index.tokenizer["vocab"] == 256
    total = sum(len(d.encode()) + 1 for d in DOCS)
    assert index.tokens("train") + index.tokens("val") == total
    assert len(index.splits["train"]["shards"]) > 2 and index.tokens("val") > 0
    with pytest.raises(DataError, match="no split 'test'"):
        index.tokens("test")


def test_a_truncated_shard_is_one_line_naming_it_and_both_sizes(corpus):
    shard = corpus / "train-00001.bin"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(DataError) as err:
        Index.read(str(corpus))
    assert f"shard {shard} is {size - 3} bytes, expected {size}" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_shard_is_named(corpus):
    (corpus / "val-00000.bin").unlink()
    with pytest.raises(DataError, match="val-00000.bin: No such file"):
        Index.read(str(corpus))


def test_a_changed_index_fails_its_digest(corpus):
    path = corpus / "index.json"
    meta = json.loads(path.read_text())
    meta["val_fraction"] = 0.5
    path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="digest does not match"):
        Index.read(str(corpus))


@pytest.mark.parametrize("name", ["../train-00000.bin", "/etc/passwd", "sub/x.bin", ".hidden"])
def test_a_shard_name_that_is_not_a_plain_file_name_is_refused(corpus, name):
    rewrite(corpus, lambda m: m["splits"]["train"]["shards"][0].update(file=name))
    with pytest.raises(DataError, match="is not a plain file name"):
        Index.read(str(corpus))


def test_an_unknown_version_is_refused(corpus):
    rewrite(corpus, lambda m: m.update(version=2))
    with pytest.raises(DataError, match="version 2 is unknown; this Bundle reads version 1"):
        Index.read(str(corpus))


def test_split_totals_that_disagree_with_their_shards_are_refused(corpus):
    rewrite(corpus, lambda m: m["splits"]["val"].update(tokens=m["splits"]["val"]["tokens"] + 1))
    with pytest.raises(DataError, match="split 'val' says"):
        Index.read(str(corpus))


def test_an_index_that_is_not_json_is_refused(corpus):
    (corpus / "index.json").write_bytes(b"\x80\x04K\x01.")  # a pickle: never loaded as one
    with pytest.raises(DataError, match="is not JSON"):
        Index.read(str(corpus))


def test_verify_finds_a_flipped_byte(corpus):
    shard = corpus / "train-00002.bin"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0x01
    shard.write_bytes(bytes(raw))
    index = Index.read(str(corpus))  # the size is right: only the hash tells
    with pytest.raises(DataError, match=r"train-00002.bin: its SHA-256 differs"):
        index.verify()


def test_a_directory_without_an_index_is_not_a_corpus(tmp_path):
    partial = tmp_path / "corpus.partial"
    partial.mkdir()
    (partial / "train-00000.bin").write_bytes(b"abc\0")
    with pytest.raises(DataError, match="no index.json, not a prepared corpus .a .partial"):
        Index.read(str(partial))


def test_a_stream_reads_any_window_across_shard_boundaries(corpus):
    index = Index.read(str(corpus))
    for split in ("train", "val"):
        files = [corpus / s["file"] for s in index.splits[split]["shards"]]
        whole = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8).astype(np.int64)
        stream = TokenStream(index, split)
        assert len(stream) == len(whole) == index.tokens(split)
        for start in range(0, len(whole), 7):
            for length in (0, 1, 59, 61, 130):
                if start + length <= len(whole):
                    got = stream.read(start, length)
                    assert got.dtype == np.int64
                    assert got.tolist() == whole[start : start + length].tolist()


def test_a_window_outside_the_stream_is_an_index_error(corpus):
    stream = TokenStream(Index.read(str(corpus)), "train")
    with pytest.raises(IndexError, match=f"outside 0..{len(stream)}"):
        stream.read(len(stream) - 2, 3)
    with pytest.raises(IndexError):
        stream.read(-1, 1)


def test_a_stream_pickles_and_reads_the_same_elsewhere(corpus):
    stream = TokenStream(Index.read(str(corpus)), "train")
    first = stream.read(50, 20)
    assert pickle.loads(pickle.dumps(stream)).read(50, 20).tolist() == first.tolist()


def test_reading_a_window_of_a_large_shard_touches_only_its_pages(tmp_path):
    """A 512 MiB shard (sparse: no disk) read at three places: the process's peak memory
    grows by far less than the shard, so nothing reads it whole."""
    size = 512 << 20
    with open(tmp_path / "train-00000.bin", "wb") as f:
        f.truncate(size)
    splits = {
        "train": {
            "documents": 1,
            "tokens": size,
            "shards": [
                {"file": "train-00000.bin", "documents": 1, "tokens": size, "sha256": "0" * 64}
            ],
        },
        "val": {"documents": 0, "tokens": 0, "shards": []},
    }
    shards.write_index(str(tmp_path), shards.tokenizer_identity(None), "text", 0.0, [], splits)
    probe = (
        "import resource, sys\n"
        "from bundle.data.shards import Index, TokenStream\n"
        "stream = TokenStream(Index.read(sys.argv[1]), 'train')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for at in (0, len(stream) // 2, len(stream) - 4096):\n"
        "    assert stream.read(at, 4096).sum() == 0\n"
        "# windows from all over the shard, as training draws them: none stays resident\n"
        "for at in range(0, len(stream) - 4096, len(stream) // 2000):\n"
        "    stream.read(at, 257)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    grown_kib = int(out.stdout.strip())
    assert grown_kib < 32 << 10, f"reading 2,000 windows grew the peak by {grown_kib} KiB"


def test_the_tokenizer_record_names_its_kind_vocabulary_and_files(tmp_path):
    from tokenizers import Tokenizer, models

    assert shards.tokenizer_identity(None) == {
        "kind": "bytes",
        "path": None,
        "vocab": 256,
        "end_of_text": 0,
        "sha256": None,
    }
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    record = shards.tokenizer_identity(str(tmp_path))
    assert record["kind"] == "tokenizer.json" and record["path"] == os.path.abspath(tmp_path)
    assert (record["vocab"], record["end_of_text"]) == (4, 3)
    assert record["sha256"] == shards.tokenizer_digest(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"not the tokenizer")  # not one of its files
    assert shards.tokenizer_digest(str(tmp_path)) == record["sha256"]
    Tokenizer(models.WordLevel({**vocab, "c": 4}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    assert shards.tokenizer_digest(str(tmp_path)) != record["sha256"]


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(DataError, match="has no end-of-text token"):
        shards.tokenizer_identity(str(tmp_path))


def test_a_transformers_directory_is_its_tokenizer_files_and_its_eos_token(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tm
    from transformers import GPT2Tokenizer

    bpe = Tokenizer(tm.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(DOCS, trainer)
    bpe.model.save(str(tmp_path))  # vocab.json, merges.txt: what a GPT-2 tokenizer reads
    slow = tmp_path / "slow"
    GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")).save_pretrained(slow)
    (slow / "tokenizer.json").unlink(missing_ok=True)  # its vocab and merges files only
    for name in ("vocab.json", "merges.txt"):
        (slow / name).write_bytes((tmp_path / name).read_bytes())
    (slow / "model.safetensors").write_bytes(b"weights are not the tokenizer")
    record = shards.tokenizer_identity(str(slow))
    assert record["kind"] == "transformers"
    assert record["end_of_text"] == bpe.token_to_id("<|endoftext|>")
    before = record["sha256"]
    (slow / "model.safetensors").write_bytes(b"other weights")
    assert shards.tokenizer_digest(str(slow)) == before
    (slow / "merges.txt").write_text((slow / "merges.txt").read_text() + "\n")
    assert shards.tokenizer_digest(str(slow)) != before
