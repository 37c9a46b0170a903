"""A model cut into pieces: its blocks (``models.blocks``, captured from its graph where it has
no chain of its own; a Hugging Face causal LM's own modules under tensor parallelism,
``models.hf_chain``) split where ``models.partition`` says each piece begins; the graph split
made once (``Capture``) and handed to the job's other processes.

A piece is a list of blocks; the engine runs each as a ``Stage`` (``bundle.engine.stage``). A
boundary may carry several tensors: a block that returns a tuple feeds the next block as
``block(*prev)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import torch.nn as nn

from bundle import log, models
from bundle.config import ModelConfig
from bundle.errors import PartitionError
from bundle.models import Block, hf_chain, split_io
from bundle.models.inputs import Inputs
from bundle.models.partition import PartitionSpec, load_spec, resolve

_SAY_AFTER_S = 5.0  # a cut that captures for longer says what it is doing


@dataclass(frozen=True)
class Capture:
    """A model's graph split, made once by the launch's checks (on the meta device) and handed
    to the job's processes, which load it instead of capturing the forward again; ``key`` names
    what was cut (``capture_key``)."""

    key: str
    blocks: bytes


def capture_key(cfg: ModelConfig, input_shape: Sequence[int], inputs: Inputs | None = None) -> str:
    """What a capture depends on: the model as built, its cut points, its output and input."""
    return repr(
        (cfg.name, sorted(cfg.kwargs.items()), cfg.config_file, cfg.pretrained, cfg.partition)
        + (cfg.output, tuple(input_shape), inputs.key() if inputs else None)
        + ((cfg.lora, cfg.lora_train) if cfg.lora else ())  # adapters are in the graph
    )


def capture_of(
    pieces: Sequence[Sequence[Block]],
    cfg: ModelConfig,
    input_shape: Sequence[int],
    inputs: Inputs | None = None,
) -> Capture | None:
    """The graph split behind ``cut``'s pieces, for the job's other processes (None: the model
    was not cut by its graph, or holds an operation that cannot be handed on)."""
    dumped = split_io.dump([block for piece in pieces for block in piece])
    key = capture_key(cfg, input_shape, inputs)
    return Capture(key, dumped) if dumped is not None else None


def cut(
    model: nn.Module,
    cfg: ModelConfig,
    num_pieces: int,
    input_shape: Sequence[int],
    capture: Capture | None = None,
    inputs: Inputs | None = None,
    *,
    at_modules: bool = False,
) -> list[list[Block]]:
    """The model's blocks cut into ``num_pieces`` pieces at ``--partition`` (default: balanced);
    from ``capture`` when it was made for the same model and input (``capture_of``). ``inputs``:
    the batch's named inputs (None: one tensor). ``at_modules`` (a pipeline with tensor
    parallelism): a Hugging Face causal LM of ``models.hf_chain.FAMILIES`` fed one tensor is cut
    at its own modules, not by its graph, so that its stages hold the layers to split."""
    spec = load_spec(cfg.partition) if cfg.partition else None
    if num_pieces == 1 and spec is None:  # nothing to cut: never traced
        return [models.whole(model, cfg.output, inputs)]
    own = hf_chain.blocks(model, cfg.output) if at_modules and inputs is None else None
    if own is not None and spec is not None:
        spec = replace(spec, starts=hf_chain.starts(spec.starts))
    try:
        if own is not None:
            blocks = own
        elif capture is not None and capture.key == capture_key(cfg, input_shape, inputs):
            blocks = split_io.load(model, capture.blocks)
        else:
            blocks = _captured(model, spec, cfg, num_pieces, input_shape, inputs)
        return split_blocks(blocks, resolve(spec, blocks, num_pieces, cfg.name))
    except PartitionError as exc:
        if spec is None:
            raise
        raise PartitionError(f"--partition {cfg.partition}: {exc}") from None


def _captured(
    model: nn.Module,
    spec: PartitionSpec | None,
    cfg: ModelConfig,
    num_pieces: int,
    input_shape: Sequence[int],
    inputs: Inputs | None,
) -> list[Block]:
    """The model's blocks from a capture of its forward made here, saying so when it runs long."""
    started = time.monotonic()
    # Capturing a large model's forward takes tens of seconds: say so once it runs long.
    said = threading.Timer(
        _SAY_AFTER_S,
        lambda: log.get().info(
            f"cutting {cfg.name} into {num_pieces} stages: capturing its forward "
            "(fx, or torch.export where fx cannot trace it)"
        ),
    )
    said.daemon = True
    said.start()
    try:
        points = spec.starts if spec else ()
        blocks = models.blocks(model, input_shape, points, cfg.output, inputs)
    finally:
        said.cancel()
    if time.monotonic() - started > _SAY_AFTER_S:
        log.get().info(f"cut {cfg.name} in {time.monotonic() - started:.0f}s")
    return blocks


def split_blocks(blocks: Sequence[Block], starts: Sequence[int]) -> list[list[Block]]:
    """``blocks`` cut into pieces beginning at the given indices (from ``resolve``), none empty.
    A parameter several pieces use (tied weights) is held by each of them; the engine sums their
    gradients among them every step (``bundle.engine.ties``)."""
    bounds = [*starts, len(blocks)]
    if not starts or starts[0] != 0 or any(a >= b for a, b in pairwise(bounds)):
        raise PartitionError(
            f"stage starts {tuple(starts)} must begin at 0 and increase below {len(blocks)}"
        )
    return [list(blocks[a:b]) for a, b in pairwise(bounds)]
