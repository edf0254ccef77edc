"""Duplex-aware sharding search. The dynamic programme
(hidup.planning.programme, the paper's Algorithm 1) prices every plan with k micro-batches and
with one; its few best plans either way, with the plan with no communication and the expert
strategies beside them, are lowered and ranked by the fast estimate (hidup.planning.ranking).
With one micro-batch the programme's model is linear: hidup.planning.exact solves it as an
integer programme, and search(exact=...) ranks that proven plan too. On a 2-D mesh the search
runs the programme data parallel over each of its axes and over every rank (1-D), and ranks
every kind of plan."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from operator import attrgetter

from hidup.cli.collector import no_gc
from hidup.graph.capture import Graph
from hidup.graph.ops.registry import replicated
from hidup.graph.repeats import Cut
from hidup.planning.beam import _BEST, _COST, _PLAIN
from hidup.planning.costs import Profile
from hidup.planning.estimate import Estimate
from hidup.planning.exact import exact_plan
from hidup.planning.programme import Search, SearchOptions
from hidup.planning.ranking import Ranked, Ranking, far_behind
from hidup.strategy import Mesh, Strategy, fitting_options

log = logging.getLogger(__name__)


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
    # (its data-parallel parts, cost of its plan, proven lower bound, proven optimal, beam's
    # cost), seconds
    exact: tuple[tuple[int, float, float, bool, float], ...] = ()
    # (plan key, k) -> the whole Program of each plan ranked that was lowered whole
    # (Ranking.programs); select_plan keeps those of its candidates only
    programs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def candidates(self) -> tuple[tuple[str, float], ...]:
        """(name with its micro-batch count, estimated step time) of every plan ranked."""
        return tuple((f"{r.name} k={r.k}", r.step_time) for r in self.ranked)


def search(graph: Graph, world: int, profile: Profile, options: SearchOptions = SearchOptions(),
           baselines: dict[str, Strategy] | None = None) -> SearchResult:
    """The best plan: the dynamic programme's `keep` cheapest plans with k micro-batches, its
    `keep` cheapest with one (its `keep` best either way are among them), the plan with no
    communication (every op replicated: search-replicated#0; replicated_plan) and the `baselines`
    (also with every layer recomputed where that might win: Ranking.recompute_hand), each
    lowered with k and with one, ranked by the fast estimate (objective 'comm': by its own
    count). The programme prices every plan with k micro-batches and with one and keeps what is
    best either way, so that a search for Duplex finds the plans a plain search finds. On a 2-D
    `options.mesh` it runs data parallel over its machines, over its GPUs (_axes; on a 3-D mesh
    with each axis split over in turn) and over every rank (1-D), and ranks them all (of a
    programme whose best is priced over BEHIND times another's, that best plan). The integer
    programme is not run data parallel over the GPUs. Every plan is priced and held to
    `memory` with `optimizer`'s update and state. With `exact` > 0 seconds the k = 1
    programme's best plan on each mesh is also sought by the integer programme
    (hidup.planning.exact), proven optimal for that cost model unless the time runs out, and
    ranked as exact#0 (exact-2d#0); the beam can miss it (experiments.search_exactness)."""
    with no_gc():  # it makes a million small objects, none in a cycle: the collector's
        # passes over them (and over the labels alive while plans are lowered) cost a tenth
        return _search(graph, world, profile, options, baselines or {})


def _search(graph: Graph, world: int, profile: Profile, options: SearchOptions,
            baselines: dict[str, Strategy]) -> SearchResult:
    started = time.perf_counter()
    ranking = Ranking(graph, world, profile, options)
    labels, proofs, runs, failed = 0, [], [], {}
    for axes in _axes(options.mesh):
        try:
            dp = programme(graph, world, profile, replace(
                options, mesh=options.mesh if axes else None, dp=axes))
            runs.append((axes, dp, dp.run()))
        except ValueError as exc:  # no plan of the programme fits: the baselines may
            log.info("search on %s, data parallel over %s: %s", options.mesh if axes else world,
                     axes, exc)
            failed[axes] = str(exc)
            continue
        labels += dp.labels
    least = min((finals[0].best for _, _, finals in runs), default=math.inf)
    timed = options.objective == "time"
    for name, strategy in baselines.items():  # first, so that the programmes' plans priced
        # far behind the fastest of them are not lowered (Ranking.finals); also recomputed
        # (Ranking.recompute_hand)
        ranking.add_hand(strategy, name)
    _rank_finals(ranking, runs, least, proofs)
    one_d = next((dp for axes, dp, _ in runs if not axes), None)
    whole = replicated_plan(one_d) if timed and one_d is not None else None
    if whole is not None and not far_behind(one_d.plain.price(whole), least):
        ranking.add(one_d.expand(whole), "search-replicated#0", one_d.plain.price(whole))
    ranking.recompute_deferred()
    ranking.confirm()
    if not ranking.ranked and ranking.deferred_fit:  # the plans over the limit that would
        # fit recomputed do not: rank more of the programmes' plans, as they fit or not
        ranking.deferred_fit = False
        _rank_finals(ranking, runs, least, None)
        ranking.recompute_deferred()
        ranking.confirm()
    if not ranking.ranked:
        if () in failed:  # the programme over every GPU found nothing: its reason
            raise ValueError(failed[()])
        limit = math.inf if options.memory is None else options.memory / 2**30
        least = "" if ranking.least == math.inf else \
            f" (the smallest lowered needs {ranking.least / 2**30:.3g} GiB)"
        raise ValueError(f"search: no plan fits in {limit:.3g} GiB per device{least} and lowers "
                         f"for this model and world size")
    ranked = sorted(ranking.ranked, key=attrgetter("step_time" if timed else "dp_cost"))
    best = ranked[0]
    log.info("search: %d labels, %d plans ranked in %.2f s", labels, len(ranked),
             time.perf_counter() - started)
    return SearchResult(best.strategy, best.k, best.dp_cost, best.estimate, tuple(ranked),
                        time.perf_counter() - started, labels, tuple(proofs), ranking.programs)


def _rank_finals(ranking: Ranking, runs, least: float, proofs: list | None) -> None:
    """Rank each programme's final plans (of a programme priced far over the least, its best
    only), and with `exact` its integer programme's plan (its proof added to `proofs`; None:
    not sought)."""
    options, mesh = ranking.options, ranking.options.mesh
    timed = options.objective == "time"
    # the programme priced best first, so that the fastest ranked is known early (HOPELESS)
    for axes, dp, finals in sorted(runs, key=lambda run: run[2][0].best):
        # the placements across the machines: no integer programme
        over_gpus = bool(axes) and not mesh.outside(axes)
        mesh_tag = _tag(mesh, axes)
        if timed and far_behind(finals[0].best, least):  # its plan best either way only
            # (finals are in that order)
            ranking.finals(dp, finals, _BEST, 1, "search" + mesh_tag, sorted({1, dp.k}))
        else:  # the `keep` cheapest plans with k micro-batches and the `keep` cheapest with
            # one: the `keep` best either way are among them
            for by, tag, at in _orders(dp.k, options.objective):
                ranking.finals(dp, sorted(finals, key=by), by, options.keep, tag + mesh_tag, at)
        if options.exact > 0 and timed and not over_gpus and proofs is not None:
            proof = exact_plan(dp.plain, "hidup", options.exact)
            beam_cost = min(label.plain for label in finals)
            proofs.append((dp.dp_parts, proof.cost, proof.bound, proof.optimal, beam_cost))
            log.info("exact k=1 plan on %d data-parallel parts: %.4g s (bound %.4g, %s) in "
                     "%.1f s; the beam's %.4g s", dp.dp_parts, proof.cost, proof.bound,
                     "optimal" if proof.optimal else "time ran out", proof.seconds, beam_cost)
            ranking.add_stored(proof.strategy, f"exact{mesh_tag}#0", proof.cost)


def _axes(mesh: Mesh | None) -> list[tuple[str, ...]]:
    """The data-parallel axes searched (): the 1-D mesh of every GPU): on a mesh, every axis
    but one, each axis split over in turn where every other has 2 or more ranks (on a 2-D mesh:
    across the machines, placements inside each; over each machine's GPUs, placements across
    the machines), and the 1-D mesh."""
    if mesh is None:
        return [()]
    splits = [tuple(a for a in mesh.names if a != split) for split in reversed(mesh.names)]
    return [dp for dp in splits if all(mesh.size(a) > 1 for a in dp)] + [()]


def _tag(mesh: Mesh | None, dp: tuple[str, ...]) -> str:
    """How a programme's plans are named after their mesh: '' on the 1-D mesh, '-2d' data
    parallel across the machines of a 2-D one, '-2dt' over its GPUs; on a 3-D mesh '-3d-' and
    the axis split over."""
    if not dp:
        return ""
    if len(mesh.shape) == 2:
        return "-2d" if mesh.outside(dp) else "-2dt"
    return f"-3d-{mesh.split_axis(dp)}"


def _orders(k: int, objective: str) -> list[tuple]:
    """How the programme's final labels are ranked: (order, name, the micro-batch counts at
    which a plan counts as one of the order's best). Every plan is lowered with k and with
    one: the programme's prices differ from the estimate's, and a plan it prices best with k
    can be the fastest with one."""
    if k == 1 or objective != "time":  # one order: the cost (with k, or the bytes)
        return [(_COST, "search", [k])]
    return [(_COST, "search", [k]), (_PLAIN, "search-k1", [1])]


def programme(graph: Graph, world: int, profile: Profile, options: SearchOptions) -> Search:
    """The search's programme on `options.mesh`, data parallel over `options.dp`; on a 2-D mesh
    whose data-parallel parts of the batch do not split into k micro-batches, the programme
    with one (its plans run without Duplex there)."""
    cut = None
    if len(graph.ops) >= options.extrapolate and options.exact == 0:
        cut = Cut.of(graph)
        cut = cut if cut.cuts else None
    try:
        return Search(graph, world, profile, options, cut)
    except ValueError as exc:
        if options.mesh is None or options.k == 1:
            raise
        log.info("search on %s, data parallel over %s, without Duplex: %s", options.mesh,
                 options.dp, exc)
        return Search(graph, world, profile, replace(options, k=1), cut)


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
