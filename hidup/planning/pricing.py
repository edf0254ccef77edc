"""What the search programme (hidup.planning.programme) charges for one option of a node: c of
computation (forward + backward, per micro-batch) and m of communication (its input conversions
and their backward duals, per micro-batch, plus its parameters' gradient reduction spread over the
step). A replicated tensor's gradient is a Partial sum where a consumer reads it replicated and
makes a split or Partial output (a column-parallel matmul): the lowering makes it whole once, at
the tensor (the dual of its conversion to R, or an all-reduce where its home is R); the first such
consumer pays that, and the dual of a conversion to R is charged nowhere else. The optimizer's
update of the node's parameter shards is priced at the parameter's first consumer, where its
placement is chosen. Memory counts each parameter, its gradient and the optimizer's state tensors
(hidup.program.OPTIMIZERS). (Pricing gradient reductions as hidden under the backward instead, as
the lowering issues them, won 3-5% on two small models and lost 20-25% on the paper's BERT models
at 16-32 GPUs, where the backward's conversions share the link.) Objective 'comm' counts bytes instead of seconds.

On a mesh (hidup.strategy.Mesh) a conversion is priced as the lowering runs it, step by step
between the two placements' layouts, each step along its axes' groups (hidup.program.conversions;
a flat option's over the world), and a parameter's gradient is reduced into its stored shard as
the lowering reduces it (hidup.program.buckets.reductions): still partial in a row, all-reduced
over the world; whole there, over its mesh column, the columns sharing each machine's link; a
flat parameter's complete over every rank or all-reduced there."""
from __future__ import annotations

import math
from typing import NamedTuple

from hidup.graph import ops
from hidup.graph.capture import Node
from hidup.graph.flops import backward_flops, forward_flops
from hidup.graph.ops.gating import exchanges
from hidup.graph.placement import Partial, Placement, R, Replicate, Shard, ShardingOption, flat, \
    is_flat, is_r, is_whole, plain_option, same
from hidup.strategy import conversion
from hidup.program.buckets import reductions
from hidup.program.tasks import LoweringError

_DUAL = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
         "all_reduce": "all_reduce", "slice": "all_gather"}


class _NodeCost(NamedTuple):
    """What one option of one node costs (seconds, bytes)."""
    compute: float  # forward + backward computation per micro-batch
    grads: float  # its parameters' gradient reductions, per step
    memory: float  # its output per step, and the parameters it is the home of (those it
    #   reads whole counted as the cheaper of whole and stored sharded)
    update: float  # the optimizer's update of those parameters, per step


def _scaled(cost: _NodeCost, weight: int) -> _NodeCost:
    """The cost of `weight` nodes alike."""
    return cost if weight == 1 else _NodeCost(*(x * weight for x in cost))


class Pricing:
    """The programme's prices of conversions and of nodes' options, each priced once
    (a mixin of hidup.planning.programme.Search, whose graph, profile, shapes and caches it
    reads)."""

    def per_mb(self, t: str) -> float:
        """Share of a once-per-step cost carried by one micro-batch."""
        return 1.0 / self.k if isinstance(self.mbs.home(t), Replicate) else 1.0

    def conversion_cost(self, t: str, src: Placement, dst: Placement) -> float:
        """The conversion's time per micro-batch, forward and backward (its dual)."""
        key = (self.alike[t], src, dst)
        if key not in self._converts:
            self._converts[key] = self._conversion_cost(t, src, dst)
        return self._converts[key]

    def _conversion_cost(self, t: str, src: Placement, dst: Placement) -> float:
        """The steps the lowering runs between the two layouts (hidup.program.conversions),
        each along its axes; the alias between a machine's placements and flat ones that hold
        the same pieces is free."""
        if is_flat(src) != is_flat(dst) and not isinstance(self.mbs.home(t), Shard):
            raise LoweringError(f"tensor {t} is not split over the batch: it cannot pass "
                                f"between a machine's placements and flat ones")
        lay, itemsize = self.layouts, self.itemsize(t)
        cost = 0.0
        for step in lay.steps(t, lay.of(t, src), lay.of(t, dst)):
            size = max(lay.numel(t, step.before), lay.numel(t, step.after)) * itemsize
            # the dual of a conversion to R runs only where the gradient comes back as a
            # Partial sum: partial_grad_cost charges it then
            cost += self._collectives(step.kind, size,
                                      t in self.grads and not is_whole(step.dst),
                                      self.per_mb(t), lay.axes(step))
        return cost

    def partial_grad_cost(self, t: str, home: Placement) -> float:
        """Per micro-batch, making whole the Partial gradient of t's replicated value, which the
        lowering does once, however many consumers make it Partial: the dual of its conversion
        to R (a reduce-scatter to a split home, an all-reduce to a Partial one), or an
        all-reduce where t's home is R (hidup.program.lowering's reduced_at)."""
        key = (self.alike[t], home, "grad")
        if key not in self._converts:
            whole = flat(R) if is_flat(home) else R
            size = max(self.nbytes(t, home), self.nbytes(t, whole))
            kind = "all_reduce" if same(home, whole) else _DUAL[conversion(home, whole)]
            if self.objective == "comm":
                cost = float(size)
            else:
                cost = self.scope_time(kind, size, self.scope(is_flat(home)))
            self._converts[key] = cost * self.per_mb(t)
        return self._converts[key]

    def _collectives(self, kind: str, size: int, backward: bool, share: float,
                     axes: tuple[str, ...]) -> float:
        """A conversion's collective of `size` bytes along the mesh's `axes`, and its dual
        where the tensor has a gradient, `share` of it per micro-batch (the layers' tensors
        repeat: computed once)."""
        key = (kind, size, backward, share, axes)
        if key not in self._conversions:
            if self.objective == "comm":
                cost = size * share * (kind != "slice")
            else:
                fwd = 0.0 if kind == "slice" else self.scope_time(kind, size, axes)
                bwd = self.scope_time(_DUAL[kind], size, axes) if backward else 0.0
                cost = (fwd + bwd) * share
            self._conversions[key] = cost
        return self._conversions[key]

    def scope(self, flat: bool) -> tuple[str, ...]:
        """The axes a placement's collectives run along: a row's, or (`flat`) every axis."""
        return self.mesh.names if flat else self.layouts.order[-1:]

    def scope_time(self, kind: str, size: int, axes: tuple[str, ...]) -> float:
        """A collective along the mesh's `axes`, every group's at once: a row's (row_time),
        every rank's, or another's, the groups sharing each machine's link
        (Profile.link_load)."""
        if axes == self.layouts.order[-1:]:
            return self.row_time(kind, size)
        if len(axes) == len(self.mesh.names):
            return sum(self.profile.collective_split(kind, size, self.everyone))
        groups = self.mesh.groups(axes)
        latency, transfer = self.profile.collective_split(kind, size, groups[0])
        return latency + transfer * self.profile.link_load(groups[0], groups)

    def row_time(self, kind: str, size: int) -> float:
        """A conversion's collective over a mesh row, every row's at once: rows that cross the
        machines (data parallel over the GPUs) share each machine's link (Profile.link_load)."""
        latency, transfer = self.profile.collective_split(kind, size, self.group)
        return latency + transfer * self.row_load

    def node_cost(self, node: Node, opt: ShardingOption) -> _NodeCost:
        """What the option costs; objective 'comm' counts bytes, its gradients' as `grads`."""
        kind = self._node_kinds.get(node.name)
        if kind is None:
            here = self.position[node.name]
            kind = self._node_kinds[node.name] = (
                node.op, repr(node.args), self.alike[node.name],
                tuple((self.alike[t], self.g.node(t).kind, self.first[t] == here)
                      for t in node.inputs), self.kept_share.get(node.name, 1.0))
        key = kind, opt
        if key not in self._node_costs:
            self._node_costs[key] = self._node_cost(node, opt)
        return self._node_costs[key]

    def _node_cost(self, node: Node, opt: ShardingOption) -> _NodeCost:
        ins = [self.shape(t, p) for t, p in zip(node.inputs, opt.inputs)]
        out = self.shape(node.name, opt.output)
        fwd = forward_flops(node.op, ins, out, node.args, exchanges(node, plain_option(opt)))
        nbytes = sum(math.prod(s) for s in ins + [out]) * node.out.itemsize
        compute = self.profile.kernel_time(fwd, nbytes) + \
            self.profile.kernel_time(backward_flops(node.op, fwd, ins, out, node.args),
                                     2 * nbytes) + \
            sum(self.scope_time(kind, b, self.scope(is_flat(opt.output)))
                for backward in (False, True)
                for kind, b in ops.inner_collectives(node, plain_option(opt), tuple(ins), backward))
        if is_r(self.mbs.home(node.name)):
            compute /= self.k  # runs once per step
        grads = 0.0
        memory, update, numel = math.prod(out) * node.out.itemsize * self.k * \
            self.kept_share.get(node.name, 1.0), 0.0, 0
        for t, p in zip(node.inputs, opt.inputs):
            param = self.g.node(t)
            if param.kind == "param":
                size = self.nbytes(t, p)
                partial = opt.partial_gradient(p)
                if partial or self.first[t] == self.position[node.name]:
                    grads += self.grad_reduction(t, p, partial, size)
                if self.first[t] == self.position[node.name]:  # its home: where it lives
                    held = (2 + self.optimizer.states) * size  # parameter, gradient, state
                    if is_r(p) and self.world > 1:  # or stored sharded (the ranking's +sharded
                        #   variant): a shard of each, and the weight gathered for use
                        held = min(held, size + held / self.world)
                    memory += held
                    if param.out.is_float:
                        numel += math.prod(self.shape(t, p))  # the shard it updates
        if numel and self.objective == "time":  # a share of the one update kernel, no launch
            update = self.profile.kernel_time(self.optimizer.flops * numel,
                                              self.optimizer.bytes * numel) \
                - self.profile.op_overhead
        if self.objective == "comm":
            compute = 0.0
        return _NodeCost(compute, grads, memory, update)

    def grad_reduction(self, t: str, p: Placement, partial: bool, nbytes: int) -> float:
        """Reducing parameter t's gradient into its stored shard, where it is read as p (a
        Partial sum there where `partial`), as the lowering does it (buckets.reductions):
        along the dp axes, each part's partial sum; along the axes where it is a Partial sum
        and stored whole an all-reduce (a reduce-scatter where stored sharded); objective
        'comm': their bytes."""
        lay = self.layouts
        g = Partial() if partial else R if is_whole(p) else p  # as the lowering's gplace
        grad = lay.in_mesh_order(lay.of_grad(t, p, g))
        stored = lay.in_mesh_order(lay.of(t, p))  # as Strategy.storage (nothing across)
        steps = reductions(grad, stored, self.mesh.names)
        if self.objective == "comm":
            return float(nbytes) * len(steps)
        return sum(self.scope_time(kind, nbytes, axes) for kind, axes, _ in steps)

    def costs(self, node: Node, opt: ShardingOption) -> tuple[_NodeCost | None, _NodeCost | None]:
        """The option's cost with k micro-batches (None where its splits do not divide by
        them) and with one (None where there is no plain pricing); LoweringError where it
        divides by neither. A node that stands for several (Search.weights) costs as many
        times."""
        weight = self.weights.get(node.name, 1)
        if self.plain is self:
            cost = _scaled(self.node_cost(node, opt), weight)
            return cost, cost
        plain = _scaled(self.plain.node_cost(node, opt), weight) \
            if self.plain is not None else None
        try:
            return _scaled(self.node_cost(node, opt), weight), plain
        except LoweringError:
            if plain is None:
                raise
            return None, plain  # a plan that runs with one micro-batch only
