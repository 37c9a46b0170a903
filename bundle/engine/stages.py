"""The stages a run trains, cut from the model: the full model built alike on every process
(``--weights``, ``--pretrained`` loaded) and cut into pieces (``models.cut``), each run as a
``Stage``, what crosses each boundary between them, and the pieces one rank runs."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from bundle import log, models
from bundle.config import ModelConfig, RunConfig
from bundle.engine.precision import Policy
from bundle.engine.stage import Stage
from bundle.engine.tensor_parallel import Split
from bundle.engine.transport import Boundaries, TensorMeta
from bundle.ir.schedule import Pipe
from bundle.models import quant
from bundle.models.cut import Capture, cut
from bundle.models.inputs import Inputs


def build_stages(
    cfg: RunConfig,
    num_stages: int,
    input_shape: tuple[int, ...],
    num_classes: int,
    capture: Capture | None = None,
    *,
    keep: Collection[int] | None = None,
    inputs: Inputs | None = None,
    split: Split | None = None,
) -> list[Stage]:
    """The full model, seeded identically on every process (``--weights`` loaded), cut into
    stages (from ``capture`` where the launch's checks made the model's graph split).

    ``--pretrained``: the model is built with its parameters on the meta device and cut, and
    only the stages in ``keep`` (None: all) are given memory and read from the checkpoint; the
    others keep meta tensors (a weight tied to a kept stage's is that stage's tensor).
    ``inputs``: the batch's named inputs (None: one tensor). ``--lora`` adapts the model before
    it is cut (``models.adapt``); ``--base-dtype`` then stores the frozen base of the stages in
    ``keep``, once they are loaded (``store_base``). ``split``: this process's part of its
    replica's TP group, whose layers are split last (``Split.apply``)."""
    torch.manual_seed(cfg.train.seed)
    if cfg.model.pretrained:
        model = models.pretrained.build_empty(
            cfg.model.name,
            cfg.model.pretrained,
            num_classes=num_classes,
            input_shape=input_shape,
            args=cfg.model.kwargs,
        )
    else:
        model = models.build_model(cfg.model, num_classes, input_shape)
    models.adapt(model, cfg.model, seed=cfg.train.seed)
    at_modules = max(cfg.parallel.tp_degrees, default=1) > 1
    stages = cut_stages(
        model, cfg.model, num_stages, input_shape, capture, inputs, at_modules=at_modules
    )
    kept = [s for i, s in enumerate(stages) if keep is None or i in keep]
    if cfg.model.pretrained:
        # Split first, on the meta device: each process then reads only its shards.
        if split is not None:
            split.apply(model, kept)
        models.pretrained.load(
            model,
            cfg.model.pretrained,
            seed=cfg.train.seed,
            strict=cfg.model.weights_strict,
            pieces=stages,
            keep=keep,
            shards=split.reads() if split is not None else None,
        )
    elif split is not None:
        split.apply(model, kept)
    return store_base(model, stages, cfg.model, keep)


def store_base(
    model: torch.nn.Module,
    stages: list[Stage],
    cfg: ModelConfig,
    keep: Collection[int] | None = None,
) -> list[Stage]:
    """``--base-dtype``: the frozen base of the stages in ``keep`` (None: all) stored as it says
    (``models.quant``), each process its own; what it saved said once."""
    if cfg.base_dtype is None:
        return stages
    fit, misfit = quant.linear_weights(model)
    kept = [s for i, s in enumerate(stages) if keep is None or i in keep]
    done = quant.convert(kept, cfg.base_dtype, fit)
    say = log.get().info
    say(f"--base-dtype {cfg.base_dtype}: {done.text()}")
    if cfg.base_dtype == "nf4" and misfit:
        say(
            f"--base-dtype nf4: {len(misfit)} linear weights stay bf16, their size not a "
            f"multiple of {quant.NF4_BLOCK} (e.g. {misfit[0]})"
        )
    return stages


def lora_record(cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int) -> dict:
    """What a checkpoint records of a ``--lora`` run's adapters (``models.lora.Adapted``), from
    the model built again on the meta device (no memory)."""
    model = models.meta_model(cfg.model, num_classes, input_shape)
    with torch.device("meta"):
        adapted = models.adapt(model, cfg.model, seed=cfg.train.seed)
    assert adapted is not None, "lora_record is for a --lora run"
    return adapted.record()


def cut_stages(
    model: torch.nn.Module,
    cfg: ModelConfig,
    num_stages: int,
    input_shape: Sequence[int],
    capture: Capture | None = None,
    inputs: Inputs | None = None,
    *,
    at_modules: bool = False,
) -> list[Stage]:
    """The model cut into ``num_stages`` stages (``models.cut``'s pieces, from ``capture`` where
    it fits), each taking the model's input dtype and the batch's named ``inputs`` (None: one
    tensor); ``at_modules``: at its own modules where it has them (tensor parallelism)."""
    pieces = cut(model, cfg, num_stages, input_shape, capture, inputs, at_modules=at_modules)
    dtype, names = models.input_dtype(model), inputs.names if inputs is not None else ()
    return [Stage(piece, input_dtype=dtype, input_names=names) for piece in pieces]


@torch.no_grad()
def boundary_metas(
    stages: Sequence[Stage],
    input_shape: tuple[int, ...],
    policy: Policy,
    inputs: Inputs | None = None,
) -> list[tuple[TensorMeta, ...]]:
    """What crosses each stage boundary: shapes from one row on the CPU (dummy, or the data's
    example of named ``inputs``), once; dtype and layout from the precision policy, which every
    rank holds alike."""
    modes = [s.training for s in stages]
    # Pieces another process runs may hold no memory (--pretrained): then all run on meta.
    on_meta = any(t.is_meta for s in stages for t in s.state_dict(keep_vars=True).values())
    device = "meta" if on_meta else "cpu"
    metas: list[tuple[TensorMeta, ...]] = []
    if inputs is not None:
        x = inputs.example(1, device)
        side = dict(zip(inputs.names, x, strict=True))
    else:
        x, side = (torch.zeros(1, *input_shape, dtype=stages[0].input_dtype, device=device),), {}
    try:
        for s in stages[:-1]:
            if on_meta:
                state = {k: v.to("meta") for k, v in s.state_dict(keep_vars=True).items()}
                x = torch.func.functional_call(s.eval(), state, x, {"side": side})
            else:
                x = s.eval()(*x, side=side)
            metas.append(tuple(policy.boundary(TensorMeta.of(t)) for t in x))
    finally:
        for s, mode in zip(stages, modes, strict=True):
            s.train(mode)
    return metas


@dataclass(frozen=True)
class Pieces:
    """One rank's pieces of the model: where the model's pieces run (``pipe``), the ``modules``
    of the rank's model chunks in chunk order, and what crosses each boundary of the model
    (``metas``, as ``boundary_metas`` gives them)."""

    pipe: Pipe
    modules: Sequence[Stage]
    metas: Sequence[tuple[TensorMeta, ...]]

    def boundaries(self, piece: int) -> Boundaries:
        """What crosses the two boundaries of the model's piece ``piece``."""
        last = piece == self.pipe.pieces - 1
        return Boundaries(
            inputs=self.metas[piece - 1] if piece > 0 else (),
            outputs=self.metas[piece] if not last else (),
        )
