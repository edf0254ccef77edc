"""sum / mean over dims: a split reduced dim gives Partial sums; a mean divides by the global count."""
from __future__ import annotations

import math

import torch

from hidup.graph.ops.registry import register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten
REDUCTIONS = [aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default]


def _reduced(node, ndim: int) -> tuple[list[int], bool]:
    if node.op.endswith(".default") or len(node.args) < 2 or node.args[1] in (None, []):
        return list(range(ndim)), False
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    return sorted(d % ndim for d in dims), keep


@register(REDUCTIONS)
def reduction(node, ins):
    shape = ins[0].shape
    dims, keep = _reduced(node, len(shape))
    opts = [ShardingOption((R,), R), ShardingOption((P,), P)]
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        out = P if d in dims else Shard(d if keep else d - sum(r < d for r in dims))
        opts.append(ShardingOption((Shard(d),), out))
    return opts


@register_local([aten.mean.dim, aten.mean.default])
def local_mean(node, option, ctx):
    """mean = local sum / global count: right whether the reduced dims are split or not."""
    dims, keep = _reduced(node, len(ctx.global_in[0]))
    count = math.prod(ctx.global_in[0][d] for d in dims)
    return lambda t: torch.sum(t[0], dims, keepdim=keep) / count
