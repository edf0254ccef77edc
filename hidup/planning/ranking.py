"""The ranking of plans: each plan the search (hidup.planning.search) or a caller hands over is
lowered with one micro-batch and with k, held to the memory limit, estimated
(hidup.planning.estimate) in the executor's mode and ranked; a plan over the limit whose state
fits is kept to be tried with layers recomputed (Ranking.recompute_deferred). The configurations
a user would pick by hand (the fixed strategies: Ranking.add_hand) are also tried with every
layer recomputed, selectively as torchtitan runs fsdp, or whole (Ranking.recompute_hand)."""
from __future__ import annotations

import logging
import math
from operator import attrgetter
from typing import NamedTuple

from hidup.cli.progress import progress
from hidup.graph.capture import Graph
from hidup.planning.costs import Profile
from hidup.planning.estimate import Estimate
from hidup.planning.extrapolate import Priced, Pricer
from hidup.planning.planfile import check
from hidup.planning.programme import Search, SearchOptions
from hidup.strategy import (Strategy, first_layers, layers, recomputing, sharded_storage,
                            stored_across)
from hidup.program.tasks import LoweringError, Program

log = logging.getLogger(__name__)
# On a 2-D mesh the search ranks the plans of the mesh's programme and of the 1-D one; where
# one programme's best plan is priced over BEHIND times the other's, only that plan of it is
# lowered and estimated (the estimate of the programme's plans differs from its price by -4% to
# +33% on the paper's models at 16 and 64 GPUs, so such a plan is not expected to win). The same
# holds for the plan with no communication (replicated_plan).
BEHIND = 2.0
# Nor is a plan lowered with more micro-batches where its estimate with one is over BEHIND
# times the fastest ranked: k micro-batches do each kernel and collective of one at least once,
# and the most they hide is the shorter of the two, so the estimate with k is at least half the
# estimate with one. Such a count is HOPELESS: tried, and not expected to win.
HOPELESS = "hopeless"
# Plans over the limit whose estimate and peak are within this share of each other's are
# recomputed once (Ranking.recompute_deferred): the programme's near-copies of one plan
ALIKE = 1e-3



class Ranked(NamedTuple):
    """A plan the search lowered with `k` micro-batches and estimated, and that fits."""

    step_time: float  # the fast estimate's (s)
    name: str  # search#j, search-k1#j, search-2d#j, exact#0, search-replicated#0 (+sharded:
    #   its parameters stored sharded; +resharded: also gathered again for the backward), or a
    #   baseline's
    strategy: Strategy
    dp_cost: float  # the programme's own price of it (nan for a baseline)
    estimate: Estimate
    k: int
    extrapolated: bool = False  # priced from short copies of the model (Ranking.confirm)
    peak: float = math.nan  # the memory model's peak per device (bytes), as priced


def lowered_whole(ranked) -> dict[tuple, Ranked]:
    """The entries of `ranked` lowered whole (not extrapolated), by (plan_key(strategy), k):
    their figures are what lowering the plan again would give."""
    out: dict[tuple, Ranked] = {}
    for r in ranked:
        if not r.extrapolated:
            out.setdefault((plan_key(r.strategy), r.k), r)
    return out


DEFERRED = "deferred"  # Ranking.add's word for a plan over the limit kept to be recomputed



def plan_key(strategy: Strategy) -> tuple:
    """What makes two plans the same plan (all of it but its name and notes)."""
    return (strategy.mesh, strategy.dp, tuple(strategy.placements.items()),
            tuple(strategy.options.items()), tuple(sorted(strategy.reshard)),
            tuple(sorted(strategy.across.items())), strategy.across_axes,
            tuple(sorted(strategy.recompute)), tuple(sorted(strategy.selective)))


class Ranking:
    """The plans lowered and estimated so far: each with one micro-batch and with k, each
    variant that lowers and fits in memory kept (Duplex pays only where it hides more than it
    costs)."""

    def __init__(self, graph: Graph, world: int, profile: Profile, options: SearchOptions):
        self.graph, self.world, self.profile, self.options = graph, world, profile, options
        self.memory = math.inf if options.memory is None else options.memory
        self.ranked: list[Ranked] = []
        # plans ranked so far: count -> it fits (True, False, or DEFERRED)
        self.seen: dict[tuple, dict[int, bool | str]] = {}
        self.least = math.inf  # the smallest peak of a plan over the limit (bytes)
        # plans over the limit whose parameters and state fit, for recompute_deferred:
        # (estimate without recomputation, order, strategy, name, dp_cost, k, peak)
        self.deferred: list[tuple] = []
        self.deferred_fit = True  # finals count a deferred plan as one that fits
        # hand configurations (add_hand) to try with every layer recomputed: (strategy, name)
        self.hand: list[tuple[Strategy, str]] = []
        # (plan key, k) -> the estimate of a plan lowered with k that fits, or that is over the
        # limit with its parameters and state within it (s): a bound for it recomputed
        self.estimated: dict[tuple, float] = {}
        self.pricer = Pricer(graph, world, profile, options.optimizer, options.mode,
                             options.extrapolate)
        # (plan key, k) -> the whole Program of a plan ranked or of a hand configuration
        # (add_hand, fitting or not), where it was lowered whole: what a caller simulating
        # them would lower again (simulator.predict.compare)
        self.programs: dict[tuple, Program] = {}

    @property
    def fastest(self) -> float:
        """The smallest step time ranked so far (s; infinite before any)."""
        return min((r.step_time for r in self.ranked), default=math.inf)

    def finals(self, dp: Search, finals, cost, keep: int, tag: str, at: list[int]) -> None:
        """Rank the first `keep` distinct plans of `finals` that fit with a micro-batch count of
        `at` (named TAG#j, the programme's `cost` of its label beside it), each lowered with k
        and with one but where tried already; after the first, none that the programme prices
        over BEHIND times the fastest ranked (the baselines are ranked before)."""
        mine: list[tuple] = []
        for j, label in enumerate(finals[:10 * keep]):
            if j and dp.objective == "time" and far_behind(cost(label), self.fastest):
                log.info("plans %s#%d.. not lowered: priced %.4g s, over %g times the fastest "
                         "ranked", tag, j, cost(label), BEHIND)
                break  # finals come cheapest first: so are the rest
            strategy = dp.strategy(label, "hidup" if dp.objective == "time" else "min-comm")
            plan = plan_key(strategy)
            if plan in mine:
                continue  # the same plan reached through another state
            mine.append(plan)
            if plan not in self.seen:
                check(self.graph, strategy)
            tried = self.add_stored(strategy, f"{tag}#{j}", cost(label), sorted({1, dp.k}))
            keep -= any(tried[kk] is True or tried[kk] == HOPELESS
                        or tried[kk] == DEFERRED and self.deferred_fit
                        for kk in at)  # it fits: the DP's memory model is an estimate
            if keep == 0:
                break

    def add_stored(self, strategy: Strategy, name: str, dp_cost: float,
                   counts: list[int] | None = None) -> dict[int, bool | str]:
        """Rank the plan and, where it keeps some parameter whole, the same plan with every such
        parameter stored sharded (NAME+sharded; hidup.strategy.sharded_storage): where a
        parameter lives is the search's decision too, priced by the estimate (gathers before
        use, gradients reduce-scattered) and held to memory (state on the shards). Where that
        does not fit with some count, also with each gathered weight freed after the forward and
        gathered again for the backward (NAME+resharded). On a 2-D mesh, also with its
        parameters stored sharded over its dp axis too (NAME+across; hidup.strategy.
        stored_across). Whether each count fits: any variant's."""
        tried = dict(self.add(strategy, name, dp_cost, counts))
        ranks = self.world // strategy.parts
        variants = []
        if strategy.mesh:  # stored sharded over the dp axis too (NAME+across)
            variants.append(self.add(stored_across(self.graph, strategy, ranks),
                                     f"{name}+across", dp_cost, counts))
        sharded = sharded_storage(self.graph, strategy, ranks)
        if sharded is not strategy:
            kept = self.add(sharded, f"{name}+sharded", dp_cost, counts)
            variants.append(kept)
            if not all(kept.values()):
                variants.append(self.add(
                    sharded_storage(self.graph, strategy, ranks, reshard=True),
                    f"{name}+resharded", dp_cost, counts))
        for fits in variants:
            for kk, ok in fits.items():
                tried[kk] = tried.get(kk, False) or ok
        return tried

    def add(self, strategy: Strategy, name: str, dp_cost: float, counts: list[int] | None = None,
            seen: bool = True, hand: bool = False) -> dict[int, bool | str]:
        """Estimate the plan with each micro-batch count of `counts` (default: 1 and k) not
        tried yet (`seen`: remember it, so that a plan reached twice is lowered once); return
        whether it fits, per count (DEFERRED: it does not, but its parameters and state do, so
        recompute_deferred tries it with layers recomputed). A `hand` configuration's whole
        Programs are kept (`programs`) whether it fits or not."""
        if self.options.recompute is not None:
            strategy = recomputing(self.graph, strategy, self.options.recompute,
                                   self.options.selective)
        tried = self.seen.setdefault(plan_key(strategy), {}) if seen else {}
        counts = counts or sorted({1, self.options.k})
        for kk in counts:
            if kk in tried:
                continue
            tried[kk] = False
            progress(f"ranking the plans ({len(self.ranked)} ranked): {name} with k={kk}")
            try:
                priced = self.price(strategy, kk)
            except (LoweringError, ValueError) as exc:
                log.info("plan %s with k=%d cannot be lowered: %s", name, kk, exc)
                continue
            if hand and priced.program is not None:
                self.programs[plan_key(strategy), kk] = priced.program
            memory = priced.memory
            if memory.peak > self.memory:
                self.least = min(self.least, memory.peak)
                log.info("plan %s with k=%d needs %.3g GiB per device: over the limit", name, kk,
                         memory.peak / 2**30)
                if self.defer_recomputed(strategy, name, dp_cost, kk, priced):
                    tried[kk] = DEFERRED  # as it fits: ranked recomputed, or a faster plan is
                    continue
                # no larger count can fit where what any count holds (parameters and optimizer
                # state) is over the limit, or where 1/k of every part would still be (each of
                # the k micro-batches keeps its whole forward's activations for its backward)
                for more in counts:
                    if more > kk and (memory.params + memory.optimizer > self.memory
                                      or memory.peak * kk > more * self.memory):
                        tried[more] = False
                continue
            step_time = self.rank(priced, strategy, name, dp_cost, kk)
            tried[kk] = True
            if self.options.objective == "time" and step_time > BEHIND * self.fastest:
                for more in counts:
                    if more > kk and more not in tried:
                        log.info("plan %s not lowered with k=%d: %.4g s with k=%d, over %g "
                                 "times the fastest ranked", name, more, step_time, kk,
                                 BEHIND)
                        tried[more] = HOPELESS
        return tried

    def price(self, strategy: Strategy, kk: int, whole: bool = False) -> Priced:
        """The plan lowered with kk micro-batches: its estimate in the goal's mode and its
        memory (extrapolated from short copies of the model where it repeats layers, unless
        `whole`: hidup.planning.extrapolate)."""
        return self.pricer.price(strategy, kk, whole)

    def rank(self, priced: Priced, strategy: Strategy, name: str, dp_cost: float,
             kk: int) -> float:
        """Rank a plan priced with kk micro-batches that fits, by its estimate; the estimate's
        step time."""
        est = priced.estimate
        self.ranked.append(Ranked(est.step_time, name, strategy, dp_cost, est, kk,
                                  priced.extrapolated, priced.memory.peak))
        self.estimated[plan_key(strategy), kk] = est.step_time
        if priced.program is not None:
            self.programs[plan_key(strategy), kk] = priced.program
        return est.step_time

    def confirm(self) -> None:
        """Lower the fastest plan ranked on the whole graph where its figures were extrapolated
        and rank it by those (dropped where it turns out not to fit), until the fastest is one
        lowered whole: what the user reads of the chosen plan is never extrapolated."""
        while self.ranked:
            best = min(self.ranked, key=attrgetter("step_time"))
            if not best.extrapolated:
                return
            self.ranked.remove(best)
            progress(f"confirming the fastest plan: {best.name} with k={best.k}")
            priced = self.price(best.strategy, best.k, whole=True)
            log.info("plan %s with k=%d lowered whole: %.4g s (extrapolated %.4g s), %.3g GiB",
                     best.name, best.k, priced.estimate.step_time, best.step_time,
                     priced.memory.peak / 2**30)
            if priced.memory.peak <= self.memory:
                self.rank(priced, best.strategy, best.name, best.dp_cost, best.k)

    def add_hand(self, strategy: Strategy, name: str) -> None:
        """Rank a configuration a user would pick by hand (a fixed strategy, NAME) as it is (not
        remembered as seen, so that it keeps its name where a searched plan is the same) and,
        where the goal leaves recomputation to the planner and the model has layers, keep it for
        recompute_hand: with every layer recomputed, selectively or whole."""
        self.add(strategy, name, math.nan, seen=False, hand=True)
        if self.options.recompute is None and layers(self.graph) and not (
                strategy.recompute or strategy.selective):
            self.hand.append((strategy, name))

    def recompute_hand(self) -> None:
        """Rank each configuration kept by add_hand with every layer recomputed selectively
        (NAME+selective: as torchtitan runs fsdp) and, where that does not fit, whole
        (NAME+recompute), with each micro-batch count at which it might be chosen, each held to
        memory. Recomputing only adds work, so a variant is no faster than the plan as it is
        with the same count: tried only where that estimate (the ranked one where the plan
        fits, else defer_recomputed's) is below the fastest ranked, which leaves out a plan
        that fits as it is and the counts at which it cannot win. A count the plan was not
        estimated with does not lower, holds parameters and state over the limit (nothing
        recomputed fits), or is hopeless (k micro-batches take at least half of one's time):
        not tried either. With k, a selectively recomputed plan can be the only one that fits:
        its plan as it is was then deferred with an estimate, and it is tried whenever it can
        win. Whole layers recompute what selective ones do and more: tried only where selective
        ones do not fit and recompute_deferred ranked no NAME+recompute with that count (its
        fewest first layers recomputed whole are no slower than all of them)."""
        names = layers(self.graph)
        for strategy, name in self.hand:
            for kk in sorted({1, self.options.k}):
                if self.estimated.get((plan_key(strategy), kk), math.inf) >= self.fastest:
                    continue
                if self.add(recomputing(self.graph, strategy, names, True),
                            f"{name}+selective", math.nan, [kk])[kk] is True:
                    continue
                if not any(r.name == f"{name}+recompute" and r.k == kk for r in self.ranked):
                    self.add(recomputing(self.graph, strategy, names, False),
                             f"{name}+recompute", math.nan, [kk])
        self.hand = []

    def defer_recomputed(self, strategy: Strategy, name: str, dp_cost: float, kk: int,
                         priced: Priced) -> bool:
        """Where the plan does not fit with kk micro-batches but its parameters and optimizer
        state do, keep it for `recompute_deferred` with its estimate without recomputation
        (`priced`'s); whether it was kept."""
        memory = priced.memory
        if strategy.recompute or strategy.selective or self.options.recompute is not None or \
                not layers(self.graph) or memory.params + memory.optimizer > self.memory:
            return False
        bound = priced.estimate.step_time
        self.estimated[plan_key(strategy), kk] = bound
        self.deferred.append((bound, len(self.deferred), strategy, name, dp_cost, kk,
                              memory.peak))
        return True

    def recompute_deferred(self) -> None:
        """Rank each plan kept by defer_recomputed, fastest first, with the activations of the
        fewest first layers recomputed in the backward that make it fit, selectively
        (NAME+selective: the matmuls' and attention's outputs kept) and whole (NAME+recompute;
        hidup.strategy.recompute), each priced by the estimate (the recomputed forward) and held
        to memory. The count is guessed from what recomputing every layer saves, as if each
        layer saved as much. Recomputing only adds work, so a plan whose estimate without it is
        no faster than a plan ranked already is not tried. Then the hand configurations
        (recompute_hand), against the fastest ranked by then. Of plans whose estimate and peak
        without recomputation are within ALIKE of one tried with the same k (the programme's
        plans that differ in ops that cost next to nothing, such as a view's split), none is
        tried."""
        tried: list[tuple] = []  # (bound, peak, k) of the plans tried
        for bound, _, strategy, name, dp_cost, kk, peak in sorted(self.deferred):
            if bound >= self.fastest:
                log.info("plan %s with k=%d not recomputed: %.4g s without recomputation, "
                         "%.4g s ranked already", name, kk, bound, self.fastest)
                continue
            if any(kk == k0 and _alike(bound, b0) and _alike(peak, p0) for b0, p0, k0 in tried):
                log.info("plan %s with k=%d not recomputed: estimated and holding within "
                         "%g of one tried", name, kk, ALIKE)
                continue
            tried.append((bound, peak, kk))
            # whole layers first: where recomputing all of them does not fit, selectively
            # recomputing them (which keeps more) does not either
            if self._fewest_layers(strategy, f"{name}+recompute", dp_cost, kk, peak, False):
                self._fewest_layers(strategy, f"{name}+selective", dp_cost, kk, peak, True)
        self.deferred = []
        self.recompute_hand()

    def _fewest_layers(self, strategy: Strategy, name: str, dp_cost: float, kk: int,
                       peak: float, selective: bool) -> bool:
        names = layers(self.graph)
        every = recomputing(self.graph, strategy, names, selective)
        try:
            priced = self.price(every, kk)
        except (LoweringError, ValueError):
            return False
        least = priced.memory.peak
        if least > self.memory:
            self.least = min(self.least, least)
            return False
        n = math.ceil(len(names) * (peak - self.memory) / (peak - least))
        for count in (n, n + 1):  # fewer than every layer
            if count >= len(names):
                break
            plan = recomputing(self.graph, strategy, first_layers(self.graph, count), selective)
            if self.add(plan, name, dp_cost, [kk])[kk]:
                return True
        self.rank(priced, every, name, dp_cost, kk)  # every layer (priced above): it fits
        self.seen.setdefault(plan_key(every), {})[kk] = True
        return True


def _alike(a: float, b: float) -> bool:
    return abs(a - b) <= ALIKE * max(abs(a), abs(b))


def far_behind(price: float, least: float) -> bool:
    """A plan (or a programme's best) priced over BEHIND times the least: not lowered."""
    return price > BEHIND * least


def rank_plans(graph: Graph, world: int, profile: Profile, plans: dict[str, Strategy],
               options: SearchOptions = SearchOptions()) -> list[Ranked]:
    """The given plans (hand configurations: Ranking.add_hand), each lowered with one
    micro-batch and with k, estimated and held to the memory limit, and recomputed where it
    might pay (Ranking.recompute_deferred); fastest first."""
    ranking = Ranking(graph, world, profile, options)
    for name, strategy in plans.items():
        ranking.add_hand(strategy, name)
    ranking.recompute_deferred()
    ranking.confirm()
    return sorted(ranking.ranked, key=attrgetter("step_time"))
