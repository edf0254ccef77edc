"""Models nobody here wrote (tiny `transformers` configs, experiments.third_party) plan and train
equal to single-device eager PyTorch: loss and every gradient, on gloo ranks."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import ranks_and_workers
from test_equivalence import (executor_for, local_step, mode_of, planned, recorded_first,
                              rel_err, stepped, traced_rank)

from hidup.graph import ops
from hidup.graph.capture import capture
from hidup.graph.ops.gating import exchanges
from hidup.graph.placement import R, Shard, plain_option
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.strategy import conversion, fixed_strategy, microbatch_split, random_strategy
from hidup.strategy.mesh import Mesh
from hidup.runtime.layout import mb_join, mb_part, shard_of

pytest.importorskip("transformers")
from experiments.third_party import MODELS, MORE_SPECS, build, model_spec  # noqa: E402

BATCH = 8


def batch(name: str, seed: int = 1):
    return model_spec(name).batch(BATCH, torch.Generator().manual_seed(seed))


def reference(name: str):
    model = build(name)
    loss = model(*batch(name))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.item(), grads, sum(p.grad is not None for p in model.parameters()), buffers


def strategy_of(graph, how: str, world: int, k: int):
    if how == "search":
        return search(graph, world, load_profile("v100-8x8-10gbps"), SearchOptions(k=k)).strategy
    if how == "random":  # any option of any op, DTensor's included
        return random_strategy(graph, world, random.Random(f"{graph.fingerprint}{world}"))
    return fixed_strategy(how, graph, world)


def traced(name: str, how: str, world: int, k: int) -> bool:
    """The searched plan runs traced as users run it under Duplex on 2 gloo ranks (the eight
    first families), and so does expert (its routed rows go through the process group's
    all-to-all inside hidup::experts_a2a, where the threads exchange them in memory); the rest
    untraced on threads (local_grads: the same tasks as Python; test_random_strategies holds
    the two modes to the same result bit for bit, and test_equivalence traces every fixed
    plan). Tracing is 70% of a gloo rank's time: every k = 2 plan traced took 70 s on 2 ranks,
    against 35 s for the searched one only."""
    return how in ("search", "expert") and k > 1 and name in MODELS and \
        mode_of(how, world) == "graph"


def run_cases(world: int, cases) -> tuple[list[dict], dict]:
    """Per rank {case: (loss, whole gradients, strategy text, buffers)} after one step of each
    case, and the eager references (references): the traced cases on gloo ranks
    (third_party_grads), the others on threads (local_cases) in worker processes, and the
    references here, all at once (conftest.ranks_and_workers)."""
    real = [c for c in cases if traced(*c[:2], world, c[2])]
    return ranks_and_workers(world, (third_party_grads, real),
                             (local_cases, [c for c in cases if c not in real]),
                             lambda: references(cases))


def local_cases(cases, world: int) -> list[dict]:
    """Per rank {case: (loss, whole gradients, strategy text, buffers)} after one step of each
    case, its ranks on threads of this process (local_step: untraced)."""
    out = [{} for _ in range(world)]
    for case, model, graph, strategy in planned(cases, world, strategy_of, build, _example):
        for rank, result in enumerate(local_step(model, graph, strategy, world, case[2],
                                                 case[0], batch(case[0]), buffers_out=True)):
            out[rank][case] = result
    return out


def _example(name: str):
    return batch(name, seed=0)


def third_party_grads(rank, world, cases):
    """{case: (loss, whole gradients, strategy text, buffers)} after one step of each case, traced
    on one rank (test_equivalence.traced_rank; the executor writes forward's buffer updates into
    the model's own buffers, as eager does)."""
    runs, models = [], {}
    for i, (case, model, graph, strategy) in enumerate(planned(cases, world, strategy_of, build,
                                                               _example)):
        models[case] = model
        runs.append((case, executor_for(model, graph, strategy, world, case[2], case[0],
                                        mode=traced_rank(i, rank, world, "graph")),
                     batch(case[0])))
    return {case: stepped(ex, batch) + ({n: b.clone() for n, b in models[case].named_buffers()},)
            for case, ex, batch in recorded_first(runs)}


def references(cases) -> dict:
    """reference() of each model among the cases, by name."""
    return {name: reference(name) for name in {c[0] for c in cases}}


def check(results, refs, cases):
    for case in cases:
        ref_loss, ref_grads, n_tensors, ref_buffers = refs[case[0]]
        scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
        for rank_result in results:
            loss, grads, text, buffers = rank_result[case]
            for bname, b in ref_buffers.items():  # BatchNorm's running statistics, counters
                assert rel_err(buffers[bname].double(), b.double()) <= 1e-5, (case, bname)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
            # one gradient per parameter tensor (tied weights under one of their names)
            assert set(grads) <= set(ref_grads), (case, set(grads) - set(ref_grads))
            assert len(grads) == n_tensors, (case, len(grads), n_tensors)
            for pname, g in grads.items():
                err = rel_err(g, ref_grads[pname], scale)
                assert err <= 1e-4, (case, pname, err)


# every family under ddp, megatron and the searched plan (and fsdp on 2 ranks), plain SPMD and
# Duplex (k = 2; ResNet's BatchNorm statistics join the micro-batches: test_microbatch_joins)
# (the encoder-decoders, whose label shifting writes into a view in place, on 2 ranks only)
PLANS = [(m, how, k) for m in MODELS for how in ("ddp", "megatron", "search") for k in (1, 2)]
CASES = PLANS + [(m, "random", 2) for m in MODELS] + [("mixtral", "expert", k) for k in (1, 2)] \
    + [(m, "fsdp", k) for m in MODELS for k in (1, 2)]
CASES_4 = [c for c in PLANS if c[0] not in ("bart", "t5")] + [("llama", "random", 1),
                                                             ("mixtral", "expert", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("world, cases", [(2, CASES), (4, CASES_4)])
def test_third_party_models_match_eager(world, cases):
    check(*run_cases(world, cases), cases)


# more families (experiments.third_party.MORE_SPECS: 26, with the first eight 34, encoders,
# vision transformers and three mixtures of experts among them), each under plans that
# split its ops: ddp, fsdp, megatron, the search (on v100-8x8-10gbps, as strategy_of) and,
# where it has experts, expert; each plain and with Duplex, on 2 ranks
MOE = ("qwen2_moe", "qwen3_moe", "granite_moe")
MORE = [(m, how, k) for m in MORE_SPECS for how in ("ddp", "fsdp", "megatron", "search")
        for k in (1, 2)] + [(m, "expert", k) for m in MOE for k in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("part", range(3))
def test_more_families_match_eager_under_plans_that_split(part):
    names = list(MORE_SPECS)[part::3]
    cases = [c for c in MORE if c[0] in names]
    check(*run_cases(2, cases), cases)


# routed experts on a 2 x 2 mesh: data parallel across the machines and expert inside each
# (dp-expert), and Megatron inside each machine with the experts over all 4 GPUs (tp+ep); the
# routers' rows sent to their experts' GPUs by all-to-all either way
MESH_MOE = [("mixtral", "dp-expert", 2), ("mixtral", "tp+ep", 1), ("qwen3_moe", "tp+ep", 2)]


def test_routed_experts_on_a_2x2_mesh_match_eager():
    out = [{} for _ in range(4)]
    for case in MESH_MOE:
        name, how, k = case
        model = build(name)
        graph = capture(model, _example(name))
        strategy = fixed_strategy(how, graph, 4, Mesh.grid(2, 2))
        routers = [n for n in graph.ops if n.op == "hidup.tokens"]
        assert routers and all(exchanges(n, plain_option(strategy.options[n.name]))
                               for n in routers), case
        for rank, result in enumerate(local_step(model, graph, strategy, 4, k, name,
                                                 batch(name), buffers_out=True)):
            out[rank][case] = result
    check(out, references(MESH_MOE), MESH_MOE)


def test_more_families_plans_split_their_ops():
    """The plans of the families above split ops (not a replicated run under a plan's name):
    on Qwen2-MoE, ddp, fsdp, expert and the search most ops (the batch), megatron some (the
    linears' weights), and expert the experts' weights, read by its routers' per-token
    regions."""
    graph = capture(build("qwen2_moe"), batch("qwen2_moe"))
    split = {how: strategy_of(graph, how, 2, 1).split_ops
             for how in ("ddp", "fsdp", "megatron", "expert", "search")}
    assert all(n > len(graph.ops) / 2 for how, n in split.items() if how != "megatron"), split
    assert split["megatron"] > 10, split
    expert = fixed_strategy("expert", graph, 2)
    experts = [p.name for p in graph.params if len(p.out.shape) == 3]
    assert len(experts) == 4 and all(expert.placements[p] == Shard(0) for p in experts)
    assert sum(n.op == "hidup.tokens" for n in graph.ops) == 2


def test_a_histogram_over_as_many_experts_as_rows_is_no_row_count():
    """Qwen3-MoE's routers count each expert's rows with a histogram of 128 bins, its expert
    count; the tiny batch has 128 tokens too. Its bins are a weight's dim, not a row count: each
    router is one per-token region (run on part of the rows, the histogram keeps its 128 bins),
    whose experts expert parallelism splits, each rank's rows sent to their experts' ranks."""
    graph = capture(build("qwen3_moe"), batch("qwen3_moe"))
    regions = [n for n in graph.ops if n.op == "hidup.tokens"]
    assert len(regions) == 2
    [region] = {repr(n.args[0]) for n in regions}  # the two layers' regions alike
    assert "aten.histc.default[128]" in region
    expert = fixed_strategy("expert", graph, 2)
    assert all(str(expert.options[n.name]) == "(S(0), S(0), S(0), S(0), S(0)) -> S(0)"
               for n in regions)


def test_tied_weights_train_as_one_tensor():
    """GPT-2 ties its embedding and output weights: torch.export gives each name a placeholder
    but uses one. After a step, both names hold the trained value, which eager SGD gives."""
    import hidup

    model, eager = build("gpt2"), build("gpt2")
    plan = hidup.plan(model, batch("gpt2"), cluster="cpu-gloo-loopback", gpus=1, optimizer="sgd")
    trainer = hidup.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    trainer.step(*batch("gpt2"))
    state = trainer.full_state_dict()
    eager(*batch("gpt2")).backward()
    torch.optim.SGD(eager.parameters(), lr=0.5).step()
    want = eager.model.lm_head.weight.detach()
    for name in ("model.transformer.wte.weight", "model.lm_head.weight"):
        assert torch.allclose(state[name], want, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("name, op, kind", [("resnet", "aten.sub", "all_reduce")])
def test_microbatch_joins(name, op, kind):
    """Where an op needs the whole batch at once (BatchNorm's statistics), the micro-batch split
    joins the micro-batches there (summed / concatenated), says where, and Duplex is planned:
    every other op still runs on each micro-batch. (A router's sort is inside a per-token
    region, which runs on each micro-batch: tests/test_tokens.py.)"""
    import hidup

    graph = capture(build(name), batch(name))
    split = microbatch_split(graph, 2)
    assert split.notes and op in split.notes[0], split.notes
    joins = {conversion(split.home(t), q) for node in graph.ops
             for t, q in zip(node.inputs, split.options[node.name].inputs)} - {None}
    assert kind in joins, joins
    per_mb = sum(split.home(n.name) != R for n in graph.ops)
    assert per_mb > len(graph.ops) / 3, (per_mb, len(graph.ops))
    plan = hidup.plan(build(name), batch(name), cluster="cpu-gloo-loopback", gpus=2,
                      micro_batches=2)
    assert "Duplex with 2 micro-batches" in plan.describe(), plan.describe()


def test_microbatch_parts_join_into_the_shard():
    """A micro-batch's part along a dim the ranks do not split holds a piece of every rank's
    block, so that the parts joined are the whole again, and a rank's parts of its shard are
    the same rows its micro-batches hold of the whole."""
    whole = torch.arange(48.).reshape(24, 2)
    for k, blocks in ((2, 1), (2, 3), (3, 2)):
        parts = [mb_part(whole, 0, k, m, blocks) for m in range(k)]
        assert torch.equal(mb_join(parts, 0, blocks), whole)
    world, k = 3, 2
    for rank in range(world):
        shard = [shard_of(whole, Shard(0), Shard(0), k, m, rank, world, True) for m in range(k)]
        assert torch.equal(torch.cat(shard), whole.chunk(world)[rank])
        for m in range(k):  # all-gathering the ranks' pieces of a micro-batch gives its part
            gathered = torch.cat([shard_of(whole, Shard(0), Shard(0), k, m, r, world, True)
                                  for r in range(world)])
            assert torch.equal(gathered, shard_of(whole, R, Shard(0), k, m, 0, world, True))


def test_expert_strategy_splits_grouped_matmul_experts():
    """Mixtral's experts (3-d weights read by the grouped matmuls of its router's per-token
    region) are split by the expert strategy over ranks that divide their count, each rank
    sending its tokens' rows to their experts' ranks by all-to-all (the rows stay split, as
    data parallelism splits them), and refused in one line otherwise. The search's space
    holds the other expert option too: every row on every rank, each rank computing its
    experts' rows (a Partial sum)."""
    graph = capture(build("mixtral"), batch("mixtral"))
    strategy = fixed_strategy("expert", graph, 2)
    routers = [n for n in graph.ops if n.op == "hidup.tokens"]
    assert len(routers) == 2 and all(
        str(strategy.options[n.name]) == "(S(0), S(0), S(0), S(0), S(0)) -> S(0)"
        for n in routers)
    assert "(R, R, R, S(0), S(0)) -> P(sum)" in map(str, ops.node_options(graph, routers[0]))
    with pytest.raises(ValueError, match="4 experts do not split over 8 ranks"):
        fixed_strategy("expert", graph, 8)
