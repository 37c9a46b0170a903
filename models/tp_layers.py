"""What a split layer computes (``models.tp`` splits it): Megatron-LM's two conjugate functions,
each style's forward, and the forwards of a LoRA-adapted layer (``models.lora``) split with its
adapters.

``all_reduce`` sums in place over the tensor-parallel group (the engine injects it)::

    colwise   y_r = x @ W_r.T + b_r          f = copy_to_tp:   forward identity,   backward sum
    rowwise   y   = g(x_r @ W_r.T) + b       g = reduce_from_tp: forward sum,      backward identity

An adapted layer's adapters are split as its weight, the Megatron/PEFT way (``s`` the scaling)::

    colwise   y_r = base_r(f(x)) + B_r(A(drop(f(x)))) * s      B's rows split, A whole
    rowwise   y   = g(x_r @ W_r.T) + b + B(g(A_r(drop(x_r)))) * s      A's columns split, B whole

A colwise layer's ``A`` is used whole by every rank, but each rank's backward sees only its own
output rows, so its gradient is partial there and is summed (f applied to the weight); a
rowwise layer's ``B`` sees the summed input, so its gradient is whole on every rank. A rowwise
adapted layer sums twice in forward, the base's product and then the adapters', in that order
on every rank (one sum of both, concatenated, would save a call; it is not done).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from bundle.models import lora

AllReduce = Callable[[Tensor], None]


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, all_reduce: AllReduce) -> Tensor:
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # A copy: the incoming gradient may be the same tensor another branch receives.
        summed = grad.clone(memory_format=torch.contiguous_format)
        ctx.all_reduce(summed)
        return summed, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the partial outputs summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, all_reduce: AllReduce) -> Tensor:
        summed = x.clone(memory_format=torch.contiguous_format)
        all_reduce(summed)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, all_reduce: AllReduce) -> Tensor:
    return cast(Tensor, _CopyToTP.apply(x, all_reduce))


def reduce_from_tp(x: Tensor, all_reduce: AllReduce) -> Tensor:
    return cast(Tensor, _ReduceFromTP.apply(x, all_reduce))


def grad_summed(p: Tensor, all_reduce: AllReduce) -> Tensor:
    """Parameter ``p`` as one use of it sees it, its gradient from that use summed over the
    group (a parameter whole on every rank whose gradient is partial on each)."""
    return copy_to_tp(p, all_reduce)


# -- the layers --------------------------------------------------------------------------------


class _Colwise:
    """The forward of a colwise (or packed) layer: its own, on f of its input."""

    tp_all_reduce: AllReduce

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().forward(copy_to_tp(x, self.tp_all_reduce), *args, **kwargs)  # type: ignore[misc]


class _Rowwise:
    """The forward of a rowwise layer: the partial products summed, then the bias once."""

    tp_all_reduce: AllReduce
    weight: Tensor
    bias: Tensor | None

    def forward(self, x: Tensor) -> Tensor:
        out = reduce_from_tp(F.linear(x, self.weight), self.tp_all_reduce)
        return out if self.bias is None else out + self.bias


@contextlib.contextmanager
def _summing_grads(params: dict[str, nn.Parameter | None], all_reduce: AllReduce) -> Iterator[None]:
    """While it lasts, each parameter of ``params`` (a module's ``_parameters``) that trains is
    seen through f: each use sums its gradient over the group, so gradient accumulation over
    micro-batches stays exact."""
    own = dict(params)
    for name, p in own.items():
        if p is not None and p.requires_grad:
            params[name] = grad_summed(p, all_reduce)  # type: ignore[assignment]
    try:
        yield
    finally:
        params.update(own)


class _GradSummed:
    """The forward of a replicated module whose parameters' gradients are partial: its own,
    with f on each parameter that trains."""

    tp_all_reduce: AllReduce
    _parameters: dict[str, nn.Parameter | None]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _summing_grads(self._parameters, self.tp_all_reduce):
            return super().forward(*args, **kwargs)  # type: ignore[misc]


class _ColwiseAdapted(_Colwise):
    """An adapted colwise layer (``lora_B`` split as the weight, ``lora_A`` whole): its own
    forward on f of its input, with f on ``lora_A``'s weight where it trains."""

    lora_A: nn.Linear

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        with _summing_grads(self.lora_A._parameters, self.tp_all_reduce):
            return super().forward(x, *args, **kwargs)


class _RowwiseAdapted(_Rowwise):
    """An adapted rowwise layer (``lora_A`` split as the weight, ``lora_B`` whole): the base's
    sum, then the adapters' partial products summed before ``lora_B``."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        partial = self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))
        update = self.lora_B(reduce_from_tp(partial, self.tp_all_reduce))
        return out + update * self.scaling


_FORWARDS: dict[str, type] = {
    "colwise": _Colwise,
    "packed_colwise": _Colwise,
    "rowwise": _Rowwise,
    "replicate_grad_sum": _GradSummed,
}
_ADAPTED: dict[str, type] = {
    "colwise": _ColwiseAdapted,
    "packed_colwise": _ColwiseAdapted,
    "rowwise": _RowwiseAdapted,
}
_CLASSES: dict[tuple[type, str], type] = {}


def tp_class(m: nn.Module, style: str) -> type:
    """``m``'s class with ``style``'s forward (an adapted layer's where ``m`` is one), under
    its own class name; one class per (class, style), kept here under a name of its own so
    that pickle finds it."""
    base = type(m)
    if (base, style) not in _CLASSES:
        forward = (_ADAPTED if lora.is_adapted(m) else _FORWARDS)[style]
        key = f"TP_{style}_{base.__name__}"
        while key in globals():
            key += "_"
        cls = type(base.__name__, (forward, base), {"__module__": __name__})
        cls.__qualname__ = key
        _CLASSES[base, style] = globals()[key] = cls
    return _CLASSES[base, style]
