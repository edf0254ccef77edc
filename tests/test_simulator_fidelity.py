"""Simulator fidelity: link tiers and ring / tree formulas, interference both ways, identical
ranks simulated once with the same result as simulating them all."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hidup.models import capture_model, get_model
from hidup.strategy import data_parallel, megatron
from conftest import turned as turn
from hidup.program import COLLECTIVES, Wait, lower
from simulator import LinkCost, Profile, load_profile, simulate
from test_simulator import A, AR, B, C, program


def two_tier(**kw) -> Profile:
    intra = {k: LinkCost(1e-6, 100e9) for k in COLLECTIVES}
    inter = {k: LinkCost(10e-6, 1e9) for k in COLLECTIVES}
    return Profile("two-tier", "test", 1e12, 1e12, 0.0, intra, 2, inter,
                   kw.get("compute", 1.0), kw.get("comm", 1.0))


def test_group_inside_a_machine_uses_the_fast_tier_and_a_spanning_one_the_slow_tier():
    p = two_tier()
    # all-gather on 2 ranks of one machine: 1 step + 1/2 of 1e9 bytes at 100 GB/s
    assert p.collective_time("all_gather", 1e9, (0, 1)) == pytest.approx(1e-6 + 0.005, rel=1e-12)
    # on 4 ranks over 2 machines: 3 steps + 3/4 of 1e9 bytes at 1 GB/s
    assert p.collective_time("all_gather", 1e9, (0, 1, 2, 3)) == pytest.approx(30e-6 + 0.75,
                                                                                rel=1e-12)


def test_all_reduce_takes_the_cheaper_of_ring_and_tree():
    p = two_tier()
    ring = lambda n, b: 2 * (n - 1) * 10e-6 + 2 * (n - 1) / n * b / 1e9  # noqa: E731
    tree = lambda n, b: 2 * (n - 1).bit_length() * 10e-6 + 2 * b / 1e9  # noqa: E731
    # 4 ranks, 1 GB: the ring moves 3/2 of the tensor against the tree's 2
    assert p.collective_time("all_reduce", 1e9, (0, 1, 2, 3)) == pytest.approx(ring(4, 1e9))
    # 1024 ranks: 2046 ring steps against 20 tree steps
    group = tuple(range(1024))
    assert p.collective_time("all_reduce", 1e3, group) == pytest.approx(tree(1024, 1e3))
    assert tree(1024, 1e3) < ring(1024, 1e3)
    assert p.collective_time("all_reduce", 1e9, (0,)) == 0.0


def test_interference_slows_both_streams_while_they_overlap():
    """A (1 s), then the all-reduce (1 s alone) beside C (0.5 s alone), then B (1 s).
    Together, kernels run at 1/2 speed and collectives at 1/1.5: C ends at 1 + 0.5 * 2 = 2.0,
    when the all-reduce has done 1.0 / 1.5 of its 1.0 s; alone again it ends at 2 + 1/3;
    B ends at 3 + 1/3."""
    p = Profile("i", "test", 1e12, 1e12, 0.0, {k: LinkCost(0.0, 1e9) for k in COLLECTIVES}, 4,
                None, 2.0, 1.5)
    r = simulate(program(A, AR, C, Wait(-1, 1), B), p)
    ar = next(rec for rec in r.records[0] if rec.task.id == 1)
    assert (ar.start, ar.end) == (pytest.approx(1.0), pytest.approx(2 + 1 / 3))
    assert r.step_time == pytest.approx(3 + 1 / 3, rel=1e-12)
    assert r.computation == pytest.approx(1 + 1.0 + 1, rel=1e-12)  # C took 1.0 s, slowed


def test_a_collectives_latency_is_slowed_by_its_own_factor_beside_a_kernel():
    """The same program, the all-reduce 0.1 s of latency (2 steps of 0.05 s) and 1 s of
    transfer, beside C (0.5 s). Busy cores delay small messages' round trips more than large
    transfers: with a latency factor of 3 (kernels and transfers not slowed) its latency takes
    0.3 s while C runs, so it ends 0.2 s later; without one it takes the communication
    factor (1.0 here)."""
    link = {k: LinkCost(0.05, 1e9) for k in COLLECTIVES}
    base = Profile("i", "test", 1e12, 1e12, 0.0, link, 4, None, 1.0, 1.0)
    steps = program(A, AR, C, Wait(-1, 1), B)

    def all_reduce_end(p: Profile) -> float:
        return next(r.end for r in simulate(steps, p).records[0] if r.task.id == 1)

    assert all_reduce_end(base) == pytest.approx(1 + 0.1 + 1, rel=1e-12)
    assert all_reduce_end(replace(base, interference_latency=3.0)) == \
        pytest.approx(1 + 0.3 + 1, rel=1e-12)
    assert replace(base, interference_comm=1.5).latency_slowdown == 1.5  # none: the comm factor
    # after C (ends at 1.5) the latency runs at full speed again: 0.5 s of it, 3x slower while
    # C runs (0.5 s of wall time covers 1/6 s of it), the rest (1/3 s) alone
    long = {k: LinkCost(0.25, 1e9) for k in COLLECTIVES}
    slow = replace(base, collectives=long, interference_latency=3.0)
    assert all_reduce_end(slow) == pytest.approx(1 + 0.5 + 1 / 3 + 1, rel=1e-12)


def test_profile_keeps_its_latency_factor_and_refuses_unknown_ones(tmp_path):
    from hidup.planning.costs import ProfileError
    from hidup.planning.profile_file import from_dict, load_profile

    doc = load_profile("cpu-gloo-loopback").to_dict()
    assert "latency" not in doc["interference"]  # a profile measured before it: left out
    doc["interference"]["latency"] = 2.5
    assert from_dict(doc).interference_latency == 2.5 == from_dict(doc).latency_slowdown
    assert from_dict(doc).to_dict()["interference"]["latency"] == 2.5
    doc["interference"]["tail"] = 1.0
    with pytest.raises(ProfileError, match=r"optionally with \"latency\""):
        from_dict(doc)
    doc["interference"] = {"compute": 1.0, "communication": 1.0, "latency": 0.5}
    with pytest.raises(ProfileError, match="each must be >= 1.0"):
        from_dict(doc)


@pytest.mark.parametrize("strategy", [data_parallel, megatron])
@pytest.mark.parametrize("k", [1, 2])
def test_identical_ranks_once_equals_all_ranks(strategy, k):
    spec = get_model("gpt:tiny", gpus=4)
    graph = capture_model(spec, spec.batch)
    prog = lower(graph, strategy(graph, 4), 4, k)
    for profile in (load_profile("v100-1x4-nvlink"), two_tier(compute=1.3, comm=1.2)):
        one, every = simulate(prog, profile), simulate(prog, profile, all_ranks=True)
        assert len(one.records) == 1 and len(every.records) == 4
        for field in ("step_time", "computation", "communication", "overlap_ratio"):
            assert getattr(one, field) == pytest.approx(getattr(every, field), rel=1e-12)


@pytest.mark.parametrize("name,turned", [("dp-megatron", False), ("dp-megatron", True),
                                          ("fsdp+tp", False)])
def test_symmetric_ranks_once_equal_every_rank(tiny_graphs, name, turned):
    """On a 2-D mesh (4 machines of 2 GPUs) the rows', columns' and world's groups are alike:
    rank 0 alone, its transfers loading each link as all its collective's groups do, gives the
    step that simulating all 8 ranks gives, on one lane and on two (transfers beside each other),
    with the links shared or not, and with measured pair demands."""
    from hidup.strategy import Mesh, fixed_strategy
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy(name, graph, 8, Mesh.grid(4, 2))
    strategy = turn(strategy) if turned else strategy
    base = replace(load_profile("v100-8x8-10gbps"), gpus_per_node=2)
    pairs = replace(base, pair_points=(("inter", "all_reduce", 2, 1e3, 1.6),
                                       ("inter", "all_reduce", 2, 1e8, 1.9)))
    for k in (1, 2):
        program = lower(graph, strategy, 8, k)
        assert any(len(c.parts) > 1 for c in program.collectives)
        for profile in (base, replace(base, comm_lanes=2), two_tier(compute=1.3, comm=1.2),
                        pairs):
            one, every = simulate(program, profile), simulate(program, profile, all_ranks=True)
            assert len(one.records) == 1 and len(every.records) == 8
            for field in ("step_time", "computation", "communication", "overlap_ratio"):
                assert getattr(one, field) == pytest.approx(getattr(every, field), rel=1e-9)


def test_ranks_that_are_not_alike_are_all_simulated():
    """Groups of unequal size, or some crossing machines and some not, are not symmetric."""
    from simulator.engine import _copies
    from hidup.graph.placement import R
    from hidup.program.tasks import Convert
    profile = replace(load_profile("v100-8x8-10gbps"), gpus_per_node=2)

    def task(parts):
        return Convert(0, "all_reduce", "x", R, R, "fwd", None, (4,), 4096, parts[0], ("x",),
                       ("y",), groups=parts)
    assert _copies((task(((0, 2), (1, 3))),), profile) is not None  # columns: alike
    assert _copies((task(((0, 1, 2), (3,))),), profile) is None  # sizes differ
    assert _copies((task(((0, 1), (2, 4), (3, 5))),), profile) is None  # in one machine or across


def test_duplex_trace_alternates_micro_batches_between_the_streams():
    """As in the executor's real trace: one micro-batch's collective runs while the other computes."""
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    r = simulate(lower(graph, megatron(graph, 2), 2, 2), load_profile("v100-1x4-nvlink"))
    comm = [x for x in r.records[0] if x.stream == r.comm_stream and x.task.mb is not None]
    compute = [x for x in r.records[0] if x.stream != r.comm_stream and x.task.mb is not None]
    assert {x.task.mb for x in comm} == {0, 1}
    switches = sum(a.task.mb != b.task.mb for a, b in zip(comm, comm[1:]))
    assert switches >= len(comm) // 2  # the comm stream alternates between the micro-batches
    hidden = [(c, k) for c in comm for k in compute
              if k.task.mb != c.task.mb and k.start < c.end and c.start < k.end]
    assert {c.task.mb for c, _ in hidden} == {0, 1}


def test_monte_carlo_interval():
    from simulator.montecarlo import step_time_interval
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    prog = lower(graph, megatron(graph, 2), 2, 2)
    profile = load_profile("v100-1x4-nvlink")
    exact = simulate(prog, profile).step_time
    still = step_time_interval(prog, profile, samples=5, sigma=0.0)
    assert still.low == still.high == pytest.approx(exact, rel=1e-12)
    noisy = step_time_interval(prog, profile, samples=60, sigma=0.2, seed=1)
    assert noisy.low < exact < noisy.high and noisy.low < noisy.mean < noisy.high
    with pytest.raises(ValueError, match=r"samples >= 2 \(got 1\)"):
        step_time_interval(prog, profile, samples=1)


def test_rendezvous_waits_for_the_slowest_rank():
    """Rank 1 computes 1.5x slower: the all-reduce starts when rank 1 has finished A (1.5 s), so
    rank 0 waits 0.5 s at the rendezvous; then each rank finishes B at its own speed."""
    p = Profile("r", "test", 1e12, 1e12, 0.0, {k: LinkCost(0.0, 1e9) for k in COLLECTIVES}, 4)
    r = simulate(program(A, AR, Wait(-1, 1), B), p, slow_ranks={1: 1.5})
    ar = [next(rec for rec in rank if rec.task.id == 1) for rank in r.records]
    assert [(x.start, x.end) for x in ar] == [(pytest.approx(1.5), pytest.approx(2.5))] * 2
    assert r.step_time == pytest.approx(2.5 + 1.5, rel=1e-12)  # rank 1's B takes 1.5 s
    assert simulate(program(A, AR, Wait(-1, 1), B), p).step_time == pytest.approx(3.0)


# -- sub-groups sharing the inter-node links ---------------------------------------------------
def _split(groups):
    """A (1 s), the all-reduce of 1e9 bytes in `groups` of 4 ranks on 2 machines of 2, B (1 s)."""
    from dataclasses import replace as rep
    ar = rep(AR, group=groups[0], groups=groups)
    return rep(program(A, ar, Wait(-1, 1), B), world=4)


def _links() -> Profile:
    """Inter-node links of 1 GB/s without latency; NVLink-like 100 GB/s inside a machine."""
    intra = {k: LinkCost(0.0, 100e9) for k in COLLECTIVES}
    inter = {k: LinkCost(0.0, 1e9) for k in COLLECTIVES}
    return Profile("links", "test", 1e12, 1e12, 0.0, intra, 2, inter)


def _all_reduce_spans(result):
    return [[(r.start, r.end) for r in rank if r.task.id == 1][0] for rank in result.records]


def test_groups_crossing_the_same_links_share_them():
    """Pairs {0,2} and {1,3} each cross both machines' links: alone, a 2-rank ring all-reduce of
    1e9 bytes moves 2(n-1)/n x 1e9 = 1e9 bytes at 1 GB/s = 1 s; together each gets half: 2 s."""
    r = simulate(_split(((0, 2), (1, 3))), _links(), all_ranks=True)
    assert len(r.records) == 4
    assert _all_reduce_spans(r) == [(pytest.approx(1.0), pytest.approx(3.0))] * 4
    assert r.step_time == pytest.approx(4.0, rel=1e-12)
    one = simulate(_split(((0, 2), (1, 3))), _links())  # alike pairs: rank 0 stands for all
    assert len(one.records) == 1 and one.step_time == pytest.approx(4.0, rel=1e-12)
    # pairs inside a machine ({0,1}, {2,3}) use NVLink and share nothing: 1e9 / 100e9 = 0.01 s
    inside = simulate(_split(((0, 1), (2, 3))), _links(), all_ranks=True)
    assert _all_reduce_spans(inside) == [(pytest.approx(1.0), pytest.approx(1.01))] * 4
    # {0,2} alone on the links (ranks 1 and 3 in groups of one, which move nothing): 1 s
    alone = simulate(_split(((0, 2), (1,), (3,))), _links())
    assert _all_reduce_spans(alone)[0] == (pytest.approx(1.0), pytest.approx(2.0))


def test_link_share_is_re_timed_when_a_group_starts_and_ends():
    """Ranks 1 and 3 compute A 1.5x slower, so pair {1,3} starts at 1.5 s while {0,2} has run
    alone since 1.0 s: {0,2} moves 0.5 s of its 1 s alone, the other 0.5 s at half speed (1 s)
    and ends at 2.5; {1,3} moved 0.5 of its 1 s by then and ends alone at 3.0."""
    r = simulate(_split(((0, 2), (1, 3))), _links(), slow_ranks={1: 1.5, 3: 1.5})
    spans = _all_reduce_spans(r)
    assert spans[0] == spans[2] == (pytest.approx(1.0), pytest.approx(2.5))
    assert spans[1] == spans[3] == (pytest.approx(1.5), pytest.approx(3.0))
    assert r.step_time == pytest.approx(3.0 + 1.5, rel=1e-12)  # rank 1's B takes 1.5 s


def test_groups_that_do_not_split_the_world_are_refused():
    from simulator.records import SimulationError
    with pytest.raises(SimulationError, match=r"do not split the 4 ranks"):
        simulate(_split(((0, 2), (1, 2))), _links())
