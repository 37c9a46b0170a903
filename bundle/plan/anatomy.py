"""A model's anatomy, counted on the meta device: no memory, no arithmetic.

Per block of ``models.blocks(model)``, counted at two row counts so that every count is
``fixed + per_row * rows``: parameters, how many of them are frozen (``--lora``'s base: no
gradient, no optimizer state, no sync), and the shapes of those that train (for PowerSGD's cost);
what a cut after the block sends; the bytes the block's forward saves for backward (storages
once, parameters never, as ``bundle.engine.memory.SavedBytes`` counts them; and how many of those
its predecessor saves too: the tensor between them); and every operator's FLOPs and bytes moved,
forward and backward, for the roofline estimate of a device the planner does not run on. The
model is built as the run trains it (``ModelSpec.build``): with ``--lora`` its base is frozen
before it is counted, so a frozen layer's backward counts its input's gradient and no weight
gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from bundle import models
from bundle.config import ModelConfig, parse_model_args

# (flops per row, bytes fixed, bytes per row, 1 if the op computes in the autocast dtype)
Op = tuple[float, float, float, int]


@dataclass(frozen=True)
class ModelSpec:
    """The model a profile is of: its name (``--model``), one row's input shape, its classes, its
    ``--model-args``, and what of it trains (``--lora``, ``--lora-train``; None: all of it)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    args: str | None = None
    lora: str | None = None
    lora_train: str | None = None

    def build(self, *, meta: bool = False) -> torch.nn.Module:
        """The model as the run has it: ``--model-args`` passed and ``--lora`` applied
        (``models.adapt``), so that what requires a gradient is what the run trains; with
        ``meta`` on the meta device, adapters too."""
        make = models.build_on_meta if meta else models.build
        model = make(
            self.name,
            num_classes=self.num_classes,
            input_shape=self.input_shape,
            args=parse_model_args(self.args),
        )
        if self.lora is not None:
            cfg = ModelConfig(
                name=self.name, args=self.args, lora=self.lora, lora_train=self.lora_train
            )
            with torch.device("meta") if meta else contextlib.nullcontext():
                models.adapt(model, cfg, seed=0)
        return model


@dataclass(frozen=True)
class Linear:
    """``fixed + per_row * rows``: how a count grows with the rows of a micro-batch."""

    fixed: float
    per_row: float

    def at(self, rows: float) -> float:
        return self.fixed + self.per_row * rows

    @staticmethod
    def fit(at2: float, at4: float) -> Linear:
        per_row = (at4 - at2) / 2
        return Linear(at2 - 2 * per_row, per_row)


@dataclass(frozen=True)
class BlockAnatomy:
    name: str
    params: int
    out_elems: tuple[int, ...]  # elements per row of each floating-point output tensor
    out_other_bytes: int  # bytes per row of non-floating outputs (they cross without a gradient)
    saved: Linear  # bytes saved for backward by the block's forward (fp32)
    saved_shared: Linear  # of those, the bytes the previous block saves too (its output)
    fwd_ops: tuple[Op, ...]
    bwd_ops: tuple[Op, ...]
    # Of the parameters that train: PowerSGD's cost needs them; () if not counted.
    param_shapes: tuple[tuple[int, ...], ...] = ()
    frozen: int = 0  # of ``params``, those that do not train (--lora's base)

    @property
    def trained(self) -> int:
        """Parameters that get a gradient, optimizer state and a place in the sync."""
        return self.params - self.frozen


@dataclass(frozen=True)
class Anatomy:
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    blocks: tuple[BlockAnatomy, ...]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    @property
    def input_elems(self) -> int:
        return int(np.prod(self.input_shape))


class _OpCounter(TorchDispatchMode):
    """Records every operator's FLOPs and bytes moved (views move none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[float, float, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
        counter = flop_registry.get(func.overloadpacket)
        flops = float(counter(*args, **kwargs, out_val=out)) if counter else 0.0
        self.ops.append((flops, float(nbytes), int(counter is not None)))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _count_blocks(spec: ModelSpec, rows: int) -> list[dict]:
    """One pass over the blocks on the meta device at ``rows`` rows."""
    torch.manual_seed(0)
    input_shape = spec.input_shape
    model = spec.build(meta=True)
    with torch.device("meta"):
        blocks = models.blocks(model, input_shape)
    x: tuple[torch.Tensor, ...] = (
        torch.empty(rows, *input_shape, device="meta", dtype=models.input_dtype(model)),
    )
    out_rows, prev_saved, prev_keep = [], {}, []
    for i, (name, block) in enumerate(blocks):
        params = {_storage(p) for p in block.parameters()}
        saved: dict[int, int] = {}
        keep: list[torch.Tensor] = []  # saved tensors stay alive: their storage ids stay unique

        def pack(t: torch.Tensor, saved=saved, keep=keep, params=params) -> torch.Tensor:
            if _storage(t) not in params:
                saved[_storage(t)] = t.untyped_storage().nbytes()
                keep.append(t)
            return t

        inp = tuple(t.detach().requires_grad_(i > 0 and t.is_floating_point()) for t in x)
        fwd, bwd = _OpCounter(), _OpCounter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            out = block(*inp)
        outs = out if isinstance(out, tuple) else (out,)
        floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
        with bwd:
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
        out_rows.append(
            {
                "name": name,
                "params": sum(p.numel() for p in block.parameters()),
                "param_shapes": [tuple(p.shape) for p in block.parameters() if p.requires_grad],
                "frozen": sum(p.numel() for p in block.parameters() if not p.requires_grad),
                "out_elems": [o.numel() // rows for o in outs if o.is_floating_point()],
                "out_other": sum(o.nbytes // rows for o in outs if not o.is_floating_point()),
                "saved": sum(saved.values()),
                "shared": sum(n for k, n in saved.items() if k in prev_saved),
                "fwd": fwd.ops,
                "bwd": bwd.ops,
            }
        )
        prev_saved, prev_keep = saved, keep  # noqa: F841 - keeps the previous block's ids valid
        x = tuple(o.detach() for o in outs)
    return out_rows


def count_anatomy(
    model_name: str, input_shape, num_classes: int, args: str | None = None
) -> Anatomy:
    """The anatomy of a model that trains whole, counted at 2 and 4 rows (``count``)."""
    return count(ModelSpec(model_name, tuple(input_shape), num_classes, args))


def count(spec: ModelSpec) -> Anatomy:
    """The anatomy of ``spec``'s model as the run trains it, counted at 2 and 4 rows and fitted
    linearly in rows."""
    two, four = (_count_blocks(spec, r) for r in (2, 4))
    blocks = []
    for a, b in zip(two, four, strict=True):
        ops = {}
        for key in ("fwd", "bwd"):
            ops[key] = tuple(
                (f4 / 4, Linear.fit(n2, n4).fixed, Linear.fit(n2, n4).per_row, half)
                for (_, n2, half), (f4, n4, _) in zip(a[key], b[key], strict=True)
            )
        blocks.append(
            BlockAnatomy(
                name=a["name"],
                params=a["params"],
                out_elems=tuple(a["out_elems"]),
                out_other_bytes=a["out_other"],
                saved=Linear.fit(a["saved"], b["saved"]),
                saved_shared=Linear.fit(a["shared"], b["shared"]),
                fwd_ops=ops["fwd"],
                bwd_ops=ops["bwd"],
                param_shapes=tuple(tuple(int(d) for d in s) for s in a["param_shapes"]),
                frozen=a["frozen"],
            )
        )
    return Anatomy(spec.name, tuple(spec.input_shape), spec.num_classes, tuple(blocks))
