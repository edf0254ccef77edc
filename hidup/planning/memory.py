"""Peak memory of one rank's Program: which tensors PyTorch holds at each task when the tasks run in
order, each value freed after its last use. One linear pass over the tasks, last uses precomputed.

Rules (a value's size is its numel x the itemsize of its dtype in the run: Program.dtypes, as
hidup.graph.dtypes finds them for the run's precision; float32 master weights under bf16):
- parameters: every local shard (a key `name@placement/*` of a `program.param_grads` name that no
  task writes) lives the whole step at its own dtype; so does the optimizer state:
  `program.optimizer`'s state tensors (hidup.program.OPTIMIZERS), each the size and dtype of
  the shard (0 for plain SGD, two for Adam's and AdamW's moments), unless the caller gives
  `optimizer_bytes_per_param` itself. A parameter converted at its compute dtype
  (Program.compute: gathered in bf16) is that dtype once converted; its gradient is its own.
- inputs: every other value read but never written (user inputs, buffers) lives the whole step.
- gradients: a key written by a backward Compute or Convert is one accumulated buffer, allocated at
  its first write and freed after its last read, at its tensor's dtype; a final parameter gradient
  lives until the 'update' task has run, and is then freed (as zero_grad(set_to_none=True)).
- activations: a forward Compute's output, or a forward Convert's (allocated when the collective
  is issued), is freed after its last read; autograd also keeps what the node's derivative reads
  of its inputs (as its backward reads them: a weight freed after the forward is the one
  gathered again) and of its output (Compute.reads), and what else it saves (Compute.keeps: the
  op's own tensors such as a loss's log-softmax or attention's log-sum-exp, autocast's copies of
  its inputs; hidup.graph.saved), until that node's backward task for the same micro-batch has
  run. Loss values live all step.
- recomputation (activation checkpointing): a recomputed layer's first forward keeps nothing for
  the backward (its values are freed after their last forward read); its 'recompute' tasks
  write the values again, new ones that the backward holds as it holds a forward's.
- scratch: what a task holds only while it runs, beyond what it writes and keeps
  (Compute.scratch: a composite op's intermediates, such as the gradient of a loss's
  log-softmax inside its backward), at that task only.
Not modelled: transient buffers inside a kernel or a collective (an accumulation's sum, a
gather's staging copy, the optimizer's temporaries: foreach Adam's sqrt(exp_avg_sq) of every
shard at once), allocator caching and fragmentation.
A view (an op whose schema says its output aliases its input: view, transpose, expand, slice;
or a composite that views where it can, on a contiguous input: reshape, contiguous, a cast to
the dtype the value has; Compute.alias) holds no memory of its own: its base lives until the
view's last use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from operator import add, sub

import torch

from hidup.graph.placement import Shard
from hidup.program.recompute import derivative_reads, dropped
from hidup.program.tasks import Compute, Convert, Program, Wait, optimizer_cost

_ACT, _GRAD = 0, 1  # the sweep's lists per kind, indexed by 'first written in backward'


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds: constant parts, and the peaks of the parts that change over the step."""

    params: int
    inputs: int
    optimizer: int
    grads_peak: int  # the most gradient bytes live at once (not necessarily at `peak_task_id`)
    activations_peak: int
    peak: int  # the most bytes live at once, everything together
    peak_task_id: int | None  # the task during which `peak` is live; None for an empty Program
    # where peak_memory was given each task's region: per region, the most bytes live during
    # one of its tasks beyond the constant parts, and the most activation and gradient bytes
    by_region: dict | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        at = "" if self.peak_task_id is None else f" at #{self.peak_task_id}"
        return (f"peak {_fmt(self.peak)}{at}: params {_fmt(self.params)}, optimizer "
                f"{_fmt(self.optimizer)}, inputs {_fmt(self.inputs)}, gradients <= "
                f"{_fmt(self.grads_peak)}, activations <= {_fmt(self.activations_peak)}")


def _fmt(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def peak_memory(program: Program, optimizer_bytes_per_param: int | None = None,
                regions=None) -> MemoryReport:
    """The peak bytes one rank holds while the executor runs `program`'s tasks in order, with
    `program.optimizer`'s state (or `optimizer_bytes_per_param` bytes per local parameter
    element, where given); with `regions` (each task's region, a key), also the peaks of each
    region (MemoryReport.by_region)."""
    tasks = program.tasks
    numel, first, last = _scan(program)
    end = len(tasks) - 1
    update = next((i for i in range(end, -1, -1) if type(tasks[i]) is Compute
                   and tasks[i].phase == "update"), end)
    for key in program.param_grads.values():
        last[key] = max(last.get(key, update), update)
    for key in program.loss_keys:
        last[key] = end
    names = set(program.param_grads)
    size = _Sizes(program, first.keys())
    params = inputs = optimizer = 0
    states = optimizer_cost(program.optimizer).states
    for key in last.keys() - first.keys():
        if key.split("@", 1)[0] in names and key.endswith("/*"):
            params += numel[key] * size(key, False)
            optimizer += numel[key] * (size(key, False) * states
                                       if optimizer_bytes_per_param is None
                                       else optimizer_bytes_per_param)
        elif not key.startswith(_KEPT):
            inputs += numel[key] * size(key, False)
    return _sweep(tasks, numel, first, last, size, params, inputs, optimizer, regions)


class _Sizes:
    """A value key's itemsize in the run: its tensor's dtype (Program.dtypes; a gradient key is
    'd' + the value's key, or 'grad:' + the parameter's name); a parameter converted at its
    compute dtype has that dtype once converted (a key some task writes, in the forward or
    gathered again in the backward), its stored shard and its gradients their own. Where the
    Program has no dtypes (hand-built in tests), 4 bytes."""

    def __init__(self, program: Program, written):
        self.dtypes, self.compute, self.written = program.dtypes, program.compute, written
        self._cache: dict[tuple[str, bool], int] = {}

    def __call__(self, key: str, grad: bool) -> int:
        if (key, grad) not in self._cache:
            self._cache[key, grad] = self._size(key, grad)
        return self._cache[key, grad]

    def _size(self, key: str, grad: bool) -> int:
        if key.startswith(_KEPT):
            return 1
        name = key
        if grad and key.startswith("grad:"):
            name = key[5:]
        elif grad and key.startswith("d") and key[1:].split("@", 1)[0] in self.dtypes:
            name = key[1:]
        else:  # a value, if written in the backward (a parameter gathered again)
            grad = False
        tensor = name.split("@", 1)[0]
        dtype = self.dtypes.get(tensor)
        if dtype is None:
            return 4
        if tensor in self.compute and not grad and key in self.written:  # converted
            dtype = self.compute[tensor]
        return _itemsize(dtype)


@lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


_KEPT = "saved:"  # the key of what autograd keeps of a forward beside its inputs and output


def _scan(program: Program) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per value key: its elements, the index of its first write and of its last use. What a
    forward's derivative reads of its inputs and output (Compute.reads) is used again by its
    backward for the same micro-batch (autograd holds it until then); the seed gradient
    'hidup.ones' is no node's backward. A value written again by a recomputation (activation
    checkpointing) is a new one ('KEY~i', i its task), which the later tasks read (a
    recomputation no task reads is dropped from the step: it writes nothing); the forward's
    value is freed after its last read before, or held by autograd for the backward of an op
    that was not recomputed and reads it (attention in a selectively recomputed layer)."""
    numel: dict[str, int] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    saved: dict[tuple[str, int | None], tuple] = {}  # forwards awaiting their backward: what
    #   their derivative reads, their output's key, their input keys and those inputs' values
    now: dict[str, str] = {}  # a key written again -> its value's key now
    views: list[tuple[str, str]] = []  # (a view's key, the key of the value it views)
    gone = dropped(program)  # recomputations the step drops
    waits = {t.collective: i for i, t in enumerate(program.tasks) if type(t) is Wait}
    for i, t in enumerate(program.tasks):
        if type(t) is Wait:
            continue
        ins = tuple(now.get(key, key) for key in t.inputs)
        outs = t.outputs
        if t.phase == "recompute":
            outs = tuple(_again(numel, now, key, i) if key in first else key for key in outs)
        if type(t) is Compute and t.phase in ("fwd", "recompute"):
            saved[(t.node, t.mb)] = t.reads, outs[0], t.inputs, ins, t.keeps and f"{_KEPT}{i}"
            if t.id in gone:  # a recomputation dropped from the step: writes nothing, holds
                continue  # nothing (its backward still reads what it read)
            if t.keeps and t.reads is not None:
                first[f"{_KEPT}{i}"], numel[f"{_KEPT}{i}"] = i, t.keeps
        used = ins
        if type(t) is Compute and t.phase == "bwd" and ins:
            reads, out, raw, held, kept = saved.pop((t.node, t.mb), (None,) * 5)
            if kept in first:
                last[kept] = i
            reads = reads or (True,) * len(ins)
            if not t.again and raw is not None:  # autograd holds the values its forward read,
                #   not the ones a recomputation wrote since (a weight gathered again excepted)
                ins = ins[:1] + tuple(h if r == b else now_key for r, h, b, now_key in
                                      zip(raw, held, t.inputs[1:], ins[1:]))
            used = ins if t.again else derivative_reads(ins, reads)
            if out is not None and reads[-1]:
                last[out] = i
        for key in used:
            last[key] = i
        if type(t) is Convert:
            _convert_sizes(numel, first, t, ins, outs, i, program.world, program.k)
            _held_until_wait(numel, first, last, t, ins, i, waits.get(t.id), program)
        elif t.phase in ("fwd", "recompute"):
            for key, shape in zip(ins, t.in_shapes):
                if key not in numel:  # a parameter or an input: no task writes it
                    numel[key] = math.prod(shape)
            _written(numel, first, ((outs[0], t.out_shape),), i)
            if ins and (t.alias or is_view(t.op)):
                views.append((outs[0], ins[0]))
        elif t.op == "hidup.ones":
            _written(numel, first, ((outs[0], t.out_shape),), i)
        elif t.phase == "bwd":
            _written(numel, first, zip(outs, t.in_shapes), i)
            for key, shape in zip(ins[1:], t.in_shapes):  # a forward input read only here
                numel.setdefault(key, math.prod(shape))
    for view, base in reversed(views):  # a view holds its base's memory, no memory of its own
        last[base] = max(last.get(base, 0), last.get(view, 0))
        numel[view] = 0
    return numel, first, last


def _held_until_wait(numel, first, last, t: Convert, ins, i: int, wait: int | None,
                     program: Program) -> None:
    """A collective's work holds what it sends until its Wait: its input, or the copy packed
    from it (hidup.runtime.collectives.PACKING: a bucket's inputs flattened together, a shard
    moved to dim 0, a parameter cast to its compute dtype, an all-to-all's chunks stacked), a
    key 'INPUT#send-i' of its size and dtype from the conversion to the Wait. A bucket
    all-reduced in place holds no more than its outputs."""
    if wait is None or not t.collective or len(t.group or range(program.world)) < 2 or \
            (t.kind == "all_reduce" and len(ins) > 1):
        return
    moved = t.kind in ("all_gather", "reduce_scatter") and \
        getattr(t.src if t.kind == "all_gather" else t.dst, "dim", 0) != 0
    cast = t.kind == "all_gather" and t.tensor in program.compute
    if len(ins) == 1 and not (moved or cast or t.kind == "all_to_all"):
        last[ins[0]] = max(last.get(ins[0], wait), wait)  # the input itself
        return
    for key in ins:
        send = f"{key}#send-{i}"
        first[send], last[send], numel[send] = i, wait, numel[key]


def _again(numel: dict[str, int], now: dict[str, str], key: str, i: int) -> str:
    """Task i (a recomputation) writes `key` again: a new value, read under the key returned."""
    now[key] = f"{key}~{i}"
    numel[now[key]] = numel[key]
    return now[key]


@lru_cache(maxsize=None)
def is_view(op: str) -> bool:
    """Does ATen op 'aten.NAME.OVERLOAD' return a view of its first input (its schema says its
    output aliases it: view, transpose, expand, slice...)?"""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.rpartition(".")
    target = getattr(getattr(getattr(torch.ops, namespace, None), name, None), overload, None)
    schema = getattr(target, "_schema", None)
    if not (schema and schema.returns and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write):
        return False
    # reshape, contiguous, flatten: composites that view where they can and copy where they
    # cannot (an expanded or transposed input): counted as a copy
    return not target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def _written(numel: dict[str, int], first: dict[str, int], outputs, i: int) -> None:
    """Task i writes these (key, shape) pairs: a key's first write allocates it ('': none)."""
    for key, shape in outputs:
        if key and key not in first:
            first[key] = i
            numel[key] = math.prod(shape)


def _convert_sizes(numel, first, t: Convert, ins, outs, i: int, world: int, k: int) -> None:
    """A conversion reads `shape`; several inputs and outputs are a bucket, converted pairwise,
    except a join of the micro-batches' parts (mb_gather), each part of `shape`. ins, outs: the
    keys of its inputs' and outputs' values (_scan)."""
    for key in ins if t.kind == "mb_gather" else ins[:1]:  # a batch input: no task writes it
        numel.setdefault(key, math.prod(t.shape))
    for key, shape in zip(ins, t.in_shapes):  # a bucket's inputs
        numel.setdefault(key, math.prod(shape))
    for src, dst in zip(ins, outs):
        if dst not in first:
            first[dst] = i
            numel[dst] = _converted_numel(t, _known(numel, src, t), world, k)


def _known(numel: dict[str, int], key: str, t: Convert) -> int:
    if key not in numel:
        raise ValueError(f"task {t}: the size of its input {key} is not known (no earlier task "
                         f"writes it and its shape is not the conversion's `shape`)")
    return numel[key]


def _converted_numel(t: Convert, n: int, world: int, k: int) -> int:
    """Elements of a conversion's result: gathered x group, scattered or sliced / group; the
    micro-batches' parts joined x k, the whole sliced / k."""
    if t.kind in ("mb_gather", "mb_slice"):
        return n * k if t.kind == "mb_gather" else n // k
    group = len(t.group) or world
    if t.kind == "all_gather":
        return n * group
    if t.kind == "reduce_scatter" or (t.kind == "slice" and isinstance(t.dst, Shard)):
        return n // group
    return n  # all_reduce, all_to_all, alias


def _sweep(tasks, numel, first, last, size, params, inputs, optimizer, regions=None
           ) -> MemoryReport:
    """Allocate at first write, measure during the task, free after its last use: running sums,
    activations and gradients (keys first written by a backward task) apart, each key counted
    at `size(key, is_gradient)` bytes per element."""
    n = len(tasks)
    grad = [getattr(t, "phase", "") == "bwd" for t in tasks]
    alloc = [[0] * n, [0] * n]  # [activations, gradients] allocated at each task
    free = [[0] * n, [0] * n]
    for key, i in first.items():
        g = grad[i]
        nbytes = numel[key] * size(key, g)
        alloc[g][i] += nbytes
        free[g][max(last.get(key, i), i)] += nbytes
    during = []  # per kind: bytes live during each task
    for a, f in zip(alloc, free):
        before = accumulate(map(sub, a, f), initial=0)  # live before each task
        during.append(list(map(add, before, a)))
    for i, t in enumerate(tasks):  # what a task holds only while it runs
        during[grad[i]][i] += getattr(t, "scratch", 0)
    const = params + inputs + optimizer
    if not n:
        return MemoryReport(params, inputs, optimizer, 0, 0, const, None)
    total = list(map(add, *during))
    i = max(range(n), key=total.__getitem__)
    by_region = None
    if regions is not None:
        by_region = {}
        for key, live, act, grad in zip(regions, total, during[_ACT], during[_GRAD]):
            was = by_region.get(key, (0, 0, 0))
            by_region[key] = (max(was[0], live), max(was[1], act), max(was[2], grad))
    return MemoryReport(params, inputs, optimizer, max(during[_GRAD]), max(during[_ACT]),
                        const + total[i], tasks[i].id, by_region)
