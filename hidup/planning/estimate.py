"""The planner's fast cost estimate of a Program: one pass over its tasks with the simulator's
rules for one rank (identical ranks; every collective starts when the communication stream is free
and its inputs are written; a 2-D mesh's groups that cross one machine's link at once share it;
kernels run in order on the compute stream, after their Waits; with a GPU profile's host figures,
nothing starts before the host has issued it). Equal to the SimPy
simulator when the profile has no interference (a test checks it)."""
from __future__ import annotations

from dataclasses import dataclass

from hidup.planning.costs import Profile
from hidup.program.tasks import Convert, Program, Wait


@dataclass(frozen=True)
class Estimate:
    step_time: float
    computation: float
    communication: float


def estimate(program: Program, profile: Profile, mode: str = "graph") -> Estimate:
    """The step as the simulator runs it for `program` under `profile`, the executor in `mode`."""
    done: dict[int, float] = {}
    writers: dict[str, list[int]] = {}
    device = comm = computation = communication = host = 0.0
    unpacked: set[int] = set()  # collectives past their first Wait

    def kernel(seconds: float) -> float:  # on the compute stream, in order
        nonlocal device, computation
        device += seconds
        computation += seconds
        return device

    for task in program.tasks:
        issue = profile.issue_time(task, mode)
        if issue is not None:  # a GPU's host issues every task in order, ahead of the streams
            host += issue
            if not (isinstance(task, Convert) and task.collective):
                device = max(device, host)
        if isinstance(task, Wait):
            device = max(device, done[task.collective])
            coll = program.tasks[task.collective]
            unpack = profile.host_times(coll)[1]
            if unpack > 0 and task.collective not in unpacked:
                unpacked.add(task.collective)
                kernel(unpack)
            continue
        if isinstance(task, Convert) and task.collective:
            pack = profile.host_times(task)[0]
            issued = kernel(pack) if pack > 0 else 0.0
            start = max([comm, issued, host] +
                        [done[w] for key in task.inputs for w in writers.get(key, ())])
            latency, transfer = profile.network_split(task, task.group)
            load = profile.link_load(task.group, task.parts)  # groups sharing a machine's link
            comm = done[task.id] = start + latency + transfer * load
            communication += comm - start
        else:
            done[task.id] = kernel(profile.compute_time(task))
        for key in task.outputs:
            if key:
                writers.setdefault(key, []).append(task.id)
    return Estimate(max(done.values(), default=0.0), computation, communication)
