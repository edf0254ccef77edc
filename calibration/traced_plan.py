"""Read which strategy a traced run executed, from its collectives, and express it as a plan.

A PyTorch-profiler trace names no tensors, but it records, per step, the NCCL kernels in issue
order and the device-to-device copies with their byte counts. The HiDup prototype all-gathers a
sharded parameter into a list of per-rank chunks: each AllGather kernel is followed, on the
communication stream, by one copy per rank of `bytes / world`. So the forward's all-gathers give
the sizes of the tensors gathered, in order of use. A parameter-sized gather before any
computation that needs it is a parameter kept sharded (ZeRO-3 style, gathered once per step,
its gradient reduce-scattered back); the SendRecv groups are expert-parallel all-to-alls.

`derive_plan` starts from the `expert` strategy (experts split, everything else data parallel)
and shards, along dim 0, the parameters whose sizes match the gathered ones, matched in the
order the model first uses its parameters (each gather takes the first unused parameter of its
size at or after the previous gather's). What it found is printed, so the derivation can be
checked against the trace by eye. The prototype all-reduced each replicated parameter's
gradient on its own (the trace's small all-reduces, one per parameter): lower the plan with
bucket_bytes=0 to do the same.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, replace

from calibration.trace import TraceError, step_gpu_events
from hidup.graph.capture import Graph
from hidup.graph.placement import Shard
from hidup.planning.planfile import check
from hidup.strategy import Strategy, expert_parallel


@dataclass(frozen=True)
class Gather:
    """One all-gather of the traced step: its kernel time and the tensor's whole size."""

    seconds: float
    nbytes: int


def collective_kernels(step_events: list[dict]) -> list[dict]:
    """The NCCL kernels and device-to-device copies among one step's GPU events (in order)."""
    return [e for e in step_events if e["name"].startswith("nccl")
            or (e.get("cat") == "Memcpy" and "DtoD" in e["name"])]


def one_step(events: list[dict], step: int) -> list[dict]:
    """Profiled step `step`'s GPU events (calibration.trace.step_gpu_events)."""
    per_step = step_gpu_events(events)
    if not 0 <= step < len(per_step):
        raise TraceError(f"the trace has {len(per_step)} profiled steps; step {step} is not one")
    return per_step[step]


def nccl_kind(name: str) -> str | None:
    """'ncclKernel_AllGather_RING_LL_...' -> 'all_gather' (SendRecv: the pieces of all_to_all)."""
    if not name.startswith("nccl"):
        return None
    word = name.split("_")[1]
    return {"AllGather": "all_gather", "AllReduce": "all_reduce",
            "ReduceScatter": "reduce_scatter", "SendRecv": "all_to_all"}.get(word)


def sized(step_events: list[dict], world: int, kind: str) -> list[Gather]:
    """One step's all-gathers (or reduce-scatters) with their whole size: the per-rank chunk
    copies on the kernel's stream right after it (or, for a reduce-scatter, right before it:
    the chunks packed into its input), `world` equal ones, times `world`."""
    out = []
    kernels = collective_kernels(step_events)
    for i, e in enumerate(kernels):
        if nccl_kind(e["name"]) != kind:
            continue
        stream = e["args"].get("stream")
        near = kernels[i + 1:i + 1 + world] if kind == "all_gather" else kernels[max(0, i - world):i]
        copies = [c["args"].get("bytes", 0) for c in near
                  if c.get("cat") == "Memcpy" and c["args"].get("stream") == stream]
        if len(copies) != world or len(set(copies)) != 1:
            raise TraceError(f"{kind} at ts {e['ts']}: expected {world} equal copies of its "
                             f"chunks beside it on stream {stream}, found {copies}; this trace "
                             f"does not record the collective's sizes")
        out.append(Gather(e["dur"] * 1e-6, copies[0] * world))
    return out


def gathers(events: list[dict], world: int, step: int = 1) -> list[Gather]:
    """The step's all-gathers with their whole size (see `sized`)."""
    return sized(one_step(events, step), world, "all_gather")


def derive_plan(events: list[dict], graph: Graph, world: int, step: int = 1
                ) -> tuple[Strategy, list[str]]:
    """The traced run's plan (see the module text) and one line per gathered tensor."""
    params = {n.name: n for n in graph.params}
    order = []  # parameters in order of first use
    for node in graph.ops:
        order += [t for t in node.inputs if t in params and t not in order]
    base = expert_parallel(graph, world)
    placements, used, lines = dict(base.placements), set(), []
    at = 0  # gathers come in order of use: each matches at or after the previous match
    for g in gathers(events, world, step):
        name = next((t for t in order[at:] if t not in used and params[t].out.nbytes == g.nbytes),
                    None)
        if name is None:
            raise TraceError(f"an all-gather of {g.nbytes} bytes matches no unused parameter of "
                             f"the model: the trace is of another model or batch")
        used.add(name)
        at = order.index(name)
        placements[name] = Shard(0)
        lines.append(f"all_gather {g.nbytes:>10d} B {g.seconds * 1e3:7.3f} ms -> {name} "
                     f"{params[name].out.shape} sharded S(0)")
    strategy = replace(base, name="traced-hidup", placements=placements)
    check(graph, strategy)
    return strategy, lines


def kind_counts(events: list[dict], step: int = 1) -> dict[str, int]:
    """How many NCCL kernels of each kind the step ran."""
    return dict(collections.Counter(k for e in collective_kernels(one_step(events, step))
                                    if (k := nccl_kind(e["name"]))))
