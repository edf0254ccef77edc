"""Duplex-aware sharding search's dynamic programme (the paper's Algorithm 1): over the cuts of the
graph in topological order. A state is the placements of the tensors live at a cut; each label
on it carries the time so far T, the debt D (the other micro-batch's computation still pending
that the next stage's communication can hide), the memory M the plan holds, and the plan's time
so far with one micro-batch (plain SPMD), since a plan runs with k micro-batches or with one,
whichever is faster. Which labels and states are kept: hidup.planning.beam. So one programme
does what a Duplex-priced and a plain programme did (issue 19: the Duplex-priced one alone
missed plans the plain one found; two cost the time twice).

Stage model for k micro-batches, a node costing c of computation and m of communication (what
they count: hidup.planning.pricing):
  m = 0:  T += c,  D += (k-1) c            (micro-batch 0 runs on; the others owe it)
  m > 0:  T += max(D, m) + c,  D = (k-1) c + max(0, m - c)
and the plan costs T + D. The optimizer's update of the node's parameter shards adds to T: it
runs after the backward, hiding nothing and hidden by nothing. With k = 1 it is plain SPMD:
T += m + c. With one micro-batch the model is linear: hidup.planning.exact solves it as an
integer programme. The search (hidup.planning.search) lowers and ranks the programme's best plans.

On a 2-D mesh (SearchOptions.mesh, data parallel over its axis SearchOptions.dp) the programme
chooses each op's option over a row of the mesh (the other axis' group), on its part of the
batch, or (SearchOptions.flat) over every rank of the mesh flattened (hidup.graph.placement's
flat options: experts split over every GPU beside attention split inside a machine), priced as
hidup.planning.pricing says."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from hidup.cli.progress import progress
from hidup.graph.capture import Graph, Node
from hidup.graph.repeats import Cut
from hidup.graph.placement import (Partial, Placement, R, Shard, ShardingOption, flat_option,
                                   is_flat, same)
from hidup.planning.beam import Beam, _Label
from hidup.planning.costs import Profile
from hidup.planning.pricing import Pricing, _NodeCost, _scaled
from hidup.strategy import Mesh, Strategy, dp_axes, fitting_options, microbatch_split
from hidup.strategy.recompute import recomputable_share
from hidup.program.conversions import Layouts
from hidup.program.tasks import LoweringError, Shapes, optimizer_cost

_NOTHING: frozenset = frozenset()
_GRAD = "grad"  # in a state's converted-to set: the tensor's replicated gradient is a Partial
#   sum, whose reduction is charged (to the first consumer that makes it one)


class _Cut(NamedTuple):
    """The programme's keys around one node. A key holds a value per live tensor: first those
    the node neither reads nor makes, in the order they had before it, then those it does."""
    live: tuple[str, ...]  # the tensors live before the node, in its key's order
    reads: tuple[int, ...]  # per input of the node, its position in that key (-1: none yet)
    kept: tuple[int, ...]  # the positions in that key of the tensors that pass the node
    touched: tuple[str, ...]  # the tensors it reads or makes that stay live after it
    after: tuple[str, ...]  # the tensors live after it, in the next key's order


@dataclass(frozen=True)
class SearchOptions:
    """What a search is asked for, beside the graph, the world size and the profile."""

    k: int = 2  # micro-batches (Duplex); the plans are also priced with one
    memory: float | None = None  # bytes a device holds (None: no limit)
    optimizer: str = "adamw"  # whose update time and state memory count (hidup.program.OPTIMIZERS)
    # the mesh of the world to search on, of 2 or 3 axes (None: the 1-D mesh;
    # hidup.planning.search also searches the 1-D mesh beside it)
    mesh: Mesh | None = None
    # the programme's data-parallel axes of `mesh`, every axis but one (the search runs one
    # programme per split axis); () on the 1-D mesh
    dp: tuple[str, ...] = ()
    beam: int = 16  # states kept per cut
    labels: int = 4  # labels kept per state
    keep: int = 3  # plans of the programme lowered and estimated per order
    exact: float = 0.0  # seconds for the integer programme's proof of the k = 1 plan (0: none)
    objective: str = "time"  # 'time', or 'comm': the fewest bytes communicated
    # layers whose activations every plan recomputes in the backward; None: a plan that does not
    # fit is also tried with the fewest first layers recomputed that make it fit
    recompute: frozenset[str] | None = None
    selective: bool = False  # those layers recomputed selectively (their matmuls' and
    #                          attention's outputs kept)
    mode: str = "graph"  # the executor mode whose costs the estimate ranks plans by (its host
    #   time per task where the profile has host figures; 'compile': Inductor's fused kernels)
    flat: bool = True  # on a mesh data parallel over every axis outside its innermost (2-D:
    #   its machines), also each op's options over every rank (flat placements), beside those
    #   over a row's ranks
    extrapolate: int = 1000  # graphs of this many ops or more, where they repeat layers, are
    #   ranked from short copies (hidup.planning.extrapolate; smaller ones lower in well under
    #   a second); the chosen plan is always lowered whole

    def __post_init__(self):
        object.__setattr__(self, "dp", dp_axes(self.dp))


class Search(Pricing, Beam):
    """One search: a graph, a world size, a profile, k micro-batches, an objective, the
    optimizer that will run (its update time and its state's memory)."""

    def __init__(self, graph: Graph, world: int, profile: Profile,
                 options: SearchOptions = SearchOptions(), cut: Cut | None = None):
        """`cut`: search its short graph instead of `graph` (its whole one), each node of
        a run's middle layer priced as the layers it stands for (Cut.weights), and give
        plans of the whole graph (strategy)."""
        if cut is not None:
            graph = cut.short
        self.cut = cut
        self.weights = {} if cut is None else cut.weights
        if options.objective not in ("time", "comm"):
            raise ValueError(f"objective {options.objective!r}: choose 'time' or 'comm'")
        k, self.options = options.k, options
        memory, objective, beam = options.memory, options.objective, options.beam
        self.optimizer = optimizer_cost(options.optimizer)
        self.g, self.profile, self.k = graph, profile, k
        mesh, dp = options.mesh or Mesh.line(world), options.dp
        if mesh.world != world or (options.mesh is None) != (not dp):
            raise ValueError(f"search options: mesh {options.mesh} with dp axes {list(dp)} for "
                             f"{world} GPUs; give a mesh of the world and every axis of it but "
                             f"one, or neither")
        self.dp_parts = mesh.size(dp)  # the mesh's data-parallel parts
        self.world = world // self.dp_parts  # placements: a row's ranks
        self.memory, self.objective, self.beam = memory or math.inf, objective, beam
        self.least_over = math.inf  # the least memory of a label over the limit at this node
        self.per_state = options.labels
        self.mbs = microbatch_split(graph, k, dp=self.dp_parts)
        rows = mesh.rows(dp)
        self.group, self.everyone = rows[0], tuple(range(world))
        self.row_load = profile.link_load(rows[0], rows)  # rows crossing one link share it
        self.position = {n.name: i for i, n in enumerate(graph.ops)}
        self.last: dict[str, int] = {}  # tensor -> position of its last consumer
        self.first: dict[str, int] = {}  # tensor -> position of its first consumer
        for node in graph.ops:
            for t in node.inputs:
                self.last[t] = max(self.last.get(t, -1), self.position[node.name])
                self.first.setdefault(t, self.position[node.name])
        self.placeholders = {n.name for n in graph.nodes if n.kind != "op"}
        self.kept_share = recomputable_share(graph if cut is None else cut.whole,
                                             options.recompute)  # its layers, every one
        self.grads = graph.gradients  # the tensors with a gradient
        self.reduced = self.grads - {p.name for p in graph.params}  # whose replicated value's
        #   Partial gradient a conversion's dual or an all-reduce makes whole (parameters':
        #   node_cost's `grads`)
        self._cuts = self._cut_plans()
        self._values: list[tuple] = []  # a key holds each (home, converted-to) as its index here
        self._ids: dict[tuple, int] = {}
        self.labels = 0
        # The layers repeat: tensors alike (shape, dtype, micro-batch split, with a gradient or
        # not) convert alike, and nodes alike (op, arguments, inputs alike, which parameters
        # they are the home of) cost alike: each is priced once.
        kinds: dict[tuple, int] = {}
        self.alike = {n.name: kinds.setdefault((n.out.shape, n.out.dtype, self.mbs.home(n.name),
                                                n.name in self.grads), len(kinds))
                      for n in graph.nodes}
        self._converts: dict[tuple, float] = {}  # (alike, src, dst) -> seconds
        self._node_kinds: dict[str, tuple] = {}  # node -> what it costs alike with
        self._node_costs: dict[tuple, _NodeCost] = {}  # (node kind, option) -> node_cost
        self._conversions: dict[tuple, float] = {}  # _collectives' key -> seconds
        shapes = Shapes(graph, self.mbs, self.world, k * self.dp_parts, self.dp_parts)
        self.shape, self.nbytes = shapes.shape, shapes.nbytes  # (tensor, placement) -> local
        self.itemsize = shapes.itemsize
        self.mesh, self.layouts = mesh, Layouts(graph, self.mbs, mesh, dp, k)
        # what prices each label's `plain` time: this programme at k = 1, another (the same
        # graph with one micro-batch) at k > 1; none for objective 'comm' at k > 1
        self.plain: Search | None = self if k == 1 else None
        if k > 1 and objective == "time":
            self.plain = Search(graph, world, profile, replace(options, k=1), cut)

    # -- the dynamic programme ----------------------------------------------------------------
    def run(self) -> list[_Label]:
        """The labels of the last cut, best first (each with k micro-batches or one)."""
        states: dict[tuple, list[_Label]] = {(): [_Label(0.0, 0.0, 0.0, 0.0)]}
        what = self.what()
        for i, node in enumerate(self.g.ops):
            progress(what, i + 1, len(self.g.ops))
            self.least_over = math.inf
            states = self.extend(states, node)
            if not states:
                least = "" if self.least_over == math.inf else \
                    f" (the least a plan holds up to it: {self.least_over / 2**30:.3g} GiB)"
                raise ValueError(f"search: no option of node {node.name} ({node.op}) fits in "
                                 f"{self.memory / 2**30:.3g} GiB per device{least} or divides "
                                 f"evenly")
        finals = [label for labels in states.values() for label in labels]
        return sorted(finals, key=lambda lab: lab.best)

    def what(self) -> str:
        """The programme, for the progress line: its mesh and micro-batches."""
        mesh = self.options.mesh
        mesh = f"{self.world} GPUs" if mesh is None else \
            f"the {'x'.join(map(str, mesh.shape))} mesh, data parallel over " \
            f"{', '.join(self.options.dp)}"
        return f"search on {mesh}, k={self.k}: op"

    def extend(self, states, node: Node) -> dict[tuple, list[_Label]]:
        """Every label of every state, extended by every option of the node."""
        options = []
        for opt in self.node_options(node):
            try:
                options.append((opt, *self.costs(node, opt)))
            except LoweringError:
                continue  # a split that does not divide with the micro-batches
        cut = self._cuts[self.position[node.name]]
        weight = self.weights.get(node.name, 1)
        out: dict[tuple, list[_Label]] = {}
        steps: dict[tuple, tuple | None] = {}  # states differ mostly in what the node does not
        for key, labels in states.items():  # read: one step per option and values it reads
            ins = tuple(map((key + (-1,)).__getitem__, cut.reads))  # -1: not placed yet
            untouched = tuple(map(key.__getitem__, cut.kept))
            for i, (opt, cost, plain) in enumerate(options):
                if (i, ins) not in steps:
                    steps[i, ins] = self._step(node, opt, cost is not None, ins)
                if steps[i, ins] is None:
                    continue
                comm, comm1, touched = steps[i, ins]
                if weight != 1:
                    comm, comm1 = comm * weight, comm1 * weight
                self.add(out, untouched + touched,
                         self.advance(labels, node, opt, comm, cost, comm1, plain))
        return self.prune(out)

    def node_options(self, node: Node) -> list[ShardingOption]:
        """The node's options over a machine's ranks, and on a 2-D mesh with SearchOptions.flat
        its options over every rank (flat)."""
        opts = list(fitting_options(self.g, node, self.world))
        if self.options.mesh and self.options.mesh.outside(self.options.dp) and \
                self.options.flat:
            opts += [flat_option(o) for o in fitting_options(self.g, node,
                                                             self.world * self.dp_parts)]
        return opts

    def placeholder_home(self, t: str, want: Placement) -> Placement | None:
        """Where a parameter, buffer or input lives, read first as `want`: there, but an input
        read flat lives over a machine's ranks, split over the batch as the data loader gives
        it (None where it is not: it cannot reach a flat placement)."""
        if not is_flat(want) or self.g.node(t).kind != "input":
            return want
        home = self.mbs.home(t)
        return home if isinstance(home, Shard) else None

    # A state (the key of the programme's labels at a cut) holds, for each tensor live at that
    # cut, its home placement and the placements it was converted to for earlier consumers: as
    # the lowering does, a tensor is converted to a placement once, however many read it there.
    # The live tensors of a cut are the same in every state, so a key is just their values, in
    # the order live(node) names them, each value interned as a number (fast to hash).
    def _cut_plans(self) -> list[_Cut]:
        plans, live = [], ()
        for i, node in enumerate(self.g.ops):
            slots = {t: s for s, t in enumerate(live)}
            touched = tuple(t for t in dict.fromkeys((*node.inputs, node.name))
                            if self.last.get(t, -1) > i)
            kept = tuple(s for s, t in enumerate(live) if t not in touched and self.last[t] > i)
            plans.append(_Cut(live, tuple(slots.get(t, -1) for t in node.inputs), kept, touched,
                              tuple(live[s] for s in kept) + touched))
            live = plans[-1].after
        return plans

    def live(self, node: Node, after: bool = False) -> tuple[str, ...]:
        """The tensors a state before (or after) the node holds, in its key's order."""
        cut = self._cuts[self.position[node.name]]
        return cut.after if after else cut.live

    def _id(self, value: tuple) -> int:
        if value not in self._ids:
            self._ids[value] = len(self._values)
            self._values.append(value)
        return self._ids[value]

    def state(self, node: Node, placed: dict[str, tuple]) -> tuple:
        """The key before the node of {tensor: (home, converted-to)} for each live tensor."""
        return tuple(self._id(placed[t]) for t in self.live(node))

    def placed(self, node: Node, key: tuple, after: bool = False) -> dict[str, tuple]:
        """What a key before (or after) the node holds: {tensor: (home, converted-to)}."""
        return {t: self._values[v] for t, v in zip(self.live(node, after), key)}

    def transition(self, key: tuple, node: Node, opt: ShardingOption, duplex: bool = True):
        """(communication per micro-batch with k micro-batches (infinite where not `duplex`),
        the same with one, the key after the node), from the key before it, or None if the
        option is invalid there."""
        cut = self._cuts[self.position[node.name]]
        step = self._step(node, opt, duplex, tuple(key[s] if s >= 0 else -1 for s in cut.reads))
        if step is None:
            return None
        comm, comm1, touched = step
        return comm, comm1, tuple(key[s] for s in cut.kept) + touched

    def _step(self, node: Node, opt: ShardingOption, duplex: bool, ins: tuple):
        """transition() for the node's inputs' values `ins` (-1: not placed yet): the
        communication with k micro-batches and with one, and the values after it of the
        tensors it reads or makes that stay live (_Cut.touched)."""
        comm, comm1, updated = 0.0 if duplex else math.inf, 0.0, {}
        for t, want, value in zip(node.inputs, opt.inputs, ins):
            if t in updated:  # read twice by the node
                home, made = self._values[updated[t]]
            elif value >= 0:
                home, made = self._values[value]
            elif t in self.placeholders:  # an input or parameter goes where its first
                home = self.placeholder_home(t, want)  # consumer wants it
                if isinstance(want, Partial) or home is None:
                    return None
                made = _NOTHING
            else:
                return None
            if isinstance(want, Partial) and not same(home, want):
                return None
            if is_flat(want) != is_flat(home) and not isinstance(self.mbs.home(t), Shard):
                return None  # only a tensor split over the batch passes between the scopes
            if not same(want, home) and want not in made:
                if duplex:
                    try:
                        comm += self.conversion_cost(t, home, want)
                    except LoweringError:  # its home does not split into k micro-batches
                        comm = math.inf  # (made by an op that runs with one only)
                if self.plain is not None and self.plain is not self:
                    comm1 += self.plain.conversion_cost(t, home, want)
                made = made | {want}
            if opt.partial_gradient(want) and t in self.reduced and _GRAD not in made:
                if duplex:  # the first consumer to make t's gradient a Partial sum
                    try:
                        comm += self.partial_grad_cost(t, home)
                    except LoweringError:  # as above
                        comm = math.inf
                if self.plain is not None and self.plain is not self:
                    comm1 += self.plain.partial_grad_cost(t, home)
                made = made | {_GRAD}
            updated[t] = self._id((home, made))
        updated[node.name] = self._id((opt.output, _NOTHING))
        return (comm, comm if self.plain is self else comm1,
                tuple(updated[t] for t in self._cuts[self.position[node.name]].touched))

    def advance(self, labels: list[_Label], node, opt, comm: float, cost: _NodeCost | None,
                comm1: float = math.inf, plain: _NodeCost | None = None) -> list[_Label]:
        """The labels after the node (one per label before it): its stage on the micro-batches'
        timeline, its communication the input conversions' and a k-th of its parameters'
        gradient reductions; and its time with one micro-batch (`comm1`, `plain`: the same
        priced at k = 1). One call per state and option: this runs a million times."""
        self.labels += len(labels)
        name, k = node.name, self.k
        new = tuple.__new__  # _Label(...) without its Python-level __new__: twice as fast
        if plain is not None and self.plain is not self:  # its time with one micro-batch
            g1, c1, u1 = plain.grads, plain.compute, plain.update
        else:  # none, or (k = 1) the time itself
            comm1, g1, c1, u1 = math.inf, 0.0, 0.0, 0.0
        if cost is None:  # its splits do not divide by k micro-batches
            return [new(_Label, (math.inf, math.inf, lab.memory + plain.memory,
                                 lab.plain + comm1 + g1 + c1 + u1, name, opt, lab))
                    for lab in labels]
        memory = cost.memory if plain is None else min(cost.memory, plain.memory)  # where it
        # fits with one micro-batch, it can run (the limit, and which label is leanest)
        comm += cost.grads / k
        compute, update = cost.compute, cost.update
        # one comprehension per case, each label's fields written out: the sums in the same
        # order as the stage model above
        if k == 1 or self.objective == "comm":
            same = self.plain is self
            return [new(_Label, (t, 0.0, lab.memory + memory, t if same else math.inf, name,
                                 opt, lab))
                    for lab in labels for t in [lab.time + comm + compute + update]]
        if comm == 0.0:
            owed = (k - 1) * compute
            return [new(_Label, (lab.time + compute + update, lab.debt + owed,
                                 lab.memory + memory, lab.plain + comm1 + g1 + c1 + u1, name,
                                 opt, lab)) for lab in labels]
        owed = (k - 1) * compute + max(0.0, comm - compute)
        return [new(_Label, (lab.time + (lab.debt if lab.debt > comm else comm) + compute
                             + update, owed, lab.memory + memory,
                             lab.plain + comm1 + g1 + c1 + u1, name, opt, lab))
                for lab in labels]

    def price(self, strategy: Strategy) -> float:
        """The programme's cost of one given plan with k micro-batches (as its own labels would
        price it)."""
        label, key = _Label(0.0, 0.0, 0.0, 0.0), ()
        for node in self.g.ops:
            opt = strategy.options[node.name]
            step = self.transition(key, node, opt)
            if step is None:
                raise ValueError(f"plan {strategy.name}: node {node.name} takes an input it "
                                 f"cannot have")
            comm, _, key = step
            weight = self.weights.get(node.name, 1)
            label, = self.advance([label], node, opt, comm * weight,
                                  _scaled(self.node_cost(node, opt), weight))
        return label.cost

    def add(self, out: dict, key: tuple, new: list[_Label]) -> None:
        """Add the labels to the state `key` but those over the memory limit (prune() drops
        the dominated ones of the states it keeps)."""
        limit = self.memory
        fits = new if limit == math.inf else [label for label in new if label.memory <= limit]
        if fits:
            out.setdefault(key, []).extend(fits)
        elif new:  # for run's error, where nothing fits
            self.least_over = min(self.least_over, min(label.memory for label in new))

    def strategy(self, label: _Label, name: str) -> Strategy:
        """The label's plan, of the whole graph (expand)."""
        options: dict[str, ShardingOption] = {}
        while label is not None and label.option is not None:
            options[label.node] = label.option
            label = label.back
        return self.expand(self.plan(options, name))

    def expand(self, strategy: Strategy) -> Strategy:
        """A plan of the graph searched as one of the whole graph: each layer a run's middle
        layer stands for does what that one does (the plan itself where nothing was cut)."""
        if self.cut is None:
            return strategy
        name, nodes = self.cut.name, self.cut.whole.nodes
        return replace(strategy, options={n.name: strategy.options[name(n.name)]
                                          for n in nodes if n.kind == "op"},
                       placements={n.name: strategy.placements[name(n.name)]
                                   for n in nodes if n.kind != "op"})

    def plan(self, options: dict[str, ShardingOption], name: str) -> Strategy:
        """The strategy of one option per node: parameters and inputs live where their first
        consumer reads them."""
        options = {n.name: options[n.name] for n in self.g.ops}
        placements: dict[str, Placement] = {}
        for node in self.g.ops:
            for t, p in zip(node.inputs, options[node.name].inputs):
                if t in self.placeholders:
                    placements.setdefault(t, self.placeholder_home(t, p))
        placements = {n.name: placements.get(n.name, R) for n in self.g.nodes if n.kind != "op"}
        return Strategy(name, placements, options, mesh=self.options.mesh, dp=self.options.dp)
