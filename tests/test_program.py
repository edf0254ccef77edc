"""Lowering: the Program's tasks, micro-batches, collectives and waits."""
from __future__ import annotations

import pytest

from hidup.program import buckets as buckets_module
from hidup.graph.placement import R
from hidup.strategy import data_parallel, fully_sharded, megatron, sharded_storage
from hidup.program import Compute, Convert, LoweringError, Wait, lower


def first(tasks, pred):
    return next(i for i, t in enumerate(tasks) if pred(t))


def test_duplex_issues_one_micro_batch_comm_before_the_other_computes(tiny_graphs):
    _, _, graph = tiny_graphs["mlp:tiny"]
    prog = lower(graph, megatron(graph, 2), 2, k=2)
    tasks = prog.tasks
    # forward all-reduce of the first row-parallel output for mb 0, then mb 1's compute, then wait
    ar0 = first(tasks, lambda t: isinstance(t, Convert) and t.tensor == "linear_1" and t.mb == 0)
    fwd1 = first(tasks, lambda t: isinstance(t, Compute) and t.node == "linear_1" and t.mb == 1)
    wait0 = first(tasks, lambda t: isinstance(t, Wait) and t.collective == tasks[ar0].id)
    assert ar0 < fwd1 < wait0
    assert tasks[ar0].kind == "all_reduce" and tasks[ar0].bytes == 4 * 16 * 4  # (8/2 rows, 16) fp32
    # the same in backward: the all-reduce of mb 0's gradient of the second block's input (made
    # a Partial sum by its column-parallel linear_2) overlaps mb 1's backward
    bw = [t for t in tasks if isinstance(t, Convert) and t.phase == "bwd" and t.tensor == "add"]
    assert [(t.kind, t.mb) for t in bw] == [("all_reduce", 0), ("all_reduce", 1)]
    bwd1 = first(tasks, lambda t: isinstance(t, Compute) and t.phase == "bwd"
                 and t.node == "linear_2" and t.mb == 1)
    assert bw[0].id < bwd1 < first(tasks, lambda t: isinstance(t, Wait) and t.collective == bw[0].id)


def test_parameter_gradients_reduced_once_per_step(tiny_graphs):
    _, _, graph = tiny_graphs["mlp:tiny"]
    for k in (1, 2, 4):
        prog = lower(graph, data_parallel(graph, 2), 2, k=k, bucket_bytes=0)
        grad_ars = [t for t in prog.collectives if t.phase == "bwd"]
        assert len(grad_ars) == len(graph.params)  # one all-reduce per parameter, any k
        assert all(t.mb is None for t in grad_ars)
        fwd = [t for t in prog.tasks if isinstance(t, Compute) and t.phase == "fwd"]
        assert len(fwd) == k * len(graph.ops)
        assert fwd[0].in_shapes[0] == (8 // 2 // k, 16)  # micro-batch split, then the rank split


def test_gradients_are_bucketed_like_ddp(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    sizes = {p.name: p.out.nbytes for p in graph.params}
    cap = 20_000
    buckets = [t for t in lower(graph, data_parallel(graph, 2), 2, k=2, bucket_bytes=cap).collectives
               if t.phase == "bwd"]
    names = [key.removeprefix("grad:") for t in buckets for key in t.outputs]
    assert sorted(names) == sorted(sizes)  # every parameter once
    for t in buckets[:-1]:  # a bucket closes once it holds at least `cap` bytes
        held = [sizes[key.removeprefix("grad:")] for key in t.outputs]
        assert t.bytes == sum(held) >= cap and sum(held[:-1]) < cap
    assert len(buckets) < len(sizes)


def test_the_first_bucket_is_small_as_in_ddp(tiny_graphs, monkeypatch):
    """The first bucket closes at FIRST_BUCKET_BYTES, so its all-reduce runs under the rest of
    the backward; the others at the cap."""
    monkeypatch.setattr(buckets_module, "FIRST_BUCKET_BYTES", 20_000)
    _, _, graph = tiny_graphs["gpt:tiny"]
    sizes = {p.name: p.out.nbytes for p in graph.params}
    buckets = [t for t in lower(graph, data_parallel(graph, 2), 2, k=1, bucket_bytes=10**9)
               .collectives if t.phase == "bwd"]
    first = [sizes[key.removeprefix("grad:")] for key in buckets[0].outputs]
    assert len(buckets) == 2 and sum(first) >= 20_000 > sum(first[:-1])
    assert buckets[0].bytes + buckets[1].bytes == sum(sizes.values())


def test_sharded_parameters_are_gathered_and_scattered_in_buckets_like_fsdp(tiny_graphs):
    """fsdp's parameters are all-gathered in buckets of about `bucket_bytes` (gathered) in the
    order of their first use, once per step whatever k, each bucket issued before its first use
    and no earlier than the one before it is needed; gathered again for the backward in the
    reverse order (fsdp reshards after the forward; sharded storage without reshard does not);
    their gradients reduce-scattered in buckets; every parameter in one of each; one collective
    per parameter with buckets off."""
    _, _, graph = tiny_graphs["gpt:tiny"]
    sizes = {p.name: p.out.nbytes for p in graph.params}
    sharded = [p for p in sizes if fully_sharded(graph, 2).home(p) != R]
    first_use = {}
    for i, node in enumerate(graph.ops):
        for t in node.inputs:
            first_use.setdefault(t, i)
    for k in (1, 2):
        prog = lower(graph, fully_sharded(graph, 2), 2, k=k, bucket_bytes=20_000)
        gathers = [t for t in prog.collectives if t.kind == "all_gather" and t.phase == "fwd"]
        again = [t for t in prog.collectives if t.kind == "all_gather" and t.phase == "bwd"]
        assert [t.outputs for t in again] == [
            tuple(key + "+again" for key in t.outputs) for t in reversed(gathers)]
        first_compute = {}  # a bucket is issued before its first use, after the one before's
        for i, task in enumerate(prog.tasks):
            if isinstance(task, Compute):
                for key in task.inputs:
                    first_compute.setdefault(key, i)
        used = [first_compute[t.outputs[0]] for t in gathers]
        for j, bucket in enumerate(gathers):
            assert bucket.id < used[max(j - 1, 0)]  # before the one before it is first used
            assert j < 2 or bucket.id > used[j - 2]  # and not before the one two back is
        scatters = [t for t in prog.collectives if t.kind == "reduce_scatter"]
        gathered = [key.split("@")[0] for t in gathers for key in t.outputs]
        assert gathered == sorted(sharded, key=first_use.get)  # each once, in order of use
        assert sorted(key.split("@")[0].removeprefix("d") for t in scatters
                      for key in t.outputs) == sorted(sharded)
        for t in gathers[:-1]:  # a bucket closes once it holds at least the cap
            held = [sizes[key.split("@")[0]] for key in t.outputs]
            assert t.bytes == sum(held) >= 20_000 > sum(held[:-1])
        assert 1 < len(gathers) < len(sharded) and 1 < len(scatters) < len(sharded)
        assert all(t.mb is None for t in gathers + scatters)
    plain = lower(graph, fully_sharded(graph, 2), 2, k=1, bucket_bytes=0).collectives
    assert sum(t.kind == "all_gather" for t in plain) == 2 * len(sharded)
    kept = sharded_storage(graph, data_parallel(graph, 2), 2)
    assert not kept.reshard and fully_sharded(graph, 2).reshard == set(sharded)
    assert not [t for t in lower(graph, kept, 2, k=2).collectives
                if t.kind == "all_gather" and t.phase == "bwd"]


def test_every_collective_is_waited_before_the_update(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    prog = lower(graph, megatron(graph, 2), 2, k=2)
    waited = {t.collective for t in prog.tasks if isinstance(t, Wait)}
    assert waited == {t.id for t in prog.collectives}
    update = first(prog.tasks, lambda t: isinstance(t, Compute) and t.phase == "update")
    assert all(t.id < update for t in prog.collectives)


def test_split_that_does_not_divide_is_an_error(tiny_graphs):
    _, _, graph = tiny_graphs["mlp:tiny"]
    with pytest.raises(LoweringError, match=r"tensor x as S\(0\): dim 0 of size 8 .* does not "
                                            r"split into 3 ranks"):
        lower(graph, data_parallel(graph, 3), 3, k=1)


def test_a_bucket_grown_one_gradient_at_a_time_closes_where_one_pass_closes():
    """OpenRun (a bucket's gradients as each is complete) closes runs where one pass over all
    of them does: at a change of key and once the bytes reach the cap, the cap growing after
    the first bucket as DDP's does."""
    import random
    from hidup.program.buckets import OpenRun

    rng = random.Random(0)
    for _ in range(200):
        items = [(rng.choice("ab"), rng.randint(1, 9)) for _ in range(rng.randint(0, 30))]
        key, nbytes = (lambda item: item[0]), (lambda item: item[1])
        run, closed, caps = OpenRun(), [], []
        for item in items:
            cap = 4 if not closed else 16  # the first bucket small
            caps.append(cap)
            closed += run.grow(item, key, nbytes, cap)
        # one pass over them all, each item under the cap it was added with
        expected, last, total = [], [], 0
        for item, cap in zip(items, caps):
            if last and key(item) != key(last[0]):
                expected.append(last)
                last, total = [], 0
            last.append(item)
            total += nbytes(item)
            if total >= cap:
                expected.append(last)
                last, total = [], 0
        assert (closed, run.items) == (expected, last), items
        assert run.total == sum(map(nbytes, run.items))
