"""A plan's step time and peak memory, from short copies of a model with repeated layers.

A transformer stack is N copies of one block (hidup.graph.repeats: a block is one layer, or a
few consecutive ones where kinds of layer alternate). Where a plan treats each block of a run
alike (the same options, storage and recomputation: a *segment*), the blocks it adds to a short
copy each add the same tasks to the Program: the same kernels, collectives and held bytes. So
the plan is lowered on the model cut to KEPT blocks of each segment (the base) and, for the one
segment longer than that, with one block more (its slope), and each figure of the whole model
is the base's plus the slope times the cut blocks: two short lowerings instead of one of every
layer, each kept for plans whose short copies are the same. With several long segments (the
first layers recomputed), a copy with one block more per segment, and the peak memory taken per
region of the step (Pricer.price says why). Used for graphs of `min_ops` ops or more (smaller
ones lower in well under a second: SearchOptions.extrapolate), where the short lowerings hold
fewer ops than the whole graph. The ranking confirms its best plan on the whole graph
(hidup.planning.ranking.Ranking.confirm): the figures a user reads are never extrapolated."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from hidup.graph.nodes import Graph
from hidup.graph.repeats import block_ops, block_params, layer_runs, shortened
from hidup.planning.costs import Profile
from hidup.planning.estimate import Estimate, estimate
from hidup.planning.memory import MemoryReport, peak_memory
from hidup.program.lowering import lower
from hidup.program.tasks import Program
from hidup.strategy import Strategy, layers

KEPT = 2  # blocks of each segment in the base (the first sees the stretch before the segment,
#   the last the stretch after it; the slope's extra block sits between blocks alike)
SHARE = 1.0  # extrapolated only where the short lowerings' ops are under this share of the graph's


@dataclass(frozen=True)
class Priced:
    """A plan lowered with some micro-batch count: its estimate and its memory."""

    estimate: Estimate
    memory: MemoryReport
    extrapolated: bool  # from short copies of the model (False: the whole Program, lowered)
    program: Program | None = None  # the model's whole Program, where it was lowered whole


@dataclass
class Pricer:
    """Prices plans of one graph on one cluster: `price(strategy, k)`. A short copy's figures
    are kept by what it computes (its ops, options, storage and recomputation in order), so a
    plan whose short copies are another's (the same plan with more or fewer first layers
    recomputed: the cut layers differ, the copies do not) is priced without lowering again."""

    graph: Graph
    world: int
    profile: Profile
    optimizer: str = "adamw"  # whose update and state the Programs hold
    mode: str = "graph"  # the executor mode the estimate prices (hidup.program.HOST_MODES)
    min_ops: float = 1000  # graphs with fewer ops are priced whole
    share: float = SHARE  # extrapolated only where the short lowerings' ops are under this
    #   share of the graph's
    _kept: dict = field(default_factory=dict, repr=False)  # a short copy's figures, by key

    def price(self, strategy: Strategy, k: int, whole: bool = False) -> Priced:
        """The plan's estimate and memory with k micro-batches: extrapolated from short copies
        where the graph has `min_ops` ops or more and runs of repeated layers longer than KEPT
        that the plan treats alike, and the short lowerings' ops are under `share` of the
        graph's; else (or `whole`) from the whole Program. LoweringError or ValueError where it
        does not lower.

        One such segment: the base and one layer more. Several (the first layers recomputed,
        the rest not): the base and, for each segment, one layer more in it. The times add up
        per segment; the peak does not (on Llama 8B, fsdp with the first five layers
        recomputed, k = 2: 116.3 GiB extrapolated so, 136.6 lowered whole: the peak is reached
        in another part of the step). So each copy's memory is taken per region (a segment's
        first or last layer, or another layer, in each phase: _regions) and each region's peak
        extrapolated: within a segment of layers alike, a layer further in holds what the one
        before it held plus the same again, so a region's peak is at its first or last layer,
        and the step's is the largest region's."""
        graph = self.graph
        segments = () if whole or len(graph.ops) < self.min_ops else \
            segments_of(graph, strategy)
        long = [s for s in segments if len(s) > KEPT]
        cuts = [len(s) - KEPT for s in long]
        per_layer = [len(block_ops(graph, s[0])) for s in long]  # a block's ops
        short_ops = len(graph.ops) - sum(c * n for c, n in zip(cuts, per_layer))
        if not long or (1 + len(long)) * short_ops + sum(per_layer) >= \
                self.share * len(graph.ops):  # the short lowerings' ops
            return self._lowered(graph, strategy, k, False)
        base = {s: min(len(s), KEPT) for s in segments}
        first = self._short(strategy, base, k, long)
        more = [self._short(strategy, {**base, s: KEPT + 1}, k, long) for s in long]

        def line(f: float, ms) -> float:
            return f + sum(c * (m - f) for c, m in zip(cuts, ms))

        step = [line(f, ms) for f, *ms in zip(_vector(first), *map(_vector, more))]
        if len(long) == 1:
            memory = [line(f, ms) for f, *ms in zip(_memory_vector(first.memory),
                                                     *(_memory_vector(m.memory) for m in more))]
            return Priced(Estimate(*step), MemoryReport(*(round(x) for x in memory), None),
                          True)
        fixed = [round(line(f, ms)) for f, *ms in zip(_fixed_vector(first.memory),
                                                       *(_fixed_vector(m.memory) for m in more))]
        regions = [r for r in first.memory.by_region
                   if all(r in m.memory.by_region for m in more)]
        peaks = [[line(first.memory.by_region[r][j], [m.memory.by_region[r][j] for m in more])
                  for r in regions] for j in range(3)]  # live, activations, gradients
        live, activations, gradients = (round(max(p)) for p in peaks)
        return Priced(Estimate(*step), MemoryReport(*fixed, gradients, activations,
                                                    sum(fixed) + live, None), True)

    def _lowered(self, graph: Graph, strategy: Strategy, k: int, short: bool,
                 roles: dict | None = None) -> Priced:
        program = lower(graph, strategy, self.world, k, optimizer=self.optimizer)
        regions = None if roles is None else _regions(graph, program, roles)
        return Priced(estimate(program, self.profile, self.mode),
                      peak_memory(program, regions=regions), short,
                      program if graph is self.graph else None)

    def _short(self, strategy: Strategy, kept: dict, k: int, long) -> Priced:
        """The plan on the model cut to `kept` layers of each segment (its copy's figures kept
        by what it computes and, where there are several `long` segments, by the roles of its
        layers in them: its memory per region)."""
        short = _shortened(self.graph, kept)
        names = short._index
        across = {p: d for p, d in strategy.across.items() if p in names}
        plan = replace(strategy,
                       placements={n: p for n, p in strategy.placements.items() if n in names},
                       options={n: o for n, o in strategy.options.items() if n in names},
                       reshard=frozenset(p for p in strategy.reshard if p in names),
                       across=across, across_axes=strategy.across_axes if across else (),
                       recompute=strategy.recompute & set(layers(short)),
                       selective=strategy.selective & set(layers(short)))
        roles = {layer: (i, "first" if j == 0 else "last" if j == kept[s] - 1 else "inside")
                 for i, s in enumerate(long) for j, block in enumerate(s[:kept[s]])
                 for layer in block} \
            if len(long) > 1 else None  # (one segment's peak extrapolates whole)
        key = (k, _computes(short, plan),  # and the roles in layer order (not the layers'
               roles and tuple(roles.get(layer) for layer in layers(short)))  # names)
        if key not in self._kept:
            self._kept[key] = self._lowered(short, plan, k, False, roles)
        return self._kept[key]


def _regions(graph: Graph, program, roles: dict) -> list[tuple]:
    """Each task's region: its phase, and the role of the layer of the op or tensor it works on
    (`roles`: a long segment's first or last layer, or one inside it) or, for a layer of no
    long segment (or none), that layer with the last role before it (the ops before the
    segments and those after them are regions apart: the loss's and the embedding's backward);
    a task on no node of the graph (a bucket of gradients, a wait) is in the region of the task
    before it."""
    out, where, phase, role = [], None, "", None
    for task in program.tasks:
        name = getattr(task, "node", None) or getattr(task, "tensor", None)
        if name is not None and name in graph._index:
            layer = graph.node(name).layer
            if layer in roles:
                where = role = roles[layer]
            else:
                where = (layer, role)
        phase = getattr(task, "phase", phase)
        out.append((phase, where))
    return out


def _computes(graph: Graph, plan: Strategy) -> tuple:
    """What a plan of a short copy computes, alike for copies that compute the same: its ops
    and their options in order, where each parameter lives, the layers recomputed in order."""
    return (tuple((n.op, n.out, n.inputs.__len__(), plan.options[n.name]) for n in graph.ops),
            tuple((n.out, plan.placements.get(n.name), n.name in plan.reshard,
                   plan.across.get(n.name)) for n in graph.nodes if n.kind != "op"),
            tuple((layer in plan.recompute, layer in plan.selective) for layer in layers(graph)),
            plan.mesh, plan.dp, plan.across_axes)


def segments_of(graph: Graph, strategy: Strategy) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The graph's runs of repeated blocks of layers (hidup.graph.repeats.layer_runs) cut where
    the plan treats a block unlike the one before it: each segment's blocks alike."""
    found = []
    for run in layer_runs(graph):
        segment, before = [run[0]], _block_plan(graph, strategy, run[0])
        for block in run[1:]:
            plan = _block_plan(graph, strategy, block)
            if plan == before:
                segment.append(block)
            else:
                found.append(tuple(segment))
                segment, before = [block], plan
        found.append(tuple(segment))
    return tuple(s for s in found if len(s) > 1)


def _block_plan(graph: Graph, strategy: Strategy, block: tuple[str, ...]) -> tuple:
    """What the plan does with one block of layers, alike for blocks it treats alike."""
    return (tuple(strategy.options[n.name] for n in block_ops(graph, block)),
            tuple((strategy.placements.get(p), p in strategy.reshard, strategy.across.get(p))
                  for p in block_params(graph, block)),
            tuple((layer in strategy.recompute, layer in strategy.selective) for layer in block))


def _shortened(graph: Graph, kept: dict) -> Graph:
    """shortened(graph, kept), once per graph and cut."""
    cache = graph.__dict__.setdefault("_shortened", {})
    key = tuple(sorted(kept.items()))
    if key not in cache:
        cache[key] = shortened(graph, kept)
    return cache[key]


def _vector(priced: Priced) -> list[float]:
    e = priced.estimate
    return [e.step_time, e.computation, e.communication]


def _fixed_vector(m: MemoryReport) -> list[float]:
    """The parts of the memory held all step (their sum is under every peak)."""
    return [m.params, m.inputs, m.optimizer]


def _memory_vector(m: MemoryReport) -> list[float]:
    return _fixed_vector(m) + [m.grads_peak, m.activations_peak, m.peak]
