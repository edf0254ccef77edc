"""Choosing the plan to run: the one function that `hidup.plan()`, `python -m hidup.planner` and
`python -m simulator.predict` call, so that the same model, cluster and goal give the same plan
through every door.

HiDup's Duplex-aware search runs on the cluster's device mesh (machines x GPUs per machine where
the GPUs fill whole machines, or a 3-D mesh asked for) and over every GPU, with the fixed
strategies that apply (ddp, megatron, expert; hsdp, dp-megatron, dp-expert, fsdp+tp, tp+ep on a
mesh of 2 or more machines, hsdp+tp on a 3-D one) as its baselines, each also with every
layer recomputed, selectively (as torchtitan runs fsdp) or whole, where that might win
(hidup.planning.ranking.Ranking.recompute_hand); every plan is lowered with one micro-batch and
with k, held to a device's memory and ranked by the planner's estimate of the step
(hidup.planning.estimate: the simulator's rules, in one pass). The fastest that fits is
chosen: a searched plan (named 'hidup') or a fixed strategy that no searched plan beat."""
from __future__ import annotations

import math

from dataclasses import dataclass, field, replace

from hidup.graph.capture import Graph
from hidup.graph.dtypes import check_precision, run_dtypes
from hidup.planning.costs import Profile
from hidup.planning.programme import SearchOptions
from hidup.planning.ranking import Ranked, plan_key, rank_plans
from hidup.planning.search import SearchResult, search
from hidup.program import HOST_MODES, Program, optimizer_cost
from hidup.strategy import (ACROSS, FIXED, Mesh, Strategy, fixed_strategies, fixed_strategy,
                            microbatch_split, parse_recompute, recomputing, selective_part)

DUPLEX_K = 2  # the micro-batches Duplex is tried with when the goal leaves k to the planner
SEARCH = "search"


@dataclass(frozen=True)
class Goal:
    """What a plan is for, beside the model's graph and the cluster's profile. The defaults are
    those of every door (the API, both commands)."""

    gpus: int
    micro_batches: int | None = None  # None: plain SPMD or Duplex with DUPLEX_K, whichever is
    #   faster; a number: that many
    memory: float | None = None  # bytes a device holds (None: the profile's)
    optimizer: str = "adamw"  # the one training runs: its update's time and its state's memory
    mesh: tuple[int, ...] | None = None  # machines x GPUs per machine, or machines x blocks x
    #   GPUs per block (None: the cluster's; hidup.strategy.Mesh.grid makes it the mesh searched
    #   where it has 2 or more machines, or 3 axes)
    strategy: str = SEARCH  # or a fixed strategy's name (hidup.strategy.FIXED, ACROSS)
    beam: int = 16  # states the search keeps per cut
    exact: float = 0.0  # seconds for the integer programme's proof of the k = 1 plan (0: none)
    recompute: str = "auto"  # activation checkpointing: 'auto' (the fewest first layers that
    #   make a plan fit, where it does not, selectively or whole; a fixed strategy also with
    #   every layer recomputed, selectively or whole), 'none', 'all', a count of
    #   first layers, or layer names joined by commas, each also as 'selective:...'
    #   ('selective' alone: every layer; hidup.strategy.parse_recompute)
    mode: str = "graph"  # the executor mode training runs in (hidup.program.HOST_MODES): its
    #   host cost and, for 'compile', Inductor's fused kernels rank the plans
    precision: str | None = None  # 'fp32' or 'bf16' (autocast, float32 master weights): the
    #   dtypes the plans' values, collectives and memory are counted at (hidup.graph.dtypes);
    #   None: the profile's
    grows: str = ""  # what of the model grows with `gpus`, in words, where something does (the
    #   zoo's MoE models: their experts, hidup.models.ModelSpec.grows); a refusal then does not
    #   advise more GPUs


@dataclass(frozen=True)
class Selection:
    """The plan chosen for a goal, and what it was chosen from."""

    strategy: Strategy  # named 'hidup' where searched, else the fixed strategy's name
    k: int  # its micro-batches (1: plain SPMD)
    profile: Profile  # the cluster's, with the goal's memory limit
    goal: Goal  # as asked, with the mesh used
    duplex_k: int  # the micro-batch count Duplex was priced with (1: the batch does not split)
    candidates: dict[str, Strategy]  # the best searched plan ('hidup') and each fixed strategy
    ranked: tuple[Ranked, ...]  # every plan estimated that fits, fastest first
    search: SearchResult | None = None  # None for a fixed strategy
    notes: tuple[str, ...] = field(default=())  # why there is no Duplex or no searched plan
    # candidate -> {micro-batch count: its whole Program}, as the search lowered it (those it
    # ranked: simulator.predict.compare simulates them without lowering them again)
    programs: dict[str, dict[int, Program]] = field(default_factory=dict, repr=False,
                                                    compare=False)

    @property
    def searched(self) -> bool:
        return self.strategy.name == "hidup"

    @property
    def step_time(self) -> float:
        """The planner's estimate of the chosen plan's step (s)."""
        return next(r.step_time for r in self.ranked
                    if r.strategy.options == self.strategy.options and r.k == self.k
                    and r.strategy.mesh == self.strategy.mesh
                    and r.strategy.dp == self.strategy.dp)


def select_plan(graph: Graph, profile: Profile, goal: Goal) -> Selection:
    """The plan to run for `goal` on `profile` (a ValueError says why there is none)."""
    goal, profile, k, notes = _settle(graph, profile, goal)
    graph = run_dtypes(graph, goal.precision, profile.device)
    _check_state_fits(graph, goal, profile.device_memory)
    recompute = None if goal.recompute == "auto" else parse_recompute(goal.recompute, graph)
    selective = selective_part(goal.recompute)[0]
    mesh = Mesh.of_machines(*goal.mesh)
    options = SearchOptions(k=k, memory=profile.device_memory, optimizer=goal.optimizer,
                            mesh=mesh, beam=goal.beam, exact=goal.exact,
                            recompute=recompute, selective=selective, mode=goal.mode)
    fixed = fixed_strategies(graph, goal.gpus, mesh)
    found = None
    if goal.strategy == SEARCH:
        try:  # the fixed strategies are ranked as baselines, even where the search finds
            # no plan of its own
            found = search(graph, goal.gpus, profile, options, baselines=fixed)
            ranked = found.ranked
        except ValueError as exc:  # neither a searched plan nor a fixed one fits
            notes += (str(exc),)
            ranked = ()
    else:
        chosen = fixed_strategy(goal.strategy, graph, goal.gpus, mesh)
        if recompute is not None:  # checked here: the ranking would log it and go on
            chosen = recomputing(graph, chosen, recompute, selective)
        ranked = tuple(rank_plans(graph, goal.gpus, profile, {goal.strategy: chosen}, options))
    allowed = {goal.micro_batches} if goal.micro_batches else {1, k}
    fitting = [r for r in ranked if r.k in allowed]
    if not fitting:
        why = "; ".join(notes) or ("those that fit run with another micro-batch count" if ranked
                                   else "every plan lowered is over the limit")
        limit = "no limit" if profile.device_memory is None else \
            f"a device's {profile.device_memory / 2**30:.3g} GiB"
        batch = _batch(graph)
        if batch % goal.gpus:
            fix = (f"more memory, fewer GPUs or a batch that {goal.gpus} divides (more GPUs do "
                   f"not help: the batch of {batch} does not split over {goal.gpus}, so data "
                   f"parallelism cannot share it out)")
        elif goal.grows:
            fix = (f"more memory, a smaller batch or fewer GPUs (more GPUs do not help: the "
                   f"model was made for {goal.gpus} and {goal.grows} grow with them)")
        else:
            fix = "more GPUs or memory, a smaller batch"
        raise ValueError(f"no plan{'' if goal.strategy == SEARCH else ' of ' + goal.strategy} "
                         f"with {' or '.join(map(str, sorted(allowed)))} micro-batches lowers "
                         f"and fits {limit} on {goal.gpus} GPUs ({why}); give {fix}"
                         f"{', or leave micro_batches to the planner' if goal.micro_batches else ''}")
    best = fitting[0]
    strategy = replace(best.strategy, name="hidup" if _searched(best) else
                       best.name.removesuffix("+recompute").removesuffix("+selective"))
    candidates = {name: _as_ranked(name, s, ranked) for name, s in fixed.items()} \
        if goal.strategy == SEARCH else {goal.strategy: strategy}
    hidup = strategy if _searched(best) else \
        next((replace(r.strategy, name="hidup") for r in ranked if _searched(r)), None)
    if hidup is not None:  # the searched plan first, where the search found one
        candidates = {"hidup": hidup, **candidates}
    programs = {}
    if found is not None:
        programs = {name: {kk: found.programs[plan_key(s), kk] for kk in (1, k)
                           if (plan_key(s), kk) in found.programs}
                    for name, s in candidates.items()}
        found = replace(found, programs={})  # the others' Programs are let go
    return Selection(strategy, best.k, profile, goal, k, candidates, tuple(ranked), found, notes,
                     programs)


def _as_ranked(name: str, strategy: Strategy, ranked) -> Strategy:
    """Fixed strategy `name` as its fastest ranked run holds it: with the layers it recomputes
    (the goal's, or NAME+recompute's or NAME+selective's where that is its fastest that fits);
    as given where none fits."""
    best = next((r.strategy for r in ranked
                 if r.name in (name, f"{name}+recompute", f"{name}+selective")), strategy)
    return replace(best, name=name)


def _searched(plan: Ranked) -> bool:
    return plan.name.startswith(("search", "exact"))


def _settle(graph: Graph, profile: Profile, goal: Goal
            ) -> tuple[Goal, Profile, int, tuple[str, ...]]:
    """The goal checked, with its mesh; the profile with its memory limit; the micro-batch count
    Duplex is priced with; notes."""
    if not isinstance(goal.gpus, int) or goal.gpus < 1:
        raise ValueError(f"gpus={goal.gpus!r}: give the number of ranks, 1 or more")
    if goal.micro_batches is not None and (not isinstance(goal.micro_batches, int)
                                           or goal.micro_batches < 1):
        raise ValueError(f"micro_batches={goal.micro_batches!r}: give 1 (plain SPMD), 2 or more "
                         f"(Duplex), or None to let HiDup choose")
    if goal.strategy != SEARCH and goal.strategy not in FIXED and goal.strategy not in ACROSS:
        raise ValueError(f"strategy={goal.strategy!r}: give '{SEARCH}' or one of "
                         f"{[*FIXED, *ACROSS]}")
    goal = replace(goal, precision=check_precision(goal.precision or profile.precision))
    if goal.mode not in HOST_MODES:
        raise ValueError(f"mode={goal.mode!r}: give one of {', '.join(HOST_MODES)}")
    profile.check_world(goal.gpus)
    if goal.memory is not None:
        if not goal.memory > 0:
            raise ValueError(f"memory={goal.memory!r}: give a device's memory in bytes, e.g. "
                             f"16 * 2**30")
        profile = replace(profile, device_memory=float(goal.memory))
    mesh = tuple(goal.mesh or profile.mesh(goal.gpus))
    if len(mesh) not in (2, 3) or min(mesh) < 1 or math.prod(mesh) != goal.gpus:
        raise ValueError(f"mesh {'x'.join(map(str, mesh))} is not the {goal.gpus} GPUs; give "
                         f"MACHINESxGPUS or MACHINESxBLOCKSxGPUS whose product is "
                         f"{goal.gpus}")
    if goal.strategy == SEARCH:  # a fixed strategy says what of its own does not split
        _check_splits(graph, goal.gpus, mesh[0])
    k, notes = goal.micro_batches or DUPLEX_K, ()
    if k > 1:
        try:
            microbatch_split(graph, k)
        except ValueError as exc:  # the batch does not split, or an op needs it whole
            if goal.micro_batches:
                raise ValueError(f"micro_batches={goal.micro_batches}: {exc}") from exc
            notes, k = (f"no Duplex: {exc}",), 1
    return replace(goal, mesh=mesh), profile, k, notes


def _check_splits(graph: Graph, gpus: int, machines: int) -> None:
    """Refuse, before any search, a GPU count over which no op can split: a split over n ranks
    needs a dim of n or more (over the machines of a 2-D mesh, the batch), so beyond the largest
    dim every GPU would run the whole step."""
    largest = max((d for n in graph.nodes for d in n.out.shape), default=1)
    batch = _batch(graph)
    if gpus <= largest or machines > 1 and batch % machines == 0 and gpus // machines <= largest:
        return
    raise ValueError(f"{gpus} GPUs: no op of the model can be split over them (a split over n "
                     f"ranks needs a dimension of n or more; the largest is {largest}, the batch "
                     f"{batch}), so each GPU would run the whole step; give at most {largest} "
                     f"GPUs, or a larger batch")


def _check_state_fits(graph: Graph, goal: Goal, memory: float | None) -> None:
    """Refuse, before any search, a device that cannot hold the model's parameters and its
    optimizer's state even sharded evenly over every GPU: no plan holds less (each element is
    kept on some rank, with its state), whatever it does with the rest."""
    if memory is None:
        return
    states = optimizer_cost(goal.optimizer).states
    params = sum(p.out.nbytes for p in graph.params)
    total = params * (1 + states)
    if total / goal.gpus <= memory:
        return
    state = f" and {goal.optimizer}'s state" if states else ""
    raise ValueError(f"the model's parameters{state} take {_size(total)}, "
                     f"{_size(total / goal.gpus)} per GPU even sharded over all {goal.gpus}, "
                     f"over a device's {_size(memory)}; give at least "
                     f"{math.ceil(total / memory)} GPUs or more memory"
                     f"{', or an optimizer with less state (sgd keeps none)' if states else ''}")


def _size(nbytes: float) -> str:
    """Bytes in the unit that reads best: '3.2 GiB', '118 KiB', '1000 bytes'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} bytes"


def _batch(graph: Graph) -> int:
    """The batch: the smallest first dim of the user's inputs (1 where they have none)."""
    return min((n.out.shape[0] for n in graph.user_inputs if n.out.shape), default=1)
