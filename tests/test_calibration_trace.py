"""The trace reader reproduces the figures that shared/traces/README.md read off the real V100
traces (step wall, computation, communication, overlap; mean of the four profiled steps)."""
from __future__ import annotations

from pathlib import Path

import pytest

from calibration.trace import TraceError, TracedUpdate, breakdown, load_trace, main, traced_update

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"needs the traces at {TRACES}")
# trace: (wall ms, computation ms, communication ms, overlap) as the README gives them
README = {"v100-1x4-nvlink/hidup": (387.3, 370.1, 34.8, 0.68),
          "v100-1x4-nvlink/ddp": (401.0, 390.6, 59.5, 0.87),
          "v100-1x4-nvlink/deepspeed": (574.8, 545.7, 17.2, 0.0),
          "v100-1x4-nvlink/fastmoe": (486.0, 294.6, 181.6, 0.0),
          "v100-2x4/hidup": (458.9, 368.7, 141.2, 0.42)}


@needs_traces
@pytest.mark.parametrize("name", sorted(README))
def test_breakdown_matches_the_readme(name):
    wall, computation, communication, overlap = README[name]
    b = breakdown(load_trace(TRACES / f"{name}.json.gz"))
    assert b.wall * 1e3 == pytest.approx(wall, abs=0.06)
    assert b.computation * 1e3 == pytest.approx(computation, abs=0.25)
    if name.endswith("ddp"):  # the README counts 2.9 ms/step fewer device-to-device copies
        assert b.communication * 1e3 == pytest.approx(62.4, abs=0.06)
        assert b.overlap == pytest.approx(0.83, abs=0.01)
    else:
        assert b.communication * 1e3 == pytest.approx(communication, abs=0.06)
        assert b.overlap == pytest.approx(overlap, abs=0.01)


# PyTorch 2.11 traces of one H100 (kernel / gpu_memcpy events, each step marked on the host and
# on the device): host step mean and the GPU busy time per step as shared/traces/h100-1x1 lists
H100 = {"bert-sgmoe-paper-fp32": ((72.0, 72.8, 74.1, 72.3), (68.6, 68.6)),
        "bert-sgmoe-paper-bf16": ((71.1, 72.4, 60.3, 55.4), (14.0, 14.0)),
        "switch-trace-paper-fp32": ((179.8, 180.5, 173.3, 186.3), (105.2, 106.1)),
        "switch-trace-paper-bf16": ((114.4, 119.9, 141.0, 137.2), (21.0, 21.3))}


@needs_traces
@pytest.mark.parametrize("name", sorted(H100))
def test_h100_traces_are_read(name):
    """Four steps (not eight: the device's copies of the step marks are not steps), their GPU
    work counted, and no communication on one GPU."""
    host, (low, high) = H100[name]
    b = breakdown(load_trace(TRACES / "h100-1x1" / f"{name}.json.gz"))
    assert b.wall * 1e3 == pytest.approx(sum(host) / 4, abs=0.06)
    assert low - 0.15 <= b.computation * 1e3 <= high + 0.15
    assert b.communication == 0.0


def test_bad_traces_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(TraceError, match=r"bad\.json: cannot read it"):
        load_trace(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="no ProfilerStep# ranges"):
        breakdown(load_trace(tmp_path / "empty.json"))
    assert main([str(tmp_path / "missing.json.gz")]) == 2
    assert "cannot read it" in capsys.readouterr().err


@needs_traces
def test_the_optimizer_each_trace_ran():
    """shared/traces/README.md says the V100 runs used Adam; their optimizer steps say otherwise:
    DDP and the HiDup prototype ran SGD (one add_ per parameter, 69 parameters), FastMoE Adam (8
    kernels per parameter, 78 parameters), DeepSpeed its FusedAdam. The H100 traces record no
    optimizer step (their README names SGD)."""
    ran = {name: traced_update(load_trace(TRACES / f"{name}.json.gz"))
           for name in ("v100-1x4-nvlink/ddp", "v100-1x4-nvlink/hidup", "v100-1x4-nvlink/fastmoe",
                        "v100-1x4-nvlink/deepspeed", "v100-2x4/hidup",
                        "h100-1x1/bert-sgmoe-paper-fp32")}
    assert {n: (u.optimizer, u.kernels) for n, u in ran.items() if u} == {
        "v100-1x4-nvlink/ddp": ("sgd", 69), "v100-1x4-nvlink/hidup": ("sgd", 69),
        "v100-1x4-nvlink/fastmoe": ("adam", 8 * 78), "v100-1x4-nvlink/deepspeed": ("adam", 8),
        "v100-2x4/hidup": ("sgd", 69)}
    assert ran["h100-1x1/bert-sgmoe-paper-fp32"] is None
    assert ran["v100-1x4-nvlink/ddp"].seconds * 1e3 == pytest.approx(6.81, abs=0.01)
    assert ran["v100-1x4-nvlink/fastmoe"].seconds * 1e3 == pytest.approx(16.45, abs=0.01)


def test_an_optimizer_hidup_does_not_price_is_named():
    step = {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#Lion.step", "ts": 0, "dur": 5,
            "tid": 1}
    with pytest.raises(TraceError, match="optimizer Lion .* is not one HiDup prices"):
        traced_update([step])
    momentum = [dict(step, name="Optimizer.step#SGD.step"),
                {"ph": "X", "cat": "cpu_op", "name": "aten::mul_", "ts": 1, "dur": 1, "tid": 1,
                 "args": {"External id": 7}},
                {"ph": "X", "cat": "kernel", "name": "k", "ts": 2, "dur": 3,
                 "args": {"External id": 7}}]
    assert traced_update(momentum) == TracedUpdate("sgd-momentum", 3e-6, 1)
