"""What a new user meets first: experiments write into a git-ignored scratch folder by default and
a --quick run never overwrites the committed results; trace_overlap reads the shipped Duplex
trace (and refuses one it cannot read); rates need a unit, float flags must be finite and in
range, and calibration.derive prints readable figures. Every refusal is one line, exit 2."""
from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from calibration import derive
from conftest import one_line
from experiments import accuracy, outputs, paper, trace_overlap, whatif

REPO = Path(__file__).resolve().parents[1]
DUPLEX_TRACE = REPO.parent / "shared" / "traces" / "v100-1x4-nvlink" / "hidup.json.gz"


def refusal(main, argv, capsys) -> str:
    """Run a command's main; it must stop with exit 2 and one line on stderr: that line."""
    return one_line(main, argv, capsys, code=2)


def snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


# -- 1. default output folders ------------------------------------------------------------------

def test_defaults_are_scratch_folders_not_the_committed_results(monkeypatch):
    monkeypatch.chdir(REPO)
    for out in (paper.parse_args(["breakdown"]).out, paper.parse_args(["all", "--quick"]).out,
                whatif.parse_args([]).out, accuracy.parse_args(["--quick"]).out):
        assert out.parts[0] == "out" and not outputs.committed(out), out
    assert outputs.committed(Path("experiments/results/paper"))
    # a full run may refresh the committed figures, when asked to explicitly
    assert paper.parse_args(["breakdown", "--out", "experiments/results/paper"]).out


def test_quick_paper_and_whatif_runs_leave_the_committed_results_alone(tmp_path, monkeypatch,
                                                                      capsys):
    before = snapshot(outputs.RESULTS)
    monkeypatch.chdir(tmp_path)
    assert paper.main(["breakdown", "--quick"]) == 0
    assert whatif.main(["--model", "bert-sgmoe:tiny", "--points", "1"]) == 0
    printed = capsys.readouterr().out
    for name in ("paper/breakdown.csv", "paper/breakdown.png", "whatif/whatif.csv",
                 "whatif/whatif.png"):
        assert (tmp_path / "out" / name).is_file(), name
    assert "wrote out/paper/breakdown.csv" in printed and "out/paper/ is scratch" in printed
    assert "out/whatif/ is scratch" in printed
    assert snapshot(outputs.RESULTS) == before


def test_quick_runs_into_the_committed_results_are_refused(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for main, argv, default in (
            (paper.main, ["breakdown", "--quick", "--out", "experiments/results/paper"],
             "out/paper/"),
            (paper.main, ["all", "--quick", "--out", str(outputs.RESULTS / "paper")], "out/paper/"),
            (accuracy.main, ["--quick", "--out", "experiments/results/accuracy"],
             "out/accuracy/")):
        line = refusal(main, argv, capsys)
        assert "a --quick run" in line and "committed" in line and default in line, line


# -- 2. trace_overlap ---------------------------------------------------------------------------

@pytest.mark.skipif(not DUPLEX_TRACE.is_file(), reason="needs ../shared/traces")
def test_trace_overlap_reads_the_shipped_duplex_trace(capsys):
    assert trace_overlap.main([str(DUPLEX_TRACE)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"^(\d+) collectives \(NCCL kernels\), ([\d.]+) ms, ([\d.]+) ms of it under "
                      r"computation: overlap (\d+)%", out, re.M)
    assert found, out
    count, total, hidden, share = (float(g) for g in found.groups())
    assert count > 0 and total > 0 and hidden > 0 and 0 < share <= 100
    assert "nccl AllReduce" in out and "nccl SendRecv" in out  # per kind of collective
    assert "overlap 69%" in out  # calibration.trace's mean step, as shared/traces/README.md says


def test_trace_overlap_refuses_what_it_cannot_read(tmp_path, capsys):
    bad_gzip = tmp_path / "bad.json.gz"
    bad_gzip.write_bytes(b"\x1f\x8b not gzip")
    cut = tmp_path / "cut.json"
    cut.write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm"')
    not_chrome = tmp_path / "list.json"
    not_chrome.write_text("[1, 2, 3]")
    for path in (bad_gzip, cut, not_chrome, tmp_path / "missing.json"):
        line = refusal(trace_overlap.main, [str(path)], capsys)
        assert str(path) in line and "Chrome trace" in line, line
    quiet = tmp_path / "no-collectives.json.gz"  # readable, but nothing communicates
    quiet.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "cat": "kernel", '
                                    b'"name": "gemm", "ts": 0, "dur": 5, "pid": 0}]}'))
    line = refusal(trace_overlap.main, [str(quiet)], capsys)
    assert "no collectives in it" in line and "multi-rank run" in line, line


# -- 3. rates, float flags, readable figures ----------------------------------------------------

def test_rates_need_a_unit(tmp_path, capsys):
    assert derive.parse_rate("9.71gbps") == pytest.approx(9.71e9 / 8)
    assert derive.parse_rate("10 Gbit/s") == pytest.approx(10e9 / 8)
    assert derive.parse_rate("100mbit") == pytest.approx(12.5e6)
    for rate in ("1", "1e9", "nan", "inf", "1e999gbit", "10gb"):
        line = refusal(derive.main, ["--base", "v100-2x4", f"--inter-bandwidth={rate}", "--name",
                                     "x", "--out", str(tmp_path / "x.json")], capsys)
        assert f"--inter-bandwidth {rate!r}" in line and "with its unit" in line, line
        assert "e.g. 100mbit, 10gbit, 9.71gbps" in line, line
    line = refusal(whatif.main, ["--bandwidth", "1:100"], capsys)
    assert "--bandwidth '1'" in line and "with its unit" in line, line
    assert not (tmp_path / "x.json").exists()


def test_derive_prints_readable_figures(tmp_path, capsys):
    assert derive.main(["--base", "v100-2x4", "--gpus-per-node", "8", "--inter-bandwidth",
                        "9.71gbit", "--name", "x", "--out", str(tmp_path / "x.json")]) == 0
    out = capsys.readouterr().out
    inter = [line for line in out.splitlines() if "inter-node" in line]
    assert len(inter) == 4, out
    assert "bus bandwidth 1.21 GB/s (9.71 Gbit/s)" in out  # the fastest kind: the link itself
    for line in inter:
        assert re.search(r"latency +\d+\.\d\d us per step, bus bandwidth [\d.]+ [kMG]?B/s", line)
        assert "e-" not in line and "e+" not in line, line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0.5"])
def test_whatif_threshold_must_be_finite_and_at_least_one(value, capsys):
    line = refusal(whatif.main, [f"--threshold={value}"], capsys)
    assert f"--threshold {float(value)}" in line and "give >= 1.0" in line, line
