"""A strategy: one sharding option per op node and a home placement per parameter and input;
the conversions between placements; greedy propagation of placements from seeds.

A strategy with no `mesh` is for the 1-D mesh of every rank. On a mesh of 2 or 3 axes
(hidup.strategy.mesh) every axis but one is data parallel (`dp`): each group along them takes
an equal part of the batch and their parameter gradients are summed. The placements and options
split over the other axis' groups (on a 2-D mesh: a machine's GPUs with dp ("machines",), or
one GPU of every machine with dp ("gpus",))."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hidup.graph import ops
from hidup.graph.capture import Graph, Node
from hidup.graph.placement import (R, Partial, Placement, Replicate, Shard, ShardingOption,
                                   is_flat, is_r, plain, same)
from hidup.strategy.mesh import Mesh, dp_axes


@dataclass(frozen=True)
class Strategy:
    name: str
    placements: dict[str, Placement] = field(hash=False)  # parameters, buffers, user inputs
    options: dict[str, ShardingOption] = field(hash=False)  # op nodes
    notes: tuple[str, ...] = ()  # where it departs from what its name says, for the reports
    # the mesh of 2 or 3 axes it is for (None: the 1-D mesh of every rank, of any size)
    mesh: Mesh | None = None
    # on a mesh, the axes it is data parallel over, every axis but one (an axis' name is taken
    # for the 1-tuple); the placements split over the other; () on the 1-D mesh
    dp: tuple[str, ...] = ()
    # parameters stored sharded whose gathered weight is freed after the forward and gathered
    # again for the backward (FSDP's reshard_after_forward), instead of held from one to the other
    reshard: frozenset[str] = field(default=frozenset(), hash=False)
    # on a mesh, parameters stored sharded over the `across_axes` too, each on a dim of its
    # piece: gathered along those axes before the step uses it, its gradient reduce-scattered
    # there instead of all-reduced (FSDP across the data-parallel parts)
    across: dict[str, int] = field(default_factory=dict, hash=False)
    # layers (Node.layer) whose activations are not kept for the backward but recomputed in it,
    # right before the layer's backward (activation checkpointing; hidup.strategy.recompute)
    recompute: frozenset[str] = field(default=frozenset(), hash=False)
    # layers recomputed selectively: their compute-heavy ops' outputs kept (matmuls, attention;
    # hidup.strategy.recompute), the rest recomputed as above
    selective: frozenset[str] = field(default=frozenset(), hash=False)
    # the dp axes `across` stores its parameters sharded over (the rest of dp replicates them:
    # hybrid sharding); () where nothing is stored so
    across_axes: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "dp", dp_axes(self.dp))
        if self.mesh is None or not self.dp:
            if self.mesh is not None or self.dp:
                raise ValueError(f"strategy {self.name}: mesh {self.mesh} with dp axes "
                                 f"{list(self.dp)}: give both, a mesh of 2 or 3 axes and its "
                                 f"data-parallel axes, or neither")
        else:
            if len(self.mesh.shape) not in (2, 3):
                raise ValueError(f"strategy {self.name}: mesh {self.mesh} has "
                                 f"{len(self.mesh.shape)} axes; give 2 or 3, or no mesh")
            self.mesh.split_axis(self.dp)  # every axis but one
            if any(self.mesh.size(a) == 1 for a in self.dp):
                one = next(a for a in self.dp if self.mesh.size(a) == 1)
                raise ValueError(f"strategy {self.name}: its data-parallel axis {one!r} of mesh "
                                 f"{self.mesh} has one rank; give a mesh without it instead")
        if bool(self.across) != bool(self.across_axes) or \
                any(a not in self.dp for a in self.across_axes):
            raise ValueError(f"strategy {self.name}: parameters stored sharded over the axes "
                             f"{list(self.across_axes)} ({len(self.across)} of them): give "
                             f"both, the parameters and some of its dp axes {list(self.dp)}, "
                             f"or neither")

    @property
    def parts(self) -> int:
        """The data-parallel parts of its mesh (the dp axes' size; 1 on a 1-D mesh)."""
        return self.mesh.size(self.dp) if self.mesh else 1

    @property
    def split_axis(self) -> str | None:
        """The mesh axis its placements split over (None on the 1-D mesh)."""
        return self.mesh.split_axis(self.dp) if self.mesh else None

    @property
    def mesh_words(self) -> str:
        """How its mesh divides the work, for reports ('' on a 1-D mesh)."""
        if self.mesh is None:
            return ""
        if len(self.mesh.shape) == 2:
            if self.dp == ("gpus",):
                return f"data parallel over each machine's {self.parts} GPUs; across the machines"
            return f"data parallel across {self.parts} machines; inside each"
        along = " x ".join(f"{a} ({self.mesh.size(a)})" for a in self.dp)
        return f"data parallel along {along}; along {self.split_axis} " \
               f"({self.mesh.size(self.split_axis)})"

    @property
    def split_ops(self) -> int:
        """How many op nodes run on a part of some tensor (not all of it whole)."""
        return sum(any(not is_r(p) for p in (*o.inputs, o.output))
                   for o in self.options.values())

    def storage(self, name: str, world: int) -> tuple[Placement, ...]:
        """Where parameter `name` is stored on a rank: one DTensor placement per axis of the
        plan's mesh (the 1-D mesh of `world` ranks where it has none), as DTensor places its
        shards: a flat home on every axis ([S(d), S(d)]); else its home on the split axis and,
        on a dp axis, Shard(d) where it is stored sharded over that axis too (`across`), else
        Replicate."""
        home = self.home(name)
        if self.mesh is None:
            return (home,)
        if is_flat(home):
            return (plain(home),) * len(self.mesh.names)
        split, across = self.split_axis, self.across.get(name)
        return tuple(home if axis == split else Shard(across)
                     if across is not None and axis in self.across_axes else R
                     for axis in self.mesh.names)

    def home(self, name: str) -> Placement:
        """Where a tensor lives after it is produced (before any conversion for a consumer)."""
        return self.placements[name] if name in self.placements else self.options[name].output

    def __str__(self) -> str:
        mesh = f" ({self.mesh_words})" if self.mesh else ""
        lines = [f"strategy {self.name}{mesh}"]
        lines += [f"  {n}: {p}" for n, p in self.placements.items()]
        lines += [f"  {n}: {o}" for n, o in self.options.items()]
        lines += [f"  recomputed in the backward: {', '.join(sorted(self.recompute))}"] \
            if self.recompute else []
        lines += [f"  recomputed selectively: {', '.join(sorted(self.selective))}"] \
            if self.selective else []
        return "\n".join(lines)


def conversion(src: Placement, dst: Placement) -> str | None:
    """The collective (or local op) that turns `src` into `dst`; None when they are equal."""
    if same(src, dst):
        return None
    if isinstance(dst, Replicate):
        return "all_gather" if isinstance(src, Shard) else "all_reduce"
    if isinstance(dst, Shard):
        return "all_to_all" if isinstance(src, Shard) else "reduce_scatter" \
            if isinstance(src, Partial) else "slice"
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
        if t in seen or t not in choices or is_r(choices[t].output):
            continue
        seen.add(t)
        producer = graph.node(t)
        if _splits_whole(graph, producer, choices[t], placements, choices):
            found.add(t)
        todo.extend(producer.inputs)
    return found


def _splits_whole(graph, node: Node, opt: ShardingOption, placements, choices) -> bool:
    """Does the option split a tensor made only of whole (replicated) ones?"""
    return not is_r(opt.output) and all(
        is_r(placed(t, placements, choices)) or placed(t, placements, choices) is None
        for t in node.inputs)


def placed(t: str, placements, choices) -> Placement | None:
    """Where tensor t is so far: an input's or parameter's placement, or its producer's output."""
    if t in placements:
        return placements[t]
    return choices[t].output if t in choices else None


def _score(graph, node: Node, opt: ShardingOption, placements, choices, world, shard_params, allowed):
    comm, n_conv, n_split = 0.0, 0, 0
    for t, want in zip(node.inputs, opt.inputs):
        src = placed(t, placements, choices)
        if src is None:  # an unplaced parameter goes where this consumer wants it
            if not shard_params and not is_r(want) or isinstance(want, Partial):
                return (math.inf,)
            n_split += not is_r(want)
            continue
        kind = conversion(src, want) if not isinstance(want, Partial) or same(src, want) \
            else "bad"
        if kind == "bad" or (kind is not None and allowed is not None and kind not in allowed):
            return (math.inf,)
        comm += conversion_cost(src, want, graph.node(t).out.nbytes, world)
        n_conv += kind is not None
    return (comm, n_conv, -n_split, is_r(opt.output))
