"""The rule registry: for each ATen op, its sharding options and how a rank runs it locally."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from hidup.graph import dtensor
from hidup.graph.nodes import Node, TensorMeta, fill
from hidup.graph.placement import R, ShardingOption

RuleFn = Callable[[Node, tuple[TensorMeta, ...]], list[ShardingOption]]
_RULES: dict[str, RuleFn] = {}
_LOCALS: dict[str, Callable] = {}
_INNER: dict[str, Callable] = {}


def _keys(ops) -> list[str]:
    return [str(op) for op in (ops if isinstance(ops, (list, tuple)) else [ops])]


def register(ops):
    """Decorator: `fn(node, input_metas) -> [ShardingOption]` is the rule of `ops` (an op or a list)."""

    def deco(fn):
        for key in _keys(ops):
            _RULES[key] = fn
        return fn

    return deco


def register_local(ops):
    """Decorator: `fn(node, option, ctx) -> callable(tensors) -> tensor` runs `ops` on local shards."""

    def deco(fn):
        for key in _keys(ops):
            _LOCALS[key] = fn
        return fn

    return deco


def register_inner(ops):
    """Decorator: `fn(node, option, local_in_shapes, backward) -> ((kind, bytes), ...)` gives the
    collectives an op of `ops` runs inside itself, blocking, under `option`, in its forward or
    its backward (LocalContext.reduce, LocalContext.group), for the Program."""

    def deco(fn):
        for key in _keys(ops):
            _INNER[key] = fn
        return fn

    return deco


def runs_inner(op: str) -> bool:
    """Can an op of this kind run collectives inside itself (register_inner)?"""
    return op in _INNER


def inner_collectives(node: Node, option: ShardingOption, in_shapes: tuple[tuple[int, ...], ...],
                      backward: bool = False) -> tuple[tuple[str, int], ...]:
    """(kind, bytes) of each collective the node runs inside itself under `option` on inputs of
    these local shapes, in its forward or its backward, over the ranks its placements split over
    (none for most ops; bytes as a Convert's: the whole tensor on one rank)."""
    fn = _INNER.get(node.op)
    return () if fn is None else tuple(fn(node, option, in_shapes, backward))


def has_rule(op: str) -> bool:
    """Does the project's overlay have a rule for this op (looked up before DTensor's)?"""
    return op in _RULES


def node_options(graph, node: Node) -> tuple[ShardingOption, ...]:
    """`options` of a graph's node, computed once per graph: the search, the plan checks, the
    baselines and the plan's description ask for every node many times."""
    cache = graph.__dict__.setdefault("_options", {})
    if node.name not in cache:
        cache[node.name] = tuple(options(node, node.in_metas(graph)))
    return cache[node.name]


def source(graph, node: Node) -> str:
    """Where a node's options come from: 'overlay' (a rule here), 'dtensor' (DTensor's
    strategies, through hidup.graph.dtensor) or 'replicated' (nobody covers it: it runs whole
    on every rank)."""
    if node.op in _RULES:
        return "overlay"
    return "dtensor" if len(node_options(graph, node)) > 1 else "replicated"


def replicated_ops(graph) -> list[Node]:
    """The graph's ops that neither an overlay rule nor DTensor covers: each runs replicated."""
    return [n for n in graph.ops if source(graph, n) == "replicated"]


def options(node: Node, in_metas: tuple[TensorMeta, ...]) -> list[ShardingOption]:
    """The node's sharding options: the overlay's rule, else DTensor's strategies, else
    replicated (always correct: every rank runs the op on whole inputs)."""
    rule = _RULES.get(node.op)
    if rule is None:
        return dtensor.options(node, in_metas) or [replicated(len(in_metas))]
    try:
        opts = rule(node, in_metas)
    except Exception as exc:
        raise type(exc)(f"node {node.name} ({node.op}): {exc}") from exc
    return list(dict.fromkeys(opts))  # unique, order kept


def replicated(n_inputs: int) -> ShardingOption:

    return ShardingOption((R,) * n_inputs, R)


@dataclass(frozen=True)
class LocalContext:
    """What a rank needs to run one node on its shards of one micro-batch."""

    rank: int
    world: int
    in_shapes: tuple[tuple[int, ...], ...]  # local
    out_shape: tuple[int, ...]  # local
    global_out: tuple[int, ...]
    global_in: tuple[tuple[int, ...], ...]
    root: bool  # True on the one (rank, micro-batch) that adds constant terms to a Partial output
    device: str = "cpu"  # where the step runs: factory ops make their tensors there
    # a graph tensor computed whole from the whole global batch (every rank has it), or None
    # where it depends on parameters: how a loss counts the targets it keeps over the batch
    whole: Callable[[str], object] | None = None
    # reduce(x, op): x all-reduced ('sum' or 'max') over the ranks the option splits over, for
    # an op that reduces inside itself (a vocabulary-parallel loss; inner_collectives says so
    # to the Program); the identity where the op runs on one rank
    reduce: Callable[[torch.Tensor, str], torch.Tensor] = lambda x, op: x
    # the name of the group of ranks the option splits over, for an op that exchanges inside
    # itself (hidup.graph.ops.dispatch: routed experts' rows by all-to-all)
    group: str = ""


def default_local(node: Node, option: ShardingOption, ctx: LocalContext):
    index = dtensor.shape_arg(node.target) if isinstance(node.target, torch._ops.OpOverload) \
        else None
    if index is not None and index < len(node.args) and ctx.out_shape != ctx.global_out:
        # a global shape in the arguments (view, new_zeros, ...): this rank's local one instead
        node = replace(node, args=node.args[:index] + (list(ctx.out_shape),) + node.args[index + 1:])
    if node.out_index is not None:
        return lambda t: node.target(*fill(node.args, t), **fill(node.kwargs, t))[node.out_index]
    return lambda tensors: node.target(*fill(node.args, tensors), **fill(node.kwargs, tensors))


def local_callable(node: Node, option: ShardingOption, ctx: LocalContext):
    """A function of the local input tensors that computes this rank's local output."""
    return _LOCALS.get(node.op, default_local)(node, option, ctx)


def arg(node: Node, index: int, name: str, default=None):
    """Positional-or-keyword argument `index`/`name` of a node (Ref for tensors)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def iter_rules() -> Iterable[str]:
    return iter(_RULES)
