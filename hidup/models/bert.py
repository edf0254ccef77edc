"""BERT with mixture-of-experts layers (bert-sgmoe: top-2, bert-switch: top-1), masked language
modelling. A fixed number of tokens per sequence is masked, so the loss is a sum over masked tokens
divided by a count known from the shapes (shardable with no data-dependent denominator)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hidup.models.transformer import moe_stack, run_stack, sinusoidal

MASK_RATE = 0.15


def masked_per_sequence(seq: int) -> int:
    return max(1, round(seq * MASK_RATE))


class BertMoE(nn.Module):
    def __init__(self, vocab, dim, heads, hidden, layers, seq, experts, top_k, capacity,
                 dropout=0.0, aux_weight=0.0):
        super().__init__()
        self.vocab, self.n_masked = vocab, masked_per_sequence(seq)
        self.tok = nn.Embedding(vocab, dim)
        self.register_buffer("pe", sinusoidal(seq, dim))
        self.layers = moe_stack(dim, heads, hidden, layers, experts, top_k, capacity, dropout,
                                aux_weight)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets, weights):
        """tokens: (b, s) with masked positions replaced; targets: original tokens; weights: 1.0 at
        the masked positions, else 0.0."""
        x, aux = run_stack(self.layers, self.tok(tokens) + self.pe)
        logits = self.head(x).reshape(-1, self.vocab)
        ce = F.cross_entropy(logits, targets.reshape(-1), reduction="none")
        loss = (ce * weights.reshape(-1)).sum() / (tokens.shape[0] * self.n_masked)
        return loss if aux is None else loss + aux


def mask_tokens(tokens: torch.Tensor, mask_id: int, gen: torch.Generator):
    """(masked tokens, targets, weights): the same number of random positions in every sequence."""
    b, s = tokens.shape
    n = masked_per_sequence(s)
    pos = torch.rand(b, s, generator=gen).argsort(dim=1)[:, :n]
    weights = torch.zeros(b, s).scatter_(1, pos, 1.0)
    masked = torch.where(weights.bool(), torch.full_like(tokens, mask_id), tokens)
    return masked, tokens.clone(), weights


def random_inputs(vocab: int, seq: int):
    def inputs(batch, gen):
        tokens = torch.randint(1, vocab, (batch, seq), generator=gen)
        return mask_tokens(tokens, 0, gen)
    return inputs
