"""Tensor parallelism (Megatron-LM's) on a model's own modules, with plain tensors.

A plan maps module-name patterns (``*`` one path segment, as transformers writes them:
``layers.*.self_attn.q_proj``) to a style. ``apply`` turns every planned ``nn.Linear`` into its
tensor-parallel self in place: it keeps its name, its class name and ``isinstance`` (its class
becomes a subclass of itself, as ``models.lora`` does), and its parameters keep their names as
ordinary ``nn.Parameter`` holding this rank's shard, so the optimizer, the gradient sync and the
checkpoints see ordinary tensors; ``ShardSpec`` says how each was cut. No DTensor.

Megatron's two conjugate functions carry the communication (``models.tp_layers``: what each
style computes; ``all_reduce`` sums in place over the tensor-parallel group, the engine injects
it)::

    colwise   y_r = x @ W_r.T + b_r          f = copy_to_tp:   forward identity,   backward sum
    rowwise   y   = g(x_r @ W_r.T) + b       g = reduce_from_tp: forward sum,      backward identity

    x ──f──> [q|k|v, up: colwise] ──> per-head / per-feature work ──> [o, down: rowwise] ──g──> y

A LoRA-adapted layer (``models.lora``) is split with its adapters: a colwise layer's
``lora_B`` as its weight (packed blocks too) and its ``lora_A`` whole (its gradient summed); a
rowwise layer's ``lora_A`` as its weight and its ``lora_B`` whole. Their specs are listed with
the weights', so checkpoints and PEFT's export see whole adapters.

``packed_colwise`` is colwise over a fused layer of ``parts`` equal blocks (q|k|v: 3, gate|up:
2): each block is split, and this rank's weight is its blocks' shards in order, so
``chunk(parts)`` of its output gives its q, k, v. ``replicate`` leaves a module whole on every
rank; ``replicate_grad_sum`` too, for a module whose input holds this rank's heads only (a
per-head norm): its parameters' gradients are partial on each rank and are summed (f applied to
them), so every rank keeps the same whole gradient.

The model's own plan (``plan_of``): Bundle's GPT's, or a transformers model's (its ``tp_plan``,
resolved by transformers from ``config.base_model_tp_plan``), its styles mapped to these.
Attention reads its head count from the tensors (GPT's ``view(b, t, -1, head_dim)``,
transformers' ``(*input_shape, -1, head_dim)``), so nothing else changes.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
from torch import Tensor

from bundle.models import lora
from bundle.models.gpt import GPT, Attention
from bundle.models.tp_layers import AllReduce as AllReduce
from bundle.models.tp_layers import copy_to_tp as copy_to_tp
from bundle.models.tp_layers import reduce_from_tp as reduce_from_tp
from bundle.models.tp_layers import tp_class

STYLES = ("colwise", "rowwise", "packed_colwise", "replicate", "replicate_grad_sum")
_SPLIT = ("colwise", "rowwise", "packed_colwise")
_NO_PLAN = (
    "give the model a tp_plan attribute (module-name patterns -> colwise, rowwise, "
    "packed_colwise or replicate; docs/tensor-parallel.md)"
)


class TPError(ValueError):
    """A plan or a degree that tensor parallelism cannot take, in one line for a user."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tensor-parallel group: along ``dim``, the tensor
    being ``parts`` equal blocks there (a fused q|k|v: 3), each block split in rank order."""

    dim: int
    parts: int = 1

    def local(self, full: Tensor, rank: int, size: int) -> Tensor:
        """This rank's shard of ``full``: a contiguous copy."""
        n = full.shape[self.dim]
        if n % (self.parts * size):
            raise TPError(
                f"a dimension of {n} is not {self.parts} block(s) split {size} ways (dim {self.dim})"
            )
        block, piece = n // self.parts, n // (self.parts * size)
        shards = [full.narrow(self.dim, p * block + rank * piece, piece) for p in range(self.parts)]
        return torch.cat(shards, self.dim).contiguous()

    def full(self, shards: Sequence[Tensor]) -> Tensor:
        """The whole tensor from every rank's shard, given in rank order."""
        blocks = [s.chunk(self.parts, self.dim) for s in shards]
        whole = [torch.cat([b[p] for b in blocks], self.dim) for p in range(self.parts)]
        return torch.cat(whole, self.dim)


# -- plans -------------------------------------------------------------------------------------

# transformers' styles (transformers.distributed.tensor_parallel, 5.x) whose module is left
# whole here: its output (gathered or replicated there) equals the whole module's; a parent's
# ``all_reduce`` sums what its rowwise children already sum here.
_HF_WHOLE = frozenset({
    "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
    "embedding_rowwise", "embedding_colwise", "sequence_parallel", "gather", "all_reduce",
    "replicate",
})  # fmt: skip
_HF_RENAMED = {"replicated_with_grad_allreduce": "replicate_grad_sum"}
_EXPERTS = frozenset({"grouped_gemm", "packed_rowwise", "ep_router", "ep_dispatch_experts"})
_GPT_PLAN = {
    "layers.*.attn.qkv": "packed_colwise",
    "layers.*.attn.proj": "rowwise",
    "layers.*.mlp.0": "colwise",
    "layers.*.mlp.2": "rowwise",
}


def style_of(pattern: str, style: str) -> str:
    """``style`` as one of ``STYLES`` (transformers' names mapped), or a TPError naming
    ``pattern``: experts are not split yet, nor MLA's key/value projection."""
    if style in STYLES:
        return style
    if style in _HF_WHOLE:
        return "replicate"
    if style in _HF_RENAMED:
        return _HF_RENAMED[style]
    if style in _EXPERTS or style.startswith(("moe_", "local", "ep_")):
        raise TPError(
            f"{pattern}: style {style!r} shards mixture-of-experts layers, which "
            "--tensor-parallel does not split yet"
        )
    if style == "mla_kv_a_proj":
        raise TPError(f"{pattern}: style {style!r} (MLA attention) is not supported yet")
    raise TPError(f"{pattern}: style {style!r} is not one of {', '.join(STYLES)}")


def _own_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan as written: GPT's, or transformers' (the model's ``tp_plan``, which
    transformers resolves from ``config.base_model_tp_plan`` with the base model's prefix)."""
    if isinstance(model, GPT):
        return dict(_GPT_PLAN)
    resolved = getattr(model, "tp_plan", None)
    if isinstance(resolved, Mapping) and resolved:
        return dict(resolved)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not isinstance(base, Mapping) or not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def plan_of(model: nn.Module, given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The plan to apply: ``given`` (a user's) where there is one, else the model's own;
    pattern -> one of ``STYLES``. A model with neither is a TPError."""
    raw = dict(given) if given else _own_plan(model)
    plan = {pattern: style_of(pattern, style) for pattern, style in raw.items()}
    if not any(s != "replicate" for s in plan.values()) and not given:
        raise TPError(f"{type(model).__name__} has no tensor-parallel plan: {_NO_PLAN}")
    return plan


def _matches(name: str, pattern: str) -> bool:
    """Whether ``pattern``'s segments are ``name``'s last ones (``*``: any one segment)."""
    got, want = name.split("."), pattern.split(".")
    if len(want) > len(got):
        return False
    return all(w in ("*", g) for w, g in zip(want, got[len(got) - len(want) :], strict=True))


def _nearest(names: Sequence[str], pattern: str) -> str:
    """The module names nearest ``pattern``, as patterns of as many segments (numbers as ``*``)."""
    depth = pattern.count(".") + 1
    tails = set()
    for n in names:
        segments = ["*" if s.isdigit() else s for s in n.split(".")]
        tails.add(".".join(segments[-depth:]))
    near = difflib.get_close_matches(pattern, sorted(tails), n=3, cutoff=0.5)
    return ", ".join(near) if near else "none"


def resolve(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """Every module ``plan`` names: name -> (module, style), each checked to take its style."""
    named = {n: m for n, m in model.named_modules() if n}
    chosen: dict[str, tuple[nn.Module, str]] = {}
    for pattern, given in plan.items():
        style = style_of(pattern, given)
        hits = [n for n in named if _matches(n, pattern)]
        if not hits:
            raise TPError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"nearest names: {_nearest(list(named), pattern)}"
            )
        for n in hits:
            if n in chosen and chosen[n][1] != style:
                raise TPError(f"{n} is planned both {chosen[n][1]} and {style}")
            chosen[n] = (named[n], style)
    for n, (m, style) in chosen.items():
        if lora.is_adapted(m) and style == "replicate_grad_sum":
            raise TPError(f"{n} is LoRA-adapted: {style} does not sum its adapters' gradients")
        if style in _SPLIT and not isinstance(m, nn.Linear):
            raise TPError(f"{n} is a {type(m).__name__}: {style} splits nn.Linear layers only")
    return chosen


# -- checks ------------------------------------------------------------------------------------


def _parts(name: str) -> int:
    """A packed layer's blocks: 3 for a fused q|k|v (by its name), else 2 (gate|up)."""
    tail = name.rpartition(".")[2].lower()
    return 3 if "qkv" in tail or tail in ("c_attn", "query_key_value") else 2


def _head_counts(
    model: nn.Module, chosen: Mapping[str, tuple[nn.Module, str]]
) -> list[tuple[str, int, str]]:
    """(what, count, of whom) of every head count a split attention layer divides: GPT's
    ``Attention.heads``; a transformers config's query and key/value heads."""
    split = [n for n, (_, s) in chosen.items() if s in _SPLIT]
    named = dict(model.named_modules())
    found = []
    for n, m in named.items():
        if isinstance(m, Attention) and any(s.startswith(f"{n}.") for s in split):
            found.append(("heads", m.heads, n))
    config = getattr(model, "config", None)
    parents = {type(named[n.rpartition(".")[0]]).__name__ for n in split}
    if config is not None and any("Attention" in p for p in parents):
        get_text = getattr(config, "get_text_config", None)
        text = get_text() if callable(get_text) else config
        for key in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(text, key, None)
            if isinstance(count, int):
                found.append((key, count, type(model).__name__))
    return found


def _split_size(name: str, m: nn.Module, style: str) -> tuple[str, int]:
    """(what, size) of the dimension ``style`` splits in layer ``name``."""
    linear = cast(nn.Linear, m)
    if style == "rowwise":
        return "in_features", linear.in_features
    if style == "colwise":
        return "out_features", linear.out_features
    parts = _parts(name)
    if linear.out_features % parts:
        raise TPError(
            f"{name}: out_features {linear.out_features} is not {parts} equal blocks "
            "(packed_colwise)"
        )
    return f"out_features per block of {parts}", linear.out_features // parts


def _tied(model: nn.Module, chosen: Mapping[str, tuple[nn.Module, str]]) -> None:
    """A split layer's weight shared with another module (tied embeddings) is refused."""
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for n, (m, style) in chosen.items():
        names = owners.get(id(m.weight), []) if style in _SPLIT else []
        others = [o for o in names if o != f"{n}.weight"]
        if others:
            raise TPError(f"{n}.weight is tied to {others[0]}: a tied weight cannot be split")


def check(model: nn.Module, plan: Mapping[str, str], degree: int) -> None:
    """Refuse, before anything is changed, a plan ``model`` cannot take at ``degree`` ranks: a
    pattern that matches nothing, a style that is not one, a head count or a split dimension
    that ``degree`` does not divide, a tied layer to split, an adapted layer whose gradients
    would be summed whole (``replicate_grad_sum``)."""
    if degree < 1:
        raise TPError(f"--tensor-parallel must be a positive integer, not {degree}")
    chosen = resolve(model, plan)
    _tied(model, chosen)
    for what, count, whom in _head_counts(model, chosen):
        if count % degree:
            raise TPError(f"--tensor-parallel {degree} does not divide {what} {count} of {whom}")
    for name, (m, style) in chosen.items():
        if style in _SPLIT:
            what, size = _split_size(name, m, style)
            if size % degree:
                raise TPError(
                    f"--tensor-parallel {degree} does not divide {what} {size} of {name} ({style})"
                )


# -- apply -------------------------------------------------------------------------------------


def _shard(m: nn.Linear, name: str, style: str, rank: int, size: int) -> dict[str, ShardSpec]:
    """Cut ``m``'s parameters to this rank's shards in place; their specs by full name."""
    parts = _parts(name) if style == "packed_colwise" else 1
    weight = ShardSpec(1 if style == "rowwise" else 0, parts)
    specs = {f"{name}.weight": weight}
    m.weight = nn.Parameter(
        weight.local(m.weight.detach(), rank, size), requires_grad=m.weight.requires_grad
    )
    if m.bias is not None and style != "rowwise":  # a rowwise bias is added once, whole
        bias = ShardSpec(0, parts)
        m.bias = nn.Parameter(
            bias.local(m.bias.detach(), rank, size), requires_grad=m.bias.requires_grad
        )
        specs[f"{name}.bias"] = bias
    m.out_features, m.in_features = m.weight.shape[0], m.weight.shape[1]
    if lora.is_adapted(m):
        # The adapter on the split side is cut as the weight: B's rows (colwise), A's columns.
        part = "lora_A" if style == "rowwise" else "lora_B"
        adapter = cast(nn.Linear, getattr(m, part))
        adapter.weight = nn.Parameter(
            weight.local(adapter.weight.detach(), rank, size),
            requires_grad=adapter.weight.requires_grad,
        )
        adapter.out_features, adapter.in_features = adapter.weight.shape
        specs[f"{name}.{part}.weight"] = weight
    return specs


def apply(
    model: nn.Module,
    plan: Mapping[str, str],
    *,
    rank: int,
    size: int,
    all_reduce: AllReduce,
) -> dict[str, ShardSpec]:
    """Make ``model`` tensor-parallel in place, as rank ``rank`` of ``size``: every planned
    layer takes its style. ``all_reduce(t)`` sums ``t`` in place over the group. Returns the
    spec of every split parameter by full name (replicated ones are not listed); ``size`` 1
    changes nothing."""
    if size == 1:
        return {}
    if not 0 <= rank < size:
        raise TPError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
    check(model, plan, size)
    specs: dict[str, ShardSpec] = {}
    for name, (m, style) in resolve(model, plan).items():
        if style == "replicate":
            continue
        if style in _SPLIT:
            specs.update(_shard(cast(nn.Linear, m), name, style, rank, size))
        m.__class__ = tp_class(m, style)
        m.tp_all_reduce = all_reduce  # type: ignore[assignment]
    return specs
