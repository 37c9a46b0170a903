"""A frozen base kept in fewer bytes (``--base-dtype``, with ``--lora``): each process converts
the frozen parameters of its own pieces after they are cut and loaded.

``bf16`` stores every frozen floating parameter in bfloat16; ``nf4`` stores the frozen weights
of linear layers (``nn.Linear``, transformers' ``Conv1D``) in QLoRA's 4-bit NormalFloat
(torchao's ``NF4Tensor``: blocks of 64 values, their scales quantized again in blocks of up to
256) and the rest of the frozen base in bfloat16; ``fp32`` stores it in float32. The output
layer and weights tied to another module keep bfloat16 (as QLoRA keeps them out of 4 bits), and
so does a weight whose size is not a multiple of 64.

A converted parameter is a ``Frozen`` tensor: it keeps its name, shape and the dtype it had (so
the activations, the boundaries between stages and the precision policy see the model they saw
before) and is widened from what it stores each time an operation reads it. A linear layer's
product (``F.linear``, ``aten.linear``, a ``Conv1D``'s ``addmm``) keeps only the stored weight
for its backward and widens it again there, so no micro-batch in flight holds a widened copy::

    y = x @ widen(W).T          dL/dx = dL/dy @ widen(W)          (W gets no gradient)

A ``Frozen`` tensor also carries the SHA-256 of the tensor it was stored from (``source``): what a
checkpoint keeps of it (``bundle.checkpoint.parts.digest_of``), so the base built again in full
(a resume, an export's merge) is checked as it is, whatever ``--base-dtype``.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from bundle.errors import ConfigError
from bundle.models.lora import _output_layer, adaptable

FLAG = "--base-dtype"
NF4_BLOCK = 64  # values per scale (QLoRA's)
NF4_SCALER_BLOCK = 256  # scales per second-level scale, at most
aten = torch.ops.aten


class Frozen(torch.Tensor):
    """A frozen parameter stored in another form (``stored``: bfloat16, or an ``NF4Tensor``),
    seen with its own shape and dtype; any operation reads it widened to that dtype. ``source``:
    the SHA-256 of the tensor it was stored from (uint8[32]), what a checkpoint keeps of it."""

    stored: torch.Tensor
    source: torch.Tensor

    @staticmethod
    def __new__(cls, stored: torch.Tensor, dtype: torch.dtype, source: torch.Tensor) -> Frozen:
        return torch.Tensor._make_wrapper_subclass(
            cls, stored.shape, dtype=dtype, device=stored.device, requires_grad=False
        )

    def __init__(self, stored: torch.Tensor, dtype: torch.dtype, source: torch.Tensor) -> None:
        self.stored, self.source = stored, source

    def holding(self, stored: torch.Tensor) -> Frozen:
        """The same tensor holding ``stored`` (moved or aliased)."""
        return Frozen(stored, self.dtype, self.source)

    def widened(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values, as a plain tensor of ``dtype`` (default: its own)."""
        s = self.stored
        plain = s.get_original_weight() if hasattr(s, "get_original_weight") else s
        return plain.to(dtype or self.dtype)

    @property
    def stored_bytes(self) -> int:
        """Bytes the stored form holds (an NF4 tensor's codes, scales and table)."""
        s = self.stored
        if not hasattr(s, "quantized_data"):
            return s.numel() * s.element_size()
        inner = cast(Any, s).__tensor_flatten__()[0]
        return sum(getattr(s, n).numel() * getattr(s, n).element_size() for n in inner)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Frozen({type(self.stored).__name__}, shape={tuple(self.shape)}, {self.dtype})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save of a state dict: its values
        return self.widened().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        product = _product(func, args, kwargs)
        if product is not None:
            return product
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.data and func.__name__ == "__set__":
            _take(*args)
        return out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first: Any = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default):
            return first.holding(first.stored)
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, first.dtype):
            moved = {k: v for k, v in kwargs.items() if k in ("device", "non_blocking")}
            with torch._C._EnableTorchFunction():  # an NF4 tensor moves by its own ``to``
                return first.holding(first.stored.to(**moved))
        if func is aten.copy_.default and isinstance(first, Frozen):
            return _copy_into(first, args[1])
        plain = tree_map(lambda t: t.widened() if isinstance(t, Frozen) else t, (args, kwargs))
        return func(*plain[0], **plain[1])


def _take(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.data = src``, as ``Module.to`` moves a parameter: what ``src`` holds goes along."""
    if isinstance(dst, Frozen) and isinstance(src, Frozen):
        dst.stored, dst.source = src.stored, src.source
    elif isinstance(dst, Frozen):
        raise TypeError(f"a frozen base tensor ({dst!r}) takes another's data, not a plain one")


def _copy_into(dst: Frozen, src: torch.Tensor) -> Frozen:
    """``dst.copy_(src)``: the same values cost nothing (replicas that build the same base and
    broadcast it at start); others are stored again, and are its source."""
    if isinstance(src, Frozen):
        src = src.widened()
    if not torch.equal(dst.widened(), src.to(dst.dtype)):
        s = dst.stored
        dst.stored = _nf4(src) if hasattr(s, "quantized_data") else src.to(s.dtype)
        dst.source = sha256(src.to(dst.dtype))
    return dst


def sha256(t: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a tensor's bytes (uint8[32]), as a checkpoint digests a frozen base tensor."""
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return torch.frombuffer(bytearray(hashlib.sha256(data.tobytes()).digest()), dtype=torch.uint8)


class _Product(torch.autograd.Function):
    """A linear layer's ``x @ W.T + b`` (a ``Conv1D``'s ``b + x @ W``) keeping only the stored
    ``W`` for the backward, where it is widened again."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: Frozen, bias: torch.Tensor | None, conv1d: bool
    ) -> torch.Tensor:
        ctx.w, ctx.conv1d = w, conv1d  # W never trains: its stored form is all there is to keep
        weight, b = w.widened(), _plain(bias)
        if not conv1d:
            return F.linear(x, weight, b)
        return x @ weight if b is None else torch.addmm(b, x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight = ctx.w.widened(grad.dtype)
        dx = grad @ (weight.T if ctx.conv1d else weight)
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, db, None


_LINEAR = (F.linear, aten.linear.default)
_ADDMM = (torch.addmm, aten.addmm.default)


def _product(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A linear layer's product with a frozen weight, else None (an operation like any other)."""
    if func in _LINEAR and len(args) >= 2 and isinstance(args[1], Frozen):
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return _Product.apply(_plain(args[0]), args[1], bias, False)
    if func in _ADDMM and len(args) == 3 and not kwargs and isinstance(args[2], Frozen):
        return _Product.apply(_plain(args[1]), args[2], args[0], True)
    return None


def _plain(t: Any) -> Any:
    return t.widened() if isinstance(t, Frozen) else t


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in NF4: blocks of 64, the scales' blocks as large as divide their count."""
    scaler_block = math.gcd(NF4_SCALER_BLOCK, weight.numel() // NF4_BLOCK)
    nf4: torch.Tensor = _to_nf4()(weight.detach().contiguous(), NF4_BLOCK, scaler_block)
    return nf4


def _to_nf4() -> Any:
    """torchao's ``to_nf4`` (optional, and untyped), where its release keeps it."""
    for where in ("torchao.quantization", "torchao.dtypes.nf4tensor"):
        try:
            return importlib.import_module(where).to_nf4
        except (ImportError, AttributeError):
            continue
    raise ConfigError(FLAG, "nf4", "needs torchao: pip install torchao")


def linear_weights(model: nn.Module) -> tuple[set[str], list[str]]:
    """The full-model names of the frozen weights ``nf4`` stores in 4 bits (linear layers', not
    the output layer's nor one tied to another module), and those of the linear weights left in
    bfloat16 because their size is not a multiple of 64."""
    head = _output_layer(model)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    fit, misfit = set(), []
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if not adaptable(m) or m is head or w is None or w.requires_grad or uses[id(w)] > 1:
            continue
        full = f"{name}.weight" if name else "weight"
        if w.numel() % NF4_BLOCK == 0:
            fit.add(full)
        else:
            misfit.append(full)
    return fit, misfit


@dataclass
class Converted:
    """What ``convert`` did: bytes of the frozen base before and after, per stored form."""

    before: int = 0
    after: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, before: int, after: int) -> None:
        self.before += before
        self.after[kind] = self.after.get(kind, 0) + after

    def text(self) -> str:
        """``this process's frozen base 1.2 MiB -> 0.3 MiB (bf16 0.1, nf4 0.2)``."""
        mib, after = 2.0**20, sum(self.after.values())
        kinds = ", ".join(f"{k} {v / mib:.3g}" for k, v in sorted(self.after.items()))
        sizes = f"{self.before / mib:.3g} MiB -> {after / mib:.3g} MiB"
        return f"this process's frozen base {sizes} ({kinds})"


def convert(
    pieces: Sequence[nn.Module], base_dtype: str, nf4_names: Iterable[str] = ()
) -> Converted:
    """Store the frozen floating parameters of ``pieces`` as ``base_dtype`` says, in place: those
    named in ``nf4_names`` (full-model names: a piece's ``full_name`` of its own, where it has
    one) in NF4 under ``nf4``. A parameter several modules hold (tied) is converted once and
    stays shared."""
    nf4 = set(nf4_names) if base_dtype == "nf4" else set()
    names: dict[int, str] = {}
    for piece in pieces:
        full_name: Callable[[str], str] = getattr(piece, "full_name", lambda n: n)
        for n, p in piece.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), full_name(n))
    done: dict[int, nn.Parameter] = {}
    report = Converted()
    for m in (m for piece in pieces for m in piece.modules()):
        for key, t in list(m._parameters.items()):
            if t is None or t.requires_grad or not t.is_floating_point() or t.is_meta:
                continue
            if id(t) not in done:
                done[id(t)] = _stored(t, names[id(t)] in nf4, base_dtype, report)
            m._parameters[key] = done[id(t)]
    return report


def _stored(p: nn.Parameter, in_nf4: bool, base_dtype: str, report: Converted) -> nn.Parameter:
    before = p.numel() * p.element_size()
    if isinstance(p, Frozen):
        raise ConfigError(FLAG, base_dtype, "the base is converted already")
    if base_dtype == "fp32":
        out = nn.Parameter(p.detach().float(), requires_grad=False)
        report.add("fp32", before, out.numel() * 4)
        return out
    stored = _nf4(p) if in_nf4 else p.detach().to(torch.bfloat16)
    frozen = Frozen(stored, p.dtype, sha256(p))
    report.add("nf4" if in_nf4 else "bf16", before, frozen.stored_bytes)
    return nn.Parameter(frozen, requires_grad=False)


def stored_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s frozen parameters hold as stored (each once)."""
    seen = {id(p): p for p in module.parameters() if not p.requires_grad}
    return sum(
        p.stored_bytes if isinstance(p, Frozen) else p.numel() * p.element_size()
        for p in seen.values()
    )
