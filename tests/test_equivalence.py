"""Every strategy the executor runs equals single-device training: loss and every gradient after
one step, for 2 and 4 gloo ranks, data and tensor parallel, Duplex on and off."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from conftest import build_model, ranks_and_workers, run_ranks, turned

from hidup.graph.capture import capture
from hidup.graph.dtypes import run_dtypes
from hidup.graph.placement import flat, flat_option
from hidup.models import get_model
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import Search, SearchOptions
from hidup.planning.search import replicated_plan
from hidup.planning.search import search
from hidup.strategy import (Mesh, fixed_strategy, layers, random_strategy, recomputing,
                            sharded_storage)
from hidup.program import LoweringError, lower
from hidup.program.tasks import BUCKET_BYTES
from hidup.runtime.execute import Executor, full_tensor
from hidup.runtime.local_world import assemble, run_local

MODELS = ("mlp:tiny", "gpt:tiny")
CASES = [(m, s, k) for m in MODELS for s in ("ddp", "megatron") for k in (1, 2)]
CASES += [(m, "search", 2) for m in MODELS + ("bert-sgmoe:tiny",)]  # a searched plan
CASES += [("gpt:tiny", "replicated", 2)]  # the search's plan with no communication
CASES += [(m, "fsdp", k) for m in ("gpt:tiny", "bert-sgmoe:tiny") for k in (1, 2)]  # sharded
# fsdp gathering in buckets of ~4 kB (each issued as the one before it is first used, the
# backward's again in reverse), and sharded storage whose gathered weights are held to the
# backward (no reshard)
CASES += [("gpt:tiny", "fsdp-small-buckets", 2), ("bert-sgmoe:tiny", "fsdp-kept", 2)]
BUCKETS = {"fsdp-small-buckets": 4096}  # bucket_bytes by strategy name (default: DDP's)
# activation checkpointing: every layer's activations recomputed in the backward (NAME+recompute),
# with tensor parallel's collectives run again, weights gathered again (fsdp), Duplex on and off
RECOMPUTE, SELECTIVE = "+recompute", "+selective"
CASES += [("gpt:tiny", "megatron+recompute", 2), ("gpt:tiny", "fsdp+recompute", 1),
          ("bert-sgmoe:tiny", "fsdp+recompute", 2), ("bert-sgmoe:tiny", "search+recompute", 2)]
# a Llama-shaped model (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
CASES += [("llama:tiny", "megatron", 2), ("llama:tiny", "search", 2),
          ("llama:tiny", "fsdp+recompute", 2)]
# sequence parallelism: Megatron with the ops between its regions split on the sequence
# (entered by reduce-scatter, left by all-gather), and a vocabulary-parallel embedding
CASES += [("gpt:tiny", "megatron-sp", 2), ("llama:tiny", "megatron-sp", 1),
          ("bert-sgmoe:tiny", "megatron-sp", 2), ("llama:tiny", "megatron-sp+selective", 2)]
# selective recomputation: the matmuls' outputs kept, differentiated again from recomputed inputs,
# attention run once, keeping its inputs and output
CASES += [("gpt:tiny", "megatron+selective", 2), ("bert-sgmoe:tiny", "fsdp+selective", 1),
          ("llama:tiny", "search+selective", 2)]


def batch_of(spec, seed=1):
    return spec.inputs(spec.batch, torch.Generator().manual_seed(seed))


def reference(name: str, world: int):
    """Independent single-device run: plain PyTorch autograd on the nn.Module made for `world` GPUs."""
    spec = get_model(name, gpus=world)
    model = build_model(spec)
    loss = model(*batch_of(spec))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def one_d_strategy(graph, name: str, world: int, k: int):
    """A strategy over every rank: searched, every op replicated (as the search ranks it), or
    fixed by name; NAME+recompute / NAME+selective: NAME with every layer recomputed, whole or
    selectively."""
    for suffix in (RECOMPUTE, SELECTIVE):
        if name.endswith(suffix):
            return recomputing(graph, one_d_strategy(graph, name.removesuffix(suffix), world, k),
                               layers(graph), selective=suffix == SELECTIVE)
    if name.startswith("fsdp-"):
        return fixed_strategy("fsdp", graph, world) if name == "fsdp-small-buckets" else \
            sharded_storage(graph, fixed_strategy("ddp", graph, world), world)
    if name == "replicated":
        return replicated_plan(Search(graph, world, load_profile("v100-8x8-10gbps"), SearchOptions(k=k)))
    return (search(graph, world, load_profile("v100-8x8-10gbps"), SearchOptions(k=k)).strategy
            if name == "search" else fixed_strategy(name, graph, world))


def mode_of(strategy_name: str, world: int = 2) -> str:
    """The executor mode a case runs in: every fixed or searched plan as users run it, traced
    (graph), on 2 ranks (the 2 x 2 mesh's on 4); random draws, and the 1-D plans again on 4
    ranks, untraced: the Program's tasks one by one as Python, as the traced step records them
    (tests/test_random_strategies.py holds the two modes to the same result bit for bit)."""
    return "untraced" if strategy_name.startswith("random") or world > 2 else "graph"


def planned(cases, world: int, make_strategy, build, example):
    """(case, model, graph, strategy) of each case (model NAME, strategy NAME, k) whose
    `make_strategy(graph, NAME, world, k)` is not None: the model `build(NAME)` gives (the same
    weights each time: its graph, of `example(NAME)`, is captured once)."""
    graphs = {}
    for name, strategy_name, k in cases:
        model = build(name)
        if name not in graphs:
            graphs[name] = capture(model, example(name))
        strategy = make_strategy(graphs[name], strategy_name, world, k)
        if strategy is not None:
            yield (name, strategy_name, k), model, graphs[name], strategy


def zoo_planned(cases, world: int, make_strategy):
    """planned() of the zoo's models made for `world` GPUs."""
    return planned(cases, world, make_strategy,
                   lambda name: build_model(get_model(name, gpus=world)),
                   lambda name: batch_of(get_model(name, gpus=world), seed=0))


def distributed_grads(rank, world, cases, make_strategy=one_d_strategy, mesh=False):
    """{case: (loss, whole gradients, the strategy as text)} after one step of each case whose
    `make_strategy(graph, name, world, k)` is not None (in the mode `mode_of` gives it, on the
    rank `traced_rank` names; a 2-D `mesh` plan's on 2 ranks' terms)."""
    runs = []
    for i, (case, model, graph, strategy) in enumerate(zoo_planned(cases, world, make_strategy)):
        name, strategy_name, k = case
        mode = traced_rank(i, rank, world, mode_of(strategy_name, 2 if mesh else world))
        runs.append((case, executor_for(model, graph, strategy, world, k, name,
                                        BUCKETS.get(strategy_name, BUCKET_BYTES), mode),
                     batch_of(get_model(name, gpus=world))))
    return {case: stepped(ex, batch) for case, ex, batch in recorded_first(runs)}


def traced_rank(case: int, rank: int, world: int, mode: str) -> str:
    """The mode of case number `case` on `rank` in a run on gloo ranks: a traced case is traced
    on one rank, the next case's on the next rank and so on round the world, and runs untraced
    on the others. Recording a step is most of what a traced case costs (each rank records its
    own); the untraced ranks issue the same collectives in the same order (the traced graph's
    order is the Program's, as the untraced runner's is), so the run checks the recorded step of
    one rank against one device, and over the cases every rank's."""
    return mode if mode != "graph" or case % world == rank else "untraced"


def recorded_first(runs: list[tuple]) -> list[tuple]:
    """`runs` (case, executor, batch), after each traced executor has recorded its step: every
    rank records its cases before any step runs, so that the ranks record at once instead of
    waiting for each other's recordings at the step's first collective."""
    for _, ex, batch in runs:
        if ex.mode == "graph":
            ex.compiled(False, list(batch))
    return runs


def executor_for(model, graph, strategy, world: int, k: int, name: str,
                 bucket_bytes: int = BUCKET_BYTES, mode: str = "graph") -> Executor:
    program = lower(graph, strategy, world, k, name, bucket_bytes)
    return Executor(graph, strategy, program, dict(model.named_parameters(remove_duplicate=False)),
                    buffers=dict(model.named_buffers()), mode=mode)


def stepped(ex: Executor, batch) -> tuple:
    """(loss, whole gradients by parameter name, the strategy as text) after one step of the
    executor without update, on this rank."""
    loss = ex.step(dict(zip([n.source for n in ex.g.user_inputs], batch)), update=False)
    grads = {ex.g.node(p).source: ex.full(p, g) for p, g in ex.grads.items()}
    return float(loss), grads, str(ex.s)


def one_step(model, graph, strategy, world: int, k: int, name: str, batch,
             bucket_bytes: int = BUCKET_BYTES, mode: str = "graph"):
    """stepped() of a new executor of the plan."""
    return stepped(executor_for(model, graph, strategy, world, k, name, bucket_bytes, mode), batch)


def local_step(model, graph, strategy, world: int, k: int, name: str, batch,
               bucket_bytes: int = BUCKET_BYTES, buffers_out: bool = False) -> list[tuple]:
    """As one_step gives it on each of `world` ranks, the ranks run on threads of this process
    (hidup.runtime.local_world: untraced, collectives exchanged in memory): per rank (loss,
    whole gradients by parameter name, the strategy as text), and with `buffers_out` the rank's
    buffers after the step by name."""
    program = lower(graph, strategy, world, k, name, bucket_bytes)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = {**graph.constants, **dict(model.named_buffers())}
    ranks = run_local(graph, strategy, program,
                      {n.name: params[n.source].detach() for n in graph.params},
                      [buffers[n.source].detach() for n in graph.nodes if n.kind == "buffer"],
                      list(batch))
    grads = {graph.node(p).source: assemble(strategy, program, p, [r.grads[p] for r in ranks],
                                            graph.node(p).out.shape)
             for p in program.param_grads}
    names = [n.source for n in graph.nodes if n.kind == "buffer"]
    return [(float(r.loss), grads, str(strategy))
            + ((dict(zip(names, r.buffers)),) if buffers_out else ()) for r in ranks]


def local_grads(cases, world: int, make_strategy=one_d_strategy) -> list[dict]:
    """What run_ranks(world, distributed_grads, cases, make_strategy) gives, each case's step
    run by local_step: per rank, {case: (loss, whole gradients, the strategy as text)}."""
    out = [{} for _ in range(world)]
    for case, model, graph, strategy in zoo_planned(cases, world, make_strategy):
        name, strategy_name, k = case
        for rank, result in enumerate(local_step(model, graph, strategy, world, k, name,
                                                 batch_of(get_model(name, gpus=world)),
                                                 BUCKETS.get(strategy_name, BUCKET_BYTES))):
            out[rank][case] = result
    return out


def split_run(world: int, cases, make_strategy=one_d_strategy, mesh: bool = False,
              real=None) -> list:
    """Each case's step per rank: those of `real` (default: those users run traced, mode_of)
    on `world` gloo ranks, the others on threads (local_grads: untraced) in worker processes,
    at once (conftest.ranks_and_workers); merged per rank."""
    traced = [c for c in cases if (c in real if real is not None else
                                   mode_of(c[1], 2 if mesh else world) == "graph")]
    return ranks_and_workers(world, (distributed_grads, traced, make_strategy, mesh),
                             (local_grads, [c for c in cases if c not in traced],
                              make_strategy))[0]


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """Norm-wise relative error. A gradient that is zero in exact arithmetic (e.g. an attention key
    bias: softmax ignores a per-query constant) holds only rounding noise, so the denominator is
    at least `scale` (1e-3 of the model's largest gradient norm)."""
    return float((a - b).norm() / max(float(b.norm()), scale, 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_single_device(world):
    results = split_run(world, CASES)
    refs = {name: reference(name, world) for name in {case[0] for case in CASES}}
    for case in CASES:
        ref_loss, ref_grads = refs[case[0]]
        scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
        for rank_result in results:
            loss, grads, _ = rank_result[case]
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
            assert set(grads) == set(ref_grads), case
            for pname, g in grads.items():
                err = rel_err(g, ref_grads[pname], scale)
                assert err <= 1e-5, (case, pname, err)


def bf16_grads(rank, world, cases):
    """Like distributed_grads, with the executor's bf16 autocast path; also the float32 loss."""
    out = {}
    for name, strategy_name, k in cases:
        spec = get_model(name, gpus=world)
        model = build_model(spec)
        graph = capture(model, batch_of(spec, seed=0))
        strategy = one_d_strategy(graph, strategy_name, world, k)
        inputs = dict(zip([n.source for n in graph.user_inputs], batch_of(spec)))
        results = []
        for dtype in (torch.bfloat16, None):  # the Program of the run's dtypes (bf16 gathers)
            program = lower(run_dtypes(graph, "bf16" if dtype else "fp32", "cpu"), strategy,
                            world, k, name)
            assert program.compute if dtype and strategy_name == "fsdp" else True
            ex = Executor(graph, strategy, program, dict(model.named_parameters()),
                          buffers=dict(model.named_buffers()), autocast=dtype)
            loss = float(ex.step(inputs, update=False))
            results.append((loss, {graph.node(p).source: full_tensor(g, strategy.home(p), world)
                                   for p, g in ex.grads.items()}))
        out[(name, strategy_name, k)] = results
    return out


def test_bf16_values_flow_as_in_eager_autocast():
    """Under bf16 autocast each op's output keeps the dtype autocast gives it, as in eager
    PyTorch (a matmul's output stays bf16 for the ops after it): with the batch split over the
    ranks (data parallel, and the search's plan for llama:tiny) and the weights gathered in bf16
    (fsdp: hidup.graph.dtypes), the loss equals eager autocast's on one device to float32
    rounding, closer than to the float32 run."""
    cases = [("llama:tiny", "ddp", 1), ("llama:tiny", "search", 2), ("llama:tiny", "fsdp", 2)]
    results = run_ranks(2, bf16_grads, cases)
    spec = get_model("llama:tiny", gpus=2)
    model = build_model(spec)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = float(model(*batch_of(spec)))
    for case in cases:
        for rank_result in results:
            (loss, _), (loss32, _) = rank_result[case]
            assert abs(loss - eager) <= 1e-6 * abs(eager), (case, loss, eager, loss32)
            assert abs(loss32 - eager) > 1e-5 * abs(eager)  # bf16 rounding shows


def test_bf16_autocast_matches_single_device_within_bf16_tolerance():
    """Mixed precision: loss within 1% and every gradient within 5% (norm-wise) of float32
    single-device training; and it is really bf16 (the loss differs from the float32 run's)."""
    cases = [("gpt:tiny", "megatron", 2), ("gpt:tiny", "ddp", 1)]
    results = run_ranks(2, bf16_grads, cases)
    ref_loss, ref_grads = reference("gpt:tiny", 2)
    scale = 1e-2 * max(float(g.norm()) for g in ref_grads.values())
    for case in cases:
        for rank_result in results:
            (loss, grads), (loss32, _) = rank_result[case]
            assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (case, loss, ref_loss)
            assert abs(loss - loss32) > 1e-7 * abs(loss32), "autocast did not change the loss"
            for pname, g in grads.items():
                assert g.dtype == torch.float32
                err = rel_err(g, ref_grads[pname], scale)
                assert err <= 5e-2, (case, pname, err)


TURNED = "turned-"  # data parallel over each machine's GPUs (conftest.turned)
FLAT = "random-flat-"  # random, some layers over every rank
# a 2-D mesh of 2 machines x 2 ranks: data parallel across, the strategy inside
MESH_CASES = [("gpt:tiny", "dp-megatron", 1), ("gpt:tiny", "dp-megatron", 2),
              ("bert-sgmoe:tiny", "dp-expert", 2), ("gpt:tiny", "search-2d", 2),
              ("bert-sgmoe:tiny", "search-2d", 1)]
# FSDP across the machines and Megatron with sequence parallelism inside (parameters stored
# sharded over the mesh column)
MESH_CASES += [("gpt:tiny", "fsdp+tp", 1), ("gpt:tiny", "fsdp+tp", 2),
               ("bert-sgmoe:tiny", "fsdp+tp", 2), ("gpt:tiny", "fsdp+tp+recompute", 2),
               ("gpt:tiny", "fsdp+tp+selective", 2), ("llama:tiny", "fsdp+tp", 2)]
# FSDP inside each machine, replicated across the machines (hybrid sharding)
MESH_CASES += [("gpt:tiny", "hsdp", 1), ("llama:tiny", "hsdp", 2)]
MESH_CASES += [(m, f"random-{seed}", 1 + seed % 2) for m in ("gpt:tiny", "bert-sgmoe:tiny")
               for seed in range(4)]
# ops over every rank (flat) beside ops over a machine's ranks: tp+ep (experts over every GPU,
# Megatron inside a machine), and random strategies with random layers' ops over every rank
MESH_CASES += [("bert-sgmoe:tiny", "tp+ep", 1), ("bert-sgmoe:tiny", "tp+ep", 2),
               ("bert-sgmoe:tiny", "tp+ep+selective", 2)]
MESH_CASES += [(m, f"{FLAT}{seed}", 1 + seed % 2) for m in ("gpt:tiny", "bert-sgmoe:tiny")
               for seed in range(4)]
# the mesh turned around: the strategy across the machines (one GPU of each), data parallel
# inside each (the mesh's groups are interleaved: rank = position * 2 + part)
MESH_CASES += [("gpt:tiny", f"{TURNED}dp-megatron", 2), ("bert-sgmoe:tiny", f"{TURNED}dp-expert", 1),
               ("gpt:tiny", f"{TURNED}fsdp+tp", 2), ("bert-sgmoe:tiny", f"{TURNED}search-2d", 2),
               ("gpt:tiny", f"{TURNED}random-5", 2)]
# the mesh cases run traced on gloo ranks (their collectives in DeviceMesh's groups: a row's, a
# column's, the world's, flat ops', storage across the machines, the turned mesh's); the others'
# numerics on threads (local_grads)
REAL_MESH = [("gpt:tiny", "dp-megatron", 2), ("bert-sgmoe:tiny", "search-2d", 1),
             ("gpt:tiny", "fsdp+tp", 2), ("llama:tiny", "hsdp", 2),
             ("bert-sgmoe:tiny", "tp+ep", 2), ("gpt:tiny", f"{TURNED}fsdp+tp", 2)]


def mesh_strategy(graph, name: str, world: int, k: int):
    """A 2-D strategy on 2 machines: fixed, searched on the mesh, or random inside (None where
    a random split does not divide the model's sizes); NAME+recompute: every layer recomputed."""
    for suffix in (RECOMPUTE, SELECTIVE):
        if name.endswith(suffix):
            return recomputing(graph, mesh_strategy(graph, name.removesuffix(suffix), world, k),
                               layers(graph), selective=suffix == SELECTIVE)
    if name.startswith(TURNED):
        if name == f"{TURNED}search-2d":
            dp = Search(graph, world, load_profile("v100-8x8-10gbps"),
                        SearchOptions(k=k, mesh=Mesh.grid(2, world // 2), dp="gpus"))
            return dp.strategy(dp.run()[0], "hidup")
        inner = mesh_strategy(graph, name.removeprefix(TURNED), world, k)
        return None if inner is None else turned(inner)
    if name == "search-2d":
        dp = Search(graph, world, load_profile("v100-8x8-10gbps"),
                    SearchOptions(k=k, mesh=Mesh.grid(2, world // 2), dp="machines"))
        return dp.strategy(dp.run()[0], "hidup")
    if name.startswith(FLAT):
        return random_flat(graph, world, k, random.Random(int(name.removeprefix(FLAT))))
    if name.startswith("random-"):
        inner = random_strategy(graph, world // 2, random.Random(int(name[7:])),
                                divide=world * k)
        strategy = replace(inner, mesh=Mesh.grid(2, world // 2), dp="machines")
        try:
            lower(graph, strategy, world, k)
        except LoweringError:
            return None
        return strategy
    return fixed_strategy(name, graph, world, Mesh.grid(2, world // 2))


def random_flat(graph, world: int, k: int, rng):
    """A random strategy on 2 machines whose ops in a random layer take a random option over
    every rank (flat; their parameters stored sharded over every rank or not, as drawn), the
    others one over a machine's ranks (None where it does not lower)."""
    inner = random_strategy(graph, world // 2, rng, divide=world * k)
    every = random_strategy(graph, world, rng, divide=world * k)
    chosen = set(rng.sample(sorted(layers(graph)), 1))
    ops = {n.name for n in graph.ops if n.layer in chosen}
    options = {n: flat_option(every.options[n]) if n in ops else o
               for n, o in inner.options.items()}
    read = {t for n in ops for t in graph.node(n).inputs if graph.node(t).kind == "param"}
    homes = {t: flat(every.placements[t]) if t in read else p
             for t, p in inner.placements.items()}
    strategy = replace(inner, options=options, placements=homes,
                       mesh=Mesh.grid(2, world // 2), dp="machines",
                       reshard=inner.reshard | every.reshard & read)
    try:
        lower(graph, strategy, world, k)
    except (LoweringError, ValueError):
        return None
    return strategy


@pytest.mark.slow
def test_2d_mesh_plans_match_single_device():
    """2 machines x 2 ranks: dp-megatron, dp-expert, fsdp+tp, plans searched on the mesh and
    random strategies inside each machine, Duplex on and off, equal single-device training
    (REAL_MESH on gloo ranks, traced; the others on threads)."""
    results = split_run(4, MESH_CASES, mesh_strategy, True, REAL_MESH)
    assert sum(case[1].startswith("random") for case in results[0]) >= 4, results[0].keys()
    assert_equal_to_one_device(results, 4, MESH_CASES)


def assert_equal_to_one_device(results, world: int, cases) -> None:
    """Every rank's loss and gradients of every case equal a single-device run's."""
    refs = {name: reference(name, world) for name in {case[0] for case in cases}}
    for case in results[0]:
        ref_loss, ref_grads = refs[case[0]]
        scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
        for rank_result in results:
            loss, grads, text = rank_result[case]
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss, text)
            assert set(grads) == set(ref_grads), case
            for pname, g in grads.items():
                err = rel_err(g, ref_grads[pname], scale)
                assert err <= 1e-5, (case, pname, err, text)


# a 3-D mesh (2 machines x 2 blocks x 2 GPUs): data parallel over the machines and the blocks,
# Megatron (with sequence parallelism) over a block's GPUs; the parameters stored sharded over
# both data-parallel axes (fsdp+tp) or over the blocks only, replicated across the machines
# (hsdp+tp); FSDP over a block's GPUs (hsdp); plans searched on the 3-D mesh
CUBE_CASES = [("gpt:tiny", "fsdp+tp", 2), ("gpt:tiny", "hsdp+tp", 1), ("gpt:tiny", "hsdp", 1),
              ("llama:tiny", "hsdp+tp", 2), ("bert-sgmoe:tiny", "dp-expert", 1),
              ("gpt:tiny", "search-3d", 1)]


def cube_strategy(graph, name: str, world: int, k: int):
    mesh = Mesh.grid(2, 2, world // 4)
    if name == "search-3d":
        dp = Search(graph, world, load_profile("v100-8x8-10gbps"),
                    SearchOptions(k=k, mesh=mesh, dp=("machines", "outer")))
        return dp.strategy(dp.run()[0], "hidup")
    return fixed_strategy(name, graph, world, mesh)


@pytest.mark.slow
def test_3d_mesh_plans_match_single_device():
    """2 x 2 x 2 ranks: fixed and searched plans on a 3-D mesh, Duplex on and off, equal
    single-device training; the first two on gloo ranks, traced (their collectives in groups
    along one axis and along two), the others on threads (local_grads, in worker processes)."""
    results = split_run(8, CUBE_CASES, cube_strategy, True, CUBE_CASES[:2])
    assert len(results[0]) == len(CUBE_CASES), results[0].keys()
    assert_equal_to_one_device(results, 8, CUBE_CASES)
