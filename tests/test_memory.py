"""Peak memory of a Program: exact bytes of a hand-built step, parameter shards of real plans."""
from __future__ import annotations

import math

import pytest

from hidup.graph.placement import Partial, R, Shard
from hidup.models import capture_model, get_model
from hidup.planning.memory import peak_memory
from hidup.strategy import data_parallel, megatron
from hidup.program import Compute, Convert, Program, Wait, lower


def _fwd(i, node, op, inputs, in_shapes, out_shape, output):
    return Compute(id=i, node=node, op=op, phase="fwd", mb=0, flops=0.0, bytes=0.0,
                   in_shapes=in_shapes, out_shape=out_shape, inputs=inputs, outputs=(output,))


def _bwd(i, node, op, inputs, in_shapes, out_shape, outputs):
    return Compute(id=i, node=node, op=op, phase="bwd", mb=0, flops=0.0, bytes=0.0,
                   in_shapes=in_shapes, out_shape=out_shape, inputs=inputs, outputs=outputs)


def _convert(i, kind, tensor, src, dst, phase, mb, shape, inputs, outputs):
    return Convert(id=i, kind=kind, tensor=tensor, src=src, dst=dst, phase=phase, mb=mb,
                   shape=shape, bytes=0, group=(0, 1), inputs=inputs, outputs=outputs)


def two_op_program() -> Program:
    """x (rows split over 2 ranks) all-gathered, lin = x @ w (w: 4x8, replicated), loss = sum."""
    tasks = (
        _convert(0, "all_gather", "x", Shard(0), R, "fwd", 0, (1, 4), ("x@S(0)/0",), ("x@R/0",)),
        Wait(id=1, collective=0),
        _fwd(2, "lin", "aten.mm.default", ("x@R/0", "p_w@R/*"), ((2, 4), (4, 8)), (2, 8),
             "lin@R/0"),
        _fwd(3, "loss", "aten.sum.default", ("lin@R/0",), ((2, 8),), (), "loss@R/0"),
        _bwd(4, "loss", "hidup.ones", (), (), (), ("dloss@R/0",)),
        _bwd(5, "loss", "aten.sum.default", ("dloss@R/0", "lin@R/0"), ((2, 8),), (),
             ("dlin@R/0",)),
        _bwd(6, "lin", "aten.mm.default", ("dlin@R/0", "x@R/0", "p_w@R/*"), ((2, 4), (4, 8)),
             (2, 8), ("", "dp_w@R/*")),
        _convert(7, "all_reduce", "p_w", Partial(), R, "bwd", None, (4, 8), ("dp_w@R/*",),
                 ("grad:p_w",)),
        Wait(id=8, collective=7),
        Compute(id=9, node="", op="optimizer.step", phase="update", mb=None, flops=0.0, bytes=0.0,
                in_shapes=(), out_shape=(), inputs=("grad:p_w",), outputs=()),
    )
    return Program(model="two-op", fingerprint="", strategy="hand", world=2, k=1, tasks=tasks,
                   loss_keys=("loss@R/0",), param_grads={"p_w": "grad:p_w"}, optimizer="sgd")


def test_two_op_program_peak_is_pinned():
    # Elements (x 4 bytes). Whole step: w 32 (params), x@S(0) 4 (inputs) = 36.
    # #0 gather x@R 8 -> 44; #2 lin 16 -> 60; #3 loss 1 -> 61 (activations 25: the most)
    # #4 dloss 1 -> 62; #5 dlin 16 -> 78, dloss freed -> 77 (lin is kept for lin's backward)
    # #6 dp_w 32 -> 109 = the peak; then dlin, x@R and lin are freed -> 69
    # #7 grad:p_w 32 -> 101 (gradients 64: the most), dp_w freed -> 69; #9 update frees grad:p_w
    report = peak_memory(two_op_program())
    assert (report.params, report.inputs, report.optimizer) == (128, 16, 0)
    assert (report.grads_peak, report.activations_peak) == (256, 100)
    assert (report.peak, report.peak_task_id) == (109 * 4, 6)
    assert str(report).startswith("peak 0.00 MiB at #6: params 0.00 MiB")


def test_optimizer_state_given_per_parameter_element():
    report = peak_memory(two_op_program(), optimizer_bytes_per_param=8)
    assert report.optimizer == 32 * 8  # Adam's two fp32 moments per parameter element
    assert report.peak == 109 * 4 + 32 * 8


def test_empty_program():
    prog = Program("none", "", "hand", 1, 1, (), (), {})
    report = peak_memory(prog)
    assert (report.peak, report.peak_task_id) == (0, None)


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt:tiny", gpus=2)
    return capture_model(spec, spec.batch)


def local_param_bytes(graph, strategy, world) -> int:
    """Each parameter's whole size, divided by the world where its home placement splits it."""
    return sum(4 * n.out.numel // (world if isinstance(strategy.home(n.name), Shard) else 1)
               for n in graph.params)


@pytest.mark.parametrize("make", [data_parallel, megatron])
def test_params_are_the_local_shards(gpt, make):
    strategy = make(gpt, 2)
    report = peak_memory(lower(gpt, strategy, 2, k=2))
    assert report.params == local_param_bytes(gpt, strategy, 2)
    assert report.peak > report.params + report.activations_peak


def test_megatron_holds_about_half_the_weights(gpt):
    ddp = peak_memory(lower(gpt, data_parallel(gpt, 2), 2, k=1))
    mega = peak_memory(lower(gpt, megatron(gpt, 2), 2, k=1))
    whole = 4 * sum(n.out.numel for n in gpt.params)
    assert ddp.params == whole == 120576
    # 14 vectors of 32 floats (LayerNorm weights and biases, row-parallel biases) stay whole
    assert mega.params == 120576 // 2 + 14 * 128 // 2 == 61184
    assert mega.params < 0.55 * ddp.params


def test_duplex_keeps_every_micro_batch_activations(gpt):
    """Every micro-batch's forward runs before any backward, so at the switch all k micro-batches'
    activations are live: k = 2 holds about as much as k = 1, not half of it (a little less:
    what is not kept for the backward, such as the logits the loss reads, is half the size)."""
    one, two = (peak_memory(lower(gpt, data_parallel(gpt, 2), 2, k=k)) for k in (1, 2))
    assert 0.9 * one.activations_peak <= two.activations_peak <= one.activations_peak + 64
    assert math.isclose(two.peak, one.peak, rel_tol=0.05)


def test_the_backward_holds_only_what_each_derivative_reads(gpt):
    """A linear's derivative reads its input and weight, an add's nothing, a gelu's its input,
    fused attention's its inputs and output (hidup.graph.saved, on fake CPU tensors); autograd
    also keeps tensors of the op's own: layer norm's mean and rstd, attention's log-sum-exp, the
    loss's log-softmax of its logits. A view holds no memory of its own. Holding every input and
    output instead holds more."""
    from dataclasses import replace

    from hidup.graph.saved import backward_reads, backward_saves
    from hidup.planning.memory import is_view
    reads = {n.op: backward_reads(gpt, n) for n in gpt.ops}
    own = {n.op: backward_saves(gpt, n).own for n in gpt.ops}
    logits = next(n for n in gpt.ops if n.op == "aten.cross_entropy_loss.default").inputs[0]
    assert own["aten.cross_entropy_loss.default"] == gpt.node(logits).out.nbytes + 4
    attention = next(n for n in gpt.ops if n.op == "aten.scaled_dot_product_attention.default")
    assert own[attention.op] == attention.out.numel // attention.out.shape[-1] * 4  # (B, H, S)
    norm = next(n for n in gpt.ops if n.op == "aten.layer_norm.default")
    assert own[norm.op] == norm.out.numel // norm.out.shape[-1] * 8  # float32 mean and rstd
    assert own["aten.linear.default"] == 0
    assert reads["aten.linear.default"] == (True, True, False, False)
    assert reads["aten.add.Tensor"] == (False, False, False)
    assert reads["aten.gelu.default"] == (True, False)
    assert reads["aten.scaled_dot_product_attention.default"] == (True,) * 4
    assert is_view("aten.transpose.int") and not is_view("aten.reshape.default")
    program = lower(gpt, data_parallel(gpt, 2), 2, k=1)
    everything = replace(program, tasks=tuple(
        replace(t, reads=None) if isinstance(t, Compute) else t for t in program.tasks))
    held, all_kept = peak_memory(program), peak_memory(everything)
    assert held.activations_peak == 332841 < all_kept.activations_peak == 352776


def test_a_collective_holds_what_it_sends_until_its_wait():
    """A reduce-scatter along dim 1 packs a copy of its input (moved to dim 0), which its work
    holds until the Wait: 32 elements live through the compute in between, though the
    input's last use is the conversion."""
    tasks = (
        _fwd(0, "g", "aten.mul.Tensor", ("x@R/0",), ((4, 8),), (4, 8), "g@P(sum)/0"),
        _convert(1, "reduce_scatter", "g", Partial(), Shard(1), "fwd", 0, (4, 8),
                 ("g@P(sum)/0",), ("g@S(1)/0",)),
        _fwd(2, "h", "aten.mul.Tensor", ("x@R/0",), ((4, 8),), (4, 16), "h@R/0"),
        Wait(id=3, collective=1),
        _fwd(4, "loss", "aten.sum.default", ("g@S(1)/0", "h@R/0"), ((4, 4), (4, 16)), (),
             "loss@R/0"),
    )
    program = Program(model="rs", fingerprint="", strategy="hand", world=2, k=1, tasks=tasks,
                      loss_keys=("loss@R/0",), param_grads={}, optimizer="sgd")
    report = peak_memory(program)
    # at #2: g's packed copy 32 + g@S(1) 16 + h 64 (g itself freed after #1)
    assert (report.activations_peak, report.peak_task_id) == ((32 + 16 + 64) * 4, 2)


def test_a_join_of_the_micro_batches_of_an_input_counts_every_part():
    """An op with one option for the whole batch (replicated) reads a batch input's two
    micro-batches joined (mb_gather): each part is an input no task writes, 4 x 6 elements,
    and the join 8 x 6, live with them at the op (the join of y@R/1 was not counted)."""
    tasks = (
        _convert(0, "mb_gather", "y", R, R, "fwd", None, (4, 6), ("y@R/0", "y@R/1"),
                 ("y@R/*~R",)),
        _fwd(1, "twice", "aten.mul.Tensor", ("y@R/*~R",), ((8, 6),), (8, 6), "twice@R/*"),
        _fwd(2, "loss", "aten.sum.default", ("twice@R/*",), ((8, 6),), (), "loss@R/*"),
    )
    program = Program(model="join", fingerprint="", strategy="hand", world=1, k=2, tasks=tasks,
                      loss_keys=("loss@R/*",), param_grads={}, optimizer="sgd")
    report = peak_memory(program)
    assert report.inputs == 2 * 4 * 6 * 4
    assert (report.activations_peak, report.peak_task_id) == ((48 + 48) * 4, 1)


def test_what_an_op_keeps_and_holds_while_it_runs(gpt):
    """A product with a constant keeps only the constant; the loss's backward holds the
    gradient of its log-softmax (the logits' size) while it makes the logits'."""
    import torch

    from hidup.graph.capture import capture
    from hidup.graph.saved import backward_saves

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8, 8))
            self.register_buffer("scale", torch.full((8,), 2.0))

        def forward(self, x):
            return ((x @ self.w) * self.scale).sum()

    graph = capture(Scaled(), (torch.ones(4, 8),))
    mul = next(n for n in graph.ops if n.op == "aten.mul.Tensor")
    assert backward_saves(graph, mul).reads == (False, True, False)
    loss = next(n for n in gpt.ops if n.op == "aten.cross_entropy_loss.default")
    logits = gpt.node(loss.inputs[0]).out.nbytes
    assert backward_saves(gpt, loss).scratch == (0, logits)
