"""A stage's backward in two halves, for the zero-bubble schedules (bundle.ir.schedule).

- ``input_half`` (the schedule's I): the gradient of the stage's inputs, which the stage upstream
  waits for. It keeps the autograd graph and, through hooks, the gradients arriving at the
  intermediates from which the weights' gradients branch off ("parameter groups": the graph
  walk of torch.distributed.pipelining's ``stage_backward_input``, whose helpers it uses).
- ``weight_half`` (W): the weights' gradients from those intermediates, later, while the stage
  would otherwise wait. It runs as ``torch.autograd.backward`` over the intermediates' gradient
  edges with the weights as ``inputs``, so the weights' gradients are accumulated by autograd
  itself and every gradient hook fires (DDP's reducer and the hierarchical sync's buckets, as in
  a whole backward); torch's ``stage_backward_weight`` writes ``.grad`` directly and would skip
  them.

The two halves together compute the whole backward's gradients, each summed in the same order.
Where the walk cannot split the graph (no input needs a gradient, as on the first stage, or a
weight is not reached through the inputs' part of the graph), I computes only the inputs'
gradient (if any) and W is the whole backward over the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge


@functools.cache
def _walk() -> Any:
    """torch.distributed.pipelining's graph walk (torch >= 2.5), or None. Imported when a split
    backward first runs: the package pulls in DTensor, a second of start-up that a run of any
    other schedule does without."""
    try:
        from torch.distributed.pipelining import _backward
    except ImportError:  # pragma: no cover - older torch: W is the whole backward over the weights
        return None
    return _backward


@dataclass
class Held:
    """What the input half keeps for the weight half of one micro-batch."""

    # The weights W accumulates into (the stage's, reached from its outputs).
    weights: list[torch.Tensor]
    # Per parameter group: (its intermediates, the gradients each received in the input half,
    # its weights).
    groups: list[tuple[list[Any], list[Any], list[torch.Tensor]]] | None
    # Kept only where W runs the whole backward over the weights (``groups`` is None).
    outputs: list[torch.Tensor] | None = None
    grads: list[torch.Tensor] | None = None


def _grad_node(t: torch.Tensor) -> Any:
    return _walk()._get_grad_fn_or_grad_acc(t)


def input_half(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> Held:
    """Accumulate the inputs' gradients into their ``.grad``; return what W needs."""
    outs = [o for o in outputs if o.requires_grad]
    gs = list(grads) if grads is not None else [torch.ones_like(o) for o in outs]
    xs = [x for x in inputs if x.requires_grad]
    ws = [w for w in weights if w.requires_grad]
    if not outs:
        return Held([], [])
    walk = _walk() if xs else None
    if walk is None:
        if xs:
            _accumulate(xs, torch.autograd.grad(outs, xs, gs, retain_graph=True))
        return Held(ws, None, outs, gs)
    roots = [n for n in map(_grad_node, outs) if n is not None]
    reverse = walk.construct_reverse_graph(roots)
    node_of = {_grad_node(w): w for w in ws}
    reached = [w for n, w in node_of.items() if n in reverse or n in roots]
    groups = walk.get_param_groups(
        [n for n in map(_grad_node, xs) if n is not None], list(node_of), reverse
    )
    covered = {n for g in groups for n in g["params"]}
    if any(_grad_node(w) not in covered for w in reached):
        _accumulate(xs, torch.autograd.grad(outs, xs, gs, retain_graph=True, allow_unused=True))
        return Held(reached, None, outs, gs)
    captured: list[list[Any]] = []
    handles = []
    for g in groups:
        seen: list[Any] = [None] * len(g["intermediates"])
        g["intermediates"] = list(g["intermediates"])
        captured.append(seen)
        for i, node in enumerate(g["intermediates"]):
            handles.append(node.register_prehook(_capture(seen, i)))
    try:
        _accumulate(xs, torch.autograd.grad(outs, xs, gs, retain_graph=True, allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    held = [
        (g["intermediates"], seen, [node_of[n] for n in g["params"]])
        for g, seen in zip(groups, captured, strict=True)
    ]
    return Held(reached, held)


def _capture(seen: list[Any], i: int):
    def hook(grad_outputs):
        seen[i] = grad_outputs

    return hook


def _accumulate(xs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor | None]) -> None:
    for x, g in zip(xs, gs, strict=True):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g


def weight_half(held: Held) -> None:
    """Accumulate the weights' gradients (through autograd, so their hooks fire)."""
    if held.groups is None:
        if held.outputs:
            torch.autograd.backward(held.outputs, held.grads, inputs=held.weights)
        return
    for nodes, seen, weights in held.groups:
        edges, grads = [], []
        for node, got in zip(nodes, seen, strict=True):
            for i, grad in enumerate(got or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue
        # An intermediate downstream of another in the same group would pass its gradient on
        # again: each is held to the gradients it received in the input half.
        clamps = (
            [n.register_prehook(lambda _, g=got: g) for n, got in zip(nodes, seen, strict=True)]
            if len(nodes) > 1
            else []
        )
        try:
            torch.autograd.backward(edges, grads, inputs=weights)
        finally:
            for h in clamps:
                h.remove()
