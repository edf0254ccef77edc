"""Activation checkpointing (hidup.strategy.recompute, hidup.program.recompute): the layers come
from the module path, a recomputed layer runs again right before its backward, keeps nothing from
its forward, holds less memory, costs its forward again, is chosen where a plan would not fit
otherwise, and survives a plan file. Equality with single-device training:
tests/test_equivalence.py (NAME+recompute cases) and tests/test_random_strategies.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import build_model, read_by
from torch import nn
from torch.nn import functional as F

from hidup.graph.capture import capture
from hidup.models import capture_model, get_model
from hidup.planning.estimate import estimate
from hidup.planning.memory import is_view, peak_memory
from hidup.planning.planfile import PlanError, check, load_plan, save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.ranking import DEFERRED, Ranking
from hidup.planning.search import search
from hidup.planning.select import Goal, select_plan
from hidup.program import Compute, Convert, lower
from hidup.program.recompute import dropped, nondeterministic
from hidup.runtime.execute import Executor
from hidup.runtime.step import trace_step
from hidup.strategy import (data_parallel, describe, fixed_strategy, layers, parse_recompute,
                            recomputing)


@pytest.fixture(scope="module")
def gpt():
    return capture_model(get_model("gpt:tiny", gpus=2), 8)


def test_layers_are_the_numbered_children_of_the_module_path(gpt):
    assert layers(gpt) == ["blocks.0", "blocks.1"]
    by_op = {n.name: n.layer for n in gpt.ops}
    assert by_op["linear"] == "blocks.0" and by_op["linear_6"] == "blocks.1"
    assert by_op["embedding"] == "" and by_op["cross_entropy_loss"] == ""
    assert parse_recompute("1", gpt) == {"blocks.0"} and parse_recompute("none", gpt) == set()
    assert parse_recompute("all", gpt) == {"blocks.0", "blocks.1"}
    with pytest.raises(ValueError, match=r"recompute: 3 layers, the model has 2"):
        parse_recompute("3", gpt)
    with pytest.raises(ValueError, match=r"blocks\.7 is not a layer of this model; its layers "
                                         r"are blocks\.0, blocks\.1"):
        recomputing(gpt, data_parallel(gpt, 2), {"blocks.7"})


def test_a_recomputed_layer_runs_again_right_before_its_backward(gpt):
    strategy = recomputing(gpt, data_parallel(gpt, 2), {"blocks.1"})
    program = lower(gpt, strategy, 2, 2)
    computes = [t for t in program.tasks if isinstance(t, Compute)]
    layer = {n.name for n in gpt.ops if n.layer == "blocks.1"}
    for m in (0, 1):
        again = [i for i, t in enumerate(computes) if t.phase == "recompute" and t.mb == m]
        # all 22 ops of the layer (its dropouts draw nothing: p = 0), in forward order, at once
        assert len(again) == 22 and again == list(range(again[0], again[0] + 22))
        fwd = [t.node for t in computes if t.phase == "fwd" and t.mb == m and t.node in layer]
        assert [computes[i].node for i in again] == fwd
        first_bwd = min(i for i, t in enumerate(computes) if t.phase == "bwd" and t.mb == m
                        and t.node in layer)
        assert again[-1] < first_bwd
        assert all(t.phase != "bwd" or t.node not in layer
                   for t in computes[:again[0]] if t.mb == m)
    assert "activations of 1 of 2 layers recomputed in the backward (blocks.1)" in \
        describe(gpt, strategy)


def test_random_ops_are_kept_not_recomputed():
    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(p)

        def forward(self, x):
            return x + self.drop(torch.relu(self.fc(x)))

    for p, kept in ((0.1, 1), (0.0, 0)):
        assert _random_and_recomputed(Block, p, torch.randn(4, 8), "dropout") == \
            (2 * kept, 2 * (1 - kept))


def test_attention_without_dropout_is_recomputed():
    """Attention whose call leaves dropout_p out (its default, 0: how a captured graph writes
    dropout 0) draws no random numbers: a recomputed layer runs it again; with dropout it is
    kept."""
    class Attention(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.qkv, self.p = nn.Linear(8, 24), p

        def forward(self, x):
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
            return x + F.scaled_dot_product_attention(q, k, v, dropout_p=self.p).squeeze(1)

    for p, kept in ((0.0, 0), (0.5, 1)):
        assert _random_and_recomputed(Attention, p, torch.randn(2, 4, 8),
                                      "scaled_dot_product") == (2 * kept, 2 * (1 - kept))


def _random_and_recomputed(block, p, example, op: str) -> tuple[int, int]:
    """Two `block(p)` in a row, every layer recomputed: of their two `op` nodes, how many draw
    random numbers, and how many the Program runs again in the backward."""
    graph = capture(_Loss(nn.Sequential(block(p), block(p))), (example,))
    nodes = [n for n in graph.ops if op in n.op]
    assert len(nodes) == 2
    program = lower(graph, recomputing(graph, data_parallel(graph, 1), layers(graph)), 1)
    again = {t.node for t in program.tasks if isinstance(t, Compute) and t.phase == "recompute"}
    return sum(map(nondeterministic, nodes)), len(again & {n.name for n in nodes})


class _Loss(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x).square().mean()


def traced_step(model, graph, strategy, program, xs):
    """Rank 0's step (no update) traced into an FX graph, collectives stood in."""
    ex = Executor(graph, strategy, program, dict(model.named_parameters()), rank=0,
                  local_collectives=True)
    return trace_step(ex.spec, list(ex.params.values()), ex.buffers, xs, ex.lr, False)


@pytest.mark.parametrize("how", ["whole", "selective", "none"])
def test_the_traced_backward_reads_nothing_a_recomputed_forward_made(how):
    """In the traced step, no backward task reads a value a recomputed layer's first forward
    made (nor a view of it): those are freed in the forward (selectively, but for the outputs
    it keeps: the matmuls', and attention's, which runs once and keeps what its backward reads,
    its inputs too). Without recomputation the backward reads them."""
    recompute = how != "none"
    spec = get_model("gpt:tiny", gpus=2)
    model = build_model(spec)
    xs = list(spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    graph = capture(model, xs)
    strategy = recomputing(graph, data_parallel(graph, 2), layers(graph) if recompute else (),
                           selective=how == "selective")
    program = lower(graph, strategy, 2, 2)
    kept = {t.node for t in program.tasks if isinstance(t, Compute) and t.again}
    assert (how == "selective") == bool(kept) and all("linear" in name for name in kept)
    made_again = {t.node for t in program.tasks if getattr(t, "phase", "") == "recompute"}
    once = {n.name for n in graph.ops if how == "selective" and n.layer
            and n.name not in kept | made_again and "attention" in n.op}
    assert (how == "selective") == bool(once)
    held, todo = set(once), [t for name in once for t in graph.node(name).inputs]
    while todo:  # its inputs and what they view
        name = todo.pop()
        held.add(name)
        node = graph.node(name)
        if node.kind == "op" and is_view(node.op):
            todo += node.inputs[:1]
    kept |= held
    gm = traced_step(model, graph, strategy, program, xs)
    inside = {n.name for n in graph.ops if n.layer  # read only inside its layer (a layer's
              and all(c.layer == n.layer for c in graph.consumers(n.name))}  # output is kept)
    first = {t.id for t in program.tasks if isinstance(t, Compute) and t.phase == "fwd"
             and t.node in inside - kept}
    backward = {t.id for t in program.tasks if getattr(t, "phase", "") == "bwd"
                and not isinstance(t, Convert)}
    made, read = read_by(gm, first, backward)
    assert made and bool(read) != recompute, read[:3]


def test_recomputation_holds_less_and_costs_the_forward_again(gpt):
    profile = load_profile("v100-2x4")
    plain = lower(gpt, data_parallel(gpt, 2), 2, 1)
    again = {n: lower(gpt, recomputing(gpt, data_parallel(gpt, 2), layers(gpt)[:n]), 2, 1)
             for n in (1, 2)}
    some = lower(gpt, recomputing(gpt, data_parallel(gpt, 2), layers(gpt), selective=True), 2, 1)
    # selectively: the linears' outputs kept and attention's, the rest recomputed: between none
    # and whole. Pinned: 237572 bytes with attention recomputed and the recomputations that
    # nothing reads counted; attention's output (a rank's 4 x 4 x 16 x 8 float32, its inputs
    # view the kept linear's output) adds 8192, and what those recomputations, dropped from the
    # step, wrote or kept alive no longer counts: 3 x 8192 less at the activations' peak; what
    # autograd keeps of the ops' own is live there too: both attentions' log-sum-exp (2 x 1024)
    # and two layer norms' mean and rstd (2 x 519); and the loss's all-reduce holds what it
    # sends (one float) until its Wait
    assert peak_memory(again[2]).activations_peak < peak_memory(some).activations_peak \
        == 237572 + 8192 - 3 * 8192 + 2 * 1024 + 2 * 519 + 4 \
        < peak_memory(plain).activations_peak
    assert estimate(plain, profile).step_time < estimate(some, profile).step_time \
        < estimate(again[2], profile).step_time
    peaks = [peak_memory(p).activations_peak for p in (plain, again[1], again[2])]
    # the first layer's activations are freed in the forward; the last layer's too, but it is
    # recomputed as soon as the backward starts, where the peak is: it saves little more (the
    # recomputations that nothing reads, dropped, count 2 x 8192 less)
    # (+ what autograd keeps of the ops' own live at each peak: layer norms' mean and rstd,
    # attentions' log-sum-exp, the loss's log-softmax; hidup.graph.saved; and, recomputing
    # every layer, the loss's all-reduce holding the one float it sends until its Wait)
    assert peaks == [327680 + 5161, 196608 + 3099, 163844 - 2 * 8192 + 2062 + 4]
    extra = [t for t in again[2].tasks if isinstance(t, Compute) and t.phase == "recompute"]
    times = [estimate(p, profile).step_time for p in (plain, again[2])]
    forward = sum(profile.compute_time(t) for t in extra if t.id not in dropped(again[2]))
    assert forward > 0 and times[1] - times[0] == pytest.approx(forward, rel=0.02)


def test_the_planner_recomputes_the_fewest_layers_that_make_a_plan_fit(gpt):
    profile = load_profile("v100-2x4")
    plain = select_plan(gpt, profile, Goal(2, micro_batches=1))
    assert not plain.strategy.recompute
    limit = 0.97 * min(peak_memory(lower(gpt, r.strategy, 2, 1)).peak for r in plain.ranked)
    tight = select_plan(gpt, profile, Goal(2, micro_batches=1, memory=limit))
    # the fewest first layers, whole or (keeping more, where that fits) selectively
    chosen = tight.strategy.recompute or tight.strategy.selective
    assert chosen and peak_memory(lower(gpt, tight.strategy, 2, 1)).peak <= limit
    fewer = recomputing(gpt, tight.strategy, sorted(chosen)[:-1],
                        selective=not tight.strategy.recompute)
    assert len(chosen) == 2 or peak_memory(lower(gpt, fewer, 2, 1)).peak > limit
    with pytest.raises(ValueError, match=r"no plan with 1 micro-batches lowers and fits"):
        select_plan(gpt, profile, Goal(2, micro_batches=1, memory=limit, recompute="none"))
    every = select_plan(gpt, profile, Goal(2, micro_batches=1, recompute="all"))
    assert all(s.recompute == {"blocks.0", "blocks.1"} for s in every.candidates.values())
    some = select_plan(gpt, profile, Goal(2, micro_batches=1, recompute="selective:1"))
    assert all(s.selective == {"blocks.0"} and not s.recompute
               for s in some.candidates.values())


def test_a_plan_no_faster_than_one_ranked_is_not_tried_recomputed(gpt):
    """Recomputing only adds work: a plan over the limit whose estimate without recomputation is
    no faster than a plan ranked already is not lowered again with layers recomputed."""
    profile, ddp = load_profile("v100-2x4"), fixed_strategy("ddp", gpt, 2)
    options = SearchOptions(k=1, memory=650_000)  # ddp needs 715,140 bytes
    alone = Ranking(gpt, 2, profile, options)
    assert alone.add(ddp, "ddp", float("nan"), [1]) == {1: DEFERRED}  # tried at the end
    assert not alone.ranked and len(alone.deferred) == 1
    alone.recompute_deferred()
    assert [r.name for r in alone.ranked] == ["ddp+recompute"]  # (selective does not fit)
    for faster, tried in ((0.5, False), (2.0, True)):
        ranking = Ranking(gpt, 2, profile, options)
        ranking.add(ddp, "ddp", float("nan"), [1])
        ranking.ranked.append(alone.ranked[0]._replace(
            name="other", step_time=faster * estimate(lower(gpt, ddp, 2, 1), profile).step_time))
        ranking.recompute_deferred()
        assert [r.name for r in ranking.ranked] == ["other"] + ["ddp+recompute"] * tried


def test_a_plan_file_keeps_its_recomputed_layers(gpt, tmp_path):
    strategy = recomputing(gpt, fixed_strategy("fsdp", gpt, 2), {"blocks.0"})
    save_plan(tmp_path / "plan.json", gpt, strategy, 2, "gpt:tiny")
    assert load_plan(tmp_path / "plan.json", gpt, 2).recompute == {"blocks.0"}
    some = recomputing(gpt, strategy, {"blocks.1"}, selective=True)
    save_plan(tmp_path / "some.json", gpt, some, 2, "gpt:tiny")
    loaded = load_plan(tmp_path / "some.json", gpt, 2)
    assert loaded.selective == {"blocks.1"} and not loaded.recompute
    with pytest.raises(PlanError, match=r"recompute: layers\.9 is not a layer of this model"):
        check(gpt, replace(strategy, recompute=frozenset({"layers.9"})))


def test_selective_recomputation_repeats_no_matmul():
    """The traced step of a selectively recomputed plan has as many matmuls as with nothing
    recomputed: a kept op's forward, run again for its backward, has no reader and is dropped
    (so the estimate does not price it). Recomputing whole layers repeats their matmuls, but for
    those whose output no backward reads (the MLP's last linear, read only by the residual add):
    the step drops those as the cost model does (hidup.program.recompute.dropped)."""
    spec = get_model("gpt:tiny", gpus=2)
    model = build_model(spec)
    xs = list(spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    graph = capture(model, xs)
    counts, repeated = {}, {}
    for how in ("none", "selective", "whole"):
        strategy = recomputing(graph, data_parallel(graph, 2),
                               layers(graph) if how != "none" else (),
                               selective=how == "selective")
        program = lower(graph, strategy, 2, 1)
        gm = traced_step(model, graph, strategy, program, xs)
        counts[how] = sum(n.op == "call_function" and any(
            mm in str(n.target) for mm in ("addmm", "aten.mm", "bmm")) for n in gm.graph.nodes)
        linears = [t for t in program.tasks if isinstance(t, Compute) and t.phase == "recompute"
                   and t.op == "aten.linear.default"]
        repeated[how] = sum(t.id not in dropped(program) for t in linears)
        assert how != "whole" or len(linears) > repeated[how]  # some are dropped
    assert counts["none"] == counts["selective"] < counts["whole"], counts
    assert counts["whole"] - counts["none"] == repeated["whole"] and not repeated["selective"]


def test_plans_that_fit_only_recomputed_but_do_not_give_way_to_more_plans(monkeypatch):
    """A plan over the limit whose parameters fit counts as fitting while the programme's plans
    are ranked (it is tried recomputed at the end); where none of those fits even with every
    layer recomputed, more of the programme's plans are ranked (bert-sgmoe:paper, 32 GPUs, the
    fewest bytes: its first plans need 32.6 GiB recomputed against 32)."""
    import hidup.planning.search as search_module

    passes = []
    first = search_module._rank_finals
    monkeypatch.setattr(search_module, "_rank_finals", lambda ranking, *a: (
        passes.append(ranking.deferred_fit), first(ranking, *a)))
    spec = get_model("bert-sgmoe:paper", gpus=32)
    graph = capture_model(spec, spec.batch)
    memory = 32 * 2**30
    found = search(graph, 32, load_profile("v100-8x8-10gbps"),
                   SearchOptions(k=1, memory=memory, objective="comm", optimizer="sgd"))
    assert passes == [True, False]
    assert peak_memory(lower(graph, found.strategy, 32, 1, optimizer="sgd")).peak <= memory


def _mixtral_graph():
    """Mixtral at tiny size (experiments.third_party): its router's sort joins the micro-batches,
    so its experts' half of each layer runs once per step after the join."""
    pytest.importorskip("transformers")
    from experiments.third_party import MODELS, build
    model = build("mixtral")
    return model, capture(model, MODELS["mixtral"].batch(8, torch.Generator().manual_seed(0)))


def test_a_join_of_the_micro_batches_is_recomputed_once_per_step():
    """A recomputed layer's ops after a join of the micro-batches (Mixtral's experts, behind
    the router's sort) are recomputed too, once per step (micro-batch None), right before their
    first backward, reading the join kept from the forward: with Duplex the layer holds no more
    than without it (before, those ops kept every input for their backward: 1.24x k = 1's)."""
    _, graph = _mixtral_graph()
    plain = fixed_strategy("fsdp", graph, 2)
    strategy = recomputing(graph, plain, layers(graph))
    peak = {k: peak_memory(lower(graph, strategy, 2, k)).peak for k in (1, 2)}
    assert peak[2] < peak_memory(lower(graph, plain, 2, 2)).peak
    assert peak[2] <= 1.05 * peak[1], peak
    program = lower(graph, strategy, 2, 2)
    computes = [t for t in program.tasks if isinstance(t, Compute)]
    again = [i for i, t in enumerate(computes) if t.phase == "recompute" and t.mb is None]
    experts = {n.name for n in graph.ops if n.op.startswith("transformers.grouped_mm")}
    assert experts <= {computes[i].node for i in again}
    for name in experts:  # each made again before its backward, after its forward
        fwd, rec, bwd = (next(i for i, t in enumerate(computes) if t.node == name
                              and t.phase == phase) for phase in ("fwd", "recompute", "bwd"))
        assert fwd < rec < bwd and computes[rec].mb is None


def mixtral_grads(rank, world, cases):
    """{case: (loss, whole gradients, strategy text, buffers)} after one step of Mixtral with
    every layer recomputed (whole or selectively), as test_third_party.third_party_grads."""
    from test_equivalence import one_step
    from test_third_party import batch
    out = {}
    for name, how, k in cases:
        model, graph = _mixtral_graph()
        strategy = recomputing(graph, fixed_strategy(how.split("+")[0], graph, world),
                               layers(graph), selective=how.endswith("+selective"))
        result = one_step(model, graph, strategy, world, k, name, batch(name))
        out[(name, how, k)] = result + ({n: b.clone() for n, b in model.named_buffers()},)
    return out


@pytest.mark.slow
def test_recomputed_joins_match_single_device():
    """Mixtral with every layer recomputed, its experts' half once per step after the join of the
    micro-batches, equals single-device eager training on 2 gloo ranks (loss, every gradient)."""
    from conftest import run_ranks
    from test_third_party import check, references
    cases = [("mixtral", "fsdp+recompute", 2), ("mixtral", "expert+selective", 2)]
    check(run_ranks(2, mixtral_grads, cases), references(cases), cases)
