"""experiments.accuracy end to end on an emulated cluster (CI's small version: gpt:small, ddp and
megatron, Duplex on and off, 2 hosts at 1 Gbit/s, one round: each configuration run once, as
the median of 4 configurations' errors is what the gate reads: one attempt took 213 s with three
rounds and 121 s with one, alone, and the three rounds' spread was at most 6.3% per
configuration), calibrated once as a user
calibrates (calibration.profile, then calibration.ops timing the kernels in real steps):
calibration, prediction and real runs, the CSV, JSON summary and plot it writes, and issue 15's
gate: the run fails when the median absolute error of the simulator against the real runs
exceeds 10%. This 2-core VM's speed drifts by up to 1.9x within a minute, and a run whose
machine slowed or sped up after its calibration misses by the drift, whatever the simulator
does (four quick runs here with calibration.ops timing the configurations in turns: medians
6.3%, 5.9%, 2.0%, and 18.2% in one whose four configurations all measured 6-23% slower than
predicted, ddp 8-17% slower than in the other three). So a run above the gate
gets one more, fresh one (calibrated again); the test fails when both are above 10%, and
prints both tables."""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
import shutil

import pytest
import torch

from experiments import accuracy
from experiments.accuracy_report import summarize, write_outputs
from experiments.accuracy_rows import Row, read_rows
from experiments.accuracy_runs import probed, speed_probe_ms


@pytest.mark.skipif(not (os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
                    reason="needs root and iproute2 (network namespaces)")
def test_quick_accuracy_run_writes_its_table_and_plot(tmp_path, capsys):
    tables = []
    for attempt in (1, 2):
        code = accuracy.main(["--quick", "--rounds", "1", "--out", str(tmp_path),
                              "--max-median-error", "0.10"])
        out = capsys.readouterr().out
        tables.append(f"attempt {attempt}:\n{out}")
        if code == 0:
            break
    print("\n".join(tables))  # shown by pytest -rP, and on a failure
    assert code == 0, "\n".join(tables)  # 1: both medians above 10% (the tables say where)
    rows = list(csv.DictReader(open(tmp_path / "accuracy.csv")))
    assert {(r["strategy"], r["k"]) for r in rows} == {("ddp", "1"), ("ddp", "2"),
                                                         ("megatron", "1"), ("megatron", "2")}
    for r in rows:
        assert float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) > 0
        assert float(r["kernels_measured"]) == 1.0  # every kernel priced from calibration.ops
        assert 0.3 < float(r["drift"]) < 3  # the speed probe ran around the calibration and run
    summary = json.loads((tmp_path / "accuracy.json").read_text())
    errors = [abs(float(r["predicted_ms"]) - float(r["measured_ms"])) / float(r["measured_ms"])
              for r in rows]  # the summary is its table's: the median of the rows' errors
    assert summary["configurations"] == 4
    assert summary["median_abs_error"] == pytest.approx(statistics.median(errors), rel=1e-3,
                                                        abs=1e-4)
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
    assert "median |error|" in out and "the machine's drift" in out
    assert summary["drift_probed"] == 4
    # the run kept its profiles and plans: this simulator predicts it again to the same figures
    again = tmp_path / "again"
    assert accuracy.main(["--combine", str(tmp_path), "--repredict", "--out", str(again)]) == 0
    assert "predicted again by this version's simulator" in capsys.readouterr().out
    before, after = read_rows(tmp_path), read_rows(again)
    assert [r.predicted_ms for r in after] == pytest.approx([r.predicted_ms for r in before],
                                                            rel=1e-9)
    assert [r.measured_ms for r in after] == [r.measured_ms for r in before]
    assert json.loads((again / "accuracy.json").read_text())["sources"][0]["repredicted"]
    # without the profile it was predicted from, the error names it
    for path in tmp_path.glob("profile-*gpt-small*.json"):
        path.unlink()
    assert accuracy.main(["--combine", str(tmp_path), "--repredict", "--out", str(again)]) == 2
    assert "was predicted from" in capsys.readouterr().err


def test_summary_figures_on_a_hand_made_table():
    row = lambda s, k, p, m: Row("m", s, k, "1gbit", 2, 1, p, m, 0, 0, 0, 1.0)  # noqa: E731
    rows = [row("ddp", 1, 110, 100), row("ddp", 2, 90, 100), row("megatron", 1, 200, 210),
            row("megatron", 2, 80, 95)]
    summary = summarize(rows)
    assert summary["median_abs_error"] == pytest.approx(0.1)  # of 4.8%, 10%, 10%, 15.8%
    assert summary["max_abs_error"] == pytest.approx(15 / 95)
    # predicted order 80 < 90 < 110 < 200, measured 95 < 100 = 100 < 210
    assert summary["kendall_tau"]["m"] > 0.8
    # the simulator picks megatron k=2 (80 predicted), which is also measured best (95)
    assert summary["regret"]["m on 2x1 1gbit"] == 1.0
    assert "median_abs_drift" not in summary  # no row has a speed probe


def test_drift_scales_each_prediction_to_the_speed_its_run_had():
    row = lambda p, m, d: Row("m", "ddp", 1, "1gbit", 2, 1, p, m, 0, 0, 0, 1.0,  # noqa: E731
                              drift=d)
    # the first two ran on a machine 10% slower / 20% faster than their kernels were timed on,
    # which is all their error; the third has a 5% error of its own; the fourth has no probe
    rows = [row(100, 110, 1.1), row(100, 80, 0.8), row(100, 105, 1.0), row(90, 100, math.nan)]
    summary = summarize(rows)
    assert summary["drift_probed"] == 3
    assert summary["median_abs_drift"] == pytest.approx(0.1)
    assert summary["max_abs_drift"] == pytest.approx(0.2)
    assert summary["median_abs_error_at_run_speed"] == pytest.approx(0.0)  # of 0, 0, 4.8%
    assert rows[2].error_at_run_speed == pytest.approx(100 / 105 - 1)
    assert summary["median_abs_error"] == pytest.approx((10 / 110 + 0.1) / 2)  # of 4.8, 9.1,
    #   10, 25%


def test_speed_probe_times_a_fixed_workload_on_one_thread():
    threads = torch.get_num_threads()
    first, second = speed_probe_ms(repeats=3), speed_probe_ms(repeats=3)
    assert 0.1 < first < 5000 and 0.1 < second < 5000
    assert torch.get_num_threads() == threads  # the caller's setting is given back
    (result, speed) = probed(lambda: "done")
    assert result == "done" and speed > 0


def test_combine_reports_earlier_runs_as_one_table(tmp_path, capsys):
    row = lambda c, s, k, p, m: Row("m", s, k, c, 2, 1, p, m, 1, 2, 0.5, 1.0,  # noqa: E731
                                    m * 0.9, m * 1.2,  # the rounds' fastest, slowest
                                    m / p)  # a drift: all the error is the machine's
    one = [row("1gbit", "ddp", 1, 110, 100), row("1gbit", "megatron", 1, 200, 210)]
    two = [row("10gbit", "ddp", 1, 30, 40), row("10gbit", "megatron", 1, 38, 35)]
    for name, rows in (("one", one), ("two", two)):
        (tmp_path / name).mkdir()
        write_outputs(rows, summarize(rows), tmp_path / name, f"run {name}")
    out = tmp_path / "both"
    assert accuracy.main(["--combine", str(tmp_path / "one"), str(tmp_path / "two"),
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 configurations" in printed and "| m | megatron | off | 2x1 10gbit | 38.0 | 35.0 |" \
        in printed
    assert read_rows(out) == one + two  # the CSV round trip keeps every field
    summary = json.loads((out / "accuracy.json").read_text())
    assert [s["command"] for s in summary["sources"]] == ["run one", "run two"]
    assert summary["median_abs_error_at_run_speed"] < 1e-9 < summary["median_abs_error"]
    assert summary["max_abs_error"] == pytest.approx(0.25)  # ddp at 10gbit: 30 against 40
    assert summary["median_round_spread"] == pytest.approx(1.2 / 0.9 - 1)
    assert "| 2x1 1gbit | 110.0 | 100.0 | +10.0% | 90.0-120.0 |" in printed
    # one cluster ranks right, the other wrong; across both the bandwidth orders most pairs
    assert summary["kendall_tau_per_cluster"] == {"m on 2x1 10gbit": -1.0, "m on 2x1 1gbit": 1.0}
    assert summary["kendall_tau"]["m"] == pytest.approx(2 / 3)
    # a configuration in two folders would count twice; a folder without a run is named
    assert accuracy.main(["--combine", str(tmp_path / "one"), str(tmp_path / "one"),
                          "--out", str(out)]) == 2
    assert accuracy.main(["--combine", str(tmp_path), "--out", str(out)]) == 2
    # a run written before the rounds' range was kept still combines, without that figure
    old = tmp_path / "old"
    old.mkdir()
    lines = (tmp_path / "one" / "accuracy.csv").read_text().splitlines()
    cut = lambda line: ",".join(line.split(",")[:12] + line.split(",")[14:])  # noqa: E731
    (old / "accuracy.csv").write_text("\n".join(map(cut, lines)) + "\n")
    assert "measured_low_ms" not in (old / "accuracy.csv").read_text()
    assert [r.measured_ms for r in read_rows(old)] == [100, 210]
    assert accuracy.main(["--combine", str(old), "--out", str(out)]) == 0
    assert json.loads((out / "accuracy.json").read_text())["median_round_spread"] is None
    # a damaged summary is named, with what to do
    (tmp_path / "two" / "accuracy.json").write_text("{not json")
    assert accuracy.main(["--combine", str(tmp_path / "two"), "--out", str(out)]) == 2
    errors = capsys.readouterr().err
    assert "in both" in errors and "no accuracy.csv there" in errors
    assert f"{tmp_path / 'two' / 'accuracy.json'} is not the summary" in errors


def test_repredict_needs_runs_calibrated_once_given_with_combine(tmp_path, capsys):
    row = Row("m", "ddp", 1, "1gbit", 2, 1, 110, 100, 0, 0, 0, 1.0)
    write_outputs([row], summarize([row]), tmp_path,
                  "python -m experiments.accuracy --recalibrate-each")
    with pytest.raises(SystemExit):
        accuracy.main(["--repredict", "--out", str(tmp_path / "x")])
    assert "give their folders with --combine" in capsys.readouterr().err
    assert accuracy.main(["--combine", str(tmp_path), "--repredict",
                          "--out", str(tmp_path / "x")]) == 2
    assert "(--recalibrate-each)" in capsys.readouterr().err
    # a run calibrated once, but its profile is gone: the missing file is named
    write_outputs([row], summarize([row]), tmp_path, "python -m x")
    assert accuracy.main(["--combine", str(tmp_path), "--repredict",
                          "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'profile-2x1-1gbit-m.json'}, which is not there" in \
        capsys.readouterr().err


def test_a_cluster_with_one_configuration_has_no_ranking(tmp_path, capsys):
    rows = [Row("m", "ddp", 1, "1gbit", 2, 1, 110, 100, 0, 0, 0, 1.0),
            Row("m", "ddp", 1, "10gbit", 2, 1, 30, 40, 0, 0, 0, 1.0),
            Row("m", "megatron", 1, "10gbit", 2, 1, 38, 35, 0, 0, 0, 1.0)]
    summary = summarize(rows)
    assert summary["kendall_tau_per_cluster"]["m on 2x1 1gbit"] is None
    write_outputs(rows, summary, tmp_path, "run")
    text = (tmp_path / "accuracy.json").read_text()
    assert "NaN" not in text and json.loads(text)["kendall_tau_per_cluster"] == \
        {"m on 2x1 10gbit": -1.0, "m on 2x1 1gbit": None}
    assert accuracy.main(["--combine", str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert "m on 2x1 1gbit - (one configuration)" in capsys.readouterr().out
