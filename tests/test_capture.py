"""Capture: every node carries shape, dtype, FLOPs and bytes; failures name the node and op."""
from __future__ import annotations

import pytest
import torch

from hidup.graph.capture import CaptureError, capture


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
