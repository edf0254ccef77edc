"""hidup.graph.ops.dispatch: routed experts' rows sent to their experts' ranks by all-to-all and
back give each rank the products and gradients that the whole batch's grouped matmul gives its
rows and experts."""
import threading
from functools import partial

import pytest
import torch

from hidup.graph.ops import dispatch
from hidup.runtime.local_world import Exchange


def sorted_rows(gen, rows: int, experts: int, dim: int):
    """Rows sorted by expert (some experts with none) and offs: where each expert's rows end."""
    expert = torch.sort(torch.randint(0, experts, (rows,), generator=gen)).values
    counts = torch.bincount(expert, minlength=experts)
    counts[1] = 0  # an expert no row of this rank picks
    total = int(counts.sum())
    return torch.randn(total + 2, dim, generator=gen), counts.cumsum(0).to(torch.int32)


def grouped(x, weight, offs):
    """The whole grouped matmul: each expert's rows times its weight, zero after the last."""
    ends = [0, *offs.tolist()]
    out = x.new_zeros(x.shape[0], weight.shape[2])
    for e, (a, b) in enumerate(zip(ends, ends[1:])):
        out[a:b] = x[a:b] @ weight[e]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_rows_sent_to_their_experts_give_the_whole_grouped_matmul(world):
    gen = torch.Generator().manual_seed(world)
    experts, dim, width = 8, 6, 5
    weight = torch.randn(experts, dim, width, generator=gen)
    data = [sorted_rows(gen, 7 + 3 * r, experts, dim) for r in range(world)]
    grads = [torch.randn(x.shape[0], width, generator=gen) for x, _ in data]
    exchange, group, results, errors = Exchange(), tuple(range(world)), [None] * world, []
    local = experts // world

    def rank_main(rank):
        try:
            name = dispatch.register_group(f"test:{world}:{rank}", exchange,
                                           partial(Exchange.rows, group=group, rank=rank))
            x = data[rank][0].clone().requires_grad_()
            w = weight[rank * local:(rank + 1) * local].clone().requires_grad_()
            out = dispatch.experts_a2a(x, w, data[rank][1], name)
            out.backward(grads[rank])
            results[rank] = out.detach(), x.grad, w.grad
        except BaseException as exc:  # noqa: BLE001
            exchange.fail(exc)
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    w = weight.clone().requires_grad_()
    for rank, (x, offs) in enumerate(data):
        x = x.clone().requires_grad_()
        out = grouped(x, w, offs)
        out.backward(grads[rank])
        torch.testing.assert_close(results[rank][0], out.detach())
        torch.testing.assert_close(results[rank][1], x.grad)
        assert results[rank][0][-2:].abs().max() == 0  # rows after the last routed one
    for rank in range(world):  # each rank's experts' gradient: every rank's rows
        torch.testing.assert_close(results[rank][2], w.grad[rank * local:(rank + 1) * local])


def test_the_collectives_of_a_grouped_matmul_are_counts_rows_and_products():
    """Forward: the counts, the rows out, the products back; backward: the counts, the rows and
    their gradients out, the rows' gradients back (bytes: this rank's whole tensor)."""
    fwd = dispatch.collectives(10, 6, 5, 2, experts=8, backward=False)
    assert fwd == (("all_to_all", 64), ("all_to_all", 120), ("all_to_all", 100))
    bwd = dispatch.collectives(10, 6, 5, 2, experts=8, backward=True)
    assert bwd == (("all_to_all", 64), ("all_to_all", 120), ("all_to_all", 100),
                   ("all_to_all", 120))


def test_gradients_are_laid_out_as_the_traced_step_expects():
    """The op's real gradients have the strides its fake gives (what make_fx records a traced
    step's views with): the weight's gradient laid out as the weight, a transposed view of the
    parameter as `transformers` passes it. With a contiguous one, a data-parallel axis's bucket
    flattened the parameter's gradient by a view that the run could not take."""
    gen = torch.Generator().manual_seed(0)
    x, offs = sorted_rows(gen, 9, 4, 6)
    weight = torch.randn(4, 5, 6, generator=gen).transpose(1, 2).requires_grad_()
    out = dispatch.experts_a2a(x.requires_grad_(), weight, offs, dispatch.STAND_IN)
    grad_x, grad_w = torch.autograd.grad(out, (x, weight), torch.randn(out.shape, generator=gen))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = dispatch.experts_a2a_backward(mode.from_tensor(x), mode.from_tensor(weight),
                                             mode.from_tensor(offs), dispatch.STAND_IN,
                                             mode.from_tensor(out))
    assert grad_w.stride() == fake[1].stride() == weight.stride()
    assert grad_x.stride() == fake[0].stride()
