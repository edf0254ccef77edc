"""Transformer layers for the zoo: attention written with per-head views (so heads can be split),
post-LN encoder layers (BERT, ViT) whose feed-forward may be a mixture of experts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hidup.models.moe import MoE


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False):
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(a.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, activation=F.gelu):
        super().__init__()
        self.fc1, self.fc2, self.activation = nn.Linear(dim, hidden), nn.Linear(hidden, dim), activation

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x))), None


class EncoderLayer(nn.Module):
    """Post-LN encoder layer; `ffn` is a FeedForward or a MoE (both return (output, aux loss))."""

    def __init__(self, dim: int, heads: int, ffn: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.attn = Attention(dim, heads, dropout)
        self.ffn = ffn
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = self.ln1(x + self.drop(self.attn(x)))
        y, aux = self.ffn(x)
        return self.ln2(x + self.drop(y)), aux


def moe_stack(dim, heads, hidden, layers, experts, top_k, capacity, dropout, aux_weight,
              activation=F.gelu) -> nn.ModuleList:
    """Layers alternating a standard encoder layer and one whose feed-forward is a MoE."""
    return nn.ModuleList(
        EncoderLayer(dim, heads, MoE(dim, hidden, experts, top_k, capacity, aux_weight)
                     if i % 2 else FeedForward(dim, hidden, activation), dropout)
        for i in range(layers))


def run_stack(layers: nn.ModuleList, x):
    """Apply the layers; return the output and the summed auxiliary (load-balancing) loss."""
    aux_total = None
    for layer in layers:
        x, aux = layer(x)
        if aux is not None:
            aux_total = aux if aux_total is None else aux_total + aux
    return x, aux_total


def sinusoidal(seq: int, dim: int) -> torch.Tensor:
    pos = torch.arange(seq, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(seq, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe
