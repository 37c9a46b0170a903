"""A ``transformers`` model's class and config as data (``hf_config`` in ``bundle.json``): what
a run records of the model it built, and the model built again from that record, checked first
(a model class of ``transformers``, nothing else). ``hf_export`` writes a step with it,
``merged`` rebuilds a ``--lora`` run's base with it, ``bundle.generate`` samples with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bundle.errors import ConfigError

RECORD = "hf_config"  # bundle.json's key: {"class": "GPT2LMHeadModel", "config": {...}}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


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
