"""``--dataset tokens`` in one process: the order of windows as a pure function without a table,
windows and labels read from a prepared corpus, read ahead on a thread, and its checks."""

from __future__ import annotations

import threading

import pytest
import torch

from bundle.config import DataConfig
from bundle.data import loader, order, tokens
from bundle.data.__main__ import main as data_command
from bundle.errors import DataError


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4099])
def test_the_walked_order_is_a_permutation_of_every_size(n):
    walked = order.Walked(n, seed=3, epoch=1)
    assert sorted(walked[0:n].tolist()) == list(range(n))


def test_the_walked_order_is_a_pure_function_of_seed_epoch_and_position():
    n = 10_007
    whole = order.Walked(n, 5, 2)[0:n]
    assert torch.equal(order.Walked(n, 5, 2)[123:4567], whole[123:4567])  # any slice, any time
    assert not torch.equal(order.Walked(n, 5, 3)[0:n], whole)  # another epoch, another order
    assert not torch.equal(order.Walked(n, 6, 2)[0:n], whole)  # another seed
    assert not torch.equal(whole, torch.arange(n))  # shuffled
    huge = order.Walked(10**12, 5, 2)  # a corpus of a trillion windows costs nothing to order
    assert int(huge[10**11 : 10**11 + 1000].max()) < 10**12


def test_every_replica_of_a_lazy_order_reads_its_rows_of_the_same_global_batches():
    n, batch, seed, steps = 97, 10, 4, 25  # 9 steps an epoch: steps cross two epoch boundaries
    shards = [
        order.Shard(num_bundles=2, micro_batches=2, width=2, bundle=b, replica=r)
        for b in range(2)
        for r in range(2)
    ]
    per_replica = [list(order.replica_indices(s, n, batch, seed, steps, lazy=True)) for s in shards]
    for step in range(steps):
        want = order.global_batch(n, batch, seed, step, lazy=True) + (step // 9) * n
        got = torch.cat([lists[2 * step + m] for m in range(2) for lists in per_replica])
        assert sorted(got.tolist()) == sorted(want.tolist())
    tail = list(order.replica_indices(shards[3], n, batch, seed, steps, start=11, lazy=True))
    assert all(torch.equal(a, b) for a, b in zip(tail, per_replica[3][22:], strict=True))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    docs = []
    for i in range(40):
        (root / f"d{i}.txt").write_text(f"document {i}: " + "abc" * (i + 3))
        docs.append(str(root / f"d{i}.txt"))
    out = root / "corpus"
    assert data_command(["prepare", *docs, "--out", str(out), "--val-fraction", "0.2"]) == 0
    return str(out)


def test_windows_and_their_labels_come_from_the_corpus(corpus):
    cfg = DataConfig(dataset="tokens", data_dir=corpus, seq_len=8)
    train = tokens.windows(cfg, "train")
    stream = train.stream
    assert len(train) == (len(stream) - 1) // 8 > 10
    keys = torch.tensor([3, 0, len(train) + 5])  # a key of the next epoch reads its window
    x, y = train.fetch(keys)
    for row, k in enumerate([3, 0, 5]):
        flat = torch.from_numpy(stream.read(k * 8, 9))
        assert torch.equal(x[row], flat[:-1]) and torch.equal(y[row], flat[1:])
    assert torch.equal(train.fetch_labels(keys), y)
    assert x.dtype == torch.int64 and tokens.spec(cfg) == (256, (8,))


def test_a_corpus_is_read_ahead_on_a_thread_batch_for_batch(corpus):
    cfg = DataConfig(dataset="tokens", data_dir=corpus, seq_len=8)
    train = tokens.windows(cfg, "train")
    keys = [torch.tensor([i, i + 1]) for i in range(0, 20, 2)]
    names: set[str] = set()
    real = train.fetch

    def fetch(k):
        names.add(threading.current_thread().name)
        return real(k)

    train.fetch = fetch  # type: ignore[method-assign]
    got = list(loader.micro_batches(train, iter(keys), workers=0))
    assert names == {"bundle-data-ahead"}
    assert all(
        torch.equal(gx, wx) and torch.equal(gy, wy)
        for (gx, gy), (wx, wy) in zip(got, (real(k) for k in keys), strict=True)
    )


def test_an_error_of_the_read_ahead_thread_is_raised_where_its_batch_was_due():
    def items():
        yield 1
        raise DataError("shard train-00003.bin cannot be read")

    got = loader.ahead(items())
    assert next(got) == 1
    with pytest.raises(DataError, match="train-00003.bin"):
        next(got)


def test_another_tokenizer_or_a_split_without_a_window_is_one_line(corpus, tmp_path):
    other = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(other))
    with pytest.raises(DataError, match="was prepared with another tokenizer") as err:
        tokens.tokenizer_of(DataConfig(dataset="tokens", data_dir=corpus, tokenizer=str(other)))
    assert "\n" not in str(err.value)
    assert tokens.tokenizer_of(DataConfig(dataset="tokens", data_dir=corpus)) is None  # bytes
    long = DataConfig(dataset="tokens", data_dir=corpus, seq_len=100_000)
    with pytest.raises(DataError, match="train split holds no window of --seq-len 100000"):
        tokens.check(long, needs_val=False)


def test_a_run_takes_the_corpus_tokenizer_so_its_checkpoints_record_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bundle import cli, preflight

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "[UNK]", "a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text(" ".join("abc"[i % 3] for i in range(500)))
    out = tmp_path / "corpus"
    argv = ["prepare", str(tmp_path / "a.txt"), "--out", str(out), "--val-fraction", "0"]
    assert data_command([*argv, "--tokenizer", str(tmp_path / "tok")]) == 0
    cfg = cli.parse(["--model", "gpt", "--dataset", "tokens", "--data-dir", str(out)], {})
    resolved = preflight.resolve(cfg)
    assert resolved.data.tokenizer == str(tmp_path / "tok")
    assert resolved.run_settings()["tokenizer"] == str(tmp_path / "tok")  # bundle.json's
    assert tokens.spec(resolved.data) == (5, (64,))


def test_a_checkpoint_records_its_corpus_and_resuming_on_another_says_so(corpus, tmp_path):
    from bundle import data

    (tmp_path / "a.txt").write_text("another corpus " * 50)
    other = tmp_path / "other"
    assert data_command(["prepare", str(tmp_path / "a.txt"), "--out", str(other)]) == 0
    cfg = DataConfig(dataset="tokens", data_dir=corpus)
    info = data.identity(cfg)  # what bundle.json records beside the settings
    assert info == {"corpus": tokens.corpus_digest(cfg)} and info["corpus"].startswith("sha256:")
    assert data.check_resume(cfg, info) == []
    (note,) = data.check_resume(DataConfig(dataset="tokens", data_dir=str(other)), info)
    assert note.startswith(f"resuming on another corpus than the checkpoint's (--data-dir {other}")
    assert data.check_resume(cfg, {}) == []  # a checkpoint that recorded none: nothing to say
