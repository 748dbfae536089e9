"""Models: plain `nn.Module`s, nothing distributed in them."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CharGPT", "MLP"]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, width: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, n_heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small decoder-only transformer over bytes (nanoGPT's shape, pre-norm, tied embeddings)."""

    def __init__(self, vocab_size: int, context: int, n_layers: int, n_heads: int, width: int, dropout: float = 0.0):
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6N plus attention), as in the PaLM/nanoGPT MFU estimate."""
        n = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        layers, width = len(self.blocks), self.tok_emb.weight.shape[1]
        return 6 * n + 12 * layers * width * self.context


class MLP(nn.Module):
    """Tabular classifier: Linear+ReLU layers, then a linear head."""

    def __init__(self, in_features: int, hidden_sizes: list[int], num_classes: int, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden_sizes:
            layers += [nn.Linear(width, h), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
