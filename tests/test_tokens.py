"""Per-token regions (hidup.graph.tokens): a router that sorts rows and puts them back is one node
that runs on any part of the rows; a sort that really mixes rows is left as it was."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from hidup.graph.capture import capture
from hidup.graph.ops import node_options
from hidup.graph.tokens import TOKENS
from hidup.program import lower
from hidup.runtime.execute import Executor
from hidup.strategy import fixed_strategy, microbatch_split


class SortedRouter(torch.nn.Module):
    """Not a library's router, one written here: each row goes to one of 4 experts (by its top
    score), rows sorted by expert, each expert's rows through its own weight, put back in order."""

    def __init__(self, experts: int = 4, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(dim, experts)
        self.weight = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        expert = self.gate(rows).argmax(-1)
        order = torch.argsort(expert, stable=True)
        picked = rows[order]
        out = torch.einsum("nd,nde->ne", picked, self.weight[expert[order]])
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0])
        return (out[back].tanh() * rows).sum()


class SortedAcrossRows(torch.nn.Module):
    """A sort whose result depends on every row: the rows' running sum in sorted order."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        key = (x * self.w).sum(-1)
        order = torch.argsort(key)
        return (x[order].cumsum(0) * self.w).sum()


def test_a_router_is_one_node_that_splits_with_the_rows():
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    graph = capture(SortedRouter(), (x,))
    regions = [n for n in graph.ops if n.op == TOKENS]
    assert len(regions) == 1 and not [n for n in graph.ops if "sort" in n.op]
    [node] = regions
    assert [str(o) for o in node_options(graph, node)][:2] == ["(R, R, R) -> R",
                                                               "(S(0), S(0), R) -> S(0)"]
    split = microbatch_split(graph, 2)  # no join: each micro-batch runs the region on its rows
    assert split.notes == () and str(split.options[node.name]) == "(S(0), S(0), R) -> S(0)"
    assert str(fixed_strategy("ddp", graph, 2).options[node.name]) == "(S(0), S(0), R) -> S(0)"


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_router_trains_as_eager_on_each_micro_batch(k):
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    model = SortedRouter()
    eager = copy.deepcopy(model)
    loss = eager(x)
    loss.backward()
    graph = capture(model, (x,))
    strategy = fixed_strategy("ddp", graph, 1)
    ex = Executor(graph, strategy, lower(graph, strategy, 1, k), dict(model.named_parameters()))
    got = ex.step({"x": x}, update=False)
    assert float(got) == pytest.approx(float(loss), rel=1e-5)
    grads = {graph.node(p).source: ex.full(p, g) for p, g in ex.grads.items()}
    assert set(grads) == {"weight"}  # the gate gets none: an argmax
    assert torch.allclose(grads["weight"], eager.weight.grad, atol=1e-5)


def test_a_sort_that_mixes_rows_stays_as_it_was():
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    graph = capture(SortedAcrossRows(), (x,))
    assert not [n for n in graph.ops if n.op == TOKENS]
    assert any("sort" in n.op for n in graph.ops)
    assert microbatch_split(graph, 2).notes  # the micro-batches join before it


def test_what_a_region_keeps_is_its_rows_share():
    """What a router region keeps for its backward is made of the rows it computes: under data
    parallelism a rank's share of them, however large the weights it reads whole (measured at
    the captured shapes, it is scaled by the rows' share, not by all its inputs')."""
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    graph = capture(SortedRouter(experts=4, dim=8), (x,))
    [node] = [n for n in graph.ops if n.op == TOKENS]
    region = node.args[0]
    halves = [(s[0] // 2, *s[1:]) if r else s for s, r in zip(region.shapes, region.rowwise)]
    assert region.share(halves) == 0.5 and region.share(region.shapes) == 1.0
    from hidup.program.lowering import Lowering
    lowering = Lowering(graph, fixed_strategy("ddp", graph, 2), 2, 1, "router")
    weights = sum(math.prod(s) for s, r in zip(region.shapes, region.rowwise) if not r)
    rows = sum(math.prod(s) for s, r in zip(region.shapes, region.rowwise) if r)
    assert weights > 0 and lowering.local_share(node, 1000, halves) == 500  # not
    assert 1000 * (weights + rows / 2) // (weights + rows) > 500  # what all inputs would give


def test_a_router_built_on_the_meta_device_is_found():
    """A `transformers` Mixtral built under torch.device("meta") (a full-size model planned with
    no weights) counts its experts' rows with a histogram of integer expert ids, as on a GPU,
    and makes its index tensors with device=meta: the check runs the region on the CPU all the
    same (the histogram on a float copy, factories where the rows are), so each layer's router
    is one node, as on a model built on the CPU."""
    transformers = pytest.importorskip("transformers")
    from experiments.third_party import WithLoss

    config = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, use_cache=False)
    with torch.device("meta"):
        model = WithLoss(transformers.MixtralForCausalLM(config), ("input_ids", "labels"))
    ids = torch.zeros(3, 16, dtype=torch.long, device="meta")  # 96 (token, expert) pairs:
    #   no weight dim (128, the fused gate and up projection's, would not be scaled)
    graph = capture(model, (ids, ids))
    assert len([n for n in graph.ops if n.op == TOKENS]) == 2
    assert not [n for n in graph.ops if "sort" in n.op or "histc" in n.op]


def test_the_checks_grouped_matmul_is_the_ops_and_gives_no_weight_an_unasked_gradient():
    """The check runs a grouped matmul expert by expert (hidup.graph.tokens._grouped_rows): the
    op's values, also for a broadcast probe weight (one number per expert), and no gradient
    made for a weight that does not ask for one (the op's own backward makes the whole weight's:
    gigabytes of zeros for a full-size model's experts)."""
    from hidup.graph.flops import GROUPED_MM
    from hidup.graph.tokens import _grouped_rows

    class Node:
        op = GROUPED_MM[0]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=gen, requires_grad=True)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # expert 1 has no rows; rows 8, 9 none
    for weight in (torch.randn(3, 6, 5, generator=gen),
                   torch.randn(3, 1, 1, generator=gen).expand(3, 6, 5)):
        want = torch.zeros(10, 5)
        for e, (a, b) in enumerate(([0, 3], [3, 3], [3, 8])):
            want[a:b] = x[a:b] @ weight[e].contiguous()
        got = _grouped_rows(Node(), [x, weight, offs], {})
        assert torch.allclose(got, want, atol=1e-6)
        [grad] = torch.autograd.grad(got.sum(), [x])
        assert torch.allclose(grad, torch.autograd.grad(want.sum(), [x])[0], atol=1e-6)
    assert weight.grad is None
