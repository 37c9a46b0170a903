"""``--tokenizer DIR``: a tokenizer saved on disk tokenizes ``--dataset text`` (its vocabulary is
the model's classes) and ``bundle.generate`` decodes with it; tokenizer.json or what transformers
reads from a directory; nothing downloaded; one-line refusals. Tokenizers trained here, tiny."""

from __future__ import annotations

import shutil

import pytest
import torch

from bundle import data, generate, models
from bundle.checkpoint import format as ckpt
from bundle.config import DataConfig
from bundle.data import tokenizer
from bundle.errors import ConfigError, DataError

TEXT = "the quick brown fox jumps over the lazy dog; a lazy dog sleeps in the sun. " * 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A byte-level BPE of 300 tokens: (tokenizer.json's directory, the model's vocab/merges dir)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm

    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    root = tmp_path_factory.mktemp("tok")
    (root / "fast").mkdir()
    tok.save(str(root / "fast" / "tokenizer.json"))
    (root / "files").mkdir()
    tok.model.save(str(root / "files"))  # vocab.json, merges.txt: what a GPT-2 tokenizer reads
    return root


def test_a_saved_tokenizer_makes_the_texts_tokens_and_the_models_classes(trained, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = DataConfig(
        dataset="text", data_file=str(corpus), seq_len=8, tokenizer=str(trained / "fast")
    )
    tok = tokenizer.load(str(trained / "fast"))
    assert tok.decode(tok.encode("the lazy fox")) == "the lazy fox"
    assert data.input_spec(cfg) == (tok.vocab, (8,)) and 256 < tok.vocab <= 300
    splits = data.load(cfg, 0, needs_val=True)
    x, y = splits.train[0]
    ids = tok.encode(TEXT)
    assert x.tolist() == ids[:8] and y.tolist() == ids[1:9]  # the next token is the label
    assert len(splits.train) + len(splits.val) < len(TEXT) // 8  # fewer tokens than bytes
    assert splits.num_classes == tok.vocab


def test_what_transformers_reads_from_a_directory_tokenizes_the_same(trained):
    from transformers import GPT2Tokenizer

    slow = trained / "slow"
    GPT2Tokenizer(
        str(trained / "files" / "vocab.json"), str(trained / "files" / "merges.txt")
    ).save_pretrained(slow)
    (slow / "tokenizer.json").unlink(missing_ok=True)  # its vocab and merges files only
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(trained / "files" / name, slow / name)
    auto, fast = tokenizer.load(str(slow)), tokenizer.load(str(trained / "fast"))
    assert type(auto).__name__ == "_Auto"
    assert auto.encode(TEXT[:200]) == fast.encode(TEXT[:200])


def test_bad_tokenizers_are_one_line(trained, tmp_path):
    with pytest.raises(DataError, match="no such directory or tokenizer.json"):
        tokenizer.load(str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="tokenizer.json is not a tokenizer") as bad:
        tokenizer.load(str(tmp_path / "junk"))
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="tokenizes --dataset text, tokens, hf"):
        DataConfig(dataset="synthetic", tokenizer=str(trained / "fast"))
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:900])  # enough bytes, too few tokens for --seq-len 16
    cfg = DataConfig(
        dataset="text", data_file=str(short), seq_len=16, tokenizer=str(trained / "fast")
    )
    with pytest.raises(DataError, match=r"holds \d+ tokens with --tokenizer .*needs at least 340"):
        data.load(cfg, 0, needs_val=True)


def test_generation_encodes_and_decodes_with_the_tokenizer(trained, tmp_path, capsys):
    vocab = tokenizer.load(str(trained / "fast")).vocab
    torch.manual_seed(0)
    model = models.build(
        "gpt", num_classes=vocab, input_shape=(16,), args={"layers": 1, "width": 16, "heads": 2}
    )
    path = str(tmp_path / "w.pt")
    ckpt.save(path, model.state_dict())
    argv = [path, "--model", "gpt", "--model-args", "layers=1,width=16,heads=2", "--seq-len", "16"]
    argv += ["--tokenizer", str(trained / "fast"), "--prompt", "the lazy", "--max-new-tokens", "5"]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("the lazy") and len(out) > len("the lazy\n")
