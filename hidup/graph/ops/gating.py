"""Gating ops of mixtures of experts: top-k, one-hot, cumulative sum, clamp. Each keeps the dims it
computes along whole; a top-k's values and indices are two nodes with the same options."""
from __future__ import annotations

import torch

from hidup.graph.flops import GROUPED_MM
from hidup.graph.ops.dispatch import collectives, experts_a2a
from hidup.graph.ops.grouped import experts_mm
from hidup.graph.ops.pointwise import pointwise_options
from hidup.graph.ops.registry import arg, register, register_inner, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten


@register([aten.topk.default, aten.sort.default, aten.max.dim, aten.min.dim, aten.argmax.default,
           aten.argmin.default])
def along_dim(node, ins):
    """Any dim but the one searched (top-k, sort, max, argmax along `dim`)."""
    default = -1 if node.op in ("aten.topk.default", "aten.sort.default") else 0
    index = 2 if node.op == "aten.topk.default" else 1
    dim = arg(node, index, "dim", default)
    shape = ins[0].shape
    if dim is None:  # over the flattened tensor
        return [ShardingOption((R,), R)]
    dim = dim % len(shape)
    keep = arg(node, index + 1, "keepdim", False) or node.op in ("aten.topk.default",
                                                                  "aten.sort.default")
    opts = [ShardingOption((R,), R)]
    for d, size in enumerate(shape):
        if d != dim and size > 1:
            opts.append(ShardingOption((Shard(d),), Shard(d if keep or d < dim else d - 1)))
    return opts


@register(aten.cumsum.default)
def cumsum(node, ins):
    """Any dim but the one summed along (for gating: the sequence stays whole)."""
    return pointwise_options(node.out.shape, [ins[0].shape], fixed_dims=(node.args[1],))


@register(aten.one_hot.default)
def one_hot(node, ins):
    """Every index dim keeps its split; the new class dim stays whole."""
    shape = ins[0].shape
    return [ShardingOption((R,), R)] + [ShardingOption((Shard(d),), Shard(d))
                                        for d, size in enumerate(shape) if size > 1]


@register([aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default])
def clamp(node, ins):
    return pointwise_options(node.out.shape, [m.shape for m in ins])


@register("hidup.tokens")
def per_token_region(node, ins):
    """A per-token region (hidup.graph.tokens) runs on any part of the rows: replicated, or its
    row-wise inputs and its output split on the rows (dim 0), its weights whole; and where it
    runs experts, split over the ranks (expert parallel) in two ways: on every row, each rank
    computing its experts' rows (a Partial sum), or on each rank's own rows, sent to their
    experts' ranks and back by all-to-all (`exchanges`; hidup.graph.ops.dispatch)."""
    region = node.args[0]
    rows = tuple(Shard(0) if r else R for r in region.rowwise)
    opts = [ShardingOption((R,) * len(ins), R), ShardingOption(rows, Shard(0))]
    if any(region.experts):
        opts.append(ShardingOption(tuple(Shard(0) if e else R for e in region.experts), P))
        opts.append(ShardingOption(tuple(Shard(0) if e or r else R
                                         for e, r in zip(region.experts, region.rowwise)),
                                   Shard(0)))
    return opts


def exchanges(node, option) -> bool:
    """Does a per-token region's option send its rows to their experts' ranks (its experts and
    its rows split)?"""
    return node.op == "hidup.tokens" and option.output == Shard(0) and any(
        e and p == Shard(0) for e, p in zip(node.args[0].experts, option.inputs))


@register_local("hidup.tokens")
def local_region(node, option, ctx):
    """The region on this rank's inputs; where its experts' weights are split, each grouped
    matmul computes this rank's experts' rows only, the others zero (a Partial sum), or, where
    the rows are split too, sends them to their experts' ranks (ctx.group) and back."""
    region, sent = node.args[0], exchanges(node, option)

    def run(inner, ins, split):
        if inner.op in GROUPED_MM and inner.inputs[1] in split:
            if sent:
                return experts_a2a(ins[0], ins[1], ins[2], ctx.group)
            return experts_mm(ins[0], ins[1], ins[2], ctx.rank * split[inner.inputs[1]])
        return None

    return lambda tensors: region(*tensors, run=run)


@register_inner("hidup.tokens")
def region_collectives(node, option, in_shapes, backward):
    """The all-to-alls of a region whose rows are sent to their experts' ranks: each grouped
    matmul's (hidup.graph.ops.dispatch.collectives), on its rows' part of the captured ones."""
    if not exchanges(node, option):
        return ()
    region = node.args[0]
    fraction, shapes = region.fraction(in_shapes), region.shape_of
    out = []
    for inner in region.expert_matmuls:
        rows, width = shapes[inner.inputs[0]]
        out += collectives(round(rows * fraction), width, inner.out.shape[-1],
                           inner.out.itemsize, shapes[inner.inputs[2]][0], backward)
    return tuple(out)
