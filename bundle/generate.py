"""Sample text from a trained language model, the step after training.

    python -m bundle.generate SAVE_DIR/step-N --prompt "Once upon" --max-new-tokens 200
    python -m bundle.generate weights.pt --model gpt --model-args layers=6,width=384,heads=6 \\
        --seq-len 256 --prompt "Once upon"

CHECKPOINT is a ``--save-dir`` step directory (it records the model, its arguments, the
vocabulary and the context length; it is verified before it is read) or a ``--checkpoint``
weights file, with the ``--model`` and ``--model-args`` it was trained with. Text is tokenized as
``--dataset text`` read it: byte-level (256 tokens), or by the ``--tokenizer`` the step directory
records (or given here). Sampling: ``--temperature`` (0: always the likeliest
token), ``--top-k``; the same ``--seed`` gives the same text. The context is the last
``--seq-len`` tokens (the model's training context by default). Errors are one line on stderr,
exit code 2 (as main.py's input errors).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bundle import tokenizer
from bundle.checkpoint import format as ckpt
from bundle.config import parse_model_args
from bundle.errors import BundleError, ConfigError

PROG = "python -m bundle.generate"


@dataclass(frozen=True)
class Source:
    """What a checkpoint says about the model it holds."""

    model: str
    args: dict[str, Any]
    output: str | None
    vocab: int
    tokenizer: str | None  # --tokenizer's directory; None: byte-level
    context: int
    state: dict[str, torch.Tensor]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a --save-dir step directory, or a --checkpoint file")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="context in tokens (default: the training context)")  # fmt: skip
    p.add_argument("--model", help="a weights file's model (a step directory records it)")
    p.add_argument("--model-args", metavar="K=V,...")
    p.add_argument("--model-config", metavar="FILE|DIR", help="a transformers model's config")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the tokenizer it was trained with (a step directory records it; "
                        "default: byte-level)")  # fmt: skip
    return p


def source(args: argparse.Namespace) -> Source:
    """The model's description and weights, from a step directory or a weights file."""
    path = args.checkpoint
    if os.path.isdir(path):
        info = ckpt.read_info(path)
        if info.get("input_shape") is None or len(info["input_shape"]) != 1:
            raise ConfigError(
                "CHECKPOINT", path, f"its model takes {info.get('input_shape')}, not token ids"
            )
        return Source(
            model=args.model or info["model"],
            args=parse_model_args(args.model_args or info.get("model_args")),
            output=info.get("model_output"),
            vocab=int(info["num_classes"]),
            tokenizer=args.tokenizer or info.get("tokenizer"),
            context=int(info["input_shape"][0]),
            state=ckpt.weights(path),
        )
    if not os.path.isfile(path):
        raise ConfigError("CHECKPOINT", path, "no such step directory or weights file")
    if not args.model:
        raise ConfigError("CHECKPOINT", path, "a weights file needs --model (and --model-args)")
    return Source(
        model=args.model,
        args=parse_model_args(args.model_args),
        output=None,
        vocab=tokenizer.load(args.tokenizer).vocab,
        tokenizer=args.tokenizer,
        context=args.seq_len or 256,
        state=ckpt.load(path),
    )


def build(src: Source, context: int, config_file: str | None) -> nn.Module:
    from bundle import models

    model = models.build(
        src.model,
        num_classes=src.vocab,
        input_shape=(context,),
        args=src.args,
        config_file=config_file,
    )
    own = model.state_dict()
    missing = sorted(set(own) - set(src.state))
    if missing:
        raise ConfigError(
            "CHECKPOINT",
            src.model,
            f"it lacks {len(missing)} of the model's tensors ({missing[0]})",
        )
    model.load_state_dict({k: src.state[k] for k in own})
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
        if args.max_new_tokens < 0 or (args.top_k is not None and args.top_k < 1):
            raise ConfigError("--max-new-tokens/--top-k", argv, "must be >= 0 and >= 1")
        src = source(args)
        context = args.seq_len or src.context
        words = tokenizer.load(src.tokenizer)
        prompt = words.encode(args.prompt)
        if not prompt:
            raise ConfigError("--prompt", args.prompt, "give at least one character")
        model = build(src, context, args.model_config)
        tokens = sample(
            model,
            prompt,
            new_tokens=args.max_new_tokens,
            context=context,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            output=src.output,
        )
    except BundleError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(words.decode(tokens) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
