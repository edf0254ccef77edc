"""The SimPy engine on hand-built Programs (times pinned to hand-computed values); profiles."""
import json

import pytest

from hidup.graph.placement import P, R, Shard
from hidup.planning.profile_file import from_dict
from hidup.program import COLLECTIVES, Compute, Convert, Program, Wait
from simulator import LinkCost, Profile, ProfileError, SimulationError, load_profile, simulate

OVERHEAD, ALPHA = 1e-6, 1e-5
T_A = 1.0 + OVERHEAD  # 1e12 FLOPs at 1e12 FLOP/s
T_C = 0.5 + OVERHEAD  # 5e11 FLOPs
T_AR = 2 * ALPHA + 1.0  # ring all-reduce on 2 ranks: 2 steps, 2(n-1)/n x 1e9 B at 1e9 B/s


def profile(**kw) -> Profile:
    costs = {kind: LinkCost(ALPHA, 1e9) for kind in COLLECTIVES}
    return Profile("test", "hand-made", kw.get("flops", 1e12), kw.get("mem_bandwidth", 1e12),
                   OVERHEAD, costs, 4)


def compute(name: str, flops: float, inputs=(), outputs=(), nbytes=0.0) -> Compute:
    return Compute(-1, name, "aten.mm.default", "fwd", 0, flops, nbytes, (), (), tuple(inputs),
                   tuple(outputs))


def all_reduce(tensor: str, nbytes: int, world: int = 2) -> Convert:
    return Convert(-1, "all_reduce", tensor, P, R, "fwd", 0, (), nbytes, tuple(range(world)),
                   (tensor,), (tensor + "@R",))


def program(*tasks, world: int = 2) -> Program:
    """Number the tasks by position (a Wait names its collective by position)."""
    numbered = tuple(type(t)(**{**t.__dict__, "id": i}) for i, t in enumerate(tasks))
    return Program("hand", "0", "hand", world, 1, numbered, (), {})


A = compute("a", 1e12, outputs=["a"])
B = compute("b", 1e12, inputs=["a@R"], outputs=["b"])
C = compute("c", 5e11, outputs=["c"])
AR = all_reduce("a", 10**9)


def test_serial_order_adds_up():
    r = simulate(program(A, AR, Wait(-1, 1), B, C), profile())
    assert r.step_time == pytest.approx(T_A + T_AR + T_A + T_C, rel=1e-12)
    assert r.computation == pytest.approx(2 * T_A + T_C, rel=1e-12)
    assert r.communication == pytest.approx(T_AR, rel=1e-12)
    assert r.overlap_ratio == 0.0
    assert r.exposed_communication == pytest.approx(T_AR, rel=1e-12)


def test_overlapped_order_hides_the_independent_compute():
    r = simulate(program(A, AR, C, Wait(-1, 1), B), profile())
    assert r.step_time == pytest.approx(T_A + T_AR + T_A, rel=1e-12)
    assert r.computation == pytest.approx(2 * T_A + T_C, rel=1e-12)
    assert r.communication == pytest.approx(T_AR, rel=1e-12)
    assert r.overlap_ratio == pytest.approx(T_C / T_AR, rel=1e-12)
    assert r.exposed_communication == pytest.approx(T_AR - T_C, rel=1e-12)


def test_every_rank_runs_the_same_timeline():
    r = simulate(program(A, AR, C, Wait(-1, 1), B), profile(), all_ranks=True)
    assert len(r.records) == 2
    times = [[(rec.task.id, rec.stream, rec.start, rec.end) for rec in rank] for rank in r.records]
    assert times[0] == times[1]
    ar = next(rec for rec in r.records[0] if rec.task.id == 1)
    assert (ar.stream, ar.start) == (r.comm_stream, pytest.approx(T_A, rel=1e-12))


def test_collective_waits_for_all_earlier_producers_of_its_input():
    grad1 = compute("g1", 1e12, outputs=["g"])
    grad2 = compute("g2", 5e11, outputs=["g"])
    r = simulate(program(grad1, grad2, all_reduce("g", 10**9), Wait(-1, 2)), profile())
    assert r.step_time == pytest.approx(T_A + T_C + T_AR, rel=1e-12)


def test_collectives_run_one_after_another_on_the_comm_stream():
    r = simulate(program(A, AR, all_reduce("x", 10**9), Wait(-1, 1), Wait(-1, 2)), profile())
    assert r.step_time == pytest.approx(T_A + 2 * T_AR, rel=1e-12)


def test_local_conversions_and_memory_bound_kernels():
    slice_ = Convert(-1, "slice", "a", R, Shard(0), "fwd", 0, (), 2 * 10**12, (), ("a",), ("s",))
    alias = Convert(-1, "alias", "a", R, R, "bwd", 0, (), 10**12, (), ("s",), ("t",))
    copy = compute("copy", 0.0, nbytes=3e12)
    r = simulate(program(slice_, alias, copy), profile())
    assert r.step_time == pytest.approx((OVERHEAD + 2.0) + 0.0 + (OVERHEAD + 3.0), rel=1e-12)
    assert r.communication == 0.0 and r.overlap_ratio == 0.0


def test_a_group_of_one_communicates_for_free():
    r = simulate(program(A, all_reduce("a", 10**9, world=1), Wait(-1, 1), B, world=1), profile())
    assert r.step_time == pytest.approx(2 * T_A, rel=1e-12)


def test_wait_for_a_non_collective_is_refused():
    with pytest.raises(SimulationError, match=r"#0 is not a collective"):
        simulate(program(A, Wait(-1, 0)), profile())


def test_a_wait_before_the_collectives_input_is_a_deadlock():
    with pytest.raises(SimulationError, match=r"deadlock: task #1 never ran on rank 0"):
        simulate(program(Wait(-1, 2), A, AR), profile())


def test_a_collective_outside_the_world_is_refused():
    with pytest.raises(SimulationError, match=r"groups \(\(0, 1, 2\),\) do not split the 2 ranks"):
        simulate(program(A, all_reduce("a", 8, world=3), Wait(-1, 1)), profile())


# -- profiles ---------------------------------------------------------------------------------
def test_shipped_profile_is_the_fit_from_the_traces():
    """v100-1x4-nvlink is fitted from the V100 traces (tests/test_calibration_from_trace.py
    re-fits it and checks its predictions); here: plausible V100 figures, one machine."""
    p = load_profile("v100-1x4-nvlink")
    assert 5e12 < p.flops < 15.7e12 and 1e11 < p.mem_bandwidth < 9e11 and p.gpus_per_node == 4
    for cost in p.collectives.values():
        assert 1e10 < cost.beta < 3e11  # NVLink bus bandwidths, tens of GB/s
    assert "calibration.from_trace" in p.source and p.provenance["strategies"] == ["ddp", "traced"]
    assert p.inter_node is None and p.interference_compute == p.interference_comm == 1.0


def test_profile_round_trips_through_a_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(profile().to_json())
    assert load_profile(path) == profile()
    assert load_profile(str(path)).collectives == profile().collectives


def _write(tmp_path, text: str):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


def _doc(**changes) -> str:
    doc = json.loads(profile().to_json())
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize("text, message", [
    ("{not json", r"bad\.json: not valid JSON .*; fix or re-create it"),
    ('{"format": "hidup-plan", "version": 1}', r"bad\.json: not a HiDup profile .*give a profile"),
    (_doc(version=1), r"bad\.json: version 1, this HiDup reads version 2; re-create"),
    (_doc(extra=1), r"bad\.json: unknown keys \['extra'\]; the keys are"),
    (_doc(flops=-1), r"bad\.json: flops must be a positive number, got -1"),
    (_doc(collectives={"all_reduce": {"alpha": 0, "beta": 1}}), r"must have exactly the kinds"),
    (_doc(interference={"compute": 0.5, "communication": 1.0}), r"each must be >= 1.0"),
])
def test_bad_profile_files_are_refused_with_the_reason(tmp_path, text, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(_write(tmp_path, text))


def test_missing_profile_file_and_unknown_name(tmp_path):
    with pytest.raises(ProfileError, match=r"nothere\.json: cannot read it .*check the path"):
        load_profile(tmp_path / "nothere.json")
    with pytest.raises(ProfileError, match=r"unknown cluster profile 'tpu'; choose one of "
                                           r"\[.*'v100-1x4-nvlink', 'v100-2x4', 'v100-8x8-10gbps'"):
        load_profile("tpu")


def _measured(points) -> Profile:
    """Two machines of one rank; the fit says 1 ms + bytes at 1 GB/s for every kind."""
    link = {k: LinkCost(1e-3, 1e9) for k in COLLECTIVES}
    return Profile("m", "test", 1e12, 1e11, 0.0, link, 1, link, collective_points=points)


def test_measured_collective_times_come_before_the_fit():
    pts = [["inter", "all_reduce", 2, 1e6, 0.004], ["inter", "all_reduce", 2, 4e6, 0.010]]
    p, fit = _measured(pts), _measured(None)
    t = lambda prof, b, kind="all_reduce", g=(0, 1): prof.collective_time(kind, b, g)  # noqa: E731
    assert t(p, 1e6) == pytest.approx(0.004) and t(p, 4e6) == pytest.approx(0.010)
    assert t(p, 2.5e6) == pytest.approx(0.007)  # linear between measured sizes
    assert t(p, 8e6) == pytest.approx(0.018)  # the last segment's slope beyond them
    assert t(p, 10) == pytest.approx(0.004)  # the smallest size's time below them
    # split as the fit splits, scaled to the measured total
    lat, xfer = p.collective_split("all_reduce", 4e6, (0, 1))
    flat, fxfer = fit.collective_split("all_reduce", 4e6, (0, 1))
    assert lat / xfer == pytest.approx(flat / fxfer) and lat + xfer == pytest.approx(0.010)
    # kinds, tiers and group sizes that were not measured keep the fit
    assert t(p, 1e6, "all_gather") == t(fit, 1e6, "all_gather")
    assert t(p, 1e6, g=(0, 1, 2)) == t(fit, 1e6, g=(0, 1, 2))
    # saved with the profile, refused when malformed
    assert from_dict(p.to_dict()).collective_points == pts
    bad = dict(p.to_dict(), collective_points=[["inter", "all_reduce", 1, 10, 0.1]])
    with pytest.raises(ProfileError, match=r"collective_points holds .* group size >= 2"):
        from_dict(bad)


def test_a_mesh_column_takes_its_own_measured_times():
    """Machines of 2 ranks: a group of one rank on each machine (a 2-D mesh's column) takes the
    'column' points, a group of consecutive ranks across machines the 'inter' ones, a group in
    one machine the fit; a what-if link drops both measured tiers."""
    from dataclasses import replace

    from calibration.derive import with_inter_link

    pts = [["inter", "all_reduce", 2, 1e6, 0.004], ["inter", "all_reduce", 2, 4e6, 0.010],
           ["column", "all_reduce", 2, 1e6, 0.006], ["column", "all_reduce", 2, 4e6, 0.020]]
    p = replace(_measured(pts), gpus_per_node=2)
    fit = replace(_measured(None), gpus_per_node=2)
    assert p.collective_time("all_reduce", 4e6, (0, 2)) == pytest.approx(0.020)  # a column
    assert p.collective_time("all_reduce", 1e6, (1, 3)) == pytest.approx(0.006)
    assert p.collective_time("all_reduce", 4e6, (0, 1)) == fit.collective_time(
        "all_reduce", 4e6, (0, 1))  # inside a machine: the fit (no intra points)
    four = [["inter", "all_reduce", 4, 1e6, 0.007], ["inter", "all_reduce", 4, 4e6, 0.030]]
    p4 = replace(_measured(pts + four), gpus_per_node=2)
    assert p4.collective_time("all_reduce", 4e6, (0, 1, 2, 3)) == pytest.approx(0.030)
    assert from_dict(p.to_dict()).collective_points == pts
    assert with_inter_link(p, 1e10).collective_points is None


def test_a_what_if_link_or_a_perturbed_profile_moves_the_measured_times_too():
    import random

    from calibration.derive import with_inter_link
    from simulator.montecarlo import perturb

    pts = [["inter", "all_reduce", 2, 1e6, 0.004], ["inter", "all_reduce", 2, 4e6, 0.010],
           ["intra", "all_reduce", 2, 1e6, 0.001], ["intra", "all_reduce", 2, 4e6, 0.002]]
    p = _measured(pts)
    faster = with_inter_link(p, 1e10)  # another link: its measured times no longer apply
    assert faster.collective_points == pts[2:]
    assert faster.collective_time("all_reduce", 4e6, (0, 1)) == pytest.approx(2e-3 + 4e6 / 1e10)
    moved = perturb(p, random.Random(1), 0.3)
    ratios = {pt[0]: q[4] / pt[4] for pt, q in zip(pts, moved.collective_points)}
    assert all(abs(r - 1) > 1e-6 for r in ratios.values())
    assert [q[4] / pt[4] for pt, q in zip(pts, moved.collective_points)] == pytest.approx(
        [ratios["inter"]] * 2 + [ratios["intra"]] * 2)  # one factor per tier and kind


def test_ranks_with_varying_kernels_wait_for_the_slowest_at_each_collective():
    """Kernel A takes 1 s or 3 s, each rank drawing its own: the all-reduce starts when both
    ranks are done, after max(A0, A1), whose mean is 2.5 s (3 s unless both draw 1 s), not A's
    mean of 2 s; one rank alone has nothing to wait for."""
    from dataclasses import replace

    from hidup.planning.costs import kernel_key
    from simulator.montecarlo import expected_step
    prog = program(A, AR, Wait(-1, 1))
    varying = replace(profile(), kernels={kernel_key(A): 2.0},
                      kernel_quantiles={kernel_key(A): [1.0, 3.0]})
    assert simulate(prog, varying).step_time == pytest.approx(2.0 + T_AR)
    mean = expected_step(prog, varying, samples=4000).step_time
    assert mean == pytest.approx(2.5 + T_AR, abs=0.05)
    alone = program(A, world=1)
    assert expected_step(alone, varying).step_time == pytest.approx(2.0)
    # the spread survives a round trip through the profile file
    assert from_dict(json.loads(varying.to_json())).kernel_quantiles == varying.kernel_quantiles


def test_a_gpu_host_issues_every_task_and_a_kernel_waits_to_be_issued():
    from dataclasses import replace

    from hidup.planning.estimate import estimate
    from simulator.records import HOST
    from simulator.trace import chrome_trace

    tiny = [compute(f"t{i}", 1e6, outputs=[f"t{i}"]) for i in range(10)]  # 1 us + 1 us overhead
    host = replace(profile(), host={"graph": 1e-4, "cuda-graphs": 0.0})
    fast = simulate(program(*tiny), host, mode="cuda-graphs")
    assert fast.step_time == pytest.approx(10 * 2e-6, rel=1e-9)  # the streams' pace
    slow = simulate(program(*tiny), host)  # graph mode: 100 us to issue each
    assert slow.step_time == pytest.approx(10 * 1e-4 + 2e-6, rel=1e-9)  # the host's pace
    assert slow.computation == pytest.approx(10 * 2e-6, rel=1e-9)  # host time is not compute
    assert [r.stream for r in slow.records[0]].count(HOST) == 10
    tracks = {e["args"]["name"] for e in chrome_trace(slow)["traceEvents"]
              if e["name"] == "thread_name"}
    assert "host (issues the tasks)" in tracks
    # a Wait blocks the stream, not the host: C is issued during the all-reduce and runs after A
    prog = program(A, AR, C, Wait(-1, 1), B)
    r = simulate(prog, host)
    assert r.step_time == pytest.approx(1e-4 + T_A + T_AR + T_A, rel=1e-9)
    for p in (prog, program(*tiny), program(A, AR, Wait(-1, 1), B, C)):
        assert estimate(p, host).step_time == pytest.approx(simulate(p, host).step_time, rel=1e-9)
    assert simulate(prog, profile()).step_time == pytest.approx(T_A + T_AR + T_A, rel=1e-12)
    with pytest.raises(ProfileError, match="not 'compile'"):
        simulate(prog, host, mode="compile")
    doc = json.loads(host.to_json())
    assert from_dict(doc).host == {"graph": 1e-4, "cuda-graphs": 0.0}
    with pytest.raises(ProfileError, match="executor modes"):
        from_dict(dict(doc, host={"fast": 1e-5}))


# -- collectives in flight at once (gloo's two threads) -----------------------------------------

def lanes_profile(lanes: int, pairs=None) -> Profile:
    from dataclasses import replace
    return replace(profile(), comm_lanes=lanes, pair_points=pairs)


TWO = (A, AR, all_reduce("x", 10**9), Wait(-1, 1), Wait(-1, 2))


def test_two_lanes_share_the_rank_fairly_where_no_pair_was_measured():
    # both start at T_A and share the rank, latency and transfer: no sooner done than one after
    # the other
    r = simulate(program(*TWO), lanes_profile(2))
    assert r.step_time == pytest.approx(T_A + 2 * T_AR, rel=1e-12)
    comm = [x for x in r.records[0] if x.stream == r.comm_stream]
    assert sorted(x.lane for x in comm) == [0, 1]
    assert all(x.start == pytest.approx(T_A, rel=1e-12) for x in comm)


def test_a_measured_pair_ratio_sets_how_fast_two_run_at_once():
    # two all-reduces in flight took 0.6 of one after the other: each runs at 1 / (2 x 0.6)
    pairs = [["intra", "all_reduce", 2, 2**20, 0.6], ["intra", "all_reduce", 2, 2**30, 0.6]]
    r = simulate(program(*TWO), lanes_profile(2, pairs))
    assert r.step_time == pytest.approx(T_A + 2 * 0.6 * T_AR, rel=1e-12)


def test_a_third_collective_waits_for_a_free_lane_in_program_order():
    pairs = [["intra", "all_reduce", 2, 2**20, 0.5]]  # the link fits two at full speed
    three = (A, AR, all_reduce("x", 10**9), all_reduce("y", 10**9), Wait(-1, 1), Wait(-1, 2),
             Wait(-1, 3))
    r = simulate(program(*three), lanes_profile(2, pairs))
    assert r.step_time == pytest.approx(T_A + 2 * T_AR, rel=1e-12)
    third = next(x for x in r.records[0] if x.task.id == 3)
    assert third.start == pytest.approx(T_A + T_AR, rel=1e-12) and third.lane == 0
    # one lane: one after the other, as before
    assert simulate(program(*three), lanes_profile(1, pairs)).step_time == \
        pytest.approx(T_A + 3 * T_AR, rel=1e-12)


def test_link_demand_interpolates_the_pairs_in_log_size_and_bounds_noise():
    pairs = [["inter", "all_gather", 2, 2**20, 0.9], ["inter", "all_gather", 2, 2**23, 0.6],
             ["inter", "all_to_all", 2, 2**20, 0.3]]
    p = Profile("t", "test", 1e12, 1e12, 0.0, {k: LinkCost(0.0, 1e9) for k in COLLECTIVES}, 1,
                {k: LinkCost(0.0, 1e9) for k in COLLECTIVES}, comm_lanes=2, pair_points=pairs)
    crossing = (0, 1)  # one rank on each of two machines
    assert p.link_demand("all_gather", 2**10, crossing) == pytest.approx(0.9)
    assert p.link_demand("all_gather", 2**20 * 8**0.5, crossing) == pytest.approx(0.75)
    assert p.link_demand("all_gather", 2**30, crossing) == pytest.approx(0.6)
    assert p.link_demand("all_to_all", 2**20, crossing) == 0.5  # below 0.5 is noise
    assert p.link_demand("all_reduce", 2**20, crossing) == 1.0  # not measured: fair sharing
    back = from_dict(json.loads(p.to_json()))
    assert (back.comm_lanes, back.pair_points) == (2, pairs)
    assert "comm_lanes" not in profile().to_dict()  # one lane: the default, not written
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ProfileError, match=r"comm_lanes must be a whole number >= 1"):
            from_dict(dict(p.to_dict(), comm_lanes=bad))
    with pytest.raises(ProfileError, match=r"pair_points holds .*ratio\]"):
        from_dict(dict(p.to_dict(), pair_points=[["inter", "all_gather", 2, 2**20]]))
