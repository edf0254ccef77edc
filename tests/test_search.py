"""The Duplex-aware search: its fast estimate agrees with the simulator, it is never worse than the
expert strategies, it respects memory, and its plans train exactly like one device."""
from __future__ import annotations

import json
import re

from dataclasses import replace

import pytest

from hidup.graph.placement import R

from hidup.models import capture_model, get_model, names
from hidup.planner import main as plan_main
from hidup.planning.estimate import estimate
from hidup.planning.planfile import load_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.strategy import Mesh, fixed_strategies
from hidup.program import lower
from simulator import simulate

PROFILE = "v100-8x8-10gbps"


def baselines(graph, world):
    return fixed_strategies(graph, world)


@pytest.mark.parametrize("name", [n for n in names() if n.endswith(":tiny")])
def test_search_estimate_agrees_with_the_simulator(name):
    spec = get_model(name, gpus=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    found = search(graph, 2, profile, SearchOptions(k=2), baselines=baselines(graph, 2))
    simulated = simulate(lower(graph, found.strategy, 2, found.k), profile).step_time
    assert found.estimate.step_time == pytest.approx(simulated, rel=0.05)


# Where a parameter is stored is not yet a decision of the programme (it stores a parameter where
# its first consumer computes with it), so fsdp's plans are outside its space: the selection
# ranks fsdp as a baseline, and the case below marks what the programme misses.
IN_SPACE = ("ddp", "megatron", "expert")


def _best_fixed(graph, world, profile, optimizer="adamw", names=IN_SPACE) -> tuple[float, str]:
    """The fastest fixed strategy's estimated step, with Duplex or without, and its name."""
    times = []
    for name, strategy in fixed_strategies(graph, world).items():
        if name not in names:
            continue
        for k in (1, 2):
            try:
                times.append((estimate(lower(graph, strategy, world, k, optimizer=optimizer),
                                       profile).step_time,
                              f"{name} k={k}"))
            except ValueError:
                continue
    return min(times)


_MODEL_MISSES = pytest.mark.xfail(strict=True, reason=(
    "issue 19: not the beam (at k = 1 it reaches the proven optimum of its cost model here, "
    "test below) but the cost model: it charges each gradient reduction in full at its node, "
    "and prices ddp on gpt:small at 3.68 ms where the lowered plan takes 2.79; pricing them as "
    "hidden under the backward fixed these two and lost 20-25% on the paper's BERT models"))


@pytest.mark.parametrize("model, world, cluster, best, optimizer", [
    ("bert-sgmoe:paper", 8, "v100-2x4", "expert", "adamw"),  # 2 machines: the experts split
    # the search's own plans miss expert here with sgd (1.444 ms against 1.408), but every op
    # replicated, ranked beside them, beats it (1.405 ms): the gradient pricing is still off
    ("bert-sgmoe:tiny", 2, "v100-1x4-nvlink", "expert", "sgd"),
    ("gpt:small", 4, "v100-1x4-nvlink", "megatron", "adamw"),  # its loss vocabulary parallel
    pytest.param("gpt:small", 4, "v100-1x4-nvlink", "ddp", "sgd", marks=_MODEL_MISSES),
])
def test_the_search_alone_matches_or_beats_the_best_fixed_strategy(model, world, cluster, best,
                                                                   optimizer):
    """The dynamic programme with no fixed strategy among its candidates finds a plan at least
    as fast as the best of them (each fixed strategy is a plan in its space). Where it does not
    yet, the case is marked; it must start to pass when the cost model prices gradient
    reductions as the lowered plan runs them without losing the paper-size plans."""
    graph = capture_model(get_model(model, gpus=world), get_model(model, gpus=world).batch)
    profile = load_profile(cluster)
    fixed_time, fixed_name = _best_fixed(graph, world, profile, optimizer)
    assert fixed_name.startswith(best)
    found = search(graph, world, profile, SearchOptions(k=2, optimizer=optimizer))  # no baselines
    assert all(name.startswith(("search#", "search-k1#", "search-replicated#"))
               for name, _ in found.candidates)
    assert found.estimate.step_time <= fixed_time * (1 + 1e-9), (found.candidates, fixed_name)


def test_the_search_alone_matches_fsdp():
    """Where a parameter is stored is the search's decision: it reaches fsdp's plan (sharded
    storage, computed data parallel), which the v100-2x4 profile prices below every plan that
    keeps the parameters whole."""
    spec = get_model("bert-sgmoe:paper", gpus=8)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-2x4")
    fsdp_time, _ = _best_fixed(graph, 8, profile, names=("fsdp",))
    found = search(graph, 8, profile, SearchOptions(k=2))  # no baselines
    assert found.estimate.step_time <= fsdp_time * (1 + 1e-9)


def test_paper_size_search_alone_matches_or_beats_every_baseline():
    """At the paper's size on the 8 x 8 cluster, the search with no fixed strategy among its
    candidates finds a plan at least as fast as each of them (with or without Duplex), and the
    simulator times the plan it returns as its estimate does."""
    spec = get_model("bert-sgmoe:paper", gpus=8)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    found = search(graph, 8, profile, SearchOptions(k=2))  # no baselines
    assert not {n.split()[0] for n, _ in found.candidates} & set(baselines(graph, 8))
    best_time, best_name = _best_fixed(graph, 8, profile)
    assert found.estimate.step_time <= best_time * (1 + 1e-9), (found.candidates, best_name)
    sim = simulate(lower(graph, found.strategy, 8, found.k), profile).step_time
    assert found.estimate.step_time == pytest.approx(sim, rel=1e-9)


@pytest.mark.parametrize("cluster", [PROFILE, "cpu-gloo-loopback"])
def test_estimate_is_the_simulator_on_one_lane(cluster):
    """The estimate runs the simulator's rules for one rank: equal to it, without interference
    (V100) and with it (the CPU cluster: a kernel 1.89x slower beside a collective, a collective
    1.82x beside a kernel), packing and unpacking on the compute stream included."""
    spec = get_model("gpt:tiny", gpus=4)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(cluster)
    assert profile.comm_lanes == 1
    slowed = 0
    for strategy in baselines(graph, 4).values():
        for k in (1, 2):
            program = lower(graph, strategy, 4, k)
            simulated = simulate(program, profile).step_time
            assert estimate(program, profile).step_time == pytest.approx(simulated, rel=1e-9)
            slowed += simulated > simulate(program, replace(
                profile, interference_compute=1.0, interference_comm=1.0)).step_time * 1.01
    assert (slowed > 0) == (cluster != PROFILE)  # interference mattered where it is


def test_memory_limit_is_respected_or_refused():
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    with pytest.raises(ValueError, match=r"no option of node \w+ .* fits in .* GiB per device"
                                         r" \(the least a plan holds up to it: [\d.e-]+ GiB\)"):
        search(graph, 2, load_profile(PROFILE), SearchOptions(k=2, memory=1000))


def test_plan_cli_writes_a_plan_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "bert-switch:tiny", "--gpus", "2", "--out", str(out),
                      "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["plans"]) == {"hidup", "ddp", "fsdp", "megatron", "megatron-sp", "expert"}
    chosen = doc["plans"][doc["chosen"]][f"k{doc['chosen_k']}_ms"]
    assert all(chosen <= min(t[key] for key in ("k1_ms", "k2_ms") if t[key] is not None)
               * (1 + 1e-9) for t in doc["plans"].values())
    spec = get_model("bert-switch:tiny", gpus=2)
    strategy = load_plan(out, capture_model(spec, spec.batch), 2)
    assert {n: str(o) for n, o in strategy.options.items()} == doc["options"]  # what it printed
    assert json.loads(out.read_text())["cluster"] == doc["cluster"] == "v100-8x8-10gbps"
    # the plan is named by what it does, with each plan's memory beside its times
    assert doc["chosen"] in ("hidup", "ddp", "fsdp", "megatron", "megatron-sp", "expert")
    assert "key ops" in doc["description"] and doc["memory_limit_gib"] == 32
    assert all(t["k1_gib"] > 0 for t in doc["plans"].values())
    assert plan_main(["--model", "bert-switch:tiny", "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"\nchose (the searched plan|the fixed strategy \w+, which no searched plan "
                     r"beat) \(.*key ops.*\), with(out)? Duplex", text), text
    assert "peak k=1 / k=2 (GiB)" in text and "search#" not in text
    assert plan_main(["--model", "nope:tiny"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_is_never_returned():
    from hidup.planning.memory import peak_memory
    spec = get_model("bert-sgmoe:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    base = baselines(graph, 2)
    ddp_peak = min(peak_memory(lower(graph, base["ddp"], 2, k)).peak for k in (1, 2))
    found = search(graph, 2, profile, SearchOptions(k=2, memory=ddp_peak - 1), baselines=base)
    assert peak_memory(lower(graph, found.strategy, 2, found.k)).peak <= ddp_peak - 1
    assert found.strategy.options != base["ddp"].options


@pytest.mark.parametrize("model, world, cluster, machines", [
    ("bert-sgmoe:tiny", 2, "v100-1x4-nvlink", 1), ("gpt:small", 4, "v100-1x4-nvlink", 1),
    ("gpt:tiny", 4, "v100-1x4-nvlink", 1), ("mlp:tiny", 2, "v100-1x4-nvlink", 1),
    ("bert-sgmoe:paper", 8, "v100-2x4", 2),
    ("gpt:paper", 8, "v100-8x8-10gbps", 1)])  # some splits divide by 8 ranks but not by 16
def test_the_duplex_search_alone_finds_what_the_plain_search_finds(model, world, cluster,
                                                                     machines):
    """One programme prices every plan with k = 2 micro-batches and with one: the search for
    Duplex runs it alone (one per mesh) and finds a plan at least as fast as the plain search's;
    its best plan with one micro-batch is within 0.1% of the plain programme's (measured: equal,
    or 0.002% better on bert-sgmoe:paper's 2 x 4 mesh; gpt:paper's was 0.36% worse before the
    beam kept a share of states for the cheapest with one micro-batch). Ranked, the plans get
    their +sharded variants, which the programme does not price: on gpt:small the Duplex
    search's best plan is 0.10% slower than the plain search's (3.1194 against 3.1162 ms; its
    own plan unsharded is the faster, 3.1199 against 3.1269), since the vocabulary-parallel loss
    was added; so the ranked plans are held to 0.2%."""
    from hidup.planning.programme import Search, SearchOptions

    spec = get_model(model, gpus=world)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(cluster)
    grid = Mesh.of_machines(machines, world // machines)
    plain = search(graph, world, profile, SearchOptions(k=1, mesh=grid))
    duplex = search(graph, world, profile, SearchOptions(k=2, mesh=grid))
    assert duplex.estimate.step_time <= plain.estimate.step_time * 1.002
    for mesh, dp in {(None, None), (grid, grid and "machines")}:
        alone = Search(graph, world, profile, SearchOptions(k=1, mesh=mesh, dp=dp)).run()[0].cost
        both = Search(graph, world, profile, SearchOptions(k=2, mesh=mesh, dp=dp)).run()
        assert min(label.plain for label in both) <= alone * 1.001


def test_a_tensor_is_converted_once_per_placement_however_many_read_it():
    """As the lowering does: the second consumer that wants a tensor in a placement it was
    already converted to pays nothing for it."""
    from hidup.planning.programme import Search, SearchOptions
    from hidup.strategy import fitting_options

    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    dp = Search(graph, 2, load_profile("v100-1x4-nvlink"), SearchOptions(k=1))
    consumers: dict[str, list] = {}
    for node in graph.ops:
        for t in node.inputs:
            consumers.setdefault(t, []).append(node)
    for t, (a, b, *_) in ((t, c) for t, c in consumers.items() if len(c) >= 2 and
                          graph.node(t).kind == "op"):
        for oa in fitting_options(graph, a, 2):
            for ob in fitting_options(graph, b, 2):
                want = oa.inputs[a.inputs.index(t)]
                if want == R or ob.inputs[b.inputs.index(t)] != want:
                    continue
                start = dp.state(a, {x: (R, frozenset()) for x in dp.live(a)})
                first, _, after_a = dp.transition(start, a, oa)
                placed = dp.placed(a, after_a, after=True)
                before_b = dp.state(b, {x: placed.get(x, (R, frozenset())) for x in dp.live(b)})
                again, _, _ = dp.transition(before_b, b, ob)
                alone, _, _ = dp.transition(
                    dp.state(b, {x: (R, frozenset()) for x in dp.live(b)}), b, ob)
                assert first > 0 and placed[t] == (R, frozenset({want}))
                assert alone - again == pytest.approx(dp.conversion_cost(t, R, want))
                return
    pytest.fail("no tensor with two consumers wanting the same split in gpt:tiny")


@pytest.mark.parametrize("model, world", [("mlp:tiny", 2), ("gpt:tiny", 2), ("bert-sgmoe:tiny", 2),
                                          ("bert-switch:tiny", 2), ("gpt:small", 4)])
def test_the_programme_finds_the_integer_programmes_proven_optimum_at_k1(model, world):
    """Exactness at k = 1: the integer programme states the programme's own cost model; its plan,
    priced by the programme, costs what it claims and is proven optimal; no fixed strategy, no
    random plan and not the beam's plan is cheaper; the beam stays within 2% of it here."""
    import random

    from hidup.planning.exact import exact_plan
    from hidup.planning.programme import Search, SearchOptions
    from hidup.strategy import fitting_options

    spec = get_model(model, gpus=world)
    graph = capture_model(spec, spec.batch)
    dp = Search(graph, world, load_profile("v100-1x4-nvlink"), SearchOptions(k=1))
    exact = exact_plan(dp)
    assert exact.optimal and exact.cost == pytest.approx(exact.bound, rel=1e-6)
    assert dp.price(exact.strategy) == exact.cost
    others = [dp.price(s) for s in fixed_strategies(graph, world).values()]
    rng = random.Random(0)
    for _ in range(50):  # random plans: every op takes a random option valid after the others'
        options, key = {}, ()
        for node in graph.ops:
            steps = [(o, dp.transition(key, node, o)) for o in fitting_options(graph, node, world)]
            options[node.name], (_, _, key) = rng.choice([(o, st) for o, st in steps if st])
        others.append(dp.price(dp.plan(options, "random")))
    assert min(others) >= exact.cost * (1 - 1e-9)
    beam = dp.run()[0].cost  # measured: 0-1.6% above the optimum on these five
    assert exact.cost * (1 - 1e-9) <= beam <= exact.cost * 1.02


def test_the_exact_line_says_the_space_it_proved_optimal_in():
    """hidup.planner --exact: on a 2-D mesh the integer programme proves the best plan among
    those that split every op inside a machine; a beam plan below it is said to lie outside
    that space, not the proof to be wrong. Over all GPUs the beam's gap to the optimum, or to
    the bound where the time ran out."""
    from hidup.planner import exact_line

    two_d = exact_line({"machines": 8, "exact_ms": 36139.09, "bound_ms": 36139.09,
                        "optimal": True, "beam_ms": 2326.39}, 64)
    assert two_d.startswith("k=1 cost model on 8 machines, among the plans that split every op "
                            "inside a machine")
    assert "proven optimal there; the beam's best 2326.39 ms is below it (the beam also " \
           "splits ops over all 64 GPUs)" in two_d
    one_d = exact_line({"machines": 1, "exact_ms": 100.0, "bound_ms": 100.0, "optimal": True,
                        "beam_ms": 105.0}, 64)
    assert one_d.endswith("best plan 100.00 ms, proven optimal there; the beam's best "
                          "105.00 ms, +5.0% over that optimum")
    timed_out = exact_line({"machines": 1, "exact_ms": 300.0, "bound_ms": 80.0,
                            "optimal": False, "beam_ms": 100.0}, 8)
    assert "no plan there is below 80.00 ms; the beam's best 100.00 ms, at most +25.0% over " \
           "the optimum" in timed_out


def test_search_with_exact_ranks_the_proven_plan_the_beam_missed():
    """A narrow beam (1 state a cut) misses the k = 1 model's best plan of gpt:small on 4 GPUs;
    search(exact=...) proves that plan optimal and ranks it, and the chosen plan is then at least
    as fast as the one the beam alone found."""
    spec = get_model("gpt:small", gpus=4)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-1x4-nvlink")
    beam_only = search(graph, 4, profile, SearchOptions(k=2, beam=1))
    proven = search(graph, 4, profile, SearchOptions(k=2, beam=1, exact=60))
    [(machines, cost, bound, optimal, beam_cost)] = proven.exact
    assert machines == 1 and optimal and cost == pytest.approx(bound, rel=1e-6)
    assert beam_cost > cost * 1.05  # the beam's miss
    assert any(name.startswith("exact#0") for name, _ in proven.candidates)
    assert proven.estimate.step_time <= beam_only.estimate.step_time * (1 + 1e-9)
    assert beam_only.exact == ()


@pytest.mark.parametrize("world", [2, 4])
def test_the_duplex_programme_matches_the_unbounded_one_where_that_runs(world):
    """Exactness at k = 2, where the stage model is not linear: with no cap on states or labels
    the programme keeps every non-dominated label and is exact (each step is monotone in every
    label field); the default beam reaches the same cost. It runs in time on mlp:tiny only."""
    from hidup.planning.programme import Search, SearchOptions

    spec = get_model("mlp:tiny", gpus=world)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-1x4-nvlink")
    unbounded = Search(graph, world, profile, SearchOptions(k=2, beam=10**9, labels=10**9))
    best = unbounded.run()[0]
    assert unbounded.price(unbounded.strategy(best, "x")) == pytest.approx(best.cost, rel=1e-12)
    assert Search(graph, world, profile, SearchOptions(k=2)).run()[0].cost == pytest.approx(best.cost, rel=1e-12)


def test_search_exactness_experiment_writes_its_table(tmp_path, capsys):
    import csv

    from experiments.search_exactness import main as exactness_main

    assert exactness_main(["--models", "gpt:tiny", "--gpus", "2", "--cluster", "v100-1x4-nvlink",
                           "--out", str(tmp_path)]) == 0
    [row] = list(csv.DictReader(open(tmp_path / "search_exactness.csv")))
    assert row["model"] == "gpt:tiny" and row["mesh"] == "1x2" and row["optimal"] == "True"
    assert float(row["beam_ms"]) >= float(row["exact_ms"]) * (1 - 1e-9)
    assert float(row["duplex_ms"]) >= float(row["exact_ms"]) * (1 - 1e-9)
    assert "gpt:tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        exactness_main(["--beam", "0"])
    with pytest.raises(SystemExit):
        plan_main(["--model", "mlp:tiny", "--gpus", "2", "--exact", "-1"])
    assert "--exact -1.0" in capsys.readouterr().err


def test_a_mesh_whose_batch_does_not_split_into_micro_batches_is_searched_without_duplex():
    """gpt:tiny, batch 2 on 2 machines x 2: each machine's one sequence does not split into two
    micro-batches, so the 2-D programme runs with one (as a plain search would) and its plans
    are ranked, without Duplex; the 1-D plans still have it."""
    spec = get_model("gpt:tiny", gpus=4)
    graph = capture_model(spec, 2)
    found = search(graph, 4, load_profile("v100-2x4"), SearchOptions(k=2, mesh=Mesh.grid(2, 2)))
    mesh = [name for name, _ in found.candidates if name.startswith("search-2d#")]
    assert mesh and all(name.endswith(" k=1") for name in mesh)
    assert any(name.startswith("search#") and name.endswith(" k=2") for name, _ in found.candidates)


def test_the_programme_prices_a_replicated_block_before_a_sharded_one_as_lowered():
    """mlp:small's first block computed on every rank, then megatron's column-parallel matmul:
    that block's output gets a Partial gradient, which the lowering all-reduces once there (its
    parameters' gradients are then whole: no all-reduce of theirs), and the programme charges
    that one all-reduce (before: it carried the Partial sum back and all-reduced the block's
    8.4 MB of parameter gradients, which the programme did not see: 639 us priced, 725 lowered)."""
    from hidup.graph.placement import parse_option
    from hidup.planning.programme import Search, SearchOptions
    from hidup.program.tasks import Convert
    spec = get_model("mlp:small", gpus=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-8x8-10gbps")
    dp = Search(graph, 2, profile, SearchOptions(k=1))
    options = dict(fixed_strategies(graph, 2)["megatron"].options)
    block = ("linear", "relu", "linear_1")
    for node in block:  # the first block computed on every rank
        options[node] = parse_option("(R) -> R" if node == "relu" else "(R, R, R) -> R")
    plan = dp.plan(options, "replicated-first-block")
    program = lower(graph, plan, 2, 1)
    reduced = [t for t in program.tasks if isinstance(t, Convert) and t.phase == "bwd"
               and t.kind == "all_reduce"]
    params = {p for n in block for p in graph.node(n).inputs if graph.node(p).kind == "param"}
    assert not any(p in task.tensor for task in reduced for p in params)
    assert any(task.tensor == "add" for task in reduced)  # the block's output, read by linear_2
    lowered = estimate(program, profile).step_time
    assert dp.price(plan) == pytest.approx(lowered, rel=0.05)


def test_the_plan_with_no_communication_is_ranked_where_slow_links_make_it_the_fastest():
    """bert-sgmoe:tiny on 2 x 4 V100 joined at 1 Gbit/s: every op replicated on every rank (no
    collective at all) is the fastest plan, and the search returns it, found by the beam or
    ranked beside the beam's plans."""
    from calibration.derive import parse_rate, with_inter_link
    spec = get_model("bert-sgmoe:tiny", gpus=8)
    graph = capture_model(spec, spec.batch)
    profile = with_inter_link(load_profile("v100-2x4"), parse_rate("1gbit"))
    found = search(graph, 8, profile, SearchOptions(k=2))
    assert all(o.output == R and set(o.inputs) <= {R} for o in found.strategy.options.values())
    program = lower(graph, found.strategy, 8, found.k)
    assert not [t for t in program.tasks if getattr(t, "collective", False)]
    assert found.estimate.step_time <= min(t for _, t in found.candidates) * (1 + 1e-12)

