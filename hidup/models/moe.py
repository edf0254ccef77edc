"""Mixture of experts with capacity (GShard / Switch): top-k gating, dispatch and combine as the
four einsums `bsd,bsec->becd`, `edh,becd->bech`, `ehd,bech->becd`, `becd,bsec->bsd`.

A token's slot in its expert counts from 0 along the sequence; every one of the `capacity` slots
is usable; second choices are placed after all first choices of the sequence; tokens over
capacity are dropped (their expert output is zero; the residual carries them)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def capacity(seq: int, experts: int, top_k: int, factor: float = 1.25, rounding=math.ceil) -> int:
    """Slots per expert per sequence: seq / experts x factor, doubled for top-2."""
    return max(1, int(rounding(seq / experts * factor)) * top_k)


class MoE(nn.Module):
    """Replaces a feed-forward block: experts are ReLU MLPs (dim -> hidden -> dim) without biases.
    With aux_weight > 0 it also returns the load-balancing loss (Switch Transformer), a product of
    whole-batch means: it cannot be split into Duplex micro-batches, so it is off by default."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, capacity: int,
                 aux_weight: float = 0.0):
        super().__init__()
        self.experts, self.top_k, self.capacity, self.aux_weight = experts, top_k, capacity, aux_weight
        self.gate = nn.Parameter(torch.randn(dim, experts) * dim ** -0.5)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def routing(self, x):
        """(dispatch, combine) of shape (b, s, e, c), and the load-balancing loss."""
        probs = torch.softmax(torch.einsum("bsd,de->bse", x, self.gate), dim=-1)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        dispatch = combine = None
        taken = None  # first choices per expert in the sequence, shape (b, 1, e)
        for i in range(self.top_k):
            mask = F.one_hot(top_i[:, :, i], self.experts).to(x.dtype)  # (b, s, e)
            slot = torch.cumsum(mask, dim=1) - 1.0
            if taken is not None:
                slot = slot + taken
            taken = mask.sum(dim=1, keepdim=True) if taken is None else taken
            keep = mask * (slot < self.capacity).to(x.dtype)
            where = F.one_hot(torch.clamp((slot * mask).sum(dim=-1), 0, self.capacity - 1)
                              .to(torch.int64), self.capacity).to(x.dtype)  # (b, s, c)
            d = keep.unsqueeze(-1) * where.unsqueeze(2)  # (b, s, e, c)
            c = d * top_p[:, :, i].unsqueeze(-1).unsqueeze(-1)
            dispatch = d if dispatch is None else dispatch + d
            combine = c if combine is None else combine + c
        if not self.aux_weight:
            return dispatch, combine, None
        first = F.one_hot(top_i[:, :, 0], self.experts).to(x.dtype)
        aux = self.experts * (first.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()
        return dispatch, combine, aux * self.aux_weight

    def forward(self, x):
        dispatch, combine, aux = self.routing(x)
        expert_in = torch.einsum("bsd,bsec->becd", x, dispatch)
        h = F.relu(torch.einsum("edh,becd->bech", self.w1, expert_in))
        out = torch.einsum("ehd,bech->becd", self.w2, h)
        return torch.einsum("becd,bsec->bsd", out, combine), aux
