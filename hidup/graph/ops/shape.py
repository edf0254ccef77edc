"""View-like ops: view / reshape / flatten / unflatten / squeeze / unsqueeze / expand (one rule from
the shapes), transpose / permute, select, slice, cat. The data never moves: only placements map."""
from __future__ import annotations

import math

import torch

from hidup.graph.ops.registry import default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten

RESHAPES = [aten.view.default, aten.reshape.default, aten._unsafe_view.default,
            aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims,
            aten.squeeze.default, aten.unsqueeze.default]


def reshape_map(a: tuple[int, ...], b: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim whose split gives the same contiguous blocks: the dims that have the
    same number of elements before them, both of size > 1."""
    out_by_prefix = {math.prod(b[:o]): o for o in reversed(range(len(b))) if b[o] > 1}
    return {i: out_by_prefix[math.prod(a[:i])] for i in range(len(a))
            if a[i] > 1 and math.prod(a[:i]) in out_by_prefix}


def dim_map_options(mapping: dict[int, int], n_extra: int = 0) -> list[ShardingOption]:
    extra = (R,) * n_extra
    opts = [ShardingOption((R,) + extra, R), ShardingOption((P,) + extra, P)]
    opts += [ShardingOption((Shard(i),) + extra, Shard(o)) for i, o in mapping.items()]
    return opts


@register(RESHAPES)
def reshape(node, ins):
    return dim_map_options(reshape_map(ins[0].shape, node.out.shape))


@register(aten.expand.default)
def expand(node, ins):
    a, b = ins[0].shape, node.out.shape
    off = len(b) - len(a)
    opts = dim_map_options({i: i + off for i in range(len(a)) if a[i] > 1 and a[i] == b[i + off]})
    # a broadcast dim can be produced split: each rank expands to its own chunk
    grown = [d for d in range(len(b)) if b[d] > 1 and (d < off or a[d - off] == 1)]
    return opts + [ShardingOption((R,), Shard(d)) for d in grown]


@register_local(RESHAPES + [aten.expand.default])
def local_shape(node, option, ctx):
    """Shapes written in the graph are global: give the op this rank's local output shape."""
    if node.op == "aten.unflatten.int":
        dim = node.args[1] % len(ctx.in_shapes[0])
        sizes = ctx.out_shape[dim: dim + len(node.args[2])]
        return lambda t: aten.unflatten.int(t[0], dim, list(sizes))
    if node.op in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                   "aten.expand.default"):
        return lambda t: node.target(t[0], list(ctx.out_shape))
    return default_local(node, option, ctx)


def _permutation(node, n: int) -> list[int]:
    if node.op == "aten.permute.default":
        return [d % n for d in node.args[1]]
    perm = list(range(n))
    if node.op == "aten.t.default":
        perm.reverse()
    else:
        d0, d1 = node.args[1] % n, node.args[2] % n
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


@register([aten.transpose.int, aten.permute.default, aten.t.default])
def permute(node, ins):
    perm = _permutation(node, len(ins[0].shape))
    return dim_map_options({i: perm.index(i) for i in range(len(perm)) if ins[0].shape[i] > 1})


@register([aten.select.int, aten.slice.Tensor])
def select(node, ins):
    """Every dim but the one indexed keeps its split."""
    n = len(ins[0].shape)
    dim = node.args[1] % n if len(node.args) > 1 else 0
    drop = node.op == "aten.select.int"
    mapping = {i: i - (drop and i > dim) for i in range(n) if i != dim and ins[0].shape[i] > 1}
    return dim_map_options(mapping)


@register(aten.cat.default)
def cat(node, ins):
    n = len(node.out.shape)
    dim = (node.args[1] if len(node.args) > 1 else 0) % n
    k = len(ins)
    opts = [ShardingOption((R,) * k, R), ShardingOption((P,) * k, P)]
    # a legacy empty 1-d input (cat's "skip it" case) is split with the others: it is empty
    opts += [ShardingOption(tuple(Shard(d) if len(m.shape) == n else R for m in ins), Shard(d))
             for d in range(n) if d != dim and node.out.shape[d] > 1]
    return opts


