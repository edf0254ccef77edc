"""Property: a random valid strategy (a random option per node) trains exactly like one device,
for every model, Duplex on and off, on 2 and 4 gloo ranks. The strategies are drawn anew on each
run from a seed the test prints (HIDUP_TEST_SEED draws them again). Each runs untraced (the
Program's tasks one by one as Python) with its ranks on threads of one process, their
collectives exchanged in memory (hidup.runtime.local_world); on 2 gloo ranks the first of each
model's draws also runs traced (graph mode, what users run), which must give the same loss and
gradients bit for bit."""
from __future__ import annotations

import os
import random
from contextlib import nullcontext

import pytest
import torch

from conftest import build_model, run_ranks, start_ranks, start_workers
from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.strategy import random_strategy
from test_equivalence import batch_of, local_step, one_step, reference, rel_err

MODELS = ("mlp:tiny", "gpt:tiny", "bert-sgmoe:tiny", "bert-switch:tiny", "vit-sgmoe:tiny",
          "vit-switch:tiny", "switch-trace:tiny")


def drawn(graph, world: int, seed: int):
    """Seed's random strategy (each must lower: a failure else) and its micro-batches."""
    k = 1 + seed % 2
    return random_strategy(graph, world, random.Random(seed), divide=world * k), k


def runs(world, name, seeds, step):
    """{seed: (strategy text, loss, whole gradients)} after one step of each seed's strategy,
    `step(model, graph, strategy, world, k, name, batch)` giving (loss, gradients, text)."""
    spec = get_model(name, gpus=world)
    graph = capture(build_model(spec), batch_of(spec, seed=0))
    out = {}
    for seed in seeds:
        strategy, k = drawn(graph, world, seed)
        loss, grads, text = step(build_model(spec), graph, strategy, world, k, name,
                                 batch_of(spec))
        out[seed] = (text, loss, grads)
    return out


def random_runs(seeds, world, name):
    """runs() of the untraced step, its ranks on threads of this process (local_step; rank 0's
    loss)."""
    return runs(world, name, seeds, lambda *args: local_step(*args)[0])


def traced_runs(rank, world, name, seeds):
    """{("graph", seed): ...} of runs() of the traced step on gloo ranks (graph mode, what users
    run)."""
    return {("graph", seed): result for seed, result in
            runs(world, name, seeds, lambda *args: one_step(*args, mode="graph")).items()}


# a new draw on every run; HIDUP_TEST_SEED=N draws the same strategies again
SEED = int(os.environ.get("HIDUP_TEST_SEED") or random.SystemRandom().randrange(2**31))
STRATEGIES = 12  # per model and world size, half with Duplex (k = 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_random_strategy_matches_single_device(world, name):
    print(f"HIDUP_TEST_SEED={SEED}: set it to draw these strategies again")
    seeds = random.Random(f"{SEED} {name} {world}").sample(range(2**31), STRATEGIES)
    traced = seeds[:1] if world == 2 else ()
    # the draws untraced in worker processes (half each), the traced one on gloo ranks and the
    # reference here, at once
    with start_workers(random_runs, [seeds[0::2], seeds[1::2]], world, name) as workers, \
            start_ranks(world, traced_runs, name, traced) if traced else nullcontext() as ranks:
        ref_loss, ref_grads = reference(name, world)
        results = {seed: run for half in workers.results() for seed, run in half.items()}
        if traced:
            results.update(ranks.results()[0])
    scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
    for seed in traced:  # the traced step computes what its tasks run as Python do, bit for bit
        text, loss, grads = results.pop(("graph", seed))
        assert (text, loss) == results[seed][:2], (SEED, seed, text)
        for pname, g in grads.items():
            assert torch.equal(g, results[seed][2][pname]), (SEED, seed, pname, text)
    assert sorted(results) == sorted(seeds), f"HIDUP_TEST_SEED={SEED}"
    for seed, (text, loss, grads) in results.items():
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (SEED, seed, text)
        for pname, g in grads.items():
            assert rel_err(g, ref_grads[pname], scale) <= 1e-5, (SEED, seed, pname, text)


class Stacked(torch.nn.Module):
    """A model of ops DTensor answers only through the adapter's list handling (stack) or the
    overlay answers (where with a number for a branch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.where(x > 0, self.a(x), 0.5)
        s = torch.stack([h, self.b(x)], dim=1)
        return (s * s).mean()


def _stacked_runs(rank, world, seeds):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    graph = capture(Stacked(), (x,))
    return {seed: one_step(Stacked(), graph, random_strategy(graph, world, random.Random(seed),
                                                             divide=world * (1 + seed % 2)),
                           world, 1 + seed % 2, "stacked", (x,),
                           mode="graph" if seed % 3 == 0 else "untraced")
            for seed in seeds}


def test_stack_and_where_with_a_number_split_as_one_device():
    """Random plans of a model with stack and where(cond, x, number), their splits among them
    (on the batch, on the features, stack's new dim), train as one device does on 2 ranks."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    model = Stacked()
    loss = model(x)
    loss.backward()
    seeds = random.Random(SEED).sample(range(2**31), 12)
    results = run_ranks(2, _stacked_runs, seeds)[0]
    split = set()
    for seed, (got, grads, text) in results.items():
        assert abs(got - loss.item()) <= 1e-5 * abs(loss.item()), (SEED, seed, text)
        for pname, g in grads.items():
            want = dict(model.named_parameters())[pname].grad
            assert rel_err(g, want) <= 1e-5, (SEED, seed, pname, text)
        split |= {line.split(":")[0].strip() for line in text.splitlines()
                  if line.strip().startswith(("stack:", "where:")) and "S(" in line}
    assert split == {"stack", "where"}, (SEED, split)
