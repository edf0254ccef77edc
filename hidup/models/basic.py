"""Small models for tests and examples: an MLP regressor and a GPT-style causal language model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn



class MLP(nn.Module):
    """Layers of Linear -> ReLU -> Linear with a residual; mean-squared-error loss."""

    def __init__(self, dim: int, hidden: int, layers: int):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(layers))

    def forward(self, x, target):
        for up, down in zip(self.up, self.down):
            x = x + down(F.relu(up(x)))
        return F.mse_loss(x, target)


class Block(nn.Module):
    """Pre-LN transformer block: causal multi-head attention (per-head views, so heads can be split)
    and a GELU feed-forward."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TransformerLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def lm_inputs(vocab: int, seq: int):
    def inputs(batch, gen):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return inputs


def regression_inputs(dim: int):
    def inputs(batch, gen):
        return torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)
    return inputs
