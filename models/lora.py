"""LoRA adapters on a frozen model (``--lora``), applied to the whole model before it is cut.

A target keeps its name and its own forward: its class becomes a subclass of itself
(``LoRALinear``, ``LoRAConv1D``, as torchtitan's converter does) with three children, so
``q_proj.weight`` is still ``q_proj.weight`` (``--pretrained`` reads it by that name, a checkpoint
keeps it) and the adapters are ``q_proj.lora_A.weight`` ``[r, in]`` and ``q_proj.lora_B.weight``
``[out, r]``, PEFT's names without its adapter segment::

    y = base(x) + lora_B(lora_A(dropout(x))) * scaling          (scaling = alpha / r)

Everything else is frozen (``requires_grad=False``) except the modules ``--lora-train`` names;
the engine, sync and optimizer already take only what trains. ``lora_A`` starts as PEFT's
(Kaiming-uniform) and ``lora_B`` at zero, each seeded from (seed, module name), so any shape, and
a model on the meta device filled later, starts alike; ``--lora-init DIR`` reads an adapter PEFT
saved instead (``peft_state`` writes one). ``merge_state`` folds the adapters into the weights
(``W + scaling * B @ A``, transposed for GPT-2's ``Conv1D``).
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn

from bundle.config import LoRASpec
from bundle.config.lora import ADAPTER_WEIGHTS, ALL_LINEAR
from bundle.errors import ConfigError

FLAG = "--lora"
# What PEFT adapts when no target is named, by transformers' model_type (PEFT's
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, the families in common use), and for
# Bundle's own gpt (its attention's projections, as GPT-2's c_attn).
DEFAULT_TARGETS: Mapping[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "gemma",
            "gemma2",
            "gemma3_text",
            "phi",
            "gptj",
            "opt",
            "starcoder2",
            "olmo",
            "olmo2",
            "granite",
            "cohere",
            "stablelm",
            "deepseek_v2",
        ),
        ("q_proj", "v_proj"),
    ),  # fmt: skip
    "gpt2": ("c_attn",),
    "phi3": ("qkv_proj",),
    "gpt_neox": ("query_key_value",),
    "bloom": ("query_key_value",),
    "falcon": ("query_key_value",),
    "gpt_bigcode": ("c_attn",),
    "bert": ("query", "value"),
    "roberta": ("query", "value"),
    "distilbert": ("q_lin", "v_lin"),
    "t5": ("q", "v"),
    "bundle-gpt": ("qkv",),
}


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers, weight ``[in, out]``)."""
    is_one = any(c.__name__ == "Conv1D" for c in type(m).__mro__)
    return is_one and hasattr(m, "nf") and hasattr(m, "weight")


def adaptable(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


class _Adapted:
    """The forward of an adapted layer: its own, plus the low-rank update."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(x, *args, **kwargs)  # type: ignore[misc]
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + update * self.scaling


_CLASSES: dict[type, type] = {}


def _adapted_class(base: type) -> type:
    """``base`` with the adapters' forward; one class per base, kept here by name so that a
    module holding one can be pickled as its base can."""
    if base not in _CLASSES:
        name = f"LoRA{base.__name__}"
        cls = type(name, (_Adapted, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[base] = globals()[name] = cls
    return _CLASSES[base]


def is_adapted(m: nn.Module) -> bool:
    return isinstance(m, _Adapted)


@dataclass(frozen=True)
class Adapted:
    """What ``apply`` did: the adapted modules (name -> "linear" or "conv1d"), the modules
    trained whole, the spec, and the targets as PEFT's config names them."""

    modules: dict[str, str]
    trained: tuple[str, ...]
    spec: LoRASpec
    targets: tuple[str, ...]
    counts: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What a checkpoint records (bundle.json's ``lora``): enough to merge or export."""
        return {
            "spec": self.spec.text(),
            "scaling": self.spec.scaling,
            "modules": dict(sorted(self.modules.items())),
            "trained": list(self.trained),
            "targets": list(self.targets),
        }


def family(model: nn.Module) -> str | None:
    from bundle.models.gpt import GPT

    if isinstance(model, GPT):
        return "bundle-gpt"
    return getattr(getattr(model, "config", None), "model_type", None)


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return out if out is not None else getattr(model, "head", None)


def _nearest(names: Iterable[str], wanted: str) -> str:
    tails = sorted({n.rpartition(".")[2] for n in names if n})
    near = difflib.get_close_matches(wanted, tails, n=4, cutoff=0.4) or tails[:6]
    return ", ".join(near) if near else "none"


def targets_of(model: nn.Module, spec: LoRASpec) -> tuple[dict[str, nn.Module], tuple[str, ...]]:
    """The modules ``spec`` adapts (by name), and its targets as written (defaults resolved);
    a target that matches nothing, or a module that is not linear, refused in one line."""
    named = dict(model.named_modules())
    if not any(adaptable(m) for m in named.values()):
        raise ConfigError(FLAG, spec.text(), f"{type(model).__name__} has no linear layer to adapt")
    targets = spec.targets
    if not targets:
        kind = family(model)
        if kind is None or kind not in DEFAULT_TARGETS:
            raise ConfigError(
                FLAG,
                spec.text(),
                f"there is no default target for {type(model).__name__} (family {kind}): name "
                f"modules with targets=NAME,... or targets={ALL_LINEAR}",
            )
        targets = DEFAULT_TARGETS[kind]
    if targets == (ALL_LINEAR,):
        head = _output_layer(model)
        chosen = {n: m for n, m in named.items() if adaptable(m) and m is not head and n}
        return chosen, targets
    chosen = {}
    for t in targets:
        hits = {n: m for n, m in named.items() if n and _matches(n, t)}
        if not hits:
            raise ConfigError(
                FLAG,
                spec.text(),
                f"target {t!r} matches no module of {type(model).__name__}; nearest names: "
                f"{_nearest(named, t)}",
            )
        wrong = [f"{n} ({type(m).__name__})" for n, m in hits.items() if not adaptable(m)]
        if wrong:
            raise ConfigError(
                FLAG,
                spec.text(),
                f"target {t!r} matches {wrong[0]}: LoRA adapts Linear and Conv1D layers only",
            )
        chosen.update(hits)
    return chosen, targets


def apply(
    model: nn.Module,
    spec: LoRASpec,
    *,
    seed: int,
    train: tuple[str, ...] = (),
    init: str | None = None,
) -> Adapted:
    """Adapt ``model`` in place: adapters on the targets, everything else frozen but the
    modules named in ``train``; ``init``: a PEFT adapter directory to start from."""
    if any(is_adapted(m) for m in model.modules()):
        raise ConfigError(FLAG, spec.text(), "the model is adapted already")
    chosen, targets = targets_of(model, spec)
    named = dict(model.named_modules())
    kept: dict[str, nn.Module] = {}
    for t in train:
        hits = {n: m for n, m in named.items() if n and _matches(n, t)}
        if not hits:
            raise ConfigError(
                "--lora-train", t, f"matches no module; nearest names: {_nearest(named, t)}"
            )
        kept.update(hits)
    model.requires_grad_(False)
    modules = {}
    for name, m in chosen.items():
        _adapt(m, spec, name, seed)
        modules[name] = "conv1d" if is_conv1d(m) else "linear"
    for m in kept.values():
        m.requires_grad_(True)
    adapted = Adapted(modules, tuple(kept), spec, targets)
    if init is not None:
        load_peft(model, init, adapted)
    return adapted


def _adapt(m: nn.Module, spec: LoRASpec, name: str, seed: int) -> None:
    w = cast(torch.Tensor, m.weight)
    d_in, d_out = (w.shape[0], w.shape[1]) if is_conv1d(m) else (w.shape[1], w.shape[0])
    # On the meta device where the model's tensors are built there (checks before launch); a
    # base built empty to be filled from files (--pretrained) gets real adapters at once.
    device = None if w.is_meta and torch.empty(0).device.type != "meta" else w.device
    m.__class__ = _adapted_class(type(m))
    m.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    m.lora_A = nn.Linear(d_in, spec.r, bias=False, device=device, dtype=torch.float32)
    m.lora_B = nn.Linear(spec.r, d_out, bias=False, device=device, dtype=torch.float32)
    m.scaling = spec.scaling  # type: ignore[assignment]
    if m.lora_A.weight.is_meta:
        return
    digest = hashlib.sha256(f"{seed}/lora/{name}".encode()).digest()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        nn.init.kaiming_uniform_(m.lora_A.weight, a=math.sqrt(5))  # PEFT's default
        nn.init.zeros_(m.lora_B.weight)


def adapter_names(model: nn.Module) -> set[str]:
    """The adapters' parameter names (what no base checkpoint holds)."""
    return {
        f"{name}.{part}.weight"
        for name, m in model.named_modules()
        if is_adapted(m)
        for part in ("lora_A", "lora_B")
    }


def frozen_names(model: nn.Module) -> set[str]:
    """Parameters that do not train (the base), by name; a tied one once per name."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


# -- PEFT's files -------------------------------------------------------------------------------

PREFIX = "base_model.model."


def peft_key(name: str) -> str:
    return PREFIX + name


def load_peft(model: nn.Module, directory: str, adapted: Adapted) -> None:
    """Set the adapters (and the modules trained whole) from ``directory``'s
    ``adapter_model.safetensors``: every adapter must be there, of its shape, and nothing else."""
    from safetensors.torch import load_file

    flag = "--lora-init"
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        stored = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - unreadable in any way: one line
        raise ConfigError(flag, directory, f"cannot read {ADAPTER_WEIGHTS}: {exc}") from None
    own = dict(model.named_parameters())
    want = {peft_key(n): n for n in sorted(adapter_names(model))}
    want.update({peft_key(n): n for t in adapted.trained for n in own if n.startswith(t + ".")})
    missing = [v for k, v in want.items() if k not in stored]
    unexpected = [k for k in stored if k not in want]
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which is not"
        raise ConfigError(
            flag,
            directory,
            f"does not fit this model's adapters ({len(missing)} missing, {len(unexpected)} "
            f"unexpected: it {what} an adapter here); was it saved for another base or targets?",
        )
    with torch.no_grad():
        for key, name in want.items():
            p, value = own[name], stored[key]
            if tuple(value.shape) != tuple(p.shape):
                raise ConfigError(
                    flag,
                    directory,
                    f"{name} is {list(value.shape)} there but {list(p.shape)} in this model "
                    "(another base model?)",
                )
            if not p.is_meta:
                p.copy_(value)


def peft_state(state: Mapping[str, torch.Tensor], record: Mapping[str, Any]) -> dict:
    """PEFT's ``adapter_model.safetensors`` entries from a full-model state (adapters and the
    modules trained whole, PEFT's ``modules_to_save``)."""
    keep = {f"{m}.{p}.weight" for m in record["modules"] for p in ("lora_A", "lora_B")}
    trained = tuple(record.get("trained", ()))
    out = {}
    for name, value in state.items():
        if name in keep or any(name.startswith(t + ".") for t in trained):
            out[peft_key(name)] = value.detach().contiguous()
    return out


def merge_state(state: Mapping[str, torch.Tensor], record: Mapping[str, Any]) -> dict:
    """``state`` with each adapter folded into its weight (``W + scaling * B @ A``, transposed
    for a ``Conv1D``) and the adapters left out: the plain model's state."""
    out = dict(state)
    scaling = float(record["scaling"])
    for name, kind in record["modules"].items():
        a, b = out.pop(f"{name}.lora_A.weight"), out.pop(f"{name}.lora_B.weight")
        w = out[f"{name}.weight"]
        delta = (b.float() @ a.float()) * scaling
        out[f"{name}.weight"] = (w.float() + (delta.T if kind == "conv1d" else delta)).to(w.dtype)
    return out
