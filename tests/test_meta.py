"""Models built on the meta device: planned without weights, and run with each rank holding only
its own shards, made from a state dict or by the model's own initialisation."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import run_ranks

import hidup

pytest.importorskip("transformers")
from experiments.third_party import MODELS, build  # noqa: E402

BATCH = 8
LR = 0.5


def batch(name: str):
    return MODELS[name].batch(BATCH, torch.Generator().manual_seed(1))


def meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build(name)


def meta_run(rank, world, name, strategy, state_dict):
    """Plan the meta model, parallelize it (from `state_dict`, or initialised module by module),
    take one SGD step: (loss, whole weights after it, shapes of this rank's shards, whether the
    module's parameters are all still on the meta device)."""
    model = meta_model(name)
    plan = hidup.plan(model, batch(name), cluster="cpu-gloo-loopback", gpus=world,
                      strategy=strategy, optimizer="sgd")
    trainer = hidup.parallelize(model, plan, state_dict=state_dict,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    loss = float(trainer.step(*batch(name)))
    shards = {n: tuple(t.shape) for n, t in trainer.executor.params.items()}
    buffers = {n.source: b.clone() for n, b in zip(
        [n for n in trainer.graph.nodes if n.kind == "buffer"], trainer.executor.buffers)}
    return loss, trainer.full_state_dict() | buffers, shards, \
        all(p.is_meta for p in model.parameters())


@pytest.mark.slow
def test_meta_model_from_state_dict_trains_as_eager():
    """Megatron on 2 ranks: each rank cuts its shards from the state dict; one step equals
    eager's, and the user's meta module never got storage."""
    eager = build("llama")
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    loss = eager(*batch("llama"))
    loss.backward()
    torch.optim.SGD(eager.parameters(), lr=LR).step()
    for got_loss, weights, shards, still_meta in run_ranks(2, meta_run, "llama", "megatron",
                                                           state):
        assert still_meta
        assert abs(got_loss - loss.item()) <= 1e-5 * abs(loss.item())
        for name, want in eager.state_dict().items():
            assert torch.allclose(weights[name], want, rtol=0, atol=1e-5), name
        held = sum(math.prod(s) for s in shards.values())
        assert held < sum(p.numel() for p in eager.parameters()), shards  # its shards only


@pytest.mark.slow
def test_meta_model_initialised_by_its_own_code():
    """Without a state dict, every rank initialises module by module with the model's own
    _init_weights, from rank 0's random state: both ranks hold the same whole model, split
    (megatron: each holds its shards only), with the deterministic buffers (rotary
    frequencies) an eager build has and linear weights drawn with the config's std."""
    (loss0, w0, shards, _), (loss1, w1, _, _) = run_ranks(2, meta_run, "llama", "megatron", None)
    eager = build("llama")
    assert loss0 == loss1 and torch.isfinite(torch.tensor(loss0))
    for name, value in w0.items():
        assert torch.equal(value, w1[name]), name
    for name, value in eager.named_buffers():
        assert torch.equal(w0[name], value), name
    weight = w0["model.model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < float(weight.std()) < 0.025  # initializer_range 0.02, and one SGD step
    assert sum(math.prod(s) for s in shards.values()) < sum(p.numel() for p in
                                                             eager.parameters()), shards


def test_meta_module_without_initialiser_is_refused():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return (x @ self.w).sum()

    with torch.device("meta"):
        model = Bare()
    x = torch.randn(2, 4)
    plan = hidup.plan(model, (x,), cluster="cpu-gloo-loopback", gpus=1, strategy="ddp")
    with pytest.raises(ValueError, match="no reset_parameters.*state_dict"):
        hidup.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
