"""A tensor's conversions between two placements of a plan, axis by axis of the mesh, for
hidup.program.lowering.Lowering (and the search's pricing, hidup.planning.pricing, which prices
the same steps).

A value held as a placement p of the plan has a layout: one DTensor placement per mesh axis, the
axes in the order its shards nest (Layouts.order: the data-parallel axes, then the split axis).
Along the split axis it is p; along the dp axes as the data-parallel parts hold it (its
micro-batch split's home: split over the batch, whole in each part, or each part's partial
sum); a flat p (over every rank) is that placement along every axis. A conversion runs the steps
hidup.strategy.redistribute plans between the two layouts, each along its axes' groups; where
the layouts are the same (a flat placement and a machine's that hold the same pieces) it is an
alias. A gradient goes back the same way, from the gradient's layout where it was read to its
layout at home."""
from __future__ import annotations

from hidup.graph.placement import Partial, Placement, R, Replicate, Shard, is_flat, \
    option_is_flat, plain
from hidup.strategy import Mesh
from hidup.strategy.mesh import dp_axes
from hidup.strategy.redistribute import Layout, Step, local_numel, redistribute
from hidup.program.tasks import LoweringError, gkey, local_shape, vkey


class Layouts:
    """Layouts of one graph's tensors under a plan's mesh, dp axes and micro-batch split
    (`mbs`, k micro-batches), and the steps between them, each planned once."""

    def __init__(self, graph, mbs, mesh: Mesh, dp: tuple[str, ...], k: int):
        self.g, self.mbs, self.k = graph, mbs, k
        dp = dp_axes(dp)
        self.order = (*dp, mesh.split_axis(dp))  # the axes, in the order shards nest
        self.sizes = tuple(mesh.size(a) for a in self.order)
        self.names = mesh.names
        # steps along neighbouring axes at once where the order is the mesh's (whose
        #   flattened groups number their ranks so)
        self.flattens = self.order == tuple(a for a in mesh.names if a in self.order)
        self._plans: dict[tuple, tuple[Step, ...]] = {}

    def of(self, t: str, p: Placement) -> Layout:
        """The layout of t's value held as p."""
        if is_flat(p):
            return (plain(p),) * len(self.order)
        return (self.mbs.home(t),) * (len(self.order) - 1) + (p,)

    def of_grad(self, t: str, p: Placement, g: Placement) -> Layout:
        """The layout of t's gradient (held as g, Lowering.gplace) where t is read as p: g
        along the split axis, along the dp axes the dual of the value's placement (a value
        whole in each part has a partial sum of the parts' gradients, a split one the split
        gradient, a partial sum a whole gradient)."""
        if is_flat(p):
            return (plain(g),) * len(self.order)
        dual = {Replicate: Partial(), Partial: R}
        return tuple(dual.get(type(v), v) for v in self.of(t, p)[:-1]) + (g,)

    def in_mesh_order(self, layout: Layout) -> Layout:
        """A layout with its placements in the mesh's order of axes."""
        return tuple(layout[self.order.index(a)] for a in self.names)

    def mb_shape(self, t: str) -> tuple[int, ...]:
        """t's shape in one micro-batch (the whole where it is held once per step)."""
        return local_shape(self.g.node(t).out.shape, R, self.mbs.home(t), 1, self.k,
                           lambda: f"tensor {t}")

    def steps(self, t: str, src: Layout, dst: Layout) -> tuple[Step, ...]:
        """redistribute's plan from src to dst for t; LoweringError where there is none."""
        key = t, src, dst
        if key not in self._plans:
            try:
                self._plans[key] = redistribute(src, dst, self.sizes, self.mb_shape(t),
                                                self.flattens)
            except ValueError as exc:
                raise LoweringError(f"tensor {t}: {exc}") from None
        return self._plans[key]

    def numel(self, t: str, layout: Layout) -> int:
        """Elements of t one rank holds in `layout` (per micro-batch)."""
        return local_numel(layout, self.sizes, self.mb_shape(t))

    def shape(self, t: str, layout: Layout) -> tuple[int, ...]:
        """t's local shape in `layout`."""
        out = list(self.mb_shape(t))
        for p, n in zip(layout, self.sizes):
            if isinstance(p, Shard):
                out[p.dim] //= n
        return tuple(out)

    def axes(self, step: Step) -> tuple[str, ...]:
        """The names of the axes a step runs along."""
        return tuple(self.order[i] for i in step.axes)


def layout_key(t: str, layout: Layout, mb: int | None) -> str:
    """The key of t's value in a layout a conversion passes through."""
    return vkey(t, "[" + ", ".join(map(str, layout)) + "]", mb)


class Conversions:
    """Lowering's conversions of values and gradients, axis by axis. It reads the Lowering's s
    (strategy), layouts, uses, mbs_split, home, shape and itemsize, and calls its gplace,
    emit_convert, contributed and scatter_grad."""

    def check_flat(self) -> None:
        """Flat options need a mesh data parallel over every axis outside the innermost; a
        tensor passes between a machine's placements and flat ones only where it is split over
        the batch (parameters and what is made of them once per step hold each scope's own
        gradient sums: all who read one read it in the scope it lives in)."""
        flats = [n for n, o in self.s.options.items() if option_is_flat(o)]
        if not flats:
            return
        if not self.s.mesh or not self.s.mesh.outside(self.s.dp):
            raise LoweringError(f"strategy {self.s.name}: op {flats[0]} runs over every rank "
                                f"(a flat option), which needs a mesh data parallel over every "
                                f"axis outside the innermost (on a 2-D mesh: its machines); "
                                f"use its 1-D option instead")
        for t, uses in self.uses.items():
            scopes = {is_flat(p) for _, _, p in uses} | {is_flat(self.home(t))}
            if len(scopes) > 1 and not isinstance(self.mbs_split.home(t), Shard):
                raise LoweringError(f"strategy {self.s.name}: tensor {t} is read over a machine "
                                    f"and over every rank, but it is not split over the batch "
                                    f"(a parameter, or made of them), so it cannot pass between "
                                    f"them; give its readers one scope")

    def emit_value_conversion(self, t: str, src: Placement, dst: Placement, phase: str,
                              m: int | None, made: set[str]) -> None:
        """t's value (micro-batch m) from src to dst, once among those sharing `made`: each
        step of the plan between their layouts, or an alias where those are the same."""
        out = vkey(t, dst, m)
        if out in made:
            return
        made.add(out)
        self.shape(t, src), self.shape(t, dst)  # each splits evenly, else a LoweringError
        self.emit_steps(t, self.layouts.of(t, src), self.layouts.of(t, dst), phase, m,
                        vkey(t, src, m), out, lambda layout: layout_key(t, layout, m), made)

    def emit_steps(self, t, src: Layout, dst: Layout, phase, m, in_key, out_key, key_of,
                   made: set[str], grad: bool = False, root_axes: tuple[str, ...] = ()
                   ) -> None:
        """The plan's steps from layout src to dst, reading in_key and writing out_key (the
        layouts on the way: key_of(layout), each made once among those sharing `made`); an
        alias where there are none. `root_axes`: the result is added on the first rank along
        them only (a whole gradient made a Partial sum there)."""
        lay, itemsize = self.layouts, self.itemsize(t, grad)
        steps = lay.steps(t, src, dst)
        if not steps:
            self.emit_convert("alias", t, plain(src[-1]), plain(dst[-1]), phase, m, in_key,
                              out_key, lay.shape(t, src), lay.numel(t, src) * itemsize,
                              root_axes=root_axes)
            return
        key = in_key
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            out = out_key if last else key_of(step.after)
            if not last and out in made:  # another conversion of t passed there already
                key = out
                continue
            made.add(out)
            nbytes = max(lay.numel(t, step.before), lay.numel(t, step.after)) * itemsize
            # the last step of a root one makes the partial sum along its axes
            result = Partial() if last and set(lay.axes(step)) & set(root_axes) else step.dst
            self.emit_convert(step.kind, t, step.src, result, phase, m, key, out,
                              lay.shape(t, step.before), nbytes,
                              root_axes=root_axes if last else (), axes=lay.axes(step))
            key = out

    def grad_conversion(self, t: str, p: Placement, home: Placement, m: int | None) -> None:
        """t's gradient, complete as read at p, back to its home: the plan from its layout
        there to its layout at home (where that is a Partial sum along axes where the read
        one is not, the whole is added on the first rank along them). Each layout on the way
        has a key of its own, since other readers' gradients may pass it."""
        lay = self.layouts
        self.shape(t, p), self.shape(t, home)  # each splits evenly, else a LoweringError
        src = lay.of_grad(t, p, self.gplace(t, p))
        dst = lay.of_grad(t, home, self.gplace(t, home))
        root = tuple(i for i, (a, b) in enumerate(zip(src, dst))
                     if isinstance(b, Partial) and not isinstance(a, Partial))
        target = tuple(R if i in root else b for i, b in enumerate(dst))
        steps = lay.steps(t, src, target)
        if len(steps) == 1 and steps[0].kind == "reduce_scatter" and not root and m is None \
                and self.g.node(t).kind == "param" and lay.axes(steps[0]) == self.row_axes:
            return self.scatter_grad(t, p, home)  # in a bucket
        self.emit_steps(t, src, target, "bwd", m, gkey(t, p, m), gkey(t, home, m),
                        lambda layout: f"d{layout_key(t, layout, m)}~{p}", set(), grad=True,
                        root_axes=tuple(lay.order[i] for i in root))
        self.contributed(t, home, m)

