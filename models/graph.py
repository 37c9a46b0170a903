"""Any ``nn.Module`` as ordered pipeline blocks, by a split of its ``torch.fx`` graph.

The model's forward is traced once (``torch.nn`` layers and ``torchvision.ops`` modules stay whole
calls). A *point* is a module path; the stage it begins starts at the first graph node that module
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
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.errors import PartitionError

Block = tuple[str, nn.Module]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Rows of the example batch: odd, so a tensor whose first dimension happens to match is unlikely.
_ROWS = 3


class Segment(fx.GraphModule):
    """One block of a graph split; its parameters are named as in the full model."""


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


def _trace(model: nn.Module, leaves: frozenset[str]) -> fx.Graph:
    params = list(inspect.signature(model.forward).parameters.values())
    concrete = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}
    if not params or len(params) - len(concrete) != 1:
        raise PartitionError(
            f"{type(model).__name__}.forward must take one input (its other arguments need "
            f"defaults), not {len(params) - len(concrete)}"
        )
    try:
        return _Tracer(leaves).trace(model, concrete_args=concrete or None)
    except Exception as exc:  # noqa: BLE001 - any tracing failure is the same refusal
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PartitionError(
            f"cannot cut {type(model).__name__} into stages: torch.fx cannot trace its forward "
            f"({reason}); give an nn.Sequential, or a forward without data-dependent control flow"
        ) from None


def _module_of(node: fx.Node) -> str:
    """The innermost module path the node runs in ('' for the root's own code)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack)) if stack else ""


def _signature(graph: fx.Graph) -> list[str]:
    return [f"{n.op} {n.target} {n.args} {n.kwargs}" for n in graph.nodes]


def trace(model: nn.Module) -> fx.Graph:
    """The model's graph, the same in training and in evaluation mode."""
    leaves: set[str] = set()
    was = model.training
    try:
        for _ in range(len(list(model.modules())) + 1):
            model.train()
            train = _trace(model, frozenset(leaves))
            model.eval()
            evaluation = _trace(model, frozenset(leaves))
            a, b = _signature(train), _signature(evaluation)
            if a == b:
                return train
            i = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            node = list(train.nodes)[min(i, len(a) - 1)]
            path = _module_of(node)
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


class _Analysis:
    """The traced graph in order, with where each module begins and what each value is."""

    def __init__(self, model: nn.Module, graph: fx.Graph, example: torch.Tensor) -> None:
        self.model, self.graph = model, graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        # The data input; the forward's other arguments keep their defaults (concrete when
        # traced): every segment takes them as defaulted arguments of its own, none crosses.
        self.inputs, self.defaulted = placeholders[:1], placeholders[1:]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.body = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        self.index = {n: i for i, n in enumerate(self.body)}
        self.first: dict[str, int] = {}
        self.whole: set[str] = set()  # modules called as one unit
        for i, n in enumerate(self.body):
            path = _module_of(n)
            if n.op == "call_module":
                self.whole.add(str(n.target))
            parts = path.split(".") if path else []
            for k in range(1, len(parts) + 1):
                self.first.setdefault(".".join(parts[:k]), i)
        end = len(self.body)
        # Values that can cross a boundary: inputs and computed nodes (parameters are fetched).
        self.span: dict[fx.Node, tuple[int, int]] = {}
        for n in [*self.inputs, *self.body]:
            users = [end if u.op == "output" else self.index[u] for u in n.users]
            self.span[n] = (self.index.get(n, -1), max(users, default=-1))
        self.batched = self._run(example)

    @torch.no_grad()
    def _run(self, example: torch.Tensor) -> dict[fx.Node, str]:
        """Per value, '' if it is a tensor with the batch first, else what it is instead."""
        kinds: dict[fx.Node, str] = {}
        rows = example.shape[0]

        class Probe(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                value = super().run_node(n)
                if not isinstance(value, torch.Tensor):
                    kinds[n] = f"a {type(value).__name__}, not a tensor"
                elif value.dim() == 0 or value.shape[0] != rows:
                    kinds[n] = f"a tensor of shape {tuple(value.shape)} without the batch first"
                else:
                    kinds[n] = ""
                return value

        was = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                _interpret(Probe(fx.GraphModule(self.model, self.graph)), example)
        except Exception as exc:  # noqa: BLE001 - reported as the model's own failure
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PartitionError(
                f"{type(self.model).__name__} fails on an input of shape "
                f"{tuple(example.shape[1:])}: {reason}"
            ) from None
        finally:
            self.model.train(was)
        return kinds

    def crossing(self, at: int) -> list[fx.Node]:
        """The values defined before body[at] and used from it on, in graph order."""
        return [n for n, (d, last) in self.span.items() if d < at <= last]

    def why_not(self, at: int) -> str:
        """'' if a stage can begin at body[at], else why not."""
        for n in self.crossing(at):
            kind = self.batched.get(n, "")
            if kind:
                return f"{n.name} crossing it is {kind}"
        return ""

    def where(self, point: str) -> int:
        """Where the stage beginning at module ``point`` starts, or a PartitionError saying why not."""
        if point in self.first:
            return self.first[point]
        parent = next((w for w in self.whole if point.startswith(w + ".")), None)
        if parent is not None:
            raise PartitionError(
                f"cannot cut at {point!r}: it runs inside {parent!r}, which runs whole"
            )
        try:
            self.model.get_submodule(point)
        except AttributeError:
            raise PartitionError(f"unknown split point {point!r}: no such module") from None
        raise PartitionError(f"cannot cut at {point!r}: the model's forward never calls it")


def _interpret(probe: fx.Interpreter, example: torch.Tensor) -> None:
    """``probe.run(example)`` without its progress bar (whose lock outlives a worker process),
    each value dropped after its last use."""
    probe.env, probe.args_iter = {}, iter([example])
    for node in probe.graph.nodes:
        probe.env[node] = probe.run_node(node)
        for dead in probe.user_to_last_uses.get(node, []):
            del probe.env[dead]


def _expands(module: nn.Module, path: str, a: _Analysis) -> bool:
    """Whether a module's children are points rather than the module itself: a container's are,
    and so are those of a module holding a container of composite modules (a ViT's encoder)."""
    if path in a.whole:
        return False
    if isinstance(module, _CONTAINERS):
        return True

    def composite(m: nn.Module, p: str) -> bool:
        return p not in a.whole and any(True for _ in m.children())

    return any(
        isinstance(c, _CONTAINERS)
        and f"{path}.{name}" not in a.whole
        and any(composite(g, f"{path}.{name}.{k}") for k, g in c.named_children())
        for name, c in module.named_children()
    )


def default_points(model: nn.Module, a: _Analysis) -> list[tuple[str, int]]:
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


def blocks(model: nn.Module, example: torch.Tensor, points: Sequence[str] = ()) -> list[Block]:
    """The model cut at its default points and ``points`` (each checked), as ``Segment`` blocks."""
    a = _Analysis(model, trace(model), example)
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
        starts[0] = _module_of(a.body[0]) or a.body[0].name
    bounds = sorted(starts)
    return [
        (starts[lo], _segment(a, lo, hi))
        for lo, hi in zip(bounds, [*bounds[1:], len(a.body)], strict=True)
    ]


def _segment(a: _Analysis, lo: int, hi: int) -> Segment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in a.crossing(lo) if lo else a.inputs:
        env[n] = graph.placeholder(n.name)
    for n in a.defaulted:
        default = n.args[0] if n.args else None
        env[n] = graph.placeholder(n.name, default_value=default)

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise AssertionError(f"{n.name} is neither crossing nor computed here")
            env[n] = graph.get_attr(str(n.target))
        return env[n]

    for n in a.body[lo:hi]:
        env[n] = graph.node_copy(n, arg)
    if hi == len(a.body):
        graph.output(fx.map_arg(a.output.args[0], arg))
    else:
        outs = [arg(n) for n in a.crossing(hi)]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    return Segment(a.model, graph, class_name="Segment")
