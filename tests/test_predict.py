"""`python -m simulator.predict`: the report, the JSON form, plan files and one-line errors."""
import json
import re

import pytest

from hidup import models
from hidup.planning.planfile import save_plan
from hidup.strategy import megatron
from hidup.program import COLLECTIVES
from simulator import LinkCost, Profile, load_profile
from simulator.predict import capture_model, main


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def free_profile(tmp_path):
    """The shipped figures without the fixed costs (per-kernel overhead, collective latency, the
    weights each micro-batch reads again), which are all that can make Duplex slower."""
    p = load_profile("v100-1x4-nvlink")
    p = Profile(p.name, "test", p.flops, 1e30, 0.0,
                {k: LinkCost(0.0, p.collectives[k].beta) for k in COLLECTIVES}, p.gpus_per_node)
    path = tmp_path / "free.json"
    path.write_text(p.to_json())
    return path


def test_json_duplex_is_not_slower_without_fixed_costs(capsys, free_profile):
    out = run_json(capsys, "--model", "mlp:tiny", "--gpus", "2", "--strategy", "megatron",
                   "--cluster", str(free_profile))
    assert (out["model"], out["gpus"], out["strategy"], out["micro_batches"]) == \
        ("mlp:tiny", 2, "megatron", 2)
    assert out["duplex"]["step_time_ms"] <= out["spmd"]["step_time_ms"]
    assert out["duplex"]["peak_memory_bytes"] == out["duplex"]["memory"]["peak"] > 0
    assert out["speedup"] == pytest.approx(out["spmd"]["step_time_ms"] /
                                           out["duplex"]["step_time_ms"])
    assert out["plan"]["options"]["linear"] == "(R, S(0), S(0)) -> S(1)"


def test_report_and_trace_with_the_shipped_profile(capsys, tmp_path):
    trace = tmp_path / "duplex.trace.json"
    assert main(["--model", "mlp:tiny", "--gpus", "2", "--cluster", "v100-1x4-nvlink",
                 "--strategy", "megatron", "--trace", str(trace), "--show-plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model mlp:tiny (batch 8, adamw), cluster v100-1x4-nvlink: 2 GPUs, 1 "
                          "machine of 2, 32 GiB each, strategy megatron")
    assert "SPMD (k=1)" in out and "Duplex (k=2)" in out
    assert "  linear: (R, S(0), S(0)) -> S(1)" in out  # --show-plan: every op
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0}  # identical ranks: one is simulated
    assert any(e["name"] == "all_reduce linear_1 mb1" for e in events)


def test_the_plan_is_summarised_unless_asked_for_in_full(capsys):
    assert main(["--model", "mlp:tiny", "--gpus", "2", "--strategy", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "plan megatron: all 4 key ops tensor parallel (every op's placements: --show-plan)" \
        in out
    assert "linear: (R" not in out


def test_a_plan_file_gives_the_same_prediction_as_its_strategy(capsys, tmp_path):
    graph = capture_model(models.get_model("mlp:tiny"), 8)
    save_plan(tmp_path / "plan.json", graph, megatron(graph, 2), 2, "mlp:tiny", "v100-2x4")
    by_name = run_json(capsys, "--model", "mlp:tiny", "--gpus", "2", "--strategy", "megatron")
    by_file = run_json(capsys, "--model", "mlp:tiny", "--gpus", "2",
                       "--strategy", str(tmp_path / "plan.json"))
    assert by_file == by_name


def test_a_plan_searched_for_another_cluster_says_so(capsys, tmp_path):
    graph = capture_model(models.get_model("mlp:tiny"), 8)
    save_plan(tmp_path / "plan.json", graph, megatron(graph, 2), 2, "mlp:tiny", "v100-8x8-10gbps")
    assert main(["--model", "mlp:tiny", "--gpus", "2", "--cluster", "cpu-gloo-loopback",
                 "--strategy", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "note: plan plan.json was searched for cluster v100-8x8-10gbps, not cpu-gloo-loopback" \
        in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet"], r"error: unknown model 'resnet'; choose one of"),
    (["--model", "mlp:tiny", "--cluster", "tpu"], r"error: unknown cluster profile 'tpu'"),
    (["--model", "mlp:tiny", "--strategy", "zero"], r"error: unknown strategy 'zero'"),
    (["--model", "mlp:tiny", "--micro-batches", "3"], r"does not split into 3 micro-batches"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("python -m simulator.predict: error:")
    assert re.search(message, err)


def test_a_plan_for_another_world_size_is_refused_naming_the_count(capsys, tmp_path):
    graph = capture_model(models.get_model("mlp:tiny", gpus=4), 8)
    save_plan(tmp_path / "plan.json", graph, megatron(graph, 4), 4, "mlp:tiny")
    with pytest.raises(SystemExit) as exc:
        main(["--model", "mlp:tiny", "--gpus", "2", "--strategy", str(tmp_path / "plan.json")])
    assert exc.value.code == 2
    assert "was made for 4 GPUs, this run has 2; give --gpus 4" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # a strategy that would split nothing is not run as full replication under its name
    (["--model", "gpt:small", "--gpus", "3", "--strategy", "megatron", "--cluster",
      "v100-1x4-nvlink"], "strategy megatron on 3 GPUs splits nothing: no dimension it would "
     "split (256, 1024, 4096) divides by 3"),
    (["--model", "gpt:tiny", "--gpus", "100000", "--strategy", "ddp"],
     "strategy ddp on 100000 GPUs: the batch of 8 (input tokens) does not split"),
    # a GPU count beyond every dimension is refused before the search
    (["--model", "mlp:tiny", "--gpus", "4096", "--cluster", "v100-8x8-10gbps"],
     "4096 GPUs: no op of the model can be split over them (a split over n ranks needs a "
     "dimension of n or more; the largest is 64, the batch 8), so each GPU would run the "
     "whole step; give at most 64 GPUs"),
    # a one-machine profile is not stretched over machines it has no link figures for
    (["--model", "bert-sgmoe:tiny", "--gpus", "8", "--cluster", "v100-1x4-nvlink"],
     "cluster v100-1x4-nvlink describes machines of 4 GPU(s) and has no figures for a link "
     "between machines"),
])
def test_what_a_strategy_or_cluster_cannot_be_is_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_memory_beyond_the_device_is_said_in_gib(capsys):
    assert main(["--model", "bert-sgmoe:paper", "--gpus", "8", "--strategy", "megatron",
                 "--batch", "768"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"does not fit a device's 32 GiB: SPMD \(k=1\) needs 7\d\.?\d* GiB per "
                     r"rank", out), out
    assert "note: 1 of 41 linear weights replicated (no dim divides by 8): p_head_weight" in out


def test_default_run_compares_the_searched_plan_with_the_baselines(capsys):
    assert main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"], out["cluster"], out["gpus"]) == ("bert-sgmoe:paper", "v100-2x4", 8)
    names = [p["strategy"] for p in out["plans"]]
    assert names == ["hidup", "ddp", "fsdp", "megatron", "megatron-sp", "expert", "hsdp",
                     "dp-megatron", "dp-expert", "fsdp+tp", "tp+ep"]  # on a 2 x 4 mesh
    best = {p["strategy"]: min(p[run]["step_time_ms"] for run in ("spmd", "duplex")
                               if p[run]["fits"]) for p in out["plans"]}
    assert out["chosen"]["strategy"] == min(best, key=best.get)
    assert out["chosen"]["why"].startswith(f"chose {out['chosen']['strategy']} ")
    megatron_run = next(p for p in out["plans"] if p["strategy"] == "megatron")
    assert megatron_run["spmd"]["fits"] is True  # 14.1 GiB on a 32 GiB V100


def test_bucket_mb_zero_reduces_each_parameter_on_its_own():
    from simulator.predict import SimOptions, predict
    def reductions(mb):
        p = predict("mlp:tiny", "v100-1x4-nvlink", 2, "ddp", None, 1, SimOptions(bucket_mb=mb))
        return sum(r.task.kind == "all_reduce" for r in p.spmd.records[0] if hasattr(r.task, "kind"))
    assert reductions(0) > reductions(25) >= 1


def test_numbers_print_plain():
    from hidup.cli import number
    assert [number(72451.3), number(318.34), number(5.3012, 3), number(1554.9, 3)] == \
        ["72451", "318.3", "5.3", "1555"]


def test_the_comparison_gives_each_runs_peak_and_stars_only_what_does_not_fit(capsys):
    """Peak memory per k beside each plan; the footnote only where a run is starred."""
    assert main(["--model", "gpt:tiny", "--gpus", "2", "--cluster", "v100-1x4-nvlink"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\nddp +[\d.]+ +[\d.]+ +[\d.]+x +[\d.]+ / [\d.]+\n", out), out
    assert "peak k=1 / k=2 (GiB)" in out and "*" not in out and "does not fit" not in out
    assert main(["--model", "gpt:tiny", "--gpus", "2", "--cluster", "v100-1x4-nvlink",
                 "--memory", "0.0005"]) == 0
    out = capsys.readouterr().out
    assert "*" in out and "(*: does not fit a device's memory)" in out, out


def test_the_columns_add_up_to_the_step_with_the_host_shown(capsys):
    """On a GPU profile with host figures a small model's step is mostly the host issuing
    tasks: computation + exposed communication + idle is the step, and the verdict on Duplex
    names the host, not the kernels."""
    assert main(["--model", "gpt:small", "--cluster", "h100-bf16", "--gpus", "1",
                 "--strategy", "ddp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for run in ("spmd", "duplex"):
        r = out[run]
        total = r["computation_ms"] + r["exposed_communication_ms"] + r["idle_ms"]
        assert abs(total - r["step_time_ms"]) <= 1e-6 * r["step_time_ms"], r
        assert r["idle_ms"] > r["computation_ms"]  # host-bound: the idle fills the step
    assert main(["--model", "gpt:small", "--cluster", "h100-bf16", "--gpus", "1"]) == 0
    assert "Duplex would take" in (text := capsys.readouterr().out) and "ms idle)" in text, text


def test_the_comparison_simulates_the_searchs_programs_as_lowered_again(monkeypatch):
    """compare simulates each candidate from the Program the search lowered where it ranked it
    (Selection.programs), lowering only the others: the same tasks, and the same prediction,
    as lowering it again."""
    import simulator.predict as predict_module
    from simulator.predict import SimOptions, compare, simulate
    from hidup.planning.select import Goal

    lowered = []
    real_lower = predict_module.lower
    monkeypatch.setattr(predict_module, "lower",
                        lambda *a, **kw: lowered.append(a[1].name) or real_lower(*a, **kw))
    out = compare("gpt:tiny", "v100-1x4-nvlink", Goal(2))
    chosen = out.predictions[out.chosen]
    assert len(lowered) < 2 * len(out.predictions)  # the ranked ones are not lowered again
    graph = chosen.graph
    for p in out.predictions:
        again = simulate(graph, p.strategy, p.profile, 2, p.k, SimOptions(), p.model)
        assert (again.spmd.step_time, again.duplex.step_time, again.memory) == \
            (p.spmd.step_time, p.duplex.step_time, p.memory), p.strategy.name
