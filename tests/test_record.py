"""hidup.runtime.record against eager: what it records runs to the same values, with what the
step's passes read (each node's fake value and its task mark), and nothing only the recording
needed (detaches, device queries)."""
from __future__ import annotations

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from hidup.runtime.record import record


def _step(w, x, lr):
    """A little training step: a constant made inside, a detach, a tuple-returning op, autograd,
    an in-place update of an input, and marks."""
    with fx_traceback.annotate({"task": 1}):
        w_ = w.detach().requires_grad_()
        a, b = torch.split(x * torch.tensor([1.0, -2.0, 0.5]), [1, 2], dim=1)
        loss = (torch.cat([a.exp(), b], dim=1) @ w_).square().mean()
    with fx_traceback.annotate({"task": 2}):
        (grad,) = torch.autograd.grad(loss, [w_])
        w.sub_(lr * grad)
    return [loss.detach(), grad]


def test_a_recorded_step_runs_as_eager_and_keeps_its_marks():
    gen = torch.Generator().manual_seed(0)
    w, x, lr = torch.randn(3, 4, generator=gen), torch.randn(5, 3, generator=gen), \
        torch.tensor(0.1)
    gm = record(_step, w, x, lr)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.detach.default not in ops and torch.ops.prim.device.default not in ops
    assert torch.ops.aten.sub_.Tensor in ops and torch.ops.aten.split_with_sizes.default in ops
    marks = {n.meta["custom"]["task"] for n in gm.graph.nodes if n.op == "call_function"}
    assert marks == {1, 2}
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in gm.graph.nodes
               if n.op != "output" and n.target is not torch.ops.aten.split_with_sizes.default)
    w_eager, w_graph = w.clone(), w.clone()
    expected = _step(w_eager, x, lr)
    got = gm(w_graph, x, lr)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert torch.equal(w_eager, w_graph)  # the in-place update is in the graph
    # the same ATen ops as make_fx records (whose detaches the step's passes dropped)
    with fx_traceback.preserve_node_meta():
        reference = make_fx(_step, tracing_mode="fake")(w.clone(), x, lr)
    assert [t for t in (n.target for n in reference.graph.nodes if n.op == "call_function")
            if t is not torch.ops.aten.detach.default] == ops


def test_the_benchmark_prints_both_tools_on_the_same_graph(capsys):
    """experiments.record_time: a row per model, both tools' medians and their ratio, and the
    two graphs of the same size (it refuses to print a row otherwise)."""
    from experiments import record_time

    assert record_time.main(["--models", "mlp:tiny", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| model | graph nodes | make_fx (s) |")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[0] == "mlp:tiny" and int(cells[1]) > 0
    # the seconds printed to 2 decimals, the ratio of the unrounded ones
    fx, mine, ratio = (float(c) for c in cells[2:5])
    assert (fx - 0.005) / (mine + 0.005) <= ratio <= (fx + 0.005) / max(mine - 0.005, 1e-9)
    with pytest.raises(SystemExit):
        record_time.main(["--models", "nope"])
    assert "unknown model 'nope'" in capsys.readouterr().err
