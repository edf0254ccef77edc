"""The executor: runs a Program task by task on this rank with torch.distributed (gloo on CPU,
nccl on GPU). Forward ops record a small autograd graph each, so that backward tasks can run in
the Program's order, interleaving micro-batches; collectives are asynchronous until their Wait."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hidup import ops
from hidup.capture import Graph
from hidup.placement import Partial, Placement, Shard
from hidup.program import Compute, Convert, Program, Wait, vkey
from hidup.strategy import Strategy, microbatch_split

log = logging.getLogger(__name__)


def shard_of(full: torch.Tensor, placement: Placement, mb_placement: Placement, k: int,
             mb: int | None, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of micro-batch `mb` of a whole tensor: micro-batch split first, then mesh."""
    x = full
    if isinstance(mb_placement, Shard) and mb is not None:
        x = x.chunk(k, dim=mb_placement.dim)[mb]
    if isinstance(placement, Shard):
        x = x.chunk(world, dim=placement.dim)[rank]
    return x.contiguous()


@dataclass
class _Pending:
    work: object
    finish: object  # callable(): puts the collective's result into the environment
    done: bool = False


class Executor:
    """Holds this rank's parameter shards and runs one Program step at a time."""

    def __init__(self, graph: Graph, strategy: Strategy, program: Program,
                 params: dict[str, torch.Tensor], lr: float = 0.01,
                 device: torch.device | str = "cpu", group=None,
                 buffers: dict[str, torch.Tensor] | None = None, rank: int | None = None,
                 autocast: torch.dtype | None = None):
        split = next((t for t in program.collectives if t.groups), None)
        if split is not None:
            raise ValueError(f"task {split} runs in sub-groups {split.groups}: the executor runs "
                             f"world-spanning collectives only (a Program from hidup.program.lower)")
        # mixed precision (paper Sec. VI.F): each node's forward runs under torch.autocast with
        # this dtype (matmuls in bf16); its output is kept in float32, so collectives, saved
        # values and gradients stay float32
        self.autocast = autocast
        self.g, self.s, self.p = graph, strategy, program
        self.world, self.k, self.device = program.world, program.k, torch.device(device)
        self.group = group
        self.rank = rank if rank is not None else dist.get_rank(group) if self.world > 1 else 0
        self.mbs = microbatch_split(graph, program.k)
        self.params = {}  # param node name -> local shard (a leaf the optimizer updates)
        for node in graph.params:
            full = params[node.source].detach().to(self.device)
            shard = shard_of(full, strategy.home(node.name), self.mbs.home(node.name), self.k,
                             None, self.rank, self.world)
            self.params[node.name] = torch.nn.Parameter(shard)
        self.optimizer = torch.optim.SGD(self.params.values(), lr=lr)
        # CUDA: one stream per compute stream of the Program, joined by events (CPU: host order)
        self.cuda_streams = None
        if self.device.type == "cuda" and program.streams > 1:
            self.cuda_streams = [torch.cuda.current_stream(self.device)] + [
                torch.cuda.Stream(self.device) for _ in range(program.streams - 1)]
        self.events: dict[int, torch.cuda.Event] = {}
        self.free_after, self.backward_of = _lifetimes(program)
        self.buffers = {n.source: buffers[n.source].detach().to(self.device)
                        for n in graph.nodes if n.kind == "buffer"} if buffers else {}
        missing = [n.source for n in graph.nodes if n.kind == "buffer" and n.source not in self.buffers]
        if missing:
            raise ValueError(f"the model's buffers {missing} were not given to the executor")
        self._fns = {}

    # -- one step ---------------------------------------------------------------------------
    def step(self, inputs: dict[str, torch.Tensor], update: bool = True) -> float:
        """One training step on the global batch `inputs` (user input name -> whole tensor);
        returns the step's loss. With update=False the gradients are left in `self.grads`."""
        env: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            env[vkey(name, self.s.home(name), None)] = p
        for node in self.g.nodes:
            if node.kind in ("input", "buffer"):
                full = (inputs if node.kind == "input" else self.buffers)[node.source]
                for m in ([None] if node.kind == "buffer" else range(self.k)):
                    env[vkey(node.name, self.s.home(node.name), m)] = shard_of(
                        full.to(self.device), self.s.home(node.name), self.mbs.home(node.name),
                        self.k, m, self.rank, self.world)
        self.saved, self.pending, self.env = {}, {}, env
        for i, task in enumerate(self.p.tasks):
            if isinstance(task, Compute) and task.phase == "update" and not update:
                continue
            with torch.profiler.record_function(_label(task)), self.on_stream(task):
                self.run_task(task)
            for key in self.free_after.get(i, ()):  # values no later task reads
                env.pop(key, None)
        self.grads = {n: env[key] for n, key in self.p.param_grads.items()}
        loss = sum(float(env[k]) for k in self.p.loss_keys)
        self.saved = self.env = None
        return loss

    @contextmanager
    def on_stream(self, task):
        """On CUDA with several compute streams: run the task on its stream after the events it
        waits for, and record its own event. Elsewhere: nothing to do."""
        if self.cuda_streams is None:
            yield
            return
        stream = self.cuda_streams[task.stream]
        for tid in getattr(task, "after", ()):
            stream.wait_event(self.events[tid])
        with torch.cuda.stream(stream):
            yield
            if not isinstance(task, Wait):
                self.events[task.id] = torch.cuda.Event()
                self.events[task.id].record(stream)

    def run_task(self, task) -> None:
        if isinstance(task, Wait):  # with two streams, each stream waits for a collective
            pending = self.pending[task.collective]
            if pending.work is not None:
                pending.work.wait()  # on CUDA: the current stream waits; on CPU: the host does
            if not pending.done:
                pending.finish()
                pending.done = True
        elif isinstance(task, Convert):
            self.convert(task)
        elif task.phase == "fwd":
            self.forward(task)
        elif task.phase == "bwd":
            self.backward(task)
        else:
            self.update(task)

    def accumulate(self, key: str, value: torch.Tensor, root_only: bool = False) -> None:
        if root_only and self.rank != 0:
            value = torch.zeros_like(value)
        self.env[key] = value if key not in self.env else self.env[key] + value

    # -- compute ----------------------------------------------------------------------------
    def forward(self, task: Compute) -> None:
        node = self.g.node(task.node)
        fn = self._fns.get(task.id)
        if fn is None:
            root = (self.rank == 0 or task.option.output != Partial()) and \
                   (not task.mb_partial or task.mb in (0, None))
            ctx = ops.LocalContext(self.rank, self.world, task.in_shapes, task.out_shape,
                                   node.out.shape, tuple(m.shape for m in node.in_metas(self.g)),
                                   root)
            fn = self._fns[task.id] = ops.local_callable(node, task.option, ctx)
        leaves = []
        for key in task.inputs:
            x = self.env[key]
            if self.cuda_streams is not None:  # the allocator must not reuse it too early
                x.record_stream(torch.cuda.current_stream(self.device))
            leaves.append(x.detach().requires_grad_(True) if x.is_floating_point() else x)
        with torch.enable_grad():
            if self.autocast is None:
                out = fn(leaves)
            else:
                with torch.autocast(self.device.type, dtype=self.autocast):
                    out = fn(leaves)
                if out.is_floating_point() and out.dtype != torch.float32:
                    out = out.float()
        if tuple(out.shape) != task.out_shape:
            raise RuntimeError(f"node {task.node} ({task.op}) mb {task.mb}: local output shape "
                               f"{tuple(out.shape)}, the Program expects {task.out_shape}")
        if (task.node, task.mb) in self.backward_of:  # keep the autograd graph for its backward
            self.saved[(task.node, task.mb)] = (leaves, out)
        self.env[task.outputs[0]] = out.detach()

    def backward(self, task: Compute) -> None:
        if task.op == "hidup.ones":
            self.env[task.outputs[0]] = torch.ones(task.out_shape, device=self.device)
            return
        leaves, out = self.saved.pop((task.node, task.mb))
        wanted = [i for i, key in enumerate(task.outputs) if key]
        grads = [None] * len(wanted)
        if out.requires_grad and wanted:
            grads = torch.autograd.grad(out, [leaves[i] for i in wanted],
                                        self.env[task.inputs[0]], allow_unused=True)
        for i, g in zip(wanted, grads):
            g = torch.zeros_like(leaves[i]) if g is None else g
            self.accumulate(task.outputs[i], g, task.outputs[i] in task.root_only)

    def update(self, task: Compute) -> None:
        for name, key in self.p.param_grads.items():
            self.params[name].grad = self.env[key].detach().reshape(self.params[name].shape)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- conversions ------------------------------------------------------------------------
    def convert(self, task: Convert) -> None:
        if len(task.inputs) > 1:
            return self.bucket_all_reduce(task)
        x, out_key = self.env[task.inputs[0]], task.outputs[0]
        root = bool(task.root_only)
        if task.kind == "alias":
            self.accumulate(out_key, x, root)
        elif task.kind == "slice":
            d = task.dst.dim
            self.accumulate(out_key, x.chunk(self.world, dim=d)[self.rank].contiguous(), root)
        elif self.world == 1:  # a group of one: every collective is the identity
            self.pending[task.id] = _Pending(None, lambda: self.accumulate(out_key, x, root))
        else:
            work, result = _COLLECTIVES[task.kind](x, task, self.world, self.group)
            self.pending[task.id] = _Pending(work, lambda: self.accumulate(out_key, result(), root))


    def bucket_all_reduce(self, task: Convert) -> None:
        """Several gradients all-reduced as one flat buffer (a DDP bucket)."""
        parts = [self.env[key] for key in task.inputs]
        flat = torch.cat([p.detach().reshape(-1) for p in parts])
        work = dist.all_reduce(flat, group=self.group, async_op=True) if self.world > 1 else None

        def finish():
            for key, piece, p in zip(task.outputs, flat.split([q.numel() for q in parts]), parts):
                self.accumulate(key, piece.view_as(p))

        self.pending[task.id] = _Pending(work, finish)


def _lifetimes(program: Program) -> tuple[dict[int, list[str]], set]:
    """Which values can be dropped after each task (their last reader or writer), keeping the
    step's results (losses, final gradients); and which forward nodes have a backward task."""
    keep = set(program.loss_keys) | set(program.param_grads.values())
    waits = {t.collective: i for i, t in enumerate(program.tasks) if isinstance(t, Wait)}
    last: dict[str, int] = {}
    for i, task in enumerate(program.tasks):
        if isinstance(task, Wait):
            continue
        for key in task.inputs + task.outputs:
            if key:
                last[key] = i
        if isinstance(task, Convert) and task.collective:  # its result lands at its last Wait
            for key in task.outputs:
                last[key] = max(last[key], waits[task.id])
    free: dict[int, list[str]] = {}
    for key, i in last.items():
        if key not in keep:
            free.setdefault(i, []).append(key)
    backward = {(t.node, t.mb) for t in program.tasks
                if isinstance(t, Compute) and t.phase == "bwd" and t.op != "hidup.ones"}
    return free, backward


def _all_reduce(x, task, world, group):
    y = x.detach().clone()
    return dist.all_reduce(y, group=group, async_op=True), lambda: y


def _all_gather(x, task, world, group):
    d = task.src.dim
    y = x.detach().movedim(d, 0).contiguous()
    buf = torch.empty((world * y.shape[0],) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device)
    work = dist.all_gather_into_tensor(buf, y, group=group, async_op=True)
    return work, lambda: buf.movedim(0, d).contiguous()


def _reduce_scatter(x, task, world, group):
    d = task.dst.dim
    y = x.detach().movedim(d, 0).contiguous()
    buf = torch.empty((y.shape[0] // world,) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device)
    work = dist.reduce_scatter_tensor(buf, y, group=group, async_op=True)
    return work, lambda: buf.movedim(0, d).contiguous()


def _all_to_all(x, task, world, group):
    a, b = task.src.dim, task.dst.dim
    send = torch.stack(x.detach().chunk(world, dim=b)).contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, lambda: torch.cat(recv.unbind(0), dim=a).contiguous()


_COLLECTIVES = {"all_reduce": _all_reduce, "all_gather": _all_gather,
                "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all}


def _label(task) -> str:
    mb = "" if getattr(task, "mb", None) is None else f" mb{task.mb}"
    if isinstance(task, Wait):
        return f"wait #{task.collective}"
    if isinstance(task, Convert):
        return f"{task.kind} {task.tensor}{mb}"
    return f"{task.phase} {task.node or task.op}{mb}"


def full_tensor(local: torch.Tensor, placement: Placement, world: int, group=None) -> torch.Tensor:
    """Reassemble a whole tensor from its shards (for checks, outside the timed step)."""
    if isinstance(placement, Shard) and world > 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=placement.dim)
    if isinstance(placement, Partial) and world > 1:
        y = local.clone()
        dist.all_reduce(y, group=group)
        return y
    return local
