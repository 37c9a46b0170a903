"""The data: datasets by name, a corpus prepared once into token shards, and the order every
sample is read in, the same under any shape.

Modules, from the data up:

- ``tokenizer``: text to token ids and back (bytes, or ``--tokenizer DIR``);
- ``splits``: ``DataSplits``, what a dataset gives the run (splits, classes, the model's input);
- ``samples``: how one sample is read: by key, seeded augmentations, samples that cannot be read;
- ``order``: which samples each step trains on, and each stage-0 replica's rows of them: a pure
  function of ``(seed, epoch, global index)``;
- ``sources``: the datasets by name (``SOURCES``), their splits, and what a model is built for;
- ``prepare``: ``python -m bundle.data prepare``: text, .jsonl(.gz), .parquet or a saved dataset
  tokenized once into token shards (imported by that command only: numpy, tqdm, a pool);
- ``shards``: those shards on disk: their ``index.json`` (checked, verified) and one split read as
  one memory-mapped sequence of tokens (``TokenStream``);
- ``tokens``: ``--dataset tokens``: such a corpus's windows, in an order drawn without a table;
- ``data_files``: ``--data-files``: the files its globs match, in order, the ``datasets`` builder
  that reads each, and their digest (what a stream's position is counted in);
- ``stream``: ``--dataset hf``: .jsonl(.gz)/.parquet files streamed with ``datasets``, tokenized
  and packed as they are read (prepare's split and encoder), resumed from a recorded position;
- ``classify``: ``--dataset hf --label-field``: a row each, one text classification sample,
  padded to ``--seq-len`` with its attention mask (named inputs, ``models.inputs``);
- ``loader``: a stage's micro-batches read in order, with loader workers prefetching.

The names most callers use are here: ``data.load``, ``data.input_spec``, ``data.global_batch``.
"""

from typing import Any

from bundle.data.order import (
    Shard,
    epoch_order,
    global_batch,
    replica_indices,
    steps_per_epoch,
    stream_indices,
)
from bundle.data.samples import size
from bundle.data.sources import (
    SOURCES,
    SYNTHETIC_CLASSES,
    TEXT_VOCAB,
    DataSplits,
    check_data,
    check_resume,
    digits_arrays,
    identity,
    input_spec,
    load,
    named_inputs,
    train_size,
)

__all__ = [
    "SOURCES",
    "SYNTHETIC_CLASSES",
    "TEXT_VOCAB",
    "DataSplits",
    "Shard",
    "check_data",
    "check_resume",
    "digits_arrays",
    "epoch_steps",
    "epoch_order",
    "global_batch",
    "identity",
    "input_spec",
    "load",
    "named_inputs",
    "replica_indices",
    "stream_indices",
    "size",
    "steps_per_epoch",
    "train_size",
]


def epoch_steps(train: Any, batch: int, steps: int) -> int:
    """Steps in an epoch of ``train``: a stream (``--dataset hf``, no length) has one, the run."""
    return steps if getattr(train, "endless", False) else steps_per_epoch(size(train), batch)
