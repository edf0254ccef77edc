"""The compiled step: collectives and waits in the Program's order (traced and through Inductor),
the same results in every mode, and clear refusals."""
from __future__ import annotations

import pytest
import torch
from conftest import build_model, read_by, run_ranks

from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.strategy import fixed_strategy
from hidup.program import Compute, Convert, Wait, lower
from hidup.runtime.execute import Executor
from hidup.runtime.passes import communication_order
from hidup.runtime.collectives import issue

FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


def program_order(program) -> list[str]:
    """The functional collectives the Program's tasks issue and wait for, in its order: its
    collectives and waits, and the all-reduces a kernel runs inside itself (Compute.inner:
    a vocabulary-parallel loss), each waited for at once (routed experts' all-to-alls run
    inside their op, hidup::experts_a2a, not as nodes of the graph)."""
    order = []
    for t in program.tasks:
        if isinstance(t, Wait):
            order.append("wait_tensor")
        elif isinstance(t, Convert) and t.collective:
            order.append(FUNCTIONAL[t.kind])
        elif isinstance(t, Compute):
            order += [x for kind, _ in t.inner if kind == "all_reduce"
                      for x in (FUNCTIONAL[kind], "wait_tensor")]
    return order


def setup(name, strategy, world, k):
    spec = get_model(name, gpus=world)
    model = build_model(spec)
    batch = spec.inputs(spec.batch, torch.Generator().manual_seed(1))
    graph = capture(model, batch)
    plan = fixed_strategy(strategy, graph, world)
    program = lower(graph, plan, world, k, name)
    return model, graph, plan, program, dict(zip([n.source for n in graph.user_inputs], batch))


def orders(rank, world, name, strategy, k, modes):
    model, graph, plan, program, inputs = setup(name, strategy, world, k)
    out = {"program": program_order(program)}
    for mode in modes:
        ex = Executor(graph, plan, program, dict(model.named_parameters()), mode=mode)
        loss = float(ex.step(inputs, update=False))
        run = ex.compiled(False, list(inputs.values()))
        out[mode] = (communication_order(run.__self__), loss,
                     {p: g.clone() for p, g in ex.grads.items()})
    return out


def collectives_in_flight(rank, world, rounds):
    """Two collectives in flight at a time as under Duplex, with computation between: first
    all-gathers only, then every kind in turn; each result checked."""
    group = torch.distributed.group.WORLD.group_name
    kinds = ("all_gather",) * rounds + ("all_gather", "all_reduce", "reduce_scatter",
                                         "all_to_all") * (rounds // 20)
    pending, bad, a = [], 0, torch.randn(64, 64)
    for i, kind in enumerate(kinds):
        rows = 8 * world * (1 + i % 6)
        x = torch.arange(rows * 33, dtype=torch.float32).view(rows, 33) + 1000 * rank + i
        pending.append((kind, x.clone(), issue(kind, x, world, group)))
        del x  # the collective holds its input
        a = torch.tanh(a @ a)
        if len(pending) == 2:
            kind, x, y = pending.pop(0)
            bad += not torch.equal(torch.ops._c10d_functional.wait_tensor(y), expected(kind, x, world))
    return bad


def expected(kind, x, world):
    """What `kind` returns on every rank, from rank r's input x + 1000 r."""
    me = torch.distributed.get_rank()
    parts = [x + 1000 * (r - me) for r in range(world)]
    total = sum(parts)
    rows = x.shape[0] // world
    return {"all_gather": torch.cat(parts), "all_reduce": total,
            "reduce_scatter": total[me * rows:(me + 1) * rows],
            "all_to_all": torch.cat([p[me * rows:(me + 1) * rows] for p in parts])}[kind]


@pytest.mark.slow
def test_collectives_in_flight_together_stay_correct():
    """Two collectives in flight on gloo, thousands of times: right results, no crash (the
    functional all_gather_into_tensor corrupted the heap here within 20,000 rounds)."""
    assert run_ranks(2, collectives_in_flight, 15_000) == [0, 0]


@pytest.mark.slow
def test_traced_step_issues_and_waits_in_the_programs_order():
    """Duplex is the graph's order: gpt:tiny tensor parallel, two micro-batches, four kinds of
    conversion, every issue and wait where the Program has it."""
    result = run_ranks(2, orders, "gpt:tiny", "megatron", 2, ("graph",))[0]
    order, _, _ = result["graph"]
    assert len(set(result["program"])) >= 3 and order == result["program"]
    # Duplex: some collective is still in flight when another one is issued
    assert any(a != "wait_tensor" and b != "wait_tensor" for a, b in zip(order, order[1:]))


@pytest.mark.slow
def test_inductor_keeps_the_programs_order_and_the_results():
    result = run_ranks(2, orders, "mlp:tiny", "megatron", 2, ("graph", "compile"))[0]
    (graph_order, graph_loss, graph_grads), (order, loss, grads) = result["graph"], result["compile"]
    assert order == graph_order == result["program"]
    assert loss == pytest.approx(graph_loss, rel=1e-5)
    for p, g in grads.items():
        assert torch.allclose(g, graph_grads[p], rtol=1e-4, atol=1e-6), p


def test_cuda_graphs_need_a_gpu_and_modes_are_checked(tiny_graphs):
    spec, model, graph = tiny_graphs["mlp:tiny"]
    plan = fixed_strategy("ddp", graph, 1)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device, this run is on cpu"):
        Executor(graph, plan, lower(graph, plan, 1, 1), dict(model.named_parameters()),
                 mode="cuda-graphs")
    with pytest.raises(ValueError, match="executor mode 'fast': choose one of"):
        Executor(graph, plan, lower(graph, plan, 1, 1), dict(model.named_parameters()),
                 mode="fast")


def test_step_updates_in_place_and_returns_the_loss_as_a_tensor(tiny_graphs):
    """SGD in the graph: one step moves each parameter by -lr * its gradient, the loss stays on
    the device (no host sync); set_lr takes effect without retracing."""
    spec, model, graph = tiny_graphs["mlp:tiny"]
    plan = fixed_strategy("ddp", graph, 1)
    program = lower(graph, plan, 1, 2)
    ex = Executor(graph, plan, program, dict(model.named_parameters()), lr=0.5)
    inputs = dict(zip([n.source for n in graph.user_inputs],
                      spec.inputs(spec.batch, torch.Generator().manual_seed(3))))
    loss = ex.step(inputs, update=False)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    before = {n: p.clone() for n, p in ex.params.items()}
    grads = {n: g.clone() for n, g in ex.grads.items()}
    ex.set_lr(0.25)
    ex.step(inputs)
    assert len(ex._steps) == 2  # the step without update and the one with
    for name, p in ex.params.items():
        assert torch.allclose(p, before[name] - 0.25 * grads[name].reshape(p.shape), atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graph", "compile", "cuda-graphs"])
def test_a_cuda_step_waits_for_nothing_on_the_host(tiny_graphs, mode):
    """After the first steps (tracing, compiling, capturing), a step never syncs with the host."""
    spec, model, graph = tiny_graphs["gpt:tiny"]
    plan = fixed_strategy("ddp", graph, 1)
    ex = Executor(graph, plan, lower(graph, plan, 1, 2), dict(model.named_parameters()),
                  device="cuda", mode=mode)
    inputs = {n.source: x.cuda() for n, x in zip(
        graph.user_inputs, spec.inputs(spec.batch, torch.Generator().manual_seed(3)))}
    for _ in range(3):
        ex.step(inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = ex.step(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_weight_resharded_after_the_forward_is_not_read_by_the_backward(reshard):
    """In the traced step of fsdp (reshard after forward), no backward task reads the weights
    the forward gathered: what autograd saved of them is rebuilt from the weights gathered
    again, so the forward's are freed after their last forward use. Kept to the backward
    (sharded storage without reshard), the backward reads them."""
    from hidup.runtime.step import trace_step
    from hidup.strategy import sharded_storage

    spec = get_model("gpt:tiny", gpus=2)
    model = build_model(spec)
    xs = list(spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    graph = capture(model, xs)
    strategy = fixed_strategy("fsdp", graph, 2) if reshard else \
        sharded_storage(graph, fixed_strategy("ddp", graph, 2), 2)
    program = lower(graph, strategy, 2, 2)
    ex = Executor(graph, strategy, program, dict(model.named_parameters()), rank=0,
                  local_collectives=True)
    gm = trace_step(ex.spec, list(ex.params.values()), ex.buffers, xs, ex.lr, False)
    fwd_gathers = {t.id for t in program.collectives if t.kind == "all_gather"
                   and t.phase == "fwd"}
    done = {t.id for t in program.tasks if isinstance(t, Wait) and t.collective in fwd_gathers}
    backward = {t.id for t in program.tasks if getattr(t, "phase", "") == "bwd"
                and not isinstance(t, Convert)}
    gathered, read = read_by(gm, done, backward)  # with what shares their storage
    assert gathered and bool(read) != reshard, read[:3]
