"""A graph split made once, by the launch's checks, as bytes the job's other processes load
(``dump``, ``load``): each segment's nodes written by name (an operator by its qualified name,
a use of an earlier node as a reference), and the capture's constants apart, as tensors read
back with ``weights_only``. The bytes go from the launcher to its own workers, never to disk."""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.models.export import CONSTANT, is_constant
from bundle.models.graph import Block, Segment


@dataclass(frozen=True)
class _Ref:
    """A node's use of an earlier node, by name, as written."""

    name: str


class _Pickler(pickle.Pickler):
    """Writes an operator (``torch.ops.aten.add.Tensor``, not picklable itself) by its name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return _operator, (str(obj),)
        return NotImplemented


def _operator(name: str) -> Any:
    return functools.reduce(getattr, name.split("."), torch.ops)


def dump(blocks: Sequence[Block]) -> bytes | None:
    """A graph split's blocks as bytes that ``load`` turns into the same blocks of another
    instance of the model, without capturing its forward again; None when the blocks are not a
    graph split, or hold an operation that cannot be written by name."""
    segments = [(name, m) for name, m in blocks if isinstance(m, Segment)]
    if not segments or len(segments) < len(blocks):
        return None

    def ref(a: Any) -> Any:
        return _Ref(a.name) if isinstance(a, fx.Node) else a

    def row(n: fx.Node) -> tuple[Any, ...]:
        return (
            n.op,
            n.name,
            n.target,
            fx.node.map_aggregate(n.args, ref),
            fx.node.map_aggregate(n.kwargs, ref),
        )

    # The capture's constants as data, apart from the graphs: keyed "segment/node".
    constants = {
        f"{i}/{n.name}": n.meta[CONSTANT]
        for i, (_, m) in enumerate(segments)
        for n in m.graph.nodes
        if is_constant(n)
    }
    if any(t.device.type == "meta" and t.numel() for t in constants.values()):
        return None  # a constant made on the meta device has no values: captured again
    tensors = io.BytesIO()
    torch.save({k: _values(t) for k, t in constants.items()}, tensors)
    out = io.BytesIO()
    try:
        rows = [(name, m.side, [row(n) for n in m.graph.nodes]) for name, m in segments]
        _Pickler(out).dump((rows, tensors.getvalue()))
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        return None  # an operation only this process can name: every process captures its own
    return out.getvalue()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A constant as data (an empty one made on the meta device, a cache's, has all its values)."""
    if t.device.type == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return t.detach().cpu()


def load(model: nn.Module, dumped: bytes) -> list[Block]:
    """``dump``'s blocks, over ``model``'s own parameters and buffers."""
    out: list[Block] = []
    segments, tensors = pickle.loads(dumped)  # noqa: S301 - written by this job's own launcher
    constants = torch.load(io.BytesIO(tensors), weights_only=True)
    for i, (name, side, rows) in enumerate(segments):
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}

        def get(a: Any, env: dict[str, fx.Node] = env) -> Any:
            return env[a.name] if isinstance(a, _Ref) else a

        for op, node_name, target, args, kwargs in rows:
            env[node_name] = graph.create_node(
                op,
                target,
                fx.node.map_aggregate(args, get),
                fx.node.map_aggregate(kwargs, get),
                name=node_name,
            )
            if f"{i}/{node_name}" in constants:
                env[node_name].meta[CONSTANT] = constants[f"{i}/{node_name}"]
        out.append((name, Segment(model, graph, side=side)))
    return out
