"""Reading a stage's micro-batches in order: each key list (``bundle.data.order.Shard``) fetched as one
(inputs, labels) batch, in this process or with ``--workers`` loader workers prefetching; the last
stage reads labels only. A sample that cannot be read reaches the trainer as one ``DataError``
line, from a worker too; ``Guarded``'s replacements travel with their batch to be counted.

A dataset that reads whole batches itself (``fetch``, ``fetch_labels``: the token corpora) and
draws nothing at random (``thread_safe``) is read ahead of the step by a thread of this process
when there are no loader workers, so a step never waits for a page of the corpus to come in.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import queue
import signal
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from bundle.data.samples import Guarded, SeededAugment, known_labels, size, take_noted
from bundle.errors import DataError
from bundle.models.inputs import Batch, stack

AHEAD = 8  # micro-batches a read-ahead thread keeps ready


def _fetch(dataset: Dataset[Any], keys: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """The (inputs, labels) of the samples named by ``keys`` (see ``bundle.data`` for keys);
    named inputs (``models.inputs``) are stacked name by name."""
    if hasattr(dataset, "fetch"):
        return dataset.fetch(keys)
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        idx = keys % len(y)
        return x[idx], y[idx]
    if not isinstance(dataset, (SeededAugment, Guarded)):  # those two take keys
        keys = keys % size(dataset)
    xs, ys = zip(*(dataset[int(k)] for k in keys), strict=True)
    return stack(xs), torch.stack([torch.as_tensor(y) for y in ys])


@dataclass(frozen=True)
class _Failed:
    """A loader worker's ``DataError``, as text: raised again, as one line, where it is trained on."""

    message: str


class _BatchFetch(Dataset[Any]):
    """Loader workers fetch whole micro-batches through ``_fetch``, exactly as ``workers=0`` does,
    with the replacements made for them (``Guarded.take``)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, keys: list[int]) -> tuple[Batch, torch.Tensor, Any] | _Failed:
        try:
            x, y = _fetch(self.dataset, torch.tensor(keys, dtype=torch.long))
        except DataError as exc:
            # Raised here, the loader would re-raise it wrapped in this worker's traceback.
            return _Failed(str(exc))
        return x, y, take_noted(self.dataset)


class _Batches:
    """A sampler over precomputed key tensors (DataLoader keeps their order with workers)."""

    def __init__(self, index_lists: Iterable[torch.Tensor]) -> None:
        self.index_lists = index_lists

    def __iter__(self) -> Iterator[list[int]]:
        return (idx.tolist() for idx in self.index_lists)


def worker_init_fn(_worker_id: int) -> None:
    # The training process handles SIGINT/SIGTERM itself (it finishes the step and saves a
    # checkpoint); a Ctrl-C reaching the whole process group must not kill the loader mid-step.
    # The workers still exit when the loader shuts down or their parent dies (DataLoader watchdog).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@functools.cache
def _end_workers_at_exit() -> None:
    """At interpreter exit, kill this process's loader workers rather than wait for them.

    multiprocessing's own exit handler sends daemonic children SIGTERM and then joins them; the
    workers ignore SIGTERM (``worker_init_fn``), so while a loader is still referenced (by the
    traceback of a failure being reported, say) that join would never return. Handlers run in
    reverse order of registration: this one, registered after multiprocessing's, runs first.
    """
    atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    # DataLoader's SIGCHLD handler raises when a worker dies by a signal: these die by ours.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:  # DataLoader workers are; multiprocessing would end them here anyway
            child.kill()
            child.join(5)


def micro_batches(
    dataset: Dataset[Any],
    index_lists: Iterable[torch.Tensor],
    *,
    workers: int,
    pin_memory: bool = False,
) -> Iterator[tuple[Batch, torch.Tensor]]:
    """Fetch each key list as one (inputs, labels) pair, in order, with ``workers`` prefetching.

    ``pin_memory`` only when the process computes on CUDA: pinning opens a CUDA context (on
    cuda:0) in a process that may never use the GPU, such as a gloo run on a GPU host.
    """
    guarded = dataset if isinstance(dataset, Guarded) else None
    if getattr(dataset, "thread_safe", False) and (workers == 0 or hasattr(dataset, "seek")):
        # A stream (seek) reads in order in one place: loader workers would each need their own.
        yield from ahead(_fetch(dataset, idx) for idx in index_lists)
        return
    if workers == 0:
        for idx in index_lists:
            batch = _fetch(dataset, idx)
            if guarded is not None and guarded.noted:
                guarded.settle(guarded.take())
            yield batch
        return
    _end_workers_at_exit()
    loader = DataLoader(
        _BatchFetch(dataset),
        sampler=_Batches(index_lists),
        batch_size=None,  # each sampled item is already a whole micro-batch
        num_workers=workers,
        worker_init_fn=worker_init_fn,
        prefetch_factor=4,
        pin_memory=pin_memory,  # lets the stage's non_blocking copy overlap
    )
    # A local, so that a failure's traceback keeps it (and its workers) alive while the error is
    # reported: shut down with batches in flight, a worker can abort mid-send, noisily.
    batches = iter(loader)
    for item in batches:
        if isinstance(item, _Failed):
            raise DataError(item.message)
        x, y, noted = item
        if guarded is not None and noted:
            guarded.settle(noted)
        yield x, y


@dataclass(frozen=True)
class _Raised:
    error: BaseException


def ahead(items: Iterator[Any], depth: int = AHEAD) -> Iterator[Any]:
    """``items``, made by a daemon thread up to ``depth`` ahead of the caller; what the thread
    raises is raised here, where its item would have come."""
    made: queue.Queue[Any] = queue.Queue(maxsize=depth)
    end = object()

    def make() -> None:
        try:
            for item in items:
                made.put(item)
            made.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            made.put(_Raised(exc))

    threading.Thread(target=make, name="bundle-data-ahead", daemon=True).start()
    while (item := made.get()) is not end:
        if isinstance(item, _Raised):
            raise item.error
        yield item


def labels_of(dataset: Dataset[Any]) -> torch.Tensor:
    """Every label of ``dataset``, without decoding a single image where the dataset allows."""
    labels = known_labels(dataset)
    if labels is None:
        labels = torch.stack([torch.as_tensor(dataset[i][1]) for i in range(size(dataset))])
        take_noted(dataset)  # a stand-in's label read here is no sample trained on
    return labels


def stage_micro_batches(
    dataset: Dataset[Any],
    index_lists: Iterable[torch.Tensor],
    *,
    first: bool,
    workers: int,
    pin_memory: bool = False,
    side: tuple[str, ...] = (),
) -> Iterator[tuple[Batch | None, torch.Tensor]]:
    """Stage 0 reads (inputs, labels); the last stage reads only the labels of its own rows; a
    stage that reads named inputs (``side``, models.inputs) reads those of its own rows too."""
    if first:
        yield from micro_batches(dataset, index_lists, workers=workers, pin_memory=pin_memory)
        return
    if side:
        for x, y in micro_batches(dataset, index_lists, workers=workers, pin_memory=pin_memory):
            if not isinstance(x, dict):
                raise DataError(
                    f"the model reads {', '.join(side)} from the data, which names none"
                )
            yield {n: x[n] for n in side}, y
        return
    if hasattr(dataset, "fetch_labels"):  # a corpus: its windows' labels, never all of them
        yield from ahead((None, dataset.fetch_labels(keys)) for keys in index_lists)
        return
    labels = labels_of(dataset)
    for keys in index_lists:
        yield None, labels[keys % len(labels)]
