"""Models as users bring them (``--model tests.support.user_models:NAME``): an ``nn.Sequential``,
a module whose skip connection and integer side input cross stage boundaries, and torchvision
models of three structures at a small size. Batch statistics would make a replica's gradient
depend on its rows, so the torchvision ones normalise per sample (GroupNorm for BatchNorm), and
dropout is off: their gradients must equal one process's exactly."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torchvision


def sequential(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(1),
        nn.Linear(math.prod(input_shape), 32),
        nn.ReLU(),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, num_classes),
    )


class SkipNet(nn.Module):
    """stem -> body.0 .. body.2 -> head(h + skip) * scale[bucket]: ``skip`` (float) and
    ``bucket`` (int64, no gradient) are made in the stem and used only by the head."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        d = math.prod(input_shape)
        self.stem = nn.Linear(d, 24)
        self.skip = nn.Linear(d, 24)
        self.body = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(24, num_classes)
        self.scale = nn.Embedding(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        skip = self.skip(flat)
        bucket = (flat > 0).sum(1) % 4
        h = torch.relu(self.stem(flat))
        for layer in self.body:
            h = layer(h)
        return self.head(h + skip) * self.scale(bucket)


def skip_net(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return SkipNet(num_classes, input_shape)


def _group_norm(channels: int, *args, **kwargs) -> nn.Module:
    return nn.GroupNorm(1, channels)


def _per_sample_norms(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, child_name, nn.GroupNorm(1, child.num_features))
    return model


def mobilenet(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return torchvision.models.mobilenet_v3_small(
        num_classes=num_classes, norm_layer=_group_norm, dropout=0.0
    )


def densenet(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    model = torchvision.models.DenseNet(
        growth_rate=4, block_config=(2, 2), num_init_features=8, num_classes=num_classes
    )
    return _per_sample_norms(model)


def vit(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=input_shape[-1],
        patch_size=4,
        num_layers=3,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=num_classes,
    )


def not_a_model(num_classes: int, input_shape: tuple[int, ...]) -> object:
    return {"layers": 3}


class _TwoInputs(nn.Module):
    def __init__(self, d: int, num_classes: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, num_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.a(x.flatten(1)) + y


def two_inputs(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A forward that needs a second input: no data set gives it."""
    return _TwoInputs(math.prod(input_shape), num_classes)


def tied(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The same Linear twice, far apart: a cut between its uses would tie two stages."""
    return _Tied(math.prod(input_shape), num_classes)


class _Tied(nn.Module):
    def __init__(self, d: int, num_classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 16)
        self.shared = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.inp(x.flatten(1)))
        return self.out(self.shared(self.mid(h)))


def mean_squared_logits(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user loss: squared error against one-hot labels, the mean over the micro-batch's rows."""
    target = nn.functional.one_hot(labels, outputs.shape[-1]).float()
    return ((outputs - target) ** 2).sum(-1).mean()


class KeywordNet(nn.Module):
    """A forward taking keyword arguments (``**kwargs``, a defaulted flag) and returning a dict:
    the loss takes its ``logits``; ``hidden`` is returned too and not trained on."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        d = math.prod(input_shape)
        self.layers = nn.ModuleList([nn.Linear(d, 24), nn.Linear(24, 24), nn.Linear(24, 24)])
        self.head = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor, scale: float = 1.0, **kwargs) -> dict[str, torch.Tensor]:
        h = x.flatten(1) * scale
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return {"hidden": h, "logits": self.head(h)}


def keyword_net(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return KeywordNet(num_classes, input_shape)


def _tiny_hf(config_class, model_class, **fields):
    import transformers

    config = getattr(transformers, config_class)(**fields)
    return getattr(transformers, model_class)(config)


def gpt2(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A tiny GPT-2 with its token embedding tied to its output head, dropout off."""
    return _tiny_hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        n_layer=3,
        n_embd=16,
        n_head=2,
        vocab_size=num_classes,
        n_positions=input_shape[0],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )


def _tiny_llama(
    num_classes: int, seq_len: int, layers: int, heads: int, kv_heads: int, tied: bool = False
) -> nn.Module:
    return _tiny_hf(
        "LlamaConfig",
        "LlamaForCausalLM",
        num_hidden_layers=layers,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=num_classes,
        max_position_embeddings=seq_len,
        use_cache=False,
        tie_word_embeddings=tied,
    )


def llama_tp(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A tiny Llama whose heads, key/value heads and MLP split two ways (tensor parallelism)."""
    return _tiny_llama(num_classes, input_shape[0], layers=2, heads=4, kv_heads=2)


def llama_tp_tied(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``llama_tp`` with its token embedding tied to its output head."""
    return _tiny_llama(num_classes, input_shape[0], layers=2, heads=4, kv_heads=2, tied=True)


def llama(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A tiny Llama (rotary positions, grouped-query attention, RMSNorm, SwiGLU)."""
    return _tiny_llama(num_classes, input_shape[0], layers=3, heads=2, kv_heads=1)
