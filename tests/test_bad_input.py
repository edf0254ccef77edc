"""Bad input stops every command with one line on stderr that names the value, the rule and the
fix, and a non-zero exit: unknown model or cluster, zero GPUs, malformed or negative bandwidth,
dimensions that do not split over the GPUs or micro-batches, a plan for another model or world
size, a corrupt or truncated plan, profile or trace file, and a launch without torchrun where
one is needed. (An op without a sharding rule: tests/test_ops.py; a damaged checkpoint:
tests/test_reliability.py; calibration.profile outside torchrun: test_calibration_profile.py.)"""
from __future__ import annotations

import pytest

from calibration import derive, ops, trace
from conftest import one_line
from experiments import whatif
from hidup import planner, train
from simulator import predict


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A real plan for gpt:tiny on 2 GPUs, and truncated copies of a plan, a profile, a trace."""
    folder = tmp_path_factory.mktemp("bad")
    good = folder / "plan.json"
    assert planner.main(["--model", "gpt:tiny", "--gpus", "2", "--cluster", "v100-1x4-nvlink",
                      "--out", str(good)]) == 0
    (folder / "plan-cut.json").write_text(good.read_text()[:120])
    from hidup.planning.profile_file import load_profile

    (folder / "profile-cut.json").write_text(load_profile("v100-2x4").to_json()[:300])
    (folder / "profile-latin1.json").write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    (folder / "trace-cut.json").write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm"')
    return folder


@pytest.mark.parametrize("argv, said", [
    (["--model", "nope:tiny"], "unknown model 'nope'; choose one of"),
    (["--model", "gpt:huge"], "model gpt has no size 'huge'; choose one of"),
    (["--cluster", "tpu-pod"], "unknown cluster profile 'tpu-pod'; choose one of"),
    (["--gpus", "0"], "--gpus: 0 is not a positive whole number"),
    (["--gpus", "two"], "--gpus: two is not a positive whole number"),
    (["--model", "gpt:tiny", "--gpus", "2", "--batch", "5", "--strategy", "ddp"],
     "strategy ddp on 2 GPUs: the batch of 5 (input tokens) does not split into 2 equal parts; "
     "give a --batch that is a multiple of 2"),
    (["--model", "gpt:tiny", "--gpus", "2", "--batch", "6", "--micro-batches", "4",
      "--strategy", "ddp"],
     "batch of 6 (dim 0 of (6, 16)) does not split into 4 micro-batches; choose a batch "
     "divisible by 4"),
    (["--strategy", "/no/such/plan.json"], "plan file /no/such/plan.json does not exist"),
])
def test_predict_refuses_bad_flags(argv, said, capsys):
    line = one_line(predict.main, argv, capsys)
    assert line.startswith("python -m simulator.predict: error: ") and said in line, line


def test_plans_and_profiles_for_something_else_or_damaged(files, capsys):
    good = str(files / "plan.json")
    cases = [
        (["--model", "mlp:tiny", "--gpus", "2", "--strategy", good],
         "was made for model 'gpt:tiny' with fingerprint"),
        (["--model", "gpt:tiny", "--gpus", "4", "--strategy", good],
         "was made for 2 GPUs, this run has 4; give --gpus 2 or make a plan for 4 GPUs"),
        (["--model", "gpt:tiny", "--gpus", "2", "--strategy", str(files / "plan-cut.json")],
         "cannot read it (Expecting"),
        (["--cluster", str(files / "profile-cut.json")], "not valid JSON"),
        (["--cluster", str(files / "profile-latin1.json")],
         "profile-latin1.json: not UTF-8 text (byte 13: invalid continuation byte); give a profile JSON"),
    ]
    for argv, said in cases:
        line = one_line(predict.main, argv, capsys)
        assert said in line, line
    assert "make it again with python -m hidup.planner" in one_line(predict.main, cases[2][0], capsys)
    assert "fix or re-create it" in one_line(predict.main, cases[3][0], capsys)


def test_truncated_trace_and_bad_bandwidths(files, capsys, tmp_path):
    line = one_line(trace.main, [str(files / "trace-cut.json")], capsys)
    assert "trace-cut.json: cannot read it" in line and "give a PyTorch-profiler" in line
    for rate in ("fast", "-5gbit", "0"):
        line = one_line(derive.main, ["--base", "v100-2x4", f"--inter-bandwidth={rate}",
                                      "--name", "x", "--out", str(tmp_path / "x.json")], capsys)
        assert f"bandwidth {rate!r}: give a positive rate in bits per second" in line, line
    line = one_line(whatif.main, ["--bandwidth=1gbit:fast"], capsys)
    assert "bandwidth 'fast': give a positive rate" in line


def test_training_flags_and_launch(capsys, monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert "--steps must be at least 1, got 0" in one_line(train.main, ["--steps", "0"], capsys)
    assert "unknown model 'nope'" in one_line(train.main, ["--model", "nope:tiny"], capsys)
    assert "--timeout must be a positive number" in one_line(
        train.main, ["--timeout", "0"], capsys)
    # calibration.ops needs torchrun's ranks only for a world above one; a bad base is one line
    assert "cannot read it" in one_line(ops.main, ["--model", "gpt:tiny", "--base",
                                                   str(tmp_path / "none.json"), "--out",
                                                   str(tmp_path / "o.json")], capsys)
