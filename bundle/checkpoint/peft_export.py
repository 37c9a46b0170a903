"""A ``--lora`` run's step as the adapter directory PEFT reads.

    python -m bundle.checkpoint export SAVE_DIR/step-N --peft OUT [--force]

``OUT`` holds ``adapter_config.json`` and ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base, OUT)`` loads with no key missing or unexpected (and what
``--lora-init`` reads back): the adapters and ``--lora-train``'s modules (PEFT's
``modules_to_save``, saved under their own names, as PEFT saves them) under PEFT's names
(``models.lora.peft_state``). The config names the adapted modules in full (PEFT takes a module
whose name is, or ends with ``.`` and, one of them), so exactly the modules the run adapted are
adapted; ``fan_in_fan_out`` is set where they are GPT-2's ``Conv1D``. The frozen base is not
written (``base_model_name_or_path``: the run's ``--pretrained`` directory, where it had one).
Everything is written to ``OUT.partial`` and renamed, as ``--hf`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import hf_export, merged
from bundle.config.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, parse_lora
from bundle.errors import CheckpointError, ConfigError

FLAG = "--peft"


@dataclass(frozen=True)
class PeftExport:
    """What ``export_peft`` wrote: the directory, the modules adapted, the modules saved whole,
    the tensors and the bytes of ``adapter_model.safetensors``."""

    out: str
    adapted: int
    trained: tuple[str, ...]
    tensors: int
    bytes: int


def causal_lm(model: object) -> bool:
    """Whether ``model`` (``bundle.json``'s) is a ``transformers`` causal language model class
    (PEFT's task ``CAUSAL_LM``)."""
    if not (isinstance(model, str) and model.startswith("transformers:")):
        return False
    name = model.partition(":")[2]
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # transformers not here: its names still say what they are
        return name.endswith(("ForCausalLM", "LMHeadModel"))
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def adapter_config(info: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` of the run (``info``: its ``bundle.json``; ``rec``: its adapters)."""
    spec = parse_lora(rec["spec"])
    assert spec is not None, "a --lora run records its spec"
    pretrained = info.get("pretrained")
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if causal_lm(info.get("model")) else None,
        "r": spec.r,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": sorted(rec["modules"]),
        "fan_in_fan_out": "conv1d" in rec["modules"].values(),
        "bias": "none",
        "modules_to_save": list(rec.get("trained") or []) or None,
        "init_lora_weights": True,
        "use_dora": False,
        "base_model_name_or_path": pretrained if isinstance(pretrained, str) else None,
        "inference_mode": True,
    }


def _lora_info(path: str) -> dict[str, Any]:
    """``bundle.json`` of ``path``, refused in one line unless its run trained LoRA adapters."""
    info = ckpt.read_info(path)
    if not merged.is_lora(info):
        raise ConfigError(
            FLAG,
            path,
            f"it holds no LoRA adapters (its run had no --lora): export {path} OUT.pt writes "
            f"its model, {info.get('model')!r}",
        )
    return info


def export_peft(path: str, out: str, *, force: bool = False) -> PeftExport:
    """Write the adapters of ``--lora`` step ``path`` as PEFT's directory ``out`` (the module
    doc); ``force`` replaces an ``out`` already there."""
    from safetensors.torch import save_file

    from bundle.models import lora

    out = hf_export.check_out(path, out, flag=FLAG, force=force)
    with contextlib.suppress(CheckpointError):  # unreadable: the verification says why
        _lora_info(path)  # another kind of run: before reading it
    try:
        state = ckpt.weights(path)  # verified first
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing exported") from None
    info = _lora_info(path)  # what was verified
    rec = merged.adapters(path, info)
    tensors = lora.peft_state(state, rec)
    wanted = {
        lora.peft_key(f"{m}.{p}.weight") for m in rec["modules"] for p in ("lora_A", "lora_B")
    }
    absent = sorted(wanted - set(tensors))
    if absent:
        raise CheckpointError(f"{path}: it lacks the adapter {absent[0].removeprefix(lora.PREFIX)}")
    config = adapter_config(info, rec)
    partial = f"{out}.partial"
    hf_export.remove(partial)
    try:
        os.makedirs(partial)
        save_file(tensors, os.path.join(partial, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(partial, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        hf_export.swap_in(partial, out)
    except BaseException as exc:
        hf_export.remove(partial)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write {out}: {ckpt.cause_of(exc)}") from exc
        raise
    return PeftExport(
        out=out,
        adapted=len(rec["modules"]),
        trained=tuple(rec.get("trained") or ()),
        tensors=len(tensors),
        bytes=os.path.getsize(os.path.join(out, ADAPTER_WEIGHTS)),
    )
