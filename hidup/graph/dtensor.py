"""The adapter to PyTorch DTensor's sharding strategies: the only module that touches DTensor's
private APIs (`torch.distributed.tensor._ops`, `_sharding_prop`, `_op_schema`).

For an ATen node, DTensor's sharding propagator knows which placements of its inputs give which
placement of its output, for about 1,160 ops (registered strategies, single-dim strategies,
propagation rules and strategies derived from an op's decomposition). `options(node, in_metas)`
reads them on a one-dimensional mesh and returns them as HiDup's ShardingOptions. What HiDup's
executor does not run the same way is dropped, never run wrongly: Partial(avg / max / min), a
strided shard, a masked partial (those ops have overlay rules where they matter), and splits of
ops whose scalar arguments hold global sizes that DTensor rewrites per rank (group_norm's N, C).
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch.utils import _pytree as pytree

from hidup.graph.nodes import Node, Ref, TensorMeta
from hidup.graph.placement import P, R, Placement, Shard, ShardingOption

TESTED_TORCH = ("2.11", "2.13")  # the torch versions this adapter is tested with (major.minor):
#   2.13 in CI (CPU); 2.11 on the GPU machine (tests/test_ops.py there, experiments/gpu_table.sh;
#   its private names read in 2.11's sources)
MAX_COMBINATIONS = 64  # input placements tried for an op known only by rules or decomposition


class UnsupportedTorchError(RuntimeError):
    """The installed torch is outside the versions the DTensor adapter is tested with."""


def check_torch(version: str = torch.__version__) -> None:
    """Refuse, in one line, a torch whose DTensor internals this adapter was not tested with."""
    if ".".join(version.split("+")[0].split(".")[:2]) not in TESTED_TORCH:
        raise UnsupportedTorchError(
            f"torch {version} is installed, but HiDup reads DTensor's sharding strategies only on "
            f"torch {' / '.join(TESTED_TORCH)}; install one of those (pip install torch==2.13.0)")


@functools.cache
def _dtensor():
    """DTensor's propagator and the private types it works with, imported once."""
    check_torch()
    import torch.distributed.tensor._ops  # noqa: F401 (registers the strategies)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as DMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.placement_types import _StridedShard

    class Api:
        pass

    api = Api()
    api.prop = DTensor._op_dispatcher.sharding_propagator
    api.has_decomp = DecompShardingStrategy.has_decomp
    # a mesh of 2 with no process group: strategies depend on the mesh's shape, not its size;
    # made of real tensors even when first asked for inside a trace (the step's make_fx)
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        api.mesh = DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)
    api.Spec, api.Meta, api.Schema = DTensorSpec, DMeta, OpSchema
    api.OpSpec, api.OpStrategy, api.Placeholder = OpSpec, OpStrategy, _ShardingPlaceholder
    api.Tuple = TupleStrategy
    api.Shard, api.Replicate, api.Partial, api.Strided = DShard, DReplicate, DPartial, _StridedShard
    return api


def covers(op) -> bool:
    """Does DTensor have any sharding strategy for this op (an OpOverload)?"""
    api = _dtensor()
    return (op in api.prop.op_single_dim_strategy_funcs or op in api.prop.op_strategy_funcs
            or op in api.prop.op_to_rules or api.has_decomp(op))


def shape_arg(op) -> int | None:
    """The position of the argument holding the output's global shape (view, new_zeros, ...),
    which a rank must replace by its local shape; None for other ops."""
    index = _dtensor().prop.op_to_shape_and_stride_idx.get(op)
    return index[0] if isinstance(index, tuple) else index


_ASKED: dict[tuple, list[ShardingOption] | None] = {}  # the answers for each call signature


def options(node: Node, in_metas: tuple[TensorMeta, ...]) -> list[ShardingOption] | None:
    """The node's options from DTensor (all-replicated first), or None where DTensor has none.
    A model's repeated layers ask the same question many times: each is answered once (the
    answer depends on the op, its arguments and its tensors' shapes and dtypes only)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or not covers(op):
        return None
    key = (op, in_metas, node.out, node.out_index, repr(node.args), repr(node.kwargs))
    if key not in _ASKED:
        _ASKED[key] = _options(node, in_metas)
    return _ASKED[key]


def _options(node: Node, in_metas: tuple[TensorMeta, ...]) -> list[ShardingOption] | None:
    api = _dtensor()
    op = node.target
    try:
        if op in api.prop.op_single_dim_strategy_funcs:
            found = _single_dim(api, node, in_metas)
        elif op in api.prop.op_strategy_funcs:
            found = _strategy(api, node, in_metas)
        else:
            found = _propagated(api, node, in_metas)
    except Exception:  # a strategy that cannot handle these arguments: as if it had none
        return None
    # global sizes in scalar arguments (torch 2.11 has no such ops: no table)
    if op in getattr(api.prop, "op_to_scalar_shape_adjuster", ()):
        found = [o for o in found if o.output == R and all(p == R for p in o.inputs)]
    replicated = ShardingOption((R,) * len(in_metas), R)
    return list(dict.fromkeys([replicated] + found))


def _dmeta(api, meta: TensorMeta):
    t = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")
    return api.Meta(t.shape, t.stride(), t.dtype)


def _args(node: Node, in_metas, leaf):
    """The node's args and kwargs with each tensor (Ref) replaced by leaf(meta)."""
    swap = lambda a: leaf(in_metas[a.index]) if isinstance(a, Ref) else a  # noqa: E731
    is_ref = lambda a: isinstance(a, Ref)  # noqa: E731
    return (pytree.tree_map(swap, node.args, is_leaf=is_ref),
            pytree.tree_map(swap, node.kwargs, is_leaf=is_ref))


def _ours(api, p) -> Placement | None:
    """DTensor's placement as HiDup runs it, or None where it runs differently."""
    if isinstance(p, api.Strided):
        return None
    if isinstance(p, (api.Shard, api.Replicate)):
        return p  # DTensor's placements are HiDup's
    if type(p) is api.Partial and p.reduce_op == "sum":
        return P
    return None  # Partial(avg / max / min), a masked partial


def _option(api, node: Node, in_metas, ins, outs) -> ShardingOption | None:
    """HiDup's option for DTensor's input and output placements; None where one does not run
    the same way or does not fit its tensor (a split of a dim it does not have)."""
    out = outs[node.out_index or 0] if isinstance(outs, (list, tuple)) else outs
    mine = [_ours(api, p) for p in ins] + [_ours(api, out)]
    metas = list(in_metas) + [node.out]
    if len(ins) != len(in_metas) or any(p is None for p in mine):
        return None
    if any(isinstance(p, Shard) and not 0 <= p.dim < len(m.shape) for p, m in zip(mine, metas)):
        return None
    return ShardingOption(tuple(mine[:-1]), mine[-1])


def _single_dim(api, node: Node, in_metas) -> list[ShardingOption]:
    """Single-dim strategies are already one mesh dimension's: rows [outputs..., inputs...]."""
    args, kwargs = _args(node, in_metas, lambda m: _dmeta(api, m))
    rows = api.prop.op_single_dim_strategy_funcs[node.target].func(node.target, args, kwargs)
    n_out = sum(1 for r in node.target._schema.returns if "Tensor" in str(r.type))
    fill = lambda p: api.Shard(p.dim) if isinstance(p, api.Placeholder) else (  # noqa: E731
        api.Replicate() if p is None else p)
    found = []
    for row in rows:
        row = [fill(p) for p in row]
        found.append(_option(api, node, in_metas, row[n_out:n_out + len(in_metas)], row[:n_out]))
    return [o for o in found if o is not None]


def _candidates(api, meta: TensorMeta) -> list:
    dims = [api.Shard(d) for d, size in enumerate(meta.shape) if size > 1]
    return [api.Replicate(), api.Partial()] + dims


def _spec(api, meta: TensorMeta, placement):
    return api.Spec(api.mesh, (placement,), _dmeta(api, meta))


def _strategy(api, node: Node, in_metas) -> list[ShardingOption]:
    """A registered strategy given every placement of every input: each OpSpec it keeps. An op
    on a list of tensors (stack, cat) is asked once per placement that every tensor of the list
    has alike: DTensor's strategy for a list follows its first tensor's first placement."""
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, Ref) for x in a)
           for a in node.args):
        return [o for p in _candidates(api, in_metas[0])
                for o in _strategy_options(api, node, in_metas, lambda meta, p=p: [p])]
    return _strategy_options(api, node, in_metas, lambda meta: _candidates(api, meta))


def _strategy_options(api, node: Node, in_metas, placements) -> list[ShardingOption]:
    """The registered strategy's OpSpecs given each input tensor the `placements(meta)`."""
    def leaf(meta):
        return api.OpStrategy([api.OpSpec(_spec(api, meta, p)) for p in placements(meta)])

    args, kwargs = _args(node, in_metas, leaf)
    args = tuple(api.Tuple(list(a)) if isinstance(a, (list, tuple)) and a
                 and all(isinstance(x, api.OpStrategy) for x in a) else a for a in args)
    try:
        strategy = api.prop.op_strategy_funcs[node.target](api.Schema(node.target, args, kwargs))
    except Exception:  # this placement of a list's tensors has no strategy
        if placements(in_metas[0]) != _candidates(api, in_metas[0]):
            return []
        raise
    found = []
    for spec in strategy.strategies:
        outs = spec.output_specs
        outs = [o.placements[0] if o is not None else api.Replicate() for o in outs] \
            if isinstance(outs, (list, tuple)) else outs.placements[0]
        ins = [s.placements[0] for s in spec.input_specs] if spec.input_specs else \
            [outs if not isinstance(outs, list) else outs[0]] * len(in_metas)
        found.append(_option(api, node, in_metas, ins, outs))
    return [o for o in found if o is not None]


def _propagated(api, node: Node, in_metas) -> list[ShardingOption]:
    """Rules and decompositions answer for given inputs: try each combination of input
    placements (up to MAX_COMBINATIONS) and keep those DTensor runs without redistributing."""
    combos = itertools.islice(itertools.product(*(_candidates(api, m) for m in in_metas)),
                              MAX_COMBINATIONS)
    found = []
    for combo in combos:
        it = iter(combo)
        args, kwargs = _args(node, in_metas, lambda m: _spec(api, m, next(it)))
        try:
            result = api.prop.propagate_op_sharding_non_cached(api.Schema(node.target, args,
                                                                          kwargs))
        except Exception:
            continue
        if result.needs_redistribute or result.output_spec is None:
            continue
        outs = result.output_spec
        outs = [o.placements[0] for o in outs] if isinstance(outs, (list, tuple)) else \
            outs.placements[0]
        found.append(_option(api, node, in_metas, combo, outs))
    return [o for o in found if o is not None]
