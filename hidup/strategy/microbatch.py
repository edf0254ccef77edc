"""How Duplex's micro-batches split each tensor of a graph: data parallel over the micro-batches,
with joins where an op needs the whole batch."""
from __future__ import annotations

from dataclasses import replace

from hidup.graph.capture import Graph
from hidup.graph.placement import P, R, Shard, ShardingOption
from hidup.strategy.base import NoMicroBatches, Strategy, Unreachable, propagate

def microbatch_split(graph: Graph, k: int, batch_dim: int = 0, dp: int = 1) -> Strategy:
    """How the k micro-batches of each of `dp` data-parallel parts (a 2-D mesh's dp axis,
    hidup.strategy.Strategy.parts) split each tensor: data parallel over k x dp parts. Shard(d):
    split along d; R: computed once per step in each part (depends on parameters only, or on a
    join); P: summed.

    First with no conversion at all, so that every op runs on each micro-batch. Where some op
    cannot (a sort over the whole batch, BatchNorm's statistics over it), with joins: the
    micro-batches' parts of a tensor concatenated (all_gather) or summed (all_reduce) into one
    value of the whole batch, computed once per step, and sliced back for the ops after it."""
    seeds = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    parts = k * dp
    what = f"{k} micro-batches" + (f" on each of {dp} data-parallel parts" if dp > 1 else "")
    for n in graph.user_inputs:
        if n.out.shape[batch_dim] % parts:
            raise ValueError(f"input {n.name}: batch of {n.out.shape[batch_dim]} (dim {batch_dim} of "
                             f"{n.out.shape}) does not split into {what}; choose a "
                             f"batch divisible by {parts}")
    cache = graph.__dict__.setdefault("_microbatch_splits", {})  # the search lowers dozens
    if (batch_dim, parts) not in cache:
        keep: set[str] = set()  # ops that must keep whole what is made of whole tensors
        first = None
        while (batch_dim, parts) not in cache:
            try:
                # one part: a slice of a whole tensor is the identity (read where it is whole)
                cache[batch_dim, parts] = propagate(graph, parts, "micro-batches", seeds,
                                                    shard_params=False,
                                                    allowed={"slice"} if parts == 1 else set(),
                                                    keep_whole=keep)
            except Unreachable as exc:
                if exc.origins - keep:
                    keep |= exc.origins
                elif parts == 1:  # nothing to split: each op sees the whole batch
                    cache[batch_dim, parts] = _one_part(graph)
                else:
                    cache[batch_dim, parts] = _with_joins(graph, parts, seeds, first or exc)
                first = first or exc
    return cache[batch_dim, parts]


def _with_joins(graph: Graph, parts: int, seeds, first: Exception) -> Strategy:
    """The micro-batch split where some op needs the whole batch: joins (all_gather: concatenate
    the parts, all_reduce: sum them) and slices allowed, the fewest bytes joined first."""
    try:
        split = propagate(graph, parts, "micro-batches", seeds, shard_params=False,
                          allowed={"all_gather", "all_reduce", "slice"})
    except Unreachable as exc:  # the first op that could not take a micro-batch
        raise NoMicroBatches(f"the batch cannot be split into micro-batches: {first}") from exc
    return replace(split, notes=(f"micro-batches joined where {first}",))


def _one_part(graph: Graph) -> Strategy:
    """The micro-batch split of one part where ops cannot keep a split: every tensor made from
    the batch is held per micro-batch (as P, a sum over the one part: the whole value), the rest
    once per step (R)."""
    per = graph.from_inputs
    options = {node.name: ShardingOption(tuple(P if t in per else R for t in node.inputs),
                                         P if node.name in per else R) for node in graph.ops}
    return Strategy("micro-batches", {n.name: P if n.name in per else R for n in graph.nodes
                                      if n.kind != "op"}, options)
