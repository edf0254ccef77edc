"""hidup.train for real: a 2-rank Duplex run under torchrun, its trace, and its CLI errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import free_port
from experiments.trace_overlap import load_events, overlaps
from hidup.train import main


@pytest.mark.slow
def test_duplex_run_trace_shows_communication_under_other_micro_batch(tmp_path):
    trace = tmp_path / "duplex.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "hidup.train", "--model", "gpt:tiny",
           "--strategy", "megatron", "--duplex", "--steps", "3", "--warmup", "1", "--json",
           "--trace", str(trace)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world"] == 2 and result["micro_batches"] == 2 and len(result["losses"]) == 3
    found = overlaps(load_events(trace))
    assert {o.mb for o in found} >= {0, 1}  # both micro-batches' collectives are in the trace
    assert sum(o.hidden_us for o in found) > 0  # and some ran during the other's computation


def test_single_process_run_and_loss_falls(capsys):
    assert main(["--model", "mlp:tiny", "--steps", "6", "--warmup", "1", "--optimizer", "sgd",
                 "--lr", "0.1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["losses"][-1] < result["losses"][0]


def test_bad_input_is_one_line(capsys):
    assert main(["--model", "mlp:tiny", "--strategy", "zigzag", "--steps", "2", "--warmup", "0"]) == 2
    assert "unknown strategy 'zigzag'; choose one of ['ddp', 'expert', 'fsdp', 'megatron', 'megatron-sp', 'dp-expert', 'dp-megatron', 'fsdp+tp', 'hsdp', 'hsdp+tp', 'tp+ep'] or a plan file" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--steps", "2", "--warmup", "2"])
    assert "--warmup (2) must be below --steps (2)" in capsys.readouterr().err
