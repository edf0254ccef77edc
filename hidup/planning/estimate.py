"""The planner's fast cost estimate of a Program: the simulator's rules for one rank, without
SimPy (identical ranks; kernels run in order on the compute stream, after their Waits; every
collective starts when the communication stream is free and its inputs are written, one at a
time; a 2-D mesh's groups that cross one machine's link at once share it; while both streams run,
each runs at the rate the profile's interference allows; with a GPU profile's host figures,
nothing starts before the host has issued it). Equal to the SimPy simulator on one
communication lane (tests check it, with interference and without)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from hidup.planning.costs import Profile, timing_key
from hidup.planning.fusion import kernel_times
from hidup.program.recompute import dropped
from hidup.program.tasks import Convert, Program, Wait


@dataclass(frozen=True)
class Estimate:
    step_time: float
    computation: float
    communication: float


def estimate(program: Program, profile: Profile, mode: str = "graph") -> Estimate:
    """The step as the simulator runs it for `program` under `profile`, the executor in `mode`:
    the compute stream and the communication stream of one rank side by side, each at the rate
    the other allows (the profile's interference: a kernel slows while a collective runs and a
    collective while a kernel runs; a kernel timed in real steps is not slowed again)."""
    compute, collectives, unpacks = _streams(program, profile, mode)
    slowdown = {"compute": profile.interference_compute, "comm": profile.interference_comm,
                "latency": profile.latency_slowdown}
    done: dict[int, float] = {}
    now = computation = communication = 0.0
    ci = qi = 0
    kernel = None  # [seconds of work left, slowed, ids done at its end]
    wire = None  # [seconds of work left, 'latency' or 'comm', transfer to come, id, start]
    while True:
        wake = []  # when a stream that cannot go on now may
        while kernel is None and ci < len(compute):  # the compute stream's next kernel
            kind, issued, what = compute[ci]
            ready = max(issued, done.get(what, math.inf)) if kind == "wait" else issued
            if ready > now:
                wake.append(ready)
                break
            ci += 1
            if kind == "kernel":
                kernel = list(what)
            elif what in unpacks:  # the first Wait unpacks the collective's result (its end
                # counts toward the step's: the last of a step's waits may unpack last)
                seconds, slowed = unpacks.pop(what)
                kernel = [seconds, slowed, (("unpacked", what),)]
        if wire is None and qi < len(collectives):  # the communication stream's next
            cid, needs, issued, latency, transfer = collectives[qi]
            start = max([issued, *(done.get(n, math.inf) for n in needs)])
            if start > now:
                wake.append(start)
            else:
                qi += 1
                wire = [latency, "latency", transfer, cid, now]
        if kernel is None and wire is None:
            if ci == len(compute) and qi == len(collectives):
                break
            now = min(wake, default=math.inf)
            if now == math.inf:
                raise ValueError(f"program {program.model} ({program.strategy}): a Wait comes "
                                 f"before the task its collective's input needs")
            continue
        kernel_rate = 1.0 / slowdown["compute"] if kernel and kernel[1] and wire else 1.0
        wire_rate = 1.0 / slowdown[wire[1]] if wire and kernel else 1.0
        step = min([w - now for w in wake] + ([kernel[0] / kernel_rate] if kernel else [])
                   + ([wire[0] / wire_rate] if wire else []))
        now += step
        if kernel:
            computation += step
            kernel[0] -= step * kernel_rate
            if kernel[0] <= _DONE * now:
                done.update((tid, now) for tid in kernel[2])
                kernel = None
        if wire:
            wire[0] -= step * wire_rate
            if wire[0] <= _DONE * now and wire[1] == "latency":
                wire[0:3] = [wire[2], "comm", 0.0]
            if wire[0] <= _DONE * now and wire[1] == "comm":
                done[wire[3]] = now
                communication += now - wire[4]
                wire = None
    return Estimate(max(done.values(), default=0.0), computation, communication)


_DONE = 1e-12  # work left below this share of the time: finished (float rounding)


def _streams(program: Program, profile: Profile, mode: str) -> tuple[list, list, dict]:
    """What the two streams of a rank run, in program order, each item with the time the host
    has issued it (0 where the profile has no host figures). The compute stream: ('kernel',
    issued, (seconds, slowed, ids done at its end)) or ('wait', issued, collective id). The
    collectives: (id, ids whose end it needs, issued, latency, transfer). Each collective's
    unpacking at its first Wait: id -> (seconds, slowed)."""
    measured = set(profile.kernels or ()) if profile.kernels_in_situ else set()
    by_id = {t.id: t for t in program.tasks if isinstance(t, Convert) and t.collective}

    def slowed(task) -> bool:  # not a kernel timed in real steps (interference in it already)
        return not (measured and timing_key(task, by_id) in measured)

    seconds, gone = kernel_times(program, profile, mode), dropped(program)
    writers: dict[str, list[int]] = {}
    compute, collectives, unpacks = [], [], {}
    host = 0.0
    for task in program.tasks:
        issue = profile.issue_time(task, mode)
        if issue is not None and task.id not in gone:  # a GPU's host issues every task in
            host += issue  # order, ahead of the streams (none that the traced step drops)
        if isinstance(task, Wait):
            compute.append(("wait", host, task.collective))
            continue
        if isinstance(task, Convert) and task.collective:
            pack, unpack = profile.host_times(task)
            needs = [w for key in task.inputs for w in writers.get(key, ())]
            if pack > 0:  # issuing it packs its input on the compute stream first
                compute.append(("kernel", host, (pack, slowed(task), (-task.id - 1,))))
                needs.append(-task.id - 1)
            if unpack > 0:
                unpacks[task.id] = (unpack, slowed(Wait(-1, task.id)))
            latency, transfer = profile.network_split(task, task.group)
            load = profile.link_load(task.group, task.parts)  # groups sharing a machine's link
            collectives.append((task.id, tuple(needs), host, latency, transfer * load))
        else:
            compute.append(("kernel", host, (seconds.get(task.id, 0.0), slowed(task),
                                             (task.id,))))
        for key in task.outputs:
            if key:
                writers.setdefault(key, []).append(task.id)
    return compute, collectives, unpacks
