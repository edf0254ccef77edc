"""Between a machine's placements and flat ones (over every rank of a 2-D mesh;
hidup.graph.placement), for hidup.program.lowering.Lowering: which strategies may mix them, the
conversions that take a tensor from one to the other through its micro-batch split (the same
values under both), and gradients back to their home the same way."""
from __future__ import annotations

from hidup.graph.placement import (Partial, Placement, R, Shard, flat, is_flat, option_is_flat,
                                   plain, same)
from hidup.strategy import conversion
from hidup.program.tasks import LoweringError, gkey, vkey


def crossing(c: Placement, src: Placement, dst: Placement) -> list[tuple]:
    """The conversions that take a tensor whose micro-batch split is c (Shard(b)) from src to
    dst: one, or between a machine's placements and flat ones, three through c, which a
    machine's ranks (the machines splitting the batch) and every rank hold alike: src -> c in
    src's scope, the same values as c in dst's (an alias), c -> dst. (The lowering runs them;
    the search's programme prices them.)"""
    if is_flat(src) == is_flat(dst):
        return [(src, dst)]
    cs, cd = (flat(c) if is_flat(src) else c), (flat(c) if is_flat(dst) else c)
    return [step for step in ((src, cs), (cs, cd), (cd, dst)) if step[0] != step[1]]


def step_kind(src: Placement, dst: Placement) -> str:
    """What one of crossing's steps runs: an alias where src and dst are the same placement
    (or the same in the two scopes), else their conversion."""
    return "alias" if same(plain(src), plain(dst)) else conversion(src, dst)


class Scopes:
    """Lowering's part for the two scopes of a 2-D mesh. It reads the Lowering's s (strategy),
    dp_parts, uses, mbs_split, home, shape and nbytes, and calls its gplace, emit_convert,
    contributed and scatter_grad."""

    def check_flat(self) -> None:
        """Flat options need a 2-D mesh data parallel over "machines"; a tensor crosses between a machine's
        placements and flat ones only where it is split over the batch (parameters and what
        is made of them once per step hold each scope's own gradient sums: all who read one
        read it in the scope it lives in)."""
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

    def steps(self, t: str, src: Placement, dst: Placement) -> list[tuple]:
        """The conversions that take t from src to dst (crossing, through t's micro-batch
        split)."""
        return crossing(self.mbs_split.home(t), src, dst)

    def emit_steps(self, t: str, steps, phase: str, m: int | None, made: set[str]) -> None:
        """Emit these conversions of t's value, each once among those sharing `made`."""
        for src, dst in steps:
            if vkey(t, dst, m) in made:
                continue
            made.add(vkey(t, dst, m))
            self.emit_convert(step_kind(src, dst), t, src, dst, phase, m, vkey(t, src, m),
                              vkey(t, dst, m),
                              self.shape(t, src), max(self.nbytes(t, src), self.nbytes(t, dst)))

    def grad_conversion(self, t, p, home, m) -> None:
        """t's gradient, complete as read at p, back to its home (the forward's steps reversed,
        each to a key of its own, since other readers' gradients may pass the same placement)."""
        key, steps, read = gkey(t, p, m), self.steps(t, home, p)[::-1], p
        for a, b in [(b, a) for a, b in steps[:-1]]:
            src, dst = self.gplace(t, a), self.gplace(t, b)
            out = f"{gkey(t, b, m)}~{read}"
            self.emit_convert(step_kind(src, dst), t, src, dst, "bwd", m, key, out,
                              self.shape(t, a), max(self.nbytes(t, a, grad=True),
                                                    self.nbytes(t, b, grad=True)))
            key, p = out, b
        src, dst = self.gplace(t, p), self.gplace(t, home)
        root = isinstance(dst, Partial) and isinstance(src, Shard)
        kind = step_kind(src, (flat(R) if is_flat(dst) else R) if root else dst)
        if kind == "reduce_scatter" and m is None and self.g.node(t).kind == "param":
            return self.scatter_grad(t, p, home)  # in a bucket
        nbytes = max(self.nbytes(t, p, grad=True), self.nbytes(t, home, grad=True))
        out = gkey(t, home, m)
        self.emit_convert(kind, t, src, dst, "bwd", m, key, out, self.shape(t, p),
                          nbytes, root)
        self.contributed(t, home, m)
