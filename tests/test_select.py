"""One way to choose a plan: hidup.plan(), python -m hidup.planner and python -m simulator.predict
all call hidup.planning.select.select_plan with the same defaults, so the same model, cluster
and GPUs give the same plan file through every door."""
import json

import pytest
import torch

import hidup
from hidup import planner
from hidup.graph.dtypes import run_dtypes
from hidup.models import capture_model, get_model
from hidup.planning.planfile import read_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.select import Goal, select_plan
from simulator import predict

SAME = ("world", "mesh", "micro_batches", "optimizer", "strategy", "placements", "options",
        "fingerprint", "inputs")


@pytest.mark.parametrize("model, cluster, gpus", [
    ("bert-sgmoe:tiny", "v100-2x4", 8),  # two machines: the 2-D mesh is searched too
    # one machine, where another optimizer or micro-batch default would choose another plan
    ("gpt:small", "v100-1x4-nvlink", 4),
])
def test_every_door_chooses_the_same_plan(tmp_path, capsys, model, cluster, gpus):
    spec = get_model(model, gpus=gpus)
    inputs = spec.inputs(spec.batch, torch.Generator().manual_seed(0))
    hidup.plan(spec.build(), inputs, cluster=cluster, gpus=gpus).save(tmp_path / "api.json")
    common = ["--model", model, "--cluster", cluster, "--gpus", str(gpus)]
    assert planner.main([*common, "--out", str(tmp_path / "planner.json")]) == 0
    assert predict.main([*common, "--save-plan", str(tmp_path / "predict.json")]) == 0
    capsys.readouterr()
    files = {door: read_plan(tmp_path / f"{door}.json") for door in ("api", "planner", "predict")}
    for key in SAME:
        assert files["api"][key] == files["planner"][key] == files["predict"][key], key


def test_the_choice_is_the_fastest_plan_that_fits_by_the_estimate():
    """The selection's plan is the fastest of what it ranked; a fixed micro-batch count or a
    fixed strategy is kept; a memory limit below every plan is refused with what to do."""
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-1x4-nvlink")
    chosen = select_plan(graph, profile, Goal(2))
    assert chosen.step_time == min(r.step_time for r in chosen.ranked)
    assert chosen.goal.mesh == (1, 2) and chosen.duplex_k == 2
    assert list(chosen.candidates)[0] == "hidup" and "ddp" in chosen.candidates
    plain = select_plan(graph, profile, Goal(2, micro_batches=1))
    assert plain.k == 1 and plain.step_time == min(r.step_time for r in plain.ranked if r.k == 1)
    ddp = select_plan(graph, profile, Goal(2, strategy="ddp"))
    assert ddp.strategy.name == "ddp" and ddp.search is None
    # below what the parameters and AdamW's two states take sharded over both GPUs: refused
    # before any search, with the GPU count that would hold them
    state = 3 * sum(p.out.nbytes for p in graph.params)  # (float32: 4 bytes each)
    with pytest.raises(ValueError, match=rf"the model's parameters and adamw's state take "
                                         rf"{state / 2**10:.3g} KiB, {state / 2**11:.3g} KiB per "
                                         rf"GPU even sharded over all 2, over a device's 1000 "
                                         rf"bytes; give at least {-(-state // 1000)} GPUs or more "
                                         rf"memory, or an optimizer with less state"):
        select_plan(graph, profile, Goal(2, memory=1000.0))
    # above that bound but below what any plan holds beside it (activations, gathered weights)
    with pytest.raises(ValueError, match=r"no plan with 1 or 2 micro-batches lowers and fits a "
                                         r"device's .* GiB on 2 GPUs \(.*\); give more GPUs or "
                                         r"memory"):
        select_plan(graph, profile, Goal(2, memory=0.51 * state))
    # a model that grows with the GPUs it is made for (the zoo's experts): not "more GPUs"
    with pytest.raises(ValueError, match=r"fits a device's .* GiB on 2 GPUs \(.*\); give more "
                                         r"memory, a smaller batch or fewer GPUs \(more GPUs do "
                                         r"not help: the model was made for 2 and its experts "
                                         r"\(2 per GPU\) grow with them\)$"):
        select_plan(graph, profile, Goal(2, memory=0.51 * state, grows="its experts (2 per GPU)"))
    batch = graph.user_inputs[0].out.shape[0]  # over GPUs it does not split into: not "more"
    assert batch % 3
    with pytest.raises(ValueError, match=rf"give more memory, fewer GPUs or a batch that 3 "
                                         rf"divides \(more GPUs do not help: the batch of "
                                         rf"{batch} does not split over 3"):
        select_plan(graph, profile, Goal(3, memory=0.34 * state))
    with pytest.raises(ValueError, match=r"strategy='fsdp2': give 'search' or one of"):
        select_plan(graph, profile, Goal(2, strategy="fsdp2"))


def test_the_planner_and_the_prediction_report_one_choice(capsys):
    """simulator.predict marks the plan the selection chose, the planner names the same."""
    args = ["--model", "bert-sgmoe:tiny", "--cluster", "v100-2x4", "--gpus", "8", "--json"]
    assert predict.main(args) == 0
    predicted = json.loads(capsys.readouterr().out)["chosen"]
    assert planner.main(args) == 0
    planned = json.loads(capsys.readouterr().out)
    assert (planned["chosen"], planned["chosen_k"]) == (predicted["strategy"], predicted["k"])


def test_the_executor_mode_ranks_the_plans():
    """A goal's executor mode prices every plan the selection ranks (on a profile with host
    figures, the mode's host time per task; for 'compile', Inductor's fused kernels): the chosen
    plan's step is its estimate in that mode, not in graph mode's."""
    from hidup.planning.estimate import estimate
    from hidup.program import lower
    spec = get_model("gpt:tiny", gpus=8)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("h100-8x-ib-bf16")
    graph_mode = select_plan(graph, profile, Goal(8))
    for mode in ("compile", "cuda-graphs"):
        chosen = select_plan(graph, profile, Goal(8, mode=mode))
        # at the profile's precision (bf16: hidup.graph.dtypes), as the selection prices it
        program = lower(run_dtypes(graph, profile.precision), chosen.strategy, 8, chosen.k,
                        optimizer="adamw")
        assert chosen.step_time == pytest.approx(estimate(program, profile, mode).step_time)
        assert chosen.step_time != pytest.approx(estimate(program, profile).step_time)
        assert chosen.step_time < graph_mode.step_time  # less host time per task than graph's
    with pytest.raises(ValueError, match="mode='fast': give one of eager, graph, compile"):
        select_plan(graph, profile, Goal(8, mode="fast"))
