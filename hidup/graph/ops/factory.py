"""Factory ops and tensor constants (made whole on every rank, where the step runs) and casts that
change nothing but the dtype (the placement passes through)."""
from __future__ import annotations

import torch

from hidup.graph.ops.pointwise import pointwise_options
from hidup.graph.ops.registry import register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten

FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
             aten.ones.default, aten.full.default, aten.empty.memory_format,
             aten.scalar_tensor.default]
CASTS = [aten.to.dtype_layout, aten.to.device, aten.to.dtype, aten._to_copy.default,
         aten.lift_fresh_copy.default, aten.detach.default]


@register(FACTORIES)
def factory(node, ins):
    """No tensor input: the whole tensor on every rank (tensor inputs, if any, replicated)."""
    return [ShardingOption((R,) * len(ins), R)]


@register_local(FACTORIES)
def local_factory(node, option, ctx):
    kwargs = {**node.kwargs, "device": torch.device(ctx.device)}
    return lambda t: node.target(*node.args, **kwargs)


NEW = [aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
       aten.new_full.default]
FILLS = [aten.fill.Scalar, aten.fill.Tensor]


@register(NEW + FILLS)
def made_whole(node, ins):
    """A tensor made in the shape its arguments give (new_*) or filled with one value (fill,
    as an in-place write into a view becomes at capture): split along any dim, a rank making
    its own part; an input that spans the dim read split with it (no conversion), the rest
    whole. Never a Partial sum: each rank's part is the whole value there."""
    return pointwise_options(node.out.shape, [m.shape for m in ins])


@register(CASTS)
def cast(node, ins):
    """Any split passes through; a Partial sum too where both dtypes are floating point."""
    src = ins[0]
    opts = [ShardingOption((R,) * len(ins), R)]
    opts += [ShardingOption((Shard(d),) + (R,) * (len(ins) - 1), Shard(d))
             for d, size in enumerate(src.shape) if size > 1]
    if src.is_float and node.out.is_float:
        opts.append(ShardingOption((P,) + (R,) * (len(ins) - 1), P))
    return opts


@register_local(CASTS)
def local_cast(node, option, ctx):
    """The dtype changes; the device stays the step's (a capture on the CPU names the CPU)."""
    dtype = getattr(torch, node.out.dtype)
    return lambda t: t[0].to(dtype=dtype)
