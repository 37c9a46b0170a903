"""The datasets by name (digits, ImageFolder, synthetic, text, a user's): ``SOURCES``, ``load``,
and what a model must be built for (``input_spec``) without reading the data.

Samples are read by *key* ``epoch * n + index`` (``bundle.data.order``): the random augmentations
of the ImageFolder training split (``SeededAugment``) are seeded by ``(seed, epoch, index)``
alone, so a resumed run, any number of loader workers and an uninterrupted run all see the same
crops. Every other dataset reads sample ``key % n``; plain indices are keys too.

Datasets that decode files (ImageFolder, a user's) are read through ``Guarded``: a sample that
cannot be read fails as one line naming its split, index and path, or, with
``--skip-bad-samples``, is replaced by a stand-in chosen from the dataset and the key alone.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeGuard

import torch
from torch.utils.data import TensorDataset

from bundle.config import DataConfig, is_reference
from bundle.data import tokenizer, tokens
from bundle.data.samples import Guarded, SeededAugment, known_labels, size
from bundle.data.splits import DataSplits as DataSplits
from bundle.errors import ConfigError, DataError
from bundle.models.inputs import Inputs, of_sample

# The digits train/val split is fixed so accuracy is comparable across seeds.
_DIGITS_SPLIT_SEED = 1234
_DIGITS_VAL_FRACTION = 0.2
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _root(cfg: DataConfig) -> str:
    if not cfg.root:
        raise DataError(
            f"--dataset {cfg.dataset} needs DATA_DIR (a directory with train/ and val/)"
        )
    return cfg.root


def digits_arrays() -> tuple[Any, Any]:
    """scikit-learn's digits as (images 1797x8x8, labels), as ``load_digits`` gives them.

    Read from the file scikit-learn ships, located without importing scikit-learn: importing
    it is over a second of every process's start-up, and the digits are the default data.
    ``load_digits`` itself where the file is not where it has always been.
    """
    spec = importlib.util.find_spec("sklearn")
    origin = spec.origin if spec is not None else None
    shipped = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if shipped is None or not shipped.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    import numpy as np

    with gzip.open(shipped, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int, copy=False)


def _digits() -> DataSplits:
    pixels, target = digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(target, dtype=torch.long)
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
    classes = cfg.num_classes or SYNTHETIC_CLASSES

    def make(n: int) -> TensorDataset:
        return TensorDataset(
            torch.randn(n, *shape, generator=gen),
            torch.randint(0, classes, (n,), generator=gen),
        )

    return DataSplits(
        make(cfg.synthetic_size), make(max(cfg.synthetic_size // 8, 1)), classes, shape
    )


def _image_folder(cfg: DataConfig, seed: int, needs_val: bool = True) -> DataSplits:
    from torchvision import datasets, transforms

    check_data(cfg, needs_val=needs_val)
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
    splits: dict[str, Any] = {}
    for name, tf in (("train", train_tf), ("val", val_tf)):
        path = os.path.join(_root(cfg), name)
        if name == "val" and not needs_val:
            # --no-eval: val/ is never read, and may be missing.
            splits[name] = TensorDataset(torch.empty(0, 3, size, size), torch.empty(0).long())
            continue
        try:
            splits[name] = datasets.ImageFolder(path, transform=tf)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(f"data directory {path!r} holds no images: {exc}") from exc
    classes = _classes(cfg, splits["train"])
    skip = cfg.skip_bad_samples
    train = Guarded(SeededAugment(splits["train"], seed), split="train", skip=skip)
    val = Guarded(splits["val"], split="val", skip=skip) if needs_val else splits["val"]
    return DataSplits(train, val, classes, (3, size, size))


def check_data(cfg: DataConfig, *, needs_val: bool = True) -> None:
    """Cheap checks done before any process starts (directory exists and is not empty);
    ``needs_val``: the run evaluates, so ``val/`` must be there too (``--no-eval``: not)."""
    if cfg.dataset == "tokens":
        tokens.check(cfg, needs_val=needs_val)
    if cfg.streams:
        from bundle.data import stream  # datasets and prepare's encoder: only for a stream

        stream.check(cfg, needs_val=needs_val)
    elif cfg.dataset == "hf":
        from bundle.data import classify

        classify.check(cfg, needs_val=needs_val)
    if cfg.dataset != "imagefolder":
        return
    if not cfg.root:
        raise DataError("--dataset imagefolder needs a data directory (positional DATA_DIR)")
    if not os.path.isdir(cfg.root):
        raise DataError(f"data directory {cfg.root!r} does not exist")
    for name in ("train", "val") if needs_val else ("train",):
        path = os.path.join(_root(cfg), name)
        if not os.path.isdir(path) or not any(os.scandir(path)):
            hint = "; --no-eval trains without one" if name == "val" else ""
            raise DataError(
                f"data directory {cfg.root!r}: {name}/ is missing or empty "
                f"(expected DIR/{name}/CLASS/*.jpg{hint})"
            )


def identity(cfg: DataConfig) -> dict[str, str]:
    """What a checkpoint records of the data beyond its settings: a prepared corpus's digest."""
    return {"corpus": tokens.corpus_digest(cfg)} if cfg.dataset == "tokens" else {}


def check_resume(cfg: DataConfig, info: dict) -> list[str]:
    """Before any process starts: a stream position a checkpoint recorded must be counted in
    this run's files (else refused); what differs from the checkpoint's data, as notes."""
    if cfg.streams and info.get("data_position") is not None:
        from bundle.data import stream

        stream.check_position(cfg, info["data_position"])
    return [
        f"resuming on another corpus than the checkpoint's (--data-dir {cfg.data_dir} is "
        f"{value[:19]}..., it was written on {str(info[key])[:19]}...): the order goes on at the "
        "next sample index"
        for key, value in identity(cfg).items()
        if key in info and info[key] != value
    ]


def train_size(cfg: DataConfig) -> int:
    """Samples in the training split, without reading them (ImageFolder's own scan of DIR/train)."""
    if cfg.dataset == "synthetic":
        return cfg.synthetic_size
    if cfg.dataset == "digits":
        return size(_digits().train)
    if cfg.dataset == "text":
        return size(_text(cfg).train)
    if cfg.dataset == "tokens":
        return len(tokens.windows(cfg, "train"))
    if cfg.streams:
        raise DataError("--dataset hf is a stream: it has no size (the run is --itr steps long)")
    if cfg.dataset == "hf":
        from bundle.data import classify

        return classify.train_size(cfg)
    if cfg.dataset != "imagefolder":
        return size(_custom(cfg).train)
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    check_data(cfg, needs_val=False)
    return len(make_dataset(os.path.join(_root(cfg), "train"), extensions=IMG_EXTENSIONS))


# --dataset text without --tokenizer: byte-level tokens, so the vocabulary is every byte value.
TEXT_VOCAB = tokenizer.BYTE_VOCAB
SYNTHETIC_CLASSES = 10  # --dataset synthetic without --num-classes
_TEXT_VAL_FRACTION = 0.1


def _text_bytes(cfg: DataConfig) -> bytes:
    path = cfg.data_file or ""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DataError(f"--data-file {path!r}: {exc.strerror or exc}") from None
    if cfg.tokenizer is None:
        _enough(cfg, len(raw), "bytes")
    return raw


def _enough(cfg: DataConfig, tokens: int, unit: str) -> None:
    """Two windows of seq_len + 1 tokens at least: one to train on, one to validate with."""
    need = 2 * (cfg.seq_len + 1) * 10
    if tokens < need:
        by = f" with --tokenizer {cfg.tokenizer}" if cfg.tokenizer else ""
        raise DataError(
            f"--data-file {cfg.data_file!r} holds {tokens} {unit}{by}; --seq-len {cfg.seq_len} "
            f"needs at least {need} (a tenth of it is the validation set, one window at least)"
        )


@functools.lru_cache(maxsize=2)
def _text_tokens(cfg: DataConfig) -> torch.Tensor:
    """The file's tokens: its bytes, or what ``--tokenizer`` makes of its text (once a process)."""
    raw = _text_bytes(cfg)
    if cfg.tokenizer is None:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ids = tokenizer.load(cfg.tokenizer).encode(raw.decode("utf-8", errors="replace"))
    _enough(cfg, len(ids), "tokens")
    return torch.tensor(ids, dtype=torch.long)


def _windows(tokens: torch.Tensor, seq_len: int) -> TensorDataset:
    """Non-overlapping windows: inputs tokens[i*T : i*T+T], labels the same shifted by one."""
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)
    return TensorDataset(x.long(), y.long())


def _text(cfg: DataConfig) -> DataSplits:
    """Tokens of any text file (bytes, or ``--tokenizer``'s): the first nine tenths train, the
    rest validates."""
    tokens = _text_tokens(cfg)
    cut = int(len(tokens) * (1 - _TEXT_VAL_FRACTION))
    return DataSplits(
        _windows(tokens[:cut], cfg.seq_len),
        _windows(tokens[cut:], cfg.seq_len),
        tokenizer.load(cfg.tokenizer).vocab,
        (cfg.seq_len,),
    )


def _tokens(cfg: DataConfig, needs_val: bool) -> DataSplits:
    """A prepared corpus (``bundle.data.tokens``): its train and validation splits, memory-mapped."""
    vocab, shape = tokens.spec(cfg)
    val = tokens.windows(cfg, "val") if needs_val else TensorDataset(torch.empty(0, 0))
    return DataSplits(tokens.windows(cfg, "train"), val, vocab, shape)


def _hf(cfg: DataConfig, needs_val: bool) -> DataSplits:
    """JSON lines or Parquet, tokenized and packed as they are read (``bundle.data.stream``);
    with ``--label-field``, a row each: text classification (``bundle.data.classify``)."""
    if cfg.label_field is not None:
        from bundle.data import classify

        return classify.splits(cfg, needs_val)
    from bundle.data import stream

    return stream.splits(cfg, needs_val)


def _custom(cfg: DataConfig) -> DataSplits:
    """A user's ``module:function``, called as ``function(split)`` for "train" and "val"."""
    from bundle.models import load_callable

    factory = load_callable(cfg.dataset, "--dataset")
    splits, raw = {}, None
    for split in ("train", "val"):
        try:
            ds = factory(split)
        except Exception as exc:  # noqa: BLE001 - the user's code failed: say where
            raise DataError(
                f"--dataset {cfg.dataset}({split!r}) raised {type(exc).__name__}: {exc}"
            ) from None
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise DataError(
                f"--dataset {cfg.dataset}({split!r}) returned a {type(ds).__name__}, "
                "not a dataset with __getitem__ and __len__"
            )
        if len(ds) == 0:
            raise DataError(f"--dataset {cfg.dataset}({split!r}) is empty")
        splits[split] = Guarded(ds, split=split, skip=cfg.skip_bad_samples)
        raw = ds if split == "train" else raw
    x, _ = splits["train"][0]
    splits["train"].take()  # a stand-in for the shape alone is no sample trained on
    inputs = of_sample(x, f"--dataset {cfg.dataset}")
    shape = tuple((inputs.rows[0] if inputs else torch.as_tensor(x)).shape)
    return DataSplits(splits["train"], splits["val"], _classes(cfg, raw), shape, inputs)


@functools.lru_cache(maxsize=1)
def _custom_spec(cfg: DataConfig) -> tuple[int, tuple[int, ...], Inputs | None]:
    """A user's dataset's classes, input shape and named inputs, made once per process."""
    splits = _custom(cfg)
    return splits.num_classes, splits.input_shape, splits.inputs


def named_inputs(cfg: DataConfig) -> Inputs | None:
    """The named inputs of the data's samples (None: one tensor), as ``input_spec`` finds them."""
    if cfg.dataset in SOURCES and cfg.dataset != "hf":
        return None
    if cfg.dataset == "hf":
        return load(cfg, 0, needs_val=False).inputs if cfg.label_field else None
    return _custom_spec(cfg)[2]


def _classes(cfg: DataConfig, ds: object) -> int:
    """How many classes a dataset has: what it declares (``num_classes``, or the length of
    ``classes`` as torchvision's datasets and ImageFolder have), else ``--num-classes``, else
    one more than the largest of the labels it holds apart from its samples (``targets``, a
    TensorDataset's); a ``--num-classes`` the data contradicts, or none to be found, is refused
    in one line."""
    declared = getattr(ds, "num_classes", None)
    if not isinstance(declared, int):
        names = getattr(ds, "classes", None)
        declared = len(names) if isinstance(names, (list, tuple)) and names else None
    if declared is not None and cfg.num_classes is not None and declared != cfg.num_classes:
        raise DataError(
            f"--num-classes {cfg.num_classes}: --dataset {cfg.dataset} has {declared} classes; "
            "leave --num-classes out to use them"
        )
    found = declared or cfg.num_classes
    if found:
        return found
    try:
        labels = known_labels(ds)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):  # targets that are not numbers
        labels = None
    if _class_indices(labels):
        return int(labels.max()) + 1
    raise DataError(
        f"--dataset {cfg.dataset} declares no number of classes (num_classes, classes, or "
        "targets holding one class index per sample): give --num-classes N"
    )


def _class_indices(labels: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """Whether ``labels`` is one class index per sample: integers >= 0, in one dimension."""
    if labels is None or labels.dim() != 1 or labels.numel() == 0:
        return False
    return not labels.is_floating_point() and int(labels.min()) >= 0


def load(cfg: DataConfig, seed: int, *, needs_val: bool = True) -> DataSplits:
    """The training and validation splits; ``needs_val`` False (``--no-eval``): an ImageFolder's
    ``val/`` is not read (an empty split stands in), so it may be missing."""
    if cfg.dataset in SOURCES:
        return SOURCES[cfg.dataset](cfg, seed, needs_val)
    if is_reference(cfg.dataset):
        return _custom(cfg)
    raise ConfigError(
        "--dataset", cfg.dataset, f"choose one of: {', '.join(SOURCES)}, or package.module:function"
    )


# --dataset NAME -> its splits (the names bundle.config.DATASETS accepts: a test keeps the two
# the same); any other name is a user's package.module:function.
SOURCES: dict[str, Callable[[DataConfig, int, bool], DataSplits]] = {
    "digits": lambda cfg, seed, needs_val: _digits(),
    "imagefolder": _image_folder,
    "synthetic": lambda cfg, seed, needs_val: _synthetic(cfg, seed),
    "text": lambda cfg, seed, needs_val: _text(cfg),
    "tokens": lambda cfg, seed, needs_val: _tokens(cfg, needs_val),
    "hf": lambda cfg, seed, needs_val: _hf(cfg, needs_val),
}


def input_spec(cfg: DataConfig) -> tuple[int, tuple[int, ...]]:
    """(classes, input shape) without loading the data: what the model must be built for."""
    if cfg.dataset == "digits":
        return 10, (1, 8, 8)
    if cfg.dataset == "text":
        _text_bytes(cfg)  # the file is there (and, byte-level, long enough)
        return tokenizer.load(cfg.tokenizer).vocab, (cfg.seq_len,)
    if cfg.dataset == "tokens":
        return tokens.spec(cfg)
    if cfg.dataset == "hf" and cfg.label_field is not None:
        from bundle.data import classify  # the classes: the label column is read

        return classify.spec(cfg)
    if cfg.dataset == "hf":
        from bundle.data import stream

        return stream.spec(cfg)
    if cfg.dataset not in ("synthetic", "imagefolder"):
        return _custom_spec(cfg)[:2]
    shape = (3, cfg.image_size, cfg.image_size)
    if cfg.dataset == "synthetic":
        return cfg.num_classes or SYNTHETIC_CLASSES, shape
    train = os.path.join(cfg.root or "", "train")
    names = [e.name for e in os.scandir(train) if e.is_dir()]
    return _classes(cfg, SimpleNamespace(classes=names)), shape
