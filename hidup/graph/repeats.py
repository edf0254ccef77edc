"""Repeated layers: a transformer stack is N copies of one block. `layer_runs` finds the runs of
consecutive blocks of layers (Node.layer) that compute the same thing: the same ops on the same
shapes and arguments, each reading its own parameters (of the same shapes), the block before it
and the same values from outside. A block is one layer where every layer is alike, or a few
consecutive ones where kinds of layer alternate (a dense layer and a mixture-of-experts one: a
block of two). `shortened` cuts runs down to their first few blocks, the values read after a
run's last block read its last kept block's instead. A short graph lowers, prices and holds
memory as the whole one does, less the cut blocks' share: what the planner's ranking
extrapolates from (hidup.planning.extrapolate)."""
from __future__ import annotations

from dataclasses import replace

from hidup.graph.nodes import Graph, Node

PERIOD = 4  # the most layers a block holds
Block = tuple  # the names of consecutive layers, in order (one or more)


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


def block_ops(graph: Graph, block: Block) -> tuple[Node, ...]:
    """The ops of a block's layers, in graph order."""
    ops = layer_ops(graph)
    return tuple(n for layer in block for n in ops[layer])


def block_params(graph: Graph, block: Block) -> tuple[str, ...]:
    """The parameters and buffers only one of a block's layers reads, in the order they are
    first read."""
    return tuple(dict.fromkeys(t for layer in block for t in layer_params(graph, layer)))


def layer_runs(graph: Graph) -> tuple[tuple[Block, ...], ...]:
    """The runs of two or more blocks, each following the one before it in the graph's ops with
    nothing between them, that compute the same thing (once per graph). From each layer on, in
    order, the run of blocks of 1 to PERIOD layers that covers the most layers is taken (of
    those, the one of the shortest blocks); a layer no run starts at stands alone."""
    cache = graph.__dict__
    if "_layer_runs" not in cache:
        names, runs, i = list(layer_ops(graph)), [], 0
        while i < len(names):
            count, period = max(((_run_length(graph, names, i, p), p)
                                 for p in range(1, PERIOD + 1)),
                                key=lambda c: (c[0] * c[1] if c[0] > 1 else 0, -c[1]))
            if count > 1:
                runs.append(tuple(tuple(names[i + j * period:i + (j + 1) * period])
                                  for j in range(count)))
                i += count * period
            else:
                i += 1
        cache["_layer_runs"] = tuple(runs)
    return cache["_layer_runs"]


def _run_length(graph: Graph, names: list[str], i: int, p: int) -> int:
    """How many blocks of p layers from names[i] on compute what the first one does, each right
    after the one before it (0 where there is no block of p layers there)."""
    def block(j: int) -> Block | None:
        layers = tuple(names[i + j * p:i + (j + 1) * p])
        ops = [layer_ops(graph)[layer] for layer in layers]
        whole = len(layers) == p and all(_adjacent(graph, a, b) for a, b in zip(ops, ops[1:]))
        return layers if whole else None

    first = block(0)
    if first is None:
        return 0
    sig = _signature(graph, first, tuple(names[max(i - p, 0):i]))
    count, previous = 1, first
    while (nxt := block(count)) is not None and _adjacent(
            graph, block_ops(graph, previous), block_ops(graph, nxt)) and \
            _signature(graph, nxt, previous) == sig:
        count, previous = count + 1, nxt
    return count


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


def shortened(graph: Graph, kept: dict[tuple[Block, ...], int]) -> Graph:
    """`graph` with each run of blocks of `kept` cut to its first kept[run] blocks (at least
    one); what read the run's last block reads its last kept block (each op where the block
    computes it). The cut blocks' ops and their own parameters are gone."""
    rename: dict[str, str] = {}
    gone: set[str] = set()
    for run, count in kept.items():
        last = block_ops(graph, run[max(count, 1) - 1])
        for block in run[max(count, 1):]:
            mine = block_ops(graph, block)
            rename.update((n.name, k.name) for n, k in zip(mine, last))
            gone.update(n.name for n in mine)
            gone.update(block_params(graph, block))
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


def _signature(graph: Graph, block: Block, previous: Block) -> tuple:
    """What a block computes, alike for two blocks that compute the same: per op its op, output,
    arguments and where each input comes from (an op of the block; of the layers before it,
    counted from their last op; one of the block's own parameters; or a value from outside, by
    name)."""
    nodes, previous = block_ops(graph, block), block_ops(graph, previous)
    here = {n.name: i for i, n in enumerate(nodes)}
    before = {n.name: i - len(previous) for i, n in enumerate(previous)}
    own = {t: i for i, t in enumerate(block_params(graph, block))}
    sig = []
    for node in nodes:
        reads = tuple(("in", here[t]) if t in here else ("prev", before[t]) if t in before
                      else ("own", own[t], str(graph.node(t).out)) if t in own else ("out", t)
                      for t in node.inputs)
        sig.append((node.op, str(node.out), repr(node.args), repr(node.kwargs), node.autocast,
                    node.out_index, reads))
    return tuple(sig)


class Cut:
    """A graph whose runs of alike blocks are cut to three, the middle one standing for every
    block between the first and the last (`weights`: how many), for the search's programme
    (hidup.planning.programme): a plan of the short graph is one of the whole graph whose
    blocks between a run's first and last do what its middle block does (`expand`)."""

    def __init__(self, graph: Graph):
        runs = [r for r in layer_runs(graph) if len(r) > 3]
        self.whole = graph
        self.short = shortened(graph, {r: 3 for r in runs})
        self.weights: dict[str, int] = {}
        self.names: dict[str, str] = {}  # whole graph's node -> the short graph's that stands
        #   for it (itself where it is kept)
        for run in runs:
            self.weights.update((n.name, len(run) - 2) for n in block_ops(graph, run[1]))
            for i, block in enumerate(run[2:], 2):  # the last does what the short third does
                like = run[2] if i == len(run) - 1 else run[1]
                self.names.update((n.name, k.name) for n, k in
                                  zip(block_ops(graph, block), block_ops(graph, like)))
                self.names.update(zip(block_params(graph, block), block_params(graph, like)))

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
