"""What each micro-batch reads and when it may run, for hidup.program.lowering.Lowering: tensors
held per micro-batch or once per step, the micro-batches' parts joined into the whole batch's
value or the whole cut into them (where an op needs the whole batch: BatchNorm's statistics, a
router's sort), and Duplex's interleaving of the micro-batches."""
from __future__ import annotations

import math

from hidup.graph.placement import Placement, R, Shard, is_r, same
from hidup.program.tasks import Convert, LoweringError, gkey, vkey


class MicroBatches:
    """Lowering's micro-batch part. It reads the Lowering's k, world, g (graph), s (strategy),
    mbs_split, once, joins, written, tasks, pending, waited and expected, and calls its add,
    wait_for, shape, nbytes and contributed."""

    # -- shapes and micro-batches -------------------------------------------------------------
    def mbs(self, t: str) -> list[int | None]:
        """The micro-batches tensor t is held for: [None] where it is once per step."""
        return [None] if t in self.once else list(range(self.k))

    def in_mb(self, t: str, m: int | None) -> int | None:
        return None if t in self.once else m

    # -- micro-batches joined and sliced --------------------------------------------------------
    def joined(self, t: str, q: Placement) -> bool:
        """Is t read whole (q = R) where its micro-batches hold parts or partial sums of it?"""
        return self.joins and is_r(q) and not is_r(self.mbs_split.home(t))

    def mb_converted(self, t: str, q: Placement) -> bool:
        """Is t read split over micro-batches as q, other than it is held (a join or a slice)?"""
        return self.joins and not same(q, self.mbs_split.home(t))

    def read_key(self, t: str, p: Placement, q: Placement, m: int | None) -> str:
        """The key of tensor t's value at rank placement p, split over micro-batches as q, that
        micro-batch m reads: as held, or joined (one per step) or sliced (per micro-batch)."""
        if not self.mb_converted(t, q):
            return vkey(t, p, self.in_mb(t, m))
        return f"{vkey(t, p, None if is_r(q) else m)}~{q}"

    def sources(self, t: str, p: Placement, q: Placement, m: int | None) -> tuple[str, ...]:
        """The keys read_key(t, p, q, m) is made from: every micro-batch's part for a join, the
        whole for a slice, itself where t is read as held."""
        if self.joined(t, q):
            return tuple(vkey(t, p, mm) for mm in range(self.k))
        if self.mb_converted(t, q):
            return (vkey(t, p, None),)
        return (self.read_key(t, p, q, m),)

    def emit_mb_conversion(self, t: str, p: Placement, q: Placement, m: int | None) -> None:
        """Make read_key(t, p, q, m) if not made yet: the micro-batches' parts of t concatenated
        (mb_gather) or summed (mb_sum) into the whole value, or the whole value cut into the
        micro-batch's part (mb_slice), all on this rank (no communication)."""
        key, h = self.read_key(t, p, q, m), self.mbs_split.home(t)
        if key in self.written:
            return
        if not is_r(q) and t not in self.once:
            raise LoweringError(f"tensor {t}: sliced over micro-batches ({q}) from a value "
                                f"each micro-batch holds ({h}); not supported")
        ins = self.sources(t, p, q, m)
        for key_in in ins:
            self.wait_for(key_in)
        kind = "mb_slice" if not is_r(q) else "mb_gather" if isinstance(h, Shard) else "mb_sum"
        self.emit_local(kind, t, p, h, q, "fwd", None if is_r(q) else m, ins, key,
                        self.shape(t, p))

    def blocks(self, t: str, p: Placement, split: Placement) -> int:
        """The rank blocks a micro-batch's part of t holds along the dim they split (`split`):
        one where p splits that dim over the ranks (the part is in this rank's block), else one
        per rank. Each must divide evenly."""
        if not isinstance(split, Shard) or same(p, split) or self.world == 1:
            return 1
        size = self.shape(t, p, split)[split.dim]
        if size % self.world:
            raise LoweringError(f"tensor {t}: a micro-batch's {size} along dim {split.dim} do not "
                                f"split into the {self.world} ranks' blocks that a join needs; "
                                f"choose a batch divisible by micro-batches x GPUs")
        return self.world

    def inputs_ready(self, node, m: int | None) -> bool:
        """Are the values node reads in micro-batch m written, or joins of written ones? (Without
        joins, always: node order is the graph's.)"""
        if not self.joins:
            return True
        opt, mb_opt = self.s.options[node.name], self.mbs_split.options[node.name]
        return all(key in self.written for t, p, q in zip(node.inputs, opt.inputs, mb_opt.inputs)
                   for key in self.sources(t, p, q, m))

    def blocked(self, keys) -> bool:
        """Would reading these values wait for a collective still in flight?"""
        return any(c not in self.waited for key in keys for c in self.pending.get(key, ()))

    def interleave(self, nodes, emit, needs, ready, marks=frozenset(), lead: int = 3) -> None:
        """Duplex order: run one micro-batch until it needs a collective's result still in flight,
        or until it is `lead` marked nodes ahead of the micro-batch behind it; then switch to the
        next one, whose computation hides that communication. A node held once per step among
        `nodes` (after a join) runs once, when the first micro-batch that reaches it finds it
        `ready`; a micro-batch waits (switches) at a node not yet ready."""
        ahead = [0] * len(nodes)  # marked nodes before position i
        for i, node in enumerate(nodes[:-1]):
            ahead[i + 1] = ahead[i] + (node.name in marks)
        cursor, m, done, idle = [0] * self.k, 0, set(), 0
        while any(c < len(nodes) for c in cursor):
            first, start = True, cursor[m]
            while cursor[m] < len(nodes):
                node = nodes[cursor[m]]
                mb = None if node.name in self.once else m
                if mb is None and node.name in done:
                    cursor[m] += 1
                    continue
                if not ready(node, mb) or not first and (
                        self.blocked(needs(node, mb)) or self.too_far(cursor, m, ahead, lead)):
                    break
                emit(node, mb)
                if mb is None:
                    done.add(node.name)
                cursor[m], first = cursor[m] + 1, False
            idle = 0 if cursor[m] > start else idle + 1
            if idle > self.k:
                raise LoweringError(f"the micro-batches cannot go on past node {node.name} "
                                    f"({node.op}): its inputs are never complete")
            m = (m + 1) % self.k

    def too_far(self, cursor, m, ahead, lead) -> bool:
        """Micro-batch m is `lead` marked nodes ahead of the one furthest behind."""
        behind = min((c for i, c in enumerate(cursor) if i != m), default=len(ahead))
        return behind < len(ahead) and ahead[cursor[m]] - ahead[behind] >= lead

    def mb_contributed(self, t: str, p: Placement, q: Placement, m: int | None) -> None:
        """One more contribution to the gradient of t read joined or sliced (q); once complete,
        back to the micro-batches' parts (a join's: sliced, or the same to each where they were
        summed) or to the whole (the slices' gradients, gathered once all are complete)."""
        key = "d" + self.read_key(t, p, q, m)
        self.expected[key] -= 1
        if self.expected[key]:
            return
        h = self.mbs_split.home(t)
        if is_r(q):
            for mm in range(self.k):
                self.emit_local("mb_slice" if isinstance(h, Shard) else "alias", t, p, q, h,
                                "bwd", mm, (key,), gkey(t, p, mm), self.shape(t, p, R))
                self.contributed(t, p, mm)
            return
        pieces = tuple("d" + self.read_key(t, p, q, mm) for mm in range(self.k))
        if not any(self.expected.get(piece) for piece in pieces):
            self.emit_local("mb_gather", t, p, q, h, "bwd", None, pieces, gkey(t, p, None),
                            self.shape(t, p, q))
            self.contributed(t, p, None)

    def emit_local(self, kind, t, p, src, dst, phase, m, ins, out, shape) -> None:
        """A conversion of t (held as p over the ranks) between the micro-batches' parts (split
        src) and the whole (dst), or back, on the rank; `shape`: one input's. Its bytes are the
        larger of one input and the output (the parts joined: all of them)."""
        parts = len(ins) if kind == "mb_gather" else 1
        self.add(Convert(len(self.tasks), kind, t, src, dst, phase, m, shape,
                         math.prod(shape) * self.g.node(t).out.itemsize * parts, (), ins,
                         (out,), blocks=self.blocks(t, p, src if is_r(dst) else dst)))
