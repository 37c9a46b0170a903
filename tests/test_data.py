"""Data: deterministic global batches and the per-replica shards they are cut into."""

from __future__ import annotations

import pytest
import torch

from bundle import data
from bundle.config import DataConfig
from bundle.errors import DataError


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


def test_micro_batches_fetch_in_order_with_and_without_workers():
    ds = data.load(DataConfig(dataset="synthetic", image_size=4, synthetic_size=64), seed=0).train
    lists = [torch.tensor([3, 1]), torch.tensor([7])]
    direct = list(data.micro_batches(ds, lists, workers=0))
    pooled = list(data.micro_batches(ds, lists, workers=1))
    for (x0, y0), (x1, y1) in zip(direct, pooled, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert torch.equal(direct[0][0], ds.tensors[0][[3, 1]])


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
    x, y = next(data.micro_batches(splits.train, [torch.tensor([0, 3])], workers=0))
    assert x.shape == (2, 3, 32, 32) and y.tolist() == [0, 1]


def test_replica_indices_follow_the_global_batches_across_epochs():
    shard = data.Shard(num_bundles=2, micro_batches=2, width=2, bundle=1, replica=0)
    lazy = list(data.replica_indices(shard, n=40, batch=12, seed=5, steps=7))  # 3 steps per epoch
    eager = [ix for t in range(7) for ix in shard.micro_indices(data.global_batch(40, 12, 5, t))]
    assert len(lazy) == 14
    assert all(torch.equal(a, b) for a, b in zip(lazy, eager, strict=True))
