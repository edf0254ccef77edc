"""Redistribution on a mesh of several axes: the collectives, each along one axis or along a run
of neighbouring axes at once, that take a tensor from one layout to another.

A layout is one DTensor placement per axis, the axes in the order the shards nest: a tensor dim
sharded along two axes is split along the first, and each of those pieces along the second (as
DTensor nests the shards of a dim in its mesh's order). A step changes one placement `src` into
`dst` along `axes` (one axis, or several neighbours in the mesh's order: one collective over
their ranks flattened, as DTensor merges such steps); it is valid where no axis after them
shards a dim it gathers, scatters or slices (that dim's pieces would not be contiguous there).

Of the plans made of such steps along the axes that must change (those where the layouts
differ, and the later ones whose shards nest in a dim those touch), `redistribute` gives the one
that moves the fewest bytes per rank (ring collectives: an all-gather or reduce-scatter moves
(n-1)/n of the larger side, an all-reduce twice that, an all-to-all (n-1)/n of its tensor; a
slice nothing), then the one of fewest steps, found by Dijkstra's search over the layouts
(DTensor's graph-based planner does the same). A Partial is never made, only kept or reduced;
every layout on the way splits the tensor's dims evenly."""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

from hidup.graph.placement import Partial, Placement, R, Shard, same
from hidup.strategy.base import conversion

Layout = tuple[Placement, ...]


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) of a redistribution: `src` becomes `dst` along the axes
    `axes` (indices into the layout, neighbours, outermost first); `before` and `after` are the
    whole layouts around it."""

    axes: tuple[int, ...]
    src: Placement
    dst: Placement
    before: Layout
    after: Layout

    @property
    def kind(self) -> str:
        """all_gather | all_reduce | reduce_scatter | all_to_all | slice (strategy.conversion)."""
        return conversion(self.src, self.dst)


def redistribute(src: Layout, dst: Layout, sizes: tuple[int, ...], shape: tuple[int, ...],
                 flattens: bool = True) -> tuple[Step, ...]:
    """The steps from layout `src` to `dst` (one placement per axis, the axes of `sizes` ranks,
    in nesting order) of a tensor of `shape`: the fewest bytes moved, then the fewest steps;
    () where they are the same. `flattens`: steps may run along several neighbouring axes at
    once (where the nesting order is the mesh's, whose flattened groups number ranks so).
    ValueError where dst is Partial on an axis where src is not (nothing becomes a partial
    sum), or where no plan splits every dim evenly on the way."""
    if len(src) != len(sizes) or len(dst) != len(sizes):
        raise ValueError(f"layouts {_words(src)} -> {_words(dst)} on {len(sizes)} axes: give one "
                         f"placement per axis")
    for layout in (src, dst):
        for d in {p.dim for p in layout if isinstance(p, Shard)}:
            n = math.prod(k for p, k in zip(layout, sizes) if isinstance(p, Shard) and p.dim == d)
            if d >= len(shape) or shape[d] % n:
                raise ValueError(f"layout {_words(layout)} on axes of {list(sizes)} ranks: dim "
                                 f"{d} of shape {tuple(shape)} does not split into {n}")
    for a, b in zip(src, dst):
        if isinstance(b, Partial) and not isinstance(a, Partial):
            raise ValueError(f"layout {_words(src)} -> {_words(dst)}: {b} where the tensor is "
                             f"{a}: nothing becomes a partial sum")
    return _plan(tuple(map(_canon, src)), tuple(map(_canon, dst)), tuple(sizes), tuple(shape),
                 flattens)


def _canon(p: Placement) -> Placement:
    """DTensor's types as themselves (a flat placement as the one it is on each axis)."""
    return Shard(p.dim) if isinstance(p, Shard) else Partial() if isinstance(p, Partial) else R


def _words(layout: Layout) -> str:
    return "[" + ", ".join(map(str, layout)) + "]"


@functools.lru_cache(maxsize=4096)
def _plan(src: Layout, dst: Layout, sizes: tuple[int, ...], shape: tuple[int, ...],
          flattens: bool) -> tuple[Step, ...]:
    if all(same(a, b) for a, b in zip(src, dst)):
        return ()
    targets = (R, *(Shard(d) for d in range(len(shape))))
    movable = _movable(src, dst)
    runs = [tuple(range(i, j)) for i in range(len(sizes))
            for j in range(i + 1, (len(sizes) if flattens else i + 1) + 1)
            if all(k in movable for k in range(i, j))]
    start, tie = (0, 0), itertools.count()
    best = {src: start}
    heap = [(start, next(tie), src, ())]
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dst:
            return path
        if cost > best.get(state, cost):
            continue
        for axes in runs:
            a = state[axes[0]]
            if any(not same(state[i], a) for i in axes[1:]):
                continue
            for b in targets:
                if same(a, b):
                    continue
                after = tuple(b if i in axes else p for i, p in enumerate(state))
                if not _valid(state, after, axes, sizes, shape):
                    continue
                step = Step(axes, a, b, state, after)
                new = (cost[0] + _moved(step, sizes, shape), cost[1] + 1)
                if new < best.get(after, (math.inf, 0)):
                    best[after] = new
                    heapq.heappush(heap, (new, next(tie), after, path + (step,)))
    raise ValueError(f"layout {_words(src)} -> {_words(dst)} on axes of {list(sizes)} ranks, "
                     f"shape {shape}: no plan splits every dim evenly on the way")


def _valid(before: Layout, after: Layout, axes: tuple[int, ...], sizes, shape) -> bool:
    """Is a step along `axes` from `before` to `after` one collective of contiguous pieces, and
    does `after` split every dim evenly?"""
    a, b = before[axes[0]], after[axes[0]]
    dims = {p.dim for p in (a, b) if isinstance(p, Shard)}
    if any(isinstance(before[i], Shard) and before[i].dim in dims
           for i in range(axes[-1] + 1, len(before))):
        return False  # a later axis' pieces of that dim: not contiguous along these axes
    for d in dims:
        n = math.prod(sizes[i] for i, p in enumerate(after) if isinstance(p, Shard) and p.dim == d)
        if shape[d] % n:
            return False
    return True


def _movable(src: Layout, dst: Layout) -> set[int]:
    """The axes a plan may run steps along: those where src and dst differ, and the later ones
    whose shards nest inside a dim those touch (they must be undone to reach it); an axis that
    is the same at both ends and nests nothing stays as it is (moving less data through it,
    as a slice and a gather across machines would, costs links the bytes do not see)."""
    movable = {i for i, (a, b) in enumerate(zip(src, dst)) if not same(a, b)}
    while True:
        dims = {p.dim for i in movable for p in (src[i], dst[i]) if isinstance(p, Shard)}
        more = {j for j in range(min(movable) + 1, len(src)) if j not in movable and any(
            isinstance(p, Shard) and p.dim in dims for p in (src[j], dst[j]))}
        if not more:
            return movable
        movable |= more


def local_numel(layout: Layout, sizes, shape) -> int:
    """Elements one rank holds of a tensor of `shape` in `layout`."""
    return math.prod(shape) // math.prod(n for p, n in zip(layout, sizes) if isinstance(p, Shard))


def _moved(step: Step, sizes, shape) -> int:
    """Elements a rank sends in the step's ring collective (a slice sends none), times the
    ranks of the mesh (an integer: each collective's group size divides them)."""
    n = math.prod(sizes[i] for i in step.axes)
    kind, scale = step.kind, math.prod(sizes) // n
    if kind == "slice" or n == 1:
        return 0
    if kind == "all_gather":
        return local_numel(step.after, sizes, shape) * (n - 1) * scale
    before = local_numel(step.before, sizes, shape) * (n - 1) * scale
    return 2 * before if kind == "all_reduce" else before  # reduce_scatter, all_to_all
