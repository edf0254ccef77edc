"""Element-wise ops (with broadcasting), dropout, softmax / log-softmax and normalisation layers."""
from __future__ import annotations

import torch

from hidup.graph.nodes import Ref
from hidup.graph.ops.registry import arg, register
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten


def pointwise_options(out_shape, in_shapes, fixed_dims=()) -> list[ShardingOption]:
    """Replicated, plus one option per output dim (not in `fixed_dims`): inputs that span the dim
    (right-aligned broadcasting) are split with it, broadcast inputs stay replicated."""
    opts = [ShardingOption((R,) * len(in_shapes), R)]
    fixed = {d % len(out_shape) for d in fixed_dims} if out_shape else set()
    for d, size in enumerate(out_shape):
        if size <= 1 or d in fixed:
            continue
        ins = []
        for shape in in_shapes:
            j = d - (len(out_shape) - len(shape))
            ins.append(Shard(j) if j >= 0 and shape[j] == size else R)
        opts.append(ShardingOption(tuple(ins), Shard(d)))
    return opts


def _shapes(ins):
    return [m.shape for m in ins]


UNARY = [aten.relu.default, aten.gelu.default, aten.silu.default, aten.tanh.default,
         aten.sigmoid.default, aten.exp.default, aten.log.default, aten.sqrt.default,
         aten.rsqrt.default, aten.abs.default, aten.pow.Tensor_Scalar, aten.dropout.default,
         aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
         aten.type_as.default]
LINEAR_UNARY = [aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
          aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Tensor, aten.where.self,
          aten.eq.Tensor, aten.ne.Tensor, aten.gt.Tensor, aten.lt.Tensor, aten.ge.Tensor,
          aten.le.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
          aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.lt.Scalar,
          aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
          # where with a Python number for a branch: DTensor's decomposition of it makes a
          # scalar tensor it has no strategy for
          aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar]


@register(UNARY + BINARY)
def pointwise(node, ins):
    return pointwise_options(node.out.shape, _shapes(ins)) + _partial_options(node, ins)


@register(LINEAR_UNARY)
def linear_unary(node, ins):
    return pointwise_options(node.out.shape, _shapes(ins)) + [ShardingOption((P,), P)]


def _partial_options(node, ins) -> list[ShardingOption]:
    """Partial sums stay Partial through ops linear in them: a sum of Partials, and a Partial
    multiplied (or divided) by a replicated tensor."""
    both_tensors = isinstance(arg(node, 0, "self"), Ref) and isinstance(arg(node, 1, "other"), Ref)
    if node.op in ("aten.add.Tensor", "aten.sub.Tensor") and both_tensors:
        return [ShardingOption((P, P), P)]
    if node.op == "aten.mul.Tensor" and both_tensors:
        return [ShardingOption((P, R), P), ShardingOption((R, P), P)]
    if node.op == "aten.div.Tensor" and both_tensors:
        return [ShardingOption((P, R), P)]
    if node.op in ("aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar", "aten.div.Scalar"):
        return [ShardingOption((P,), P)]  # times a Python number
    return []


@register([aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
           aten._log_softmax.default])
def softmax(node, ins):
    """Any dim but the one normalised over."""
    return pointwise_options(node.out.shape, _shapes(ins), fixed_dims=(node.args[1],))


@register([aten.layer_norm.default, aten.rms_norm.default])
def layer_norm(node, ins):
    """Any leading dim; the normalised trailing dims and the affine weights stay whole."""
    shape = node.out.shape
    n_norm = len(node.args[1])
    weights = len(ins) - 1
    opts = [ShardingOption((R,) * len(ins), R)]
    for d in range(len(shape) - n_norm):
        if shape[d] > 1:
            opts.append(ShardingOption((Shard(d),) + (R,) * weights, Shard(d)))
    return opts
