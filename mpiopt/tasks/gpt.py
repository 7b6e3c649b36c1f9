"""A small decoder-only transformer (GPT-2 style, tied head) for byte-level language modelling.

Seeded by ``torch.manual_seed``.  Architecture, initialisation and parameter count: docs/internals-tasks.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels._backend import check_count

__all__ = ["GPT", "GPT_DEFAULTS", "gpt_parameter_count"]

#: ``--model gpt``'s default sizes: a CPU smoke run of a minute (445,952 parameters).
GPT_DEFAULTS = {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 128}


def gpt_parameter_count(vocab_size: int, n_layer: int, n_embd: int, block_size: int) -> int:
    """The parameter count of :class:`GPT` with these sizes (the tied head counted once)."""
    return vocab_size * n_embd + block_size * n_embd + n_layer * (12 * n_embd * n_embd + 13 * n_embd) + 2 * n_embd


class _Block(nn.Module):
    """One pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(batch, length, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.resid_dropout(self.attn_proj(y.transpose(1, 2).reshape(batch, length, channels)))
        return x + self.resid_dropout(self.mlp_proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """Maps int64 tokens ``(B, T)``, ``T <= block_size``, to logits ``(B, T, vocab_size)`` of the next token."""

    def __init__(self, vocab_size: int, n_layer: int, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        vocab_size = check_count("vocab_size", vocab_size, 2)
        n_layer, n_embd, n_head = (check_count(k, v, 1) for k, v in (("n_layer", n_layer), ("n_embd", n_embd), ("n_head", n_head)))
        self.block_size = check_count("block_size", block_size, 1)
        if n_embd % n_head:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={n_embd}, n_head={n_head}")
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(self.block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied: one tensor, counted once by parameters()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2: the projections into the residual stream scaled by 1/sqrt(2 n_layer) (two per block).
        for block in self.blocks:
            for proj in (block.attn_proj, block.mlp_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence of {length} tokens is longer than block_size {self.block_size}")
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
