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
taken for a whole one. A ``--lora`` run's step is written as the plain model, its adapters
merged into the frozen base rebuilt (``merged``); ``export --peft`` writes the adapters alone.

``read_pretrained`` reads such a directory back as data: the class its ``config.json`` names
(a model class of ``transformers``, nothing else), the weights from safetensors files only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import hf_files
from bundle.checkpoint.hf_files import TOKENIZER_FILES, copy_tokenizer
from bundle.checkpoint.hf_record import RECORD as RECORD
from bundle.checkpoint.hf_record import config_from as config_from
from bundle.checkpoint.hf_record import model_class as model_class
from bundle.checkpoint.hf_record import on_meta as on_meta
from bundle.checkpoint.hf_record import record as record
from bundle.checkpoint.hf_record import record_for as record_for
from bundle.checkpoint.hf_record import tied as tied
from bundle.checkpoint.hf_record import with_tied as with_tied
from bundle.errors import BundleError, CheckpointError, ConfigError


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
    base: str | None = None,
) -> HFExport:
    """Write step ``path`` of a ``transformers`` model as a ``from_pretrained`` directory ``out``
    (see the module doc); ``force`` replaces an ``out`` already there. A ``--lora`` run's step is
    the model with its adapters merged (``merged``; ``base``: where its frozen base is)."""
    from bundle.checkpoint import merged

    limit = shard_size(max_shard_size)
    out = check_out(path, out, flag="--hf", force=force)
    with contextlib.suppress(CheckpointError):  # unreadable: the verification says why
        _transformers(path, ckpt.read_info(path))  # another kind of model: before reading it
    try:
        state = ckpt.weights(path)  # verified first
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    info = ckpt.read_info(path)  # what was verified
    cls, config = _model_of(path, info, model_config)
    if merged.is_lora(info):
        state = merged.merged_state(path, info, state, base=base, model_config=model_config)
    elif base is not None:
        raise ConfigError(
            merged.BASE, base, f"is for a --lora run's step; {path} holds no adapters"
        )
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
    remove(partial)
    try:
        with _quiet():
            model.save_pretrained(partial, max_shard_size=limit)  # type: ignore[operator]
            if generation is not None:  # instead of the one made from the model's config
                generation.save_pretrained(partial)
        copied = copy_tokenizer(source, partial) if isinstance(source, str) else ()
        swap_in(partial, out)
    except BaseException:
        remove(partial)
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


def check_out(path: str, out: str, *, flag: str, force: bool) -> str:
    """The directory ``out`` an export of step ``path`` writes (normalised), refused in one line
    where it holds the checkpoint, or exists without ``force``."""
    out = os.path.normpath(out)  # OUT/ would put OUT.partial inside OUT
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory; nothing exported")
    inside = os.path.relpath(os.path.realpath(path), os.path.realpath(out))
    if not (inside == os.pardir or inside.startswith(os.pardir + os.sep)):
        raise ConfigError(flag, out, f"it holds the checkpoint {path}: choose another directory")
    if os.path.lexists(out) and not force:
        raise ConfigError(flag, out, "it exists: give --force to replace it")
    return out


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def swap_in(partial: str, out: str) -> None:
    """``partial`` (whole) becomes ``out``; an ``out`` there (``--force``) is moved aside first
    and removed last."""
    aside = f"{out}.replaced"
    if os.path.lexists(out):
        remove(aside)
        os.replace(out, aside)
    os.replace(partial, out)
    remove(aside)


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
