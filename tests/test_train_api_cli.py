"""python -m hidup.train through the public API's Trainer, on a user's model named
package.module:factory (tests/user_model.py, not in the zoo): AdamW with a warm-up and a cosine
schedule on 2 gloo ranks equals the same training in eager single-device PyTorch; a checkpoint
written under ddp resumes under megatron with Duplex (2 ranks) and on 1 rank with the losses of
an uninterrupted run; a bad --model and an op without a sharding rule are one line, exit 2."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import hidup
from hidup.train import lr_factor, main
from tests import user_model
from tests.conftest import one_line

USER = ["--model", "tests.user_model:make"]
LINE = re.compile(r"step (\d+)/(\d+)  loss \d+\.\d{5}  [\d,]+ tokens/s  lr \d\.\d{3}e[-+]\d\d  "
                  r"memory [\d.]+ MiB resident  [\d.]+ ms")


def _env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "HIDUP_ERROR_FILE", "HIDUP_READY_FILE")}


def _start(extra: list[str], ranks: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hidup.train", "--nproc-per-node", str(ranks)] + extra
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=os.path.dirname(os.path.dirname(__file__)))


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _eager(steps: int, lr: float, warmup: int, schedule: str) -> list[float]:
    """The user's model trained as hidup.train does it, on one device in plain PyTorch."""
    torch.manual_seed(0)
    model, inputs = user_model.make()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup, steps, schedule))
    losses = []
    for step in range(steps):
        loss = model(*inputs(8, torch.Generator().manual_seed(1 + step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_own_model_trains_on_2_ranks_with_adamw_and_cosine():
    result, err = _result(_start(USER + ["--strategy", "megatron", "--duplex", "--steps", "5",
                                         "--warmup", "1", "--warmup-steps", "2", "--schedule",
                                         "cosine", "--lr", "0.01", "--json"]))
    assert result["optimizer"] == "adamw" and result["schedule"] == "cosine"
    assert result["world"] == 2 and result["micro_batches"] == 2 and result["unit"] == "tokens"
    want = [0.01 * lr_factor(s, 2, 5, "cosine") for s in range(5)]
    assert result["lrs"] == pytest.approx(want)
    assert want[0] == pytest.approx(0.01 / 3) and want[2] == pytest.approx(0.01)
    assert want[4] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    assert result["losses"] == pytest.approx(_eager(5, 0.01, 2, "cosine"), abs=1e-5)
    steps = [LINE.fullmatch(line) for line in err.splitlines() if line.startswith("step ")]
    assert [m and int(m.group(1)) for m in steps] == [1, 2, 3, 4, 5], err


def test_a_ddp_checkpoint_resumes_under_megatron_and_on_one_rank(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    common = USER + ["--warmup", "0", "--warmup-steps", "5", "--json"]  # warm-up spans the resume
    first = _start(common + ["--strategy", "ddp", "--steps", "4", "--checkpoint", str(ck),
                             "--checkpoint-every", "2"])
    whole = _start(common + ["--strategy", "ddp", "--steps", "7"])
    before, _ = _result(first)
    fresh, _ = _result(whole)
    assert sorted(f.name for f in ck.iterdir()) == ["latest.json", "step4"]
    latest = json.loads((ck / "latest.json").read_text())
    assert latest["step"] == 4 and latest["strategy"] == "ddp" and latest["world"] == 2

    resumed, err = _result(_start(common + ["--strategy", "megatron", "--micro-batches", "2",
                                            "--steps", "7", "--checkpoint", str(ck),
                                            "--resume"]))
    assert "resumed from" in err and resumed["resumed_after"] == 4
    assert resumed["strategy"] == "megatron" and resumed["micro_batches"] == 2
    assert resumed["losses"][:4] == before["losses"]  # the history comes from the checkpoint
    assert resumed["losses"][4:] == pytest.approx(fresh["losses"][4:], abs=1e-5)
    assert resumed["lrs"] == pytest.approx(fresh["lrs"][4:])

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HIDUP_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    assert main(common + ["--steps", "7", "--checkpoint", str(ck), "--resume"]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert alone["world"] == 1
    assert alone["losses"][4:] == pytest.approx(fresh["losses"][4:], abs=1e-5)

    said = one_line(main, USER + ["--steps", "7", "--checkpoint", str(ck), "--resume",
                                  "--optimizer", "sgd"], capsys, code=2)
    assert said.startswith(f"python -m hidup.train: error: --resume: the checkpoint in {ck} is of another run "
                           f"(model tests.user_model:make, batch 8, seed 0, optimizer adamw); "
                           f"this run is model tests.user_model:make, batch 8, seed 0, "
                           f"optimizer sgd; use the same"), said


def test_a_bad_model_is_one_line_with_the_fix(capsys, monkeypatch):
    proc = _start(["--model", "a.b:c"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and not out, err
    assert err.count("\n") == 1 and err.startswith(
        "python -m hidup.train: error: --model a.b:c: cannot import a.b (No module named 'a'); give a zoo model "
        "NAME:SIZE"), err
    for var in ("RANK", "WORLD_SIZE", "HIDUP_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)
    for arg, said in [("tests.user_model:nope", "module tests.user_model has no attribute 'nope'"),
                      ("tests.user_model:not_a_pair", "not_a_pair() returned CharMLP; it must "
                                                      "return (module, inputs)"),
                      ("nope:tiny", "unknown model 'nope'; choose one of")]:
        line = one_line(main, ["--model", arg, "--steps", "2", "--warmup", "0"], capsys, code=2)
        assert said in line, line


def test_an_op_without_an_overlay_rule_plans_and_trains():
    """aten.flip has no rule of HiDup's own: DTensor's strategy covers it, so the API plans it
    (nothing replicated) and hidup.train trains it on 2 ranks."""
    plan = hidup.plan(user_model.Flipped(), user_model.inputs(8, torch.Generator().manual_seed(1)),
                      cluster="v100-1x4-nvlink", gpus=2)
    assert "covered by no rule" not in plan.describe(), plan.describe()
    result, _ = _result(_start(["--model", "tests.user_model:flipped", "--strategy", "ddp",
                                "--steps", "2", "--warmup", "0", "--json"]))
    assert result["world"] == 2 and len(result["losses"]) == 2, result
    assert all(math.isfinite(x) for x in result["losses"]), result
