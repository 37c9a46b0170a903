"""A Hugging Face decoder-only causal LM cut at its own modules (``blocks``): the token
embedding, each decoder layer, the final norm and the output head, for a pipeline whose stages
split their layers over a tensor-parallel group.

Why not its graph: ``torch.export`` computes a layer's linears inline (``aten.linear`` on a
weight), so a stage cut from the captured graph holds no ``nn.Linear`` that ``models.tp`` could
split. Cut at module boundaries, a stage holds the model's own attention and MLP modules under
their own names (``model.layers.0.self_attn.q_proj.weight``), and they split as at one stage.

The blocks are named as ``gpt``'s (a ``Chain``) are, by module path: ``model.embed_tokens``,
``model.layers.0`` .. ``model.layers.N-1``, ``model.norm``, ``lm_head``, so every parameter keeps
the model's full name (checkpoints, ``--pretrained``'s reads by name, ``export --hf``, the TP
specs). What the base model's forward computes once between its layers, each layer's block
computes from the hidden states it receives, as the forward does: positions ``0..seq-1``, the
rotary table by the model's own ``rotary_emb``, and the mask by transformers' own
``create_causal_mask`` (or ``create_sliding_window_causal_mask`` where the family's forward picks
it for that layer) for the model's attention implementation. Eager attention given no mask is
not causal, so the mask is always the one the forward would pass.

The chain equals the forward only where the forward is exactly embed -> layers -> norm -> head
with those masks and nothing else, so it is taken by exact class (``FAMILIES``: Llama, Mistral,
Qwen2, Qwen3; a subclass may change the forward). Any other model (Gemma scales its embeddings,
Gemma 2 caps its logits, ...) keeps the graph cut, where tensor parallelism refuses it
(``bundle.engine.tensor_parallel.check``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from bundle.models.small import Block

# The attention kind of layer ``i`` as the family's base-model forward picks its mask.
Kind = Callable[[Any, int], str]


def _full(config: Any, i: int) -> str:
    return "full_attention"


def _window_if_set(config: Any, i: int) -> str:
    """Mistral: every layer slides when the config has a window."""
    return "full_attention" if config.sliding_window is None else "sliding_attention"


def _by_layer_types(config: Any, i: int) -> str:
    """Qwen2/3: each layer's own kind (``config.layer_types``; 4.56 reads it from the layer,
    which took it from there)."""
    return str(config.layer_types[i])


# transformers module name -> (causal LM class, base model class, its layers' attention kind)
FAMILIES: dict[str, tuple[str, str, Kind]] = {
    "llama": ("LlamaForCausalLM", "LlamaModel", _full),
    "mistral": ("MistralForCausalLM", "MistralModel", _window_if_set),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model", _by_layer_types),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model", _by_layer_types),
}


def names() -> str:
    """The causal LM classes cut here, for a message."""
    return ", ".join(cls for cls, _, _ in FAMILIES.values())


def family(model: nn.Module) -> Kind | None:
    """The attention-kind rule of ``model``'s family when it is exactly one of ``FAMILIES``'
    classes with their base model at ``model.model``; None for any other model."""
    for key, (cls, base_cls, kind) in FAMILIES.items():
        module = f"transformers.models.{key}.modeling_{key}"
        base = getattr(model, "model", None)
        if (
            type(model).__name__ == cls
            and type(model).__module__ == module
            and type(base).__name__ == base_cls
            and type(base).__module__ == module
        ):
            return kind
    return None


def blocks(model: nn.Module, output: str | None = None) -> list[Block] | None:
    """``model`` as its own modules in order (module docstring); None when it is not one of
    ``FAMILIES`` or the loss takes another of its outputs than the logits (``--model-output``)."""
    kind = family(model)
    if kind is None or output not in (None, "logits"):
        return None
    base: Any = model.model
    config = base.config
    kinds = [kind(config, i) for i in range(min(len(base.layers), config.num_hidden_layers))]
    if any(k not in _MASKS for k in kinds):
        return None  # a kind of attention whose mask is not one of the two
    chain: list[Block] = [("model.embed_tokens", base.embed_tokens)]
    made: dict[
        tuple, tuple[torch.Tensor, Any, Any]
    ] = {}  # what the layers are given, made once per input shape for all of them
    for i, k in enumerate(kinds):
        chain.append((f"model.layers.{i}", DecoderLayer(base, i, _MASKS[k], made)))
    return [*chain, ("model.norm", base.norm), ("lm_head", model.lm_head)]


def starts(points: Sequence[str]) -> tuple[str, ...]:
    """``--partition`` points written for the graph cut, in the module cut's names: the graph
    cut's own ``model.rotary_emb`` block (the planner may begin a stage there, where only the
    hidden states cross) lies just before ``model.layers.0``."""
    return tuple("model.layers.0" if p == "model.rotary_emb" else p for p in points)


def _mask_function(name: str) -> Callable[..., Any]:
    from transformers import masking_utils

    return getattr(masking_utils, name)


_KEPT = 8  # input shapes whose positions, mask and rotary table the layers keep at once
_MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}


class DecoderLayer(nn.Module):
    """Decoder layer ``i`` of a base model as a block: hidden states in, hidden states out, with
    the positions, rotary table and mask the base model's forward gives it. Its children mirror
    the model's paths (``model.layers.i``, ``model.rotary_emb``), so its parameters carry their
    full names (``named_fully``) and ``.to()`` moves the rotary table with the layer.

    The positions, rotary table and mask depend only on the input's shape, dtype and device (and
    the layer's kind of mask): the model's layers share what the first of them made (``made``),
    as the base model's forward makes them once for all its layers."""

    named_fully = True
    # The same modules, for the forward (held in ``__dict__``: registered once, as children).
    _layer: Callable[..., torch.Tensor]
    _rotary: nn.Module
    _config: Any
    _made: dict[tuple, tuple[torch.Tensor, Any, Any]]

    def __init__(
        self, base: nn.Module, i: int, mask: str, made: dict[tuple, Any] | None = None
    ) -> None:
        super().__init__()
        layers: Any = base.layers
        parts: Mapping[str, nn.Module] = {
            f"model.layers.{i}": layers[i],
            "model.rotary_emb": base.rotary_emb,  # type: ignore[dict-item]
        }
        for path, module in parts.items():
            *heads, leaf = path.split(".")
            node: nn.Module = self
            for head in heads:
                if head not in node._modules:
                    node.add_module(head, nn.Module())
                node = node._modules[head]  # type: ignore[assignment]
            node.add_module(leaf, module)
        self.__dict__.update(
            _layer=layers[i],
            _rotary=base.rotary_emb,
            _config=base.config,
            _made={} if made is None else made,
        )
        self.mask_name = mask
        create = _mask_function(mask)
        # The mask's arguments by the installed release's names (4.56: input_embeds,
        # cache_position, past_key_values; 5.x: inputs_embeds, cache).
        self._mask_args = tuple(inspect.signature(create).parameters)

    def _mask(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        args = self._mask_args
        kwargs: dict[str, Any] = {
            "config": self._config,
            "inputs_embeds" if "inputs_embeds" in args else "input_embeds": hidden,
            "attention_mask": None,
            "position_ids": positions,
        }
        if "cache_position" in args:
            kwargs["cache_position"] = positions[0]
        kwargs.update({name: None for name in ("cache", "past_key_values") if name in args})
        return _mask_function(self.mask_name)(**kwargs)

    def _rotary_table(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        if not hidden.is_meta:
            return self._rotary(hidden, positions)
        # On the meta device, the table is made where the rotary's own buffer is, then moved:
        # 4.56's forward turns autocast off for the input's device, which meta has not.
        at = next(self._rotary.buffers(), hidden).device
        x = torch.empty(0, dtype=hidden.dtype, device=at)  # read for its device and dtype only
        here = torch.arange(positions.shape[1], device=at).unsqueeze(0)
        return tuple(t.to(hidden.device) for t in self._rotary(x, here))

    def _given(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """(positions, mask, rotary table) for ``hidden``: made once per shape, dtype, device and
        kind of mask (on the meta device, made each time and kept nowhere)."""
        key = (self.mask_name, tuple(hidden.shape[:2]), hidden.dtype, hidden.device)
        found = None if hidden.is_meta else self._made.get(key)
        if found is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            # On the meta device (a boundary's shape found before a stage holds memory) the
            # mask, which reads the positions' values, is left out: it changes no shape.
            mask = None if hidden.is_meta else self._mask(hidden, positions)
            found = (positions, mask, self._rotary_table(hidden, positions))
            if not hidden.is_meta:
                if len(self._made) >= _KEPT:
                    self._made.clear()
                self._made[key] = found
        return found

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions, mask, table = self._given(hidden)
        return self._layer(
            hidden, attention_mask=mask, position_ids=positions, position_embeddings=table
        )
