"""Data: deterministic global batches and the per-replica shards they are cut into."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from bundle import cli, data, preflight
from bundle.config import DataConfig
from bundle.data import loader, order, samples, sources
from bundle.errors import DataError
from tests.support.processes import ROOT


def test_shards_of_all_bundles_and_replicas_cover_the_global_batch_once():
    batch = data.global_batch(100, 23, seed=3, step=0)
    pieces = []
    for bundle in range(2):
        for replica in range(3):
            shard = data.Shard(
                num_bundles=2, micro_batches=3, width=3, bundle=bundle, replica=replica
            )
            pieces += shard.micro_indices(batch)
    got = torch.cat(pieces)
    assert sorted(got.tolist()) == sorted(batch.tolist())
    assert len(got) == 23


def test_batches_are_deterministic_and_epochs_reshuffle():
    a = data.global_batch(50, 10, seed=1, step=2)
    assert torch.equal(a, data.global_batch(50, 10, seed=1, step=2))
    assert not torch.equal(a, data.global_batch(50, 10, seed=2, step=2))
    # step 5 is the first batch of epoch 1: same samples overall, new order
    epoch0 = torch.cat([data.global_batch(50, 10, seed=1, step=s) for s in range(5)])
    epoch1 = torch.cat([data.global_batch(50, 10, seed=1, step=s) for s in range(5, 10)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(50))
    assert not torch.equal(epoch0, epoch1)


def test_digits_split_is_real_and_disjoint():
    splits = data.load(DataConfig(dataset="digits"), seed=0)
    assert splits.input_shape == (1, 8, 8) and splits.num_classes == 10
    assert len(splits.train) + len(splits.val) == 1797
    assert splits.train.tensors[0].shape[1:] == (1, 8, 8)


def test_the_digits_read_from_scikit_learns_file_are_load_digits_own(monkeypatch):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = data.digits_arrays()
    assert images.dtype == digits.images.dtype and labels.dtype == digits.target.dtype
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    # Where the file is not found, load_digits itself.
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    images, labels = data.digits_arrays()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)


def test_micro_batches_fetch_in_order_with_and_without_workers():
    ds = data.load(DataConfig(dataset="synthetic", image_size=4, synthetic_size=64), seed=0).train
    lists = [torch.tensor([3, 1]), torch.tensor([7, 64 + 5])]  # 69: sample 5 in epoch 1
    direct = list(loader.micro_batches(ds, lists, workers=0))
    pooled = list(loader.micro_batches(ds, lists, workers=1))
    for (x0, y0), (x1, y1) in zip(direct, pooled, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert torch.equal(direct[0][0], ds.tensors[0][[3, 1]])
    assert torch.equal(direct[1][0], ds.tensors[0][[7, 5]])


def test_imagefolder_errors_name_the_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.check_data(DataConfig(dataset="imagefolder", root=str(tmp_path / "nope")))
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match="train/ is missing or empty"):
        data.check_data(DataConfig(dataset="imagefolder", root=str(tmp_path)))


def test_imagefolder_loads_images(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            d = tmp_path / split / cls
            d.mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (40, 30), (i * 50, 10, 200)).save(d / f"{i}.png")
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=32)
    data.check_data(cfg)
    splits = data.load(cfg, seed=0)
    assert splits.num_classes == 2 and data.input_spec(cfg) == (2, (3, 32, 32))
    x, y = next(loader.micro_batches(splits.train, [torch.tensor([0, 3])], workers=0))
    assert x.shape == (2, 3, 32, 32) and y.tolist() == [0, 1]


def test_an_imagefolder_without_val_trains_with_no_eval(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / "train" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (20, 20), (i * 50, 10, 200)).save(
                tmp_path / "train" / cls / f"{i}.png"
            )
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16)
    with pytest.raises(DataError, match="val/ is missing or empty .*--no-eval trains without one"):
        data.check_data(cfg)
    data.check_data(cfg, needs_val=False)
    assert data.train_size(cfg) == 4
    splits = data.load(cfg, seed=0, needs_val=False)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (4, 0, 2)
    # And so before start: main.py --no-eval DIR passes every check (val/ is never read).
    argv = ["--no-eval", "--model", "mlp", "--image-size", "16", "--batch-size", "2", str(tmp_path)]
    preflight.check_all(cli.parse(argv, {}), {})


def test_replica_indices_follow_the_global_batches_across_epochs():
    shard = data.Shard(num_bundles=2, micro_batches=2, width=2, bundle=1, replica=0)
    lazy = list(data.replica_indices(shard, n=40, batch=12, seed=5, steps=7))  # 3 steps per epoch
    eager = [ix for t in range(7) for ix in shard.micro_indices(data.global_batch(40, 12, 5, t))]
    assert len(lazy) == 14
    # keys are epoch * n + index
    assert all(torch.equal(a % 40, b) for a, b in zip(lazy, eager, strict=True))
    assert [int(a.min()) // 40 for a in lazy] == [t // 3 for t in range(7) for _ in range(2)]


def test_replica_indices_resume_at_any_step_without_replaying_earlier_epochs(monkeypatch):
    shard = data.Shard(num_bundles=2, micro_batches=2, width=2, bundle=1, replica=1)
    full = list(data.replica_indices(shard, n=40, batch=12, seed=5, steps=8))  # 3 steps per epoch
    drawn = []
    real_order = data.epoch_order
    monkeypatch.setattr(
        order,
        "epoch_order",
        lambda n, seed, epoch: drawn.append(epoch) or real_order(n, seed, epoch),
    )
    for start in (0, 1, 2, 3, 4, 6, 7, 8):  # 2 and 4 cross an epoch boundary, 3 and 6 start one
        drawn.clear()
        tail = list(data.replica_indices(shard, n=40, batch=12, seed=5, steps=8, start=start))
        assert len(tail) == len(full) - 2 * start
        assert all(torch.equal(a, b) for a, b in zip(tail, full[2 * start :], strict=True))
        assert drawn == sorted({t // 3 for t in range(start, 8)})  # only the epochs it yields


def _image_folder(root, seed=0) -> data.DataSplits:
    """Three classes of noise JPEGs of varied sizes (noise, so every crop and flip shows)."""
    from PIL import Image

    rng = random.Random(0)
    for split in ("train", "val"):
        for c, cls in enumerate(("a", "b", "c")):
            d = root / split / cls
            d.mkdir(parents=True)
            for i, size in enumerate([(40, 30), (23, 51), (64, 48)][: 2 + (c == 0)]):
                img = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
                img.save(d / f"{i}.jpg")
    return data.load(DataConfig(dataset="imagefolder", root=str(root), image_size=16), seed=seed)


def test_imagefolder_augmentations_are_a_function_of_seed_epoch_and_sample(tmp_path, monkeypatch):
    splits = _image_folder(tmp_path)
    train, n = splits.train, len(splits.train)
    assert n == 7

    def fetch(key):
        with monkeypatch.context() as m:  # torch.manual_seed would also reseed CUDA, unrestored
            m.setattr(torch.cuda, "manual_seed_all", pytest.fail)
            return train[key]

    for key in (0, 3, n + 3, 5 * n + 6):
        torch.manual_seed(1)
        x1, y1 = fetch(key)
        torch.manual_seed(2)
        state = torch.get_rng_state()
        x2, y2 = fetch(key)
        assert torch.equal(torch.get_rng_state(), state), "the caller's RNG state moved"
        assert x1.shape == (3, 16, 16) and torch.equal(x1, x2) and y1 == y2
    # the same samples in another epoch (or under another seed) get other crops and flips
    assert any(not torch.equal(train[i][0], train[n + i][0]) for i in range(n))
    other = _image_folder(tmp_path / "other", seed=1).train
    assert any(not torch.equal(train[i][0], other[i][0]) for i in range(n))
    # the last stage reads the labels of keys without decoding; the val split takes plain indices
    keys = [torch.tensor([n + 4, 1, 2 * n])]
    ((_, y_first),) = loader.stage_micro_batches(train, keys, first=True, workers=0)
    monkeypatch.setattr(train.base.base, "loader", pytest.fail)  # Guarded(SeededAugment(...))
    ((none, y_last),) = loader.stage_micro_batches(train, keys, first=False, workers=0)
    assert none is None and torch.equal(y_first, y_last) and y_last.tolist() == [1, 0, 0]
    ((xv, yv),) = loader.micro_batches(splits.val, [torch.tensor([0, 6])], workers=0)
    assert xv.shape == (2, 3, 16, 16) and yv.tolist() == [0, 2]


def test_seeded_augmentations_are_the_same_with_loader_workers(tmp_path):
    train = _image_folder(tmp_path).train
    lists = [torch.tensor(k) for k in ([0, 8, 3], [15, 6], [1, 2, 22], [4], [13, 7, 5])]
    direct = list(loader.micro_batches(train, lists, workers=0))
    pooled = list(loader.micro_batches(train, lists, workers=2))
    assert len(direct) == len(pooled) == len(lists)
    for (x0, y0), (x1, y1) in zip(direct, pooled, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


class _SignalProbe(Dataset):
    """Reports, from inside a loader worker, whether SIGINT and SIGTERM are ignored there."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int):
        ignored = [signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]
        return torch.tensor(ignored), 0


def test_loader_workers_ignore_sigint_and_sigterm():
    # Handled in this process (a shell's background job starts with SIGINT ignored), so that
    # the workers ignore them by their own doing.
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, signal.default_int_handler) for s in sigs}
    try:
        ((x, _),) = loader.micro_batches(_SignalProbe(), [torch.tensor([0])], workers=1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert x.tolist() == [[True, True]]


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda:0", True)])
def test_loader_pins_memory_only_for_a_cuda_process(device, pinned, monkeypatch):
    """A CPU (gloo) process on a GPU host does not pin: pinning would open a CUDA context."""
    from types import SimpleNamespace

    from bundle.session import train_stream
    from bundle.topology import Topology

    built: list[dict] = []

    def fake_loader(dataset, **kwargs):
        built.append(kwargs)
        return iter([(torch.zeros(1), torch.zeros(1, dtype=torch.long), [])] * 4)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "DataLoader", fake_loader)
    topo = Topology(shape=(1,), num_bundles=1, procs_per_node=1, global_batch=2, micro_batches=1)
    train = torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))
    session = SimpleNamespace(
        coord=topo.coord(0), splits=SimpleNamespace(train=train), stage=SimpleNamespace(side=())
    )
    stream = train_stream(session, topo, 0, 2, 1, device=torch.device(device))
    next(stream)
    assert [kw["pin_memory"] for kw in built] == [pinned]


def _text_cfg(path, seq_len=8) -> DataConfig:
    return DataConfig(dataset="text", data_file=str(path), seq_len=seq_len)


def test_text_is_byte_windows_with_labels_shifted_by_one(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 2)
    splits = data.load(_text_cfg(path), seed=0)
    x, y = splits.train.tensors
    assert splits.num_classes == 256 and splits.input_shape == (8,)
    assert x.dtype == y.dtype == torch.long and x.shape[1] == 8
    assert torch.equal(x[0], torch.arange(8)) and torch.equal(y[0], torch.arange(1, 9))
    assert len(splits.val) == (512 - 460 - 1) // 8  # the last tenth, in whole windows
    assert data.input_spec(_text_cfg(path)) == (256, (8,))


@pytest.mark.parametrize("content", [b"", b"short text"])
def test_a_text_file_too_short_for_its_windows_is_one_line(tmp_path, content):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"holds {len(content)} bytes; --seq-len 8 needs at least"):
        data.load(_text_cfg(path), seed=0)
    with pytest.raises(DataError, match="No such file"):
        data.load(_text_cfg(tmp_path / "missing.txt"), seed=0)


def test_a_users_dataset_function_gives_both_splits():
    cfg = DataConfig(dataset="tests.support.user_data:tiny", num_classes=3)
    splits = data.load(cfg, seed=0)
    assert splits.input_shape == (1, 4, 4) and len(splits.train) == 40 and len(splits.val) == 8
    x, y = loader._fetch(splits.train, torch.tensor([0, 41]))
    assert x.shape == (2, 1, 4, 4) and torch.equal(
        y, torch.stack([splits.train[0][1], splits.train[1][1]])
    )
    with pytest.raises(DataError, match="returned a int, not a dataset"):
        data.load(DataConfig(dataset="tests.support.user_data:not_data"), seed=0)


def test_a_dataset_that_declares_its_classes_tells_the_model_and_a_contradiction_is_refused():
    declared = "tests.support.user_data:tiny_declared"
    assert data.load(DataConfig(dataset=declared), seed=0).num_classes == 3
    assert data.input_spec(DataConfig(dataset=declared))[0] == 3
    # Declaring none: the labels it holds apart say how many (not a silent 10-way head).
    two = DataConfig(dataset="tests.support.user_data:two_classes")
    assert data.load(two, seed=0).num_classes == 2
    with pytest.raises(DataError, match="declares no number of classes.*give --num-classes N"):
        data.load(DataConfig(dataset="tests.support.user_data:tiny"), seed=0)
    with pytest.raises(DataError, match="--num-classes 5: --dataset .* has 3 classes"):
        data.load(DataConfig(dataset=declared, num_classes=5), seed=0)


class _Flaky(Dataset):
    """Six samples labelled 0,0,0,1,1,1 with torchvision's ``samples``; those in ``bad`` raise."""

    def __init__(self, bad, *, targets=True) -> None:
        self.bad = set(bad)
        self.samples = [(f"/data/c{i // 3}/{i}.jpg", i // 3) for i in range(6)]
        if targets:
            self.targets = [t for _, t in self.samples]

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        if i in self.bad:
            raise OSError(f"broken\nfile {i}")  # two lines: the error must still be one
        return torch.full((2,), float(i)), self.samples[i][1]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_that_cannot_be_read_fails_as_one_line_naming_index_and_path(workers):
    ds = samples.Guarded(_Flaky({4}), split="train", skip=False)
    stream = loader.micro_batches(
        ds, [torch.tensor([0, 1]), torch.tensor([3, 6 + 4])], workers=workers
    )
    assert next(stream)[0][:, 0].tolist() == [0.0, 1.0]  # the batches before it are unharmed
    with pytest.raises(DataError) as failed:
        next(stream)
    message = str(failed.value)
    assert message == (
        "train sample 4 (/data/c1/4.jpg) cannot be read: OSError: broken file 4 "
        "(--skip-bad-samples replaces such a sample)"
    )
    # The last stage reads labels without decoding: it needs no sample to be readable.
    assert loader.labels_of(ds).tolist() == [0, 0, 0, 1, 1, 1]


_KEEPS_A_FAILED_LOADER = """
import torch
from bundle.data import loader, samples
from bundle.errors import DataError
from tests.unit.test_data import _Flaky

stream = loader.micro_batches(
    samples.Guarded(_Flaky({1}), split="train", skip=False), [torch.tensor([1])], workers=1
)
try:
    next(stream)
except DataError as exc:
    kept = exc  # its traceback holds the loader, and so its worker, until the interpreter ends
print("reported", flush=True)
"""


def test_a_process_exits_although_a_failed_loader_is_still_referenced():
    """Workers ignore SIGTERM (so that a scheduler's signal reaches the training process alone);
    at exit they must be killed, not terminated and waited for, and quietly."""
    proc = subprocess.run(
        [sys.executable, "-c", _KEEPS_A_FAILED_LOADER],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "reported\n", proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # killing its worker is no error at exit


class _Warnings:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize("workers", [0, 1])
def test_skip_bad_samples_replaces_by_the_next_of_its_label_counts_and_warns_once(
    workers, monkeypatch
):
    warned = _Warnings()
    monkeypatch.setattr(samples.log, "get", lambda: warned)
    ds = samples.Guarded(_Flaky({2}), split="val", skip=True)
    lists = [torch.tensor([2, 1]), torch.tensor([6 + 2, 5, 12 + 2])]  # sample 2 in three epochs
    got = list(loader.micro_batches(ds, lists, workers=workers))
    # 3 has another label: the walk wraps round to 0, the next sample labelled 0.
    assert [x[:, 0].tolist() for x, _ in got] == [[0.0, 1.0], [0.0, 5.0, 0.0]]
    assert [y.tolist() for _, y in got] == [[0, 0], [0, 1, 0]]
    assert samples.replaced(ds) == 3  # every time it was drawn
    assert warned.lines == [
        "val sample 2 (/data/c0/2.jpg) cannot be read: OSError: broken file 2; "
        "val sample 0 (/data/c0/0.jpg) stands in for it (--skip-bad-samples)"
    ]
    # The same choice again, for another replica or a resumed run: the key decides alone.
    again = samples.Guarded(_Flaky({2}), split="val", skip=True)
    assert torch.equal(again[2][0], got[0][0][0]) and again[2][1] == 0


def test_without_labels_apart_the_stand_in_is_the_next_readable_and_its_label_travels():
    ds = samples.Guarded(_Flaky({2, 3}, targets=False), split="train", skip=True)
    ((x, y),) = loader.stage_micro_batches(ds, [torch.tensor([2, 3])], first=True, workers=0)
    assert x[:, 0].tolist() == [4.0, 4.0] and y.tolist() == [1, 1] and samples.replaced(ds) == 2
    # The last stage reads every label through the same rule, so inputs and labels agree; that
    # counts nothing: no sample is trained on there.
    assert loader.labels_of(ds).tolist() == [0, 0, 1, 1, 1, 1] and samples.replaced(ds) == 2


def test_a_label_with_no_readable_sample_left_fails_even_when_skipping():
    ds = samples.Guarded(_Flaky({0, 1, 2}), split="train", skip=True)
    with pytest.raises(
        DataError,
        match=r"sample 1 \(/data/c0/1.jpg\) .*, nor can any of the next 2 samples of its label$",
    ):
        ds[1]


def test_a_corrupt_image_in_an_image_folder_names_its_path(tmp_path):
    _image_folder(tmp_path)
    bad = tmp_path / "train" / "b" / "1.jpg"  # sample 4: a (3 files), then b
    bad.write_bytes(b"not a jpeg" * 10)
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path), image_size=16)
    train = data.load(cfg, seed=0).train
    with pytest.raises(DataError, match=rf"^train sample 4 \({bad}\) cannot be read: Unidentified"):
        next(loader.micro_batches(train, [torch.tensor([7 + 4])], workers=0))
    skipping = data.load(DataConfig(**{**vars(cfg), "skip_bad_samples": True}), seed=0).train
    ((x, y),) = loader.micro_batches(skipping, [torch.tensor([7 + 4])], workers=0)
    assert y.tolist() == [1] and torch.equal(x[0], skipping[7 + 3][0])  # b's sample 0 of epoch 1
    assert samples.replaced(skipping) == 1


def test_every_dataset_name_the_config_accepts_has_a_source():
    from bundle import config as C

    assert set(data.SOURCES) == set(C.DATASETS)
