"""Losses: split the batch (and extra target dims); a mean becomes a Partial sum over the global
count. A class loss may also split its classes (vocabulary parallel, as Megatron-LM's and
torchtitan's `loss_parallel`): each rank holds the logits of its slice of the classes, the
log-sum-exp of each row comes from two all-reduces inside the op (the rows' maximum, then their
sums of exponentials), and each rank adds the log-probability of the targets in its slice, a
Partial sum."""
from __future__ import annotations

import math

import torch

from hidup.graph.nodes import Ref, fill
from hidup.graph.ops.registry import (arg, default_local, register, register_local,
                                      register_inner)
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
    if _vocabulary_parallel_allowed(node, ins):
        opts.append(ShardingOption((Shard(1), R) + (R,) * (n - 2), P))
    return opts


def _vocabulary_parallel_allowed(node, ins) -> bool:
    """Classes may be split for cross-entropy without label smoothing (whose mean over the
    classes this split does not compute) and for an nll loss on log-probabilities."""
    smoothing = arg(node, 5, "label_smoothing", 0.0) if node.op == str(CLASS_LOSSES[0]) else 0.0
    return ins[0].shape[1] > 1 and smoothing == 0.0


def _vocabulary_split(node, option) -> bool:
    return node.op in map(str, CLASS_LOSSES) and option.inputs[0] == Shard(1)


@register_inner(CLASS_LOSSES)
def class_loss_collectives(node, option, in_shapes, backward):
    """The split cross-entropy's two all-reduces of one float32 per row (maximum, then sum)."""
    if backward or not _vocabulary_split(node, option) or node.op != str(CLASS_LOSSES[0]):
        return ()
    return (("all_reduce", 4 * math.prod(in_shapes[1])),) * 2


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
    if _vocabulary_split(node, option):
        return _vocabulary_parallel(node, ctx)
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



def _vocabulary_parallel(node, ctx):
    """This rank's part of a class loss whose classes are split: the negative log-probability of
    each row's target where the target is in this rank's slice (0 elsewhere), reduced as the
    loss reduces (a mean over the whole batch's kept targets)."""
    reduction, ignore = _reduction(node), arg(node, 4, "ignore_index", -100)
    logits_too = node.op == str(CLASS_LOSSES[0])  # cross-entropy; nll losses read log-probs
    count = math.prod(ctx.global_in[1])
    whole_target = ctx.whole(node.inputs[1]) if ctx.whole is not None else None

    def run(t):
        x, target = t[0], t[1]
        first = ctx.rank * x.shape[1]
        kept = target != ignore
        local = target - first
        mine = kept & (local >= 0) & (local < x.shape[1])
        index = local.clamp(0, x.shape[1] - 1)
        if logits_too:
            rows = _SplitCrossEntropy.apply(x, index, mine, kept, ctx.reduce)
        else:
            rows = -x.gather(1, index.unsqueeze(1)).squeeze(1) * mine
        if reduction == 0:
            return rows
        total = rows.sum()
        if reduction == SUM:
            return total
        if whole_target is not None:
            return total / (whole_target != ignore).sum()
        torch._assert_async(kept.all(), f"node {node.name}: a target equals ignore_index="
                                        f"{ignore}, and the target depends on parameters, so "
                                        f"the kept targets of the whole batch cannot be counted")
        return total / count

    return run


class _SplitCrossEntropy(torch.autograd.Function):
    """Per row, -log softmax(x)[target] over classes split across ranks: this rank's columns x,
    `index` the target's column here where `mine`. Its output is this rank's term of a Partial
    sum; its backward gives this rank's columns of the gradient of the whole sum, which needs no
    communication: softmax(x) - onehot(target) on the kept rows. Like cross-entropy it computes
    in float32 and keeps its log-probabilities for the backward."""

    @staticmethod
    def forward(ctx, x, index, mine, kept, reduce):
        xf = x.float()
        top = reduce(xf.detach().amax(dim=1), "max")
        total = reduce((xf - top.unsqueeze(1)).exp().sum(dim=1), "sum")
        logp = xf - (top + total.log()).unsqueeze(1)
        ctx.save_for_backward(logp, index, mine, kept)
        ctx.dtype = x.dtype
        return -logp.gather(1, index.unsqueeze(1)).squeeze(1) * mine

    @staticmethod
    def backward(ctx, grad):
        logp, index, mine, kept = ctx.saved_tensors
        g = (grad * kept).unsqueeze(1)
        dx = logp.exp() * g
        dx = dx.scatter_add(1, index.unsqueeze(1), -(g * mine.unsqueeze(1)))
        return dx.to(ctx.dtype), None, None, None, None
