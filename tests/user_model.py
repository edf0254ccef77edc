"""A user's own model for `python -m hidup.train --model tests.user_model:make` (not in HiDup's
zoo): a factory of no arguments returning (module, inputs), where module(*batch) is the loss and
inputs(batch_size, generator) the global batch. `flipped` uses an op HiDup has no rule of its own
for (aten.flip: DTensor's strategy covers it); `not_a_pair` returns something else than (module, inputs)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 40, 6


class CharMLP(nn.Module):
    """Embedding, a pre-norm GELU block with a residual, a head, cross-entropy."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, hidden: int = 48):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class Flipped(CharMLP):
    def forward(self, tokens, targets):
        h = self.emb(tokens).flip(1)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def inputs(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
            torch.randint(0, VOCAB, (batch, SEQ), generator=generator))


def make():
    return CharMLP(), inputs


def flipped():
    return Flipped(), inputs


def not_a_pair():
    return CharMLP()
