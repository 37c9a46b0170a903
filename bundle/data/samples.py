"""How one sample is read: by key, with seeded augmentations (``SeededAugment``), and through
``Guarded``, where a sample that cannot be read names itself or, with ``--skip-bad-samples``, is
replaced by a stand-in chosen from the dataset and the key alone (see ``bundle.data.order`` for keys).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset

from bundle import log
from bundle.errors import DataError


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of what is random in one step of one rank (dropout, a faulty bundle's noise,
    PowerSGD's projections; ``rank`` may be any index): resumes draw the same."""
    return ((seed * 1_000_003 + step) * 1_009 + rank) % 2**63


# --skip-bad-samples reads at most this many candidates for one bad sample's stand-in: a dataset
# that fails on every sample (a bug, not a bad file) stops soon instead of reading it all.
_STAND_IN_TRIES = 32


def size(dataset: Dataset[Any]) -> int:
    """The samples in ``dataset`` (torch's Dataset declares no ``__len__``; every one here has it)."""
    return len(cast(Sized, dataset))


class SeededAugment(Dataset[Any]):
    """``base[i]`` for key ``epoch * len(base) + i``, its random transforms seeded by the key.

    The seed depends on ``(seed, epoch, i)`` only, never on the process, the loader worker or what
    ran before; the caller's RNG state is left as it was.
    """

    def __init__(self, base: Dataset[Any], seed: int) -> None:
        self.base, self.seed = base, seed

    def __len__(self) -> int:
        return size(self.base)

    def __getitem__(self, key: int):
        epoch, i = divmod(int(key), size(self.base))
        digest = hashlib.blake2b(f"{self.seed}:{epoch}:{i}".encode(), digest_size=8).digest()
        with torch.random.fork_rng(devices=[]):
            # Not torch.manual_seed: that also reseeds every CUDA generator, which
            # fork_rng(devices=[]) would not restore. The transforms draw from the CPU one only.
            torch.default_generator.manual_seed(int.from_bytes(digest, "little") >> 1)
            return self.base[i]


class Guarded(Dataset[Any]):
    """``base`` read by key, where a sample that raises names itself.

    Without ``skip`` the sample fails as a ``DataError`` naming the split, its index and its path
    (``samples[i][0]``, ImageFolder's). With ``skip`` it is replaced by the next index, walking
    forward modulo the split's size, that can be read and, where the dataset holds its labels
    apart from its samples (ImageFolder's ``targets``), has the same label: the last stage reads
    labels without decoding, so the stand-in must carry the label it expects. The choice depends
    on the dataset and the key only, so replicas, loader workers and resumed runs agree.

    A replacement is noted where it happens (a loader worker, maybe) and handed with its batch to
    the process that trains on it, which counts it (``replaced``) and warns once per sample.
    """

    def __init__(self, base: Dataset[Any], *, split: str, skip: bool) -> None:
        self.base, self.split, self.skip = base, split, skip
        self.n, self.keyed = size(base), isinstance(base, SeededAugment)
        self.noted: list[tuple[int, str]] = []  # (index, warning), since the last ``take``
        self.replaced = 0  # replacements trained or evaluated on in this process
        self._warned: set[int] = set()
        self._labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int):
        try:
            return self._read(int(key))
        except Exception as exc:  # noqa: BLE001 - any failure of one sample: name it
            return self._stand_in(int(key), exc)

    def _read(self, key: int):
        return self.base[key if self.keyed else key % self.n]

    def _describe(self, i: int, exc: BaseException | None = None) -> str:
        path = sample_path(self.base, i)
        where = f"{self.split} sample {i}" + (f" ({path})" if path else "")
        if exc is None:
            return where
        text = " ".join(str(exc).split())[:500]
        return f"{where} cannot be read: {type(exc).__name__}: {text}"

    def _stand_in(self, key: int, exc: Exception):
        epoch, i = divmod(key, self.n)
        if not self.skip:
            raise DataError(
                f"{self._describe(i, exc)} (--skip-bad-samples replaces such a sample)"
            ) from None
        if self._labels is None:
            self._labels = known_labels(self.base)
        labels, tried = self._labels, 0
        for step in range(1, self.n):
            j = (i + step) % self.n
            if labels is not None and not torch.equal(labels[j], labels[i]):
                continue
            if tried == _STAND_IN_TRIES:
                break
            tried += 1
            try:
                sample = self._read(epoch * self.n + j)
            except Exception:  # noqa: BLE001 - a bad stand-in: walk on
                continue
            self.noted.append(
                (i, f"{self._describe(i, exc)}; {self._describe(j)} stands in for it")
            )
            return sample
        kin = " of its label" if labels is not None else ""
        raise DataError(
            f"{self._describe(i, exc)}, nor can any of the next {tried} samples{kin}"
        ) from None

    def take(self) -> list[tuple[int, str]]:
        """The replacements noted since the last call (where they happened)."""
        noted, self.noted = self.noted, []
        return noted

    def settle(self, noted: Iterable[tuple[int, str]]) -> None:
        """Count replacements handed over with a batch; warn once per sample."""
        for i, warning in noted:
            self.replaced += 1
            if i not in self._warned:
                self._warned.add(i)
                log.get().warning(f"{warning} (--skip-bad-samples)")


def sample_path(dataset: Dataset[Any], i: int) -> str | None:
    """The file sample ``i`` is read from, where the dataset says (torchvision's ``samples``)."""
    while isinstance(dataset, (SeededAugment, Guarded)):
        dataset = dataset.base
    try:
        path = getattr(dataset, "samples", None)[i][0]  # type: ignore[index]
    except (TypeError, IndexError, KeyError):
        return None
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else None


def replaced(dataset: Dataset[Any]) -> int:
    """Samples of ``dataset`` this process trained or evaluated on a stand-in for."""
    return dataset.replaced if isinstance(dataset, Guarded) else 0


def take_noted(dataset: Dataset[Any]) -> list[tuple[int, str]]:
    return dataset.take() if isinstance(dataset, Guarded) else []


def known_labels(dataset: Dataset[Any]) -> torch.Tensor | None:
    """Every label of ``dataset`` where it holds them apart from its samples, else None."""
    if isinstance(dataset, (SeededAugment, Guarded)):
        return known_labels(dataset.base)
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[1]
    if hasattr(dataset, "targets"):  # torchvision ImageFolder and friends
        return torch.as_tensor(dataset.targets)
    return None
