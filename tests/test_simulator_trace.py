"""The Chrome trace of a simulated step: tracks per rank and stream, events in microseconds."""
import json

import pytest

from hidup.graph.placement import P, R
from hidup.program import Compute, Convert, Program, Wait, task_label
from simulator import LinkCost, Profile, simulate
from simulator.trace import chrome_trace, write_trace

LINK = LinkCost(0.0, 1e9)
PROFILE = Profile("t", "test", 1e12, 1e12, 0.0, {k: LINK for k in
                  ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")}, 2)
FWD = Compute(0, "linear", "aten.linear.default", "fwd", 0, 1e9, 0.0, (), (), (), ("y",))
AR = Convert(1, "all_reduce", "linear_3", P, R, "fwd", 1, (), 10**6, (0, 1), ("y",), ("y@R",))
STEP = Compute(3, "", "optimizer.step", "update", None, 2e9, 0.0, (), (), (), ())
PROGRAM = Program("m", "0", "s", 2, 2, (FWD, AR, Wait(2, 1), STEP), (), {})


def test_event_names_read_like_the_executors_labels():
    assert task_label(FWD) == "fwd linear mb0"
    assert task_label(AR) == "all_reduce linear_3 mb1"
    assert task_label(STEP) == "update optimizer.step"


def test_trace_has_a_track_per_stream_per_rank(tmp_path):
    doc = chrome_trace(simulate(PROGRAM, PROFILE, all_ranks=True))
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
              if e["name"] == "thread_name"}
    assert tracks == {(0, 0): "stream 0 (compute)", (0, 1): "stream 1 (nccl)",
                      (1, 0): "stream 0 (compute)", (1, 1): "stream 1 (nccl)"}
    ar = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"].startswith("all_reduce")]
    assert [(e["pid"], e["tid"]) for e in ar] == [(0, 1), (1, 1)]
    assert ar[0]["ts"] == pytest.approx(1000.0) and ar[0]["dur"] == pytest.approx(1000.0)
    assert ar[0]["args"]["bytes"] == 10**6 and ar[0]["args"]["micro-batch"] == 1


def test_write_trace_writes_json(tmp_path):
    path = tmp_path / "step.trace.json"
    write_trace(path, simulate(PROGRAM, PROFILE, all_ranks=True), "s k=2")
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 6
    assert events[0]["args"]["name"] == "rank 0 s k=2"


def test_a_collective_in_flight_beside_another_has_a_track_of_its_own():
    from dataclasses import replace
    second = Convert(4, "all_reduce", "linear_4", P, R, "fwd", 1, (), 10**6, (0, 1), ("z",),
                     ("z@R",))
    program = Program("m", "0", "s", 2, 2, (FWD, AR, second, Wait(2, 1), Wait(5, 4), STEP), (),
                      {})
    doc = chrome_trace(simulate(program, replace(PROFILE, comm_lanes=2)))
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
              if e["name"] == "thread_name"}
    assert tracks[11] == "stream 1 (nccl), collective 2 in flight"
    ar = sorted((e["tid"], e["ts"]) for e in doc["traceEvents"]
                if e["ph"] == "X" and e["name"].startswith("all_reduce"))
    assert [t for t, _ in ar] == [1, 11] and ar[0][1] == pytest.approx(ar[1][1])
