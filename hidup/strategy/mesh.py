"""The device mesh: the ranks as a grid of named axes, outermost first, numbered row-major as
DeviceMesh numbers them (on a cluster of 8-GPU machines, the 2 x 8 mesh ("machines", "gpus")
puts rank 9 at machine 1, GPU 1). A group along an axis is the ranks that differ only in that
axis' coordinate: along "gpus" one machine's GPUs, along "machines" one GPU of every machine;
along several axes, the ranks that differ only in those.

A plan (hidup.strategy.Strategy) splits its tensors over one axis' groups (its split axis) and
is data parallel over every other axis (its `dp` axes: each group there takes an equal part of
the batch and sums its parameters' gradients)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

# the axes of a 2-D mesh of a cluster: its machines, and each machine's GPUs
AXES = ("machines", "gpus")
# of a 3-D one: its machines, each machine's GPUs in blocks ("outer"), and a block's GPUs
AXES3 = ("machines", "outer", "gpus")


def dp_axes(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """Axes as given (one axis' name, several, or None) as a tuple."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axes_words(axes: tuple[str, ...]) -> str:
    """Where along the mesh, in words: 'across the machines', 'inside each machine', or 'along
    machines x outer'."""
    return {("machines",): "across the machines", ("gpus",): "inside each machine"}.get(
        tuple(axes), f"along {' x '.join(axes)}")


@functools.lru_cache(maxsize=64)
def _groups(shape: tuple[int, ...], names: tuple[str, ...], axes: tuple[str, ...]
            ) -> tuple[tuple[int, ...], ...]:
    """Mesh.groups of the mesh `shape` with axes `names`, along `axes` (names of it)."""
    ranks = np.arange(math.prod(shape)).reshape(shape)
    inside = sorted(names.index(a) for a in axes)
    rest = [j for j in range(len(shape)) if j not in inside]
    # the other axes first, then `axes` in the mesh's order: one row per group
    rows = ranks.transpose(rest + inside).reshape(-1, math.prod(shape[j] for j in inside))
    return tuple(map(tuple, rows.tolist()))


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]  # ranks along each axis, outermost first
    names: tuple[str, ...] = AXES  # each axis' name (DeviceMesh's mesh_dim_names)

    def __post_init__(self):
        if len(self.shape) != len(self.names) or not self.shape:
            raise ValueError(f"mesh {self.shape} with axes {self.names}: give one name per axis")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axes {self.names}: each name once")
        if any(n < 1 for n in self.shape):
            raise ValueError(f"mesh {self.shape}: every axis needs 1 or more ranks")

    @classmethod
    def line(cls, world: int) -> Mesh:
        """The 1-D mesh of every rank."""
        return cls((world,), ("gpus",))

    @classmethod
    def grid(cls, *shape: int) -> Mesh:
        """The 2-D mesh of machines x GPUs per machine (AXES), or the 3-D mesh of machines x
        blocks per machine x GPUs per block (AXES3)."""
        names = {2: AXES, 3: AXES3}.get(len(shape))
        if names is None:
            raise ValueError(f"mesh {'x'.join(map(str, shape))}: give 2 or 3 sizes "
                             f"(MACHINESxGPUS or MACHINESxBLOCKSxGPUS)")
        return cls(tuple(shape), names)

    @classmethod
    def of_machines(cls, machines: int, *per_machine: int) -> Mesh | None:
        """A plan's mesh of `machines` x `per_machine` ranks (a machine's GPUs, or its blocks x
        a block's GPUs): the grid, or None (the 1-D mesh) where a 2-D one has one machine."""
        if machines == 1 and len(per_machine) == 1:
            return None
        return cls.grid(machines, *per_machine)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def size(self, axes: str | tuple[str, ...] | None) -> int:
        """Ranks along `axes` (one axis' name, or several; 1 for None or (): no axis)."""
        return math.prod(self.shape[self._index(a)] for a in dp_axes(axes))

    def groups(self, axes: str | tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The groups along `axes` (one axis' name, or several): each group the ranks that
        differ only in those axes' coordinates, in row-major order of them; the groups in
        row-major order of the other axes' coordinates. Along every axis: the one group of
        all ranks. Made once per mesh and axes (a lowering asks for each collective, and on
        100,000 GPUs making them takes a quarter of a second)."""
        axes = dp_axes(axes)
        for a in axes:
            self._index(a)  # an axis of the mesh
        return _groups(self.shape, self.names, axes)

    def group(self, axes: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The group along `axes` that holds `rank`."""
        return next(g for g in self.groups(axes) if rank in g)

    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on each axis."""
        out = []
        for n in reversed(self.shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def coord(self, axis: str, rank: int) -> int:
        return self.coords(rank)[self._index(axis)]

    def rank(self, coords) -> int:
        r = 0
        for c, n in zip(coords, self.shape):
            r = r * n + c
        return r

    # -- a plan's view: data parallel over its `dp` axes (() on a 1-D mesh), split over the other
    def split_axis(self, dp: tuple[str, ...]) -> str:
        """The axis a plan that is data parallel over the axes `dp` splits its tensors over: the
        one axis not in `dp`."""
        dp = dp_axes(dp)
        for a in dp:
            self._index(a)  # an axis of the mesh
        rest = [a for a in self.names if a not in dp]
        if len(rest) != 1:
            raise ValueError(f"mesh {self}: a plan on it is data parallel over every axis but "
                             f"one, not over {list(dp)}")
        return rest[0]

    def rows(self, dp: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The groups a plan's placements split over (along its split axis)."""
        return self.groups(self.split_axis(dp))

    def outside(self, dp: tuple[str, ...]) -> bool:
        """Are the `dp` axes all outside the split axis (the split axis the innermost)? Then a
        part's row is consecutive ranks, and a tensor split over the batch by the parts, then
        over a row, is split as over every rank flattened."""
        return self.split_axis(dp) == self.names[-1]

    def columns(self, dp: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The plan's data-parallel groups (along its `dp` axes; one rank each on a 1-D mesh)."""
        return self.groups(dp_axes(dp))

    def index(self, rank: int, axes: tuple[str, ...]) -> int:
        """The rank's place in its group along `axes`: its coordinates on them, row-major."""
        out = 0
        for a in dp_axes(axes):
            out = out * self.size(a) + self.coord(a, rank)
        return out

    def position(self, rank: int, dp: tuple[str, ...]) -> tuple[int, int]:
        """(part, place) of `rank` for a plan: its index among the `dp` axes (the data-parallel
        part of the batch it takes, row-major over them; 0 on a 1-D mesh) and its coordinate on
        the split axis (which piece of a split tensor it holds)."""
        return self.index(rank, dp), self.coord(self.split_axis(dp), rank)

    def _index(self, axis: str) -> int:
        if axis not in self.names:
            raise ValueError(f"mesh {self}: no axis {axis!r}; its axes are {list(self.names)}")
        return self.names.index(axis)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + f" ({', '.join(self.names)})"
