"""Sharding rules: option counts pinned per op, options checked in words, errors named."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hidup.graph import dtensor, ops
from hidup.graph.capture import CaptureError, capture
from hidup.graph.placement import parse_option


class Fn(torch.nn.Module):
    def __init__(self, fn, n_params=0, shapes=()):
        super().__init__()
        self.fn = fn
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in shapes)

    def forward(self, *xs):
        return self.fn(*xs, *self.ps)


def node_options(fn, *inputs, shapes=(), op=None):
    """Capture fn(*inputs, *params) and return the options (as strings) of its first `op` node."""
    graph = capture(Fn(fn, shapes=shapes), inputs)
    node = next(n for n in graph.ops if op is None or n.op == op)
    return [str(o) for o in ops.options(node, node.in_metas(graph))]


def test_linear_options_from_einsum():
    opts = node_options(lambda x, w, b: F.linear(x, w, b).sum(), torch.randn(4, 8),
                        shapes=[(6, 8), (6,)], op="aten.linear.default")
    assert opts == ["(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(S(1), S(1), R) -> P(sum)",
                    "(R, S(0), S(0)) -> S(1)"]


def test_batched_matmul_options():
    opts = node_options(lambda a, b: (a @ b).sum(), torch.randn(2, 3, 4), torch.randn(2, 4, 5),
                        op="aten.matmul.default")
    assert len(opts) == 5  # R, batch, rows, columns, contraction
    assert "(S(2), S(1)) -> P(sum)" in opts and "(S(0), S(0)) -> S(0)" in opts


def test_broadcast_matmul_keeps_size_one_dim_whole():
    opts = node_options(lambda a, b: (a @ b).sum(), torch.randn(3, 4, 5), torch.randn(1, 5, 2),
                        op="aten.matmul.default")
    assert "(S(0), R) -> S(0)" in opts


def test_elementwise_broadcast_and_partial():
    opts = node_options(lambda a, b: (a + b).sum(), torch.randn(4, 6), torch.randn(6),
                        op="aten.add.Tensor")
    assert opts == ["(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), S(0)) -> S(1)",
                    "(P(sum), P(sum)) -> P(sum)"]


def test_softmax_never_splits_its_dim():
    opts = node_options(lambda a: a.softmax(-1).sum(), torch.randn(4, 6, 8), op="aten.softmax.int")
    assert opts == ["(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"]


def test_layer_norm_leading_dims_only():
    opts = node_options(lambda x, w, b: F.layer_norm(x, (8,), w, b).sum(), torch.randn(2, 4, 8),
                        shapes=[(8,), (8,)], op="aten.layer_norm.default")
    assert opts == ["(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(S(1), R, R) -> S(1)"]


def test_view_maps_leading_dim_of_merged_group():
    opts = node_options(lambda x: x.reshape(8, 8).sum(), torch.randn(2, 4, 8),
                        op="aten.reshape.default")
    assert opts == ["(R) -> R", "(P(sum)) -> P(sum)", "(S(0)) -> S(0)", "(S(2)) -> S(1)"]


def test_transpose_and_mean():
    assert node_options(lambda x: x.transpose(0, 1).sum(), torch.randn(2, 3),
                        op="aten.transpose.int")[2:] == ["(S(0)) -> S(1)", "(S(1)) -> S(0)"]
    assert node_options(lambda x: x.mean(dim=1).sum(), torch.randn(2, 3),
                        op="aten.mean.dim")[2:] == ["(S(0)) -> S(0)", "(S(1)) -> P(sum)"]


def test_embedding_and_cross_entropy():
    opts = node_options(lambda i, w: F.embedding(i, w).sum(), torch.randint(0, 10, (2, 3)),
                        shapes=[(10, 4)], op="aten.embedding.default")
    assert opts == ["(R, R) -> R", "(R, S(0)) -> S(0)", "(R, S(1)) -> S(1)",
                    "(S(1), R) -> S(2)", "(S(0), R) -> P(sum)"]
    opts = node_options(lambda x, t: F.cross_entropy(x, t), torch.randn(4, 5),
                        torch.randint(0, 5, (4,)), op="aten.cross_entropy_loss.default")
    assert opts == ["(R, R) -> R", "(S(0), S(0)) -> P(sum)", "(S(1), R) -> P(sum)"]
    opts = node_options(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), torch.randn(4, 5),
                        torch.randint(0, 5, (4,)), op="aten.cross_entropy_loss.default")
    assert opts == ["(R, R) -> R", "(S(0), S(0)) -> P(sum)"]  # no split of the classes


@torch.library.custom_op("hidup_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _twice_shape(x):
    return torch.empty_like(x)


def test_options_come_from_the_overlay_then_dtensor_then_replication():
    """flip has no overlay rule: DTensor's strategy splits any dim but the flipped one; an op
    nobody covers (a user's custom op) runs replicated and is named as such."""
    graph = capture(Fn(lambda x: torch.flip(x, [0]).sum() + torch.ops.hidup_test.twice(x).sum()),
                    (torch.randn(4, 6),))
    got = {n.op: (ops.source(graph, n), [str(o) for o in ops.options(n, n.in_metas(graph))])
           for n in graph.ops}
    assert got["aten.flip.default"] == ("dtensor",
                                        ["(R) -> R", "(S(1)) -> S(1)", "(P(sum)) -> P(sum)"])
    assert got["hidup_test.twice.default"] == ("replicated", ["(R) -> R"])
    assert got["aten.sum.default"][0] == "overlay"
    assert [n.op for n in ops.replicated_ops(graph)] == ["hidup_test.twice.default"]


def test_dtensor_adapter_refuses_an_untested_torch_in_one_line():
    with pytest.raises(dtensor.UnsupportedTorchError,
                       match=r"torch 2\.9\.1\+cu126 is installed, but HiDup reads DTensor's "
                             r"sharding strategies only on torch 2\.11 / 2\.13; install"):
        dtensor.check_torch("2.9.1+cu126")
    dtensor.check_torch("2.13.0+cpu")
    dtensor.check_torch("2.11.0+cu130")


def test_in_place_ops_are_captured_as_their_functional_twins():
    """x.add_(1) then a use of x: the use reads the new value; no in-place op is left."""
    def f(x):
        y = x * 2
        y.add_(1)
        return (y * y).sum()

    graph = capture(Fn(f), (torch.randn(3),))
    assert [n.op for n in graph.ops] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.mul.Tensor",
                                         "aten.sum.default"]
    add = graph.ops[1]
    assert graph.ops[2].inputs == (add.name, add.name)


class ShiftAndFill(torch.nn.Module):
    """The two in-place patterns of `transformers` that write into views: labels shifted right
    into a slice of a new tensor (encoder-decoders' shift_tokens_right) and a buffer filled
    piecewise through slices; and a buffer counted up through a view of it."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, ids, labels):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[:, 0] = 3
        h = self.emb(shifted)
        buf = h.new_empty(h.shape[0], h.shape[1], 16)
        buf[..., :8].copy_(h)
        part = buf[..., 8:].copy_(h * 2)  # what copy_ returns: the view, written
        self.seen[:1].add_(1)
        out = self.lin(buf[..., :8] + buf[..., 8:] * part)
        return F.cross_entropy(out.reshape(-1, 10), labels.reshape(-1))


def test_in_place_writes_into_views_are_captured_functional_and_train_as_eager():
    """Each write into a view becomes its value scattered back into the viewed tensor
    (slice_scatter, select_scatter), which later readers read; no in-place op is left, the
    buffer's new value is written back (Graph.updates), and a step equals eager's."""
    from hidup.program import lower
    from hidup.runtime.execute import Executor
    from hidup.strategy import fixed_strategy

    torch.manual_seed(0)
    model = ShiftAndFill()
    ids, labels = torch.randint(0, 10, (4, 6)), torch.randint(0, 10, (4, 6))
    graph = capture(model, (ids, labels))
    ops_ = [n.op for n in graph.ops]
    assert ops_.count("aten.slice_scatter.default") == 4 and \
        ops_.count("aten.select_scatter.default") == 1
    assert not any(op.split(".")[1].endswith("_") for op in ops_)  # nothing in place
    assert [u[0] for u in graph.updates] == ["b_seen"]
    # new_empty, fill and the batch's scatters have options; the buffer's 3 counts stay whole
    assert [graph.node(n.inputs[0]).kind for n in ops.replicated_ops(graph)] == ["buffer"]
    eager = copy.deepcopy(model)
    loss = eager(ids, labels)
    loss.backward()
    for world, k in ((1, 1), (1, 2)):
        mine = copy.deepcopy(model)
        strategy = fixed_strategy("ddp", graph, world)
        ex = Executor(graph, strategy, lower(graph, strategy, world, k),
                      dict(mine.named_parameters()), buffers=dict(mine.named_buffers()))
        got = ex.step({"ids": ids, "labels": labels}, update=False)
        assert float(got) == pytest.approx(float(loss), rel=1e-6)
        for p, g in ex.grads.items():
            want = dict(eager.named_parameters())[graph.node(p).source].grad
            assert torch.allclose(ex.full(p, g).reshape(want.shape), want, atol=1e-6), p
        assert mine.seen.tolist() == [1.0, 0.0, 0.0]  # written back, as eager's


def test_a_view_read_after_a_write_through_another_is_refused_in_one_line():
    """A view taken before a write into its tensor and read after it aliases what the write
    changed, which no functional graph keeps: refused, naming the view."""
    def f(x):
        y = x * 1
        head = y[:2]
        y[2:].mul_(2)
        y[:1].add_(1)
        return head.sum() * y.sum()

    with pytest.raises(CaptureError, match=r"writes into a view of mul that slice_1 \(aten.slice"
                                           r".Tensor\), a view made before the write, is read "
                                           r"after; take that view after the write"):
        capture(Fn(f), (torch.randn(4),))


def test_ops_on_tensor_lists_and_where_with_a_number_split():
    """stack takes DTensor's strategies for a list given each placement alike (DTensor's own
    answer follows the list's first tensor); where with a Python number for a branch, which
    DTensor cannot decompose, is element-wise by the overlay."""
    x = torch.randn(4, 3)
    stack = node_options(lambda a, b: torch.stack([a, b], dim=1).sum(), x, x,
                         op="aten.stack.default")
    assert stack == ["(R, R) -> R", "(P(sum), P(sum)) -> P(sum)", "(S(0), S(0)) -> S(0)",
                     "(S(1), S(1)) -> S(2)"]
    where = node_options(lambda a: torch.where(a > 0, a, 0.0).sum(), x,
                         op="aten.where.ScalarOther")
    assert where == ["(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)"]


def test_option_text_round_trips():
    assert str(parse_option("(S(0), R, P(sum)) -> S(1)")) == "(S(0), R, P(sum)) -> S(1)"
    assert str(parse_option("(P, R) -> P")) == "(P(sum), R) -> P(sum)"  # plans saved before
    with pytest.raises(ValueError, match="not of the form"):
        parse_option("S(0) R")


def test_gating_ops():
    assert node_options(lambda x: torch.topk(x, 2, dim=-1).values.sum(), torch.randn(2, 6, 4),
                        op="aten.topk.default") == ["(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"]
    assert node_options(lambda x: torch.cumsum(x, dim=1).sum(), torch.randn(2, 6, 4),
                        op="aten.cumsum.default") == ["(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)"]
    assert node_options(lambda i: F.one_hot(i, 5).sum(), torch.randint(0, 5, (2, 6)),
                        op="aten.one_hot.default") == ["(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"]


def test_expert_einsum_and_patch_convolution():
    opts = node_options(lambda w, x: torch.einsum("edh,becd->bech", w, x).sum(),
                        torch.randn(4, 8, 16), torch.randn(2, 4, 3, 8), op="aten.einsum.default")
    assert "(S(0), S(1)) -> S(1)" in opts  # experts split: expert parallel
    assert len(opts) == 6  # R, e, d (Partial), h, b, c
    opts = node_options(lambda x, w, b: F.conv2d(x, w, b, stride=2).sum(), torch.randn(2, 3, 4, 4),
                        shapes=[(8, 3, 2, 2), (8,)], op="aten.conv2d.default")
    assert opts == ["(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(R, S(0), S(0)) -> S(1)",
                    "(S(1), S(1), R) -> P(sum)"]


def test_expand_can_produce_a_split_broadcast_dim():
    opts = node_options(lambda c: c.expand(4, -1, -1).sum(), torch.randn(1, 1, 8),
                        op="aten.expand.default")
    assert "(R) -> S(0)" in opts and "(S(2)) -> S(2)" in opts


@pytest.mark.parametrize("world", [1, 2, 4])
def test_experts_mm_over_ranks_sums_to_the_grouped_matmul(world):
    """Expert parallel grouped matmul: each rank's experts' rows (zero elsewhere), summed over
    the ranks, are every row times its expert's weight; so are the input's gradients, and each
    rank's weight gradients are its experts'. An expert with no rows is allowed."""
    from hidup.graph.ops.grouped import experts_mm

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 3, generator=gen), torch.randn(4, 3, 5, generator=gen)
    offs = torch.tensor([3, 3, 7, 10])  # expert 1 has no rows
    starts = [0, 3, 3, 7]
    want = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    grad = torch.randn(10, 5, generator=gen)
    xs = x.clone().requires_grad_(True)
    shards = [part.clone().requires_grad_(True) for part in w.chunk(world)]
    out = sum(experts_mm(xs, part, offs, r * (4 // world)) for r, part in enumerate(shards))
    out.backward(grad)
    xw, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = torch.cat([xw[s:e] @ ww[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    ref.backward(grad)
    assert torch.allclose(out, want, atol=1e-6)
    assert torch.allclose(xs.grad, xw.grad, atol=1e-6)
    assert torch.allclose(torch.cat([p.grad for p in shards]), ww.grad, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("padding", [None, 0, 5])
def test_vocabulary_parallel_embedding_over_ranks_is_the_whole_lookup(world, padding):
    """The embedding's rows split over `world` ranks: the ranks' outputs sum to the whole
    lookup, and each rank's weight gradient is its rows of the whole one's, the padding row's
    zero on the rank that holds it (a local lookup without it gave that row a gradient:
    distilbert's searched plan missed eager's by 1.2e-3)."""
    gen = torch.Generator().manual_seed(0)
    weight, idx = torch.randn(8, 3, generator=gen), torch.tensor([[0, 5, 7, 5], [2, 0, 4, 1]])
    graph = capture(Fn(lambda w, i: F.embedding(i, w, padding_idx=padding).sum()), (weight, idx))
    node = next(n for n in graph.ops if n.op == "aten.embedding.default")
    option = parse_option("(S(0), R) -> P(sum)")
    assert option in ops.node_options(graph, node)
    grad = torch.randn(2, 4, 3, generator=gen)
    pieces = [part.clone().requires_grad_(True) for part in weight.chunk(world)]
    total = 0
    for rank, piece in enumerate(pieces):
        ctx = ops.LocalContext(rank, world, ((8 // world, 3), (2, 4)), (), (), ((8, 3), (2, 4)),
                               True)
        total = total + ops.local_callable(node, option, ctx)([piece, idx])
    total.backward(grad)
    whole = weight.clone().requires_grad_(True)
    want = F.embedding(idx, whole, padding_idx=padding)
    want.backward(grad)
    assert torch.allclose(total, want)
    assert torch.allclose(torch.cat([p.grad for p in pieces]), whole.grad)


def test_embedding_rows_are_not_split_where_their_gradients_scale_by_frequency():
    graph = capture(Fn(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True).sum()),
                    (torch.randn(8, 3), torch.tensor([[0, 5, 7, 5]])))
    node = next(n for n in graph.ops if n.op == "aten.embedding.default")
    assert parse_option("(S(0), R) -> P(sum)") not in ops.node_options(graph, node)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocabulary_parallel_cross_entropy_over_ranks_is_the_whole_loss(world, reduction):
    """Cross-entropy with its classes split over `world` ranks (threads here, all-reducing
    through a barrier): the ranks' terms sum to the whole loss, ignored targets dropped from the
    mean, and each rank's gradient is its columns of the whole loss's; the Program is told of
    the two all-reduces of one float32 per row."""
    import threading

    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(6, 8, generator=gen) * 3, torch.tensor([0, 7, -100, 3, 4, 5])
    graph = capture(Fn(lambda x, t: F.cross_entropy(x, t, reduction=reduction).sum()),
                    (logits, target))  # (a model returns a scalar loss)
    node = next(n for n in graph.ops if n.op == "aten.cross_entropy_loss.default")
    option = parse_option("(S(1), R) -> P(sum)")
    assert ops.inner_collectives(node, option, ((6, 8 // world), (6,))) == \
        (("all_reduce", 24),) * 2
    assert ops.inner_collectives(node, option, ((6, 8 // world), (6,)), backward=True) == ()
    barrier, posted = threading.Barrier(world), [None] * world

    def reduce_over_threads(rank):
        def reduce(x, op):
            posted[rank] = x
            barrier.wait()
            stacked = torch.stack(posted)
            barrier.wait()
            return stacked.amax(0) if op == "max" else stacked.sum(0)
        return reduce

    pieces = [part.clone().requires_grad_(True) for part in logits.chunk(world, dim=1)]
    terms = [None] * world

    def run(rank):
        ctx = ops.LocalContext(rank, world, ((6, 8 // world), (6,)), (), (), ((6, 8), (6,)), True,
                               whole=lambda name: target, reduce=reduce_over_threads(rank))
        terms[rank] = ops.local_callable(node, option, ctx)([pieces[rank], target])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(terms)
    whole = logits.clone().requires_grad_(True)
    want = F.cross_entropy(whole, target, reduction=reduction)
    grad = torch.randn(want.shape, generator=gen)
    total.backward(grad)
    want.backward(grad)
    assert torch.allclose(total, want, atol=1e-6)
    assert torch.allclose(torch.cat([p.grad for p in pieces], dim=1), whole.grad, atol=1e-6)
