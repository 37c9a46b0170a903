"""Datasets (digits, ImageFolder, synthetic) and the deterministic per-replica sharding of batches.

Every step draws one global batch from a permutation of the epoch seeded by ``(seed, epoch)``;
the batch is cut into bundles, micro-batches and replica rows exactly as the topology cuts it, so a
single process reading the same global batches sees the same samples in the same rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from bundle.config import DataConfig
from bundle.errors import DataError
from bundle.topology import replica_rows

# The digits train/val split is fixed so accuracy is comparable across seeds.
_DIGITS_SPLIT_SEED = 1234
_DIGITS_VAL_FRACTION = 0.2
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DataSplits:
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, int, int]


def _digits() -> DataSplits:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    n_val = int(len(labels) * _DIGITS_VAL_FRACTION)
    val, train = order[:n_val], order[n_val:]
    # Normalise with the training statistics only.
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return DataSplits(
        TensorDataset(images[train], labels[train]),
        TensorDataset(images[val], labels[val]),
        10,
        (1, 8, 8),
    )


def _synthetic(cfg: DataConfig, seed: int) -> DataSplits:
    shape = (3, cfg.image_size, cfg.image_size)
    gen = torch.Generator().manual_seed(seed)

    def make(n: int) -> TensorDataset:
        return TensorDataset(
            torch.randn(n, *shape, generator=gen),
            torch.randint(0, cfg.num_classes, (n,), generator=gen),
        )

    return DataSplits(
        make(cfg.synthetic_size), make(max(cfg.synthetic_size // 8, 1)), cfg.num_classes, shape
    )


def _image_folder(cfg: DataConfig) -> DataSplits:
    from torchvision import datasets, transforms

    check_data(cfg)
    normalize = transforms.Normalize(_IMAGENET_MEAN, _IMAGENET_STD)
    size = cfg.image_size
    train_tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    val_tf = transforms.Compose(
        [
            transforms.Resize(int(size * 256 / 224)),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            normalize,
        ]
    )
    splits = {}
    for name, tf in (("train", train_tf), ("val", val_tf)):
        path = os.path.join(cfg.root, name)
        try:
            splits[name] = datasets.ImageFolder(path, transform=tf)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(f"data directory {path!r} holds no images: {exc}") from exc
    classes = len(splits["train"].classes)
    return DataSplits(splits["train"], splits["val"], classes, (3, size, size))


def check_data(cfg: DataConfig) -> None:
    """Cheap checks done before any process starts (directory exists and is not empty)."""
    if cfg.dataset != "imagefolder":
        return
    if not cfg.root:
        raise DataError("--dataset imagefolder needs a data directory (positional DATA_DIR)")
    if not os.path.isdir(cfg.root):
        raise DataError(f"data directory {cfg.root!r} does not exist")
    for name in ("train", "val"):
        path = os.path.join(cfg.root, name)
        if not os.path.isdir(path) or not any(os.scandir(path)):
            raise DataError(
                f"data directory {cfg.root!r}: {name}/ is missing or empty (expected DIR/{name}/CLASS/*.jpg)"
            )


def load(cfg: DataConfig, seed: int) -> DataSplits:
    if cfg.dataset == "digits":
        return _digits()
    if cfg.dataset == "synthetic":
        return _synthetic(cfg, seed)
    return _image_folder(cfg)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch; the same on every process."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def steps_per_epoch(n: int, batch: int) -> int:
    return n // batch


def global_batch(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices of the global batch of training ``step`` (epochs follow each other)."""
    spe = steps_per_epoch(n, batch)
    if spe == 0:
        raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
    epoch, t = divmod(step, spe)
    return epoch_order(n, seed, epoch)[t * batch : (t + 1) * batch]


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Which rows of each batch one stage-0 replica reads."""

    num_bundles: int
    micro_batches: int
    width: int
    bundle: int
    replica: int

    def rows(self, batch_len: int, micro: int) -> tuple[int, int]:
        return replica_rows(
            batch_len,
            self.num_bundles,
            self.micro_batches,
            self.width,
            self.bundle,
            micro,
            self.replica,
        )

    def micro_indices(self, batch: torch.Tensor) -> list[torch.Tensor]:
        return [batch[slice(*self.rows(len(batch), k))] for k in range(self.micro_batches)]


def _fetch(dataset: Dataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        return x[idx], y[idx]
    xs, ys = zip(*(dataset[int(i)] for i in idx), strict=True)
    return torch.stack(xs), torch.as_tensor(ys)


class _Batches:
    """A batch sampler over precomputed index tensors (DataLoader keeps their order with workers)."""

    def __init__(self, index_lists: Iterable[torch.Tensor]) -> None:
        self.index_lists = index_lists

    def __iter__(self) -> Iterator[list[int]]:
        return (idx.tolist() for idx in self.index_lists)


def micro_batches(
    dataset: Dataset, index_lists: Iterable[torch.Tensor], *, workers: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fetch each index list as one (inputs, labels) pair, in order, with ``workers`` prefetching."""
    if workers == 0:
        for idx in index_lists:
            yield _fetch(dataset, idx)
        return
    yield from DataLoader(
        dataset,
        batch_sampler=_Batches(index_lists),
        num_workers=workers,
        prefetch_factor=4,
        pin_memory=torch.cuda.is_available(),  # lets the stage's non_blocking copy overlap
    )


def labels_of(dataset: Dataset) -> torch.Tensor:
    """Every label of ``dataset``, without decoding a single image."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[1]
    if hasattr(dataset, "targets"):  # torchvision ImageFolder and friends
        return torch.as_tensor(dataset.targets)
    return torch.as_tensor([dataset[i][1] for i in range(len(dataset))])


def stage_micro_batches(
    dataset: Dataset, index_lists: Iterable[torch.Tensor], *, first: bool, workers: int
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """Stage 0 reads (inputs, labels); the last stage reads only the labels of its own rows."""
    if first:
        yield from micro_batches(dataset, index_lists, workers=workers)
        return
    labels = labels_of(dataset)
    for idx in index_lists:
        yield None, labels[idx]


def replica_indices(
    shard: Shard, n: int, batch: int, seed: int, steps: int
) -> Iterator[torch.Tensor]:
    """This replica's index list of every micro-batch of ``steps`` training steps, lazily."""
    spe = steps_per_epoch(n, batch)
    if spe == 0:
        raise DataError(f"the training set has {n} samples, fewer than one batch of {batch}")
    order, epoch = None, -1
    for step in range(steps):
        if step // spe != epoch:
            epoch = step // spe
            order = epoch_order(n, seed, epoch)
        t = step % spe
        yield from shard.micro_indices(order[t * batch : (t + 1) * batch])


def input_spec(cfg: DataConfig) -> tuple[int, tuple[int, int, int]]:
    """(classes, input shape) without loading the data: what the model must be built for."""
    if cfg.dataset == "digits":
        return 10, (1, 8, 8)
    shape = (3, cfg.image_size, cfg.image_size)
    if cfg.dataset == "synthetic":
        return cfg.num_classes, shape
    train = os.path.join(cfg.root or "", "train")
    return sum(1 for e in os.scandir(train) if e.is_dir()), shape
