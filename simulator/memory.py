"""Peak memory of one rank's Program: which tensors PyTorch holds at each task when the tasks run in
order, each value freed after its last use. One linear pass over the tasks, last uses precomputed.

Rules (all sizes are numel x `itemsize`; the Program has no dtypes, so integer index tensors are
counted at `itemsize` too, a small over-estimate):
- parameters: every local shard (a key `name@placement/*` of a `program.param_grads` name that no
  task writes) lives the whole step; so does the optimizer state, `optimizer_bytes_per_param`
  bytes per local parameter element (0 for SGD as the executor uses, 8 for Adam's fp32 moments).
- inputs: every other value read but never written (user inputs, buffers) lives the whole step.
- gradients: a key written by a backward Compute or Convert is one accumulated buffer, allocated at
  its first write and freed after its last read; a final parameter gradient lives until the
  'update' task has run.
- activations: a forward Compute's output, or a forward Convert's (allocated when the collective
  is issued), is freed after its last read; autograd also keeps a forward node's inputs and output
  until that node's backward task for the same micro-batch has run. Loss values live all step.
Not modelled: tensors autograd saves inside one op (softmax outputs, dropout masks), transient
buffers of a task (an accumulation's sum, a gather's staging copy), views sharing storage with
their base (a view / transpose output is counted as a new tensor: an over-estimate), allocator
caching and fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hidup.placement import Shard
from hidup.program import Compute, Convert, Program

_GRAD, _ACT = 0, 1


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

    def __str__(self) -> str:
        at = "" if self.peak_task_id is None else f" at #{self.peak_task_id}"
        return (f"peak {_fmt(self.peak)}{at}: params {_fmt(self.params)}, optimizer "
                f"{_fmt(self.optimizer)}, inputs {_fmt(self.inputs)}, gradients <= "
                f"{_fmt(self.grads_peak)}, activations <= {_fmt(self.activations_peak)}")


def _fmt(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def peak_memory(program: Program, itemsize: int = 4,
                optimizer_bytes_per_param: int = 0) -> MemoryReport:
    """The peak bytes one rank holds while the executor runs `program`'s tasks in order."""
    tasks = program.tasks
    numel = _numels(program)
    first, last, kind = _first_last(tasks)
    _hold_for_backward(tasks, last)
    end = len(tasks) - 1
    update = next((i for i, t in enumerate(tasks) if isinstance(t, Compute)
                   and t.phase == "update"), end)
    for key in program.param_grads.values():
        last[key] = max(last.get(key, update), update)
    for key in program.loss_keys:
        last[key] = end
    names = set(program.param_grads)
    params = inputs = 0
    for key in last.keys() - first.keys():
        if key.split("@", 1)[0] in names and key.endswith("/*"):
            params += numel[key]
        else:
            inputs += numel[key]
    return _sweep(tasks, numel, first, last, kind, itemsize, params * itemsize,
                  inputs * itemsize, params * optimizer_bytes_per_param)


def _numels(program: Program) -> dict[str, int]:
    """Element count of every value key, from the local shapes the tasks carry."""
    numel: dict[str, int] = {}
    for t in program.tasks:
        if isinstance(t, Compute):
            ins = t.inputs[1:] if t.phase == "bwd" else t.inputs
            if t.phase == "bwd" and t.inputs:
                numel.setdefault(t.inputs[0], math.prod(t.out_shape))
            for key, shape in zip(ins, t.in_shapes):
                numel.setdefault(key, math.prod(shape))
            if t.phase == "fwd" or t.op == "hidup.ones":
                numel.setdefault(t.outputs[0], math.prod(t.out_shape))
            elif t.phase == "bwd":
                for key, shape in zip(t.outputs, t.in_shapes):
                    if key:
                        numel.setdefault(key, math.prod(shape))
        elif isinstance(t, Convert):
            n = math.prod(t.shape)
            numel.setdefault(t.inputs[0], n)
            numel.setdefault(t.outputs[0], _converted_numel(t, n, program.world))
    return numel


def _converted_numel(t: Convert, n: int, world: int) -> int:
    """Elements of a conversion's result: gathered x group, scattered or sliced / group."""
    group = len(t.group) or world
    if t.kind == "all_gather":
        return n * group
    if t.kind == "reduce_scatter" or (t.kind == "slice" and isinstance(t.dst, Shard)):
        return n // group
    return n  # all_reduce, all_to_all, alias


def _first_last(tasks) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per key: index of its first write, of its last read (its first write if never read), and
    whether it is a gradient (written in backward) or an activation."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    kind: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if isinstance(t, (Compute, Convert)):
            for key in t.inputs:
                last[key] = i
            for key in t.outputs:
                if key and key not in first:
                    first[key] = i
                    kind[key] = _GRAD if t.phase == "bwd" else _ACT
                    last.setdefault(key, i)
    for key, i in first.items():
        if last[key] < i:  # read only before it was written: that read was of an input
            last[key] = i
    return first, last, kind


def _hold_for_backward(tasks, last: dict[str, int]) -> None:
    """Autograd keeps a forward node's inputs and output until its backward for the same
    micro-batch (the seed gradient 'hidup.ones' is not that backward)."""
    bwd = {(t.node, t.mb): i for i, t in enumerate(tasks) if isinstance(t, Compute)
           and t.phase == "bwd" and t.op != "hidup.ones"}
    for t in tasks:
        if isinstance(t, Compute) and t.phase == "fwd":
            j = bwd.get((t.node, t.mb))
            if j is not None:
                for key in t.inputs + t.outputs[:1]:
                    if last[key] < j:
                        last[key] = j


def _sweep(tasks, numel, first, last, kind, itemsize, params, inputs, optimizer) -> MemoryReport:
    """Walk the tasks once: allocate at first write, measure, free after last read."""
    n = len(tasks)
    alloc = [[0] * n, [0] * n]
    free = [[0] * n, [0] * n]
    for key, i in first.items():
        size, k = numel[key] * itemsize, kind[key]
        alloc[k][i] += size
        free[k][last[key]] += size
    const = params + inputs + optimizer
    live, peaks = [0, 0], [0, 0]
    peak, peak_at = const, None
    for i in range(n):
        live[0] += alloc[0][i]
        live[1] += alloc[1][i]
        peaks[0] = max(peaks[0], live[0])
        peaks[1] = max(peaks[1], live[1])
        total = const + live[0] + live[1]
        if peak_at is None or total > peak:
            peak, peak_at = total, tasks[i].id
        live[0] -= free[0][i]
        live[1] -= free[1][i]
    return MemoryReport(params, inputs, optimizer, peaks[_GRAD], peaks[_ACT], peak, peak_at)
