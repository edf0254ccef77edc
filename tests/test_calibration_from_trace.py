"""Profiles fitted from the real V100 traces, the plan read from the traced HiDup run, and the
simulator's predictions of the traced step times (issue: within 5% for DDP and the HiDup plan)."""
from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from calibration import derive, from_trace
from calibration.trace import TraceError, load_trace
from calibration.traced_plan import derive_plan, kind_counts
from hidup.graph.placement import Shard
from hidup.models import capture_model, get_model
from hidup.planning.costs import ProfileError
from hidup.planning.profile_file import load_profile
from hidup.program import lower

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
ONE = TRACES / "v100-1x4-nvlink"
pytestmark = pytest.mark.skipif(not ONE.is_dir(), reason="needs ../shared/traces")


@pytest.fixture(scope="module")
def paper4():
    spec = get_model("switch-trace:paper", gpus=4)
    return spec, capture_model(spec, spec.batch)


def test_the_traced_plan_shards_the_gathered_weights_and_issues_the_traced_collectives(paper4):
    spec, graph = paper4
    events = load_trace(ONE / "hidup.json.gz")
    plan, lines = derive_plan(events, graph, 4)
    sharded = {n for n, p in plan.placements.items()
               if isinstance(p, Shard) and "moe" not in n and n != "x"}
    dense, attention = (0, 2, 4), range(6)
    want = ({f"p_layers_{i}_self_attn_{w}_weight" for i in attention for w in ("in_proj",
                                                                             "out_proj")}
            | {f"p_layers_{i}_linear{j}_weight" for i in dense for j in (1, 2)}
            | {f"p_layers_{i}_linear2_bias" for i in dense})
    assert sharded == want and len(lines) == 21
    program = lower(graph, plan, 4, 2, spec.name, bucket_bytes=0)
    ours = collections.Counter(c.kind for c in program.collectives)
    traced = kind_counts(events)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ours[kind] == traced[kind]
    assert ours["all_reduce"] == traced["all_reduce"] + 1  # + the loss, which the run did not


def test_fitted_profile_predicts_the_traced_steps_within_5_percent(tmp_path, capsys):
    out = tmp_path / "v100.json"
    assert from_trace.main([f"{ONE / 'ddp.json.gz'}=ddp", f"{ONE / 'hidup.json.gz'}=traced",
                            "--model", "switch-trace:paper", "--gpus", "4", "--out",
                            str(out)]) == 0
    text = capsys.readouterr().out
    assert "residuals intra-node all_to_all: 24 points" in text
    profile = load_profile(out)
    assert 5e12 < profile.flops < 15.7e12  # a V100's fp32 peak is 15.7 TFLOP/s
    assert profile.provenance["strategies"] == ["ddp", "traced"]
    from experiments import switch_trace
    assert switch_trace.main(["--cluster", str(out), "--out", str(tmp_path / "st")]) == 0
    rows = {r["trace"]: r for r in __import__("csv").DictReader(
        open(tmp_path / "st" / "switch_trace.csv"))}
    for trace in ("ddp.json.gz", "hidup.json.gz"):
        assert abs(float(rows[trace]["error"])) <= 0.05, rows[trace]
    # each row is predicted with the optimizer its trace ran
    assert [rows[t]["predict"].split("--optimizer ")[1].split()[0] for t in
            ("ddp.json.gz", "hidup.json.gz", "fastmoe.json.gz")] == ["sgd", "sgd", "adam"]
    assert float(rows["ddp.json.gz"]["traced_update_ms"]) == pytest.approx(6.81, abs=0.01)
    two = rows["v100-2x4/hidup.json.gz"]  # the prototype on 2 machines, on the shipped v100-2x4
    assert "--gpus 8 --cluster v100-2x4" in two["predict"] and abs(float(two["error"])) <= 0.1
    plan = json.loads((tmp_path / "st" / "switch-trace-hidup-plan.json").read_text())
    assert plan["placements"]["p_layers_0_linear1_weight"] == "S(0)"


def test_shipped_profiles_say_where_they_come_from():
    one, two, big = (load_profile(n) for n in ("v100-1x4-nvlink", "v100-2x4", "v100-8x8-10gbps"))
    assert "calibration.from_trace" in one.source and one.inter_node is None
    assert two.flops == one.flops and two.collectives == one.collectives
    assert two.inter_node and "--links-only" in two.source
    assert big.gpus_per_node == 8 and "calibration.derive" in big.source
    assert max(c.beta for c in big.inter_node.values()) == pytest.approx(9.71e9 / 8)


def test_derive_scales_the_inter_node_link():
    two = load_profile("v100-2x4")
    half = derive.with_inter_link(two, max(c.beta for c in two.inter_node.values()) / 2)
    for kind, cost in half.inter_node.items():
        assert cost.beta == pytest.approx(two.inter_node[kind].beta / 2)
        assert cost.alpha == two.inter_node[kind].alpha
    assert derive.parse_rate("9.71gbit") == pytest.approx(9.71e9 / 8)
    assert derive.parse_rate("100mbit") == pytest.approx(12.5e6)
    for bad in ("-1gbit", "fast", "0"):
        with pytest.raises(ValueError, match="positive rate in bits per second"):
            derive.parse_rate(bad)
    with pytest.raises(ProfileError, match="no inter-node tier"):
        derive.with_inter_link(load_profile("v100-1x4-nvlink"), 1e9)


HARDWARE = Path(derive.__file__).parent / "hardware" / "h100-sxm-8x-ndr400.json"


def test_the_h100_cluster_is_the_one_gpu_profile_with_the_hardware_figures(tmp_path, capsys):
    """The shipped H100 cluster profiles are what calibration.derive --hardware makes from the
    one-GPU profiles and the hardware file: the kernels' efficiency kept, the memory bandwidth
    scaled by 2.4 / 3.35, NVLink's and the network's figures from the file, each source named."""
    for base, name in (("h100", "h100-8x-ib"), ("h100-bf16", "h100-8x-ib-bf16")):
        out = tmp_path / f"{name}.json"
        assert derive.main(["--base", base, "--hardware", str(HARDWARE), "--name", name,
                            "--out", str(out)]) == 0
        made, one, shipped = load_profile(str(out)), load_profile(base), load_profile(name)
        assert made.to_dict() | {"provenance": None} == shipped.to_dict() | {"provenance": None}
        assert made.flops == one.flops and made.host == one.host
        assert made.mem_bandwidth == pytest.approx(one.mem_bandwidth * 2.4 / 3.35)
        assert made.gpus_per_node == 8 and made.device_memory == 96 * 2**30
        assert made.collectives["all_reduce"].beta == 480e9
        assert made.collectives["all_gather"].alpha == 3.4e-6
        assert made.inter_node["reduce_scatter"].beta == 376e9
        for cited in ("nccl-tests/issues/212", "nccl-tests/issues/290", "tuning.cc",
                      "2.4 TB/s"):
            assert cited in made.source, cited
    bad = json.loads(HARDWARE.read_text())
    del bad["intra_node"]["all_to_all"]["latency"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert derive.main(["--base", "h100", "--hardware", str(tmp_path / "bad.json"), "--name",
                        "x", "--out", str(tmp_path / "x.json")]) == 2
    assert "intra_node all_to_all's 'latency' is None; give a positive number" in \
        capsys.readouterr().err


def test_bad_traces_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b not gzip")
    assert from_trace.main([f"{bad}=ddp", "--model", "switch-trace:paper", "--gpus", "4",
                            "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress line
    assert err.startswith("python -m calibration.from_trace: error: trace ") and "cannot read" in err
    assert from_trace.main([f"{bad}", "--model", "switch-trace:paper", "--gpus", "4",
                            "--out", str(tmp_path / "p.json")]) == 2
    assert "give TRACE=STRATEGY" in capsys.readouterr().err
    no_copies = tmp_path / "t.json"
    no_copies.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "cat": "cpu_op", "tid": 1},
        {"ph": "X", "name": "ProfilerStep#2", "ts": 100, "dur": 100, "cat": "cpu_op", "tid": 1},
        {"ph": "X", "cat": "Kernel", "name": "ncclKernel_AllGather_RING_LL_Sum_int8_t", "ts": 110,
         "dur": 5, "args": {"stream": 20}}]}))
    with pytest.raises(TraceError, match="does not record the collective's sizes"):
        derive_plan(load_trace(no_copies), capture_model(*(lambda s: (s, s.batch))(
            get_model("switch-trace:tiny", gpus=2))), 2)


H100 = TRACES / "h100-1x1"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_h100_traces_refit_the_shipped_profile_and_read_the_host_time(tmp_path, capsys, precision):
    """PyTorch 2.x eager traces (no 'forward' range, 'External id'): both models' kernels fitted
    to one roofline that reproduces the shipped h100 profile; with --host-mode the host's busy
    time per step, less the profiler's 2.94 us per recorded event (fitted on bert-sgmoe bf16
    against its untimed 28.0 ms step), matches the untimed host-bound steps of the traces'
    README (bert-sgmoe bf16 28.0 ms; switch-trace bf16 100.5 ms, not fitted on)."""
    out = tmp_path / "h100.json"
    traces = [f"{H100 / f'{m}-paper-{precision}.json.gz'}=ddp@{m}:paper"
              for m in ("bert-sgmoe", "switch-trace")]
    assert from_trace.main([*traces, "--gpus", "1", "--batch", "32", "--base", "v100-1x4-nvlink",
                            "--host-mode", "eager", "--profiler-overhead-us", "2.94",
                            "--out", str(out)]) == 0
    text = capsys.readouterr().out
    fitted = load_profile(out)
    shipped = load_profile("h100" if precision == "fp32" else "h100-bf16")
    assert fitted.flops == pytest.approx(shipped.flops, rel=1e-6)
    assert fitted.mem_bandwidth == pytest.approx(shipped.mem_bandwidth, rel=1e-6)
    assert (4e13 if precision == "fp32" else 2e14) < fitted.flops < 1e15
    assert 2e12 < fitted.mem_bandwidth < 5e12  # an H100's HBM3: 3.35 TB/s
    host = dict((m.group(1), float(m.group(2))) for m in
                re.finditer(r"check: (\S+): .*; host ([\d.]+) ms per step", text))
    assert len(host) == 2
    if precision == "bf16":
        assert host["bert-sgmoe-paper-bf16.json.gz"] == pytest.approx(28.0, rel=0.02)
        assert host["switch-trace-paper-bf16.json.gz"] == pytest.approx(100.5, rel=0.02)
    assert set(fitted.host) == {"eager"} and fitted.host["eager"] > 1e-5
    assert fitted.provenance["models"] == ["bert-sgmoe:paper", "switch-trace:paper"]


def test_a_trace_without_its_model_is_a_one_line_error(capsys):
    trace = H100 / "bert-sgmoe-paper-fp32.json.gz"
    assert from_trace.main([f"{trace}=ddp", "--gpus", "1", "--out", "/tmp/x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "@NAME:SIZE or --model" in err[0]
