"""The local world (hidup.runtime.local_world): ranks on threads of one process whose
collectives meet in memory, as the tests' numerics checks run most plans."""
from __future__ import annotations

import threading

import pytest
import torch

from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.program import lower
from hidup.runtime import local_world
from hidup.runtime.local_world import Exchange, PeerFailed, assemble, run_local
from hidup.strategy import fixed_strategy


def _on_threads(world: int, fn) -> list:
    out = [None] * world
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r)))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_collectives_meet_as_on_a_process_group():
    """Each kind, laid out along dim 0 as the functional collectives lay it out; two groups at
    once; the n-th collective of a rank meets the n-th of its peers."""
    ex = Exchange()
    xs = [torch.arange(4.0) + 10 * r for r in range(4)]

    def rank(r):
        group = (0, 1) if r < 2 else (2, 3)  # two groups of two, at once
        handles = [ex.issue(kind, xs[r], group, r) for kind in
                   ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")]
        handles.append(ex.issue("all_reduce", xs[r], (0, 1, 2, 3), r, op="max"))
        return [ex.wait(h) for h in handles]

    got = _on_threads(4, rank)
    a, b = xs[0], xs[1]
    assert torch.equal(got[0][0], a + b) and torch.equal(got[1][0], a + b)
    assert torch.equal(got[1][1], torch.cat([a, b]))
    assert torch.equal(got[0][2], (a + b)[:2]) and torch.equal(got[1][2], (a + b)[2:])
    assert torch.equal(got[1][3], torch.cat([a[2:], b[2:]]))  # chunk 1 of each rank
    assert torch.equal(got[2][0], xs[2] + xs[3])
    assert all(torch.equal(g[4], xs[3]) for g in got)


def test_a_failing_rank_stops_its_peers_with_its_error(monkeypatch):
    """A rank's error reaches the caller; its peers waiting at a collective stop too (no hang)."""
    monkeypatch.setattr(local_world, "TIMEOUT_S", 5.0)
    spec = get_model("gpt:tiny", gpus=2)
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.inputs(spec.batch, torch.Generator().manual_seed(0))
    graph = capture(model, batch)
    strategy = fixed_strategy("megatron", graph, 2)
    program = lower(graph, strategy, 2, 1)
    params = {n.name: p.detach() for n, p in zip(graph.params, model.parameters())}
    calls = []

    def broken(kind, x, group, rank, op="sum"):
        calls.append(rank)
        if rank == 1:
            raise RuntimeError("rank 1 broke")
        return Exchange.issue(exchange, kind, x, group, rank, op)

    exchange = Exchange()
    monkeypatch.setattr(local_world, "Exchange", lambda: exchange)
    monkeypatch.setattr(exchange, "issue", broken)
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_local(graph, strategy, program, params, [], list(batch))
    assert 1 in calls


def test_replicas_that_differ_are_refused():
    spec = get_model("mlp:tiny", gpus=2)
    model = spec.build()
    graph = capture(model, spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    strategy = fixed_strategy("ddp", graph, 2)
    program = lower(graph, strategy, 2, 1)
    p = graph.params[0]
    shape = tuple(p.out.shape)
    same = torch.randn(shape)
    assert torch.equal(assemble(strategy, program, p.name, [same, same.clone()], shape), same)
    with pytest.raises(ValueError, match="rank 1's copy differs"):
        assemble(strategy, program, p.name, [same, same + 1], shape)
