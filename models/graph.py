"""Any ``nn.Module`` as ordered pipeline blocks, by a split of its graph: torch.fx's, or where fx
cannot trace the forward, torch.export's (``models.export``).

The model's forward is traced once (under fx, ``torch.nn`` layers and ``torchvision.ops`` modules
stay whole calls). Values made only from constants, buffers and the batch size are computed
again by the stage that needs them instead of crossing. A *point* is a module path; the stage it begins starts at the first graph node that module
(or anything inside it) runs. Between two neighbouring points lies one block, a ``Segment``: a
``GraphModule`` over the nodes in between that takes every value crossing its start and returns
every value crossing its end, so a skip connection over a boundary simply travels as one more
tensor. Parameters and buffers keep their full-model names and are fetched by the segment that
uses them; none is ever sent.

The default points follow the module tree: the root's children, and the children of every
container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) or of a module holding a
container of non-trivial modules (a ViT's ``encoder`` holds its layers), so ``encoder.layers.3``,
``features.7`` or ``blocks.2`` are points. Any other called module path may be asked for too.

A point can be cut only where every crossing value is a tensor whose first dimension is the batch
(found by running the graph once on a few rows): a point that fails says so, naming what crosses.
A forward that reads ``self.training`` outside ``torch.nn`` layers would be baked into the trace;
the module doing so is kept whole instead (found by tracing in both modes and comparing).

A split is made once per job (by the launch's checks, on the meta device): ``dump`` writes its
segments' graphs, ``load`` rebuilds them over another instance of the model, and devices the
capture wrote as constants read the segment's input instead, so a segment runs wherever it is put.
Tensors the capture lifted out of the forward travel with the graph as data (``torch.save``,
read back with ``weights_only=True``).

Here: the capture and the cut. The block, ``Segment``, is ``models.segment``; the traced graph
read once (where modules begin, what crosses, what is recomputed) is ``models.analysis``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.errors import PartitionError
from bundle.models.analysis import Analysis, Example
from bundle.models.export import (
    CONSTANT,
    WRAPPER,
    exported,
    first_line,
    is_constant,
    module_of,
    owned,
    plain,
)
from bundle.models.outputs import check_forward, selected
from bundle.models.segment import Segment as Segment

Block = tuple[str, nn.Module]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Rows of the example batch: odd, so a tensor whose first dimension happens to match is unlikely.
_ROWS = 3


class _Tracer(fx.Tracer):
    def __init__(self, leaves: frozenset[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (
            qualname in self.leaves
            or type(m).__module__.startswith("torchvision.ops")
            or super().is_leaf_module(m, qualname)
        )


def _trace(
    model: nn.Module, leaves: frozenset[str], key: str | None, names: tuple[str, ...]
) -> fx.Graph:
    tracer = _Tracer(frozenset(f"{WRAPPER}.{leaf}" for leaf in leaves))
    try:
        # Named inputs: the root takes *inputs, one placeholder each, in order.
        concrete: Any = (fx.PH,) * len(names) if names else None  # fx takes a tuple too
        graph = tracer.trace(selected(model, key, names), concrete_args=concrete)
    except Exception as exc:  # noqa: BLE001 - any tracing failure: the capture by export next
        raise _Untraceable(plain(first_line(exc))) from None
    return owned(graph)


class _Untraceable(Exception):
    """torch.fx cannot trace the forward (its reason, first line)."""


def _signature(graph: fx.Graph) -> list[str]:
    return [f"{n.op} {n.target} {n.args} {n.kwargs}" for n in graph.nodes]


def trace(
    model: nn.Module, example: Example, key: str | None = None, names: tuple[str, ...] = ()
) -> fx.Graph:
    """The model's graph, the same in training and in evaluation mode: torch.fx's where it can
    trace the forward, else ``torch.export``'s (control flow on shapes and configs, as in
    Hugging Face models). ``names``: the batch's named inputs (``models.inputs``), () for one."""
    check_forward(model, names)
    try:
        return _fx_trace(model, key, names)
    except _Untraceable as exc:
        return exported(model, example, key, str(exc), names)


def _fx_trace(model: nn.Module, key: str | None, names: tuple[str, ...]) -> fx.Graph:
    leaves: set[str] = set()
    was = model.training
    try:
        for _ in range(len(list(model.modules())) + 1):
            model.train()
            train = _trace(model, frozenset(leaves), key, names)
            model.eval()
            evaluation = _trace(model, frozenset(leaves), key, names)
            a, b = _signature(train), _signature(evaluation)
            if a == b:
                return train
            differing = _differing_modules(train, evaluation) - leaves
            if differing and "" not in differing:
                leaves |= differing  # every module that reads self.training, in one pass
                continue
            i = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            node = list(train.nodes)[min(i, len(a) - 1)]
            path = module_of(node)
            while path in leaves:  # kept whole already: the choice is its parent's
                path = path.rpartition(".")[0]
            if not path:
                raise PartitionError(
                    f"cannot cut {type(model).__name__} into stages: its own forward depends on "
                    "self.training (traced differently in training and evaluation mode)"
                )
            leaves.add(path)  # the module that reads self.training runs whole
    finally:
        model.train(was)
    raise AssertionError("unreachable: every module made whole")


def _by_module(graph: fx.Graph) -> dict[str, list[str]]:
    """Each module's own operations (innermost path), as targets and constants: names left out,
    so an operation added or removed elsewhere does not make a module differ."""
    out: dict[str, list[str]] = {}
    for n in graph.nodes:
        consts = [a for a in (*n.args, *n.kwargs.values()) if not isinstance(a, fx.Node)]
        out.setdefault(module_of(n), []).append(f"{n.op} {n.target} {consts}")
    return out


def _differing_modules(train: fx.Graph, evaluation: fx.Graph) -> set[str]:
    """The modules whose own operations differ between the training and evaluation traces."""
    a, b = _by_module(train), _by_module(evaluation)
    return {path for path in a.keys() | b.keys() if a.get(path) != b.get(path)}


def _expands(module: nn.Module, path: str, a: Analysis) -> bool:
    """Whether a module's children are points rather than the module itself: a container's are,
    and so are those of a module holding a container of composite modules (a ViT's encoder), or
    holding a module that does (BERT's ``bert`` holds ``encoder``, which holds its layers)."""
    if path in a.whole:
        return False
    if isinstance(module, _CONTAINERS):
        return True

    def composite(m: nn.Module, p: str) -> bool:
        return p not in a.whole and any(True for _ in m.children())

    def expands_within(m: nn.Module, p: str) -> bool:
        return not isinstance(m, _CONTAINERS) and _expands(m, p, a)

    return any(
        isinstance(c, _CONTAINERS)
        and f"{path}.{name}" not in a.whole
        and any(composite(g, f"{path}.{name}.{k}") for k, g in c.named_children())
        or expands_within(c, f"{path}.{name}")
        for name, c in module.named_children()
    )


def default_points(model: nn.Module, a: Analysis) -> list[tuple[str, int]]:
    """(point, where its stage would begin) from the module tree, in graph order."""
    out: list[tuple[str, int]] = []

    def expand(prefix: str, module: nn.Module, start: int) -> None:
        children = [(f"{prefix}{name}", c) for name, c in module.named_children()]
        called = sorted((a.first[p], p, c) for p, c in children if p in a.first)
        for j, (at, path, child) in enumerate(called):
            at = min(start, at) if j == 0 else at
            if _expands(child, path, a):
                expand(path + ".", child, at)
            else:
                out.append((path, at))

    expand("", model, 0)
    return out


def blocks(
    model: nn.Module,
    example: Example,
    points: Sequence[str] = (),
    key: str | None = None,
    names: tuple[str, ...] = (),
) -> list[Block]:
    """The model cut at its default points and ``points`` (each checked), as ``Segment`` blocks;
    ``key``: which of the forward's outputs the last one returns (models.outputs.select);
    ``names``: the batch's named inputs, in the order of ``example`` (() for one input)."""
    a = Analysis(model, trace(model, example, key, names), example, bool(names))
    if not a.body:
        raise PartitionError(f"{type(model).__name__}'s forward computes nothing")
    starts: dict[int, str] = {}
    for point, at in default_points(model, a):
        if at not in starts and (at == 0 or not a.why_not(at)):
            starts[at] = point
    for point in points:
        at = a.where(point)
        why = a.why_not(at) if at else ""
        if why:
            raise PartitionError(f"cannot cut at {point!r}: {why}")
        starts[at] = point  # the name asked for wins over a default one at the same place
    if 0 not in starts:
        starts[0] = module_of(a.body[0]) or a.body[0].name
    bounds = sorted(starts)
    return [
        (starts[lo], _segment(a, lo, hi, names))
        for lo, hi in zip(bounds, [*bounds[1:], len(a.body)], strict=True)
    ]


def _segment(a: Analysis, lo: int, hi: int, names: tuple[str, ...]) -> Segment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in a.sent(lo) if lo else a.inputs:
        env[n] = graph.placeholder(n.name)
    batch = next(iter(env.values()))  # a batched input: its first dimension is the batch size
    side = tuple(names[a.inputs.index(n)] for n in a.reads(lo, hi)) if lo else ()
    for n, name in zip(a.reads(lo, hi) if lo else (), side, strict=True):
        env[n] = graph.placeholder(name)

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:
            if n in a.recomputable and a.index[n] < lo:  # computed again here, not received
                if n.target is torch.ops.aten.sym_size.int:
                    env[n] = graph.call_function(torch.ops.aten.sym_size.int, (batch, 0))
                else:
                    env[n] = graph.node_copy(n, arg)
            elif n.op == "get_attr":
                env[n] = graph.get_attr(str(n.target))
                if is_constant(n):
                    env[n].meta[CONSTANT] = n.meta[CONSTANT]
            else:
                raise AssertionError(f"{n.name} is neither crossing nor computed here")
        return env[n]

    for n in a.body[lo:hi]:
        env[n] = graph.node_copy(n, arg)
    if hi == len(a.body):
        graph.output(fx.map_arg(a.output.args[0], arg))
    else:
        outs = [arg(n) for n in a.sent(hi)]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    return Segment(a.model, _on_input_device(graph, batch), side=side)


def _on_input_device(graph: fx.Graph, batch: fx.Node) -> fx.Graph:
    """Devices the capture wrote into the graph as constants (export records ``torch.arange(n,
    device=x.device)`` with the device it was captured on) read from the segment's input
    instead, so a segment captured on the CPU or the meta device runs wherever it is moved."""
    device: fx.Node | None = None

    def follow(value: Any) -> Any:
        nonlocal device
        if not isinstance(value, torch.device):
            return value
        if device is None:
            last = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(last):
                device = graph.call_function(getattr, (batch, "device"))
        return device

    for n in list(graph.nodes):
        if n.op == "call_function" and n is not device:
            n.args = fx.node.map_aggregate(n.args, follow)
            n.kwargs = fx.node.map_aggregate(n.kwargs, follow)
    return graph
