"""The Program's data model: one training step of one rank as ordered tasks (compute, conversions,
waits), each tagged with its micro-batch, and the local shapes and sizes of tensors on a rank.
`hidup.program.lowering.lower` builds a Program; the executor runs it, the simulator times it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hidup.graph.capture import Graph
from hidup.graph.placement import (Placement, Shard, ShardingOption, is_flat, option_is_flat,
                                   plain)
from hidup.strategy import Mesh, Strategy

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
# conversions on a rank's compute stream: a slice of its shard, and the micro-batches' parts of a
# tensor concatenated or summed into the whole batch's (a join) or the whole cut into them
MB_CONVERSIONS = ("mb_gather", "mb_sum", "mb_slice")
LOCAL_KERNELS = ("slice", *MB_CONVERSIONS)
MODES = ("graph", "compile", "cuda-graphs")  # how hidup.runtime.execute runs a rank's step
HOST_MODES = ("eager", *MODES)  # whose host cost a profile can give: plain PyTorch's, or a mode's


@dataclass(frozen=True)
class OptimizerCost:
    """What one optimizer step costs per local parameter element (fp32): FLOPs, bytes moved, and
    the state tensors the optimizer keeps, each the size of the parameter."""

    name: str
    flops: float
    bytes: float
    states: int

    @property
    def op(self) -> str:
        """The update task's op: 'optimizer.step' for plain SGD (the key calibrated profiles
        measured), 'optimizer.step.NAME' for the others."""
        return "optimizer.step" if self.name == "sgd" else f"optimizer.step.{self.name}"


# The optimizers HiDup knows, as torch.optim runs them with their defaults (foreach on a GPU; the
# CPU's per-tensor loop does the same arithmetic): one element of a parameter per step. Bytes count
# every pass's reads and writes of 4-byte elements (a fused kernel would move fewer: AdamW 28).
OPTIMIZERS: dict[str, OptimizerCost] = {o.name: o for o in (
    # SGD, no momentum: _foreach_add_(p, g, alpha=-lr): a multiply and an add; read p, g, write p
    OptimizerCost("sgd", flops=2, bytes=12, states=0),
    # SGD with momentum (no dampening, no Nesterov): buf.mul_(momentum) 1 flop, r/w buf 8 B;
    # buf.add_(g) 2 flops, read buf, g, write buf 12 B; p.add_(buf, alpha=-lr) 2 flops, 12 B;
    # one state tensor (momentum_buffer)
    OptimizerCost("sgd-momentum", flops=5, bytes=32, states=1),
    # Adam (weight_decay 0): m.lerp_(g, 1-b1) 3 flops, read m, g, write m 12 B;
    # v.mul_(b2) 1 flop, 8 B; v.addcmul_(g, g, 1-b2) 3 flops, read v, g, write v 12 B;
    # d = v.sqrt() 1 flop, 8 B; d.div_(bc2) 1 flop, 8 B; d.add_(eps) 1 flop, 8 B;
    # p.addcdiv_(m, d, -lr/bc1) 3 flops, read p, m, d, write p 16 B: 13 flops, 72 B;
    # two state tensors (exp_avg, exp_avg_sq)
    OptimizerCost("adam", flops=13, bytes=72, states=2),
    # AdamW (weight_decay 0.01, decoupled): Adam's passes, first p.mul_(1 - lr*wd), 1 flop,
    # read and write p 8 B: 14 flops, 80 B; the same two state tensors
    OptimizerCost("adamw", flops=14, bytes=80, states=2),
)}


def optimizer_cost(name: str) -> OptimizerCost:
    """The table's entry for optimizer `name`; an unknown name is a one-line LoweringError."""
    try:
        return OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise LoweringError(f"unknown optimizer {name!r}; choose one of "
                            f"{', '.join(OPTIMIZERS)}") from None


@dataclass(frozen=True)
class Compute:
    """A kernel on the compute stream: a node's forward or backward, the optimizer update, or the
    seed gradient of the loss (op 'hidup.ones')."""

    id: int
    node: str
    op: str
    phase: str  # 'fwd' | 'bwd' | 'update' | 'recompute' (a forward again, right before its
    #             backward: activation checkpointing, hidup.program.recompute)
    mb: int | None  # micro-batch; None: once per step
    flops: float
    bytes: float
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    inputs: tuple[str, ...]  # value keys read
    outputs: tuple[str, ...]  # value keys written (gradients accumulate; a backward task has one
    #                           per forward input, '' where that input needs no gradient)
    option: ShardingOption | None = None
    mb_partial: bool = False  # the micro-batches' outputs are summed (a loss over the batch)
    root_only: tuple[str, ...] = ()  # outputs added on rank 0 only (replicated into Partial)
    # a forward's: per input, then for the output, whether its derivative reads it (autograd
    # keeps it for the backward; hidup.graph.saved); None: all of them
    reads: tuple[bool, ...] | None = None
    # a backward's: it differentiates its node's forward again from the inputs it reads (an op
    # whose output a selectively recomputed layer kept; its first forward kept nothing)
    again: bool = False
    # a forward's: local bytes autograd keeps for its backward beside its inputs and output
    # (tensors of the op's own, autocast's copies of its inputs; hidup.graph.saved)
    keeps: int = 0
    # a forward's: its output shares its first input's memory (a composite that views there:
    # hidup.program.lowering.Lowering.aliases); views by schema are known by their op
    alias: bool = False
    # local bytes it holds only while it runs, beyond what it writes and keeps: a composite
    # op's intermediates (hidup.graph.saved.Saves.scratch)
    scratch: int = 0
    # (kind, bytes) of each collective it runs inside itself, blocking, over the ranks its
    # option splits over (Program.op_axes; hidup.graph.ops.inner_collectives): a
    # vocabulary-parallel loss's all-reduces, routed experts' all-to-alls
    inner: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        mb = "*" if self.mb is None else self.mb
        return f"#{self.id} {self.phase} {self.node or self.op} mb{mb} {self.op} {self.option or ''}"


@dataclass(frozen=True)
class Convert:
    """A placement conversion of one tensor: a collective on the communication stream, or a local
    slice / alias on the compute stream. Its result is usable after the matching Wait."""

    id: int
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | slice | alias, or
    #            across micro-batches (src, dst: their split): mb_gather | mb_sum | mb_slice
    tensor: str
    src: Placement
    dst: Placement
    phase: str
    mb: int | None
    shape: tuple[int, ...]  # local input shape
    bytes: int  # the whole (gathered / reduced) tensor on one rank
    group: tuple[int, ...]  # the ranks of rank 0's group (the world unless `groups` splits it)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    root_only: tuple[str, ...] = ()
    # sub-groups: the world split into disjoint groups, each rank's collective runs in its own:
    # the mesh's groups along `axes` (hidup.strategy.Mesh.groups: on a 2-D mesh a machine's
    # ranks, or one GPU of every machine); () for a collective over the whole world
    groups: tuple[tuple[int, ...], ...] = ()
    # micro-batch conversions along a dim the ranks' placement does not split: the rank blocks
    # (world) each micro-batch's part holds there, one after another (see runtime.layout.shard_of)
    blocks: int = 1
    # a bucket (several inputs, one collective over them flattened together): each input's
    # local shape; () for one tensor (its shape is `shape`)
    in_shapes: tuple[tuple[int, ...], ...] = ()
    # a collective's or a slice's: the axes of the Program's mesh it runs along (its groups are
    # the mesh's groups along them, each rank's the DeviceMesh's group of those axes; a slice
    # keeps the piece of the rank's place along them); () for another local one
    axes: tuple[str, ...] = ()
    # with root_only: the axes along which only the first rank adds the result, the others
    # zeros (a whole gradient made a partial sum there); () with no root_only
    root_axes: tuple[str, ...] = ()

    @property
    def collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The groups that run this collective at once: `groups`, or the one `group`."""
        return self.groups or (self.group,)

    def __str__(self) -> str:
        mb = "*" if self.mb is None else self.mb
        return (f"#{self.id} {self.phase} {self.kind} {self.tensor} mb{mb} {self.src}->{self.dst} "
                f"{self.bytes}B")


@dataclass(frozen=True)
class Wait:
    """The compute stream waits until collective `collective` has finished."""

    id: int
    collective: int

    def __str__(self) -> str:
        return f"#{self.id} wait #{self.collective}"


Task = Compute | Convert | Wait


@dataclass(frozen=True)
class Program:
    model: str
    fingerprint: str
    strategy: str
    world: int
    k: int
    tasks: tuple[Task, ...]
    loss_keys: tuple[str, ...]  # replicated per-micro-batch losses (summed = the step's loss)
    param_grads: dict[str, str] = field(hash=False)  # parameter node -> final gradient key
    optimizer: str = "adamw"  # the update's optimizer, a key of OPTIMIZERS
    # the mesh of its world (None: the 1-D mesh), and the axes of it the plan is data parallel
    # over (hidup.strategy.Strategy.mesh and dp)
    mesh: Mesh | None = None
    dp: tuple[str, ...] = ()
    # buffer node -> the replicated value forward writes into it (BatchNorm's running statistics)
    buffer_updates: dict[str, str] = field(default_factory=dict, hash=False)
    precision: str = "fp32"  # the run's: fp32, or bf16 (mixed, under torch.autocast)
    # tensor -> the dtype of its values in the run (a parameter's: its master weights', its
    # gradient's and its optimizer state's); empty: as captured
    dtypes: dict[str, str] = field(default_factory=dict, hash=False)
    # parameter -> the dtype the run converts (gathers, slices) it at, where not its own: its
    # readers compute it so (hidup.graph.dtypes.RunDtypes.compute)
    compute: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def grid(self) -> Mesh:
        """Its mesh, the 1-D one of its world where it has none."""
        return self.mesh or Mesh.line(self.world)

    @property
    def parts(self) -> int:
        """The data-parallel parts of its mesh (1 on a 1-D mesh)."""
        return self.grid.size(self.dp)

    @property
    def row(self) -> int:
        """The ranks its placements split tensors over (a row of the mesh)."""
        return self.world // self.parts

    def position(self, rank: int) -> tuple[int, int]:
        """A rank's (data-parallel part, place in its row): hidup.strategy.Mesh.position."""
        return self.grid.position(rank, self.dp)

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The mesh axes its placements split tensors over (a row's)."""
        return (self.grid.split_axis(self.dp),)

    def op_axes(self, option: ShardingOption) -> tuple[str, ...]:
        """The mesh axes an op run under `option` splits over: a row's, or every axis for a
        flat option (over every rank)."""
        return self.grid.names if option_is_flat(option) else self.split_axes

    def group(self, rank: int, axes: tuple[str, ...] | None = None) -> tuple[int, ...]:
        """The ranks along the mesh's `axes` (default: a row's) seen from `rank`."""
        return self.grid.group(self.split_axes if axes is None else axes, rank)

    @property
    def collectives(self) -> list[Convert]:
        return [t for t in self.tasks if isinstance(t, Convert) and t.collective]

    def __str__(self) -> str:
        mesh = f" mesh={self.mesh} dp={','.join(self.dp)}" if self.mesh else ""
        head = f"program {self.model} {self.strategy} world={self.world}{mesh} k={self.k}"
        return "\n".join([head] + [f"  {t}" for t in self.tasks])


def task_label(task: Task) -> str:
    """How a task is named in profiler traces, real and simulated: 'fwd linear mb0',
    'all_reduce linear_3 mb1', 'update optimizer.step', 'wait #12'."""
    if isinstance(task, Wait):
        return f"wait #{task.collective}"
    mb = "" if task.mb is None else f" mb{task.mb}"
    if isinstance(task, Convert):
        return f"{task.kind} {task.tensor}{mb}"
    return f"{task.phase} {task.node or task.op}{mb}"


def kernel_tasks(tasks) -> list[Compute | Convert]:
    """The compute-stream kernels among `tasks`: Computes, local slices and micro-batch joins
    (aliases take no time)."""
    return [t for t in tasks if isinstance(t, Compute)
            or (isinstance(t, Convert) and t.kind in LOCAL_KERNELS)]


def vkey(t: str, p: Placement, mb: int | None) -> str:
    return f"{t}@{p}/{'*' if mb is None else mb}"


def stored_key(t: str, p: Placement, across: bool) -> str:
    """The key of parameter t's stored shard: its row's piece (home p), or, stored sharded over
    the dp axes too (`across`), this rank's part of that piece."""
    return f"{t}@{p}|across/*" if across else vkey(t, p, None)


def param_key(strategy: Strategy, t: str) -> str:
    """The key of parameter t's stored shard under `strategy`."""
    return stored_key(t, strategy.home(t), t in strategy.across and strategy.mesh is not None)


def gkey(t: str, p: Placement, mb: int | None) -> str:
    return "d" + vkey(t, p, mb)


class LoweringError(ValueError):
    """A strategy cannot be lowered (a split that does not divide, a batch that cannot be split)."""


def local_shape(shape, placement: Placement, mb_placement: Placement, world: int, k: int,
                where=lambda: "") -> tuple[int, ...]:
    """The shape one rank holds for one micro-batch: the micro-batch split first, then the mesh
    split. `where` names the tensor in the error (a function: the search calls this a lot)."""
    out = list(shape)
    for p, n, what in ((mb_placement, k, "micro-batches"), (placement, world, "ranks")):
        if n > 1 and isinstance(p, Shard):
            if out[p.dim] % n:
                raise LoweringError(f"{where()}: dim {p.dim} of size {out[p.dim]} (shape "
                                    f"{tuple(shape)}) does not split into {n} {what}; choose a "
                                    f"batch or model size divisible by it")
            out[p.dim] //= n
    return tuple(out)


BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket
FIRST_BUCKET_BYTES = 2**20  # and its first one (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)


def tensor_shape(graph: Graph, mb_split: Strategy, t: str, p: Placement, world: int,
                 k: int, q: Placement | None = None, dp: int = 1) -> tuple[int, ...]:
    """Local shape of tensor t held as p, split over micro-batches as q (default: as `mb_split`
    holds it). On a 2-D mesh of `dp` data-parallel parts (`world`: a row's ranks, `k`: the
    batch's parts, micro-batches x dp) a flat placement is over every rank, on a micro-batch of
    the whole batch."""
    if is_flat(p):
        p, world, k = plain(p), world * dp, k // dp
    return local_shape(graph.node(t).out.shape, p, mb_split.home(t) if q is None else q, world,
                       k, lambda: f"tensor {t} as {p}")


def tensor_nbytes(graph: Graph, mb_split: Strategy, t: str, p: Placement, world: int,
                  k: int) -> int:
    shape = tensor_shape(graph, mb_split, t, p, world, k)
    return math.prod(shape) * graph.node(t).out.itemsize


class Shapes:
    """tensor_shape and tensor_nbytes of one graph, micro-batch split, world and number of
    parts, each (tensor, placement) computed once: the search and the lowering ask thousands
    of times."""

    def __init__(self, graph: Graph, mb_split: Strategy, world: int, k: int, dp: int = 1):
        self.g, self.mb_split, self.world, self.k = graph, mb_split, world, k
        self.dp = dp
        self._shapes: dict[tuple, tuple[int, ...]] = {}
        self._nbytes: dict[tuple, int] = {}

    def shape(self, t: str, p: Placement, q: Placement | None = None) -> tuple[int, ...]:
        """Local shape of t held as p, split over micro-batches as q (default: as the split
        holds it)."""
        key = t, p, q
        if key not in self._shapes:
            self._shapes[key] = tensor_shape(self.g, self.mb_split, t, p, self.world, self.k, q,
                                             self.dp)
        return self._shapes[key]

    def nbytes(self, t: str, p: Placement, q: Placement | None = None,
               grad: bool = False) -> int:
        """Bytes of t held as p (split over micro-batches as q) at the dtype the run gives its
        values, or (`grad`) its gradients: a parameter converted at its compute dtype
        (hidup.graph.dtypes) has its gradient reduced at its own."""
        key = t, p, q, grad
        if key not in self._nbytes:
            self._nbytes[key] = math.prod(self.shape(t, p, q)) * self.itemsize(t, grad)
        return self._nbytes[key]

    def itemsize(self, t: str, grad: bool = False) -> int:
        compute = self.g.run.compute if self.g.run is not None else {}
        if t in compute and not grad:
            return getattr(torch, compute[t]).itemsize
        return self.g.node(t).out.itemsize
