"""A ``transformers`` model's step as the directory ``from_pretrained`` reads, and back.

    python -m bundle.checkpoint export SAVE_DIR/step-N --hf OUT [--max-shard-size 5GB]

A step directory of a ``transformers:Class`` run records the class and the built model's config
as JSON data (``hf_config`` in ``bundle.json``), so the step alone rebuilds the model (a step
written before that is rebuilt as ``bundle.generate`` rebuilds it: the recorded ``--model-args``
and ``--model-config``). The export builds the model on the meta device, takes the checkpoint's
verified tensors (no copy), and lets the model's own ``save_pretrained`` write ``config.json``,
``generation_config.json`` (a class that generates), and safetensors shards (an index when more
than one): a weight tied to another is written once, as ``transformers`` writes it. A run
started from ``--pretrained DIR`` carries DIR's own ``generation_config.json`` instead, read as
data (``hf_files``). The run's tokenizer is copied beside them: plain files of an exact list of
names. Everything is written to ``OUT.partial`` and renamed, so a half-written export is never
taken for a whole one.

``read_pretrained`` reads such a directory back as data: the class its ``config.json`` names
(a model class of ``transformers``, nothing else), the weights from safetensors files only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import hf_files
from bundle.checkpoint.hf_files import TOKENIZER_FILES, copy_tokenizer
from bundle.errors import BundleError, CheckpointError, ConfigError

RECORD = "hf_config"  # bundle.json's key: {"class": "GPT2LMHeadModel", "config": {...}}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass(frozen=True)
class HFExport:
    """What ``export_hf`` wrote: the directory, the model's class, its tensors (each tied weight
    once), the safetensors files and their bytes, and the tokenizer files copied."""

    out: str
    cls: str
    tensors: int
    shards: int
    bytes: int
    tokenizer: tuple[str, ...]
    # The source config's auto_map (custom code the run never ran) was left out of config.json.
    dropped_auto_map: bool = False


# -- the record ------------------------------------------------------------------------------


def record(model: nn.Module) -> dict[str, Any] | None:
    """A ``transformers`` model's class and config as JSON data (None: not such a model)."""
    from bundle.models import hf

    config = getattr(model, "config", None)
    if not hf.is_pretrained_class(type(model)) or config is None:
        return None
    return {
        "class": type(model).__name__,
        "config": json.loads(config.to_json_string(use_diff=False)),
    }


def record_for(
    name: str,
    *,
    num_classes: int,
    input_shape: tuple[int, ...],
    args: Mapping[str, Any],
    config_file: str | None = None,
    pretrained: str | None = None,
) -> dict[str, Any] | None:
    """The record of model ``name`` as a run builds it (``--model-config``, or ``--pretrained``'s
    config.json) on the meta device (no memory); None for a model that is no
    ``transformers:Class``."""
    if not name.startswith("transformers:"):
        return None
    from bundle import models

    if pretrained:
        with torch.device("meta"):
            meta = models.pretrained.build(
                name, pretrained, num_classes=num_classes, input_shape=input_shape, args=args
            )
    else:
        meta = models.build_on_meta(
            name,
            num_classes=num_classes,
            input_shape=input_shape,
            args=args,
            config_file=config_file,
        )
    return record(meta)


def model_class(name: object, where: str) -> type:
    """``transformers.<name>``, if it is a model class of transformers (nothing else is built)."""
    from bundle.models import hf

    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(where, name, "must name a transformers model class")
    try:
        import transformers

        cls = getattr(transformers, name, None)
    except Exception as exc:  # noqa: BLE001 - not installed, or its lazy import failed: not one
        if hf.missing(exc):
            raise ConfigError(
                where, name, f"building it needs transformers ({hf.install_command()})"
            ) from None
        cls = None
    if not hf.is_pretrained_class(cls):
        raise ConfigError(where, name, "must name a transformers model class")
    return cls  # type: ignore[return-value]


def config_from(rec: object, where: str) -> tuple[type, Any]:
    """The model class and its config from a record, checked as data first."""
    if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
        raise ConfigError(where, type(rec).__name__, "must be {class, config} as a run records it")
    cls = model_class(rec.get("class"), f"{where} class")
    config_class = cls.config_class  # type: ignore[attr-defined]
    data = rec["config"]
    kind = data.get("model_type")
    if kind and getattr(config_class, "model_type", "") and kind != config_class.model_type:
        raise ConfigError(
            f"{where} model_type", kind, f"{cls.__name__} takes {config_class.model_type!r}"
        )
    try:
        return cls, config_class.from_dict(_ids_in_vocabulary(data))
    except Exception as exc:  # noqa: BLE001 - the library refused it: one line
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(where, cls.__name__, f"its config cannot be read: {why}") from None


def _ids_in_vocabulary(data: dict[str, Any]) -> dict[str, Any]:
    """The config with special token ids outside its vocabulary cleared: they name no token (a
    class's defaults, GPT-2's 50256, in a model Bundle sized to 256 bytes), and transformers warns
    of them at every load."""
    vocab = data.get("vocab_size")
    if not isinstance(vocab, int):
        return data
    outside = [k for k in _TOKEN_IDS if isinstance(data.get(k), int) and not 0 <= data[k] < vocab]
    return {**data, **dict.fromkeys(outside)}


def on_meta(cls: type, config: Any) -> nn.Module:
    """The model with its tensors on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model: nn.Module = cls(config)
    return model


def tied(model: nn.Module) -> dict[str, str]:
    """Each name of the model's state under which a tensor comes again -> its first name
    (GPT-2's ``lm_head.weight`` -> ``transformer.wte.weight``)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, value in model.state_dict(keep_vars=True).items():
        seen = first.setdefault(id(value), name)
        if seen != name:
            aliases[name] = seen
    return aliases


def with_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the tied copies an export leaves out, as the model ties them."""
    for alias, name in tied(model).items():
        if alias not in state and name in state:
            state[alias] = state[name]
    return state


# -- export ----------------------------------------------------------------------------------


def _transformers(path: str, info: dict) -> str:
    """The checkpoint's model, refused in one line unless it is ``transformers:Class``."""
    name = info.get("model")
    if not (isinstance(name, str) and name.startswith("transformers:")):
        raise BundleError(
            f"--hf is for transformers models; {path} holds model {name!r} "
            f"(export {path} OUT.pt writes its weights)"
        )
    return name


def _model_of(path: str, info: dict, model_config: str | None) -> tuple[type, Any]:
    """The class and config of checkpoint ``path``: what it records, or (a step written before
    records were) the model rebuilt from its recorded arguments and ``model_config``."""
    where = os.path.join(path, ckpt.INFO)
    name = _transformers(path, info)
    if RECORD in info and model_config is None:
        cls, config = config_from(info[RECORD], f"{where} {RECORD}")
        if f"transformers:{cls.__name__}" != name:
            raise ConfigError(f"{where} {RECORD} class", cls.__name__, f"the model is {name}")
        return cls, config
    from bundle.config import parse_model_args

    shape, vocab = info.get("input_shape"), info.get("num_classes")
    if not (isinstance(shape, list) and isinstance(vocab, int)):
        raise CheckpointError(f"{path}: {ckpt.INFO} records no input shape or classes")
    args = info.get("model_args")
    rec = record_for(
        name,
        num_classes=vocab,
        input_shape=tuple(shape),
        args=parse_model_args(args if isinstance(args, str) else None),
        config_file=model_config,
    )
    return config_from(rec, where)


def _fit(model: nn.Module, state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """The model's entries of ``state``, refused in one line unless every one is there and fits."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise CheckpointError(
            f"{path}: the checkpoint lacks {len(missing)} of the model's tensors ({missing[0]}); "
            "was it trained with another --model-config?"
        )
    for key, value in own.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise CheckpointError(
                f"{path}: {key} is {list(state[key].shape)} in the checkpoint but "
                f"{list(value.shape)} in the model (another --model-config?)"
            )
    return {k: state[k] for k in own}


def _loaded(cls: type, config: Any, state: dict[str, torch.Tensor], path: str) -> nn.Module:
    """The model holding the checkpoint's tensors (assigned, not copied), its weights tied again;
    tied copies that differ in the checkpoint are refused (one of them would be lost)."""
    model = on_meta(cls, config)
    mine = _fit(model, state, path)
    model.load_state_dict(mine, assign=True)
    model.tie_weights()  # type: ignore[operator]
    for key, value in model.state_dict().items():
        if key in mine and not torch.equal(value, mine[key]):
            raise CheckpointError(f"{path}: {key} differs from the weight it is tied to")
    return model.eval()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' progress bars off (one line says what was written)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def shard_size(text: str | int) -> int:
    """``--max-shard-size`` in bytes: ``5GB``, ``500MB``, ``200KB`` or a number of bytes."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = int(convert_file_size_to_int(text))
    except (ValueError, TypeError):
        size = 0
    if size < 1:
        raise ConfigError("--max-shard-size", text, "give a size such as 5GB, 500MB or 200KB")
    return size


def export_hf(
    path: str,
    out: str,
    *,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    model_config: str | None = None,
    tokenizer: str | None = None,
) -> HFExport:
    """Write step ``path`` of a ``transformers`` model as a ``from_pretrained`` directory ``out``
    (see the module doc); ``force`` replaces an ``out`` already there."""
    limit = shard_size(max_shard_size)
    out = os.path.normpath(out)  # OUT/ would put OUT.partial inside OUT
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory; nothing exported")
    inside = os.path.relpath(os.path.realpath(path), os.path.realpath(out))
    if not (inside == os.pardir or inside.startswith(os.pardir + os.sep)):
        raise ConfigError("--hf", out, f"it holds the checkpoint {path}: choose another directory")
    if os.path.lexists(out) and not force:
        raise ConfigError("--hf", out, "it exists: give --force to replace it")
    with contextlib.suppress(CheckpointError):  # unreadable: the verification says why
        _transformers(path, ckpt.read_info(path))  # another kind of model: before reading it
    try:
        state = ckpt.weights(path)  # verified first
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    info = ckpt.read_info(path)  # what was verified
    cls, config = _model_of(path, info, model_config)
    # A --pretrained directory's auto_map names code of its own; Bundle built and trained the
    # transformers class it names instead, so the export is that class, without a dangling map.
    dropped = config.__dict__.pop("auto_map", None) is not None
    if hasattr(config, "use_cache"):
        config.use_cache = True  # off for training only; inference reuses it
    model = _loaded(cls, config, state, path)
    source = tokenizer or info.get("tokenizer")
    pretrained = info.get("pretrained")  # a run from --pretrained DIR: DIR's, checked first
    generation = None
    if isinstance(pretrained, str) and model.can_generate():  # type: ignore[operator]
        generation = hf_files.generation_config(pretrained)
    partial = f"{out}.partial"
    _remove(partial)
    try:
        with _quiet():
            model.save_pretrained(partial, max_shard_size=limit)  # type: ignore[operator]
            if generation is not None:  # instead of the one made from the model's config
                generation.save_pretrained(partial)
        copied = copy_tokenizer(source, partial) if isinstance(source, str) else ()
        _swap_in(partial, out)
    except BaseException:
        _remove(partial)
        raise
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    return HFExport(
        out=out,
        cls=cls.__name__,
        tensors=len(model.state_dict()) - len(tied(model)),
        shards=len(shards),
        bytes=sum(os.path.getsize(os.path.join(out, f)) for f in shards),
        tokenizer=copied,
        dropped_auto_map=dropped,
    )


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _swap_in(partial: str, out: str) -> None:
    """``partial`` (whole) becomes ``out``; an ``out`` there (``--force``) is moved aside first
    and removed last."""
    aside = f"{out}.replaced"
    if os.path.lexists(out):
        _remove(aside)
        os.replace(out, aside)
    os.replace(partial, out)
    _remove(aside)


# -- reading an export back --------------------------------------------------------------------


@dataclass(frozen=True)
class Pretrained:
    """A ``from_pretrained`` directory read as data: its record, weights and tokenizer."""

    record: dict[str, Any]
    state: Callable[[], dict[str, torch.Tensor]]
    tokenizer: str | None  # the directory, when it holds a tokenizer


def is_pretrained(path: str) -> bool:
    """Whether ``path`` looks like a ``save_pretrained`` directory (not a step directory)."""
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.exists(
        os.path.join(path, ckpt.INFO)
    )


def read_pretrained(path: str) -> Pretrained:
    """``config.json`` (JSON; its ``architectures`` name the class) and safetensors weights only:
    a pickled ``pytorch_model.bin`` is never read."""
    where = os.path.join(path, "config.json")
    try:
        with open(where) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError("CHECKPOINT", where, f"cannot read it ({exc})") from None
    arch = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
        raise ConfigError(f"{where} architectures", arch, "must name the model class")
    rec = {"class": arch[0], "config": config}
    config_from(rec, where)  # checked before anything else is read
    from bundle.models import pretrained  # the same reader --pretrained uses: headers checked

    try:
        spans = pretrained.read(path).spans
    except ConfigError as exc:
        raise ConfigError("CHECKPOINT", path, exc.allowed) from None
    files = sorted({span.path for span in spans.values()})
    has_tokenizer = any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES)
    return Pretrained(rec, lambda: _read_shards(files), path if has_tokenizer else None)


def _read_shards(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # noqa: BLE001 - changed since its header was read: one line
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise ConfigError("CHECKPOINT", file, f"cannot read it ({why})") from None
    return state
