"""``--dataset hf --label-field``: each row of .jsonl, .jsonl.gz, .json or .parquet files is one
classification sample, its text tokenized when read, cut or padded to ``--seq-len`` with a mask
of its real tokens, its label a class index or a name indexed in sorted order; rows are held out
by a hash of their number; bad rows and files are one line. Files of a few rows in tmp_path."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from bundle import cli
from bundle.config import DataConfig
from bundle.data import classify, sources, tokenizer
from bundle.data.prepare import is_val
from bundle.data.samples import known_labels
from bundle.errors import ConfigError, DataError

T = 8
FRACTION = 0.3  # about a third held out, so a dozen rows hold some (the run's is 0.1)
TEXTS = ["a fine film", "bad", "", "the longest of them all, by far", "ok ok", "twelve chars"]


@pytest.fixture(autouse=True)
def held_out(monkeypatch):
    monkeypatch.setattr(classify, "VAL_FRACTION", FRACTION)


def cfg_of(files: str, **kw) -> DataConfig:
    return DataConfig(dataset="hf", data_files=files, label_field="label", seq_len=T, **kw)


def write_jsonl(path, rows: list[dict]) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def rows_of(n: int, label=lambda i: i % 3) -> list[dict]:
    return [{"text": TEXTS[i % len(TEXTS)], "label": label(i), "other": i} for i in range(n)]


def byte_sample(text: str) -> tuple[list[int], list[int]]:
    """The input ids and mask of ``text`` as byte tokens: cut or padded (with 0) to T."""
    ids = list(text.encode())[:T]
    return ids + [0] * (T - len(ids)), [1] * len(ids) + [0] * (T - len(ids))


def test_each_row_is_a_sample_cut_or_padded_to_seq_len_with_its_mask(tmp_path):
    rows = rows_of(12)
    split = sources.load(cfg_of(write_jsonl(tmp_path / "a.jsonl", rows)), seed=0)
    train = [r for d, r in enumerate(rows) if not is_val(d, FRACTION)]
    assert len(split.train) == len(train) and len(split.val) == len(rows) - len(train)
    for i, row in enumerate(train):
        x, y = split.train[i]
        assert set(x) == {"input_ids", "attention_mask"}
        for t in x.values():
            assert t.dtype == torch.long and t.shape == (T,)
        ids, mask = byte_sample(row["text"])
        assert x["input_ids"].tolist() == ids and x["attention_mask"].tolist() == mask
        assert y.dtype == torch.long and y.dim() == 0 and int(y) == row["label"]
    lengths = {len(r["text"]) for r in train}
    assert min(lengths) < T < max(lengths)  # some padded, some cut
    assert split.num_classes == 3 and split.input_shape == (T,)
    assert split.inputs is not None and split.inputs.names == ("input_ids", "attention_mask")
    first = split.train[0][0]
    assert all(torch.equal(split.inputs.rows[i], first[n]) for i, n in enumerate(classify.NAMES))
    assert split.train.targets.tolist() == [r["label"] for r in train]
    assert torch.equal(known_labels(split.train), split.train.targets)  # the loss stage's read
    assert split.train.classes is None


def test_rows_are_counted_across_files_and_held_out_by_a_hash_of_their_number(tmp_path):
    rows = rows_of(20)
    write_jsonl(tmp_path / "a.jsonl", rows[:7])
    write_jsonl(tmp_path / "b.jsonl.gz", rows[7:])
    split = sources.load(cfg_of(f"{tmp_path}/*.jsonl*"), seed=0)
    held = [r for d, r in enumerate(rows) if is_val(d, FRACTION)]
    train = [r for d, r in enumerate(rows) if not is_val(d, FRACTION)]
    assert held and train and any(is_val(d, FRACTION) for d in range(7, 20))  # both files
    assert split.val.targets.tolist() == [r["label"] for r in held]
    assert split.train.targets.tolist() == [r["label"] for r in train]
    for i, row in enumerate(held):
        assert split.val[i][0]["input_ids"].tolist() == byte_sample(row["text"])[0]
    no_eval = sources.load(cfg_of(f"{tmp_path}/*.jsonl*"), seed=0, needs_val=False)
    assert len(no_eval.val) == 0 and len(no_eval.train) == len(split.train)
    assert classify.train_size(cfg_of(f"{tmp_path}/*.jsonl*")) == len(split.train)


def test_class_names_are_indexed_in_sorted_order(tmp_path):
    names = ["pos", "neg", "neutral"]
    rows = rows_of(12, label=lambda i: names[i % 3])
    (tmp_path / "a.json").write_text(json.dumps(rows))  # a .json file holding a list
    cfg = cfg_of(f"{tmp_path}/a.json")
    split = sources.load(cfg, seed=0)
    assert split.train.classes == ["neg", "neutral", "pos"] and split.num_classes == 3
    train = [r for d, r in enumerate(rows) if not is_val(d, FRACTION)]
    want = [["neg", "neutral", "pos"].index(r["label"]) for r in train]
    assert split.train.targets.tolist() == want
    assert sources.input_spec(cfg) == (3, (T,))
    assert sources.input_spec(cfg_of(f"{tmp_path}/a.json", num_classes=3)) == (3, (T,))
    with pytest.raises(DataError, match="--num-classes 4: .* has 3 class names"):
        sources.input_spec(cfg_of(f"{tmp_path}/a.json", num_classes=4))


def test_parquet_rows_read_as_json_lines_do(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = rows_of(12, label=lambda i: ["b", "a"][i % 2])
    columns = {k: [r[k] for r in rows] for k in ("other", "text", "label")}
    pq.write_table(pa.table(columns), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", rows)
    from_parquet = sources.load(cfg_of(f"{tmp_path}/a.parquet"), seed=0)
    from_json = sources.load(cfg_of(f"{tmp_path}/b.jsonl"), seed=0)
    assert from_parquet.train.classes == ["a", "b"]
    assert torch.equal(from_parquet.train.targets, from_json.train.targets)
    for i in range(len(from_json.train)):
        x, y = from_parquet.train[i]
        want, label = from_json.train[i]
        assert int(y) == int(label)
        assert all(torch.equal(x[n], want[n]) for n in classify.NAMES)
    # The classes are the label column's alone: a text column of numbers is never read.
    pq.write_table(pa.table({"text": [1, 2], "label": [0, 4]}), tmp_path / "c.parquet")
    assert sources.input_spec(cfg_of(f"{tmp_path}/c.parquet")) == (5, (T,))


def test_rows_are_tokenized_when_read_never_up_front(tmp_path, monkeypatch):
    encoded: list[str] = []

    class Counting(tokenizer.Bytes):
        def encode(self, text: str) -> list[int]:
            encoded.append(text)
            return super().encode(text)

    monkeypatch.setattr(tokenizer, "load", lambda path: Counting())
    split = sources.load(cfg_of(write_jsonl(tmp_path / "a.jsonl", rows_of(12))), seed=0)
    assert len(encoded) == 1  # the first training sample: the inputs' example
    split.train[3]
    assert len(encoded) == 2


def test_a_tokenizers_pad_token_pads(tmp_path, monkeypatch):
    monkeypatch.setattr(classify, "VAL_FRACTION", 0.0)  # every row trains
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    words = tokenizer.load(str(tmp_path))
    assert classify.pad_id(words) == 1 and classify.pad_id(tokenizer.Bytes()) == 0
    rows = [{"text": "bad", "label": 0}, {"text": TEXTS[3] * 3, "label": 1}]
    cfg = cfg_of(write_jsonl(tmp_path / "a.jsonl", rows), tokenizer=str(tmp_path))
    split = sources.load(cfg, seed=0, needs_val=False)
    x, _ = split.train[0]
    ids = words.encode("bad")
    assert x["input_ids"].tolist() == ids + [1] * (T - len(ids))
    assert x["attention_mask"].tolist() == [1] * len(ids) + [0] * (T - len(ids))
    assert split.train[1][0]["input_ids"].tolist() == words.encode(TEXTS[3] * 3)[:T]


BAD_ROWS = {
    "no text": ([{"text": "a", "label": 0}, {"body": "b", "label": 1}], r"a.jsonl: row 2: no field 'text' \(--text-field\)"),
    "no label": ([{"text": "a", "label": 0}, {"text": "b"}], r"a.jsonl: row 2: no field 'label' \(--label-field\)"),
    "a null label": ([{"text": "a", "label": None}], r"a.jsonl: row 1: no field 'label'"),
    "a text that is no text": ([{"text": 3, "label": 0}], r"a.jsonl: row 1: field 'text' is int, not text"),
    "a negative label": ([{"text": "a", "label": 0}, {"text": "b", "label": -1}], r"a.jsonl: row 2: label -1 is neither a class index"),
    "a fraction": ([{"text": "a", "label": 1.5}], r"a.jsonl: row 1: label 1.5 is neither"),
    "a boolean": ([{"text": "a", "label": True}], r"a.jsonl: row 1: label True is neither"),
    "a list": ([{"text": "a", "label": [1]}], r"a.jsonl: row 1: label \[1\] is neither"),
    "both kinds": ([{"text": "a", "label": 0}, {"text": "b", "label": "x"}], r"labels mix class indices \(.*a.jsonl: row 1\) and class names \(.*a.jsonl: row 2\)"),
    "no object": ([[1, 2]], r"a.jsonl: row 1: a JSON list, not an object"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_one_line_naming_its_file_and_row(tmp_path, case):
    rows, message = BAD_ROWS[case]
    cfg = cfg_of(write_jsonl(tmp_path / "a.jsonl", rows))
    with pytest.raises(DataError, match=message) as err:
        sources.load(cfg, seed=0, needs_val=False)
    assert "\n" not in str(err.value)


def test_what_cannot_be_read_or_trained_on_is_one_line(tmp_path, monkeypatch):
    def refused(cfg: DataConfig, match: str, needs_val: bool = False) -> None:
        with pytest.raises(DataError, match=match) as err:
            sources.load(cfg, seed=0, needs_val=needs_val)
        assert "\n" not in str(err.value)

    (tmp_path / "a.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "lab\n')
    refused(cfg_of(f"{tmp_path}/a.jsonl"), r"a.jsonl: row 2: not JSON")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a", "label": 0}\n' * 50)[:40])
    refused(cfg_of(f"{tmp_path}/b.jsonl.gz"), r"b.jsonl.gz: cannot be read")
    (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    refused(cfg_of(f"{tmp_path}/c.parquet"), r"c.parquet: cannot be read")
    refused(cfg_of(f"{tmp_path}/none*.jsonl"), r"none\*\.jsonl: no file matches")
    (tmp_path / "empty.jsonl").write_text("\n")
    refused(cfg_of(f"{tmp_path}/empty.jsonl"), r"no rows to train on \(the files hold none\)")
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": 0}])
    monkeypatch.setattr(classify, "VAL_FRACTION", 1.0)
    refused(cfg_of(one), r"no rows to train on \(1 rows, every one held out")
    monkeypatch.setattr(classify, "VAL_FRACTION", 0.001)
    refused(cfg_of(one), r"no row is held out for validation .* --no-eval", needs_val=True)
    assert len(sources.load(cfg_of(one), seed=0, needs_val=False).train) == 1
    two = write_jsonl(tmp_path / "two.jsonl", [{"text": "a", "label": 4}])
    refused(cfg_of(two, num_classes=3), r"--num-classes 3: .* has class index 4")


def test_a_parquet_file_without_a_column_names_its_first_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["a"], "label": [0]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: row 1: no field 'text' \(--text-field; its"):
        sources.load(cfg_of(f"{tmp_path}/a.parquet"), seed=0, needs_val=False)
    pq.write_table(pa.table({"text": ["a", None], "label": [0, 1]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: row 2: no field 'text'"):
        sources.load(cfg_of(f"{tmp_path}/a.parquet"), seed=0, needs_val=False)


def test_the_label_field_is_a_flag_of_hf_alone():
    cfg = cli.parse(["--dataset", "hf", "--data-files", "x.jsonl", "--label-field", "y"], {})
    assert cfg.data.label_field == "y" and cli.parse([], {}).data.label_field is None
    with pytest.raises(ConfigError, match="--label-field: 'y' .* --dataset hf, not digits"):
        DataConfig(label_field="y")
    with pytest.raises(ConfigError, match="name the field holding a row's class"):
        DataConfig(dataset="hf", data_files="x.jsonl", label_field="")
