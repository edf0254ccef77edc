"""The Duplex-aware search: its fast estimate agrees with the simulator, it is never worse than the
expert strategies, it respects memory, and its plans train exactly like one device."""
from __future__ import annotations

import json
import re

import pytest

from hidup.models import capture_model, get_model, names
from hidup.plan import main as plan_main
from hidup.planning.costs import load_profile
from hidup.planning.estimate import estimate
from hidup.planning.planfile import load_plan
from hidup.planning.search import search
from hidup.planning.strategy import fixed_strategies
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
    found = search(graph, 2, profile, k=2, baselines=baselines(graph, 2))
    simulated = simulate(lower(graph, found.strategy, 2, found.k), profile).step_time
    assert found.estimate.step_time == pytest.approx(simulated, rel=0.05)
    for base, t in found.candidates:  # never worse than an expert strategy
        assert found.estimate.step_time <= t * (1 + 1e-12), base


def test_paper_size_search_beats_or_matches_every_baseline():
    spec = get_model("bert-sgmoe:paper", gpus=8)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    found = search(graph, 8, profile, k=2, baselines=baselines(graph, 8))
    assert {n.split()[0] for n, _ in found.candidates} >= {"ddp", "megatron", "expert"}
    assert found.candidates[0][1] == found.estimate.step_time
    assert found.seconds < 10
    sim = simulate(lower(graph, found.strategy, 8, found.k), profile).step_time
    assert found.estimate.step_time == pytest.approx(sim, rel=1e-9)


def test_estimate_is_the_simulator_without_interference():
    spec = get_model("gpt:tiny", gpus=4)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    for strategy in baselines(graph, 4).values():
        for k in (1, 2):
            program = lower(graph, strategy, 4, k)
            assert estimate(program, profile).step_time == pytest.approx(
                simulate(program, profile).step_time, rel=1e-12)


def test_memory_limit_is_respected_or_refused():
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    with pytest.raises(ValueError, match=r"no option of node \w+ .* fits in .* GiB per device"):
        search(graph, 2, load_profile(PROFILE), k=2, memory=1000)


def test_plan_cli_writes_a_plan_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "bert-switch:tiny", "--gpus", "2", "--out", str(out),
                      "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["plans"]) == {"hidup", "ddp", "megatron", "expert", "min-comm"}
    hidup = doc["plans"]["hidup"][f"k{doc['plans']['hidup']['chosen_k']}_ms"]
    assert all(hidup <= min(t[key] for key in ("k1_ms", "k2_ms") if t[key] is not None)
               * (1 + 1e-9) for t in doc["plans"].values())
    spec = get_model("bert-switch:tiny", gpus=2)
    strategy = load_plan(out, capture_model(spec, spec.batch), 2)
    assert {n: str(o) for n, o in strategy.options.items()} == doc["options"]  # what it printed
    assert json.loads(out.read_text())["cluster"] == doc["cluster"] == "v100-8x8-10gbps"
    # the plan is named by what it does, with each plan's memory beside its times
    assert doc["chosen"] in ("hidup", "ddp", "megatron", "expert", "min-comm")
    assert "key ops" in doc["description"] and doc["memory_limit_gib"] == 32
    assert all(t["k1_gib"] > 0 for t in doc["plans"].values())
    assert plan_main(["--model", "bert-switch:tiny", "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"\nchose (the searched plan|the fixed strategy \w+, which no searched plan "
                     r"beat) \(.*key ops.*\), with(out)? Duplex", text), text
    assert "peak mem (GiB)" in text and "search#" not in text
    assert plan_main(["--model", "nope:tiny"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_is_never_returned():
    from hidup.planning.memory import peak_memory
    spec = get_model("bert-sgmoe:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile(PROFILE)
    base = baselines(graph, 2)
    ddp_peak = min(peak_memory(lower(graph, base["ddp"], 2, k)).peak for k in (1, 2))
    found = search(graph, 2, profile, k=2, memory=ddp_peak - 1, baselines=base)
    assert peak_memory(lower(graph, found.strategy, 2, found.k)).peak <= ddp_peak - 1
    assert found.strategy.options != base["ddp"].options
