"""A model's forward captured by ``torch.export`` (what torch.fx cannot trace: control flow on
shapes and configurations, as in Hugging Face models), and the naming both captures share.

Both capture ``Selected(model)`` (the model called with its fixed arguments, the loss's tensor
taken from its output), so their paths are the model's under ``m.``: ``owned`` names them as the
model does. Export's capture is made in training mode with the batch dynamic; dropout's,
attention dropout's and batch norm's training flag then reads the segment's own mode, export's
guards and checks are dropped, and a weight the model ties under several names is fetched under
the name of the module using it.

What export makes that the model does not hold becomes part of the graph itself: a tensor it lifted
out of the forward (``torch.tensor(1.0)``, older releases' ``lifted_tensor_0``) is a constant the
graph carries (``CONSTANT`` in its node's meta), read by every segment using it; a forward whose
capture holds higher-order operators (``wrap_with_set_grad_enabled`` over a ``submod_N``) or
functorch's ``vmap`` (older ``transformers``' masks) is lowered to plain ATen operators first
(export's own ``run_decompositions({})``, which keeps every operator it need not lower).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from bundle.errors import PartitionError
from bundle.models.outputs import selected


def fetch(model: nn.Module, target: str) -> object:
    owner, _, leaf = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


WRAPPER = "m"  # the traced root is Selected(model): its paths are the model's under "m."
# The key, in a get_attr node's meta, of the tensor export lifted, which the graph carries.
CONSTANT = "bundle_constant"


def own(path: str) -> str:
    """A path in the traced wrapper -> the model's own ('' for the model itself)."""
    if path == WRAPPER:
        return ""
    return path[len(WRAPPER) + 1 :] if path.startswith(WRAPPER + ".") else path


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def plain(reason: str) -> str:
    """A tracer's reason without its internal names (fx's ``Proxy(getitem)``, export's ``s77``)."""
    reason = re.sub(r"Proxy\(\w+\)|'Proxy' object|\bProxy\b", "a traced value", reason)
    return re.sub(r"\b[su]\d+\b", "a traced size", reason)


def owned(graph: fx.Graph) -> fx.Graph:
    """Targets named as in the model itself, not in the traced wrapper."""
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            n.target = own(str(n.target))
    return graph


def module_of(node: fx.Node) -> str:
    """The innermost module path the node runs in ('' for the root's own code)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]  # (qualified name, type), as fx and export record
    return own(str(path))


# Operators whose training flag export records as a constant: (operator, the flag's position).
_MODE_ARGS = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.native_dropout.default: 2,  # dropout, once lowered (_lowered)
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
    # batch norm, once lowered (_lowered): the running statistics it returns are written back
    torch.ops.aten._native_batch_norm_legit_functional.default: 5,
    torch.ops.aten._native_batch_norm_legit.default: 5,
    torch.ops.aten.native_batch_norm.default: 5,
}
# Batch norm's count of the batches it saw, which the capture adds one to in every mode.
_COUNTED = "num_batches_tracked"
_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
# Operators taking a dropout probability that forwards set to 0 outside training.
_DROPOUT_P = {torch.ops.aten.scaled_dot_product_attention.default: 4}
# Checks export leaves in the graph, with no users: dropped (they would stretch their inputs'
# lifetimes across stage boundaries).
_CHECKS = ("_assert", "sym_constrain")


def exported(
    model: nn.Module,
    example: tuple[torch.Tensor, ...],
    key: str | None,
    fx_reason: str,
    names: tuple[str, ...] = (),
) -> fx.Graph:
    """The forward captured by ``torch.export`` with the batch dynamic, in training mode; a
    dropout's or batch norm's training flag then follows the segment's own mode. ``names``:
    the batch's named inputs, in the order of ``example``."""
    batch = torch.export.Dim("batch", min=1)
    # A named forward takes *inputs: their shapes are given as one tuple.
    dims = ((({0: batch},) * len(example)),) if names else ({0: batch},)
    was = model.training
    model.train()
    try:
        with _quiet(), _as_processes_run():
            program = torch.export.export(
                selected(model, key, names), example, dynamic_shapes=dims, strict=False
            )
    except Exception as exc:  # noqa: BLE001 - neither capture works: both reasons, one line
        raise PartitionError(
            f"cannot cut {type(model).__name__} into stages: torch.fx cannot trace its forward "
            f"({fx_reason}) and torch.export cannot capture it ({plain(first_line(exc))}); it "
            "trains whole at one-stage shapes (data parallelism)"
        ) from None
    finally:
        model.train(was)
    module = _lowered(model, program)
    # The graph's new attributes are the model's (its segments'), not the exported module's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _tied_names(model, owned(_own_mode(_constants(model, module))))


def _foreign(model: nn.Module, module: fx.GraphModule) -> list[str]:
    """What the exported module holds that a graph over the model's tensors cannot: higher-order
    operators and their subgraphs, functorch's transforms (vmap), objects other than tensors."""
    out: list[str] = []
    for n in module.graph.nodes:
        if n.op == "call_function" and (
            isinstance(n.target, torch._ops.HigherOrderOperator)
            or str(getattr(n.target, "__module__", "")).startswith("torch._functorch")
        ):
            out.append(getattr(n.target, "__name__", str(n.target)))
        elif n.op == "get_attr" and not _owned_by(model, str(n.target)):
            value = fetch(module, str(n.target))
            if not isinstance(value, torch.Tensor):
                out.append(f"{n.target} (a {type(value).__name__})")
    return out


def _owned_by(model: nn.Module, target: str) -> bool:
    try:
        fetch(model, own(target))
    except AttributeError:
        return False
    return True


def _lowered(model: nn.Module, program: torch.export.ExportedProgram) -> fx.GraphModule:
    """The exported module, lowered to ATen operators where export left anything else in it."""
    module = program.module()
    if not _foreign(model, module):
        return module
    try:
        with _quiet():
            lowered = program.run_decompositions({}).module()
    except Exception as exc:  # noqa: BLE001 - said below, with what could not be lowered
        reason = plain(first_line(exc))
    else:
        left = _foreign(model, lowered)
        if not left:
            return lowered
        reason = f"it still holds {', '.join(sorted(set(left)))}"
    raise PartitionError(
        f"cannot cut {type(model).__name__} into stages: its captured forward holds "
        f"{', '.join(sorted(set(_foreign(model, module))))}, which cannot be lowered to ATen "
        f"operators ({reason}); it trains whole at one-stage shapes (data parallelism)"
    )


def _constants(model: nn.Module, module: fx.GraphModule) -> fx.Graph:
    """Tensors export lifted out of the forward (its ``lifted_tensor_N``, held by the exported
    module, not the model) carried by the graph itself: each such get_attr gets a name no
    attribute of the model has and its tensor in ``meta[CONSTANT]``."""
    graph = module.graph
    taken: dict[str, str] = {}
    for n in graph.nodes:
        if n.op != "get_attr" or _owned_by(model, str(n.target)):
            continue
        if str(n.target) not in taken:
            name = f"_constant_{len(taken)}"
            while hasattr(model, name):
                name = f"_{name}"
            taken[str(n.target)] = name
        n.meta[CONSTANT] = fetch(module, str(n.target))
        n.target = WRAPPER + "." + taken[str(n.target)]  # owned() reads it as the model's root
    return graph


def is_constant(n: fx.Node) -> bool:
    """Whether a get_attr node reads a tensor the graph carries (``CONSTANT``)."""
    return n.op == "get_attr" and CONSTANT in n.meta


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export's own warnings and graph dumps kept off the user's console."""
    loggers = [logging.getLogger(n) for n in _EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


@contextlib.contextmanager
def _as_processes_run() -> Iterator[None]:
    """A capture made on the meta device (the launch's checks) made as the job's processes run
    the forward: tensors it makes without a device (``torch.tensor(1.0)``, which export lifts
    out) on the CPU, so they have values to hand on, not on the meta device the checks made the
    default; and ``torch.autocast(device_type=x.device.type, enabled=False)`` (older
    transformers' rotary tables) taken as the CPU's, since autocast knows no meta device (it
    records nothing either way: the region runs outside any autocast)."""
    original = torch.autocast.__init__

    def init(self: torch.autocast, device_type: str, *args: Any, **kwargs: Any) -> None:
        original(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    device = torch.device("cpu") if torch.get_default_device().type == "meta" else None
    torch.autocast.__init__ = init  # type: ignore[method-assign]
    try:
        with device if device is not None else contextlib.nullcontext():
            yield
    finally:
        torch.autocast.__init__ = original  # type: ignore[method-assign]


def _own_mode(graph: fx.Graph) -> fx.Graph:
    """Export's guards and checks dropped; dropout's and batch norm's training flag read from
    the segment running them."""
    training: fx.Node | None = None
    for n in list(graph.nodes):
        name = getattr(n.target, "__name__", str(n.target))
        check = n.op == "call_function" and not n.users and name.startswith(_CHECKS)
        if n.op == "call_module" or check:
            graph.erase_node(n)  # export's guards and checks
        elif _counts_a_batch(n):
            if training is None:
                with graph.inserting_before(n):
                    training = graph.get_attr("training")
            with graph.inserting_before(n):
                n.args = (n.args[0], graph.call_function(_one_in_training, (training,)))
        elif n.op == "call_function" and (n.target in _MODE_ARGS or n.target in _DROPOUT_P):
            if training is None:
                with graph.inserting_before(n):
                    training = graph.get_attr("training")  # the segment's own flag
            args = list(n.args)
            if n.target in _MODE_ARGS:
                args[_MODE_ARGS[n.target]] = training
            elif len(args) > _DROPOUT_P[n.target] and args[_DROPOUT_P[n.target]]:
                with graph.inserting_before(n):
                    p = graph.call_function(_in_training, (args[_DROPOUT_P[n.target]], training))
                args[_DROPOUT_P[n.target]] = p
            n.args = tuple(args)
    return graph


def _counts_a_batch(n: fx.Node) -> bool:
    """Whether ``n`` is batch norm's ``num_batches_tracked + 1``, which the module adds in
    training only, and the capture in every mode."""
    if n.op != "call_function" or n.target not in _ADDS or len(n.args) < 2:
        return False
    count, one = n.args[0], n.args[1]
    if not isinstance(count, fx.Node) or count.op != "get_attr":
        return False
    return str(count.target).endswith(_COUNTED) and isinstance(one, int) and one == 1


def _one_in_training(training: bool) -> int:
    """A batch counted by batch norm: one in training, none in evaluation."""
    return 1 if training else 0


def _in_training(p: float, training: bool) -> float:
    """An attention's dropout probability, captured in training mode: none in evaluation."""
    return p if training else 0.0


def _tied_names(model: nn.Module, graph: fx.Graph) -> fx.Graph:
    """A weight the model holds under several names (tied) is fetched, by each operation that
    uses it, under the name of the module running it (export keeps one name for all): GPT-2's
    embedding reads ``transformer.wte.weight``, its head ``lm_head.weight``."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for n in [n for n in graph.nodes if n.op == "get_attr" and not is_constant(n)]:
        candidates = names.get(id(fetch(model, str(n.target))), [])
        if len(candidates) < 2:
            continue
        for user in list(n.users):
            path = module_of(user)
            best = max(candidates, key=lambda c: _shared_prefix(c.rpartition(".")[0], path))
            if best != n.target:
                with graph.inserting_before(n):
                    user.replace_input_with(n, graph.get_attr(best))
        if not n.users:
            graph.erase_node(n)
    return graph


def _shared_prefix(owner: str, path: str) -> int:
    """How many leading module names the two dotted paths share."""
    count = 0
    for a, b in zip(owner.split("."), path.split("."), strict=False):
        if a != b:
            break
        count += 1
    return count
