"""The traced graph read once before it is cut (``Analysis``): where each module begins, which
values cross each point, which of them are batched (found by running the graph on a few rows) and
which a later stage computes again instead of receiving. ``models.graph`` asks it where to cut."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.errors import PartitionError
from bundle.models.export import fetch, first_line, is_constant, module_of, plain
from bundle.models.segment import Segment

Example = tuple[torch.Tensor, ...]  # a few rows of each of the forward's inputs, in order

# Operators a stage must not run again (a recomputed value must be the same value).
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential")
# In-place operators that change no value (only autograd's view of it): run again freely, as
# BERT's mask before transformers 5 is made (``detach_`` of a tensor made from the mask).
_KEEP_VALUES = (torch.ops.aten.detach_.default,)


class Analysis:
    """The traced graph in order, with where each module begins and what each value is."""

    def __init__(self, model: nn.Module, graph: fx.Graph, example: Example, named: bool) -> None:
        self.model, self.graph = model, graph
        # The data inputs: the traced Selected(model) takes them alone (defaults are inlined).
        self.inputs = [n for n in graph.nodes if n.op == "placeholder"]
        # Named inputs after the primary: every stage reads them from the data, never received.
        self.side = set(self.inputs[1:]) if named else set()
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.body = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        self.index = {n: i for i, n in enumerate(self.body)}
        self.first: dict[str, int] = {}
        self.whole: set[str] = set()  # modules called as one unit
        for i, n in enumerate(self.body):
            path = module_of(n)
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
        self.recomputable = self._recomputable()

    def _recomputable(self) -> set[fx.Node]:
        """Values a later stage computes again instead of receiving: those made from constants,
        buffers and the batch size only (positions, masks, rotary tables), never from a
        parameter that trains, a random draw or a write."""
        out: set[fx.Node] = set()
        for n in self.body:
            if n.op != "call_function":
                continue
            if n.target is torch.ops.aten.sym_size.int and n.args[1] == 0:
                if self.batched.get(n.args[0]) == "":  # the batch size, of any batched value
                    out.add(n)
                continue
            schema = getattr(n.target, "_schema", None)
            name = getattr(n.target, "__name__", str(n.target))
            mutates = schema is not None and schema.is_mutable and n.target not in _KEEP_VALUES
            if schema is None or mutates or any(w in name for w in _RANDOM):
                continue
            if all(i in out or i in self.side or self._constant(i) for i in n.all_input_nodes):
                out.add(n)
        return out

    def _constant(self, n: fx.Node) -> bool:
        if n.op != "get_attr":
            return False
        if n.target == "training" or is_constant(n):
            return True
        value = fetch(self.model, str(n.target))
        return not (isinstance(value, torch.Tensor) and value.requires_grad)

    @torch.no_grad()
    def _run(self, example: Example) -> dict[fx.Node, str]:
        """Per value, '' if it is a tensor with the batch first, else what it is instead."""
        kinds: dict[fx.Node, str] = {}
        rows = example[0].shape[0]

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
                _interpret(Probe(Segment(self.model, self.graph)), example)
        except Exception as exc:  # noqa: BLE001 - reported as the model's own failure
            reason = plain(first_line(exc)).rstrip(".")
            raise PartitionError(
                f"{type(self.model).__name__} fails on an input of shape "
                f"{tuple(example[0].shape[1:])}: {reason}{built_for(self.model)}"
            ) from None
        finally:
            self.model.train(was)
        return kinds

    def crossing(self, at: int) -> list[fx.Node]:
        """The values defined before body[at] and used from it on, in graph order."""
        return [n for n, (d, last) in self.span.items() if d < at <= last]

    def sent(self, at: int) -> list[fx.Node]:
        """The crossing values sent to the stage beginning at body[at] (the rest it recomputes)."""
        return [n for n in self.crossing(at) if n not in self.recomputable and n not in self.side]

    def reads(self, lo: int, hi: int) -> list[fx.Node]:
        """The named inputs the stage over body[lo:hi] reads from the data: used by its nodes,
        by what it returns, or by what it computes again."""
        seen: set[fx.Node] = set()
        used: set[fx.Node] = set()

        def visit(n: fx.Node) -> None:
            if n in seen:
                return
            seen.add(n)
            if n in self.side:
                used.add(n)
            elif n in self.recomputable and self.index[n] < lo:
                for i in n.all_input_nodes:
                    visit(i)

        ends = self.output.all_input_nodes if hi == len(self.body) else self.sent(hi)
        for n in [*ends, *(i for m in self.body[lo:hi] for i in m.all_input_nodes)]:
            visit(n)
        return [n for n in self.inputs if n in used]

    def why_not(self, at: int) -> str:
        """'' if a stage can begin at body[at], else why not."""
        sent = self.sent(at)
        for n in sent:
            kind = self.batched.get(n, "")
            if kind:
                return f"{n.name} crossing it is {kind}"
        if not sent:
            return "nothing computed from the input crosses it"
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


def built_for(model: nn.Module) -> str:
    """What input ``model`` says it was built for (timm's ``pretrained_cfg``, a transformers
    config's ``image_size``), as the end of a message ('' where it says nothing)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if size is None:
        image = getattr(getattr(model, "config", None), "image_size", None)
        size = (image, image) if isinstance(image, int) else None
    if not isinstance(size, (tuple, list)) or not size:
        return "; give it the input it was built for (--image-size, --seq-len) or build it for this one"
    return (
        f"; it was built for inputs of {'x'.join(map(str, size))}: give --image-size "
        f"{size[-1]}, or build it for this input (--model-args, e.g. img_size or image_size)"
    )


def _interpret(probe: fx.Interpreter, example: Example) -> None:
    """``probe.run(*example)`` without its progress bar (whose lock outlives a worker process),
    each value dropped after its last use."""
    probe.env, probe.args_iter = {}, iter(example)
    for node in probe.graph.nodes:
        probe.env[node] = probe.run_node(node)
        for dead in probe.user_to_last_uses.get(node, []):
            del probe.env[dead]
