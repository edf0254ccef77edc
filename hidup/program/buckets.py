"""Parameter gradients for hidup.program.lowering.Lowering: once complete on a rank, reduced
axis by axis into the parameter's stored shard (`reductions`: a reduce-scatter along the mesh
axes where the gradient is a partial sum and the parameter stored sharded, an all-reduce along
those where it is stored whole), in buckets as DDP and FSDP run them, then the optimizer's
update. Parameters stored sharded and read whole are gathered in buckets too: one collective
over many tensors flattened together, in the order the step first uses them."""
from __future__ import annotations

import math

from hidup.graph.placement import Partial, Placement, R, Replicate, Shard, flat, is_flat, same
from hidup.program.tasks import (FIRST_BUCKET_BYTES, Compute, Convert, LoweringError, Wait,
                                 gkey, stored_key, vkey)
from hidup.strategy.mesh import axes_words

GATHER_BUCKETS = 8  # a step's gathers are split into about this many buckets or more


class OpenRun:
    """The run of `runs_under_cap` still open (one key, under the cap), grown one item at a time
    with its bytes so far: items that come one at a time (a step's gradients, as each is
    complete) close runs where one pass over all of them would, without summing them again."""

    def __init__(self):
        self.items: list = []
        self.total = 0

    def grow(self, item, key, nbytes, cap: int) -> list[list]:
        """Add `item`; the runs this closes: the open one where the key changes, and the run
        with `item` once its bytes reach `cap` (a run's caps never decrease)."""
        closed = []
        if self.items and key(item) != key(self.items[0]):
            closed.append(self.take())
        self.items.append(item)
        self.total += nbytes(item)
        if self.total >= cap:
            closed.append(self.take())
        return closed

    def take(self) -> list:
        """The items so far, the run emptied."""
        items, self.items, self.total = self.items, [], 0
        return items


def runs_under_cap(items: list, key, nbytes, cap: int) -> tuple[list[list], list]:
    """Split `items`, in order, into consecutive runs (buckets) whose items share `key(item)`.
    A run closes where the key changes, and as soon as its bytes (the sum of `nbytes(item)`)
    reach `cap`: only its last item takes it to the cap or past it. Return the closed runs and
    the last run if it is still open (under the cap; else [])."""
    run, runs = OpenRun(), []
    for item in items:
        runs += run.grow(item, key, nbytes, cap)
    return runs, run.items


def reductions(grad: tuple[Placement, ...], stored: tuple[Placement, ...],
               axes: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...], Placement], ...]:
    """The collectives that turn a parameter's gradient, complete on a rank as `grad` (one
    placement per mesh axis, the mesh's `axes`), into the gradient of its stored shard
    (`stored`, Strategy.storage), as (kind, the axes it runs along, its result's placement
    there): first, for each dim d the parameter is stored sharded on along axes where the
    gradient is a partial sum, one reduce-scatter along all of them (in the mesh's order, as
    DTensor nests the shards of one dim); then one all-reduce along the axes where it is a
    partial sum and stored whole. () where the gradient is the stored shard's already."""
    scatter: dict[int, list[str]] = {}
    reduce: list[str] = []
    for axis, g, s in zip(axes, grad, stored):
        if same(g, s):
            continue
        if isinstance(g, Partial) and isinstance(s, Shard):
            scatter.setdefault(s.dim, []).append(axis)
        elif isinstance(g, Partial) and isinstance(s, Replicate):
            reduce.append(axis)
        else:
            raise LoweringError(f"a parameter's gradient {g} along mesh axis {axis!r} cannot "
                                f"become its stored placement there ({s}) by a reduction")
    return tuple(("reduce_scatter", tuple(a), Shard(d)) for d, a in scatter.items()) + \
        ((("all_reduce", tuple(reduce), R),) if reduce else ())


class GradientBuckets:
    """Lowering's gradient reductions and update. It reads the Lowering's dp_parts, buckets,
    reducing, bucket_bytes, flushed, final, mesh, ranks, optimizer, tasks, pending and waited,
    and calls its home, gplace, grad_layout, collective_axes, along, shape, nbytes, wait_for
    and add."""

    # -- storage over the dp axes (Strategy.across_axes: on a 2-D mesh, across the machines) ----
    def gather_across(self) -> None:
        """Parameters stored sharded over the dp axes: all-gathered along those axes at the
        start of the step into their row's piece, in buckets (one dim per bucket)."""
        closed, last = runs_under_cap([p.name for p in self.g.params if p.name in self.across],
                                      lambda t: self.across[t],
                                      lambda t: self.nbytes(t, self.home(t)), self.bucket_bytes)
        for bucket in closed + ([last] if last else []):
            self.emit_bucket("all_gather", bucket, Shard(self.across[bucket[0]]), R, "fwd",
                             [stored_key(b, self.home(b), True) for b in bucket],
                             [vkey(b, self.home(b), None) for b in bucket],
                             [self.stored_shape(b) for b in bucket], axes=self.s.across_axes,
                             nbytes=sum(self.nbytes(b, self.home(b)) for b in bucket))

    def check_across(self) -> None:
        """Storage over the dp axes needs a mesh, a parameter, a dim of its row's piece that
        those axes divide, and a gradient whole in a row (summed over the dp axes)."""
        params, n = {p.name for p in self.g.params}, self.mesh.size(self.s.across_axes)
        row = axes_words(self.row_axes)  # where its piece is split: 'inside each machine'
        for t, d in self.across.items():
            shape = self.shape(t, self.home(t)) if t in params else ()
            why = "the mesh is 1-D" if self.dp_parts == 1 else \
                "it is not a parameter" if t not in params else \
                f"dim {d} of its piece {list(shape)} (as split {row}) does not split into " \
                f"{n}" if d >= len(shape) or shape[d] % n else \
                f"it is split on dim {d} {row} already (a checkpoint's DTensor would read the " \
                f"two splits in the other order)" if self.home(t) == Shard(d) else \
                f"its gradient is a partial sum {row}" if isinstance(
                    self.gplace(t, self.home(t)), Partial) else ""
            if why:
                raise LoweringError(f"strategy {self.s.name}: parameter {t} cannot be stored "
                                    f"sharded {axes_words(self.s.across_axes)}: {why}; keep "
                                    f"it whole there")

    def stored_shape(self, t: str) -> tuple[int, ...]:
        """The shape of parameter t's stored shard on a rank (its row's piece, or stored sharded
        over the dp axes too, that piece's part)."""
        shape = list(self.shape(t, self.home(t)))
        if t in self.across:
            shape[self.across[t]] //= self.mesh.size(self.s.across_axes)
        return tuple(shape)

    def param_grad(self, t: str, home: Placement) -> None:
        """Parameter t's gradient is complete on this rank (at its home): reduced into its
        stored shard by `reductions`, in buckets of parameters reduced alike (the same
        collectives along the same axes); complete already where there are none."""
        key = gkey(t, home, None)
        steps = reductions(self.grad_layout(t, home), self.s.storage(t, self.ranks),
                           self.mesh.names)
        if not steps:
            self.final[t] = key
            return
        self.final[t] = "grad:" + t
        alike = tuple((kind, axes) for kind, axes, _ in steps)  # a bucket's collectives
        self.reducing[t] = steps
        # DDP's first bucket is small, so that communication starts early in the backward
        cap = self.bucket_bytes if alike in self.flushed else \
            min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        run = self.buckets.setdefault(alike, OpenRun())
        # a run closes where the steps differ: within `alike`, where a reduce-scatter's dim
        # does (one dim per bucket)
        closed = run.grow(t, self.reducing.__getitem__,
                          lambda p: self.nbytes(p, self.home(p), grad=True), cap)
        for names in closed:
            self.flush_bucket(names)
        if not run.items:  # t's bucket reached the cap
            self.flushed.add(alike)

    def flush_bucket(self, names: list[str]) -> None:
        """The reductions of these gradients (reduced alike), each collective one over them
        flattened together, as DDP and FSDP run them: a reduce-scatter leaves each its stored
        shard's part, which the next collective reads."""
        if not names:
            return
        homes = [self.home(p) for p in names]
        keys = [gkey(p, h, None) for p, h in zip(names, homes)]
        shapes = [self.shape(p, h) for p, h in zip(names, homes)]
        nbytes = sum(self.nbytes(p, h, grad=True) for p, h in zip(names, homes))
        steps = self.reducing[names[0]]
        for i, (kind, axes, dst) in enumerate(steps):
            outs = [f"grad:{p}" + ("" if i == len(steps) - 1 else "+scattered") for p in names]
            self.emit_bucket(kind, names, Partial(), dst, "bwd", keys, outs, shapes, axes=axes,
                             nbytes=nbytes)
            if kind == "reduce_scatter":  # what the next collective reads: the shards
                n = self.mesh.size(axes)
                shapes = [tuple(x // n if j == dst.dim else x for j, x in enumerate(shape))
                          for shape in shapes]
                nbytes //= n
            keys = outs

    # -- sharded storage: parameters gathered before use, gradients scattered into the shards --
    def plan_gathers(self) -> set[str]:
        """Split the parameters stored sharded that some op reads whole into buckets of about
        `bucket_bytes` gathered, or an eighth of all (GATHER_BUCKETS; at least
        FIRST_BUCKET_BYTES) where that is less, so that one bucket's gather runs while the
        layers before compute; in the order of their first use (one placement and one dtype
        per bucket: a bucket is one flat buffer); issue the first. Each later bucket is issued
        when the one before it is first needed
        (gather_for: one bucket prefetched, as FSDP does). Return their names."""
        first_use = {}
        for i, node in enumerate(self.g.ops):
            for t in node.inputs:
                first_use.setdefault(t, i)
        names = sorted((p.name for p in self.g.params
                        if isinstance(self.home(p.name), Shard)
                        and self.whole(p.name) in self.converted(p.name)),
                       key=lambda t: first_use.get(t, -1))
        cap = min(self.bucket_bytes, max(FIRST_BUCKET_BYTES, sum(
            self.nbytes(t, self.whole(t)) for t in names) // GATHER_BUCKETS))
        self.gather_buckets: list[list[str]] = []
        for itemsize in sorted({self.itemsize(t) for t in names}):  # one dtype per bucket
            closed, last = runs_under_cap([t for t in names if self.itemsize(t) == itemsize],
                                          self.home, lambda t: self.nbytes(t, self.whole(t)),
                                          cap)  # (bf16 weights apart from float32 norms')
            self.gather_buckets += closed + ([last] if last else [])
        self.gather_buckets.sort(key=lambda bucket: first_use.get(bucket[0], -1))
        self.bucket_of = {t: i for i, bucket in enumerate(self.gather_buckets) for t in bucket}
        self.regather = {t for t in names if t in self.s.reshard}
        self.issued: set[tuple[str, int]] = set()
        if self.gather_buckets:
            self.gather_for([self.gather_buckets[0][0]], "fwd")
        return set(names)

    def gather_for(self, tensors, phase: str) -> None:
        """Issue the gather buckets of these tensors that are not yet issued in this phase, and
        the next bucket after them in the phase's order (the backward's is the reverse)."""
        step = 1 if phase == "fwd" else -1
        needed = sorted({self.bucket_of[t] for t in tensors if t in self.bucket_of and (
            phase == "fwd" or t in self.regather)}, reverse=step < 0)
        for j in needed + [needed[-1] + step] if needed else ():
            if 0 <= j < len(self.gather_buckets) and (phase, j) not in self.issued:
                self.issued.add((phase, j))
                self.gather_bucket(self.gather_buckets[j], phase)

    def gather_bucket(self, bucket: list[str], phase: str) -> None:
        names = [t for t in bucket if phase == "fwd" or t in self.regather]
        if not names:
            return
        home = self.home(names[0])
        self.emit_bucket("all_gather", names, home, self.whole(names[0]), phase,
                         [vkey(t, home, None) for t in names],
                         [self.gathered_key(t, phase) for t in names],
                         [self.shape(t, home) for t in names])

    def gathered_key(self, t: str, phase: str) -> str:
        """The key of parameter t gathered whole: for the forward, or again for the backward."""
        return vkey(t, self.whole(t), None) + ("+again" if phase == "bwd" else "")

    def whole(self, t: str) -> Placement:
        """Replicated, over a machine's ranks or (t living flat) over every rank."""
        return flat(R) if is_flat(self.home(t)) else R

    def scatter_grad(self, t: str, p: Placement, home: Placement) -> None:
        """Parameter t's gradient, complete as a partial sum of its whole (read as p), joins the
        reduce-scatter bucket into its shards (home)."""
        cap = self.bucket_bytes if "scatter" in self.flushed else \
            min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        closed = self.scattered.grow((t, p), lambda b: self.home(b[0]),
                                     lambda b: self.nbytes(b[0], b[1], grad=True), cap)
        for bucket in closed:
            self.flush_scatter(bucket)
        if not self.scattered.items:  # t's bucket reached the cap
            self.flushed.add("scatter")

    def flush_scatter(self, bucket: list[tuple[str, Placement]]) -> None:
        """One reduce-scatter of these gradients; each is then complete in its shard."""
        if not bucket:
            return
        home = self.home(bucket[0][0])
        self.emit_bucket("reduce_scatter", [t for t, _ in bucket], Partial(), home, "bwd",
                         [gkey(t, p, None) for t, p in bucket],
                         [gkey(t, home, None) for t, _ in bucket],
                         [self.shape(t, p) for t, p in bucket],
                         nbytes=sum(self.nbytes(t, p, grad=True) for t, p in bucket))
        for t, _ in bucket:
            self.contributed(t, home, None)

    def emit_bucket(self, kind: str, names: list[str], src: Placement, dst: Placement,
                    phase: str, in_keys: list[str], out_keys: list[str], shapes,
                    axes: tuple[str, ...] | None = None, nbytes: int | None = None) -> None:
        """One collective over the tensors `names` (one of them: a plain conversion) along the
        mesh's `axes` (default: emit_convert's); `nbytes`: their whole size (default: each
        gathered on a machine)."""
        if nbytes is None:
            nbytes = sum(max(self.nbytes(t, self.whole(t)), self.nbytes(t, dst)) for t in names)
        if len(names) == 1:
            return self.emit_convert(kind, names[0], src, dst, phase, None, in_keys[0],
                                     out_keys[0], shapes[0], nbytes, axes=axes)
        for key in in_keys:
            self.wait_for(key)
        axes = self.collective_axes(axes, src, dst)
        group, groups = self.along(axes)
        task = Convert(len(self.tasks), kind, f"bucket({names[0]}..{names[-1]})", src, dst,
                       phase, None, shapes[0], nbytes, group, tuple(in_keys), tuple(out_keys),
                       (), groups, in_shapes=tuple(shapes), axes=axes)
        self.add(task)
        for key in out_keys:
            self.pending.setdefault(key, []).append(task.id)

    def update(self) -> None:
        self.flush_scatter(self.scattered.take())
        for run in self.buckets.values():
            self.flush_bucket(run.take())
        for key in self.final.values():
            self.wait_for(key)
        numel = sum(math.prod(self.stored_shape(p)) for p in self.final)
        opt = self.optimizer  # one kernel over the local parameter shards, costed per element
        self.add(Compute(len(self.tasks), "", opt.op, "update", None, float(opt.flops * numel),
                         float(opt.bytes * numel), (), (), tuple(self.final.values()), ()))
        for task in list(self.tasks):
            if isinstance(task, Convert) and task.collective and task.id not in self.waited:
                self.waited.add(task.id)
                self.add(Wait(len(self.tasks), task.id))
