"""The kernels of a compiled step (executor mode 'compile'), for the cost model.

`--compile` puts each stretch of a rank's step between two communication calls through Inductor
(hidup.runtime.passes.inductor_segments). Inductor runs a library op (a matmul, a convolution,
attention: the ops hidup.graph.flops counts by their FLOPs) as the library's kernel, and
generates code for every other op, fusing the ops that share data into one kernel: a fused
kernel reads its inputs once and writes only what is used outside it, so the values passed
between its ops never go through memory, and it is launched once.

The cost model prices such a stretch the same way: among the step's kernels that the profile
prices by its roofline (a kernel measured on the cluster keeps its measured time, as the
executor ran it), each run of generated-code tasks between two communication calls (or a library
op, or the optimizer's update, which runs outside the graph) is split into the groups that share
a value (one writes what another reads, or both read it). Each group is one kernel: the launch
overhead once, its FLOPs, and the bytes of the values it reads from outside the group and of
those it writes that a task outside the group reads (or nothing reads: the step's results, such
as gradients). The group's time is charged to its last task, the others take none.

What this leaves out: Inductor fuses a pointwise epilogue into a matmul only when autotuning
(not by default), and a group whose ops reduce along different dimensions may be more than one
kernel; both are counted as above."""
from __future__ import annotations

import math

from hidup.graph.connected import connected
from hidup.graph.flops import library_op
from hidup.planning.costs import kernel_key
from hidup.program.recompute import dropped
from hidup.program.tasks import Compute, Convert, Program


def kernel_times(program: Program, profile, mode: str = "graph") -> dict[int, float]:
    """Seconds of each compute-stream task of `program` but the collectives (Profile.compute_time:
    a kernel, a local conversion, an alias unless measured), by task id: none for a task the
    traced step drops (hidup.program.recompute.dropped); in mode 'compile' with the
    generated-code groups fused (the module's rule)."""
    gone = dropped(program)
    times = {t.id: 0.0 if t.id in gone else profile.compute_time(t) for t in program.tasks
             if isinstance(t, Compute) or (isinstance(t, Convert) and not t.collective)}
    if mode == "compile":
        for group in fused_groups(program, profile):
            flops = sum(t.flops for t in group)
            times.update({t.id: 0.0 for t in group})
            times[group[-1].id] = profile.kernel_time(flops, _group_bytes(group, program))
    for t in program.tasks:  # collectives inside a kernel (Compute.inner) hold its stream
        if isinstance(t, Compute) and t.inner and t.id not in gone:
            group = program.group(0, program.op_axes(t.option))
            times[t.id] += sum(profile.collective_time(kind, b, group) for kind, b in t.inner)
    return times


def fused_groups(program: Program, profile) -> list[list[Compute]]:
    """The groups of two or more generated-code tasks that Inductor runs as one kernel each, in
    program order."""
    measured, gone = profile.kernels or {}, dropped(program)
    groups, run = [], []
    for task in program.tasks:
        if getattr(task, "id", None) in gone:
            continue
        if generated(task) and kernel_key(task) not in measured:
            run.append(task)
            continue
        groups += connected(run, _keys)
        run = []
    groups += connected(run, _keys)
    return [g for g in groups if len(g) > 1]


def generated(task) -> bool:
    """Whether Inductor generates the task's code: a forward or backward of an op no library
    runs (the optimizer's update runs outside the graph; conversions and waits end a stretch
    or are copies the cost model keeps apart)."""
    return isinstance(task, Compute) and task.phase != "update" and not library_op(task.op)


def _keys(task: Compute) -> list[str]:
    """The value keys a task reads or writes (what groups it with others in a run)."""
    return [key for key in (*task.inputs, *task.outputs) if key]


def _values(task: Compute) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(reads, writes) of a task as (value key, bytes): the task's bytes shared out over the
    values it moves by their elements, as the lowering counted them (a forward reads its inputs
    and writes its output; a backward reads the output's gradient and the forward's inputs and
    writes the inputs' gradients)."""
    ins = [math.prod(s) for s in task.in_shapes]
    out = math.prod(task.out_shape)
    if task.phase == "bwd":
        reads = [(task.inputs[0], out)] + list(zip(task.inputs[1:], ins)) if task.inputs else []
        writes = [(key, n) for key, n in zip(task.outputs, ins) if key]
    else:
        reads = list(zip(task.inputs, ins))
        writes = [(key, out) for key in task.outputs if key]
    elements = sum(n for _, n in reads) + sum(n for _, n in writes)
    per = task.bytes / elements if elements else 0.0
    return [(k, n * per) for k, n in reads], [(k, n * per) for k, n in writes]


def _group_bytes(group: list[Compute], program: Program) -> float:
    """Bytes one fused kernel moves: what it reads from outside the group, once per value, and
    what it writes that a task outside it reads or that nothing reads."""
    members = {t.id for t in group}
    written, nbytes = set(), 0.0
    read: set[str] = set()
    for task in group:
        reads, writes = _values(task)
        for key, n in reads:
            if key not in written and key not in read:
                read.add(key)
                nbytes += n
        for key, n in writes:
            if key not in written:
                written.add(key)
                readers = _readers(program).get(key)
                if not readers or not readers <= members:
                    nbytes += n
    return nbytes


def _readers(program: Program) -> dict[str, set[int]]:
    """Value key -> ids of the tasks that read it (kept with the program)."""
    cached = program.__dict__.get("_readers")
    if cached is None:
        cached = {}
        for task in program.tasks:
            for key in getattr(task, "inputs", ()):
                cached.setdefault(key, set()).add(task.id)
        program.__dict__["_readers"] = cached
    return cached
