"""`python -m simulator.predict`: the report, the JSON form, plan files and one-line errors."""
import json
import re
import time

import pytest

from hidup import models
from hidup.program import COLLECTIVES
from hidup.strategy import megatron, save_plan
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
    assert main(["--model", "mlp:tiny", "--gpus", "2", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model mlp:tiny (batch 8), cluster v100-1x4-nvlink, 2 GPUs, strategy "
                          "megatron")
    assert "SPMD (k=1)" in out and "Duplex (k=2)" in out
    assert "  linear: (R, S(0), S(0)) -> S(1)" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0}  # identical ranks: one is simulated
    assert any(e["name"] == "all_reduce linear_1 mb1" for e in events)


def test_a_plan_file_gives_the_same_prediction_as_its_strategy(capsys, tmp_path):
    graph = capture_model(models.get_model("mlp:tiny"), 8)
    save_plan(tmp_path / "plan.json", graph, megatron(graph, 2), 2, "mlp:tiny")
    by_name = run_json(capsys, "--model", "mlp:tiny", "--gpus", "2")
    by_file = run_json(capsys, "--model", "mlp:tiny", "--gpus", "2",
                       "--strategy", str(tmp_path / "plan.json"))
    assert by_file == by_name


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


def test_a_plan_for_another_world_size_is_refused(capsys, tmp_path):
    graph = capture_model(models.get_model("mlp:tiny"), 8)
    save_plan(tmp_path / "plan.json", graph, megatron(graph, 4), 4, "mlp:tiny")
    with pytest.raises(SystemExit) as exc:
        main(["--model", "mlp:tiny", "--gpus", "2", "--strategy", str(tmp_path / "plan.json")])
    assert exc.value.code == 2
    assert "was made for world size 4, this run has 2 ranks" in capsys.readouterr().err


def test_default_run(capsys):
    started = time.perf_counter()
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "model gpt:small (batch 16), cluster v100-1x4-nvlink, 4 GPUs" in out
    assert "Duplex (k=2)" in out and "speedup of Duplex over SPMD" in out
    assert time.perf_counter() - started < 10


def test_bucket_mb_zero_reduces_each_parameter_on_its_own():
    from simulator.predict import predict
    def reductions(mb):
        p = predict("mlp:tiny", "v100-1x4-nvlink", 2, "ddp", None, 1, bucket_mb=mb)
        return sum(r.task.kind == "all_reduce" for r in p.spmd.records[0] if hasattr(r.task, "kind"))
    assert reductions(0) > reductions(25) >= 1
