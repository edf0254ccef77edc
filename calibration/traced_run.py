"""One traced run read for calibration.from_trace: a PyTorch-profiler Chrome trace paired with the
Program of the same run, and what is read off it: per forward op kind the GPU seconds of a step
(kernel points), the collectives' kernels paired with the Program's collectives or sized by their
chunk copies (link points), the step's summed computation kernel time and the host's busy time."""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from pathlib import Path

from calibration.trace import (TraceError, KERNELS, external_id, is_communication, load_trace,
                               step_gpu_events, steps, traced_update)
from calibration.traced_plan import collective_kernels, derive_plan, nccl_kind, sized
from hidup.graph.capture import Graph
from hidup.planning.costs import issues
from hidup.planning.planfile import resolve_strategy
from hidup.program import COLLECTIVES, Compute, Program, lower
from simulator.intervals import covered, union

# the trace's forward op (PyTorch 1.10 names) -> the captured graph's op of the same kind
OP_KINDS = {"aten::linear": "aten.linear.default", "aten::einsum": "aten.einsum.default",
            "aten::layer_norm": "aten.layer_norm.default", "aten::relu": "aten.relu.default",
            "aten::add": "aten.add.Tensor", "aten::mul": "aten.mul.Tensor"}


@dataclass(frozen=True)
class TracedRun:
    """One trace, the Program it is paired with, and what was read off it."""

    path: Path
    strategy: str
    program: Program
    kernel_points: dict[str, tuple[float, float, float]]  # op kind -> (flops, bytes, s) per op
    link_points: list[tuple[str, int, float, float]]  # (kind, n, nbytes, seconds)
    notes: list[str]
    computation: float  # summed computation kernel seconds per step, from the trace
    host: float  # seconds per step the host spent in ops, not waiting for the GPU (host_seconds)
    model: str  # the zoo model of the run


def forward_op_times(events: list[dict]) -> dict[str, list[float]]:
    """Per op kind in OP_KINDS, the GPU seconds of each profiled step's forward pass: every
    kernel launched under the outermost op of that kind (nested ops by time range, kernels by
    their external id)."""
    kernels: dict[int, float] = {}
    for e in events:
        if e.get("cat") in KERNELS and not is_communication(e):
            ext = external_id(e)
            kernels[ext] = kernels.get(ext, 0.0) + e["dur"] * 1e-6
    cpu = sorted((e for e in events if e.get("cat") == "cpu_op"),
                 key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    starts = [(e["tid"], e["ts"]) for e in cpu]
    out: dict[str, list[float]] = {k: [] for k in OP_KINDS}
    for step in steps(events):
        tid, begin, end = forward_range(step, cpu)
        totals = dict.fromkeys(OP_KINDS, 0.0)
        i = bisect.bisect_left(starts, (tid, begin))
        inside_until = -1.0  # the end of the outermost counted op we are in
        while i < len(cpu) and cpu[i]["tid"] == tid and cpu[i]["ts"] <= end:
            op = cpu[i]
            if op["name"] in OP_KINDS and op["ts"] >= inside_until:
                inside_until = op["ts"] + op["dur"]
                j = i
                while j < len(cpu) and cpu[j]["tid"] == op["tid"] and cpu[j]["ts"] <= inside_until:
                    totals[op["name"]] += kernels.get(external_id(cpu[j]), 0.0)
                    j += 1
            i += 1
        for kind, seconds in totals.items():
            out[kind].append(seconds)
    return out


def forward_range(step: dict, cpu: list[dict]) -> tuple[int, float, float]:
    """(thread, start, end) in us of a profiled step's forward pass: its 'forward' range where
    the run annotated one (the V100 traces), else the step's thread from the step's start until
    the autograd engine's first backward function (an eager PyTorch 2.x step, as the H100
    traces: the forward on the main thread, then the backward)."""
    inside = [e for e in cpu if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
    fwd = [e for e in inside if e["name"] == "forward"]
    if fwd:
        return fwd[0]["tid"], fwd[0]["ts"], fwd[0]["ts"] + fwd[0]["dur"]
    backward = [e["ts"] for e in inside if e["name"].startswith("autograd::engine")]
    if not backward:
        raise TraceError("a profiled step has neither a 'forward' range nor autograd backward "
                         "functions; annotate the forward pass with "
                         "torch.profiler.record_function('forward')")
    return step["tid"], step["ts"], min(backward)


def collective_times(per_step_events: list[list[dict]]) -> dict[str, list[float]]:
    """Per collective kind, the shortest duration over the profiled steps of its i-th kernel: an
    NCCL kernel starts on this rank when issued and spins until its peers join, so the shortest
    of the repeats is the closest to the transfer itself."""
    per_step = []
    for step_events in per_step_events:
        kinds: dict[str, list[float]] = {}
        for e in collective_kernels(step_events):
            kind = nccl_kind(e["name"])
            if kind:
                kinds.setdefault(kind, []).append(e["dur"] * 1e-6)
        per_step.append(kinds)
    out = {}
    for kind in per_step[0]:
        runs = [k.get(kind, []) for k in per_step]
        if len({len(r) for r in runs}) == 1:
            out[kind] = [min(col) for col in zip(*runs)]
    return out


def read_run(path: Path, strategy_arg: str, graph: Graph, model: str, world: int,
             profiler_overhead: float = 0.0, optimizer: str = "sgd") -> TracedRun:
    """Pair one trace with its Program and read the kernel and collective points off it. The
    Program's update is the optimizer whose step the trace records, else `optimizer`."""
    events = load_trace(path)
    update = traced_update(events)
    notes = [f"optimizer {update.optimizer} (the trace's optimizer step: {update.kernels} "
             f"kernels, {update.seconds * 1e3:.2f} ms a step)" if update else
             f"optimizer {optimizer} (the trace names none: --optimizer)"]
    if strategy_arg == "traced":
        strategy, lines = derive_plan(events, graph, world)
        notes.append(f"plan read from the trace's all-gathers: {len(lines)} parameters kept "
                     f"sharded")
        bucket = 0  # the prototype reduced each replicated parameter's gradient on its own
    else:
        strategy, bucket = resolve_strategy(strategy_arg, graph, world), 25 * 2 ** 20
    traced = _compute_streams(events)  # the paper prototype's Duplex ran one per micro-batch
    k = 2 if traced > 1 else 1
    program = lower(graph, strategy, world, k, model, bucket_bytes=bucket,
                    optimizer=update.optimizer if update else optimizer)
    notes.append(f"{strategy.name}, k={k} ({traced} CUDA compute stream(s) in the trace)")

    times = forward_op_times(events)
    fwd = [t for t in program.tasks if isinstance(t, Compute) and t.phase == "fwd"]
    kernel_points = {}
    for trace_op, op in OP_KINDS.items():
        tasks = [t for t in fwd if t.op == op]
        seconds = statistics.fmean(times[trace_op]) if times[trace_op] else 0.0
        if tasks and seconds > 0:
            n = len(tasks)
            kernel_points[op] = (sum(t.flops for t in tasks) / n, sum(t.bytes for t in tasks) / n,
                                 seconds / n)

    link_points = []
    per_step = step_gpu_events(events)
    traced = collective_times(per_step)
    for kind in ("all_gather", "reduce_scatter"):  # sized by their chunk copies, if recorded
        try:
            runs = [sized(step_events, world, kind) for step_events in per_step]
        except TraceError:
            continue
        if runs[0] and len({tuple(g.nbytes for g in r) for r in runs}) == 1:
            link_points += [(kind, world, float(col[0].nbytes), min(g.seconds for g in col))
                            for col in zip(*runs)]
            notes.append(f"{kind}: {len(runs[0])} kernels sized by their chunk copies")
            traced.pop(kind, None)
    for kind in COLLECTIVES:
        ours = [c for c in program.collectives if c.kind == kind]
        theirs = traced.get(kind, [])
        if not theirs:
            continue
        if len(ours) < len(theirs):
            notes.append(f"{kind}: trace {len(theirs)} kernels, Program {len(ours)}: not paired")
            continue
        if len(ours) > len(theirs):
            drop = sorted(ours, key=lambda c: c.bytes)[:len(ours) - len(theirs)]
            notes.append(f"{kind}: the Program's {len(drop)} smallest "
                         f"({', '.join(f'{c.bytes} B' for c in drop)}) not in the trace")
            ours = [c for c in ours if c not in drop]
        link_points += [(kind, len(c.group), float(c.bytes), s) for c, s in zip(ours, theirs)]
        notes.append(f"{kind}: {len(theirs)} kernels paired")
    return TracedRun(path, strategy_arg, program, kernel_points, link_points, notes,
                     kernel_seconds(per_step), host_seconds(events, profiler_overhead), model)


def host_seconds(events: list[dict], overhead: float = 0.0) -> float:
    """Mean over the profiled steps of the host's busy time: the union of every thread's ops
    (forward, autograd's backward, optimizer) in the step, less the parts of it spent in CUDA
    calls that wait for the GPU (synchronizations inside an op), less `overhead` seconds per
    host event recorded in the step (ops and CUDA calls: the profiler's own cost of recording
    each; for the H100 traces 2.94 us, see docs/simulator_accuracy.md)."""
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op"]
    waits = union([(e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")])
    recorded = [e["ts"] for e in events if e.get("cat") in ("cpu_op", "cuda_runtime")]
    out = []
    for step in steps(events):
        begin, end = step["ts"], step["ts"] + step["dur"]
        busy = union([(max(a, begin), min(b, end)) for a, b in ops if a < end and b > begin])
        waiting = sum(covered(a, b, busy) for a, b in waits)
        events_in_step = sum(begin <= t < end for t in recorded)
        out.append(max(0.0, (sum(b - a for a, b in busy) - waiting) * 1e-6
                        - events_in_step * overhead))
    return statistics.fmean(out)


def issued_tasks(program: Program) -> int:
    """The tasks a host issues in one step (hidup.planning.costs.issues)."""
    return sum(map(issues, program.tasks))


def kernel_seconds(per_step_events: list[list[dict]]) -> float:
    """Mean over the profiled steps of the summed durations of the computation kernels (kernels
    of two streams that ran at the same time both count: the Program's kernels are summed too)."""
    return statistics.fmean(sum(e["dur"] for e in step if not is_communication(e)) * 1e-6
                            for step in per_step_events)


def _compute_streams(events: list[dict]) -> int:
    """How many CUDA streams ran the computation in the profiled steps (each at least 5% of its
    kernels; a few set-up kernels on another stream do not count)."""
    first = steps(events)[0]["ts"]
    counts: dict = {}
    for e in events:
        if e.get("cat") in KERNELS and e["ts"] >= first and not is_communication(e):
            counts[e["args"].get("stream")] = counts.get(e["args"].get("stream"), 0) + 1
    return max(1, sum(c >= 0.05 * sum(counts.values()) for c in counts.values()))
