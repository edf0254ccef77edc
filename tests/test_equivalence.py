"""Every strategy the executor runs equals single-device training: loss and every gradient after
one step, for 2 and 4 gloo ranks, data and tensor parallel, Duplex on and off."""
from __future__ import annotations

import pytest
import torch
from conftest import build_model, run_ranks

from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.planning.costs import load_profile
from hidup.planning.search import search
from hidup.planning.strategy import fixed_strategy
from hidup.program import lower
from hidup.runtime.execute import Executor, full_tensor

MODELS = ("mlp:tiny", "gpt:tiny")
CASES = [(m, s, k) for m in MODELS for s in ("ddp", "megatron") for k in (1, 2)]
CASES += [(m, "search", 2) for m in MODELS + ("bert-sgmoe:tiny",)]  # a searched plan


def batch_of(spec, seed=1):
    return spec.inputs(spec.batch, torch.Generator().manual_seed(seed))


def reference(name: str, world: int):
    """Independent single-device run: plain PyTorch autograd on the nn.Module made for `world` GPUs."""
    spec = get_model(name, gpus=world)
    model = build_model(spec)
    loss = model(*batch_of(spec))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def distributed_grads(rank, world, cases):
    out = {}
    for name, strategy_name, k in cases:
        spec = get_model(name, gpus=world)
        model = build_model(spec)
        graph = capture(model, batch_of(spec, seed=0))
        strategy = (search(graph, world, load_profile("v100-8x8-10gbps"), k).strategy
                    if strategy_name == "search" else fixed_strategy(strategy_name, graph, world))
        program = lower(graph, strategy, world, k, name)
        ex = Executor(graph, strategy, program, dict(model.named_parameters()),
                      buffers=dict(model.named_buffers()))
        inputs = dict(zip([n.source for n in graph.user_inputs], batch_of(spec)))
        loss = ex.step(inputs, update=False)
        grads = {graph.node(p).source: full_tensor(g, strategy.home(p), world)
                 for p, g in ex.grads.items()}
        out[(name, strategy_name, k)] = (float(loss), grads)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """Norm-wise relative error. A gradient that is zero in exact arithmetic (e.g. an attention key
    bias: softmax ignores a per-query constant) holds only rounding noise, so the denominator is
    at least `scale` (1e-3 of the model's largest gradient norm)."""
    return float((a - b).norm() / max(float(b.norm()), scale, 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_single_device(world):
    results = run_ranks(world, distributed_grads, CASES)
    refs = {name: reference(name, world) for name in {case[0] for case in CASES}}
    for case in CASES:
        ref_loss, ref_grads = refs[case[0]]
        scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
        for rank_result in results:
            loss, grads = rank_result[case]
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
        strategy = fixed_strategy(strategy_name, graph, world)
        program = lower(graph, strategy, world, k, name)
        inputs = dict(zip([n.source for n in graph.user_inputs], batch_of(spec)))
        results = []
        for dtype in (torch.bfloat16, None):
            ex = Executor(graph, strategy, program, dict(model.named_parameters()),
                          buffers=dict(model.named_buffers()), autocast=dtype)
            loss = float(ex.step(inputs, update=False))
            results.append((loss, {graph.node(p).source: full_tensor(g, strategy.home(p), world)
                                   for p, g in ex.grads.items()}))
        out[(name, strategy_name, k)] = results
    return out


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
