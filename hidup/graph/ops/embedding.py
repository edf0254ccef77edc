"""Embedding lookup: split the indices (batch, sequence), the hidden dim, or the vocabulary."""
from __future__ import annotations

import torch

from hidup.graph.ops.registry import arg, default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding(node, ins):
    weight, idx = ins[0].shape, ins[1].shape
    opts = [ShardingOption((R, R), R)]
    opts += [ShardingOption((R, Shard(d)), Shard(d)) for d in range(len(idx)) if idx[d] > 1]
    opts.append(ShardingOption((Shard(1), R), Shard(len(idx))))  # hidden dim
    if weight[0] > 1 and not arg(node, 3, "scale_grad_by_freq", False):
        # vocabulary: rows outside the shard give 0 (not where a row's gradient is scaled by
        # how often the whole batch reads it)
        opts.append(ShardingOption((Shard(0), R), P))
    return opts


@register_local(aten.embedding.default)
def local_embedding(node, option, ctx):
    if option.inputs[0] != Shard(0):
        return default_local(node, option, ctx)
    rows = ctx.in_shapes[0][0]
    start = ctx.rank * rows
    padding = arg(node, 2, "padding_idx", -1)  # the row whose gradient stays zero: this rank's
    padding = padding - start if start <= padding < start + rows else -1  # if in its shard

    def run(t):
        weight, idx = t
        local = idx - start
        inside = (local >= 0) & (local < rows)
        out = aten.embedding.default(weight, torch.where(inside, local, 0), padding)
        return out * inside.unsqueeze(-1).to(out.dtype)

    return run
