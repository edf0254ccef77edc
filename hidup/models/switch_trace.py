"""The model of the real V100 traces (shared/traces/README.md): six post-LN encoder layers,
layers 0, 2, 4 a standard nn.TransformerEncoderLayer (ReLU, dropout 0.1, batch_first), layers
1, 3, 5 the same block with a Switch (top-1) MoE feed-forward: experts = 4 x GPUs, bias-free
1024 -> 4096 -> 1024 ReLU MLPs, capacity floor(seq / experts x 1.25); loss = sum of the output."""
from __future__ import annotations

import math

import torch
from torch import nn

from hidup.models.moe import MoE, capacity


class SwitchBlock(nn.Module):
    """nn.TransformerEncoderLayer's post-LN layout with the feed-forward replaced by a MoE."""

    def __init__(self, dim, heads, hidden, experts, cap, dropout):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.moe = MoE(dim, hidden, experts, 1, cap)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        x = self.norm1(x + self.dropout1(self.self_attn(x, x, x, need_weights=False)[0]))
        y, _ = self.moe(x)
        return self.norm2(x + self.dropout2(y))


class SwitchTrace(nn.Module):
    def __init__(self, dim, heads, hidden, layers, seq, experts, dropout):
        super().__init__()
        cap = capacity(seq, experts, 1, rounding=math.floor)
        self.layers = nn.ModuleList(
            SwitchBlock(dim, heads, hidden, experts, cap, dropout) if i % 2 else
            nn.TransformerEncoderLayer(dim, heads, hidden, dropout, batch_first=True)
            for i in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def random_inputs(seq: int, dim: int):
    def inputs(batch, gen):
        return (torch.randn(batch, seq, dim, generator=gen),)
    return inputs
