"""The planner's fast cost estimate of a Program: one pass over its tasks with the simulator's
rules for one rank (identical ranks; every collective starts when the communication stream is free
and its inputs are written; kernels run in order on the device, after their Waits and events).
Equal to the SimPy simulator when the profile has no interference (a test checks it)."""
from __future__ import annotations

from dataclasses import dataclass

from hidup.profile import Profile
from hidup.program import Convert, Program, Wait


@dataclass(frozen=True)
class Estimate:
    step_time: float
    computation: float
    communication: float


def estimate(program: Program, profile: Profile) -> Estimate:
    done: dict[int, float] = {}
    writers: dict[str, list[int]] = {}
    device = comm = computation = communication = 0.0
    ready: dict[int, float] = {}  # compute stream -> when its next kernel may start
    for task in program.tasks:
        if isinstance(task, Wait):
            ready[task.stream] = max(ready.get(task.stream, 0.0), done[task.collective])
            continue
        if isinstance(task, Convert) and task.collective:
            start = max([comm] + [done[w] for key in task.inputs for w in writers.get(key, ())])
            comm = done[task.id] = start + profile.collective_time(task.kind, task.bytes,
                                                                  task.group)
            communication += comm - start
        else:
            start = max([device, ready.get(task.stream, 0.0)] + [done[a] for a in task.after])
            took = profile.compute_time(task)
            device = ready[task.stream] = done[task.id] = start + took
            computation += took
        for key in task.outputs:
            if key:
                writers.setdefault(key, []).append(task.id)
    return Estimate(max(done.values(), default=0.0), computation, communication)
