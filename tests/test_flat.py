"""Ops over every rank of a 2-D mesh (flat placements, hidup.graph.placement) beside ops over a
machine's ranks: the placements, tp+ep (Megatron inside a machine, experts over every GPU), the
Program's groups, the programme's options and prices. Equivalence to single-device training:
test_equivalence.py's mesh cases."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hidup.graph.placement import (FLAT_R, P, R, FlatPartial, FlatShard, flat, is_flat,
                                   parse_option, parse_placement, plain)
from hidup.models import capture_model, get_model
from hidup.planning.estimate import estimate
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import Search, SearchOptions
from hidup.program import Compute, Convert, LoweringError, lower
from hidup.strategy import Mesh, fixed_strategy, sharded_storage
from hidup.strategy.describe import describe, mesh_option
from hidup.graph.placement import Shard
from simulator.engine import simulate
from conftest import turned

ROWS = ((0, 1), (2, 3))
TWO = Mesh.grid(2, 2)


@pytest.fixture(scope="module")
def moe():
    spec = get_model("bert-sgmoe:tiny", gpus=4)
    return capture_model(spec, spec.batch)


def two_by_two():
    return replace(load_profile("v100-8x8-10gbps"), gpus_per_node=2)


def test_flat_placements_are_dtensor_types_never_equal_to_a_machines():
    s = FlatShard(1)
    assert isinstance(s, Shard) and s.dim == 1 and str(s) == "S(1)@all"
    assert s != Shard(1) and Shard(1) != s and s == flat(Shard(1)) and plain(s) == Shard(1)
    assert FLAT_R != R and R != FLAT_R and str(FLAT_R) == "R@all" and plain(FLAT_R) == R
    assert FlatPartial() != P and str(flat(P)) == "P(sum)@all"
    assert len({s, Shard(1), FLAT_R, R}) == 4
    for text in ("S(0)@all", "R@all", "P(sum)@all", "S(2)"):
        assert str(parse_placement(text)) == text
    opt = parse_option("(S(0)@all, S(1)@all) -> S(1)@all")
    assert all(map(is_flat, opt.inputs)) and str(opt) == "(S(0)@all, S(1)@all) -> S(1)@all"


def test_the_fast_comparisons_answer_as_equality_does():
    """placement.same, is_r and is_whole (the lowering's and the search's comparisons, types
    first) against `==` on every pair of plain and flat placements, and None."""
    from hidup.graph.placement import Partial, Replicate, is_r, is_whole, same
    every = [Shard(0), Shard(1), Shard(0), R, Replicate(), P, Partial(), FlatShard(0),
             FlatShard(1), FLAT_R, FlatPartial(), None]
    for a in every:
        assert is_r(a) == (a == R) and is_whole(a) == (a is not None and plain(a) == R)
        for b in every:
            assert same(a, b) == (a == b), (a, b)


def test_tp_ep_runs_experts_over_every_rank_and_the_rest_inside_machines(moe):
    strategy = fixed_strategy("tp+ep", moe, 4, TWO)
    flat_ops = [n for n, o in strategy.options.items() if is_flat(o.output)]
    assert flat_ops == ["einsum_2", "relu", "einsum_3"]  # the experts' two matmuls, between
    assert mesh_option(moe, strategy, "einsum_2") == "([S(0), S(0)], [S(1), S(1)]) -> [S(1), S(1)]"
    assert "over all 4 GPUs: 2 key ops expert parallel" in describe(moe, strategy)
    experts = [t for n in flat_ops for t in moe.node(n).inputs if moe.node(t).kind == "param"]
    assert experts and all(strategy.home(t) == FlatShard(0) for t in experts)
    program = lower(moe, strategy, 4, k=2, bucket_bytes=0)
    a2a = [t for t in program.collectives if t.kind == "all_to_all"]
    assert a2a and all(t.group == (0, 1, 2, 3) and t.groups == () for t in a2a)  # the world
    others = [t for t in program.collectives if t.phase == "fwd" and t.kind != "all_to_all"
              and t.tensor != moe.loss]
    assert others and all(t.groups == ROWS for t in others)  # a machine's ranks
    # between the scopes axis by axis (hidup.program.conversions): a machine's S(0) tokens and
    # flat S(0)@all are the same pieces (layout [S(0), S(0)]), so the tokens go into the experts
    # and back by one all-to-all over every rank each way, with no alias between the scopes
    assert not [t for t in program.tasks if isinstance(t, Convert) and t.kind == "alias"
                and any("@all" in key for key in (*t.inputs, *t.outputs))]
    tokens = {(t.phase, t.tensor, str(t.src), str(t.dst)) for t in a2a
              if t.tensor in ("einsum_1", "einsum_3")}
    assert tokens == {("fwd", "einsum_1", "S(0)", "S(1)"), ("fwd", "einsum_3", "S(1)", "S(0)"),
                      ("bwd", "einsum_3", "S(0)", "S(1)"), ("bwd", "einsum_1", "S(1)", "S(0)")}
    # an expert's gradient is complete over every rank: no all-reduce across the machines
    assert all(not program.param_grads[t].startswith("grad:") for t in experts)
    assert all(program.param_grads[p.name].startswith("grad:") for p in moe.params
               if p.name not in experts)
    # an expert matmul's local shapes: its experts (2 x 4 of them) over the 4 ranks
    # and its tokens, micro-batch 0 of the whole batch (8 / 2), as many experts
    first = next(t for t in program.tasks if isinstance(t, Compute) and t.node == "einsum_2")
    assert moe.node("einsum_2").inputs[0] == experts[0]
    assert first.in_shapes == ((8 // 4, 32, 64), (8 // 2, 8 // 4, 6, 32))
    profile = two_by_two()
    for k in (1, 2):
        program = lower(moe, strategy, 4, k=k)
        assert estimate(program, profile).step_time == pytest.approx(
            simulate(program, profile).step_time, rel=1e-9)


def test_flat_options_are_refused_where_they_cannot_run(moe):
    strategy = fixed_strategy("tp+ep", moe, 4, TWO)
    with pytest.raises(LoweringError, match="needs a mesh data parallel over every axis outside the innermost"):
        lower(moe, turned(strategy), 4)
    with pytest.raises(LoweringError, match="needs a mesh data parallel over every axis outside the innermost"):
        lower(moe, replace(strategy, mesh=None, dp=None), 4)
    # an expert weight that lives over a machine's ranks, read over every rank: a parameter's
    # gradient is summed per scope, so it does not pass between them
    weight = moe.node("einsum_2").inputs[0]
    broken = replace(strategy, placements={**strategy.placements, weight: Shard(0)})
    with pytest.raises(LoweringError, match=f"tensor {weight} is read over a machine and over "
                                            f"every rank"):
        lower(moe, broken, 4)


@pytest.mark.parametrize("model", ["bert-sgmoe:tiny", "gpt:tiny"])
def test_the_programme_with_flat_options_never_prices_over_the_one_without(model):
    spec = get_model(model, gpus=4)
    graph = capture_model(spec, spec.batch)
    best = {}
    for on in (False, True):
        dp = Search(graph, 4, two_by_two(), SearchOptions(k=2, mesh=TWO, dp="machines",
                                                          flat=on))
        labels = dp.run()
        best[on] = labels[0].best
        plan = dp.strategy(labels[0], "hidup")
        lower(graph, plan, 4, k=2)  # what it chose runs
        assert dp.price(plan) == pytest.approx(labels[0].cost)  # priced as its labels price it
    assert best[True] <= best[False]
    if model == "bert-sgmoe:tiny":  # the experts over every GPU pay there
        assert best[True] < 0.8 * best[False], best


def test_parameters_read_over_every_rank_are_stored_sharded_over_every_rank(moe):
    """sharded_storage: a parameter a flat op reads whole (R@all) is stored S(d)@all (its dim
    divided by every rank), gathered over the world in buckets before use, its gradient
    turned into the shard there."""
    dp = Search(moe, 4, two_by_two(), SearchOptions(k=2, mesh=TWO, dp="machines"))
    plan = dp.strategy(dp.run()[0], "hidup")
    whole = {p.name: plan.home(p.name) for p in moe.params if plan.home(p.name) in (R, FLAT_R)}
    assert FLAT_R in whole.values()  # (on this tiny model the plan runs every op flat)
    stored = sharded_storage(moe, plan, 2)
    for name, home in whole.items():
        shard = stored.home(name)
        assert is_flat(shard) == is_flat(home) and isinstance(shard, Shard), name
    program = lower(moe, stored, 4, k=2)
    stored_flat = {n for n, h in whole.items() if h == FLAT_R and stored.home(n) != FLAT_R}
    gathers = [t for t in program.collectives if t.kind == "all_gather" and t.mb is None
               and t.phase == "fwd" and t.src in map(stored.home, stored_flat)]
    names = {key.split("@")[0] for t in gathers for key in t.inputs}
    assert names == stored_flat and len(gathers) < len(names)  # in buckets
    assert all(t.group == (0, 1, 2, 3) and t.groups == () for t in gathers)
    # each gradient ends on its shard over every rank (here sliced: this plan computes them
    # whole on every rank), and nothing sums it across the machines
    assert all(program.param_grads[n] == f"d{n}@{stored.home(n)}/*" for n in stored_flat)
