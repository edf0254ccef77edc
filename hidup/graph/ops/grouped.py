"""Grouped matmul, the op routed experts run through: `out[r] = input[r] @ weight[e]` for the
rows r that offs gives expert e (rows sorted by expert; offs[e] is where expert e's rows end).
PyTorch's `aten._grouped_mm` (2-d input, 3-d weight, offs) and the same op that a library
registers for the CPU (`transformers.grouped_mm_fallback`, whose schema is (input, weight, offs)).

Options: replicated; the weight's output features split (each rank computes its columns); the
contraction split (Partial output); and expert parallel: the experts split over ranks, each rank
computing only its experts' rows, zero elsewhere, so the output is a Partial sum. The expert
option runs through `hidup::experts_mm`, an op whose row ranges are read from offs inside it (a
traced step cannot hold shapes that depend on data).
"""
from __future__ import annotations

import torch

from hidup.graph.flops import GROUPED_MM
from hidup.graph.ops.registry import default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption


def _bounds(offs: torch.Tensor, first: int, count: int) -> list[tuple[int, int]]:
    ends = [0] + offs.tolist()
    return [(ends[first + i], ends[first + i + 1]) for i in range(count)]


@torch.library.custom_op("hidup::experts_mm", mutates_args=())
def experts_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               first: int) -> torch.Tensor:
    """Rows of experts first .. first + len(weight) - 1 times their weights; zero elsewhere."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for i, (start, end) in enumerate(_bounds(offs, first, weight.shape[0])):
        if end > start:
            out[start:end] = input[start:end] @ weight[i]
    return out


@experts_mm.register_fake
def _(input, weight, offs, first):
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("hidup::experts_mm_backward", mutates_args=())
def experts_mm_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input's gradient, zero outside these experts' rows; the local weights' gradient)."""
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    for i, (start, end) in enumerate(_bounds(offs, first, weight.shape[0])):
        if end > start:
            grad_input[start:end] = grad[start:end] @ weight[i].T
            grad_weight[i] = input[start:end].T @ grad[start:end]
    return grad_input, grad_weight


@experts_mm_backward.register_fake
def _(input, weight, offs, first, grad):
    return torch.empty_like(input), torch.empty_like(weight)


def differentiable(op, backward_op) -> None:
    """Register the autograd of an experts' op `op(input, weight, offs, extra)` (extra: not a
    tensor) whose gradients `backward_op(input, weight, offs, extra, grad)` gives: (the input's,
    the weight's)."""

    def backward(ctx, grad):
        input, weight, offs = ctx.saved_tensors
        grad_input, grad_weight = backward_op(input, weight, offs, ctx.extra, grad)
        return grad_input, grad_weight, None, None

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.extra = inputs[3]

    op.register_autograd(backward, setup_context=setup)


differentiable(experts_mm, experts_mm_backward)


@register(GROUPED_MM)
def grouped_mm(node, ins):
    replicated = ShardingOption((R,) * len(ins), R)
    if len(ins) != 3 or len(ins[0].shape) != 2 or len(ins[1].shape) != 3:
        return [replicated]  # another form of the op (batched, without offs): run it whole
    rest = (R,)  # offs: every rank needs every expert's row range
    return [replicated,
            ShardingOption((R, Shard(0)) + rest, P),  # experts over ranks
            ShardingOption((R, Shard(2)) + rest, Shard(1)),  # output features
            ShardingOption((Shard(1), Shard(1)) + rest, P)]  # the contraction


@register_local(GROUPED_MM)
def local_grouped_mm(node, option, ctx):
    if option.inputs[1] == Shard(0):  # this rank's experts: rank x experts per rank onwards
        first = ctx.rank * ctx.in_shapes[1][0]
        return lambda t: experts_mm(t[0], t[1], t[2], first)
    return default_local(node, option, ctx)
