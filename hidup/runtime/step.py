"""The compiled step: a Program -> one FX graph per rank that does the whole training step
(forward, backward, gradient reductions, SGD update) as generated code.

`trace_step` runs the Program's tasks once on fake tensors, recording every ATen op they call
(hidup.runtime.record, what make_fx records, faster): a forward task records
its node's ATen ops under autograd, a backward task calls autograd.grad on that node alone (the
first forward of a recomputed layer records nothing; its 'recompute' tasks do, right before its
backward), a collective is a functional collective (torch.ops._c10d_functional) issued at its
Convert and waited for (`wait_tensor`) at its Wait. What is recorded is the graph: its node order
is the Program's, so Duplex's interleaving is the order of the code that runs, and no autograd
graph, detach or per-task Python is left at run time. Every graph node carries its task's id
(`node.meta['custom']['task']`), which the profiler labels and calibration.ops use
(hidup.runtime.passes)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.fx.traceback as fx_traceback

from hidup.graph import ops
from hidup.graph.capture import Graph
from hidup.graph.ops.dispatch import STAND_IN, register_group
from hidup.graph.placement import (Partial, R, Shard, ShardingOption, option_is_flat,
                                   plain_option)
from hidup.strategy import Strategy, microbatch_split
from hidup.program.tasks import (MB_CONVERSIONS, Compute, Convert, Program, Wait, param_key,
                                 vkey)
from hidup.runtime.collectives import PACKING, issue, stand_in
from hidup.runtime.layout import mb_join, mb_part, shard_of
from hidup.runtime.passes import simplify
from hidup.runtime.record import record
from hidup.runtime.values import Values

_C = torch.ops._c10d_functional
INPUT_TASK = -1  # the graph nodes that cut the global batch into this rank's shards


@dataclass(frozen=True)
class StepSpec:
    """What one rank's traced step is built from (the Program, this rank, how to communicate)."""

    graph: Graph
    strategy: Strategy
    program: Program
    rank: int  # in the world (on a 2-D mesh: Program.position places it)
    # the process groups of the collectives, by the mesh axes they run along (Convert.axes):
    # every axis' (the world's), and on a 2-D mesh this rank's group along each axis (empty
    # with world size 1 or collectives stood in)
    group_names: dict[tuple[str, ...], str]
    autocast: torch.dtype | None = None  # each node's forward under torch.autocast (bf16);
    #   its output kept in autocast's dtype, as eager keeps it (activations and their gradients
    #   in bf16 where autocast makes them so, weights and their gradients float32)
    device_type: str = "cpu"
    local_collectives: bool = False  # calibration: collectives stood in by local copies
    # every rank on a thread of one process: collectives exchanged in memory, by the ranks of
    # each group (hidup.runtime.local_world; the untraced step only)
    exchange: object | None = None


class _TaskRunner:
    """Runs a Program's tasks in order on this rank's values; traced once by `trace_step`."""

    def __init__(self, spec: StepSpec, update: bool):
        self.spec, self.update_params = spec, update
        self.g, self.s, self.p = spec.graph, spec.strategy, spec.program
        # the placements split over a row's ranks; the columns split the batch (2-D mesh)
        self.world, self.k = self.p.row, self.p.k
        self.part, self.rank = self.p.position(spec.rank)
        self.mbs = microbatch_split(self.g, self.k, dp=self.p.parts)
        self.backward_of = {(t.node, t.mb): t for t in self.p.tasks if isinstance(t, Compute)
                            and t.phase == "bwd" and t.op != "hidup.ones"}
        # forwards run again before their backward (activation checkpointing): the first run
        # keeps nothing for the backward, the recomputation does
        self.recomputed = {(t.node, t.mb) for t in self.p.tasks if isinstance(t, Compute)
                           and (t.phase == "recompute" or t.again)}
        # where micro-batches are joined, each one's part of the batch is a piece of every
        # rank's block (shard_of), so that joined they make this rank's shard
        self.rank_blocks = any(isinstance(t, Convert) and t.kind in MB_CONVERSIONS
                               for t in self.p.tasks)
        # stored parameter shards converted at their compute dtype (bf16 gathers, as FSDP2's
        # mixed precision; Program.compute), and the dtype of each parameter's gradient
        self.cast = {param_key(self.s, t): getattr(torch, d)
                     for t, d in self.p.compute.items()}
        self.master = {n.name: getattr(torch, n.out.dtype) for n in self.g.params}

    def annotate(self, meta: dict):
        """Mark the graph nodes the block records with `meta` (their task: the profiler labels
        and calibration.ops read it); nothing where the ranks run on threads (local_world): the
        marks are a global of torch.fx, which threads would garble for later traces."""
        return nullcontext() if self.spec.exchange is not None else fx_traceback.annotate(meta)

    def __call__(self, params, buffers, inputs, lr):
        """params, buffers, inputs: lists in the graph's order (this rank's parameter shards, the
        whole buffers and the whole global batch); lr a 0-d tensor. Returns [loss] (update) or
        [loss, *gradients] (no update)."""
        self.env, self.saved, self.pending = Values(), {}, {}
        with self.annotate({"task": INPUT_TASK}):
            self.place_inputs(params, buffers, inputs)
        for task in self.p.tasks:
            if isinstance(task, Compute) and task.phase == "update" and not self.update_params:
                continue
            with self.annotate({"task": task.id}):
                self.run_task(task, params, lr)
        for node, buf in zip((n for n in self.g.nodes if n.kind == "buffer"), buffers):
            if node.name in self.p.buffer_updates:  # as eager's in-place update of the buffer
                buf.copy_(self.env[self.p.buffer_updates[node.name]])
        loss = self.env[self.p.loss_keys[0]]
        for key in self.p.loss_keys[1:]:
            loss = loss + self.env[key]
        if self.update_params:
            return [loss]
        return [loss] + [self.env[key] for key in self.p.param_grads.values()]

    def place_inputs(self, params, buffers, inputs) -> None:
        self.whole_values = {n.name: x for n, x in zip(self.g.user_inputs, inputs)}
        for node, p in zip(self.g.params, params):
            self.env[param_key(self.s, node.name)] = p
        given = {"buffer": iter(buffers), "input": iter(inputs)}
        for node in self.g.nodes:
            if node.kind not in given:
                continue
            full, split = next(given[node.kind]), self.mbs.home(node.name)
            if node.kind == "input" and isinstance(split, Shard) and self.p.parts > 1:
                full = full.chunk(self.p.parts, dim=split.dim)[self.part]  # this column's part
            for m in ([None] if node.kind == "buffer" else range(self.k)):
                self.env[vkey(node.name, self.s.home(node.name), m)] = shard_of(
                    full, self.s.home(node.name), split, self.k, m, self.rank, self.world,
                    self.rank_blocks)

    def run_task(self, task, params, lr) -> None:
        if isinstance(task, Wait):
            issued = self.pending.pop(task.collective, None)
            if issued is not None:
                issued()
        elif isinstance(task, Convert):
            self.convert(task)
        elif task.phase in ("fwd", "recompute"):
            self.forward(task)
        elif task.phase == "bwd":
            self.backward(task)
        else:
            self.sgd(params, lr)

    def accumulate(self, key: str, value: torch.Tensor, zero: bool = False) -> None:
        """Add one contribution to a gradient (or set its first); `zero`: this rank adds zeros
        (a whole value made a partial sum: another rank adds it). In place, as autograd's
        AccumulateGrad does, into a buffer no other value shares (nor two of its own elements,
        as an expanded one does); else into a new one."""
        if zero:
            value = torch.zeros_like(value)
        if key not in self.env:
            self.env[key] = value
        elif self.env.alone(key) and all(stride or size == 1 for stride, size in
                                         zip(self.env[key].stride(), self.env[key].shape)):
            self.env[key].add_(value)
        else:
            self.env[key] = self.env[key] + value

    # -- compute ----------------------------------------------------------------------------
    def forward(self, task: Compute) -> None:
        at = task.node, task.mb
        differentiated = at in self.backward_of and (
            task.phase == "recompute" or at not in self.recomputed)
        leaves, out = self.run_forward(task, task.inputs, differentiated)
        if differentiated:  # its backward differentiates this graph
            self.saved[at] = (leaves, out)
            self.env.keep(*leaves, out)
        self.env[task.outputs[0]] = out.detach()

    def run_forward(self, task: Compute, keys, differentiated: bool):
        """(leaves, output) of the task's node on the values of `keys`, under autograd where
        `differentiated`."""
        node = self.g.node(task.node)
        leaves = [x.detach().requires_grad_(True) if differentiated and x.is_floating_point()
                  else x for x in (self.env[key] for key in keys)]
        saving = self.regathered(task, leaves) if differentiated and task.phase != "bwd" \
            else nullcontext()
        with torch.enable_grad(), self.autocast(node), saving:
            out = self.callable(task, node)(leaves)
        if tuple(out.shape) != task.out_shape:
            raise RuntimeError(f"node {task.node} ({task.op}) mb {task.mb}: local output shape "
                               f"{tuple(out.shape)}, the Program expects {task.out_shape}")
        return leaves, out

    def regathered(self, task: Compute, leaves):
        """Where the backward reads an input under another key than the forward (a weight freed
        after the forward and gathered again), what autograd saves of that input (it, or a view
        of it) is kept as its layout only and rebuilt from the value gathered again when the
        backward unpacks it: the weight gathered for the forward is freed after its last use."""
        bwd = self.backward_of.get((task.node, task.mb))
        swapped = [i for i, (a, b) in enumerate(zip(task.inputs, bwd.inputs[1:])) if a != b] \
            if bwd is not None else []
        if not swapped:
            return nullcontext()

        def pack(x):
            for i in swapped:
                if x is leaves[i] or x._base is leaves[i]:
                    return i, tuple(x.shape), x.stride(), x.storage_offset()
            return x

        def unpack(saved):
            if not isinstance(saved, tuple):
                return saved
            i, size, stride, offset = saved
            return self.env[bwd.inputs[1 + i]].as_strided(size, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def autocast(self, node):
        """The run's autocast, or for an op of the model's own autocast block, the block's."""
        dtype = self.spec.autocast if node.autocast is None else \
            None if node.autocast == "off" else getattr(torch, node.autocast)
        return torch.autocast(self.spec.device_type, dtype=dtype, enabled=dtype is not None)

    def callable(self, task: Compute, node):
        """The node's local function (each task is traced once: nothing to keep)."""
        flat = option_is_flat(task.option)  # over every rank, as on a 1-D mesh of them all
        option, (rank, world) = plain_option(task.option), self.place(flat)
        root = (rank == 0 or option.output != Partial()) and \
               (not task.mb_partial or task.mb in (0, None) and (flat or self.part == 0))
        ctx = ops.LocalContext(rank, world, task.in_shapes, task.out_shape,
                               node.out.shape, tuple(m.shape for m in node.in_metas(self.g)),
                               root, self.spec.device_type, self.whole,
                               lambda x, op: self.reduce_inside(x, op, task.option),
                               self.group_inside(task.option) if task.inner else "")
        return ops.local_callable(node, option, ctx)

    def group_inside(self, option: ShardingOption) -> str:
        """The name of the group an op's `option` splits over (Program.op_axes), for an op that
        exchanges inside itself (LocalContext.group; hidup.graph.ops.dispatch): a process
        group's, the local world's threads', or calibration's stand-in; '' for one rank."""
        axes = self.p.op_axes(option)
        if self.p.grid.size(axes) == 1:
            return ""
        if self.spec.local_collectives:
            return STAND_IN
        if self.spec.exchange is not None:
            members = self.p.grid.group(axes, self.spec.rank)
            return register_group(
                f"hidup:local:{id(self.spec.exchange)}:{members}:{self.spec.rank}",
                self.spec.exchange, partial(type(self.spec.exchange).rows, group=members,
                                            rank=self.spec.rank))
        return self.spec.group_names[axes]

    def reduce_inside(self, x: torch.Tensor, op: str, option: ShardingOption) -> torch.Tensor:
        """x all-reduced by `op` over the ranks an op's `option` splits over (Program.op_axes),
        for an op that reduces inside itself (LocalContext.reduce; the Program's
        Compute.inner)."""
        axes = self.p.op_axes(option)
        if self.p.grid.size(axes) == 1 or self.spec.local_collectives:
            return x
        if self.spec.exchange is not None:
            ex = self.spec.exchange
            return ex.wait(ex.issue("all_reduce", x, self.p.grid.group(axes, self.spec.rank),
                                    self.spec.rank, op))
        return _C.wait_tensor(_C.all_reduce(x, op, self.spec.group_names[axes]))

    def whole(self, name: str) -> torch.Tensor | None:
        """Graph tensor `name` computed whole from the whole global batch (each op replicated),
        or None where it depends on a parameter or buffer: a loss counts its kept targets so."""
        if name not in self.whole_values:
            node = self.g.node(name)
            ins = [self.whole(t) for t in node.inputs] if node.kind == "op" else [None]
            if any(x is None for x in ins):
                self.whole_values[name] = None
            else:
                shapes = tuple(m.shape for m in node.in_metas(self.g))
                ctx = ops.LocalContext(0, 1, shapes, node.out.shape, node.out.shape, shapes, True,
                                       self.spec.device_type, self.whole)
                option = ShardingOption((R,) * len(ins), R)
                self.whole_values[name] = ops.local_callable(node, option, ctx)(ins)
        return self.whole_values[name]

    def backward(self, task: Compute) -> None:
        if task.op == "hidup.ones":
            self.env[task.outputs[0]] = torch.ones(task.out_shape,
                                                   device=self.env_device())
            return
        leaves, out = self.run_forward(task, task.inputs[1:], True) if task.again else \
            self.saved.pop((task.node, task.mb))  # again: its output was kept, not its inputs
        wanted = [i for i, key in enumerate(task.outputs) if key]
        grads = [None] * len(wanted)
        if out.requires_grad and wanted:
            grads = torch.autograd.grad(out, [leaves[i] for i in wanted],
                                        self.env[task.inputs[0]], allow_unused=True)
        node = self.g.node(task.node)
        for i, g in zip(wanted, grads):
            g = torch.zeros_like(leaves[i]) if g is None else g
            master = self.master.get(node.inputs[i])
            if master is not None and g.dtype != master:  # reduced at the parameter's dtype
                g = g.to(master)
            self.accumulate(task.outputs[i], g, task.outputs[i] in task.root_only and
                            self.place(option_is_flat(task.option))[0] != 0)

    def place(self, flat: bool) -> tuple[int, int]:
        """(rank, ranks) of this rank in its row, or (`flat`) among every rank."""
        return (self.spec.rank, self.p.world) if flat else (self.rank, self.world)

    def env_device(self) -> torch.device:
        return next(iter(self.env.values())).device

    def sgd(self, params, lr) -> None:
        """The update, in place on the parameter shards: p -= lr * grad."""
        pairs = [(p, self.env[self.p.param_grads[node.name]].reshape(p.shape))
                 for node, p in zip(self.g.params, params) if node.name in self.p.param_grads]
        if pairs:
            shards, grads = zip(*pairs)
            # one in-place pass, as torch.optim.SGD's p.add_(grad, alpha=-lr), with lr a tensor
            torch._foreach_addcmul_(list(shards), list(grads), [lr] * len(grads), value=-1)

    # -- conversions ------------------------------------------------------------------------
    def convert(self, task: Convert) -> None:
        for key in task.outputs if task.phase == "recompute" else ():  # made again, not added to
            del self.env[key]
        if task.kind in MB_CONVERSIONS:
            return self.mb_conversion(task)
        if len(task.inputs) > 1:
            return self.bucket_all_reduce(task) if task.kind == "all_reduce" else \
                self.bucket_shards(task)
        x, out_key = self.read(task.inputs[0]), task.outputs[0]
        # a whole value made a partial sum along root_axes: the first rank there adds it
        root = bool(task.root_only) and self.p.grid.index(self.spec.rank, task.root_axes) != 0
        if task.kind == "alias":
            self.accumulate(out_key, x, root)
        elif task.kind == "slice":  # this rank's piece along the slice's axes
            grid = self.p.grid
            piece = x.chunk(grid.size(task.axes), dim=task.dst.dim)[
                grid.index(self.spec.rank, task.axes)]
            self.accumulate(out_key, piece.contiguous(), root)
        elif (n := len(self.members(task))) == 1:  # a group of one: the identity
            self.pending[task.id] = lambda: self.accumulate(out_key, x, root)
        else:
            pack, unpack = PACKING[task.kind]
            sent = pack(x, task, n)
            with self.annotate({"task": task.id, "standin": True}):
                result = self.collective(task, sent)
            self.pending[task.id] = lambda: self.accumulate(
                out_key, unpack(self.wait(result), task, n), root)

    def read(self, key: str) -> torch.Tensor:
        """A conversion's input: a stored parameter shard at its compute dtype (self.cast)."""
        value = self.env[key]
        return value.to(self.cast[key]) if key in self.cast else value

    def mb_conversion(self, task: Convert) -> None:
        """The micro-batches' parts of a tensor on this rank, joined (concatenated or summed),
        or the whole cut into one micro-batch's part."""
        parts = [self.env[key] for key in task.inputs]
        if task.kind == "mb_gather":
            value = mb_join(parts, task.src.dim, task.blocks)
        elif task.kind == "mb_sum":
            value = parts[0]
            for part in parts[1:]:
                value = value + part
        else:
            value = mb_part(parts[0], task.dst.dim, self.k, task.mb, task.blocks).contiguous()
        self.accumulate(task.outputs[0], value)

    def bucket_all_reduce(self, task: Convert) -> None:
        """Several gradients all-reduced as one flat buffer (a DDP bucket)."""
        parts = [self.env[key] for key in task.inputs]
        if len(self.members(task)) == 1:  # a group of one: the gradients are already reduced
            self.pending[task.id] = lambda: [self.accumulate(key, p)
                                             for key, p in zip(task.outputs, parts)]
            return
        flat = torch.cat([p.reshape(-1) for p in parts])
        with self.annotate({"task": task.id, "standin": True}):
            if self.spec.local_collectives:
                flat = stand_in("all_reduce", flat, 1, 0)
            elif self.spec.exchange is not None:
                flat = self.collective(task, flat)
            else:  # in place: the buffer is the step's own (the functional one would copy it)
                flat = _C.all_reduce_(flat, "sum", self.group_name(task))

        def finish():
            done = self.wait(flat)
            for key, piece, p in zip(task.outputs, done.split([q.numel() for q in parts]), parts):
                self.accumulate(key, piece.view_as(p))

        self.pending[task.id] = finish

    def bucket_shards(self, task: Convert) -> None:
        """Several tensors all-gathered from their shards, or their partial sums
        reduce-scattered into shards, as one flat buffer (an FSDP bucket): rank r's block of
        the buffer is each tensor's r-th chunk along its shard dim, flattened, one after
        another."""
        parts = [self.read(key) for key in task.inputs]
        n = len(self.members(task))
        if n == 1:  # a group of one: each is already whole, or its own shard
            self.pending[task.id] = lambda: [self.accumulate(key, p)
                                             for key, p in zip(task.outputs, parts)]
            return
        gather = task.kind == "all_gather"
        dim = (task.src if gather else task.dst).dim
        moved = [p.movedim(dim, 0) for p in parts]
        if gather:
            flat = torch.cat([m.reshape(-1) for m in moved])
        else:
            flat = torch.cat([m.reshape(n, -1) for m in moved], dim=1).reshape(-1)
        sizes = [m.numel() if gather else m.numel() // n for m in moved]
        with self.annotate({"task": task.id, "standin": True}):
            result = self.collective(task, flat)

        def finish():
            done = self.wait(result)
            pieces = done.view(n, -1).split(sizes, dim=1) if gather else done.split(sizes)
            for key, piece, m in zip(task.outputs, pieces, moved):
                rows = m.shape[0] * n if gather else m.shape[0] // n
                value = piece.reshape(rows, *m.shape[1:]).movedim(0, dim).contiguous()
                self.accumulate(key, value)

        self.pending[task.id] = finish

    def members(self, task: Convert) -> tuple[int, ...]:
        """The ranks of this rank's group of collective `task` (along its axes of the mesh)."""
        return self.p.grid.group(task.axes, self.spec.rank)

    def group_name(self, task: Convert) -> str:
        if task.axes not in self.spec.group_names:
            raise RuntimeError(f"task {task}: no process group along the mesh axes "
                               f"{list(task.axes)} on rank {self.spec.rank} (the executor makes "
                               f"the world's and one along each axis of the mesh)")
        return self.spec.group_names[task.axes]

    def collective(self, task: Convert, x: torch.Tensor) -> torch.Tensor:
        """Issue one functional collective over this rank's group (or its local stand-in)."""
        group = self.members(task)
        if self.spec.local_collectives:
            return stand_in(task.kind, x, len(group), group.index(self.spec.rank))
        if self.spec.exchange is not None:
            return self.spec.exchange.issue(task.kind, x, group, self.spec.rank)
        return issue(task.kind, x, len(group), self.group_name(task))

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        """The collective's result once it has arrived. The wait is marked as its task's
        stand-in part, apart from the unpacking around it: calibration.ops, timing a step with
        real collectives, counts the unpacking and not the time spent waiting for the peers."""
        if self.spec.local_collectives:
            return x
        if self.spec.exchange is not None:
            return self.spec.exchange.wait(x)
        with self.annotate({"standin": True}):
            return _C.wait_tensor(x)


def untraced_step(spec: StepSpec, n_params: int, n_buffers: int, update: bool = True):
    """One rank's whole step as a function of the graph's arguments (*params, *buffers, *inputs,
    lr) that runs the Program's tasks one by one as Python on real tensors, nothing traced: what
    `trace_step` records, without the cost of recording it (checks that run one step)."""
    runner = _TaskRunner(spec, update)

    def step(*args):
        return runner(list(args[:n_params]), list(args[n_params:n_params + n_buffers]),
                      list(args[n_params + n_buffers:-1]), args[-1])
    return step


def trace_step(spec: StepSpec, params, buffers, inputs, lr, update: bool = True
               ) -> torch.fx.GraphModule:
    """Trace one rank's whole step into an FX graph (on fake tensors: nothing is computed or
    communicated). Arguments as the graph takes them: *params, *buffers, *inputs, lr."""
    gm = record(untraced_step(spec, len(params), len(buffers), update),
                *params, *buffers, *inputs, lr)
    simplify(gm)
    return gm
