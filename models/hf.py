"""Hugging Face ``transformers`` models by reference: ``--model transformers:GPT2LMHeadModel``.

Built from a config with random weights (nothing is downloaded): the class's own config class,
read from ``--model-config`` (a ``config.json`` or a directory holding one) if given, with
``--model-args`` set on it. What the data decides, unless the arguments say otherwise: a language
model's vocabulary (``...LMHeadModel``, ``...ForCausalLM``, ``...ForMaskedLM``) or a classifier's
``num_labels`` is the number of classes; an image model's ``image_size`` and ``num_channels``
come from the input shape, a text model's positions cover the sequence.

Only the ``transformers`` releases whose models this tool is tested to cut into stages are taken
(``SUPPORTED``; tests/unit/test_hf_releases.py runs the oldest and the installed one): another is
refused when such a model is built, in one line saying which releases work.

``current_name``: a tensor's name in a saved checkpoint as transformers renames it on load (BERT's
``LayerNorm.gamma``), for ``--pretrained`` to match it as ``from_pretrained`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.nn as nn

from bundle.errors import ConfigError

# A language model's class name ends so (its vocabulary is the data's classes), and a text model's
# config names its positions so.
LANGUAGE_MODELS = ("LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForPreTraining")
POSITION_FIELDS = ("n_positions", "max_position_embeddings")
# The releases taken: from the oldest (major, minor) to the first one not taken.
SUPPORTED = ((4, 56), (6, 0))


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f">={a}.{b},<{c}" + (f".{d}" if d else "")


def install_command() -> str:
    """What installs a transformers release this tool works with."""
    return f"pip install 'transformers{supported_range()}'"


def missing(exc: BaseException) -> bool:
    """Whether ``exc`` says that transformers itself is not installed."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "transformers"


def check_release(version: str) -> None:
    """Refuse a ``transformers`` release outside ``SUPPORTED``, saying which releases work."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or not SUPPORTED[0] <= release < SUPPORTED[1]:
        raise ConfigError(
            "transformers",
            version,
            f"the releases that work are transformers{supported_range()} ({install_command()})",
        )


def is_pretrained_class(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` model class (without importing transformers)."""
    return isinstance(obj, type) and any(c.__name__ == "PreTrainedModel" for c in obj.__mro__)


def _config(cls: type, name: str, config_file: str | None) -> Any:
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise ConfigError("--model", name, f"{cls.__name__} has no config class to build from")
    if not config_file:
        return config_class()
    path = Path(config_file)
    if not path.exists():
        raise ConfigError("--model-config", config_file, "no such file or directory")
    try:
        if path.is_dir():
            return config_class.from_pretrained(str(path), local_files_only=True)
        return config_class.from_json_file(str(path))
    except Exception as exc:  # noqa: BLE001 - unreadable in any way: one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("--model-config", config_file, f"cannot read it: {reason}") from None


def build(
    cls: Any,
    name: str,
    num_classes: int,
    shape: tuple[int, ...],
    args: Mapping[str, Any],
    config_file: str | None = None,
) -> nn.Module:
    """The model ``cls`` from its config (random weights), sized for the data."""
    import transformers

    check_release(transformers.__version__)
    config = _config(cls, name, config_file)
    unknown = sorted(k for k in args if not hasattr(config, k))
    if unknown:
        raise ConfigError(
            "--model-args",
            dict(args),
            f"{type(config).__name__} has no field(s) {unknown}",
        )
    data: dict[str, Any] = {}
    if cls.__name__.endswith(LANGUAGE_MODELS):
        data["vocab_size"] = num_classes
    else:
        data["num_labels"] = num_classes
    if getattr(config, "image_size", None) is not None and len(shape) == 3:
        data["image_size"], data["num_channels"] = shape[-1], shape[0]
    elif len(shape) == 1:
        for key in POSITION_FIELDS:
            if isinstance(getattr(config, key, None), int) and getattr(config, key) < shape[0]:
                data[key] = shape[0]
    for key, value in {**data, **args}.items():
        setattr(config, key, value)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training never reuses it
    if (
        cls.__name__.endswith(LANGUAGE_MODELS)
        and isinstance(getattr(config, "vocab_size", None), int)
        and config.vocab_size < num_classes
    ):
        raise ConfigError(
            "--model-args",
            dict(args),
            f"vocab_size={config.vocab_size} is smaller than the data's {num_classes} tokens",
        )
    try:
        return cls(config)
    except Exception as exc:  # noqa: BLE001 - the library refused the config: say so
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            "--model", name, f"{cls.__name__}({type(config).__name__}): {reason}"
        ) from None


# The renames transformers applies to a checkpoint's names on load, in turn, each at its first
# match, and only these (its "legacy" conversions; before 5.0 ``_fix_state_dict_key_on_load``):
# early BERT-like models' LayerNorm gamma/beta, weight norm's weight_g/weight_v (a parametrization
# now), and the doubled ``.model`` of checkpoints saved by transformers 5.10 to 5.23. Patterns as
# transformers spells them; each ends where a name does, as transformers ends them (``(?!\w)``).
_LEGACY = (
    ("LayerNorm.gamma", "LayerNorm.weight"),
    ("LayerNorm.beta", "LayerNorm.bias"),
    (".weight_g", ".parametrizations.weight.original0"),
    (".weight_v", ".parametrizations.weight.original1"),
    (r"^model\.language_model\.model|^language_model\.model\.model", "model.language_model"),
)
_RENAMES = tuple((re.compile(f"(?:{old})(?!\\w)"), new) for old, new in _LEGACY)


def current_name(saved: str) -> str:
    """A tensor's name in a checkpoint as transformers loads it (most are unchanged)."""
    for pattern, new in _RENAMES:
        saved = pattern.sub(new, saved, count=1)
    return saved
