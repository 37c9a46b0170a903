"""A ``--lora`` run's step as the plain model: its frozen base built again as the run built it,
checked against the step's digests, and the adapters folded into it (``models.lora``).

A LoRA checkpoint holds only what trains (the adapters, ``--lora-train``'s modules) and the
buffers; of each frozen base tensor it holds a SHA-256 digest (``base.<name>``). The base is
rebuilt from what ``bundle.json`` records, as ``build_stages`` built it: torch seeded with the
run's ``seed``, then the ``--pretrained`` directory read, or a ``transformers`` model built from
its recorded config (``hf_config``), or the recorded ``--model`` and ``--model-args``.
``--base FILE|DIR`` says where the base is when the record cannot: the ``--weights`` file the run
started from (not recorded), or its ``--pretrained`` directory where it lies on this machine. A
base that differs from the digests by one byte is refused in one line: the adapters were trained
on another one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bundle.checkpoint import format as ckpt
from bundle.checkpoint.parts import digest_of
from bundle.errors import CheckpointError, ConfigError

LORA = "lora_adapters"  # bundle.json's record of a --lora run's adapters (models.lora.Adapted)
DIGEST = "base."  # a frozen base tensor's SHA-256, by full-model name
BASE = "--base"
TRUST = "--trust-checkpoint-code"


def is_lora(info: Mapping[str, Any]) -> bool:
    """Whether ``bundle.json``'s ``info`` is of a ``--lora`` run."""
    return LORA in info


def adapters(path: str, info: Mapping[str, Any]) -> dict[str, Any]:
    """The run's adapter record, checked as data (one line for the first thing wrong)."""
    rec: Any = info.get(LORA)
    where = f"{os.path.join(path, ckpt.INFO)} {LORA}"
    modules = rec.get("modules") if isinstance(rec, dict) else None
    if not (
        isinstance(rec, dict)
        and isinstance(modules, dict)
        and modules
        and all(isinstance(k, str) and v in ("linear", "conv1d") for k, v in modules.items())
    ):
        raise ConfigError(where, rec, "must name the adapted modules, as a --lora run records")
    scaling, spec = rec.get("scaling"), rec.get("spec")
    trained = rec.get("trained", [])
    if not (isinstance(scaling, int | float) and not isinstance(scaling, bool)):
        raise ConfigError(f"{where} scaling", scaling, "must be a number")
    if not isinstance(spec, str):
        raise ConfigError(f"{where} spec", spec, "must be --lora's text")
    if not (isinstance(trained, list) and all(isinstance(t, str) for t in trained)):
        raise ConfigError(f"{where} trained", trained, "must be a list of module names")
    return dict(rec)


def digests(path: str) -> dict[str, torch.Tensor]:
    """The ``base.<name>`` digests of checkpoint ``path`` (verified first), by name."""
    want = {
        k: torch.empty(shape, dtype=dtype)
        for k, (shape, dtype) in ckpt.entries(path).items()
        if k.startswith(DIGEST)
    }
    if want:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # one process on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(want, storage_reader=ckpt.safe_reader(path), no_dist=True)
    return {k.removeprefix(DIGEST): v for k, v in want.items()}


def _recorded(path: str, info: Mapping[str, Any]) -> tuple[str, int, int, tuple[int, ...]]:
    """The model, seed, classes and input shape ``bundle.json`` records, checked as data."""
    where = os.path.join(path, ckpt.INFO)
    name, seed = info.get("model"), info.get("seed")
    classes, shape = info.get("num_classes"), info.get("input_shape")
    if not (isinstance(name, str) and name):
        raise CheckpointError(f"{where}: records no model")
    if not (isinstance(seed, int) and not isinstance(seed, bool)):
        raise CheckpointError(f"{where}: records no seed, so the frozen base cannot be rebuilt")
    if not (
        isinstance(classes, int)
        and isinstance(shape, list)
        and shape
        and all(isinstance(d, int) for d in shape)
    ):
        raise CheckpointError(f"{where}: records no input shape or classes")
    return name, seed, classes, tuple(shape)


def base_model(
    path: str,
    info: Mapping[str, Any],
    *,
    base: str | None = None,
    model_config: str | None = None,
    trust: bool = False,
) -> nn.Module:
    """The frozen base of checkpoint ``path``'s run, built again as the run built it (the module
    doc); ``base``: the ``--weights`` file or ``--pretrained`` directory it came from."""
    from bundle import models
    from bundle.checkpoint import hf_record
    from bundle.config import ModelConfig, is_reference, parse_model_args

    name, seed, classes, shape = _recorded(path, info)
    args = info.get("model_args") if isinstance(info.get("model_args"), str) else None
    pretrained = info.get("pretrained") if isinstance(info.get("pretrained"), str) else None
    weights = None
    if base is not None:
        if not os.path.exists(base):
            raise ConfigError(BASE, base, "no such file or directory")
        pretrained, weights = (base, None) if os.path.isdir(base) else (pretrained, base)
    hf = name.startswith("transformers:")
    if is_reference(name) and not hf and not trust:
        raise ConfigError(
            f"{os.path.join(path, ckpt.INFO)} model",
            name,
            f"rebuilding the frozen base runs this code the checkpoint names: give {TRUST} "
            "(for a checkpoint you trust)",
        )
    torch.manual_seed(seed)  # as build_stages seeds it: the base's fresh tensors come alike
    if pretrained is not None:
        if not os.path.isdir(pretrained):
            raise ConfigError(
                BASE, pretrained, "the run's --pretrained directory is not here: give --base DIR"
            )
        cfg = ModelConfig(name=name, args=args, pretrained=pretrained)
        return models.build_model(cfg, classes, shape, seed=seed)
    if hf and hf_record.RECORD in info and model_config is None:
        where = f"{os.path.join(path, ckpt.INFO)} {hf_record.RECORD}"
        cls, config = hf_record.config_from(info[hf_record.RECORD], where)
        model: nn.Module = cls(config)
    else:
        model = models.build(
            name,
            num_classes=classes,
            input_shape=shape,
            args=parse_model_args(args),
            config_file=model_config,
        )
    if weights is not None:
        models.load_weights(model, weights)
    return model


def check_base(model: nn.Module, path: str, base: str | None = None) -> None:
    """Refuse, in one line, a rebuilt base that is not the one checkpoint ``path`` was trained on
    (a tensor whose digest differs, or one it lacks)."""
    own = model.state_dict()
    recorded = digests(path)
    lacking = sorted(n for n in recorded if n not in own)
    changed = sorted(
        n for n, d in recorded.items() if n in own and not torch.equal(digest_of(own[n]), d)
    )
    if not (lacking or changed):
        return
    where = f"the base from {base}" if base else "the base rebuilt from its bundle.json"
    what = (
        f"it lacks {lacking[0]}"
        if lacking
        else f"{len(changed)} of its {len(recorded)} tensors differ, e.g. {changed[0]}"
    )
    hint = "" if base else f"; a run from --weights FILE needs {BASE} FILE"
    raise CheckpointError(
        f"{path}: {where} is not the one its adapters were trained on ({what}){hint}"
    )


def merged_state(
    path: str,
    info: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    *,
    base: str | None = None,
    model_config: str | None = None,
    trust: bool = False,
) -> dict[str, torch.Tensor]:
    """The plain model's state of ``--lora`` checkpoint ``path`` (its verified tensors ``state``):
    the base rebuilt and checked, what trained put in, and each adapter folded into its weight."""
    from bundle.models import lora

    rec = adapters(path, info)
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        model = base_model(path, info, base=base, model_config=model_config, trust=trust)
    check_base(model, path, base)
    full = {k: v.detach() for k, v in model.state_dict().items()}
    wanted = {f"{m}.{p}.weight" for m in rec["modules"] for p in ("lora_A", "lora_B")}
    # A buffer the model does not save (a rotary table) is computed again by any model built.
    unsaved = {n for n, _ in model.named_buffers()} - set(full)
    state = {k: v for k, v in state.items() if k not in unsaved}
    stray = sorted(k for k in state if k not in full and k not in wanted)
    absent = sorted(wanted - set(state))
    if absent:
        raise CheckpointError(f"{path}: it lacks the adapter {absent[0]}")
    if stray:
        raise CheckpointError(
            f"{path}: it holds {stray[0]}, which the base built from its bundle.json has not"
        )
    full.update(state)
    named = dict(model.named_modules())
    # The base's own layers say which are transposed (GPT-2's Conv1D), whatever was recorded.
    kinds = {
        n: "conv1d" if n in named and lora.is_conv1d(named[n]) else "linear" for n in rec["modules"]
    }
    try:
        return lora.merge_state(full, {**rec, "modules": kinds})
    except (KeyError, RuntimeError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CheckpointError(f"{path}: its adapters do not fit the base ({why})") from None
