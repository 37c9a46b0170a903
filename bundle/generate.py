"""Sample text from a trained language model, the step after training.

    python -m bundle.generate SAVE_DIR/step-N --prompt "Once upon" --max-new-tokens 200
    python -m bundle.generate SAVE_DIR --prompt "Once upon"     # its newest whole step
    python -m bundle.generate EXPORT_DIR --prompt "Once upon"   # export --hf, save_pretrained
    python -m bundle.generate weights.pt --model gpt --model-args layers=6,width=384,heads=6 \\
        --seq-len 256 --prompt "Once upon"

CHECKPOINT is a ``--save-dir`` step directory (it records the model, its arguments, the
vocabulary and the context length; it is verified before it is read), a save directory (its
newest whole step), a ``transformers`` ``save_pretrained`` directory (``export --hf``: the class
its ``config.json`` names, weights from safetensors files only, its tokenizer when it holds one)
or a ``--checkpoint`` weights file, with the ``--model`` and ``--model-args`` it was trained
with. Text is tokenized as ``--dataset text`` read it: byte-level (256 tokens), or by the
``--tokenizer`` the step directory records (or given here). Sampling: ``--temperature`` (0:
always the likeliest token), ``--top-k``; the same ``--seed`` gives the same text. The context is
the last ``--seq-len`` tokens (the model's training context by default, and at most that; an
export's: its position table). Errors are one line on stderr, exit code 2 (as main.py's input
errors).

What a step directory records is data, checked before use: it may name a model shipped here or in
torchvision, or ``transformers:ClassName``; a factory it names (``package.module:function``, a
``file.py``) is code the checkpoint chose and runs only with ``--trust-checkpoint-code``. The
model is built on the meta device and its tensors' shapes compared with the checkpoint's before
the model is allocated. A ``transformers`` model's step records its config (``hf_config``): the
model is rebuilt from it unless ``--model``, ``--model-args`` or ``--model-config`` is given.
A ``--lora`` run's step samples the plain model, its adapters merged into the frozen base built
again as the run built it (``checkpoint.merged``; ``--base FILE|DIR``: where that base came from).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bundle.checkpoint import format as ckpt
from bundle.checkpoint import hf_export
from bundle.config import is_reference, parse_model_args
from bundle.data import tokenizer
from bundle.errors import BundleError, ConfigError, ExitCode, positive

PROG = "python -m bundle.generate"
TRUST = "--trust-checkpoint-code"
DEFAULT_CONTEXT = 256  # a weights file's, without --seq-len


@dataclass(frozen=True)
class Source:
    """What a checkpoint says about the model it holds."""

    model: str
    args: dict[str, Any]
    output: str | None
    vocab: int
    tokenizer: str | None  # --tokenizer's directory; None: byte-level
    context: int  # the tokens each step sees
    trained: int | None  # the context it was trained on (a step directory records it)
    state: Callable[[], dict[str, torch.Tensor]]  # read once the model is known on meta
    hf: dict[str, Any] | None = None  # a transformers model's class and config (hf_export)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("checkpoint",
                   help="a --save-dir step directory or save directory, an export --hf "
                        "directory, or a --checkpoint file")  # fmt: skip
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="context in tokens (default and most: the training context)")  # fmt: skip
    p.add_argument("--model", help="a weights file's model (a step directory records it)")
    p.add_argument("--model-args", metavar="K=V,...")
    p.add_argument("--model-config", metavar="FILE|DIR", help="a transformers model's config")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the tokenizer it was trained with (a step directory records it; "
                        "default: byte-level)")  # fmt: skip
    p.add_argument("--base", metavar="FILE|DIR",
                   help="a --lora run's step: the --weights file or --pretrained directory its "
                        "frozen base came from (default: as the step records)")  # fmt: skip
    p.add_argument(TRUST, action="store_true",
                   help="run the model factory a step directory names (package.module:function): "
                        "only for checkpoints you trust, like transformers' trust_remote_code")  # fmt: skip
    return p


def check_flags(args: argparse.Namespace) -> None:
    """Refuse sampling flags no model can honour, each in one line naming it."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(
            "--temperature", args.temperature, "give a number >= 0 (0: the likeliest token)"
        )
    if args.seq_len is not None:
        positive("--seq-len", args.seq_len)
    positive("--max-new-tokens", args.max_new_tokens, 0)
    if args.top_k is not None:
        positive("--top-k", args.top_k)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _output_key(value: object) -> bool:
    """What ``--model-output NAME|N`` records: an output's name or a position, or nothing."""
    return value is None or (
        isinstance(value, str)
        and len(value) <= 100
        and (value.isidentifier() or (value.isascii() and value.isdigit()))
    )


# bundle.json's fields as generation reads them: (key, the check, what is allowed).
_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("num_classes", _count, "must be an integer >= 1"),
    ("input_shape", lambda v: isinstance(v, list) and bool(v) and all(map(_count, v)),
     "must be a list of integers >= 1"),
    ("model_args", lambda v: v is None or isinstance(v, str), "must be K=V,... text or null"),
    ("tokenizer", lambda v: v is None or isinstance(v, str), "must be a directory or null"),
    ("model_output", _output_key,
     "must be an output's name or position (as --model-output NAME|N records it) or null"),
)  # fmt: skip


def recorded_model(name: object, where: str, *, trust: bool) -> str:
    """The model a step directory names, if it is data: a model shipped here or in torchvision,
    or ``transformers:ClassName`` of a model class. A factory is code the checkpoint chose: run
    only with ``--trust-checkpoint-code``."""
    from bundle import models

    if not isinstance(name, str) or not name:
        raise ConfigError(where, name, "must name a model")
    if not is_reference(name):
        if name in models.available() or name in models.zoo_names():
            return name
        raise ConfigError(where, name, f"choose a model of: {', '.join(models.available())}")
    package, _, cls = name.partition(":")
    if package == "transformers" and cls.isidentifier() and _transformers_model(cls, where):
        return name
    if trust:
        return name
    raise ConfigError(
        where,
        name,
        f"it is code named by the checkpoint, which runs only with {TRUST} (for a checkpoint "
        "you trust); or give --model",
    )


def _transformers_model(cls: str, where: str) -> bool:
    """Whether ``transformers.<cls>`` is a model class (a PreTrainedModel); without transformers
    installed, one line that says how to install it."""
    from bundle.models import hf

    try:
        import transformers

        return hf.is_pretrained_class(getattr(transformers, cls, None))
    except Exception as exc:  # noqa: BLE001 - its lazy import failed: not one
        if hf.missing(exc):
            raise ConfigError(
                where, f"transformers:{cls}", f"needs transformers ({hf.install_command()})"
            ) from None
        return False


def _recorded(info: dict, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """bundle.json's fields generation uses, each checked as data (one line for the first bad)."""
    where = os.path.join(path, ckpt.INFO)
    out: dict[str, Any] = {}
    for key, ok, allowed in _FIELDS:
        out[key] = info.get(key)
        if not ok(out[key]):
            raise ConfigError(f"{where} {key}", out[key], allowed)
    if len(out["input_shape"]) != 1:
        raise ConfigError(
            "CHECKPOINT", path, f"its model takes {out['input_shape']}, not token ids"
        )
    out["model"] = args.model or recorded_model(
        info.get("model"), f"{where} model", trust=args.trust_checkpoint_code
    )
    out["hf"] = None
    # A recorded transformers config rebuilds the model as trained, unless flags here describe it.
    if hf_export.RECORD in info and not (args.model or args.model_args or args.model_config):
        cls, _ = hf_export.config_from(info[hf_export.RECORD], f"{where} {hf_export.RECORD}")
        if out["model"] != f"transformers:{cls.__name__}":
            raise ConfigError(f"{where} {hf_export.RECORD} class", cls.__name__, "not its model")
        out["hf"] = info[hf_export.RECORD]
    return out


def _step_source(path: str, args: argparse.Namespace) -> Source:
    from bundle.checkpoint import merged

    raw = ckpt.read_info(path)
    info = _recorded(raw, path, args)
    if args.base is not None and not merged.is_lora(raw):
        raise ConfigError(
            "--base", args.base, f"is for a --lora run's step; {path} holds no adapters"
        )
    trained = info["input_shape"][0]
    if args.seq_len is not None and args.seq_len > trained:
        raise ConfigError(
            "--seq-len",
            args.seq_len,
            f"the model was trained on {trained} tokens: give at most that",
        )
    return Source(
        model=info["model"],
        args=parse_model_args(args.model_args or info["model_args"]),
        output=info["model_output"],
        vocab=info["num_classes"],
        tokenizer=args.tokenizer or info["tokenizer"],
        context=args.seq_len or trained,
        trained=trained,
        state=lambda: _weights(path, raw, args) if merged.is_lora(raw) else ckpt.weights(path),
        hf=info["hf"],
    )


def _weights(path: str, info: dict, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """A ``--lora`` step's plain model: its adapters merged into the base built again."""
    from bundle.checkpoint import merged

    return merged.merged_state(
        path,
        info,
        ckpt.weights(path),
        base=args.base,
        model_config=args.model_config,
        trust=args.trust_checkpoint_code,
    )


def _file_source(path: str, args: argparse.Namespace) -> Source:
    if not args.model:
        raise ConfigError("CHECKPOINT", path, "a weights file needs --model (and --model-args)")
    try:
        state = ckpt.load(path)
    except Exception as exc:  # noqa: BLE001 - empty, cut short or not torch's: the same one line
        why = (str(exc).strip().splitlines() or [""])[0][:160]
        raise ConfigError(
            "CHECKPOINT", path, f"cannot read it as a weights file ({type(exc).__name__}: {why})"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError("CHECKPOINT", path, "it holds no state dict (names -> tensors)")
    return Source(
        model=args.model,
        args=parse_model_args(args.model_args),
        output=None,
        vocab=tokenizer.load(args.tokenizer).vocab,
        tokenizer=args.tokenizer,
        context=args.seq_len or DEFAULT_CONTEXT,
        trained=None,
        state=lambda: state,
    )


def _pretrained_source(path: str, args: argparse.Namespace) -> Source:
    """A ``save_pretrained`` directory: its ``config.json`` names and sizes the model."""
    described = (args.model, args.model_args, args.model_config)
    for flag, value in zip(("--model", "--model-args", "--model-config"), described, strict=True):
        if value:
            raise ConfigError(flag, value, f"{path}/config.json describes the model: leave it out")
    pre = hf_export.read_pretrained(path)
    cls, config = hf_export.config_from(pre.record, os.path.join(path, "config.json"))
    vocab: Any = getattr(config, "vocab_size", None)
    if not _count(vocab):
        raise ConfigError(f"{path}/config.json vocab_size", vocab, "a language model has one")
    sizes: list[Any] = [
        getattr(config, k, None) for k in ("n_positions", "max_position_embeddings")
    ]
    positions: int = next((n for n in sizes if _count(n)), DEFAULT_CONTEXT)
    if args.seq_len is not None and args.seq_len > positions:
        raise ConfigError("--seq-len", args.seq_len, f"the model holds {positions} positions")
    return Source(
        model=f"transformers:{cls.__name__}",
        args={},
        output=None,
        vocab=vocab,
        tokenizer=args.tokenizer or pre.tokenizer,
        context=args.seq_len or positions,
        trained=positions,
        state=pre.state,
        hf=pre.record,
    )


def _note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr)


def source(args: argparse.Namespace) -> Source:
    """The model's description and its weights, from a step directory (or the newest of a save
    directory), a ``save_pretrained`` directory, or a weights file."""
    path = args.checkpoint
    if os.path.isdir(path) and not hf_export.is_pretrained(path):
        return _step_source(ckpt.step_or_newest(path, _note), args)
    if args.base is not None:
        raise ConfigError("--base", args.base, "is for a --lora run's step directory")
    if os.path.isdir(path):
        return _pretrained_source(path, args)
    if not os.path.isfile(path):
        raise ConfigError("CHECKPOINT", path, "no such step directory or weights file")
    return _file_source(path, args)


def check_fits(
    src: Source, own: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], where: str
) -> None:
    """Refuse a checkpoint whose tensors do not fit the model as described (``own``: the model's
    shapes, built on the meta device): before the model is allocated. A weights file
    whose position table differs from ``--seq-len`` is told so: the flag sizes the model."""
    missing = sorted(set(own) - set(shapes))
    if missing:
        raise ConfigError(
            "CHECKPOINT", where, f"it lacks {len(missing)} of the model's tensors ({missing[0]})"
        )
    for key, shape in own.items():
        got = shapes[key]
        if got == shape:
            continue
        table = len(got) == len(shape) == 2 and got[1] == shape[1] and shape[0] == src.context
        if table and src.trained is None:
            raise ConfigError(
                "--seq-len",
                src.context,
                f"the checkpoint's position table ({key}) holds {got[0]} positions, not "
                f"{shape[0]}: give --seq-len {got[0]}",
            )
        raise ConfigError(
            "CHECKPOINT",
            where,
            f"{key} is {list(got)} in the checkpoint but {list(shape)} in the model "
            f"{src.model} with {src.vocab} classes (another vocabulary, or --model-args?)",
        )


def build(src: Source, config_file: str | None, where: str = "") -> nn.Module:
    """The model with the checkpoint's weights: built on the meta device first, and for real
    only once the checkpoint's tensors fit it (a recorded vocabulary of 10**12 allocates
    nothing)."""
    from bundle import models

    if src.hf is not None:
        return _build_hf(src, where or src.model)
    length = src.trained or src.context  # the model is built as trained, then fed less
    kwargs: dict[str, Any] = dict(
        num_classes=src.vocab, input_shape=(length,), args=src.args, config_file=config_file
    )
    meta = models.build_on_meta(src.model, **kwargs)
    own = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    state = src.state()
    check_fits(src, own, {k: tuple(v.shape) for k, v in state.items()}, where or src.model)
    model = models.build(src.model, **kwargs)
    model.load_state_dict({k: state[k] for k in own})
    return model.eval()


def _build_hf(src: Source, where: str) -> nn.Module:
    """A ``transformers`` model from its recorded config: on meta first, as ``build``; the tied
    copies an export leaves out are the weights they are tied to."""
    assert src.hf is not None
    cls, config = hf_export.config_from(src.hf, where)
    meta = hf_export.on_meta(cls, config)
    own = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    state = hf_export.with_tied(meta, dict(src.state()))
    check_fits(src, own, {k: tuple(v.shape) for k, v in state.items()}, where)
    model: nn.Module = cls(config)
    model.load_state_dict({k: state[k] for k in own})
    return model.eval()


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    *,
    new_tokens: int,
    context: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    output: str | None = None,
) -> list[int]:
    """``prompt`` continued by ``new_tokens`` tokens, each drawn from the model's last logits."""
    from bundle import models

    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(new_tokens):
        x = torch.tensor([tokens[-context:]], dtype=torch.long)
        logits = models.forward(model, x, output)[0, -1].float()
        if temperature <= 0:
            tokens.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < logits.numel():
            cut = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < cut, float("-inf"))
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return tokens


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        check_flags(args)
        src = source(args)
        words = tokenizer.load(src.tokenizer)
        if words.vocab > src.vocab:
            raise ConfigError(
                "--tokenizer", src.tokenizer, f"has {words.vocab} tokens, the model {src.vocab}"
            )
        prompt = words.encode(args.prompt)
        if not prompt:
            raise ConfigError("--prompt", args.prompt, "give at least one character")
        model = build(src, args.model_config, args.checkpoint)
        tokens = sample(
            model,
            prompt,
            new_tokens=args.max_new_tokens,
            context=src.context,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            output=src.output,
        )
    except BundleError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return ExitCode.INPUT
    sys.stdout.write(words.decode(tokens) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
