"""One block of a graph split, ``Segment``: a ``GraphModule`` over the full model, its parameters
under their full-model names, carrying the tensors the capture lifted out of the forward. Apart
from the split itself, as what the analysis runs, ``models.graph`` cuts and ``models.split_io``
rebuilds."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.models.export import CONSTANT, is_constant


class Segment(fx.GraphModule):
    """One block of a graph split; its parameters are named as in the full model. A tensor the
    capture lifted out of the forward (``export.CONSTANT``) is a plain attribute: in no state
    dict and never synced (it is no parameter or buffer of the model), moved with the segment.
    ``side``: the named inputs it reads from the data (``models.inputs``), taken after the
    values it receives."""

    named_fully = True

    def __init__(
        self,
        model: nn.Module,
        graph: fx.Graph,
        class_name: str = "Segment",
        side: tuple[str, ...] = (),
    ) -> None:
        constants = {str(n.target): n.meta[CONSTANT] for n in graph.nodes if is_constant(n)}
        super().__init__(_Root(model, constants) if constants else model, graph, class_name)
        self.side = side
        for name, value in constants.items():
            self._buffers.pop(name, None)
            self._non_persistent_buffers_set.discard(name)
            self.__dict__[name] = value
        self._bundle_constants = tuple(constants)  # a name no model's attribute takes

    def _apply(self, fn: Any, recurse: bool = True) -> Segment:
        super()._apply(fn, recurse)
        for (
            name
        ) in self._bundle_constants:  # .to(device) moves the constants as it moves the weights
            self.__dict__[name] = fn(self.__dict__[name])
        return self


class _Root(nn.Module):
    """The model, seen with the capture's constants at its root (what ``Segment`` copies from)."""

    def __init__(self, model: nn.Module, constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.training = model.training
        self.__dict__.update(constants, _model=model)
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)
