"""Losses: split the batch (and extra target dims); a mean becomes a Partial sum over the global count."""
from __future__ import annotations

import math

import torch

from hidup.graph.capture import Ref, fill
from hidup.graph.ops.registry import arg, default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten
MEAN, SUM = 1, 2
CLASS_LOSSES = [aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default]
POINT_LOSSES = [aten.mse_loss.default, aten.l1_loss.default]


def _reduction(node) -> int:
    index = 3 if node.op in map(str, CLASS_LOSSES) else 2
    return arg(node, index, "reduction", MEAN)


@register(CLASS_LOSSES)
def class_loss(node, ins):
    """input (N, C, d...) and target (N, d...): split N or a d; never the classes C."""
    n = len(ins)
    opts = [ShardingOption((R,) * n, R)]
    if len(ins[0].shape) == 1 or isinstance(arg(node, 2, "weight"), Ref):
        return opts  # unbatched, or class weights (a weighted mean's denominator is global)
    reduced = _reduction(node) != 0
    for d_target, size in enumerate(ins[1].shape):
        if size > 1:
            d_input = d_target if d_target == 0 else d_target + 1
            out = P if reduced else Shard(d_target)
            opts.append(ShardingOption((Shard(d_input), Shard(d_target)) + (R,) * (n - 2), out))
    return opts


@register(POINT_LOSSES)
def point_loss(node, ins):
    reduced = _reduction(node) != 0
    opts = [ShardingOption((R, R), R)]
    for d, size in enumerate(ins[0].shape):
        if size > 1 and ins[1].shape[d] == size:
            opts.append(ShardingOption((Shard(d), Shard(d)), P if reduced else Shard(d)))
    return opts


@register_local(CLASS_LOSSES + POINT_LOSSES)
def local_loss(node, option, ctx):
    """A mean is this rank's sum over the global number of terms: right for any split of the batch,
    across ranks or across micro-batches."""
    if _reduction(node) != MEAN:
        return default_local(node, option, ctx)
    is_class = node.op in map(str, CLASS_LOSSES)
    index = 3 if is_class else 2
    args = list(node.args) + [None] * (index + 1 - len(node.args))
    args[index] = SUM
    kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
    count = math.prod(ctx.global_in[1] if is_class else ctx.global_in[0])
    ignore = arg(node, 4, "ignore_index", -100)
    whole_target = ctx.whole(node.inputs[1]) if is_class and ctx.whole is not None else None

    def run(t):
        total = node.target(*fill(tuple(args), t), **fill(kwargs, t))
        if whole_target is not None:  # the mean over the kept targets of the whole batch
            return total / (whole_target != ignore).sum()
        if is_class:  # checked on the device, without a host sync
            torch._assert_async((t[1] != ignore).all(),
                                f"node {node.name}: a target equals ignore_index={ignore}, and "
                                f"the target depends on parameters, so the kept targets of the "
                                f"whole batch cannot be counted; compute the target from the "
                                f"inputs alone")
        return total / count

    return run

