"""Weights from a ``save_pretrained`` directory (``--pretrained DIR``): its ``config.json`` builds
the class, and each process reads, by name, only the tensors of the stages it runs.

The model is built with its parameters on the meta device (``parameters_on_meta``: buffers are
computed as usual, so rotary tables and position ids are real), cut, and only the kept stages'
parameters are allocated (``load``) and filled from the safetensors files, one tensor at a time,
by name: ``safe_open`` checks each file's header, and a tensor's bytes are read from the byte
range its header gives straight into the parameter (``read_into``; not mapped, so no shard is
ever resident, only the stage). Fine-tuning's rules are ``models.load_weights``': a tensor
whose name and shape fit is loaded, the rest keep their initialisation and one note names them;
``--weights-strict`` refuses. A parameter left at its initialisation is initialised by its own
module's ``_init_weights`` (``reset_parameters`` outside ``transformers``), seeded from (seed,
module name), so it is the same whatever the shape. A weight tied to another (GPT-2's ``lm_head``
to its token embedding) is saved once and loaded from that one copy into both names. A name an
old release saved (BERT's ``LayerNorm.gamma``) matches as transformers renames it on load.
Pickled checkpoints (``pytorch_model.bin``) are refused, never unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bundle.errors import ConfigError
from bundle.models import hf, lora
from bundle.models.hf import LANGUAGE_MODELS, POSITION_FIELDS, current_name
from bundle.models.refs import load_callable
from bundle.models.shard_read import ShardRead, Span, header

FLAG = "--pretrained"
CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What transformers saves besides safetensors: pickles (never unpickled here) and other frameworks.
_OTHER = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


@dataclass(frozen=True)
class Checkpoint:
    """A save_pretrained directory as read from its headers: each tensor by name."""

    directory: str
    spans: Mapping[str, Span]


def _refuse(directory: str, why: str) -> ConfigError:
    return ConfigError(FLAG, directory, why)


def read(directory: str) -> Checkpoint:
    """The directory's tensors by name, from the headers alone (no tensor is read); every way it
    cannot be loaded is one line: no config.json, no safetensors (pickles are never unpickled),
    an index naming missing files or tensors, a file unreadable or cut short."""
    root = Path(directory)
    if not root.is_dir():
        raise _refuse(directory, "no such directory (give a save_pretrained directory)")
    if not (root / CONFIG).is_file():
        raise _refuse(directory, f"holds no {CONFIG} (a save_pretrained directory has one)")
    index = _index(directory, root / INDEX) if not (root / SINGLE).is_file() else None
    names = sorted(set(index.values())) if index is not None else [SINGLE]
    absent = [n for n in names if not (root / n).is_file()]
    if absent:
        raise _refuse(directory, f"{INDEX} names {len(absent)} missing file(s), e.g. {absent[0]}")
    spans: dict[str, Span] = {}
    for name in names:
        try:
            spans.update(header(str(root / name)))
        except Exception as exc:  # noqa: BLE001 - unreadable or cut short: the same one line
            raise _refuse(directory, f"cannot read {name}: {_first_line(exc)}") from None
    where = {k: span.path for k, span in spans.items()}
    lost = sorted(k for k, v in (index or {}).items() if where.get(k) != str(root / v))
    if lost:
        raise _refuse(
            directory, f"{INDEX} names {len(lost)} tensor(s) not in their file, e.g. {lost[0]}"
        )
    return Checkpoint(directory, spans)


def _index(directory: str, path: Path) -> dict[str, str]:
    if not path.is_file():
        root = path.parent
        other = [n for n in _OTHER if (root / n).exists()]
        raise _refuse(
            directory,
            f"holds {other[0]}, not safetensors: pickles are never unpickled here; convert it "
            "where you trust it (transformers' from_pretrained, then save_pretrained(DIR) "
            "writes model.safetensors)"
            if other
            else f"holds no weights ({SINGLE} or {INDEX})",
        )
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in v
            for k, v in weight_map.items()
        ):
            raise ValueError("weight_map is no mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _refuse(directory, f"cannot read {INDEX}: {_first_line(exc)}") from None
    return weight_map


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def build(
    name: str,
    directory: str,
    *,
    num_classes: int,
    input_shape: Sequence[int],
    args: Mapping[str, Any],
) -> nn.Module:
    """The class ``name`` (``transformers:Class``) with the directory's config, ``args`` set on
    it; built on whatever device the caller chose (``parameters_on_meta``, or the meta device).

    The checkpoint's config wins where its weights depend on it: a language model keeps its
    vocabulary and a text model its positions, and data that cannot fit them is refused; a
    classifier's ``num_labels`` follows the data (its head is then initialised afresh, noted)."""
    cls: Any = load_callable(name, "--model") if ":" in name else None
    if cls is None or not hf.is_pretrained_class(cls):
        raise ConfigError(
            "--model",
            name,
            f"{FLAG} builds a transformers class: give --model transformers:CLASS, or leave "
            f"--model out to build the {CONFIG}'s architectures",
        )
    import transformers

    hf.check_release(transformers.__version__)
    try:
        config = cls.config_class.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable in any way: one line
        raise _refuse(directory, f"cannot read its {CONFIG}: {_first_line(exc)}") from None
    unknown = sorted(k for k in args if not hasattr(config, k))
    if unknown:
        raise ConfigError(
            "--model-args", dict(args), f"{type(config).__name__} has no field(s) {unknown}"
        )
    for key, value in args.items():
        setattr(config, key, value)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training never reuses it
    _fit_data(config, cls.__name__, directory, num_classes, tuple(input_shape), args)
    try:
        return cls(config)
    except Exception as exc:  # noqa: BLE001 - the library refused the config: say so
        raise ConfigError("--model", name, f"{cls.__name__}: {_first_line(exc)}") from None


def _fit_data(
    config: Any,
    cls_name: str,
    directory: str,
    num_classes: int,
    shape: tuple[int, ...],
    args: Mapping[str, Any],
) -> None:
    if cls_name.endswith(LANGUAGE_MODELS):
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and vocab < num_classes:
            raise _refuse(
                directory,
                f"its vocabulary has {vocab} tokens, the data {num_classes}: tokenize with the "
                "model's own tokenizer (--tokenizer DIR)",
            )
    elif "num_labels" not in args and getattr(config, "num_labels", num_classes) != num_classes:
        config.num_labels = num_classes  # the data's classes; the head is noted as fresh
    if len(shape) == 1:
        for key in POSITION_FIELDS:
            have = getattr(config, key, None)
            if key not in args and isinstance(have, int) and have < shape[0]:
                raise _refuse(directory, f"its {key}={have} is shorter than --seq-len {shape[0]}")
    image, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if len(shape) == 3 and image is not None and (channels, image, image) != shape:
        raise _refuse(directory, f"it takes {channels}x{image}x{image} images, the data {shape}")


def build_empty(
    name: str, directory: str, *, num_classes: int, input_shape: Sequence[int], args: Mapping
) -> nn.Module:
    """``build`` under ``parameters_on_meta``: the model ``load`` fills (whole or by stages)."""
    with parameters_on_meta():
        return build(name, directory, num_classes=num_classes, input_shape=input_shape, args=args)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with its parameters on the meta device (no memory) and its buffers as the
    constructor computes them (accelerate's ``init_empty_weights(include_buffers=False)``)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# -- matching the model's names to the checkpoint's ----------------------------------------------


@dataclass(frozen=True)
class Match:
    """Where each of the model's tensors comes from (None: left at its initialisation)."""

    sources: Mapping[str, str | None]
    note: str | None


def match(
    model: nn.Module,
    ckpt: Checkpoint,
    *,
    strict: bool = False,
    shards: Mapping[str, ShardRead] | None = None,
) -> Match:
    """The checkpoint's tensor for each entry of the model's state dict, by name and shape: its
    own name, a name tied to it (the copy transformers did not save), or either with or without
    the model's ``base_model_prefix`` (a ``GPT2Model`` saved, a ``GPT2LMHeadModel`` loaded); a
    checkpoint's name as transformers renames it on load (``current_name``), the source being the
    name it is saved under. Refused (``strict``: anything that does not fit; else nothing fits)
    in one line."""
    # LoRA's adapters are no base checkpoint's (models.lora initialises them).
    adapters = lora.adapter_names(model)
    own = {
        k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if k not in adapters
    }
    own.update({k: s.whole(own[k]) for k, s in (shards or {}).items() if k in own})
    # the saved names by their current ones; a tensor saved under its current name comes last: wins
    saved = {current_name(n): n for n in sorted(ckpt.spans, key=lambda n: current_name(n) == n)}
    tied = _tied(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    sources: dict[str, str | None] = {}
    shapes, missing = [], []
    for key, shape in own.items():
        names = [key, *tied.get(key, ())]
        if prefix:  # a base model's checkpoint in a model with a head, or the other way round
            head = f"{prefix}."
            names += [n.removeprefix(head) if n.startswith(head) else head + n for n in names]
        found = [saved[n] for n in names if n in saved]
        fit = next((n for n in found if ckpt.spans[n].shape == shape), None)
        sources[key] = fit
        if fit is None and found:
            shapes.append(f"{key}: {ckpt.spans[found[0]].shape} vs {shape}")
        elif fit is None:
            missing.append(key)
    used = {n for n in sources.values() if n is not None}
    mine = {saved[k] for k in own if k in saved}  # the model's names, of any shape
    unexpected = sorted(n for n in ckpt.spans if n not in used and n not in mine)
    problems = [
        f"{len(shapes)} of another shape (e.g. {shapes[0]})" if shapes else "",
        f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
        f"{len(unexpected)} unused in the checkpoint (e.g. {unexpected[0]})" if unexpected else "",
    ]
    problem = "; ".join(p for p in problems if p)
    if problem and (strict or not used):
        raise _refuse(ckpt.directory, f"it does not fit the model: {problem}")
    note = None
    if problem:
        fresh = sorted(k for k, v in sources.items() if v is None)
        named = ", ".join(fresh[:4]) + (", ..." if len(fresh) > 4 else "")
        note = (
            f"{FLAG} {ckpt.directory}: loaded {len(own) - len(fresh)} of the model's {len(own)} "
            f"tensors; left at their initialisation: {named or 'none'} ({problem}); "
            "--weights-strict refuses such a checkpoint"
        )
    return Match(sources, note)


def _tied(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a tensor held under several names -> its other names."""
    holders: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        holders.setdefault(id(b), []).append(name)
    return {
        n: tuple(o for o in names if o != n)
        for names in holders.values()
        for n in names
        if len(names) > 1
    }


def check(model: nn.Module, directory: str, *, strict: bool = False) -> str | None:
    """Compare the checkpoint's headers with the model (on the meta device), before launch; the
    note of what will be left at its initialisation (None: everything fits)."""
    return match(model, read(directory), strict=strict).note


# -- loading ----------------------------------------------------------------------------------


def load(
    model: nn.Module,
    directory: str,
    *,
    seed: int,
    strict: bool = False,
    pieces: Sequence[nn.Module] = (),
    keep: Collection[int] | None = None,
    shards: Mapping[str, ShardRead] | None = None,
) -> str | None:
    """Allocate and fill ``model`` (built under ``parameters_on_meta``), or only the ``pieces``
    (the stages cut from it, each with ``full_state_dict``) whose indices are in ``keep`` (None:
    all); the others stay on the meta device, except a weight tied to a kept one, which is the
    kept one. Only the kept tensors are read, of a tensor split over a TP group (``shards``, by
    the model's names) only this process's shard. Returns ``match``'s note."""
    ckpt, shards = read(directory), shards or {}
    found = match(model, ckpt, strict=strict, shards=shards)
    by_source = {found.sources.get(n): s for n, s in shards.items()}
    kept = [p for i, p in enumerate(pieces) if keep is None or i in keep] if pieces else [model]
    real = _materialise(kept, [model, *pieces])
    _initialise(model, [k for k, v in found.sources.items() if v is None], real, seed)
    targets: dict[str, list[torch.Tensor]] = {}
    for piece in kept:
        full = getattr(piece, "full_state_dict", None)  # a Stage's: the full model's names
        state = full() if callable(full) else piece.state_dict()
        for name, tensor in state.items():
            source = found.sources.get(name)
            if source is not None:
                targets.setdefault(source, []).append(tensor)
    for source in sorted(targets, key=lambda n: (ckpt.spans[n].path, ckpt.spans[n].begin)):
        span, shard = ckpt.spans[source], by_source.get(source)
        if shard is not None:
            shard.read(span, targets[source], _DTYPES[span.dtype])
        else:
            read_into(span, targets[source])
    return found.note


# safetensors' dtype names (little-endian, as the format is)
# fmt: off
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
# fmt: on
_CHUNK = 16 << 20  # bytes read at a time into a tensor of another dtype


@torch.no_grad()
def read_into(span: Span, targets: Sequence[torch.Tensor]) -> None:
    """One tensor's bytes read from its file straight into the first target (converted, a chunk
    at a time, where its dtype differs); the others (its tied names) copy it. The file is read,
    not mapped: what a process holds resident is its own stages' tensors, never a whole shard."""
    first = targets[0]
    dtype = _DTYPES.get(span.dtype)
    if dtype is None or not first.is_contiguous():
        raise ConfigError(FLAG, span.path, f"holds a tensor of dtype {span.dtype}, not read here")
    flat = first.view(-1)
    with open(span.path, "rb") as f:
        f.seek(span.begin)
        if dtype == first.dtype:
            _read_exactly(f, flat.view(torch.uint8).numpy(), span)
        else:
            per = max(1, _CHUNK // dtype.itemsize)
            buffer = torch.empty(per * dtype.itemsize, dtype=torch.uint8)
            for lo in range(0, flat.numel(), per):
                n = min(per, flat.numel() - lo)
                _read_exactly(f, buffer[: n * dtype.itemsize].numpy(), span)
                flat[lo : lo + n].copy_(buffer[: n * dtype.itemsize].view(dtype))
    for other in targets[1:]:
        if other.data_ptr() != first.data_ptr():
            other.copy_(first)


def _read_exactly(f: Any, out: Any, span: Span) -> None:
    if f.readinto(out) != out.nbytes:
        raise ConfigError(FLAG, span.path, "was cut short while it was read")


def _materialise(kept: Sequence[nn.Module], holders: Sequence[nn.Module]) -> set[int]:
    """Give the kept modules' meta parameters memory (zeros, on the CPU), each tensor once
    however many names and stages hold it; every other holder of one of them (the full model, a
    stage holding a tied copy) then holds the same tensor. Returns the new tensors' ids."""
    # meta parameter's id -> (it, kept alive so that no new object takes its id; its tensor)
    fresh: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for piece in kept:
        for module in piece.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    if id(p) not in fresh:
                        # zeros, not empty: what no rule initialises is the same everywhere
                        zeros = torch.zeros_like(p, device="cpu")
                        fresh[id(p)] = (p, nn.Parameter(zeros, requires_grad=p.requires_grad))
                    module._parameters[name] = fresh[id(p)][1]
    for piece in holders:
        for module in piece.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta and id(p) in fresh:
                    module._parameters[name] = fresh[id(p)][1]
    return {id(new) for _, new in fresh.values()}


def _initialise(model: nn.Module, fresh: Sequence[str], real: set[int], seed: int) -> None:
    """Parameters the checkpoint lacks, of the kept stages: each module owning one initialised
    by the model's own rule, seeded from (seed, module name) alone, so any shape gives the same."""
    owners = sorted({k.rpartition(".")[0] for k in fresh})
    init = getattr(model, "_init_weights", None)
    for name in owners:
        module = model.get_submodule(name)
        if not any(id(p) in real for p in module.parameters(recurse=False)):
            continue  # another process's stage, or a buffer (kept as its constructor made it)
        digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            if callable(init):
                init(module)
            elif callable(reset := getattr(module, "reset_parameters", None)):
                reset()
