"""What a model's forward gives the loss, and a whole model as one block.

A forward takes one tensor (further arguments have defaults, ``**kwargs`` is allowed) and may
return a tensor, a tuple or list, a dict or a ``transformers`` ``ModelOutput``. The rule, applied
the same at every shape: a tensor is itself; a mapping gives its ``logits`` entry (``--model-output
NAME`` names another), else its first tensor; a sequence gives its first tensor (``--model-output
N`` picks by position).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.errors import ConfigError

DEFAULT_KEY = "logits"


def _inputs(model: nn.Module) -> tuple[list[inspect.Parameter], bool]:
    """The forward's named parameters and whether it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return [], True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [
        p
        for p in params
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    return named, var_kw


def check_forward(model: nn.Module, names: tuple[str, ...] = ()) -> None:
    """One input: the forward's other named arguments need defaults (``**kwargs`` is fine).
    Named inputs (``names``): each is an argument of the forward (or ``**kwargs`` takes it), and
    every argument without a default is one of them."""
    named, var_kw = _inputs(model)
    required = [p.name for p in named if p.default is inspect.Parameter.empty]
    if names:
        unknown = [n for n in names if n not in {p.name for p in named}] if not var_kw else []
        lacking = [n for n in required if n not in names]
        if unknown or lacking:
            raise ConfigError(
                "--model",
                type(model).__name__,
                f"its forward takes no {unknown[0]!r}, which the data names"
                if unknown
                else f"its forward needs {lacking[0]!r}, which the data does not name",
            )
        return
    if len(required) > 1 or (not named and not var_kw):
        raise ConfigError(
            "--model",
            type(model).__name__,
            f"its forward must take one input (its other arguments need defaults), "
            f"not {len(required)} ({', '.join(required)})",
        )


def call_kwargs(model: nn.Module) -> dict[str, Any]:
    """Arguments every call gets: no key/value cache where the forward has one (training never
    reuses it, and a cache is state no stage boundary can carry)."""
    named, _ = _inputs(model)
    return {"use_cache": False} if any(p.name == "use_cache" for p in named) else {}


def select(out: Any, key: str | None = None) -> Any:
    """The tensor the loss takes from a forward's output (the rule above)."""
    if isinstance(out, (torch.Tensor, fx.Proxy)):  # a proxy: while torch.fx traces the model
        return out
    if isinstance(out, Mapping):  # a ModelOutput is an OrderedDict
        want = key or DEFAULT_KEY
        if want in out and isinstance(out[want], (torch.Tensor, fx.Proxy)):
            return out[want]
        if key is None:
            first = next((v for v in out.values() if isinstance(v, (torch.Tensor, fx.Proxy))), None)
            if first is not None:
                return first
        raise ConfigError(
            "--model-output",
            key or DEFAULT_KEY,
            f"the model returns a {type(out).__name__} with "
            f"{', '.join(str(k) for k in out) or 'no entries'}: name one of them",
        )
    if isinstance(out, (tuple, list)):
        if key is not None and str(key).isdigit() and int(key) < len(out):
            return select(out[int(key)])
        first = next((v for v in out if isinstance(v, (torch.Tensor, fx.Proxy))), None)
        if first is not None and key is None:
            return first
    raise ConfigError(
        "--model-output",
        key or DEFAULT_KEY,
        f"the model returns a {type(out).__name__}, not a tensor, tuple, dict or ModelOutput",
    )


class Selected(nn.Module):
    """``model`` called with its fixed arguments, the loss's tensor taken from its output."""

    def __init__(self, model: nn.Module, key: str | None = None) -> None:
        super().__init__()
        self.m, self.key, self.kwargs = model, key, call_kwargs(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return select(self.m(x, **self.kwargs), self.key)


class _Named(Selected):
    """``Selected`` over named inputs: called with them in order, it passes them by name."""

    def __init__(self, model: nn.Module, key: str | None, names: tuple[str, ...]) -> None:
        super().__init__(model, key)
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return select(self.m(**dict(zip(self.names, inputs, strict=True)), **self.kwargs), self.key)


def selected(model: nn.Module, key: str | None = None, names: tuple[str, ...] = ()) -> Selected:
    """The traced root: ``model`` called with one input, or with ``names`` in order."""
    return _Named(model, key, names) if names else Selected(model, key)


class Whole(nn.Module):
    """The whole model as one block, never traced or cut (one-stage shapes): its parameters and
    buffers keep the model's own names."""

    named_fully = True

    def __init__(
        self, model: nn.Module, key: str | None = None, names: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        self.names = names  # the batch's named inputs, passed by name in this order
        # The model's own tables: state dicts, .parameters() and .to() see its names.
        self._modules, self._parameters, self._buffers = (
            model._modules,
            model._parameters,
            model._buffers,
        )
        self.__dict__["_whole"] = model  # not a child: its entries are this module's own
        self.key, self.kwargs = key, call_kwargs(model)

    @property
    def whole_model(self) -> nn.Module:
        return self.__dict__["_whole"]

    def train(self, mode: bool = True) -> Whole:
        self.whole_model.train(mode)
        self.training = mode
        return self

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.names:
            named = dict(zip(self.names, inputs, strict=True))
            return select(self.whole_model(**named, **self.kwargs), self.key)
        return select(self.whole_model(*inputs, **self.kwargs), self.key)
