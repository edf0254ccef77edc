"""hidup.strategy.redistribute: every plan, run on simulated ranks (numpy chunks and collectives
written out here), gives each rank the piece its target layout says, on 2-D and 3-D meshes."""
import itertools
import math
import random

import numpy as np
import pytest

from hidup.graph.placement import P, R, Shard, flat
from hidup.strategy.redistribute import local_numel, redistribute


def coords_of(sizes):
    return list(itertools.product(*(range(n) for n in sizes)))


def chunk(x, layout, coords, sizes):
    """The piece of x a rank at `coords` holds in `layout` (a Partial axis holds it all)."""
    for p, c, n in zip(layout, coords, sizes):
        if isinstance(p, Shard):
            x = np.split(x, n, axis=p.dim)[c]
    return x


def start(x, layout, sizes, rng):
    """Each rank's local value of x in `layout`: its piece, and along the Partial axes random
    parts that sum to it."""
    ranks = coords_of(sizes)
    parts = [i for i, p in enumerate(layout) if p == P]
    local = {c: rng.standard_normal(chunk(x, layout, c, sizes).shape) if parts
             else chunk(x, layout, c, sizes) for c in ranks}
    for c in ranks:
        if parts and all(c[i] == 0 for i in parts):
            group = [d for d in ranks if all(d[j] == c[j] for j in range(len(c)) if j not in parts)]
            local[c] = local[c] + chunk(x, layout, c, sizes) - sum(local[d] for d in group)
    return local


def run_step(local, step, sizes):
    """The step's collective on every group of ranks along its axes."""
    out = {}
    for c in local:
        group = sorted((d for d in local if all(d[j] == c[j] for j in range(len(c))
                                                if j not in step.axes)),
                       key=lambda d: [d[i] for i in step.axes])
        me = group.index(c)
        n = len(group)
        kind = step.kind
        if kind == "slice":
            out[c] = np.split(local[c], n, axis=step.dst.dim)[me]
        elif kind == "all_gather":
            out[c] = np.concatenate([local[d] for d in group], axis=step.src.dim)
        elif kind == "all_reduce":
            out[c] = sum(local[d] for d in group)
        elif kind == "reduce_scatter":
            out[c] = np.split(sum(local[d] for d in group), n, axis=step.dst.dim)[me]
        else:  # all_to_all: my piece of each one's dst split, joined along src's dim
            out[c] = np.concatenate([np.split(local[d], n, axis=step.dst.dim)[me]
                                     for d in group], axis=step.src.dim)
    return out


def check(src, dst, sizes, shape, rng):
    x = rng.standard_normal(shape)
    local = start(x, src, sizes, rng)
    plan = redistribute(src, dst, sizes, shape)
    for step in plan:
        assert step.dst != P or step.src == P  # nothing becomes a partial sum
        local = run_step(local, step, sizes)
    parts = [i for i, p in enumerate(dst) if p == P]
    for c in local:
        want = chunk(x, dst, c, sizes)
        if parts:  # summed over its group along the Partial axes
            group = [d for d in local if all(d[j] == c[j] for j in range(len(c))
                                             if j not in parts)]
            got = sum(local[d] for d in group)
        else:
            got = local[c]
        assert got.shape == want.shape and np.allclose(got, want), (src, dst, plan)
    return plan


PLACEMENTS = (R, P, Shard(0), Shard(1), Shard(2))


def even(layout, sizes, shape):
    return all(shape[d] % math.prod(n for p, n in zip(layout, sizes) if p == Shard(d)) == 0
               for d in range(len(shape)))


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (2, 2, 2)])
def test_every_plan_gives_each_rank_its_piece(sizes):
    rng, pick = np.random.default_rng(0), random.Random(0)
    shape = (8, 8, 4)
    layouts = [lay for lay in itertools.product(PLACEMENTS, repeat=len(sizes))
               if even(lay, sizes, shape)]
    pairs = [(s, d) for s in layouts for d in layouts
             if all(b != P or a == P for a, b in zip(s, d))]
    for src, dst in pick.sample(pairs, min(len(pairs), 150)):
        check(src, dst, sizes, shape, rng)


def test_a_plan_moves_the_fewest_bytes():
    rng, sizes, shape = np.random.default_rng(1), (2, 4), (16, 8, 8)
    n = math.prod(shape)
    # a whole tensor from its shards over every rank: one all-gather over both axes, not two
    plan = check((Shard(0), Shard(0)), (R, R), sizes, shape, rng)
    assert [(s.kind, s.axes) for s in plan] == [("all_gather", (0, 1))]
    # partial sums into shards of one dim over every rank: one reduce-scatter
    plan = check((P, P), (Shard(0), Shard(0)), sizes, shape, rng)
    assert [(s.kind, s.axes) for s in plan] == [("reduce_scatter", (0, 1))]
    # along one axis only, the one conversion there
    plan = check((Shard(0), P), (Shard(0), R), sizes, shape, rng)
    assert [(s.kind, s.axes) for s in plan] == [("all_reduce", (1,))]
    # a batch-split tensor split by heads inside a machine, to whole: the first all-gather of
    # the smaller piece along the machines, then inside them (7/8 of the tensor moved, where
    # turning it into shards over every rank first would move more)
    plan = check((Shard(0), Shard(2)), (R, R), sizes, shape, rng)
    assert [(s.kind, s.axes) for s in plan] == [("all_gather", (0,)), ("all_gather", (1,))]
    assert local_numel((Shard(0), R), sizes, shape) == n // 2
    # an axis the same at both ends that nests nothing is left alone: a partial sum inside each
    # machine is all-reduced there, not sliced across the machines to move fewer bytes
    plan = check((R, P), (R, R), sizes, shape, rng)
    assert [(s.kind, s.axes) for s in plan] == [("all_reduce", (1,))]


def test_layouts_that_are_the_same_need_nothing_and_flat_placements_are_their_own():
    assert redistribute((Shard(0), R), (Shard(0), R), (2, 2), (4, 4)) == ()
    assert redistribute((flat(Shard(0)),) * 2, (Shard(0), Shard(0)), (2, 2), (4, 4)) == ()


def test_what_cannot_be_planned_says_why():
    with pytest.raises(ValueError, match="nothing becomes a partial sum"):
        redistribute((R, R), (R, P), (2, 2), (4, 4))
    with pytest.raises(ValueError, match="one placement per axis"):
        redistribute((R,), (R, R), (2, 2), (4, 4))
    with pytest.raises(ValueError, match=r"dim 0 of shape \(2, 4\) does not split into 4"):
        redistribute((R, R), (Shard(0), Shard(0)), (2, 2), (2, 4))


def test_without_flattening_every_step_runs_along_one_axis():
    plan = redistribute((Shard(0), Shard(0)), (R, R), (2, 4), (16, 8), flattens=False)
    assert [(s.kind, s.axes) for s in plan] == [("all_gather", (1,)), ("all_gather", (0,))]
