"""Models by name and their flattening into the ordered blocks stages are cut from.

``--model`` names one of three kinds:

- a model shipped here (``available()``): the small CPU models, and ``gpt``;
- any torchvision classification model (``torchvision.models.list_models``), random weights;
- a user's factory, ``package.module:function`` (or ``path/to/file.py:function``), called with
  the keyword arguments it declares among ``num_classes`` and ``input_shape`` (and any of
  ``--model-args``), returning an ``nn.Module``;
- a ``transformers`` model class, ``transformers:GPT2LMHeadModel``, built from its config with
  random weights (``models.hf``).

``--pretrained DIR`` builds a ``save_pretrained`` directory's class with its config and loads its
safetensors weights, each process only its own stages' (``models.pretrained``).

``blocks(model, input_shape)`` gives the ordered (name, module) pairs whose chained application
equals ``model(x)``: a model's own chain where it has one (the small models, ResNets, VGG,
``nn.Sequential``), else a split of its captured graph (``models.graph``: torch.fx, or
torch.export where fx cannot trace; made once and handed to the job's other processes as bytes
by ``models.split_io``). ``whole(model)`` is the one block of a one-stage shape,
never traced.

Modules, from the bottom: ``refs`` (a user's function by reference), ``inputs``, ``outputs`` (a
batch's named inputs; the output rule and ``Whole``), ``small``, ``gpt``, ``vision`` (the models shipped), ``hf``, ``pretrained``
(``transformers`` classes; ``--pretrained DIR``), ``hf_chain`` (a ``transformers`` causal LM cut
at its own modules, for a pipeline with tensor parallelism), ``export`` (the torch.export capture),
``lora`` (adapters on a frozen model), ``tp`` (layers split over a tensor-parallel group), ``tp_layers`` (what a split layer computes, LoRA's adapters split with it), ``shard_read`` (a safetensors file's tensors by byte range; a TP shard read from it), ``segment`` (one block of a graph split), ``analysis`` (the traced graph read once: where modules
begin, what crosses, what is recomputed), ``graph`` (the capture and the cut), ``split_io`` (a
split as bytes), ``partition`` (``--partition`` specs: where each piece begins, checked against
the blocks; the balanced cut), ``cut`` (a model's blocks cut into pieces there, and its graph
split captured once for the job's processes).

``build_model(cfg, ...)`` is ``--model`` built as the run configures it: ``--model-args``,
``--weights``, ``--pretrained``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from bundle.config import ModelConfig, is_reference
from bundle.errors import ConfigError, PartitionError
from bundle.models import graph, hf, lora, pretrained
from bundle.models.gpt import GPT
from bundle.models.inputs import Batch, Inputs
from bundle.models.outputs import Whole, call_kwargs, check_forward, select
from bundle.models.refs import load_callable
from bundle.models.small import (
    MLP,
    Block,
    Chain,
    DigitsCNN,
    SkipMLP,
    SmallResNet,
    apply_blocks,
    no_inplace,
)

__all__ = [
    "Block",
    "apply_blocks",
    "available",
    "blocks",
    "build",
    "build_model",
    "build_on_meta",
    "meta_model",
    "adapt",
    "example_input",
    "forward",
    "input_dtype",
    "is_known",
    "load_weights",
    "pretrained",
    "whole",
]

Builder = Callable[..., nn.Module]

_REGISTRY: dict[str, Builder] = {
    "mlp": lambda num_classes, shape: MLP(shape, num_classes),
    # Compute-heavy enough per micro-batch that a pipeline's own overhead can be seen (benchmark).
    "mlp_wide": lambda num_classes, shape: MLP(shape, num_classes, width=1024),
    "digits_cnn": lambda num_classes, shape: DigitsCNN(shape, num_classes),
    "skip_mlp": lambda num_classes, shape: SkipMLP(shape, num_classes),
    "small_resnet": lambda num_classes, shape: SmallResNet(shape, num_classes),
    # A language model: num_classes is the vocabulary, the shape (seq_len,).
    "gpt": lambda num_classes, shape, **kw: GPT(vocab=num_classes, seq_len=shape[0], **kw),
}
# The ones that take --model-args.
_TAKES_ARGS = frozenset({"gpt"})
# The torchvision models named in --help and errors (any other zoo name works too).
_SHOWN_ZOO = ("resnet18", "resnet50", "resnet101", "vgg16")


def available() -> list[str]:
    """Model names shipped here and the best-known torchvision ones, sorted."""
    return sorted([*_REGISTRY, *_SHOWN_ZOO])


def zoo_names() -> frozenset[str]:
    """Every torchvision classification model name. torchvision is imported here, when a name
    is asked about, not with this package: a run of another model starts without it."""
    from bundle.models import vision

    return vision.zoo_names()


def build_zoo(
    name: str, num_classes: int, input_shape: tuple[int, ...], kwargs: dict[str, Any]
) -> nn.Module:
    from bundle.models import vision

    return vision.build_zoo(name, num_classes, input_shape, kwargs)


def _zoo_chain(model: nn.Module) -> list[Block] | None:
    """A torchvision ResNet's or VGG's own chain of blocks; None for any other model. A model
    built from torchvision has imported it already, so nothing is imported for the others."""
    if "torchvision" not in sys.modules:
        return None
    from bundle.models import vision

    return vision.chain_blocks(model)


def is_known(name: str) -> bool:
    """Whether ``name`` is a model this build can make (a factory is checked when built)."""
    return name in _REGISTRY or name in zoo_names() or is_reference(name)


def build(
    name: str,
    *,
    num_classes: int,
    input_shape: Sequence[int],
    args: Mapping[str, Any] | None = None,
    config_file: str | None = None,
) -> nn.Module:
    """A freshly initialised model (random weights; seed torch first for reproducibility).

    ``config_file``: a ``transformers`` model's config (``--model-config``)."""
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError("num_classes", num_classes, "a positive integer")
    shape = tuple(input_shape)
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ConfigError("input_shape", input_shape, "positive integers")
    kwargs = dict(args or {})
    if is_reference(name):
        return _from_factory(name, num_classes, shape, kwargs, config_file)
    if config_file:
        raise ConfigError("--model-config", config_file, "only a transformers model takes one")
    if kwargs and name not in _TAKES_ARGS and name not in zoo_names():
        raise ConfigError("--model-args", kwargs, f"--model {name} takes none")
    if name in _REGISTRY:
        try:
            return _REGISTRY[name](num_classes, shape, **kwargs)
        except TypeError as exc:
            raise ConfigError("--model-args", kwargs, f"--model {name}: {exc}") from None
    if name in zoo_names():
        return build_zoo(name, num_classes, shape, kwargs)
    raise ConfigError(
        "--model",
        name,
        f"choose one of: {', '.join(available())}, any other torchvision classification model "
        "(e.g. mobilenet_v3_small, vit_b_16), or a factory package.module:function",
    )


def build_on_meta(
    name: str,
    *,
    num_classes: int,
    input_shape: Sequence[int],
    args: Mapping[str, Any] | None = None,
    config_file: str | None = None,
) -> nn.Module:
    """The model with its tensors on the meta device (no memory), to check and count it.

    A model whose construction reads tensor values (RegNet's widths) cannot be built on the meta
    device: it is built on the CPU and moved there."""
    try:
        with torch.device("meta"):
            return build(
                name,
                num_classes=num_classes,
                input_shape=input_shape,
                args=args,
                config_file=config_file,
            )
    except Exception:  # noqa: BLE001 - whatever failed on meta: the CPU build says it again
        cpu = build(
            name,
            num_classes=num_classes,
            input_shape=input_shape,
            args=args,
            config_file=config_file,
        )
        return cpu.to("meta")


def _from_factory(
    name: str,
    num_classes: int,
    shape: tuple[int, ...],
    kwargs: dict[str, Any],
    config_file: str | None = None,
) -> nn.Module:
    factory = load_callable(name, "--model")
    if hf.is_pretrained_class(factory):
        return hf.build(factory, name, num_classes, shape, kwargs, config_file)
    if config_file:
        raise ConfigError("--model-config", config_file, "only a transformers model takes one")
    offered = {"num_classes": num_classes, "input_shape": shape, **kwargs}
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        params = []  # a builtin or C function: what its docs say is all we know
    takes = {p.name for p in params}
    # A function taking **kwargs (timm.create_model) gets num_classes and the model args;
    # input_shape only where it names it (a model's own constructor would refuse it).
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        takes |= {"num_classes", *kwargs}
    chosen = {k: v for k, v in offered.items() if k in takes}
    unused = sorted(set(kwargs) - set(chosen))
    if unused:
        raise ConfigError("--model-args", kwargs, f"{name} takes no argument(s) {unused}")
    try:
        model = factory(**chosen)
    except Exception as exc:  # noqa: BLE001 - the user's code failed: say where
        raise ConfigError(
            "--model", name, f"the factory raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "--model", name, f"the factory returned a {type(model).__name__}, not an nn.Module"
        )
    return model


def load_weights(
    model: nn.Module, path: str, *, strict: bool = False, check_only: bool = False
) -> str | None:
    """Load a full-model state dict (``--weights``) into the model, checked against it.

    Fine-tuning's habit (timm's, torchvision's): every tensor whose name and shape fit is loaded,
    the rest of the model keeps its fresh initialisation (a head for 2 classes where the file has
    1000), and the returned note names them in one line (None: everything fit). ``strict``
    (``--weights-strict``): anything that does not fit is refused in one line; so is a file of
    which nothing fits. ``check_only``: read and compare, load nothing (a model on the meta
    device, before launch)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - unreadable in any way: the same one line
        raise ConfigError(
            "--weights", path, f"cannot read it: {type(exc).__name__}: {exc}"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError("--weights", path, "it holds no state dict (names -> tensors)")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    problems = [
        f"{len(shapes)} of another shape (e.g. {shapes[0]})" if shapes else "",
        f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
        f"{len(unexpected)} unexpected (e.g. {unexpected[0]})" if unexpected else "",
    ]
    problem = "; ".join(p for p in problems if p)
    fits = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    if problem and (strict or not fits):
        raise ConfigError("--weights", path, f"it does not fit the model: {problem}")
    if not check_only:
        model.load_state_dict(fits, strict=not problem)
    if not problem:
        return None
    fresh = len(own) - len(fits)
    return (
        f"--weights {path}: loaded {len(fits)} of the model's {len(own)} tensors, "
        f"{fresh} initialised afresh ({problem}); --weights-strict refuses such a file"
    )


def build_model(
    cfg: ModelConfig, num_classes: int, input_shape: Sequence[int], *, seed: int = 0
) -> nn.Module:
    """``--model`` built for the data (``--model-args`` passed), ``--weights`` loaded; a
    ``--pretrained`` model with all its weights read (its tensors the checkpoint lacks seeded
    from ``seed``; the engine's ``build_stages`` reads only a process's own stages')."""
    if cfg.pretrained:
        model = pretrained.build_empty(
            cfg.name,
            cfg.pretrained,
            num_classes=num_classes,
            input_shape=input_shape,
            args=cfg.kwargs,
        )
        pretrained.load(model, cfg.pretrained, seed=seed, strict=cfg.weights_strict)
        return model
    model = build(
        cfg.name,
        num_classes=num_classes,
        input_shape=input_shape,
        args=cfg.kwargs,
        config_file=cfg.config_file,
    )
    if cfg.weights:
        load_weights(model, cfg.weights, strict=cfg.weights_strict)
    return model


def meta_model(cfg: ModelConfig, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    """``--model`` (or ``--pretrained``'s class) built as the run builds it, its tensors on the
    meta device (no memory), to check, count and capture it before launch."""
    if not cfg.pretrained:
        return build_on_meta(
            cfg.name,
            num_classes=num_classes,
            input_shape=input_shape,
            args=cfg.kwargs,
            config_file=cfg.config_file,
        )
    with torch.device("meta"):
        return pretrained.build(
            cfg.name,
            cfg.pretrained,
            num_classes=num_classes,
            input_shape=input_shape,
            args=cfg.kwargs,
        )


def adapt(model: nn.Module, cfg: ModelConfig, *, seed: int) -> lora.Adapted | None:
    """``--lora`` applied to the whole model, before it is cut (None: no ``--lora``): adapters on
    its targets (from ``--lora-init``'s file where given), the rest frozen but ``--lora-train``'s
    modules (``models.lora``)."""
    spec = cfg.lora_spec
    if spec is None:
        return None
    return lora.apply(model, spec, seed=seed, train=cfg.lora_trained, init=cfg.lora_init)


def input_dtype(model: nn.Module) -> torch.dtype:
    """What the model takes: its ``input_dtype`` attribute if it declares one, token ids (long)
    if its first layer with parameters is an embedding, else float32."""
    declared = getattr(model, "input_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    first = next(
        (m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None
    )
    return torch.long if isinstance(first, nn.Embedding) else torch.float32


def example_input(model: nn.Module, input_shape: Sequence[int], rows: int = 1) -> torch.Tensor:
    """A batch of zeros the model can take (zeros are valid token ids too), on its device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.zeros(rows, *input_shape, dtype=input_dtype(model), device=device)


def blocks(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    points: Sequence[str] = (),
    output: str | None = None,
    inputs: Inputs | None = None,
) -> list[Block]:
    """The model as ordered (dotted name, module) pairs whose chained application equals model(x).

    A block's name is its module path; its parameters' full-model names are ``f"{name}.{param}"``
    (a ``graph.Segment`` names them fully itself). The only invented name is a parameterless
    ``flatten`` standing in for torchvision's functional ``torch.flatten``. ``points`` are split
    points a graph split must cut at besides its own (other models take theirs as they are);
    ``output``: which of the forward's outputs the loss takes (``--model-output``); ``inputs``:
    the batch's named inputs (``models.inputs``; None: one tensor), which only a graph split
    passes on.
    """
    if inputs is not None:
        if isinstance(model, (Chain, nn.Sequential)) or _zoo_chain(model) is not None:
            raise PartitionError(
                f"{type(model).__name__} takes one input, and the data names "
                f"{len(inputs.names)} ({', '.join(inputs.names)})"
            )
        no_inplace(model)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return graph.blocks(model, inputs.example(3, device), points, output, inputs.names)
    if isinstance(model, Chain):
        return model.blocks()
    own = _zoo_chain(model)
    if own is not None:
        return own
    no_inplace(model)
    if isinstance(model, nn.Sequential):
        return sequential_blocks(model)
    if input_shape is None:
        raise PartitionError(f"cutting a {type(model).__name__} needs the shape of its input")
    return graph.blocks(model, (example_input(model, input_shape, rows=3),), points, output)


def forward(model: nn.Module, x: Batch, output: str | None = None) -> torch.Tensor:
    """The unsplit model's output for the loss, as a stage's would be (``--model-output``);
    named inputs are passed by name."""
    if isinstance(x, dict):
        return select(model(**x, **call_kwargs(model)), output)
    return select(model(x, **call_kwargs(model)), output)


def whole(model: nn.Module, output: str | None = None, inputs: Inputs | None = None) -> list[Block]:
    """The model as one block, never traced (a one-stage shape): a model's own chain where it
    has one, else the model itself, its output taken by ``--model-output``'s rule; ``inputs``:
    the batch's named inputs, passed by name."""
    names = inputs.names if inputs is not None else ()
    if not names and (isinstance(model, (Chain, nn.Sequential)) or _zoo_chain(model) is not None):
        return blocks(model)
    check_forward(model, names)
    return [(type(model).__name__, Whole(model, output, names))]


def sequential_blocks(model: nn.Sequential, prefix: str = "") -> list[Block]:
    """An nn.Sequential's children in order, nested Sequentials opened."""
    out: list[Block] = []
    for name, child in model.named_children():
        if type(child) is nn.Sequential:
            out += sequential_blocks(child, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", child))
    return out
