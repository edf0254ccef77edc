"""How calibration.profile times what it measures: the clock (CUDA events or time.perf_counter),
the ranks' agreement on a time (the slowest rank's), and how often a kernel or a collective is run
to time it."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

_RUN_SECONDS, _MAX_CALLS = 2e-3, 1000  # a kernel's timed run repeats it to last 2 ms
_SPAN_SECONDS, _MAX_RUNS = 0.1, 500  # a collective's runs span this long, if it is cheap



class Clock:
    """Times calls on this rank's device: CUDA events on a GPU, time.perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def per_call(self, fn: Callable, calls: int = 1) -> float:
        """Seconds per call of `calls` back-to-back calls of fn."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls


class Ranks:
    """This rank's place in the world, and collective helpers that make every rank agree."""

    def __init__(self, env: dict[str, str], backend: str, device: torch.device):
        self.rank, self.world = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local = int(env["LOCAL_WORLD_SIZE"])  # ranks per node (torchrun's nproc-per-node)
        self.nnodes = max(1, self.world // self.local)
        self.backend, self.device = backend, device

    def node(self, rank: int) -> int:
        return rank // self.local

    def barrier(self, group=None) -> None:
        if self.backend == "nccl":
            dist.barrier(group=group, device_ids=[self.device.index])
        else:
            dist.barrier(group=group)

    def max(self, values: list[float], group=None) -> list[float]:
        """Element-wise maximum over the ranks of `group`."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()


def calls_per_run(seconds: float) -> int:
    """Back-to-back kernel calls per timed run, so that a run lasts a few milliseconds."""
    return max(1, min(_MAX_CALLS, math.ceil(_RUN_SECONDS / max(seconds, 1e-9))))


def spread_runs(seconds: float) -> int:
    """Runs of a call taking `seconds` that span at least _SPAN_SECONDS (at most _MAX_RUNS): a
    cheap collective's runs spread so that one spell of scheduler delays is not all of them."""
    return min(_MAX_RUNS, math.ceil(_SPAN_SECONDS / seconds))


def runs_per_point(seconds: float, repeats: int) -> int:
    """Timed runs of a point: --repeats, three times as many for runs under 10 ms (cheap, and
    noisier: a scheduler tick is 1-4 ms)."""
    return 3 * repeats if seconds < 0.01 else repeats


def time_kernel(fn: Callable, clock: Clock, repeats: int) -> float:
    """Median seconds of one call, after a warm-up (allocator, lazy initialisation)."""
    clock.per_call(fn)
    once = clock.per_call(fn)
    calls = calls_per_run(once)
    runs = runs_per_point(once * calls, repeats)
    return statistics.median(clock.per_call(fn, calls) for _ in range(runs))


def time_collective(fn: Callable, clock: Clock, repeats: int, ranks: Ranks, group) -> float:
    """Mean seconds of one collective over `group`. After a barrier, the runs are single calls
    back to back (each collective lines the ranks up for the next, with no barrier's skew), and
    a run counts for its slowest rank, so that every rank of the group agrees on the time.
    Single calls, and cheap ones spread over at least 0.1 s: on a shared CPU, spells of
    scheduler delays (a tick is 1-4 ms) would otherwise make whole points slow. The mean, not
    the median, as calibration.ops takes its kernels' (a step is a sum of collectives, and a
    sum's expectation is the sum of means): on this VM at 10 Gbit/s a calibration taking means
    had all-reduces of 4 KB-1 MB at 1.4-3x the medians of one made the same hour (a 256 KB one
    1.50 against 1.05 ms), their slow runs (scheduler ticks, TCP) paid in every real step."""
    fn()
    once = ranks.max([clock.per_call(fn)], group)[0]  # the same number of runs on every rank
    runs = max(runs_per_point(once, repeats), spread_runs(once))
    ranks.barrier(group)
    times = [clock.per_call(fn) for _ in range(runs)]
    return statistics.fmean(ranks.max(times, group))
