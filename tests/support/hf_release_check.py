"""Cut Hugging Face classes into stages under whichever ``transformers`` is importable, and check
each cut against the unsplit model: one JSON line per (class, shape).

    PYTHONPATH=.venv/transformers-4.56.2 python -m tests.support.hf_release_check [NAME ...]

Each class is built from a tiny config (random weights, nothing downloaded) through
``--model transformers:CLASS``'s own path and cut by ``cut_stages`` at the shapes 1, 1,1 and
1,1,1 as a job cuts it: the launch's checks capture the forward once, on the meta device, and
hand the capture on (``models.cut.capture_of``: graphs, and constants as tensors), which the
stages of the model with its weights are loaded from. Its chain of stages is compared with the
unsplit model: the output, then the gradient of one backward of every parameter, under its
full-model name. A case that fails says why in ``error``; the exit status is 1 if any did.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from bundle import models
from bundle.config import ModelConfig
from bundle.engine.stage import Stage
from bundle.engine.stages import cut_stages
from bundle.models.cut import Capture, capture_of, cut
from bundle.models.inputs import Batch, Inputs

SEQ, VOCAB, LABELS, ROWS = 8, 64, 4, 5
_DECODER = (
    "num_hidden_layers=2,hidden_size=16,intermediate_size=32,num_attention_heads=2,"
    "num_key_value_heads=1"
)
_ENCODER = (
    "num_hidden_layers=2,hidden_size=16,intermediate_size=32,num_attention_heads=2,"
    "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"
)
# class -> (--model-args, one sample's shape, classes)
CASES: dict[str, tuple[str, tuple[int, ...], int]] = {
    "GPT2LMHeadModel": (
        "n_layer=2,n_embd=16,n_head=2,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0,"
        "bos_token_id=0,eos_token_id=0",
        (SEQ,),
        VOCAB,
    ),
    "LlamaForCausalLM": (_DECODER, (SEQ,), VOCAB),
    "Qwen2ForCausalLM": (_DECODER, (SEQ,), VOCAB),
    "MistralForCausalLM": (_DECODER, (SEQ,), VOCAB),
    "Phi3ForCausalLM": (f"{_DECODER},pad_token_id=0", (SEQ,), VOCAB),
    "GemmaForCausalLM": (f"{_DECODER},head_dim=8", (SEQ,), VOCAB),
    "BertForSequenceClassification": (f"{_ENCODER},pad_token_id=0", (SEQ,), LABELS),
    "ViTForImageClassification": (f"{_ENCODER},patch_size=4", (3, 8, 8), LABELS),
}
WRAPPER = "wrapped GPT2LMHeadModel"  # a user's module holding a transformers model
# Classes fed several named inputs (models.inputs), padded rows masked: name -> (class, inputs).
MASKED = {
    "masked BertForSequenceClassification": (
        "BertForSequenceClassification",
        ("input_ids", "attention_mask", "token_type_ids"),
    ),
    "masked LlamaForCausalLM": ("LlamaForCausalLM", ("input_ids", "attention_mask")),
}
SHAPES = ("1", "1,1", "1,1,1")


class WrappedGPT2(nn.Module):
    """A one-line wrapper, as users write them: the ids in, the logits out (GPT-2's defaults
    otherwise: its cache on, which export lifts tensors for; dropout on, so it is compared in
    evaluation mode)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.hf = transformers.GPT2LMHeadModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x).logits


def _model(name: str) -> tuple[nn.Module, ModelConfig, tuple[int, ...]]:
    torch.manual_seed(0)
    if name == WRAPPER:
        return WrappedGPT2(), ModelConfig(name="wrapped-gpt2"), (SEQ,)
    args, shape, classes = CASES[MASKED[name][0] if name in MASKED else name]
    cfg = ModelConfig(name=f"transformers:{MASKED[name][0] if name in MASKED else name}", args=args)
    return models.build_model(cfg, classes, shape), cfg, shape


def _input(model: nn.Module, shape: tuple[int, ...], name: str) -> Batch:
    g = torch.Generator().manual_seed(1)
    if name in MASKED:  # rows padded to lengths 2 .. SEQ, a second token type from the middle
        keep = torch.arange(SEQ) < torch.randint(2, SEQ + 1, (ROWS, 1), generator=g)
        ids = torch.randint(1, LABELS, (ROWS, SEQ), generator=g) * keep
        types = (torch.arange(SEQ) >= SEQ // 2).long().expand(ROWS, -1) * keep
        given = {"input_ids": ids, "attention_mask": keep.long(), "token_type_ids": types}
        return {n: given[n] for n in MASKED[name][1]}
    if models.input_dtype(model) == torch.long:
        return torch.randint(0, LABELS, (ROWS, *shape), generator=g)
    return torch.randn(ROWS, *shape, generator=g)


def _inputs(x: Batch) -> Inputs | None:
    """The named inputs of a batch, its first row as the example (None: one tensor)."""
    return Inputs(tuple(x), tuple(v[0] for v in x.values())) if isinstance(x, dict) else None


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }


def _compare(
    model: nn.Module,
    stages: list[Stage],
    x: Batch,
    want: torch.Tensor,
    grads: dict[str, torch.Tensor],
) -> str:
    """'' if the chain of stages computes the model's output and gradients, else the difference."""
    model.zero_grad(set_to_none=True)
    h: tuple[torch.Tensor, ...] = tuple(x.values()) if isinstance(x, dict) else (x,)
    for stage in stages:
        h = stage(*h, side=x if isinstance(x, dict) else None)
    if h[0].shape != want.shape or not torch.allclose(h[0], want, atol=1e-5, rtol=1e-4):
        return f"output differs from the model's by {(h[0] - want).abs().max().item():.3g}"
    h[0].pow(2).mean().backward()
    named = {stage.full_name(n): p for stage in stages for n, p in stage.named_parameters()}
    held = {id(p) for p in named.values()}
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    if missing:
        return f"no stage holds {missing[:3]}"
    for n, p in named.items():
        if n not in grads:
            return f"the stages hold {n!r}, which the model has no gradient for"
        if p.grad is None or not torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-4):
            return f"the gradient of {n} differs from the model's"
    return ""


def check(name: str) -> list[dict[str, Any]]:
    """One result per shape for the class (or the wrapper) ``name``."""
    import transformers

    out: list[dict[str, Any]] = []
    try:
        model, cfg, shape = _model(name)
    except Exception as exc:  # noqa: BLE001 - reported per case
        return [_result(name, s, transformers.__version__, f"build: {exc}", 0.0) for s in SHAPES]
    x = _input(model, shape, name)
    inputs = _inputs(x)
    model.train(name != WRAPPER)  # the capture is made in training mode all the same
    model.zero_grad(set_to_none=True)
    want = models.forward(model, x, cfg.output)
    want.pow(2).mean().backward()
    grads = _grads(model)
    want = want.detach()
    capture: Capture | None = None
    for s in SHAPES:
        started = time.monotonic()
        n = len(s.split(","))
        try:
            if n > 1 and capture is None:
                capture = _launch_capture(name, cfg, n, shape, inputs)
            stages = cut_stages(model, cfg, n, shape, capture, inputs)
            for stage in stages:
                stage.train(model.training)
            error = _compare(model, stages, x, want, grads)
        except Exception as exc:  # noqa: BLE001 - reported per case
            text = str(exc).strip().splitlines()
            error = f"{type(exc).__name__}: {text[0] if text else ''}"
        out.append(_result(name, s, transformers.__version__, error, time.monotonic() - started))
    return out


def _launch_capture(
    name: str, cfg: ModelConfig, stages: int, shape: tuple[int, ...], inputs: Inputs | None
) -> Capture:
    """The capture the launch's checks make (bundle.preflight): of the model on the meta device."""
    with torch.device("meta"):
        meta, _, _ = _model(name)
        pieces = cut(meta, cfg, stages, shape, inputs=inputs)
        capture = capture_of(pieces, cfg, shape, inputs)
    if capture is None:
        raise RuntimeError("the capture made on the meta device cannot be handed on")
    return capture


def _result(name: str, shape: str, release: str, error: str, seconds: float) -> dict[str, Any]:
    return {
        "class": name,
        "shape": shape,
        "transformers": release,
        "ok": not error,
        "error": error,
        "seconds": round(seconds, 2),
    }


def main(argv: list[str], emit: Callable[[str], None] = print) -> int:
    torch.set_num_threads(1)
    names = argv or [*CASES, WRAPPER, *MASKED]
    failed = 0
    for name in names:
        for result in check(name):
            failed += not result["ok"]
            emit(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
