"""Lowering: (graph, strategy, world size, k micro-batches) -> the Program of one training step.

Forward: node-major within a micro-batch; each conversion is issued right after its producer and
waited for right before its consumer; micro-batches are interleaved so that one's communication
runs while another computes. Backward: the same in reverse, each gradient conversion issued as
soon as its gradient is complete. Parameter gradients are reduced once per step, in buckets.

On a 2-D mesh (strategy.mesh) every group along its dp axis (a column) runs the same step on
its part of the batch: the strategy's conversions run inside each row (the groups along the other
axis), and the parts' parameter gradients are summed across them: a gradient still partial in a
row in one all-reduce over the world, one already complete there (a shard, or replicated) over
its column. The reported loss is summed the same way. An op whose option is flat
(hidup.graph.placement) runs over every rank instead, as on a 1-D mesh of them all. Every
conversion runs axis by axis between the two placements' layouts (one placement per mesh axis:
hidup.program.conversions), so a tensor passes between a machine's placements and flat ones as
any other."""
from __future__ import annotations

import math

from hidup.graph import ops
from hidup.graph.capture import Graph
from hidup.graph.flops import backward_flops, forward_flops
from hidup.graph.placement import (Partial, Placement, R, Replicate, Shard, flat, is_flat,
                                   is_r, is_whole, plain_option, same)
from hidup.graph.saved import backward_saves
from hidup.graph.ops.gating import exchanges
from hidup.graph.tokens import TOKENS

from hidup.strategy import Mesh, Strategy, microbatch_split
from hidup.program.buckets import GradientBuckets, OpenRun
from hidup.program.microbatches import MicroBatches
from hidup.program.recompute import Recomputation
from hidup.program.conversions import Conversions, Layouts
from hidup.program.tasks import (BUCKET_BYTES, COLLECTIVES, Compute, Convert,
                                 LoweringError, Program, Task, Wait, gkey,
                                 optimizer_cost, Shapes, param_key, vkey)

# views whose output is not contiguous: a composite that views a contiguous input copies theirs
_STRIDED = frozenset(f"aten.{op}" for op in (
    "transpose.int", "permute.default", "expand.default", "slice.Tensor", "select.int", "t.default",
    "as_strided.default", "diagonal.default", "narrow.default", "unfold.default",
    "movedim.int"))


class Lowering(MicroBatches, GradientBuckets, Recomputation, Conversions):
    """Forward: node-major, micro-batch-minor; each conversion is issued right after its producer
    and waited for right before its consumer, so with k >= 2 one micro-batch's communication runs
    while the next one computes. Backward: the same in reverse, each gradient conversion issued as
    soon as its gradient is complete. Parameter gradients are reduced once per step."""

    def __init__(self, graph: Graph, strategy: Strategy, world: int, k: int, model: str,
                 bucket_bytes: int = BUCKET_BYTES, optimizer: str = "adamw"):
        self.g, self.s, self.k, self.model = graph, strategy, k, model
        self.dp_parts, self.ranks = strategy.parts, world  # the mesh's data-parallel parts
        self.world = world // self.dp_parts  # what the placements split over: a row's ranks
        self.optimizer = optimizer_cost(optimizer)
        self.bucket_bytes, self.flushed = bucket_bytes, set()
        # the buckets of gradients awaiting their reductions, one per way of reducing them
        #   (buckets.reductions: the collectives and their axes), in the order of first use
        self.buckets: dict[tuple, OpenRun] = {}
        self.reducing: dict[str, tuple] = {}  # parameter -> its gradient's reductions
        self.scattered = OpenRun()  # (gradient, placement) awaiting a reduce-scatter
        self.mbs_split = microbatch_split(graph, k, dp=self.dp_parts)
        self.parts = k * self.dp_parts
        self.joins: bool = self.parts > 1 and any(  # an op reads micro-batches joined or sliced
            not same(q, self.mbs_split.home(t)) for n in graph.ops
            for t, q in zip(n.inputs, self.mbs_split.options[n.name].inputs))
        if self.joins and self.dp_parts > 1:
            raise LoweringError(f"{model or 'the model'}: some op needs the whole batch "
                                f"({self.mbs_split.notes[0] if self.mbs_split.notes else 'a join'})"
                                f", which a 2-D mesh's parts would have to join; use a 1-D "
                                f"mesh (one machine) for it")
        self.mesh = strategy.mesh or Mesh.line(world)
        # the mesh axes collectives run along: a row's (the axis the placements split over), a
        # column's (the data-parallel axis: one place in every row), or every axis (the world)
        self.row_axes = (self.mesh.split_axis(strategy.dp),)
        self.column_axes = strategy.dp
        self._along: dict[tuple[str, ...], tuple] = {}
        self.layouts = Layouts(graph, self.mbs_split, self.mesh, strategy.dp, k)
        shapes = Shapes(graph, self.mbs_split, self.world, self.parts, self.dp_parts)
        self.shape, self.nbytes, self.itemsize = shapes.shape, shapes.nbytes, shapes.itemsize
        #   (tensor, placement) -> local; tensor -> its run itemsize
        self._kernels: dict[str, tuple] = {}  # node -> kernel()
        self.home = {n.name: strategy.home(n.name) for n in graph.nodes}.__getitem__  # tensor ->
        #   where it lives after it is produced
        self.once: set[str] = set()  # the tensors held once per step, not per micro-batch
        #   (parameters, what they make): replicated over micro-batches and made of such only,
        #   or of the micro-batches joined (an op that makes the same value from each
        #   micro-batch's input runs on each)
        self.after_join: set[str] = set()  # once-per-step ops that wait for a join
        for n in graph.nodes:
            mb_in = self.mbs_split.options[n.name].inputs if n.kind == "op" else ()
            joined = [self.joined(t, q) for t, q in zip(n.inputs, mb_in)]
            if isinstance(self.mbs_split.home(n.name), Replicate) and \
                    all(t in self.once or j for t, j in zip(n.inputs, joined)):
                self.once.add(n.name)
                if any(joined) or self.after_join & set(n.inputs):
                    self.after_join.add(n.name)
        self.written: set[str] = {vkey(n.name, strategy.home(n.name), m) for n in graph.nodes
                                  if n.kind != "op" for m in self.mbs(n.name)}
        self.tasks: list[Task] = []
        self.pending: dict[str, list[int]] = {}  # value key -> collectives that write it
        self.waited: set[int] = set()  # collectives already waited for
        self.uses = {n.name: [] for n in graph.nodes}  # tensor -> [(consumer, position, placement)]
        self._converted: dict[tuple[str, bool], tuple[Placement, ...]] = {}  # converted()
        for node in graph.ops:
            for i, (t, p) in enumerate(zip(node.inputs, strategy.options[node.name].inputs)):
                self.uses[t].append((node, i, p))
        for _, t in graph.updates:  # the value written into a buffer: whole on every rank
            self.uses[t].append((None, 0, R))
        self._grad_analysis()
        self.plan_recompute()
        self.across = dict(strategy.across)
        self.check_across()
        self.check_flat()

    def add(self, task: Task) -> None:
        self.tasks.append(task)
        self.written.update(getattr(task, "outputs", ()))

    # -- gradients: which tensors get one, and replicated gradients' kind (R or P) ------------
    def _grad_analysis(self) -> None:
        """A replicated value's gradient is a Partial sum where a consumer reads it replicated
        and makes a split or Partial output (as a column-parallel matmul does), else replicated.
        An op's replicated output whose gradient is Partial is all-reduced there, once its
        gradient is complete (Megatron's f), so its producer's backward, and every op before it
        in the replicated region, sees a replicated gradient: the region computes it on every
        rank and its parameters' gradients are whole. (Carried back instead, the Partial sum
        would make every parameter there all-reduced, a cost the search does not see.)"""
        g, s = self.g, self.s
        self.has_grad = g.gradients
        self.r_kinds: dict[str, set[str]] = {}  # tensor -> kinds of contributions to grad of its R value
        for node in g.ops:
            if node.name not in self.has_grad:
                continue
            self._conversion_kinds(node.name)
            for t, p in zip(node.inputs, s.options[node.name].inputs):
                if t in self.has_grad and is_whole(p):
                    kind = "P" if s.options[node.name].partial_gradient(p) else "R"
                    self.r_kinds.setdefault(t, set()).add(kind)
        for p in g.params:
            self._conversion_kinds(p.name)
        self.reduced_at = {t for t in self.has_grad if g.node(t).kind == "op"
                           and is_whole(self.home(t)) and "P" in self.r_kinds.get(t, ())}
        self.expected: dict[str, int] = {}
        mb_reads = set()  # (t, p, q) read joined or sliced: its backward adds to t's gradient
        for node in g.ops:
            if node.name not in self.has_grad:
                continue
            mb_in = self.mbs_split.options[node.name].inputs
            for t, p, q in zip(node.inputs, s.options[node.name].inputs, mb_in):
                if t in self.has_grad:
                    for m in self.mbs(node.name):
                        key = "d" + self.read_key(t, p, q, m)
                        self.expected[key] = self.expected.get(key, 0) + 1
                    if self.mb_converted(t, q):
                        mb_reads.add((t, p, q))
        for t, p, q in mb_reads:  # a join's gradient goes to each micro-batch; a slice's
            for m in (range(self.k) if is_r(q) else [None]):  # gradients, gathered, to the whole
                key = gkey(t, p, m)
                self.expected[key] = self.expected.get(key, 0) + 1
        for t in self.has_grad:  # each conversion a differentiated op reads adds once, in its
            for _ in self.converted(t, differentiated=True):  # backward, to t's own gradient
                for m in self.mbs(t):
                    key = gkey(t, self.home(t), m)
                    self.expected[key] = self.expected.get(key, 0) + 1

    def _conversion_kinds(self, t: str) -> None:
        if is_whole(self.home(t)) and self.converted(t):
            self.r_kinds.setdefault(t, set()).add("R")  # a slice's gradient is all-gathered

    def out_grad(self, t: str, m: int | None) -> str:
        """The key of the gradient that op t's backward reads: its home's, all-reduced first
        where that is a Partial sum (reduced_at)."""
        key = gkey(t, self.home(t), m)
        return key + "+reduced" if t in self.reduced_at else key

    def gplace(self, t: str, p: Placement) -> Placement:
        """Placement of the gradient of tensor t held as p (flat where p is)."""
        if isinstance(p, Shard):
            return p
        g = R if isinstance(p, Partial) else Partial() if "P" in self.r_kinds.get(t, ()) else R
        return flat(g) if is_flat(p) else g

    def layout(self, t: str, p: Placement) -> tuple[Placement, ...]:
        """Where tensor t's value held as p is: one DTensor placement per mesh axis, in the
        mesh's order (Layouts.of)."""
        return self.layouts.in_mesh_order(self.layouts.of(t, p))

    def grad_layout(self, t: str, p: Placement) -> tuple[Placement, ...]:
        """Where the gradient of tensor t held as p is, once complete on a rank: one placement
        per mesh axis, in the mesh's order (Layouts.of_grad)."""
        return self.layouts.in_mesh_order(self.layouts.of_grad(t, p, self.gplace(t, p)))

    def converted(self, t: str, differentiated: bool = False) -> tuple[Placement, ...]:
        """Placements that consumers (with `differentiated`: those whose backward runs) need t
        in, other than its home (each needs a conversion); once per tensor (asked per
        micro-batch and per reader)."""
        key = t, differentiated
        if key not in self._converted:
            home = self.home(t)
            self._converted[key] = tuple(dict.fromkeys(
                p for node, _, p in self.uses[t] if not same(p, home) and (
                    not differentiated or node is not None and node.name in self.has_grad)))
        return self._converted[key]

    # -- emitting tasks -----------------------------------------------------------------------
    def emit_convert(self, kind, t, src, dst, phase, m, in_key, out_key, shape, nbytes,
                     root_axes: tuple[str, ...] = (), axes: tuple[str, ...] | None = None
                     ) -> None:
        """A conversion of one tensor; a collective or slice runs along `axes` (default: a
        row's, or every axis between flat placements); `root_axes`: its result is added on the
        first rank along them only."""
        self.wait_for(in_key)  # its input complete: no collective still writing it
        axes = self.collective_axes(axes, src, dst) if kind in COLLECTIVES or kind == "slice" \
            else ()
        group, groups = self.along(axes) if kind in COLLECTIVES else ((), ())
        task = Convert(len(self.tasks), kind, t, src, dst, phase, m, shape, nbytes, group,
                       (in_key,), (out_key,), (out_key,) if root_axes else (), groups,
                       axes=axes, root_axes=root_axes)
        self.add(task)
        if task.collective:
            self.pending.setdefault(out_key, []).append(task.id)

    def collective_axes(self, axes: tuple[str, ...] | None, src: Placement,
                        dst: Placement) -> tuple[str, ...]:
        """The axes a collective between src and dst runs along: `axes` where given, else a
        row's, or every axis where src or dst is flat (over every rank)."""
        if axes is not None:
            return axes
        return self.mesh.names if is_flat(src) or is_flat(dst) else self.row_axes

    def along(self, axes: tuple[str, ...]) -> tuple:
        """(rank 0's group, every group) of a collective along the mesh's `axes`; the groups
        are () where one group holds every rank."""
        if axes not in self._along:
            groups = self.mesh.groups(axes)
            self._along[axes] = groups[0], groups if len(groups) > 1 else ()
        return self._along[axes]

    def wait_for(self, key: str) -> None:
        for cid in self.pending.get(key, []):
            if cid not in self.waited:
                self.waited.add(cid)
                self.add(Wait(len(self.tasks), cid))

    def convert_for_consumers(self, t: str, m: int | None, skip: Placement | None = None,
                              phase: str = "fwd", only=None) -> None:
        """t (micro-batch m) from its home to each placement its consumers read (of `only`,
        where given), but `skip`."""
        made: set[str] = set()
        for p in self.converted(t):
            if not same(p, skip) and (only is None or any(same(p, o) for o in only)):
                self.emit_value_conversion(t, self.home(t), p, phase, m, made)

    def in_keys(self, node, m) -> list[str]:
        opt, mb_opt = self.s.options[node.name], self.mbs_split.options[node.name]
        return [self.read_key(t, p, q, m)
                for t, p, q in zip(node.inputs, opt.inputs, mb_opt.inputs)]

    def forward(self) -> list[str]:
        self.gather_across()
        gathered = self.plan_gathers()  # in buckets, each issued before its first use
        for node in self.g.nodes:
            if node.kind != "op":
                for m in self.mbs(node.name):
                    self.convert_for_consumers(
                        node.name, m, self.whole(node.name) if node.name in gathered else None)
        self.loss_keys: list[str] = []
        # an op computed once per step (from parameters only, or after a join) runs where the
        # first micro-batch to reach it needs it: a weight's gathered copy is made where its
        # layer runs, not for every layer at the start
        self.interleave(self.g.ops, self.forward_node, self.in_keys, self.inputs_ready)
        self.updates = {}  # buffer -> the key of its new value: whole on every rank, joined
        for buffer, t in self.g.updates:  # where the micro-batches hold parts of it
            self.updates[buffer] = self.read_key(t, R, R, 0)
            if self.joined(t, R):
                self.emit_mb_conversion(t, R, R, None)
        return self.loss_keys

    def forward_node(self, node, m) -> None:
        opt, mb_opt = self.s.options[node.name], self.mbs_split.options[node.name]
        for t, p, q in zip(node.inputs, opt.inputs, mb_opt.inputs):
            if self.mb_converted(t, q):
                self.emit_mb_conversion(t, p, q, m)
        self.gather_for(node.inputs, "fwd")
        keys = self.in_keys(node, m)
        for key in keys:
            self.wait_for(key)
        ins, out, flops, nbytes, partial, _ = self.kernel(node)
        reads, keeps = self.saves(node, keys, ins)
        self.add(Compute(
            len(self.tasks), node.name, node.op, "fwd", m, flops, nbytes, ins, out, tuple(keys),
            (vkey(node.name, opt.output, m),), opt, partial, reads=reads, keeps=keeps,
            alias=self.aliases(node), scratch=self.scratch(node, ins, backward=False),
            inner=self.inner(node, opt, ins, backward=False)))
        self.convert_for_consumers(node.name, m)
        if node.name == self.g.loss:
            self.loss_keys.append(self._report_loss(m))

    def saves(self, node, keys, ins) -> tuple[tuple[bool, ...] | None, int]:
        """What autograd keeps of the node's forward on these input keys of local shapes `ins`,
        where it has a backward (nothing, where the backward differentiates the node again:
        Recomputation.again): whether it keeps each input and its output, and the local bytes
        of what else it keeps (hidup.graph.saved: its own tensors, scaled from the whole
        shapes by the inputs' local share, and autocast's copies of the inputs; a parameter
        the run converts at its compute dtype needs no copy: the converted value is kept)."""
        if node.name in self.again:
            return (False,) * (len(node.inputs) + 1), 0
        if node.name not in self.has_grad:
            return None, 0
        saves = backward_saves(self.g, node)
        reads, keeps = list(saves.reads), 0
        for i, (t, key, copy, shape) in enumerate(zip(node.inputs, keys, saves.copies, ins)):
            if copy and self.computed_at_run_dtype(t, key):
                reads[i] = True
            elif copy:
                keeps += copy * math.prod(shape) // max(1, self.g.node(t).out.numel)
        return tuple(reads), keeps + self.local_share(node, saves.own, ins)

    def scratch(self, node, ins, backward: bool) -> int:
        """Local bytes the node's forward (or backward) holds only while it runs, on inputs of
        local shapes `ins` (hidup.graph.saved: a composite's intermediates)."""
        if not node.out.is_float:
            return 0
        return self.local_share(node, backward_saves(self.g, node).scratch[backward], ins)

    def inner(self, node, opt, ins, backward: bool) -> tuple[tuple[str, int], ...]:
        """(kind, bytes) of the collectives the node runs inside itself (most run none)."""
        if not ops.runs_inner(node.op):
            return ()
        return ops.inner_collectives(node, plain_option(opt), ins, backward)

    def local_share(self, node, nbytes: int, ins) -> int:
        """`nbytes` measured at the node's whole shapes, scaled by its inputs' local share; a
        per-token region's by its rows' and experts' share (what it keeps is made of the rows
        it computes, however large the weights it reads whole: Region.share)."""
        if not nbytes:
            return 0
        if node.op == TOKENS:
            sent = exchanges(node, plain_option(self.s.options[node.name]))
            return int(nbytes * node.args[0].share(ins, sent))
        whole = sum(m.numel for m in node.in_metas(self.g))
        return nbytes * sum(map(math.prod, ins)) // max(1, whole)

    def aliases(self, node) -> bool:
        """Does the node's output share its first input's memory in the run: a composite that
        views where it can (hidup.graph.saved: reshape, contiguous, a cast to the dtype the
        value has, dropout with p = 0), on an input that is contiguous (not made by a view that
        reorders or repeats elements)? Views by schema the memory model knows itself."""
        if not node.inputs or self.g.node(node.inputs[0]).op in _STRIDED:
            return False
        return node.out.is_float and backward_saves(self.g, node).alias

    def computed_at_run_dtype(self, t: str, key: str) -> bool:
        """Is `key` parameter t converted at the dtype its readers compute it in (the executor
        casts a stored parameter before converting it; hidup.graph.dtypes.RunDtypes.compute)?"""
        run = self.g.run
        return run is not None and t in run.compute and \
            key != param_key(self.s, t)

    def kernel(self, node) -> tuple:
        """The node's forward kernel, the same for every micro-batch: (input shapes, output
        shape, FLOPs, bytes moved, whether its output is a partial sum over micro-batches, the
        inputs' bytes). Kept with the graph for each option, world and split: the search lowers
        dozens of strategies that share most of their options."""
        if node.name not in self._kernels:
            opt, mb_opt = self.s.options[node.name], self.mbs_split.options[node.name]
            key = node.name, opt, mb_opt, self.world, self.parts
            shared = self.g.__dict__.setdefault("_kernels", {})
            if key not in shared:
                mb_in = mb_opt.inputs
                ins = tuple(self.shape(t, p, q) for t, p, q in zip(node.inputs, opt.inputs, mb_in))
                out = self.shape(node.name, opt.output)
                nbytes = sum(self.nbytes(t, p, q)
                             for t, p, q in zip(node.inputs, opt.inputs, mb_in))
                shared[key] = (ins, out, forward_flops(node.op, ins, out, node.args,
                                                       exchanges(node, plain_option(opt))),
                               nbytes + self.nbytes(node.name, opt.output),
                               isinstance(mb_opt.output, Partial), nbytes)
            self._kernels[node.name] = shared[key]
        return self._kernels[node.name]

    def _report_loss(self, m) -> str:
        """The loss of micro-batch m, whole on every rank: all-reduced along the mesh axes where
        its value is a partial sum (a row's ranks where the loss is Partial there; the dp axes,
        each part holding its own part of the batch's)."""
        t, home = self.g.loss, self.home(self.g.loss)
        axes = tuple(a for a, p in zip(self.mesh.names, self.layout(t, home))
                     if isinstance(p, Partial))
        if not axes:
            return vkey(t, home, m)
        whole = flat(R) if is_flat(home) else R
        out = f"{vkey(t, R, m)}+machines" if same(home, R) else vkey(t, whole, m)
        self.emit_convert("all_reduce", t, Partial() if same(home, R) else home, whole, "fwd",
                          m, vkey(t, home, m), out, self.shape(t, home), self.nbytes(t, home),
                          axes=axes)
        return out

    def backward(self) -> dict[str, str]:
        self.final: dict[str, str] = {}
        loss = self.g.loss
        for m in self.mbs(loss):
            shape = self.shape(loss, self.home(loss))
            self.add(Compute(len(self.tasks), loss, "hidup.ones", "bwd", m, 0.0, 0.0, (), shape,
                             (), (gkey(loss, self.home(loss), m),)))
        nodes = [n for n in reversed(self.g.ops) if n.name in self.has_grad]
        reduced = {p.name for p in self.g.params if p.name in self.has_grad
                   and isinstance(self.gplace(p.name, self.home(p.name)), Partial)}
        # a parameter's gradient is reduced once every micro-batch has added to it: no micro-batch
        # runs far ahead past nodes that add to one, so reductions start early, under the
        # backward; an op computed once per step runs its backward as soon as every micro-batch
        # has added to its gradient (the micro-batches switch until then), so that gradient is
        # not held to the end of the step
        self.interleave(nodes, self.backward_node,
                        lambda n, m: [self.out_grad(n.name, m)],
                        lambda n, m: not self.expected.get(gkey(n.name, self.home(n.name), m)),
                        {n.name for n in nodes if reduced & set(n.inputs)})
        return self.final

    def backward_node(self, node, m) -> None:
        opt, mb_opt = self.s.options[node.name], self.mbs_split.options[node.name]
        grad_in = self.out_grad(node.name, m)
        self.recompute_before(node, m)  # its layer's forward again, where it is recomputed
        self.wait_for(grad_in)
        self.gather_for(node.inputs, "bwd")
        fwd_keys = tuple(  # what the forward read: a parameter resharded after it, gathered again
            self.gathered_key(t, "bwd") if t in self.regather and same(p, self.whole(t)) else key
            for t, p, key in zip(node.inputs, opt.inputs, self.in_keys(node, m)))
        for t, key in zip(node.inputs, fwd_keys):  # read now, not as the forward saved them:
            if t in self.regather or node.name in self.again:  # wait for what made them again
                self.wait_for(key)
        outs, root, done = [], [], []
        for t, p, q in zip(node.inputs, opt.inputs, mb_opt.inputs):
            if t not in self.has_grad:
                outs.append("")
                continue
            key = "d" + self.read_key(t, p, q, m)
            outs.append(key)
            done.append((t, p, q, m))
            if is_whole(p) and not opt.partial_gradient(p) and not is_whole(self.gplace(t, p)):
                #   a whole
                #   contribution to a Partial sum: one rank adds it
                root.append(key)
        ins, out, fwd, nbytes, partial, read = self.kernel(node)  # the backward reads what
        nbytes += read  # the forward did and writes its inputs' gradients
        self.add(Compute(
            len(self.tasks), node.name, node.op, "bwd", m,
            backward_flops(node.op, fwd, ins, out, node.args),
            nbytes, ins, out, (grad_in,) + fwd_keys, tuple(outs), opt, partial, tuple(root),
            again=node.name in self.again, scratch=self.scratch(node, ins, backward=True),
            inner=self.inner(node, opt, ins, backward=True)))
        for t, p, q, mm in done:
            if self.mb_converted(t, q):
                self.mb_contributed(t, p, q, mm)
            else:
                self.contributed(t, p, self.in_mb(t, mm))

    def contributed(self, t: str, p: Placement, m: int | None) -> None:
        """One more contribution to the gradient of t held as p; once complete, send it on."""
        key = gkey(t, p, m)
        self.expected[key] -= 1
        if self.expected[key]:
            return
        home = self.home(t)
        if not same(p, home):
            self.grad_conversion(t, p, home, m)
        elif self.g.node(t).kind == "param":
            self.param_grad(t, home)
        elif t in self.reduced_at:
            self.emit_convert("all_reduce", t, self.gplace(t, home), home, "bwd", m, key,
                              self.out_grad(t, m), self.shape(t, home),
                              self.nbytes(t, home, grad=True))

    def run(self) -> Program:
        loss_keys = self.forward()
        final = self.backward()
        self.update()
        run = self.g.run
        return Program(self.model, self.g.fingerprint, self.s.name, self.ranks, self.k,
                       tuple(self.tasks), tuple(loss_keys), final, self.optimizer.name,
                       self.s.mesh, self.s.dp, self.updates,
                       "fp32" if run is None else run.precision,
                       {n.name: n.out.dtype for n in self.g.nodes},
                       {} if run is None else dict(run.compute))


def lower(graph: Graph, strategy: Strategy, world: int, k: int = 1, model: str = "",
          bucket_bytes: int = BUCKET_BYTES, optimizer: str = "adamw") -> Program:
    """Strategy + world size + k micro-batches -> the Program of one training step of any rank.
    Replicated parameters' gradients are all-reduced in buckets of about `bucket_bytes`, as DDP
    does (0: one all-reduce per parameter). The update task is costed as `optimizer` (a key of
    hidup.program.OPTIMIZERS) runs, and the Program records it."""
    if k < 1 or world < 1:
        raise LoweringError(f"world size ({world}) and micro-batches k ({k}) must be at least 1")
    if strategy.mesh and strategy.mesh.world != world:
        raise LoweringError(f"strategy {strategy.name} is for the mesh {strategy.mesh} of "
                            f"{strategy.mesh.world} GPUs, not {world}; plan it for {world} GPUs")
    return Lowering(graph, strategy, world, k, model, bucket_bytes, optimizer).run()
