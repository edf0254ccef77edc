"""Strategies: one sharding option per op node and a home placement per parameter and input;
greedy propagation from seeds; the fixed expert strategies (data parallel, Megatron tensor
parallel, expert parallel, and on a 2-D mesh the last two inside a machine with data parallel
across); how a strategy reads in a report (describe, summarize). Plan files are in
hidup.planning.planfile.

A 2-D mesh is machines x ranks per machine. Its dim 0 is data parallel: each machine takes an
equal part of the batch and the machines' parameter gradients are summed. Its dim 1 is the
Strategy's placements and options, over one machine's ranks. A strategy with `machines` = 1 is
the 1-D mesh of every rank."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from hidup.graph import ops
from hidup.graph.capture import Graph, Node
from hidup.graph.flops import GROUPED_MM
from hidup.graph.placement import P, R, Partial, Placement, Replicate, Shard, ShardingOption


@dataclass(frozen=True)
class Strategy:
    name: str
    placements: dict[str, Placement] = field(hash=False)  # parameters, buffers, user inputs
    options: dict[str, ShardingOption] = field(hash=False)  # op nodes
    notes: tuple[str, ...] = ()  # where it departs from what its name says, for the reports
    machines: int = 1  # mesh dim 0 (data parallel across); the placements are over mesh dim 1

    def home(self, name: str) -> Placement:
        """Where a tensor lives after it is produced (before any conversion for a consumer)."""
        return self.placements[name] if name in self.placements else self.options[name].output

    def __str__(self) -> str:
        mesh = f" on {self.machines} machines (data parallel across)" if self.machines > 1 else ""
        lines = [f"strategy {self.name}{mesh}"]
        lines += [f"  {n}: {p}" for n, p in self.placements.items()]
        lines += [f"  {n}: {o}" for n, o in self.options.items()]
        return "\n".join(lines)


def conversion(src: Placement, dst: Placement) -> str | None:
    """The collective (or local op) that turns `src` into `dst`; None when they are equal."""
    if src == dst:
        return None
    if isinstance(dst, Replicate):
        return "all_gather" if isinstance(src, Shard) else "all_reduce"
    if isinstance(dst, Shard):
        return {Shard: "all_to_all", Partial: "reduce_scatter", Replicate: "slice"}[type(src)]
    raise ValueError(f"no conversion from {src} to {dst}: nothing becomes Partial")


_COST = {"all_gather": 1.0, "all_reduce": 2.0, "reduce_scatter": 1.0, "slice": 0.0}


def conversion_cost(src: Placement, dst: Placement, nbytes: int, world: int) -> float:
    """Relative traffic of a conversion (ring collectives); used to rank options greedily."""
    kind = conversion(src, dst)
    if kind is None:
        return 0.0
    return nbytes * (1.0 / world if kind == "all_to_all" else _COST[kind])


def splits_evenly(graph: Graph, tensor: str, p: Placement, n: int) -> bool:
    """A Shard placement of the tensor divides its dim into n equal chunks."""
    return not isinstance(p, Shard) or graph.node(tensor).out.shape[p.dim] % n == 0


def fitting_options(graph: Graph, node: Node, n: int) -> tuple[ShardingOption, ...]:
    """The node's options whose every split divides evenly into n (once per graph and n)."""
    cache = graph.__dict__.setdefault("_fitting_options", {})
    key = node.name, n
    if key not in cache:
        cache[key] = tuple(
            o for o in ops.node_options(graph, node)
            if splits_evenly(graph, node.name, o.output, n)
            and all(splits_evenly(graph, t, p, n) for t, p in zip(node.inputs, o.inputs)))
    return cache[key]


def propagate(graph: Graph, world: int, name: str, seeds: dict[str, Placement],
              shard_params: bool, allowed: set[str] | None = None,
              no_partial: set[str] = frozenset(), keep_whole: set[str] = frozenset()
              ) -> Strategy:
    """Greedy in topological order: each op takes the option that needs the least conversion traffic,
    then the fewest conversions, then the most split parameters (if `shard_params`), then split work.
    Parameters are placed by their first consumer; `allowed` limits the conversions used; the
    ops in `no_partial` take no option with a Partial output, those in `keep_whole` no option
    that splits a tensor made of whole (replicated) ones. Fails with Unreachable."""
    placements: dict[str, Placement] = {n.name: R for n in graph.nodes if n.kind == "buffer"}
    placements.update(seeds)
    choices: dict[str, ShardingOption] = {}
    for node in graph.ops:
        cands = [o for o in fitting_options(graph, node, world)
                 if (node.name not in no_partial or not isinstance(o.output, Partial))
                 and (node.name not in keep_whole
                      or not _splits_whole(graph, node, o, placements, choices))]
        scored = [(_score(graph, node, o, placements, choices, world, shard_params, allowed), i, o)
                  for i, o in enumerate(cands)]
        best_score, _, best = min(scored, key=lambda s: (s[0], s[1]))
        if math.isinf(best_score[0]):
            raise Unreachable(f"strategy {name}: node {node.name} ({node.op}) has no option "
                              f"reachable with conversions {sorted(allowed or [])}",
                              _split_origins(graph, node, placements, choices))
        choices[node.name] = best
        for t, p in zip(node.inputs, best.inputs):
            placements.setdefault(t, p)  # a parameter's home is what its first consumer wants
    return Strategy(name, {n.name: placements.get(n.name, R) for n in graph.nodes
                           if n.kind != "op"}, choices)


class NoMicroBatches(ValueError):
    """Some op cannot run on a micro-batch's part of the batch (plain SPMD still can)."""


class Unreachable(ValueError):
    """Greedy propagation found a node with no reachable option. `origins`: the ops upstream of
    it that split a tensor made of whole ones (keeping them whole may make it reachable)."""

    def __init__(self, message: str, origins: set[str]):
        super().__init__(message)
        self.origins = origins


def _split_origins(graph, node: Node, placements, choices) -> set[str]:
    """The ops upstream of node, through split tensors, whose chosen option split whole inputs."""
    found, todo, seen = set(), list(node.inputs), set()
    while todo:
        t = todo.pop()
        if t in seen or t not in choices or choices[t].output == R:
            continue
        seen.add(t)
        producer = graph.node(t)
        if _splits_whole(graph, producer, choices[t], placements, choices):
            found.add(t)
        todo.extend(producer.inputs)
    return found


def _splits_whole(graph, node: Node, opt: ShardingOption, placements, choices) -> bool:
    """Does the option split a tensor made only of whole (replicated) ones?"""
    return opt.output != R and all(
        _placed(t, placements, choices) in (R, None) for t in node.inputs)


def _placed(t: str, placements, choices) -> Placement | None:
    """Where tensor t is so far: an input's or parameter's placement, or its producer's output."""
    if t in placements:
        return placements[t]
    return choices[t].output if t in choices else None


def _score(graph, node: Node, opt: ShardingOption, placements, choices, world, shard_params, allowed):
    comm, n_conv, n_split = 0.0, 0, 0
    for t, want in zip(node.inputs, opt.inputs):
        src = _placed(t, placements, choices)
        if src is None:  # an unplaced parameter goes where this consumer wants it
            if not shard_params and want != R or isinstance(want, Partial):
                return (math.inf,)
            n_split += want != R
            continue
        kind = conversion(src, want) if not isinstance(want, Partial) or src == want else "bad"
        if kind == "bad" or (kind is not None and allowed is not None and kind not in allowed):
            return (math.inf,)
        comm += conversion_cost(src, want, graph.node(t).out.nbytes, world)
        n_conv += kind is not None
    return (comm, n_conv, -n_split, opt.output == R)


def data_parallel(graph: Graph, world: int, batch_dim: int = 0) -> Strategy:
    """DDP: user inputs split along the batch, parameters replicated."""
    seeds = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    return propagate(graph, world, "ddp", seeds, shard_params=False)


def megatron(graph: Graph, world: int) -> Strategy:
    """Megatron-LM tensor parallel: inputs replicated; a linear on a replicated input is split by
    columns, one on a column-split input by rows (Partial output, all-reduced where needed)."""
    seeds = {n.name: R for n in graph.user_inputs}
    return propagate(graph, world, "megatron", seeds, shard_params=True,
                     allowed={"all_gather", "all_reduce", "slice"})


def microbatch_split(graph: Graph, k: int, batch_dim: int = 0, machines: int = 1) -> Strategy:
    """How the k micro-batches of each of `machines` machines (a 2-D mesh's dim 0) split each
    tensor: data parallel over k x machines parts. Shard(d): split along d; R: computed once per
    step on each machine (depends on parameters only, or on a join); P: summed.

    First with no conversion at all, so that every op runs on each micro-batch. Where some op
    cannot (a sort over the whole batch, BatchNorm's statistics over it), with joins: the
    micro-batches' parts of a tensor concatenated (all_gather) or summed (all_reduce) into one
    value of the whole batch, computed once per step, and sliced back for the ops after it."""
    seeds = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    parts = k * machines
    what = f"{k} micro-batches" + (f" on each of {machines} machines" if machines > 1 else "")
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


def _from_batch(graph: Graph) -> set[str]:
    """The tensors computed from the user inputs."""
    found = {n.name for n in graph.user_inputs}
    for node in graph.ops:
        if any(t in found for t in node.inputs):
            found.add(node.name)
    return found


def _one_part(graph: Graph) -> Strategy:
    """The micro-batch split of one part where ops cannot keep a split: every tensor made from
    the batch is held per micro-batch (as P, a sum over the one part: the whole value), the rest
    once per step (R)."""
    per = _from_batch(graph)
    options = {node.name: ShardingOption(tuple(P if t in per else R for t in node.inputs),
                                         P if node.name in per else R) for node in graph.ops}
    return Strategy("micro-batches", {n.name: P if n.name in per else R for n in graph.nodes
                                      if n.kind != "op"}, options)


def random_strategy(graph: Graph, world: int, rng, divide: int | None = None) -> Strategy:
    """A random valid strategy (for tests): each op takes a random option whose Partial inputs come
    from Partial producers and whose splits divide by `divide` (default: world); each input is
    placed at random; a parameter goes where its first consumer wants it. rng: a random.Random."""
    divide = divide or world
    placements: dict[str, Placement] = {n.name: R for n in graph.nodes if n.kind == "buffer"}
    for n in graph.user_inputs:
        dims = [Shard(d) for d, size in enumerate(n.out.shape) if size > 1]
        placements[n.name] = rng.choice([R] + [p for p in dims
                                               if splits_evenly(graph, n.name, p, divide)])
    choices: dict[str, ShardingOption] = {}
    for node in graph.ops:
        cands = [o for o in fitting_options(graph, node, divide)  # Partial only from Partial
                 if all(not isinstance(want, Partial) or _placed(t, placements, choices) == want
                        for t, want in zip(node.inputs, o.inputs))]
        choices[node.name] = rng.choice(cands)
        for t, p in zip(node.inputs, choices[node.name].inputs):
            placements.setdefault(t, p)
    return Strategy("random", {n.name: placements.get(n.name, R) for n in graph.nodes
                               if n.kind != "op"}, choices)


def expert_parallel(graph: Graph, world: int, batch_dim: int = 0) -> Strategy:
    """DeepSpeed-MoE / FastMoE: data parallel, except the experts, split across ranks (each holds
    experts / world of them), reached with all-to-all and left the same way (no partial sums).
    Expert weights are the 3-d parameters that einsums or grouped matmuls read (experts first),
    themselves or through views; a grouped matmul's experts give a Partial sum (each rank its
    experts' rows), all-reduced where it is read. The loss's sum
    over the batch stays a partial sum, as in data parallel."""
    seeds: dict[str, Placement] = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    einsums = {n.name for n in graph.ops if n.op == "aten.einsum.default"}
    for node in graph.ops:
        if node.name in einsums or node.op in GROUPED_MM:
            for t in node.inputs:
                weight = _through_views(graph, t)
                if weight.kind == "param" and len(weight.out.shape) == 3:
                    seeds[weight.name] = Shard(0)
    experts = [n for n, p in seeds.items()
               if isinstance(p, Shard) and graph.node(n).kind == "param"]
    if not experts:
        raise ValueError("strategy expert: the model has no expert weights (3-d parameters read "
                         "by einsums or grouped matmuls); use ddp")
    count = graph.node(experts[0]).out.shape[0]
    if any(graph.node(n).out.shape[0] % world for n in experts):
        raise ValueError(f"strategy expert on {world} GPUs: the {count} experts do not split "
                         f"over {world} ranks; choose a GPU count that divides {count}")
    return propagate(graph, world, "expert", seeds, shard_params=False, no_partial=einsums)


def _through_views(graph: Graph, t: str) -> Node:
    """The tensor that t views (through transposes and views of one input), or t's node."""
    node = graph.node(t)
    while node.kind == "op" and len(node.inputs) == 1 and node.op.split(".")[1] in _VIEWS:
        node = graph.node(node.inputs[0])
    return node


_VIEWS = ("transpose", "permute", "view", "reshape", "t", "contiguous", "_unsafe_view")
FIXED = {"ddp": data_parallel, "megatron": megatron, "expert": expert_parallel}
# on a 2-D mesh: the strategy inside each machine, data parallel across the machines
ACROSS = {"dp-megatron": "megatron", "dp-expert": "expert"}


def fixed_strategies(graph: Graph, world: int, machines: int = 1) -> dict[str, Strategy]:
    """Every fixed strategy that applies to the model and world size (expert needs expert
    weights; none may end up as a replicated run under its own name); on a mesh of `machines`
    > 1 also those of ACROSS."""
    out = {}
    for name in [*FIXED, *(ACROSS if machines > 1 else ())]:
        try:
            out[name] = fixed_strategy(name, graph, world, machines)
        except ValueError:
            continue
    return out


def fixed_strategy(name: str, graph: Graph, world: int, machines: int = 1) -> Strategy:
    """The fixed strategy `name` on `world` ranks; an error where it would not be what its name
    says (a batch that does not split, nothing split at all), with notes where it departs in part
    (tensor-parallel weights left whole because their dims do not divide). The names of FIXED
    span every rank (a 1-D mesh); those of ACROSS need a 2-D mesh of `machines` > 1."""
    if name not in FIXED and name not in ACROSS:
        raise ValueError(f"unknown strategy {name!r}; choose one of "
                         f"{sorted(FIXED) + sorted(ACROSS)} or a plan file")
    if name in FIXED:
        strategy = FIXED[name](graph, world)
        return strategy if world == 1 else _as_named(name, graph, strategy, world)
    if machines < 2 or world % machines:
        raise ValueError(f"strategy {name} runs {ACROSS[name]} inside each machine and data "
                         f"parallel across machines: it needs a 2-D mesh of 2 or more machines "
                         f"that divides the {world} GPUs (--mesh MACHINESxGPUS), not "
                         f"{machines} machine(s)")
    inner = world // machines
    strategy = FIXED[ACROSS[name]](graph, inner)
    strategy = _as_named(name, graph, strategy, inner, machines)
    return Strategy(name, strategy.placements, strategy.options, strategy.notes, machines)


def _as_named(name: str, graph: Graph, strategy: Strategy, world: int,
              machines: int = 1) -> Strategy:
    """`strategy` if it splits what `name` promises on `world` ranks (of each of `machines`
    machines, data parallel across), else a ValueError that says which dims do not divide and
    what would."""
    base = ACROSS.get(name, name)
    split = world * machines if base in ("ddp", "expert") else machines
    for node in graph.user_inputs if split > 1 else ():
        size = node.out.shape[0] if node.out.shape else 1
        if size % split:
            raise ValueError(
                f"strategy {name} on {world * machines} GPUs: the batch of {size} (input "
                f"{node.name}) does not split into {split} equal parts; give a --batch that is "
                f"a multiple of {split}, or a GPU count that divides {size} "
                f"({_divisors(size)})")
    weights = _tensor_parallel_weights(graph) if base == "megatron" else []
    whole = [w for w in weights if strategy.placements.get(w) == R]
    if weights and len(whole) == len(weights) or not _splits_anything(strategy):
        dims = sorted({d for w in weights for d in graph.node(w).out.shape}) or \
            sorted({n.out.shape[0] for n in graph.user_inputs if n.out.shape})
        raise ValueError(
            f"strategy {name} on {world} GPUs splits nothing: no dimension it would split "
            f"({', '.join(map(str, dims))}) divides by {world}, so every op would run "
            f"replicated; choose a GPU count among {_divisors(math.gcd(*dims))} or another "
            f"strategy")
    if whole:
        shapes = ", ".join(f"{w} {list(graph.node(w).out.shape)}" for w in whole[:3])
        more = f" and {len(whole) - 3} more" if len(whole) > 3 else ""
        note = (f"{len(whole)} of {len(weights)} linear weights replicated (no dim divides by "
                f"{world}): {shapes}{more}")
        strategy = Strategy(strategy.name, strategy.placements, strategy.options, (note,))
    return strategy


def _tensor_parallel_weights(graph: Graph) -> list[str]:
    """The 2-d parameters that linear layers read: what Megatron splits."""
    return [t for node in graph.ops if node.op.startswith("aten.linear") for t in node.inputs
            if graph.node(t).kind == "param" and len(graph.node(t).out.shape) == 2]


def _splits_anything(strategy: Strategy) -> bool:
    return any(p != R for o in strategy.options.values() for p in (*o.inputs, o.output))


def _divisors(n: int) -> str:
    found = [d for d in range(2, min(n, 64) + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) if found else "none above 1"


KEY_OPS = ("linear", "einsum", "embedding", "conv", "scaled_dot_product_attention",
           "grouped_mm")
STYLES = ("data parallel", "tensor parallel", "expert parallel", "split otherwise", "replicated")


def op_style(graph: Graph, node: Node, option: ShardingOption) -> str:
    """What an op's option does, in the words of the fixed strategies: 'expert parallel' (it reads
    experts split across the ranks: 3-d weights), 'tensor parallel' (other split weights), 'data
    parallel' (whole weights, the batch dim split), 'split otherwise', or 'replicated'."""
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


def summarize(graph: Graph, strategy: Strategy) -> dict[str, int]:
    """How many of the key ops (linear, einsum, embedding, convolution, attention) each style
    (op_style) runs, in STYLES order, the styles used only."""
    counts = {style: 0 for style in STYLES}
    for node in graph.ops:
        if any(key in node.op for key in KEY_OPS):
            counts[op_style(graph, node, strategy.options[node.name])] += 1
    return {style: n for style, n in counts.items() if n}


def describe(graph: Graph, strategy: Strategy) -> str:
    """One line a user can read: e.g. '16 key ops expert parallel, 41 data parallel' (on a 2-D
    mesh: 'data parallel across 8 machines; inside each: ...')."""
    counts = sorted(summarize(graph, strategy).items(), key=lambda kv: -kv[1])
    across = f"data parallel across {strategy.machines} machines; inside each: " \
        if strategy.machines > 1 else ""
    if not counts:
        return f"{across}no key ops" + uncovered(graph)
    (style, n), rest = counts[0], counts[1:]
    what = f"all {n} key ops {style}" if not rest else \
        ", ".join([f"{n} key ops {style}"] + [f"{m} {s}" for s, m in rest])
    return across + what + uncovered(graph)


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
    '([S(0), R], [R, S(1)]) -> [S(0), S(1)]' (dim 0: across machines; dim 1: inside one). On a
    1-D mesh, the option as it is."""
    inner = strategy.options[node]
    if strategy.machines == 1:
        return str(inner)
    outer = microbatch_split(graph, 1, machines=strategy.machines).options[node]
    ins = ", ".join(f"[{a}, {b}]" for a, b in zip(outer.inputs, inner.inputs))
    return f"({ins}) -> [{outer.output}, {inner.output}]"
