"""Repeated layers: a transformer stack is N copies of one block. `layer_runs` finds the runs of
consecutive layers (Node.layer) that compute the same thing: the same ops on the same shapes and
arguments, each reading its own parameters (of the same shapes), the layer before it and the
same values from outside; `shortened` cuts runs down to their first few layers, the values
read after a run's last layer read its last kept layer's instead. A short graph lowers, prices
and holds memory as the whole one does, less the cut layers' share: what the planner's ranking
extrapolates from (hidup.planning.extrapolate)."""
from __future__ import annotations

from dataclasses import replace

from hidup.graph.nodes import Graph, Node


def layer_ops(graph: Graph) -> dict[str, tuple[Node, ...]]:
    """Each layer's ops, in graph order, for layers whose ops come one after another (once per
    graph)."""
    cache = graph.__dict__
    if "_layer_ops" not in cache:
        found: dict[str, list[Node]] = {}
        broken: set[str] = set()
        last = None
        for node in graph.ops:
            if node.layer and node.layer in found and last != node.layer:
                broken.add(node.layer)  # its ops are not one stretch
            if node.layer:
                found.setdefault(node.layer, []).append(node)
            last = node.layer
        cache["_layer_ops"] = {layer: tuple(ops) for layer, ops in found.items()
                               if layer not in broken}
    return cache["_layer_ops"]


def layer_runs(graph: Graph) -> tuple[tuple[str, ...], ...]:
    """The runs of two or more layers, each following the one before it in the graph's ops
    with nothing between them, that compute the same thing (once per graph)."""
    cache = graph.__dict__
    if "_layer_runs" not in cache:
        ops = layer_ops(graph)
        runs: list[list[str]] = []
        previous, before = None, None
        for layer, nodes in ops.items():
            sig = _signature(graph, nodes, ops.get(previous, ()))
            if runs and sig == before and _adjacent(graph, ops[previous], nodes):
                runs[-1].append(layer)
            else:
                runs.append([layer])
            previous, before = layer, sig
        cache["_layer_runs"] = tuple(tuple(r) for r in runs if len(r) > 1)
    return cache["_layer_runs"]


def layer_params(graph: Graph, layer: str) -> tuple[str, ...]:
    """The parameters and buffers only `layer`'s ops read, in the order they first read them."""
    cache = graph.__dict__.setdefault("_layer_params", {})
    if layer not in cache:
        nodes = layer_ops(graph)[layer]
        mine = {n.name for n in nodes}
        found = dict.fromkeys(
            t for n in nodes for t in n.inputs if graph.node(t).kind in ("param", "buffer")
            and graph.readers[t] <= mine)
        cache[layer] = tuple(found)
    return cache[layer]


def shortened(graph: Graph, kept: dict[tuple[str, ...], int]) -> Graph:
    """`graph` with each run of `kept` cut to its first kept[run] layers (at least one); what
    read the run's last layer reads its last kept layer (each op where the layer computes it).
    The cut layers' ops and their own parameters are gone."""
    ops = layer_ops(graph)
    rename: dict[str, str] = {}
    gone: set[str] = set()
    for run, count in kept.items():
        last = ops[run[max(count, 1) - 1]]
        for layer in run[max(count, 1):]:
            rename.update((n.name, k.name) for n, k in zip(ops[layer], last))
            gone.update(n.name for n in ops[layer])
            gone.update(layer_params(graph, layer))
    nodes = tuple(n if not any(t in rename for t in n.inputs)
                  else replace(n, inputs=tuple(rename.get(t, t) for t in n.inputs))
                  for n in graph.nodes if n.name not in gone)
    return replace(graph, nodes=nodes, loss=rename.get(graph.loss, graph.loss),
                   updates=tuple(u for u in graph.updates if u[0] not in gone
                                 and u[1] not in gone), _index={})


def _adjacent(graph: Graph, before: tuple[Node, ...], after: tuple[Node, ...]) -> bool:
    """Does `after`'s first op come right after `before`'s last one among the graph's ops?"""
    index = graph.__dict__.setdefault(
        "_op_index", {n.name: i for i, n in enumerate(graph.ops)})
    return index[after[0].name] == index[before[-1].name] + 1


def _signature(graph: Graph, nodes: tuple[Node, ...], previous: tuple[Node, ...]) -> tuple:
    """What a layer computes, alike for two layers that compute the same: per op its op, output,
    arguments and where each input comes from (an op of the layer, of the layer before, one of
    the layer's own parameters, or a value from outside, by name)."""
    here = {n.name: i for i, n in enumerate(nodes)}
    before = {n.name: i for i, n in enumerate(previous)}
    own = {t: i for i, t in enumerate(layer_params(graph, nodes[0].layer))}
    sig = []
    for node in nodes:
        reads = tuple(("in", here[t]) if t in here else ("prev", before[t]) if t in before
                      else ("own", own[t], str(graph.node(t).out)) if t in own else ("out", t)
                      for t in node.inputs)
        sig.append((node.op, str(node.out), repr(node.args), repr(node.kwargs), node.autocast,
                    node.out_index, reads))
    return tuple(sig)


class Cut:
    """A graph whose runs of alike layers are cut to three, the middle one standing for every
    layer between the first and the last (`weights`: how many), for the search's programme
    (hidup.planning.programme): a plan of the short graph is one of the whole graph whose
    layers between a run's first and last do what its middle layer does (`expand`)."""

    def __init__(self, graph: Graph):
        runs = [r for r in layer_runs(graph) if len(r) > 3]
        ops = layer_ops(graph)
        self.whole = graph
        self.short = shortened(graph, {r: 3 for r in runs})
        self.weights: dict[str, int] = {}
        self.names: dict[str, str] = {}  # whole graph's node -> the short graph's that stands
        #   for it (itself where it is kept)
        for run in runs:
            self.weights.update((n.name, len(run) - 2) for n in ops[run[1]])
            for i, layer in enumerate(run[2:], 2):  # the last does what the short third does
                like = run[2] if i == len(run) - 1 else run[1]
                self.names.update((n.name, k.name) for n, k in zip(ops[layer], ops[like]))
                self.names.update(zip(layer_params(graph, layer), layer_params(graph, like)))

    @classmethod
    def of(cls, graph: Graph) -> Cut:
        """The graph's Cut, made once per graph (the search runs a programme per mesh)."""
        if "_cut" not in graph.__dict__:
            graph.__dict__["_cut"] = cls(graph)
        return graph.__dict__["_cut"]

    @property
    def cuts(self) -> bool:
        """Does it cut anything?"""
        return bool(self.weights)

    def name(self, node: str) -> str:
        """The short graph's node that stands for the whole graph's `node`."""
        return self.names.get(node, node)
