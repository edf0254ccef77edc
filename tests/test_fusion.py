"""The compiled step's fused kernels in the cost model (hidup.planning.fusion): hand-built Programs
with times pinned to hand-computed values, and a lowered model's estimate against the simulator."""
from dataclasses import replace

import pytest

from hidup.graph.placement import P, R
from hidup.planning.costs import kernel_key
from hidup.planning.estimate import estimate
from hidup.planning.fusion import fused_groups, kernel_times
from hidup.program import COLLECTIVES, Compute, Convert, Program, Wait
from simulator import LinkCost, Profile, simulate

OVERHEAD, BANDWIDTH, N = 1e-6, 1e9, 1000  # a tensor: N float32 elements, 4000 bytes


def profile() -> Profile:
    costs = {kind: LinkCost(1e-5, 1e9) for kind in COLLECTIVES}
    return Profile("test", "hand-made", 1e12, BANDWIDTH, OVERHEAD, costs, 4)


def pointwise(src: str, dst: str, op: str = "aten.mul.Tensor") -> Compute:
    """A forward reading one N-element tensor and writing one: 8000 bytes, as lowered."""
    return Compute(-1, dst, op, "fwd", 0, float(N), 8.0 * N, ((N,),), (N,), (src,), (dst,))


def program(*tasks) -> Program:
    numbered = tuple(type(t)(**{**t.__dict__, "id": i}) for i, t in enumerate(tasks))
    return Program("hand", "0", "hand", 2, 1, numbered, (), {})


def kernel(nbytes: float) -> float:
    return OVERHEAD + nbytes / BANDWIDTH


def test_a_chain_of_generated_ops_is_one_kernel_that_skips_its_intermediates():
    # x -> mul -> m -> add -> a -> mm: the mul and add fuse; m never goes through memory
    mm = Compute(-1, "y", "aten.mm.default", "fwd", 0, 2e6, 8.0 * N, ((N,),), (N,), ("a",), ("y",))
    p = program(pointwise("x", "m"), pointwise("m", "a", "aten.add.Tensor"), mm)
    graph, compiled = kernel_times(p, profile()), kernel_times(p, profile(), "compile")
    assert graph[0] == graph[1] == pytest.approx(kernel(8.0 * N))
    assert compiled[0] == 0.0  # the group's time is charged to its last task
    assert compiled[1] == pytest.approx(kernel(4.0 * N + 4.0 * N))  # reads x, writes a (for mm)
    assert compiled[2] == graph[2]  # a library op keeps its own kernel
    assert [[t.id for t in g] for g in fused_groups(p, profile())] == [[0, 1]]


def test_a_value_read_again_later_or_by_nothing_is_written():
    # m is read inside the group and again by a later mm: written once; a (read by nothing, as a
    # gradient is) is written too
    mm = Compute(-1, "y", "aten.mm.default", "fwd", 0, 2e6, 8.0 * N, ((N,),), (N,), ("m",), ("y",))
    p = program(pointwise("x", "m"), pointwise("m", "a"), mm)
    assert kernel_times(p, profile(), "compile")[1] == pytest.approx(kernel(3 * 4.0 * N))


def test_communication_and_unrelated_ops_end_a_group():
    gather = Convert(-1, "all_reduce", "m", P, R, "fwd", 0, (N,), 4 * N, (0, 1), ("m",), ("m@R",))
    p = program(pointwise("x", "m"), gather, pointwise("x", "b"), Wait(-1, 1),
                pointwise("m@R", "c"), pointwise("z", "d"))
    assert fused_groups(p, profile()) == []  # each run holds tasks that share no value
    times = kernel_times(p, profile(), "compile")
    assert times == kernel_times(p, profile())
    # two ops reading the same input fuse (a horizontal fusion): x read once, m and b written
    q = program(pointwise("x", "m"), pointwise("x", "b"))
    assert kernel_times(q, profile(), "compile")[1] == pytest.approx(kernel(3 * 4.0 * N))


def test_a_backward_reads_the_gradient_and_the_inputs_and_writes_the_input_gradients():
    fwd = pointwise("x", "m")
    bwd = Compute(-1, "m", "aten.mul.Tensor", "bwd", 0, 2.0 * N, 12.0 * N, ((N,),), (N,),
                  ("dm", "x"), ("dx",))
    relu_bwd = Compute(-1, "x", "aten.relu.default", "bwd", 0, 2.0 * N, 12.0 * N, ((N,),), (N,),
                       ("dx", "w"), ("dw",))
    p = program(fwd, bwd, relu_bwd)
    # the two backwards fuse: read dm, x, w; dx stays inside; dw is written. The forward shares
    # x with them, so it joins the group too and m (read by nothing) is written
    assert [[t.id for t in g] for g in fused_groups(p, profile())] == [[0, 1, 2]]
    assert kernel_times(p, profile(), "compile")[2] == pytest.approx(kernel(5 * 4.0 * N))


def test_a_measured_kernel_keeps_its_time_and_is_not_fused():
    p = program(pointwise("x", "m"), pointwise("m", "a"))
    measured = replace(profile(), kernels={kernel_key(p.tasks[1]): 3e-3})
    assert fused_groups(p, measured) == []
    assert kernel_times(p, measured, "compile")[1] == 3e-3


@pytest.mark.parametrize("k", [1, 2])
def test_a_lowered_model_compiled_is_estimated_as_simulated_and_faster(k):
    from hidup.models import capture_model, get_model
    from hidup.planning.profile_file import load_profile
    from hidup.program import lower
    from hidup.strategy import fixed_strategy

    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    prog = lower(graph, fixed_strategy("ddp", graph, 2), 2, k, spec.name)
    gpu = load_profile("v100-1x4-nvlink")
    compiled = estimate(prog, gpu, "compile")
    assert compiled.step_time == pytest.approx(simulate(prog, gpu, mode="compile").step_time,
                                               rel=1e-9)
    graph_kernels = sum(kernel_times(prog, gpu).values())
    compiled_kernels = sum(kernel_times(prog, gpu, "compile").values())
    assert compiled_kernels < 0.9 * graph_kernels
    groups = fused_groups(prog, gpu)
    assert groups and all(len(g) > 1 for g in groups)
    position = {t.id: i for i, t in enumerate(prog.tasks)}
    for group in groups:  # no communication call inside a group's span
        span = prog.tasks[position[group[0].id]:position[group[-1].id] + 1]
        assert not any(isinstance(t, Wait) or (isinstance(t, Convert) and t.collective)
                       for t in span)
