"""The rule registry: for each ATen op, its sharding options and how a rank runs it locally."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from torch.utils import _pytree as pytree

from hidup.graph.capture import Node, Ref, TensorMeta
from hidup.graph.placement import R, ShardingOption

RuleFn = Callable[[Node, tuple[TensorMeta, ...]], list[ShardingOption]]
_RULES: dict[str, RuleFn] = {}
_LOCALS: dict[str, Callable] = {}


class NoRuleError(ValueError):
    """An op has no sharding rule."""


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


def has_rule(op: str) -> bool:
    return op in _RULES


def require_rules(graph) -> None:
    """Refuse, in one line naming the first such op and the fix, a graph with an op that has no
    sharding rule (a user's module: say so before any search or run)."""
    for node in graph.ops:
        if node.op not in _RULES:
            raise NoRuleError(f"op {node.op} (graph node {node.name}) has no sharding rule in "
                              f"HiDup, so it cannot be planned or run in parallel; write that "
                              f"part of forward with other ops, or add a rule with "
                              f"hidup.graph.ops.register (see hidup/graph/ops/*.py)")


def options(node: Node, in_metas: tuple[TensorMeta, ...], replicate_fallback: bool = False
            ) -> list[ShardingOption]:
    """The node's sharding options; an op without a rule is an error unless the fallback is asked for."""
    rule = _RULES.get(node.op)
    if rule is None:
        if replicate_fallback:
            return [replicated(len(in_metas))]
        raise NoRuleError(f"node {node.name}: op {node.op} has no sharding rule; add one in "
                          f"hidup/graph/ops/ or opt in to replication (replicate_fallback=True)")
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


def fill(template, tensors):
    """Replace every Ref in a node's args/kwargs by the matching tensor."""
    return pytree.tree_map(lambda a: tensors[a.index] if isinstance(a, Ref) else a, template,
                           is_leaf=lambda a: isinstance(a, Ref))


def default_local(node: Node, option: ShardingOption, ctx: LocalContext):
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
