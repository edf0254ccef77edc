"""The device mesh: the ranks as a grid of named axes, outermost first, numbered row-major as
DeviceMesh numbers them (on a cluster of 8-GPU machines, the 2 x 8 mesh ("machines", "gpus")
puts rank 9 at machine 1, GPU 1). A group along an axis is the ranks that differ only in that
axis' coordinate: along "gpus" one machine's GPUs, along "machines" one GPU of every machine.

A plan (hidup.strategy.Strategy) splits its tensors over one axis' groups and, on a 2-D mesh,
is data parallel over the other (its `dp` axis: each group there takes an equal part of the
batch and sums its parameters' gradients)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

# the axes of a 2-D mesh of a cluster: its machines, and each machine's GPUs
AXES = ("machines", "gpus")


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
    def grid(cls, machines: int, per_machine: int) -> Mesh:
        """The 2-D mesh of `machines` x `per_machine` ranks (AXES)."""
        return cls((machines, per_machine))

    @classmethod
    def of_machines(cls, machines: int, per_machine: int) -> Mesh | None:
        """A plan's mesh of `machines` x `per_machine` ranks: the 2-D grid, or None (the 1-D
        mesh) where it has one machine."""
        return cls.grid(machines, per_machine) if machines > 1 else None

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def size(self, axes: str | tuple[str, ...] | None) -> int:
        """Ranks along `axes` (one axis' name, or several; 1 for None or (): no axis)."""
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return math.prod(self.shape[self._index(a)] for a in axes)

    def other(self, axis: str) -> str:
        """On a 2-D mesh, the axis that is not `axis`."""
        if len(self.shape) != 2:
            raise ValueError(f"mesh {self}: the other axis than {axis!r} needs 2 axes")
        return self.names[1 - self._index(axis)]

    def groups(self, axes: str | tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The groups along `axes` (one axis' name, or several): each group the ranks that
        differ only in those axes' coordinates, in row-major order of them; the groups in
        row-major order of the other axes' coordinates. Along every axis: the one group of
        all ranks."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        inside = sorted(map(self._index, axes))
        rest = [j for j in range(len(self.shape)) if j not in inside]
        out = []
        for c in product(*(range(self.shape[j]) for j in rest)):
            coords = dict(zip(rest, c))
            group = []
            for a in product(*(range(self.shape[j]) for j in inside)):
                coords.update(zip(inside, a))
                group.append(self.rank(tuple(coords[j] for j in range(len(self.shape)))))
            out.append(tuple(group))
        return tuple(out)

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

    # -- a plan's view: data parallel over `dp` (None on a 1-D mesh), split over the other axis
    def split_axis(self, dp: str | None) -> str:
        """The axis a plan that is data parallel over `dp` splits its tensors over."""
        if dp is None:
            if len(self.shape) != 1:
                raise ValueError(f"mesh {self}: a plan on it needs a data-parallel axis")
            return self.names[0]
        return self.other(dp)

    def rows(self, dp: str | None) -> tuple[tuple[int, ...], ...]:
        """The groups a plan's placements split over (along its split axis)."""
        return self.groups(self.split_axis(dp))

    def columns(self, dp: str | None) -> tuple[tuple[int, ...], ...]:
        """The plan's data-parallel groups (along `dp`; one rank each on a 1-D mesh)."""
        return self.groups(dp or ())

    def position(self, rank: int, dp: str | None) -> tuple[int, int]:
        """(part, place) of `rank` for a plan: its coordinate on `dp` (the data-parallel part of
        the batch it takes; 0 on a 1-D mesh) and on the split axis (which piece of a split tensor
        it holds)."""
        return (self.coord(dp, rank) if dp else 0, self.coord(self.split_axis(dp), rank))

    def _index(self, axis: str) -> int:
        if axis not in self.names:
            raise ValueError(f"mesh {self}: no axis {axis!r}; its axes are {list(self.names)}")
        return self.names.index(axis)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + f" ({', '.join(self.names)})"
