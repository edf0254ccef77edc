"""Capture: every node carries shape, dtype, FLOPs and bytes; failures name the node and op."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hidup.graph.capture import CaptureError, capture

ROOT = Path(__file__).resolve().parents[1]


class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_nodes_carry_shapes_flops_bytes():
    graph = capture(TwoLinear(), (torch.randn(2, 8),))
    a = graph.node("linear")
    assert a.out.shape == (2, 16) and a.out.dtype == "float32"
    assert a.flops == 2 * 2 * 16 * 8
    assert a.bytes == 4 * (2 * 8 + 16 * 8 + 16 + 2 * 16)
    assert graph.node("relu").flops == 32
    assert graph.loss == "sum_1"
    assert [p.source for p in graph.params] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert str(a) == "linear = aten.linear.default(x, p_a_weight, p_a_bias) -> float32[2,16]"


def test_fingerprint_depends_on_shapes():
    m = TwoLinear()
    assert capture(m, (torch.randn(2, 8),)).fingerprint != capture(m, (torch.randn(4, 8),)).fingerprint
    assert capture(m, (torch.randn(2, 8),)).fingerprint == capture(m, (torch.randn(2, 8),)).fingerprint


class NotScalar(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_failures_name_the_node_and_op(monkeypatch):
    def broken(op, *args):
        raise ValueError("no FLOP formula")

    monkeypatch.setattr("hidup.graph.capture.forward_flops", broken)
    with pytest.raises(CaptureError, match=r"node linear \(aten.linear.default\): no FLOP formula"):
        capture(TwoLinear(), (torch.randn(2, 8),))
    monkeypatch.undo()
    with pytest.raises(CaptureError, match=r"must return a scalar loss; mul has shape \(3,\)"):
        capture(NotScalar(), (torch.randn(3),))


def test_multi_output_op_is_one_node_per_output():
    class TopK(torch.nn.Module):
        def forward(self, x):
            values, indices = torch.topk(x, 2)
            return values.sum() + indices.float().sum()

    graph = capture(TopK(), (torch.randn(3, 5),))
    items = [n for n in graph.ops if n.op == "aten.topk.default"]
    assert [(n.out_index, n.out.dtype) for n in items] == [(0, "float32"), (1, "int64")]


class _Normed(torch.nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x):
        return self.bn(self.conv(x)).square().mean()


def test_batch_norm_runs_as_its_statistics_and_writes_its_buffers():
    """A training BatchNorm becomes means over the batch (which a split batch all-reduces) and
    new running statistics and counter that the step writes back (Graph.updates)."""
    from hidup.graph.ops import node_options
    from hidup.graph.placement import Partial, Shard

    model = _Normed().train()
    graph = capture(model, (torch.randn(4, 3, 6, 6),))
    assert not any("batch_norm" in n.op for n in graph.ops)
    written = {graph.node(b).source for b, _ in graph.updates}
    assert written == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    stats = [n for n in graph.ops if n.op == "aten.mean.dim" and n.out.shape == (1, 4, 1, 1)]
    assert len(stats) == 2
    assert all(any(o.inputs == (Shard(0),) and isinstance(o.output, Partial)
                   for o in node_options(graph, n)) for n in stats)
    with pytest.raises(CaptureError):  # a momentum read from a counter: refused, not run wrong
        capture(_Normed(momentum=None).train(), (torch.randn(4, 3, 6, 6),))


class _Gathered(torch.nn.Module):
    """x[arange(b)[:, None, None], arange(s)[None, :, None], index[None, None, :]]."""

    def __init__(self, flip: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5))
        self.flip = flip

    def forward(self, x):
        b, s, n = x.shape
        index = torch.arange(n).flip(0) if self.flip else torch.arange(n)
        picked = x[torch.arange(b)[:, None, None], torch.arange(s)[None, :, None],
                   index[None, None, :]]
        return (picked * self.w[: picked.shape[-1]]).sum()


@pytest.mark.parametrize("flip", [False, True])
def test_index_by_aranges_is_a_view(flip):
    """Indexing each dim by a constant arange along it is a view (which a split batch can take of
    its own part); any other constant index stays an index. Both give eager's values."""
    from hidup.graph.ops import LocalContext, local_callable
    from hidup.graph.ops.registry import replicated

    model, x = _Gathered(flip), torch.randn(2, 3, 5)
    graph = capture(model, (x,))
    assert any(n.op == "aten.index.Tensor" for n in graph.ops) == flip
    values = {graph.user_inputs[0].name: x, graph.params[0].name: model.w.detach()}
    for node in graph.ops:  # run the graph's ops whole, as one rank would
        shapes = tuple(m.shape for m in node.in_metas(graph))
        ctx = LocalContext(0, 1, shapes, node.out.shape, node.out.shape, shapes, True)
        fn = local_callable(node, replicated(len(node.inputs)), ctx)
        values[node.name] = fn([values[t] for t in node.inputs])
    assert torch.allclose(values[graph.loss], model(x).detach())


class Blocks(torch.nn.Module):
    """A no_grad block that reads a parameter, an autocast-off block and an ordinary op: what
    torch.export writes as wrap_with_set_grad_enabled / wrap_with_autocast submodules."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("freq", torch.arange(8.0))

    def forward(self, x):
        with torch.no_grad():
            scale = torch.cos(self.freq) + self.w.sum(0)  # no gradient reaches w from here
        with torch.autocast("cpu", enabled=False):
            exact = (x.float() @ self.w).relu()
        return (exact * scale + x @ self.w).sum()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_no_grad_and_autocast_blocks_are_inlined_and_run_as_eager(dtype):
    """The blocks' ops are ops of the graph; the no_grad block passes no gradient back and the
    autocast-off block runs in float32 under a bf16 run, as in eager."""
    import hidup

    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    graph = capture(model, (x,))
    assert not any("wrap" in n.op for n in graph.ops)
    assert {n.op for n in graph.ops if n.autocast == "off"} >= {"aten.matmul.default",
                                                              "aten.relu.default"}
    assert any(n.op == "aten.detach.default" for n in graph.ops)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(x)
    loss.backward()
    trainer = hidup.parallelize(model, "ddp", optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                                device="cpu", autocast=dtype)
    got = trainer.step(x)  # lr 0: the weights stay; a step's gradients are freed once used
    assert not trainer.executor.grads
    trainer.executor.step({trainer.graph.user_inputs[0].source: x}, update=False)
    grad = next(g for g in trainer.executor.grads.values() if g is not None)
    assert torch.allclose(got, loss, rtol=1e-6), (float(got), float(loss))
    assert torch.allclose(grad.reshape(8, 8), model.w.grad, rtol=1e-5, atol=1e-6)


_AFTER_INIT = """
import gc, os, sys, torch, torch.distributed as dist
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from hidup.graph.capture import capture
class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
    def forward(self, x):
        return self.a(x).sum()
if sys.argv[2] == "capture":
    capture(TwoLinear(), (torch.randn(2, 8),))
else:  # torch.export alone, as capture calls it
    torch.export.export(TwoLinear(), (torch.randn(2, 8),))
dist.destroy_process_group()
gc.collect()
print(threads() - before)
"""


def test_capture_after_init_lets_the_process_group_go(tmp_path):
    """Captured after init_process_group (as a user under torchrun plans), the default process
    group is freed by destroy_process_group(): gloo's worker threads end there, not while the
    interpreter finalizes, where one could abort the process. torch.export alone keeps them (the
    defaults of torch.distributed.nn.functional hold the group), so this check can fail."""
    def threads_left(how: str) -> int:
        run = subprocess.run([sys.executable, "-c", _AFTER_INIT, str(tmp_path / how), how],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout.split()[-1])
    assert threads_left("capture") == 0
    assert threads_left("export") > 0  # what capture undoes is there on this torch


class _Branches(torch.nn.Module):
    """Control flow on a value: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y.sum() if y.sum() > 0 else -y.sum()


def test_an_export_failure_is_one_error_with_nothing_printed_before_it(capfd):
    """torch.export logs its guards and prints the graph it traced before it raises; capture
    keeps that off the user's stderr (the CaptureError says what failed), and passes on what
    an export that succeeds prints."""
    with pytest.raises(CaptureError, match=r"torch.export failed for _Branches: Could not guard "
                                           r"on data-dependent expression"):
        capture(_Branches(), (torch.randn(8, 4),))
    out, err = capfd.readouterr()
    assert out == "" and err == "", err
