"""Tensor parallelism with sequence parallelism (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022; torchtitan's layout), as placements like any
other: Megatron's regions, and between them the ops that Megatron runs whole on every rank
(norms, dropout, residual adds) split on a dim of their own instead, so each rank holds
1 / world of their activations. A region's Partial output then enters that stretch by a
reduce-scatter instead of an all-reduce, and the next region gathers it back (all-gather), the
same traffic as the all-reduce it replaces.

The rules are about ops and placements, never about a model:
- an embedding's weight is split by rows (the vocabulary), as Megatron-LM's vocabulary-parallel
  embedding: its output is a Partial sum, entering the first stretch by a reduce-scatter;
- a stretch is a connected set of ops that Megatron runs on whole inputs to a whole output,
  reached from a Partial value made whole (the output of a row-parallel linear or of the
  embedding) and going on through whole values that ops of the stretch make;
- its ops take the options that split each of the stretch's values (and what enters it) on
  one dim `d`, every other input as Megatron reads it or, where that is whole, sliced (no
  traffic; its gradient gathered in the backward), with `d` the dim after the batch's (dim 0,
  which data parallelism and Duplex split) that the most of its ops can split so. An op with
  no such option stays whole and reads the stretch's split values gathered (a loss on
  flattened rows, a mixture-of-experts dispatch)."""
from __future__ import annotations

from dataclasses import replace

from hidup.graph.capture import Graph
from hidup.graph.connected import connected
from hidup.graph.placement import R, Partial, Placement, Shard, ShardingOption
from hidup.strategy.base import Strategy, fitting_options, propagate

BATCH_DIM = 0  # the dim the batch splits along (data parallelism, Duplex's micro-batches)


def megatron_sp(graph: Graph, world: int, *, sequence: bool = True) -> Strategy:
    """Megatron-LM tensor parallel with a vocabulary-parallel embedding and sequence
    parallelism between its regions (this module's rules); without `sequence`, the same regions
    with the stretches between them whole."""
    seeds: dict[str, Placement] = {n.name: R for n in graph.user_inputs}
    for w in embedding_weights(graph):
        if graph.node(w).out.shape[0] % world == 0:
            seeds[w] = Shard(0)
    tp = propagate(graph, world, "megatron-sp", seeds, shard_params=True,
                   allowed={"all_gather", "all_reduce", "slice"})
    return sequence_parallel(graph, tp, world) if sequence else tp


def embedding_weights(graph: Graph) -> list[str]:
    """The parameters that embedding lookups read as their table."""
    return [n.inputs[0] for n in graph.ops if n.op == "aten.embedding.default"
            and graph.node(n.inputs[0]).kind == "param"]


def sequence_parallel(graph: Graph, strategy: Strategy, world: int) -> Strategy:
    """`strategy` with each stretch between its tensor-parallel regions split on a dim of its
    own (the module's rules); the same strategy where no stretch splits."""
    options = dict(strategy.options)
    for stretch in stretches(graph, strategy):
        split = _split_stretch(graph, strategy, stretch, world)
        if split:
            options.update(split)
    return strategy if options == strategy.options else replace(strategy, options=options)


def _whole(option: ShardingOption) -> bool:
    return option.output == R and all(p == R for p in option.inputs)


def stretches(graph: Graph, strategy: Strategy) -> list[list[str]]:
    """The stretches between tensor-parallel regions, each its ops in topological order: the
    ops run whole that read a Partial value made whole, and the ops run whole that read what
    those make, on and on; split into the parts that share no value."""
    home = strategy.home
    whole = {n.name for n in graph.ops if _whole(strategy.options[n.name])}
    readers: dict[str, list[str]] = {}
    for n in graph.ops:
        for t in n.inputs:
            readers.setdefault(t, []).append(n.name)
    reach, todo = set(), [n.name for n in graph.ops if n.name in whole and any(
        isinstance(home(t), Partial) for t in n.inputs)]
    while todo:
        op = todo.pop()
        if op not in reach:
            reach.add(op)
            todo += [r for r in readers.get(op, ()) if r in whole]
    ordered = [n.name for n in graph.ops if n.name in reach]
    return connected(ordered, lambda op: (op, *(t for t in graph.node(op).inputs if t in reach)))


def _split_stretch(graph: Graph, strategy: Strategy, stretch: list[str],
                   world: int) -> dict[str, ShardingOption]:
    """The options that split the stretch's ops on one dim after the batch's: of the dims, the
    one that splits the most of them (the first of those), each op that has such an option
    taking it. The others stay whole, reading split values gathered (an all-gather: with the
    reduce-scatter that entered the stretch, an all-reduce's traffic, as before)."""
    inside = set(stretch)
    rank = max(len(graph.node(op).out.shape) for op in stretch)
    best: dict[str, ShardingOption] = {}
    for d in range(BATCH_DIM + 1, rank):
        chosen = {op: o for op in stretch
                  if (o := _option_on(graph, strategy, op, inside, d, world)) is not None}
        if len(chosen) > len(best):
            best = chosen
    return best


def _option_on(graph: Graph, strategy: Strategy, op: str, inside: set[str], d: int,
               world: int) -> ShardingOption | None:
    """The op's option with output Shard(d) that reads each value of the stretch, and each
    Partial value entering it, as Shard(d), and every other input as the strategy does or, where
    the strategy reads it whole, sliced (a position embedding added to the stretch's values:
    each rank takes its rows, with no traffic); of those, the one that slices fewest."""
    node, was = graph.node(op), strategy.options[op]
    fits = []
    for option in fitting_options(graph, node, world):
        if option.output != Shard(d):
            continue
        sliced = 0
        for t, old, new in zip(node.inputs, was.inputs, option.inputs):
            if t in inside or isinstance(strategy.home(t), Partial):
                ok = new == Shard(d)
            else:
                ok = new == old or old == R and isinstance(new, Shard)
                sliced += new != old
            if not ok:
                break
        else:
            fits.append((sliced, option))
    return min(fits, key=lambda f: f[0])[1] if fits else None
