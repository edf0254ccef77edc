"""Duplex-aware sharding search (the paper's Algorithm 1): a dynamic programme over the cuts of the
graph in topological order. A state is the placements of the tensors live at a cut; each label
on it carries the time so far T, the debt D (the other micro-batch's computation still pending
that the next stage's communication can hide), the memory M the plan holds, and the plan's time
so far with one micro-batch (plain SPMD), since a plan runs with k micro-batches or with one,
whichever is faster. Only labels that no other label beats on all four are kept: per state
`labels` - 1 best either way, as many as a plain programme would keep, the leanest and the
cheapest with k (_trim), and the `beam` best states (some best either way, some cheapest with
k, some with one; and the one whose plan uses least memory, so that a memory limit further on
can still be met). So one programme does what a Duplex-priced and a plain programme did (issue
19: the Duplex-priced one alone missed plans the plain one found; two cost the time twice).

Stage model for k micro-batches, a node costing c of computation (forward + backward, per
micro-batch) and m of communication (its input conversions and their backward duals, per
micro-batch, plus its parameters' gradient reduction spread over the step). A replicated
tensor's gradient is a Partial sum where a consumer reads it replicated and makes a split or
Partial output (a column-parallel matmul): the lowering makes it whole once, at the tensor (the
dual of its conversion to R, or an all-reduce where its home is R); the first such consumer pays
that, and the dual of a conversion to R is charged nowhere else:
  m = 0:  T += c,  D += (k-1) c            (micro-batch 0 runs on; the others owe it)
  m > 0:  T += max(D, m) + c,  D = (k-1) c + max(0, m - c)
and the plan costs T + D. The optimizer's update of the node's parameter shards (at the
parameter's first consumer, where its placement is chosen) adds to T: it runs after the backward,
hiding nothing and hidden by nothing. Memory counts each parameter, its gradient and the
optimizer's state tensors (hidup.program.OPTIMIZERS). With k = 1 it is plain SPMD: T += m + c.
(Pricing gradient reductions as hidden under the backward instead, as the lowering issues them,
was tried for issue 19: it won 3-5% on two small models and lost 20-25% on the paper's BERT
models at 16-32 GPUs, where the backward's conversions share the link; see the README.) With one
micro-batch the model is linear: hidup.planning.exact solves it as an integer programme, and
search(exact=...) ranks that proven plan too. The few best plans, with the expert strategies
beside them, are then lowered and ranked by the fast estimate (hidup.planning.estimate).

On a 2-D mesh of `machines` (hidup.strategy) the programme chooses each op's option over
one machine's ranks, on its part of the batch: conversions are priced inside a machine, a
gradient partial there is all-reduced over the world, and a parameter's gradient that is whole
there over its mesh column, the columns sharing each machine's link. The search on a mesh also
runs the 1-D programme over every rank and ranks both kinds of plan."""
from __future__ import annotations

import gc
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import NamedTuple

from hidup.graph.capture import Graph, Node
from hidup.graph.flops import backward_flops, forward_flops
from hidup.graph.ops.registry import replicated
from hidup.graph.placement import Partial, Placement, R, Replicate, ShardingOption
from hidup.planning.costs import Profile
from hidup.planning.estimate import Estimate, estimate
from hidup.planning.exact import exact_plan
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import check
from hidup.strategy import Strategy, conversion, fitting_options, microbatch_split
from hidup.program.lowering import lower
from hidup.program.tasks import LoweringError, Shapes, mesh_groups, optimizer_cost

log = logging.getLogger(__name__)
_NOTHING: frozenset = frozenset()
_GRAD = "grad"  # in a state's converted-to set: the tensor's replicated gradient is a Partial
#   sum, whose reduction is charged (to the first consumer that makes it one)
# With k > 1, the share of the beam kept for the states best either way, then for the cheapest
# with k micro-batches; the rest for the cheapest with one. Measured on 7 models: with (0.4, 0.3)
# the programme's best plan with one micro-batch is never worse than a plain programme's, nor its
# best with k than a Duplex-priced one's (with 2/3 best, 1/3 with k: 0.36% worse on gpt:paper).
_BEAM_SHARES = (0.4, 0.3)
# On a 2-D mesh the search ranks the plans of the mesh's programme and of the 1-D one; where
# one programme's best plan is priced over _HOPELESS times the other's, only that plan of it is
# lowered and estimated (the estimate of the programme's plans differs from its price by -4% to
# +33% on the paper's models at 16 and 64 GPUs, so such a plan is not expected to win). The same
# holds for the plan with no communication (replicated_plan).
_HOPELESS = 2.0
_DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
         "all_reduce": "all_reduce", "slice": "all_gather"}


class _Label(NamedTuple):  # a NamedTuple: the search makes hundreds of thousands of them
    time: float
    debt: float
    memory: float
    plain: float  # the same plan's time with one micro-batch (the k = 1 model)
    node: str = ""
    option: ShardingOption | None = None
    back: _Label | None = None

    @property
    def cost(self) -> float:
        """With k micro-batches."""
        return self.time + self.debt

    @property
    def best(self) -> float:
        """The plan runs with k micro-batches or with one, whichever is faster."""
        cost = self.time + self.debt
        return cost if cost < self.plain else self.plain


_BEST, _COST, _PLAIN, _MEMORY = (attrgetter(field) for field in ("best", "cost", "plain",
                                                                 "memory"))


def _frontier(labels: list[_Label]) -> list[_Label]:
    """The labels that no other beats on all four fields (time, debt, memory, plain), the
    first of equal ones. In this order, a label can only be beaten by one before it."""
    labels = sorted(labels, key=_VALUES)
    kept: list[_Label] = []
    for label in labels:
        d, m, p = label.debt, label.memory, label.plain
        for o in kept:  # o.time <= label.time
            if o.debt <= d and o.memory <= m and o.plain <= p:
                break
        else:
            kept.append(label)
    return kept


_VALUES = attrgetter("time", "debt", "memory", "plain")


class _Cut(NamedTuple):
    """The programme's keys around one node. A key holds a value per live tensor: first those
    the node neither reads nor makes, in the order they had before it, then those it does."""
    live: tuple[str, ...]  # the tensors live before the node, in its key's order
    reads: tuple[int, ...]  # per input of the node, its position in that key (-1: none yet)
    kept: tuple[int, ...]  # the positions in that key of the tensors that pass the node
    touched: tuple[str, ...]  # the tensors it reads or makes that stay live after it
    after: tuple[str, ...]  # the tensors live after it, in the next key's order


class _NodeCost(NamedTuple):
    """What one option of one node costs (seconds, bytes)."""
    compute: float  # forward + backward computation per micro-batch
    grads: float  # its parameters' gradient reductions, per step
    memory: float  # its output per step, and the parameters it is the home of
    update: float  # the optimizer's update of those parameters, per step


@dataclass(frozen=True)
class SearchOptions:
    """What a search is asked for, beside the graph, the world size and the profile."""

    k: int = 2  # micro-batches (Duplex); the plans are also priced with one
    memory: float | None = None  # bytes a device holds (None: no limit)
    optimizer: str = "adamw"  # whose update time and state memory count (hidup.program.OPTIMIZERS)
    machines: int = 1  # a 2-D mesh of `machines` x world / machines (1: the 1-D mesh)
    beam: int = 16  # states kept per cut
    labels: int = 4  # labels kept per state
    keep: int = 3  # plans of the programme lowered and estimated per order
    exact: float = 0.0  # seconds for the integer programme's proof of the k = 1 plan (0: none)
    objective: str = "time"  # 'time', or 'comm': the fewest bytes communicated


class Ranked(NamedTuple):
    """A plan the search lowered with `k` micro-batches and estimated, and that fits."""

    step_time: float  # the fast estimate's (s)
    name: str  # search#j, search-k1#j, search-2d#j, exact#0, search-replicated#0, or a baseline's
    strategy: Strategy
    dp_cost: float  # the programme's own price of it (nan for a baseline)
    estimate: Estimate
    k: int


@dataclass(frozen=True)
class SearchResult:
    strategy: Strategy
    k: int  # micro-batches of the chosen plan: k, or 1 where Duplex does not pay
    dp_cost: float  # the dynamic programme's own estimate of the chosen plan (s, with the
    #   micro-batch count it was chosen with; a k = 1 price for exact#0), if it chose one
    estimate: Estimate  # the fast estimate of the chosen plan, as lowered
    ranked: tuple[Ranked, ...]  # every plan lowered, estimated and fitting, fastest first
    seconds: float  # wall time of the search
    states: int  # labels created
    # per mesh searched, the k = 1 cost model's integer programme (search(exact=...)):
    # (machines, cost of its plan, proven lower bound, proven optimal, beam's cost), seconds
    exact: tuple[tuple[int, float, float, bool, float], ...] = ()

    @property
    def candidates(self) -> tuple[tuple[str, float], ...]:
        """(name with its micro-batch count, estimated step time) of every plan ranked."""
        return tuple((f"{r.name} k={r.k}", r.step_time) for r in self.ranked)


class Search:
    """One search: a graph, a world size, a profile, k micro-batches, an objective, the
    optimizer that will run (its update time and its state's memory)."""

    def __init__(self, graph: Graph, world: int, profile: Profile,
                 options: SearchOptions = SearchOptions()):
        if options.objective not in ("time", "comm"):
            raise ValueError(f"objective {options.objective!r}: choose 'time' or 'comm'")
        k, machines, self.options = options.k, options.machines, options
        memory, objective, beam = options.memory, options.objective, options.beam
        self.optimizer = optimizer_cost(options.optimizer)
        self.g, self.profile, self.k = graph, profile, k
        self.machines, self.world = machines, world // machines  # placements: a machine's ranks
        self.memory, self.objective, self.beam = memory or math.inf, objective, beam
        self.per_state = options.labels
        self.mbs = microbatch_split(graph, k, machines=machines)
        rows, columns = mesh_groups(world, machines)
        self.group, self.everyone = rows[0], tuple(range(world))
        self.column, self.columns = columns[0], columns
        self.position = {n.name: i for i, n in enumerate(graph.ops)}
        self.last: dict[str, int] = {}  # tensor -> position of its last consumer
        self.first: dict[str, int] = {}  # tensor -> position of its first consumer
        for node in graph.ops:
            for t in node.inputs:
                self.last[t] = max(self.last.get(t, -1), self.position[node.name])
                self.first.setdefault(t, self.position[node.name])
        self.placeholders = {n.name for n in graph.nodes if n.kind != "op"}
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
        shapes = Shapes(graph, self.mbs, self.world, k * machines)
        self.shape, self.nbytes = shapes.shape, shapes.nbytes  # (tensor, placement) -> local
        # what prices each label's `plain` time: this programme at k = 1, another (the same
        # graph with one micro-batch) at k > 1; none for objective 'comm' at k > 1
        self.plain: Search | None = self if k == 1 else None
        if k > 1 and objective == "time":
            self.plain = Search(graph, world, profile, replace(options, k=1))

    # -- costs --------------------------------------------------------------------------------
    def per_mb(self, t: str) -> float:
        """Share of a once-per-step cost carried by one micro-batch."""
        return 1.0 / self.k if isinstance(self.mbs.home(t), Replicate) else 1.0

    def conversion_cost(self, t: str, src: Placement, dst: Placement) -> float:
        """The conversion's time per micro-batch, forward and backward (its dual)."""
        key = (self.alike[t], src, dst)
        if key not in self._converts:
            self._converts[key] = self._conversion_cost(t, src, dst)
        return self._converts[key]

    def _conversion_cost(self, t: str, src: Placement, dst: Placement) -> float:
        kind = conversion(src, dst)
        if kind is None:
            return 0.0
        size = max(self.nbytes(t, src), self.nbytes(t, dst))
        # the dual of a conversion to R runs only where the gradient comes back as a Partial
        # sum: partial_grad_cost charges it then
        return self._collectives(kind, size, t in self.grads and dst != R, self.per_mb(t))

    def partial_grad_cost(self, t: str, home: Placement) -> float:
        """Per micro-batch, making whole the Partial gradient of t's replicated value, which the
        lowering does once, however many consumers make it Partial: the dual of its conversion
        to R (a reduce-scatter to a split home, an all-reduce to a Partial one), or an
        all-reduce where t's home is R (hidup.program.lowering's reduced_at)."""
        key = (self.alike[t], home, "grad")
        if key not in self._converts:
            size = max(self.nbytes(t, home), self.nbytes(t, R))
            kind = "all_reduce" if home == R else _DUAL[conversion(home, R)]
            if self.objective == "comm":
                cost = float(size)
            else:
                cost = self.profile.collective_time(kind, size, self.group)
            self._converts[key] = cost * self.per_mb(t)
        return self._converts[key]

    def _collectives(self, kind: str, size: int, backward: bool, share: float) -> float:
        """A conversion's collective of `size` bytes, and its dual where the tensor has a
        gradient, `share` of it per micro-batch (the layers' tensors repeat: computed once)."""
        key = (kind, size, backward, share)
        if key not in self._conversions:
            if self.objective == "comm":
                cost = size * share * (kind != "slice")
            else:
                fwd = 0.0 if kind == "slice" else \
                    self.profile.collective_time(kind, size, self.group)
                bwd = self.profile.collective_time(_DUAL[kind], size, self.group) \
                    if backward else 0.0
                cost = (fwd + bwd) * share
            self._conversions[key] = cost
        return self._conversions[key]

    def node_cost(self, node: Node, opt: ShardingOption) -> _NodeCost:
        """What the option costs; objective 'comm' counts bytes, its gradients' as `grads`."""
        kind = self._node_kinds.get(node.name)
        if kind is None:
            here = self.position[node.name]
            kind = self._node_kinds[node.name] = (
                node.op, repr(node.args), self.alike[node.name],
                tuple((self.alike[t], self.g.node(t).kind, self.first[t] == here)
                      for t in node.inputs))
        key = kind, opt
        if key not in self._node_costs:
            self._node_costs[key] = self._node_cost(node, opt)
        return self._node_costs[key]

    def _node_cost(self, node: Node, opt: ShardingOption) -> _NodeCost:
        ins = [self.shape(t, p) for t, p in zip(node.inputs, opt.inputs)]
        out = self.shape(node.name, opt.output)
        fwd = forward_flops(node.op, ins, out, node.args)
        nbytes = sum(math.prod(s) for s in ins + [out]) * node.out.itemsize
        compute = self.profile.kernel_time(fwd, nbytes) + \
            self.profile.kernel_time(backward_flops(node.op, fwd, ins, out, node.args),
                                     2 * nbytes)
        if self.mbs.home(node.name) == R:
            compute /= self.k  # runs once per step
        grads = 0.0
        memory, update, numel = math.prod(out) * node.out.itemsize * self.k, 0.0, 0
        for t, p in zip(node.inputs, opt.inputs):
            param = self.g.node(t)
            if param.kind == "param":
                size = self.nbytes(t, p)
                if p == R and opt.output != R:  # its gradient is a Partial sum: all-reduced
                    grads += self.reduction(size, self.everyone, ())
                elif self.machines > 1 and self.first[t] == self.position[node.name]:
                    grads += self.reduction(size, self.column, self.columns)  # summed across
                if self.first[t] == self.position[node.name]:  # its home: where it lives
                    memory += (2 + self.optimizer.states) * size  # parameter, gradient, state
                    if param.out.is_float:
                        numel += math.prod(self.shape(t, p))  # the shard it updates
        if numel and self.objective == "time":  # a share of the one update kernel, no launch
            update = self.profile.kernel_time(self.optimizer.flops * numel,
                                              self.optimizer.bytes * numel) \
                - self.profile.op_overhead
        if self.objective == "comm":
            compute = 0.0
        return _NodeCost(compute, grads, memory, update)

    def reduction(self, nbytes: int, group: tuple[int, ...], parts: tuple) -> float:
        """A gradient's all-reduce over `group`, all of `parts` at once (a 2-D mesh's columns
        share each machine's link); objective 'comm': its bytes."""
        if self.objective == "comm":
            return float(nbytes)
        latency, transfer = self.profile.collective_split("all_reduce", nbytes, group)
        return latency + transfer * self.profile.link_load(group, parts)

    # -- the dynamic programme ----------------------------------------------------------------
    def run(self) -> list[_Label]:
        """The labels of the last cut, best first (each with k micro-batches or one)."""
        states: dict[tuple, list[_Label]] = {(): [_Label(0.0, 0.0, 0.0, 0.0)]}
        for node in self.g.ops:
            states = self.extend(states, node)
            if not states:
                raise ValueError(f"search: no option of node {node.name} ({node.op}) fits in "
                                 f"{self.memory / 2**30:.3g} GiB per device or divides evenly")
        finals = [label for labels in states.values() for label in labels]
        return sorted(finals, key=lambda lab: lab.best)

    def costs(self, node: Node, opt: ShardingOption) -> tuple[_NodeCost | None, _NodeCost | None]:
        """The option's cost with k micro-batches (None where its splits do not divide by
        them) and with one (None where there is no plain pricing); LoweringError where it
        divides by neither."""
        if self.plain is self:
            cost = self.node_cost(node, opt)
            return cost, cost
        plain = self.plain.node_cost(node, opt) if self.plain is not None else None
        try:
            return self.node_cost(node, opt), plain
        except LoweringError:
            if plain is None:
                raise
            return None, plain  # a plan that runs with one micro-batch only

    def extend(self, states, node: Node) -> dict[tuple, list[_Label]]:
        """Every label of every state, extended by every option of the node."""
        options = []
        for opt in fitting_options(self.g, node, self.world):
            try:
                options.append((opt, *self.costs(node, opt)))
            except LoweringError:
                continue  # a split that does not divide with the micro-batches
        cut = self._cuts[self.position[node.name]]
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
                self.add(out, untouched + touched,
                         self.advance(labels, node, opt, comm, cost, comm1, plain))
        return self.prune(out)

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
                if isinstance(want, Partial):  # consumer wants it
                    return None
                home, made = want, _NOTHING
            else:
                return None
            if isinstance(want, Partial) and home != want:
                return None
            if want != home and want not in made:
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
            label, = self.advance([label], node, opt, comm, self.node_cost(node, opt))
        return label.cost

    def add(self, out: dict, key: tuple, new: list[_Label]) -> None:
        """Add the labels to the state `key` but those over the memory limit (prune() drops
        the dominated ones of the states it keeps)."""
        limit = self.memory
        fits = new if limit == math.inf else [label for label in new if label.memory <= limit]
        if fits:
            out.setdefault(key, []).extend(fits)

    def prune(self, states: dict) -> dict:
        """The `beam` best states (with k > 1: some best either way, some cheapest with k
        micro-batches, some with one; _BEAM_SHARES) and the one whose plan uses least memory;
        in each, the labels that no other label beats on all four fields (time, debt, memory,
        plain), and of those the ones _trim() keeps."""
        if len(states) > self.beam:
            keys, kept = list(states), {}
            least = {"cost": {key: min([lab.time + lab.debt for lab in labels])
                              for key, labels in states.items()},
                     "plain": {key: min(map(_PLAIN, labels)) for key, labels in states.items()},
                     "memory": {key: min(map(_MEMORY, labels))
                                for key, labels in states.items()}}
            least["best"] = {key: min(cost, least["plain"][key])  # the least of min(cost, plain)
                             for key, cost in least["cost"].items()}
            for field, upto in self._quotas():
                for key in sorted(keys, key=least[field].__getitem__):
                    if len(kept) >= upto:
                        break
                    kept.setdefault(key)
            states = {key: states[key] for key in kept}
        for key, labels in states.items():
            labels = _frontier(labels)
            states[key] = self._trim(labels) if len(labels) > self.per_state else labels
        return states

    def _trim(self, labels: list[_Label]) -> list[_Label]:
        """A state's labels: the `per_state` - 1 best, and with k > 1 the `per_state` - 1 that a
        plain programme and a Duplex-priced one would keep (cheapest with one micro-batch, and
        with k, among the labels that their own criteria do not dominate), and the leanest."""
        n = self.per_state - 1
        kept = sorted(labels, key=_BEST)[:n]
        ids = set(map(id, kept))
        if self.k > 1:
            mine: list[_Label] = []  # the plain programme's: by plain time, then memory
            for lab in sorted(labels, key=_PLAIN):
                p, m = lab.plain, lab.memory
                for o in mine:
                    if o.plain <= p and o.memory <= m:
                        break
                else:
                    mine.append(lab)
                    if id(lab) not in ids:
                        kept.append(lab)
                        ids.add(id(lab))
                    if len(mine) == n:
                        break
        for extra in (min(labels, key=_MEMORY), min(labels, key=_COST)):
            if id(extra) not in ids:
                kept.append(extra)
                ids.add(id(extra))
        return kept

    def _quotas(self) -> list[tuple[str, int]]:
        """How prune() fills the beam: (label field, states kept once it is done), in turn."""
        n = self.beam - 1
        if self.k == 1:
            return [("best", n), ("memory", n + 1)]
        best, cheapest = _BEAM_SHARES
        return [("best", round(n * best)), ("cost", round(n * (best + cheapest))),
                ("plain", n), ("memory", n + 1)]

    def strategy(self, label: _Label, name: str) -> Strategy:
        options: dict[str, ShardingOption] = {}
        while label is not None and label.option is not None:
            options[label.node] = label.option
            label = label.back
        return self.plan(options, name)

    def plan(self, options: dict[str, ShardingOption], name: str) -> Strategy:
        """The strategy of one option per node: parameters and inputs live where their first
        consumer reads them."""
        options = {n.name: options[n.name] for n in self.g.ops}
        placements: dict[str, Placement] = {}
        for node in self.g.ops:
            for t, p in zip(node.inputs, options[node.name].inputs):
                if t in self.placeholders:
                    placements.setdefault(t, p)
        placements = {n.name: placements.get(n.name, R) for n in self.g.nodes if n.kind != "op"}
        return Strategy(name, placements, options, machines=self.machines)


def search(graph: Graph, world: int, profile: Profile, options: SearchOptions = SearchOptions(),
           baselines: dict[str, Strategy] | None = None) -> SearchResult:
    """The best plan: the dynamic programme's `keep` cheapest plans with k micro-batches, its
    `keep` cheapest with one (its `keep` best either way are among them), the plan with no
    communication (every op replicated: search-replicated#0; replicated_plan) and the `baselines`,
    each lowered with k and with one, ranked by the fast estimate (objective 'comm': by its own
    count). The programme prices every plan with k micro-batches and with one and keeps what is
    best either way, so that a search for Duplex finds the plans a plain search finds. On a 2-D
    mesh of `machines` > 1 it runs on the mesh and over every rank (1-D), and ranks both (of a
    programme whose best is priced over _HOPELESS times the other's, that best plan). Every
    plan is priced and held to `memory` with `optimizer`'s update and state. With `exact` > 0
    seconds the k = 1 programme's best plan on each mesh is also sought by the integer
    programme (hidup.planning.exact), proven optimal for that cost model unless the time runs
    out, and ranked as exact#0 (exact-2d#0); the beam can miss it (experiments.search_exactness)."""
    with _no_gc():  # it makes a million small objects, none in a cycle: the collector's
        # passes over them (and over the labels alive while plans are lowered) cost a tenth
        return _search(graph, world, profile, options, baselines or {})


@contextmanager
def _no_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(graph: Graph, world: int, profile: Profile, options: SearchOptions,
            baselines: dict[str, Strategy]) -> SearchResult:
    started = time.perf_counter()
    ranking = Ranking(graph, world, profile, options)
    labels, proofs, runs = 0, [], []
    for mesh in ([options.machines, 1] if options.machines > 1 else [1]):
        try:
            dp = programme(graph, world, profile, replace(options, machines=mesh))
            runs.append((mesh, dp, dp.run()))
        except ValueError as exc:
            if mesh == 1:
                raise
            log.info("search on %d machines x %d: %s", mesh, world // mesh, exc)
            continue
        labels += dp.labels
    least = min(finals[0].best for _, _, finals in runs)
    timed = options.objective == "time"
    for mesh, dp, finals in runs:
        mesh_tag = "-2d" if mesh > 1 else ""
        if timed and _far_behind(finals[0].best, least):  # its plan best either way only
            # (finals are in that order)
            ranking.finals(dp, finals, _BEST, 1, "search" + mesh_tag, sorted({1, dp.k}))
        else:  # the `keep` cheapest plans with k micro-batches and the `keep` cheapest with
            # one: the `keep` best either way are among them
            for by, tag, at in _orders(dp.k, options.objective):
                ranking.finals(dp, sorted(finals, key=by), by, options.keep, tag + mesh_tag, at)
        if options.exact > 0 and timed:
            proof = exact_plan(dp.plain, "hidup", options.exact)
            beam_cost = min(label.plain for label in finals)
            proofs.append((mesh, proof.cost, proof.bound, proof.optimal, beam_cost))
            log.info("exact k=1 plan on %d machines: %.4g s (bound %.4g, %s) in %.1f s; "
                     "the beam's %.4g s", mesh, proof.cost, proof.bound,
                     "optimal" if proof.optimal else "time ran out", proof.seconds, beam_cost)
            ranking.add(proof.strategy, "exact-2d#0" if mesh > 1 else "exact#0", proof.cost)
    one_d = next(dp for mesh, dp, _ in runs if mesh == 1)
    whole = replicated_plan(one_d) if timed else None
    price = one_d.plain.price(whole) if whole is not None else math.inf
    if not _far_behind(price, least):
        ranking.add(whole, "search-replicated#0", price)
    for name, strategy in baselines.items():
        ranking.add(strategy, name, math.nan, seen=False)
    if not ranking.ranked:
        limit = math.inf if options.memory is None else options.memory / 2**30
        raise ValueError(f"search: no plan fits in {limit:.3g} GiB per device and lowers for "
                         f"this model and world size")
    ranked = sorted(ranking.ranked, key=attrgetter("step_time" if timed else "dp_cost"))
    best = ranked[0]
    log.info("search: %d labels, %d plans ranked in %.2f s", labels, len(ranked),
             time.perf_counter() - started)
    return SearchResult(best.strategy, best.k, best.dp_cost, best.estimate, tuple(ranked),
                        time.perf_counter() - started, labels, tuple(proofs))


def programme(graph: Graph, world: int, profile: Profile, options: SearchOptions) -> Search:
    """The search's programme on a mesh of `options.machines`; on a 2-D mesh whose machines'
    parts of the batch do not split into k micro-batches, the programme with one (its plans run
    without Duplex there)."""
    try:
        return Search(graph, world, profile, options)
    except ValueError as exc:
        if options.machines == 1 or options.k == 1:
            raise
        log.info("search on %d machines x %d without Duplex: %s", options.machines,
                 world // options.machines, exc)
        return Search(graph, world, profile, replace(options, k=1))


def _far_behind(price: float, least: float) -> bool:
    """A plan (or a programme's best) priced over _HOPELESS times the least: not lowered."""
    return price > _HOPELESS * least


def replicated_plan(dp: Search) -> Strategy | None:
    """The plan with no communication at all: every op replicated, on every rank (None where an
    op offers no such option). Where links are slow it is the fastest, and the beam can miss it
    (on 2 x 4 V100 at 1-10 Gbit/s, vit-sgmoe:paper's beam of 16 ended 9-90% over it at k = 1).
    Keeping its state in the beam instead made the beam lose far more elsewhere (bert-sgmoe's
    plans at 1 Gbit/s estimated 77 s instead of 7.2): so it is ranked beside the programme's."""
    options = {}
    for node in dp.g.ops:
        option = replicated(len(node.inputs))
        if option not in fitting_options(dp.g, node, dp.world):
            return None
        options[node.name] = option
    return dp.plan(options, "hidup")


def _plan_key(strategy: Strategy) -> tuple:
    return strategy.machines, tuple(strategy.options.items())


def _orders(k: int, objective: str) -> list[tuple]:
    """How the programme's final labels are ranked: (order, name, the micro-batch counts at
    which a plan counts as one of the order's best). Every plan is lowered with k and with
    one: the programme's prices differ from the estimate's, and a plan it prices best with k
    can be the fastest with one."""
    if k == 1 or objective != "time":  # one order: the cost (with k, or the bytes)
        return [(_COST, "search", [k])]
    return [(_COST, "search", [k]), (_PLAIN, "search-k1", [1])]


class Ranking:
    """The plans lowered and estimated so far: each with one micro-batch and with k, each
    variant that lowers and fits in memory kept (Duplex pays only where it hides more than it
    costs)."""

    def __init__(self, graph: Graph, world: int, profile: Profile, options: SearchOptions):
        self.graph, self.world, self.profile, self.options = graph, world, profile, options
        self.memory = math.inf if options.memory is None else options.memory
        self.ranked: list[Ranked] = []
        self.seen: dict[tuple, dict[int, bool]] = {}  # plans ranked so far: count -> it fits

    def finals(self, dp: Search, finals, cost, keep: int, tag: str, at: list[int]) -> None:
        """Rank the first `keep` distinct plans of `finals` that fit with a micro-batch count of
        `at` (named TAG#j, the programme's `cost` of its label beside it), each lowered with k
        and with one but where tried already."""
        mine: list[tuple] = []
        for j, label in enumerate(finals[:10 * keep]):
            strategy = dp.strategy(label, "hidup" if dp.objective == "time" else "min-comm")
            plan = _plan_key(strategy)
            if plan in mine:
                continue  # the same plan reached through another state
            mine.append(plan)
            if plan not in self.seen:
                check(self.graph, strategy)
            tried = self.add(strategy, f"{tag}#{j}", cost(label), sorted({1, dp.k}))
            keep -= any(tried[kk] for kk in at)  # it fits: the DP's memory model is an estimate
            if keep == 0:
                break

    def add(self, strategy: Strategy, name: str, dp_cost: float, counts: list[int] | None = None,
            seen: bool = True) -> dict[int, bool]:
        """Estimate the plan with each micro-batch count of `counts` (default: 1 and k) not
        tried yet (`seen`: remember it, so that a plan reached twice is lowered once); return
        whether it fits, per count."""
        tried = self.seen.setdefault(_plan_key(strategy), {}) if seen else {}
        for kk in counts or sorted({1, self.options.k}):
            if kk in tried:
                continue
            tried[kk] = False
            try:
                program = lower(self.graph, strategy, self.world, kk,
                                optimizer=self.options.optimizer)
            except (LoweringError, ValueError) as exc:
                log.info("plan %s with k=%d cannot be lowered: %s", name, kk, exc)
                continue
            peak = peak_memory(program).peak
            if peak > self.memory:
                log.info("plan %s with k=%d needs %.3g GiB per device: over the limit", name, kk,
                         peak / 2**30)
                continue
            est = estimate(program, self.profile)
            self.ranked.append(Ranked(est.step_time, name, strategy, dp_cost, est, kk))
            tried[kk] = True
        return tried


def rank_plans(graph: Graph, world: int, profile: Profile, plans: dict[str, Strategy],
               options: SearchOptions = SearchOptions()) -> list[Ranked]:
    """The given plans, each lowered with one micro-batch and with k, estimated and held to the
    memory limit; fastest first."""
    ranking = Ranking(graph, world, profile, options)
    for name, strategy in plans.items():
        ranking.add(strategy, name, math.nan, seen=False)
    return sorted(ranking.ranked, key=attrgetter("step_time"))
