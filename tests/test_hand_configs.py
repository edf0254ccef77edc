"""The configurations a user would pick by hand (the fixed strategies, as they are and with every
layer recomputed selectively or whole: torchtitan runs fsdp with selective recomputation) are
ranked beside the search, so that its choice is never predicted slower than the best of them
that fits (hidup.planning.ranking: Ranking.add_hand, Ranking.recompute_hand)."""
from __future__ import annotations

import math

import pytest

from hidup.models import capture_model, get_model
from hidup.planning.estimate import estimate
from hidup.planning.memory import peak_memory
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.ranking import Ranking
from hidup.planning.select import Goal, select_plan
from hidup.program import lower
from hidup.strategy import fixed_strategies, fixed_strategy, layers, recomputing

PROFILE = "v100-2x4"
SUFFIXES = ("+selective", "+recompute")


@pytest.fixture(scope="module", params=["gpt:tiny", "llama:tiny"])
def graph(request):
    return capture_model(get_model(request.param, gpus=2), 8)


def _hand_configs(graph):
    """name -> strategy: each fixed strategy as it is, and with every layer recomputed
    selectively (NAME+selective) and whole (NAME+recompute)."""
    out = {}
    for name, strategy in fixed_strategies(graph, 2).items():
        out[name] = strategy
        for suffix in SUFFIXES:
            out[name + suffix] = recomputing(graph, strategy, layers(graph),
                                             suffix == "+selective")
    return out


def _peak(graph, strategy, k):
    return peak_memory(lower(graph, strategy, 2, k)).peak


def _between_fsdp(graph) -> float:
    """A limit over which fsdp is as it is, with one micro-batch and with two, and under which
    it is with every layer recomputed selectively, with one or two."""
    fsdp = fixed_strategy("fsdp", graph, 2)
    every = recomputing(graph, fsdp, layers(graph), selective=True)
    low = min(_peak(graph, every, k) for k in (1, 2))
    high = min(_peak(graph, fsdp, k) for k in (1, 2))
    assert low < high, (low, high)
    return (low + high) / 2


def test_the_choice_is_never_slower_than_a_hand_config_that_fits(graph):
    """With a limit under which fsdp fits only recomputed, the selection ranks fsdp with every
    layer recomputed selectively, and is predicted no slower than any hand configuration that
    fits (each lowered here with one micro-batch and with two, held to the limit, estimated)."""
    limit = _between_fsdp(graph)
    profile = load_profile(PROFILE)
    chosen = select_plan(graph, profile, Goal(2, memory=limit))
    names = [r.name for r in chosen.ranked]
    assert "fsdp+selective" in names and "fsdp" not in names, names
    every = set(layers(graph))
    selective = [r for r in chosen.ranked if r.name == "fsdp+selective"]
    assert chosen.step_time <= min(r.step_time for r in selective)
    fits = {}
    for name, strategy in _hand_configs(graph).items():
        for k in (1, 2):
            program = lower(graph, strategy, 2, k)
            if peak_memory(program).peak <= limit:
                fits[f"{name} k={k}"] = estimate(program, chosen.profile, "graph").step_time
    assert any(name.startswith("fsdp+selective") for name in fits), fits
    assert chosen.step_time <= min(fits.values()) * (1 + 1e-9), (chosen.step_time, fits)
    # the configuration torchtitan runs (every layer selective) is ranked where it might win
    fsdp = fixed_strategy("fsdp", graph, 2)
    plain = min(estimate(lower(graph, fsdp, 2, k), chosen.profile, "graph").step_time
                for k in (1, 2))
    assert plain >= chosen.step_time or any(r.strategy.selective == every for r in selective)


def test_a_goal_that_fixes_recomputation_ranks_no_recomputed_variants(graph):
    profile = load_profile(PROFILE)
    for recompute in ("none", "selective"):
        chosen = select_plan(graph, profile, Goal(2, recompute=recompute))
        assert not [r.name for r in chosen.ranked if r.name.endswith(SUFFIXES)], recompute
        want = set(layers(graph)) if recompute == "selective" else set()
        assert all(r.strategy.selective == want and not r.strategy.recompute
                   for r in chosen.ranked)


def test_a_hand_config_is_recomputed_only_where_it_might_win(graph):
    """Recomputing only adds work: fsdp is tried with every layer recomputed where, as it is, it
    is over the limit and its estimate is below the fastest ranked; not where it fits as it is
    (that estimate is ranked itself), nor where a faster plan is ranked already. Whole layers
    (slower) are tried only where every layer selective does not fit."""
    profile, fsdp = load_profile(PROFILE), fixed_strategy("fsdp", graph, 2)
    peaks = [_peak(graph, s, 1) for s in (
        fsdp, *(recomputing(graph, fsdp, layers(graph), how) for how in (True, False)))]
    assert peaks[0] > peaks[1] > peaks[2], peaks  # as it is, selective, whole
    selective, whole = (peaks[0] + peaks[1]) / 2, (peaks[1] + peaks[2]) / 2
    for memory, faster, tried in ((None, 1.0, []), (selective, 1.0, ["fsdp+selective"]),
                                  (whole, 1.0, ["fsdp+recompute"]), (selective, 0.1, [])):
        ranking = Ranking(graph, 2, profile, SearchOptions(k=1, memory=memory))
        if faster < 1:  # a plan ranked already, faster than fsdp as it is
            other = Ranking(graph, 2, profile, SearchOptions(k=1))
            other.add(fsdp, "other", math.nan, [1])
            ranking.ranked.append(other.ranked[0]._replace(
                step_time=faster * other.ranked[0].step_time))
        ranking.add_hand(fsdp, "fsdp")
        ranking.recompute_hand()  # (recompute_deferred would first try fewer layers)
        names = [r.name for r in ranking.ranked if r.name.startswith("fsdp+")]
        assert names == tried, (memory, faster, names)
        assert not ranking.hand
