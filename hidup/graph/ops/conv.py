"""2-d convolution (e.g. a ViT patch embedding): split the batch, the output channels, or the input
channels (Partial output); the spatial dims stay whole (no halo exchange)."""
from __future__ import annotations

import torch

from hidup.graph.nodes import fill
from hidup.graph.ops.registry import default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten


@register(aten.conv2d.default)
def conv2d(node, ins):
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    bias = (R,) if len(ins) == 3 else ()
    opts = [ShardingOption((R, R) + bias, R)]
    if ins[0].shape[0] > 1:
        opts.append(ShardingOption((Shard(0), R) + bias, Shard(0)))
    if groups == 1:
        opts.append(ShardingOption((R, Shard(0)) + ((Shard(0),) if bias else ()), Shard(1)))
        opts.append(ShardingOption((Shard(1), Shard(1)) + bias, P))
    return opts


@register_local(aten.conv2d.default)
def conv_bias_once(node, option, ctx):
    """A Partial output gets the bias on one rank only."""
    if ctx.root or len(node.inputs) < 3:
        return default_local(node, option, ctx)
    rest = tuple(node.args[3:])
    return lambda t: aten.conv2d.default(t[0], t[1], None, *fill(rest, t))
