"""What a simulated step gives back: each task's run on a rank's stream (Record), the step's
time with rank 0's computation, communication and overlap (Result, worked out from the records),
the streams' numbers, and the error for a Program that cannot be simulated."""
from __future__ import annotations

from dataclasses import dataclass

from hidup.cli import number
from hidup.program import Compute, Convert
from simulator.intervals import covered, union

COMPUTE_STREAM, COMM_STREAM, HOST = 0, 1, 2  # each rank's tracks, as numbered in `Result.records`


class SimulationError(ValueError):
    """A Program cannot be simulated: a wait for no collective, a partial group, a deadlock."""


@dataclass(frozen=True)
class Record:
    """One task's run on one rank's stream, in seconds from the start of the step."""

    task: Compute | Convert
    stream: int
    start: float
    end: float
    lane: int = 0  # on the communication stream: which of the collectives in flight at once

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Result:
    """Step time; rank 0's computation, communication and overlap (paper, Table III); seconds."""

    step_time: float
    computation: float  # busy time of rank 0's compute stream
    communication: float  # sum of rank 0's collective durations
    overlap_ratio: float  # share of communication that runs while rank 0 computes
    exposed_communication: float  # communication not hidden under computation
    comm_stream: int  # the stream number of the communication stream in `records`
    records: tuple[tuple[Record, ...], ...]  # per rank, in order of completion
    events: int = 0  # discrete events processed
    # the step's time with neither of rank 0's streams busy: its host issuing tasks (a GPU
    # profile's host figures), or waiting for another rank
    idle: float = 0.0

    def __str__(self) -> str:
        ms = {k: getattr(self, k) * 1e3 for k in ("step_time", "computation", "communication",
                                                  "exposed_communication")}
        return (f"step {number(ms['step_time'])} ms: computation {number(ms['computation'])} ms, "
                f"communication {number(ms['communication'])} ms, overlap "
                f"{self.overlap_ratio:.1%}, exposed {number(ms['exposed_communication'])} ms")


def step_result(records: list[list[Record]]) -> Result:
    """The step's Result from every rank's records (its figures: rank 0's)."""
    ends = [r.end for rank in records for r in rank]
    mine = records[0] if records else []
    busy = union([(r.start, r.end) for r in mine if r.stream == COMPUTE_STREAM])
    comm = [(r.start, r.end) for r in mine if r.stream == COMM_STREAM]
    communication = sum(e - s for s, e in comm)
    overlapped = sum(covered(s, e, busy) for s, e in comm)
    step = max(ends, default=0.0)
    either = sum(e - s for s, e in union(busy + comm))
    return Result(step, sum(e - s for s, e in busy), communication,
                  overlapped / communication if communication > 0 else 0.0,
                  communication - overlapped, COMM_STREAM,
                  tuple(tuple(rank) for rank in records), idle=max(step - either, 0.0))
