"""How a strategy reads in a report: each op's style in the fixed strategies' words (describe,
summarize), an op's placements per mesh dimension, the ops no rule covers."""
from __future__ import annotations

from collections import Counter

from hidup.graph import ops
from hidup.graph.capture import Graph, Node
from hidup.graph.placement import R, Shard, ShardingOption, option_is_flat, plain_option
from hidup.graph.tokens import TOKENS
from hidup.strategy.base import Strategy
from hidup.strategy.mesh import axes_words
from hidup.strategy.microbatch import microbatch_split
from hidup.strategy.recompute import describe_recompute


KEY_OPS = ("linear", "einsum", "embedding", "conv", "scaled_dot_product_attention",
           "grouped_mm", "hidup.tokens")  # (the last: a router's per-token region, its experts)
STYLES = ("data parallel", "tensor parallel", "expert parallel", "split otherwise", "replicated")


def op_style(graph: Graph, node: Node, option: ShardingOption) -> str:
    """What an op's option does, in the words of the fixed strategies: 'expert parallel' (it reads
    experts split across the ranks: 3-d weights), 'tensor parallel' (other split weights), 'data
    parallel' (whole weights, the batch dim split), 'split otherwise', or 'replicated'."""
    option = plain_option(option)
    if node.op == TOKENS and any(e and p != R for e, p in zip(node.args[0].experts,
                                                              option.inputs)):
        return "expert parallel"  # (its experts' weights may be views of the parameters)
    split_weights = [graph.node(t) for t, p in zip(node.inputs, option.inputs)
                     if graph.node(t).kind == "param" and p != R]
    if split_weights:
        return "expert parallel" if any(len(w.out.shape) == 3 for w in split_weights) \
            else "tensor parallel"
    placements = (*option.inputs, option.output)
    if all(p == R for p in placements):
        return "replicated"
    if any(isinstance(p, Shard) and p.dim == 0 for p in placements):
        return "data parallel"
    return "split otherwise"


def summarize(graph: Graph, strategy: Strategy, flat: bool = False) -> dict[str, int]:
    """How many of the key ops (linear, einsum, embedding, convolution, attention, routed
    experts) each style (op_style) runs, in STYLES order, the styles used only; with `flat`, of
    the ops that run over every rank of a 2-D mesh (flat options), else of the others."""
    counts = {style: 0 for style in STYLES}
    for node in graph.ops:
        if any(key in node.op for key in KEY_OPS) and \
                option_is_flat(strategy.options[node.name]) == flat:
            counts[op_style(graph, node, strategy.options[node.name])] += 1
    return {style: n for style, n in counts.items() if n}


def describe(graph: Graph, strategy: Strategy) -> str:
    """One line a user can read: e.g. '16 key ops expert parallel, 41 data parallel' (on a 2-D
    mesh: 'data parallel across 8 machines; inside each: ...')."""
    counts = sorted(summarize(graph, strategy).items(), key=lambda kv: -kv[1])
    across = f"{strategy.mesh_words}: " if strategy.mesh else ""  # (parameters may be
    #   stored sharded over dim 0 too: storage)
    if not counts:
        return f"{across}no key ops" + storage(graph, strategy) + \
            describe_recompute(graph, strategy) + uncovered(graph)
    (style, n), rest = counts[0], counts[1:]
    what = f"all {n} key ops {style}" if not rest else \
        ", ".join([f"{n} key ops {style}"] + [f"{m} {s}" for s, m in rest])
    flat = summarize(graph, strategy, flat=True)
    if flat:  # some ops over every rank
        what += f"; over all {strategy.mesh.world} GPUs: " + \
            ", ".join(f"{m} key ops {s}" for s, m in flat.items())
    return across + what + storage(graph, strategy) + describe_recompute(graph, strategy) + \
        uncovered(graph)


def stored_sharded(graph: Graph, strategy: Strategy) -> list[str]:
    """The parameters stored sharded but read whole by some op: gathered before use (FSDP)."""
    read_whole = {t for node in graph.ops
                  for t, p in zip(node.inputs, strategy.options[node.name].inputs) if p == R}
    return [p.name for p in graph.params if p.name in read_whole and strategy.home(p.name) != R]


def storage(graph: Graph, strategy: Strategy) -> str:
    """'; 9 of 9 parameters stored sharded (gathered before use)', with ', again for the
    backward' where some are resharded after the forward; or ''."""
    sharded = stored_sharded(graph, strategy)
    again = ", again for the backward" if strategy.reshard & set(sharded) else ""
    inside = f"; {len(sharded)} of {len(graph.params)} parameters stored sharded (gathered " \
             f"before use{again})" if sharded else ""
    across = f"; {len(strategy.across)} of {len(graph.params)} stored sharded " \
             f"{axes_words(strategy.across_axes)}" \
        if strategy.across and strategy.mesh else ""
    return inside + across


def uncovered(graph: Graph) -> str:
    """'; 2 ops covered by no rule run replicated (my.op x2, 3.1% of the forward FLOPs)', or ''."""
    nodes = ops.replicated_ops(graph)
    if not nodes:
        return ""
    names = ", ".join(f"{op} x{n}" for op, n in Counter(n.op for n in nodes).most_common())
    total = sum(n.flops for n in graph.ops) or 1.0
    share = 100 * sum(n.flops for n in nodes) / total
    return f"; {len(nodes)} ops covered by no rule run replicated ({names}, {share:.1f}% of " \
           f"the forward FLOPs)"


def mesh_option(graph: Graph, strategy: Strategy, node: str) -> str:
    """An op's option with each tensor's placement per mesh dimension, as DTensor writes them:
    '([S(0), R], [R, S(1)]) -> [S(0), S(1)]' (the dp axes' first, then the split axis'). On a
    1-D mesh, the option as it is."""
    inner = strategy.options[node]
    if strategy.mesh is None:
        return str(inner)
    outer = microbatch_split(graph, 1, dp=strategy.parts).options[node]
    if option_is_flat(inner):  # over every rank: the same placement on every dimension
        outer = inner = plain_option(inner)
    n = len(strategy.dp)

    def per_axis(a, b) -> str:
        return f"[{', '.join(map(str, [a] * n + [b]))}]"
    ins = ", ".join(per_axis(a, b) for a, b in zip(outer.inputs, inner.inputs))
    return f"({ins}) -> {per_axis(outer.output, inner.output)}"
