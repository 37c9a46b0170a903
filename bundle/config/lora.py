"""``--lora`` read once: rank, scaling, dropout and the modules adapted, as a frozen value.

``--lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj``: every item is ``key=value`` except
the names after ``targets=``, which run to the end (or to the next ``key=``). Targets are module
name suffixes (``q_proj`` matches ``model.layers.3.self_attn.q_proj``), or ``all-linear``;
unset, the model family's usual ones (``models.lora.DEFAULT_TARGETS``). ``--lora`` alone (or
``--lora on``) takes every default: r 8, alpha 16, no dropout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bundle.errors import ConfigError

FLAG = "--lora"
ALL_LINEAR = "all-linear"
_KEYS = ("r", "alpha", "dropout", "targets", "rslora")


@dataclass(frozen=True)
class LoRASpec:
    """Rank ``r``, ``alpha`` (the update is scaled by alpha/r, or alpha/sqrt(r) with
    ``rslora``), the adapters' input ``dropout``, and the ``targets`` (empty: the family's)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def text(self) -> str:
        """The spec as ``--lora`` takes it (what a checkpoint records)."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        out = f"r={self.r},alpha={alpha},dropout={self.dropout}"
        if self.rslora:
            out += ",rslora=true"
        return out + (f",targets={','.join(self.targets)}" if self.targets else "")


def parse_lora(text: str | None) -> LoRASpec | None:
    """``--lora``'s text as a spec (None: no LoRA); a bad item is refused in one line."""
    if text is None:
        return None
    text = text.strip()
    if text in ("", "on", "true"):
        return LoRASpec()
    values: dict[str, str] = {}
    targets: list[str] = []
    key = None
    for item in (i.strip() for i in text.split(",")):
        if "=" in item:
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key not in _KEYS:
                raise ConfigError(FLAG, text, f"unknown key {key!r}; keys: {', '.join(_KEYS)}")
            if key == "targets":
                targets += [value] if value else []
            else:
                values[key] = value
        elif key == "targets" and item:
            targets.append(item)
        else:
            raise ConfigError(FLAG, text, f"{item!r} is not key=value (keys: {', '.join(_KEYS)})")
    if "targets" in text and not targets:
        raise ConfigError(FLAG, text, "targets= names no module")
    return LoRASpec(
        r=_number(text, values, "r", int, 8, lambda v: v > 0, "a positive integer"),
        alpha=_number(text, values, "alpha", float, 16.0, lambda v: v > 0, "a positive number"),
        dropout=_number(
            text, values, "dropout", float, 0.0, lambda v: 0 <= v < 1, "a probability in [0, 1)"
        ),
        targets=tuple(dict.fromkeys(targets)),
        rslora=_flag(text, values.get("rslora", "false")),
    )


def _number(
    text: str,
    values: dict[str, str],
    key: str,
    kind: Callable[[str], Any],
    default: Any,
    ok: Callable[[Any], bool],
    what: str,
) -> Any:
    if key not in values:
        return default
    try:
        value = kind(values[key])
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConfigError(FLAG, text, f"{key} must be {what}, not {values[key]}")
    return value


def _flag(text: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(FLAG, text, f"rslora={value} is not valid; rslora must be true or false")


def parse_names(flag: str, text: str | None) -> tuple[str, ...]:
    """``--lora-train``'s module names (comma separated suffixes, as targets)."""
    if not text:
        return ()
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(flag, text, "name modules, comma separated (e.g. score,lm_head)")
    return names


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What PEFT's LoraConfig may hold that these adapters do not do (key -> the value meaning "off").
_UNSUPPORTED = {
    "use_dora": False,
    "bias": "none",
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
}


def lora_of_adapter(directory: str) -> LoRASpec:
    """The spec of an adapter PEFT saved (``--lora-init DIR``): its ``adapter_config.json``,
    read as data; what these adapters cannot do is refused in one line."""
    import json
    from pathlib import Path

    flag = "--lora-init"
    path = Path(directory) / ADAPTER_CONFIG
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(flag, directory, f"cannot read {ADAPTER_CONFIG}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("peft_type") != "LORA":
        kind = doc.get("peft_type") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(flag, directory, f"holds a {kind} adapter, not LORA")
    if not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            flag, directory, f"has no {ADAPTER_WEIGHTS} (pickled adapter_model.bin is not read)"
        )
    for key, off in _UNSUPPORTED.items():
        if doc.get(key, off) not in (off, None, {}, [], False):
            raise ConfigError(flag, directory, f"sets {key}={doc[key]!r}, which is not supported")
    targets = doc.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets == ALL_LINEAR else None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(
            flag, directory, f"target_modules {doc.get('target_modules')!r}: give a list of names"
        )
    try:
        return LoRASpec(
            r=int(doc["r"]),
            alpha=float(doc.get("lora_alpha", 8)),
            dropout=float(doc.get("lora_dropout", 0.0)),
            targets=tuple(sorted(targets)),
            rslora=bool(doc.get("use_rslora", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(flag, directory, f"{ADAPTER_CONFIG} is not valid: {exc!r}") from None


def resolve_lora(lora: str | None, init: str | None, train: str | None) -> str | None:
    """``--lora`` as the run takes it: ``--lora-init``'s adapter's spec where only that is given
    (the two must agree where both are); ``--lora-train`` only with one of them."""
    if init is not None:
        from_file = lora_of_adapter(init)
        given = parse_lora(lora)
        if given is not None and replace(given, targets=tuple(sorted(given.targets))) != from_file:
            raise ConfigError(
                "--lora-init",
                init,
                f"its adapter is {from_file.text()}, --lora asks for {given.text()}: "
                "leave --lora out to take the adapter's",
            )
        lora = from_file.text()
    parse_lora(lora)
    if lora is None and train:
        raise ConfigError("--lora-train", train, "trains modules beside LoRA adapters: give --lora")
    parse_names("--lora-train", train)
    return lora
