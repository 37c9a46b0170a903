"""A GPT-style decoder language model (nanoGPT-sized): token and position embeddings, pre-norm
causal self-attention blocks, a final LayerNorm and a linear head over the vocabulary.

Input: token ids ``(batch, seq_len)``; output: logits ``(batch, seq_len, vocab)``. Every block
maps one ``(batch, seq_len, width)`` tensor to one, so any block boundary is a split point
(``layers.3``). The input and output embeddings are separate weights (not tied), so no parameter
is shared between stages. Dropout defaults to 0 (exact gradients against one process).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bundle.models.small import Chain


class Embed(nn.Module):
    """Token ids -> token embedding + position embedding."""

    def __init__(self, vocab: int, seq_len: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(pos))


class Attention(nn.Module):
    """Multi-head causal self-attention (PyTorch's fused scaled-dot-product kernel)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The head count is read from the tensors, not from self.heads: under tensor parallelism
        # (models.tp) qkv holds this rank's heads only, its output q|k|v of them.
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    """x + attn(ln(x)), then + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(Chain):
    """embed -> layers.0 .. layers.N-1 -> ln_f -> head."""

    input_dtype = torch.long

    def __init__(
        self,
        *,
        vocab: int = 256,
        seq_len: int = 64,
        layers: int = 4,
        width: int = 128,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.embed = Embed(vocab, seq_len, width, dropout)
        self.layers = nn.ModuleList(DecoderBlock(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.block_names = ("embed", *(f"layers.{i}" for i in range(layers)), "ln_f", "head")
        self.apply(_init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * layers) ** 0.5)


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
