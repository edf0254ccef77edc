"""What calibration.profile measures on every rank (timed as calibration.timing times it): the
kernels (mm, bmm, element-wise add / mul / relu, tiny ops) and the four collectives as
hidup.runtime.execute issues them over sizes and group sizes, pairs of collectives in flight at
once where the backend runs several (gloo's threads), then computation and communication alone and at once (interference).
`measure` runs all of it; calibration.profile fits and writes the profile."""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from calibration.timing import Clock, Ranks, spread_runs, time_collective, time_kernel
from hidup.cli.progress import StatusLine
from hidup.program import COLLECTIVES

log = logging.getLogger("calibration.profile")  # the command's logger: its --verbose shows these
PAIR_SIZES = (2 ** 20, 8 * 2 ** 20)  # bytes of the pairs in flight (at most --max-bytes)


# -- what is measured --------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """A kernel to time: its FLOPs and bytes (inputs read + output written, as hidup.program
    counts them), and `make`, which builds the inputs and returns the call to time."""

    label: str
    flops: float
    bytes: float
    make: Callable[[], Callable]


def _mm(n: int, batch: int, device) -> Callable:
    a = torch.randn((batch, n, n) if batch else (n, n), device=device)
    b = torch.randn_like(a)
    return (lambda: torch.bmm(a, b)) if batch else (lambda: torch.mm(a, b))


def _pointwise(op: str, numel: int, device) -> Callable:
    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
    return {"add": lambda: torch.add(x, y), "mul": lambda: torch.mul(x, y),
            "relu": lambda: torch.relu(x)}[op]


def kernels(quick: bool, device: torch.device) -> list[Kernel]:
    """Matmuls (compute-bound when large), element-wise ops (memory-bound) and one-element ops
    (the per-kernel overhead), timed as the executor calls them: a fresh output each call."""
    gpu = device.type == "cuda"
    largest = (2048 if quick else 8192) if gpu else (256 if quick else 2048)
    out = []
    for n in (2 ** e for e in range(5, int(math.log2(largest)) + 1)):
        out.append(Kernel(f"mm {n}x{n}", 2.0 * n ** 3, 4.0 * 3 * n * n,
                          lambda n=n: _mm(n, 0, device)))
        if n <= largest // 4:  # bmm of 16 matrices: 16 times the work of one
            out.append(Kernel(f"bmm 16x{n}x{n}", 32.0 * n ** 3, 4.0 * 48 * n * n,
                              lambda n=n: _mm(n, 16, device)))
    for e in range(3, (7 if quick else 9)):
        for op, per_element in (("add", 12), ("mul", 12), ("relu", 8)):
            out.append(Kernel(f"{op} 1e{e} elements", 10.0 ** e, per_element * 10.0 ** e,
                              lambda op=op, e=e: _pointwise(op, 10 ** e, device)))
    for op, per_element in (("add", 12), ("relu", 8)):
        out.append(Kernel(f"{op} 1 element", 1.0, per_element,
                          lambda op=op: _pointwise(op, 1, device)))
    out.append(Kernel("mm 1x1", 2.0, 12.0, lambda: _mm(1, 0, device)))
    return out


def collective_call(kind: str, nbytes: int, n: int, group, device,
                    async_op: bool = False) -> tuple[Callable, int]:
    """The call of hidup.runtime.execute for a whole tensor of about nbytes over a group of n
    ranks (float32, numel a multiple of n), and the exact nbytes: the gathered / reduced tensor,
    or the local tensor of an all-to-all, as hidup.program's Convert.bytes counts it. With
    `async_op` the call returns the collective's handle, to wait on."""
    numel = max(n, nbytes // 4 // n * n)
    whole = torch.zeros(numel, device=device)  # zeros: sums stay finite and normal
    opts = {"group": group, "async_op": async_op}
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(whole, **opts)), 4 * numel
    if kind == "all_gather":
        part = torch.zeros(numel // n, device=device)
        return (lambda: dist.all_gather_into_tensor(whole, part, **opts)), 4 * numel
    if kind == "reduce_scatter":
        part = torch.zeros(numel // n, device=device)
        return (lambda: dist.reduce_scatter_tensor(part, whole, **opts)), 4 * numel
    recv = torch.empty_like(whole)
    return (lambda: dist.all_to_all_single(recv, whole, **opts)), 4 * numel


def lanes(backend: str) -> int:
    """How many collectives a rank runs at once: gloo's worker threads (ProcessGroupGloo's
    options; 2 by default), one for NCCL (a group's collectives run in order on its stream)."""
    if backend != "gloo":
        return 1
    return int(dist.group.WORLD._get_backend(torch.device("cpu")).options._threads)


def time_pair(kind: str, nbytes: int, members: tuple[int, ...], group, ranks: Ranks,
              clock: Clock, repeats: int) -> float:
    """How much longer two collectives of `kind` take in flight at once than one after the other
    (a ratio: 0.5, the link fits both at full speed; 1, they share it; gloo's threads run them
    at once, as under Duplex): the ratio of the medians over `repeats` (at least 5) alternating
    runs of each, every run the slowest rank's; cheap pairs over at least 0.1 s of runs, as
    time_collective spreads its runs (five runs of a 1 MB pair on loopback once gave 0.21)."""
    a, _ = collective_call(kind, nbytes, len(members), group, ranks.device, async_op=True)
    b, _ = collective_call(kind, nbytes, len(members), group, ranks.device, async_op=True)

    def after() -> None:
        a().wait()
        b().wait()

    def together() -> None:
        first, second = a(), b()
        first.wait()
        second.wait()

    after(), together()  # warm-up
    once = ranks.max([clock.per_call(after)], group)[0]  # the same number of runs on every rank
    apart, both = [], []
    for _ in range(max(5, repeats, spread_runs(once))):
        for fn, times in ((after, apart), (together, both)):
            ranks.barrier(group)
            times.append(clock.per_call(fn))
    apart, both = ranks.max(apart, group), ranks.max(both, group)
    return statistics.median(both) / statistics.median(apart)


def group_sizes(world: int, local: int) -> list[int]:
    """The whole world and, when it is larger than 2, groups of 2, 4, ... and of one node."""
    sizes = {world} | {2 ** e for e in range(1, int(math.log2(world)) + 1) if 2 ** e < world}
    if 1 < local < world:
        sizes.add(local)
    return sorted(sizes)


def make_groups(ranks: Ranks) -> list[tuple[tuple[int, ...], str, object]]:
    """This rank's group of each size: (members, tier, process group). Ranks are split into
    consecutive blocks; every rank creates every block's group, as dist.new_group requires. On
    several nodes of several ranks, also a 2-D mesh's first column (one rank on each node, tier
    'column'), measured alone: the other columns, which would share the nodes' links with it,
    stay idle (the cost model shares a link among the columns that cross it at once)."""
    mine = []
    for size in group_sizes(ranks.world, ranks.local):
        for first in range(0, ranks.world - size + 1, size):
            members = tuple(range(first, first + size))
            handle = dist.new_group(list(members)) if size < ranks.world else dist.group.WORLD
            if ranks.rank in members:
                tier = "intra" if len({ranks.node(r) for r in members}) == 1 else "inter"
                mine.append((members, tier, handle))
    if ranks.nnodes > 1 and ranks.local > 1:
        column = tuple(range(0, ranks.world, ranks.local))
        handle = dist.new_group(list(column))
        if ranks.rank in column:
            mine.append((column, "column", handle))
    return mine


def byte_sizes(max_bytes: int) -> list[int]:
    sizes = [2 ** 10 * 4 ** e for e in range(20) if 2 ** 10 * 4 ** e <= max_bytes]
    return sizes if sizes[-1] == max_bytes else sizes + [max_bytes]


class Progress:
    """One line on stderr, rewritten in place (hidup.cli.progress.StatusLine): the elapsed time, a
    bar, item i/N and what runs now."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.i = total, 0
        self.line = StatusLine() if enabled else None

    def step(self, what: str) -> None:
        self.i += 1
        if self.line is None:
            return
        done = round(30 * (self.i - 1) / self.total)
        self.line.write(f"[{'#' * done}{'.' * (30 - done)}] {self.i}/{self.total}  {what}",
                        force=True)

    def close(self) -> None:
        if self.line is not None:
            self.line.end(f"measured {self.total} items in "
                          f"{time.perf_counter() - self.line.start:.1f} s")


# -- measuring ---------------------------------------------------------------------------------

def interference(ranks: Ranks, clock: Clock, quick: bool, trials: int,
                 progress: Progress) -> tuple[float, float, float]:
    """How much matmuls and world all-reduces slow down when they run at once: each alone, then
    both (the all-reduces from a thread, as a communication stream issues them while the compute
    stream runs), for large all-reduces (their transfer) and small ones (their latency: waking
    the transport's threads and round trips, which busy cores delay more). Median of a few
    trials, slowest rank, at least 1.0: (computation, comm, latency)."""
    gpu = clock.cuda
    n = (2048 if quick else 4096) if gpu else (256 if quick else 512)
    nbytes = ((64 if quick else 256) if gpu else (1 if quick else 16)) * 2 ** 20
    small = 16 * 2 ** 10  # bytes: latency-bound on every link measured here
    window = 0.15 if quick else 0.5  # seconds of each loop
    matmul = _mm(n, 0, ranks.device)
    side = torch.cuda.Stream(ranks.device) if gpu else None

    def reduces(reduce, calls: int) -> float:  # seconds per all-reduce, `calls` back to back
        with torch.cuda.stream(side) if gpu else contextlib.nullcontext():
            t0 = time.perf_counter()
            for _ in range(calls):
                reduce()
            if gpu:
                side.synchronize()
            return (time.perf_counter() - t0) / calls

    def matmuls(stop: Callable[[], bool]) -> float:  # mean seconds per matmul until stop()
        times = []
        while not times or not stop():
            t0 = time.perf_counter()
            matmul()
            clock.sync()
            times.append(time.perf_counter() - t0)
        return statistics.fmean(times[:-1] or times)  # the last one may outlast the window

    reducers = {}  # bytes -> (the all-reduce call, how many make a window)
    for size in (nbytes, small):
        reduce, _ = collective_call("all_reduce", size, ranks.world, dist.group.WORLD,
                                    ranks.device)
        matmul(), reduce(), clock.sync()  # warm-up
        reducers[size] = reduce, max(3, math.ceil(window / ranks.max([reduces(reduce, 1)])[0]))

    def at_once(size: int) -> tuple[float, float]:  # seconds per (matmul, all-reduce)
        reduce, calls = reducers[size]
        progress.step(f"interference: {_size(size)} all-reduces alone")
        ranks.barrier()
        comm_alone = reduces(reduce, calls)
        progress.step(f"interference: matmuls and {_size(size)} all-reduces at once")
        ranks.barrier()
        both: dict[str, float] = {}
        thread = threading.Thread(target=lambda: both.update(comm=reduces(reduce, calls)))
        thread.start()
        compute_both = matmuls(lambda: not thread.is_alive())
        thread.join()
        return compute_both, both["comm"] / comm_alone

    factors = []
    for _ in range(trials):
        progress.step(f"interference: {n}x{n} matmuls alone")
        ranks.barrier()
        end = time.perf_counter() + window
        compute_alone = matmuls(lambda: time.perf_counter() > end)
        compute_both, comm = at_once(nbytes)
        # beside the small ones the matmuls only load the cores: the kernels' factor is the
        # large all-reduces'
        latency = at_once(small)[1]
        factors.append((compute_both / compute_alone, comm, latency))
    found = ranks.max([statistics.median(f[i] for f in factors) for i in range(3)])
    return tuple(max(1.0, f) for f in found)  # measuring noise must not make things faster


def measure(args, ranks: Ranks, clock: Clock) -> tuple[list, list, list, tuple[float, ...]]:
    """Every rank: kernel points (flops, bytes, seconds of the slowest rank), collective points
    (tier, kind, n, nbytes, seconds) of every group (complete on rank 0), pair points (tier,
    kind, n, nbytes, ratio; none where the backend runs one collective at a time), interference
    factors."""
    todo = kernels(args.quick, ranks.device)
    groups = make_groups(ranks) if ranks.world > 1 else []  # one rank: kernels only
    sizes = byte_sizes(args.max_bytes)
    pair_sizes = sorted({min(s, args.max_bytes) for s in PAIR_SIZES}) \
        if groups and lanes(ranks.backend) > 1 else []
    trials = 2 if args.quick else 5  # interference trials
    progress = Progress(len(todo) + len(groups) * len(COLLECTIVES) * (len(sizes) + len(pair_sizes))
                        + 5 * trials * bool(groups),
                        enabled=ranks.rank == 0)
    seconds = []
    for k in todo:
        progress.step(k.label)
        seconds.append(time_kernel(k.make(), clock, args.repeats))
        log.debug("%s: %.3g s", k.label, seconds[-1])
    seconds = ranks.max(seconds)  # the slowest rank's figure
    kernel_points = [(k.flops, k.bytes, t) for k, t in zip(todo, seconds)]
    mine = _collectives(groups, COLLECTIVES, sizes, args.repeats, ranks, clock, progress)
    pairs = []
    for members, tier, group in groups:
        for kind in COLLECTIVES:
            for nbytes in pair_sizes:
                progress.step(f"two {kind} in flight over {len(members)} ranks ({tier}-node), "
                              f"{_size(nbytes)}")
                ratio = time_pair(kind, nbytes, members, group, ranks, clock, args.repeats)
                log.debug("two %s n=%d %d bytes in flight: x%.3f", kind, len(members), nbytes,
                          ratio)
                if ranks.rank == members[0]:
                    pairs.append((tier, kind, len(members), nbytes, ratio))
    factors = interference(ranks, clock, args.quick, trials, progress) if groups else None
    progress.close()
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, (mine, pairs))
    return (kernel_points, [p for part, _ in everyone for p in part],
            [p for _, part in everyone for p in part], factors)


def _collectives(groups, kinds, sizes, repeats: int, ranks: Ranks, clock: Clock,
                 progress: Progress) -> list[tuple]:
    """This rank's points (tier, kind, n, nbytes, seconds) of `kinds` at `sizes` over its
    groups: one report per group, from its first member."""
    mine = []
    for members, tier, group in groups:
        for kind in kinds:
            for nbytes in sizes:
                progress.step(f"{kind} over {len(members)} ranks ({tier}-node), {_size(nbytes)}")
                call, exact = collective_call(kind, nbytes, len(members), group, ranks.device)
                t = time_collective(call, clock, repeats, ranks, group)
                log.debug("%s n=%d %d bytes: %.3g s", kind, len(members), exact, t)
                if ranks.rank == members[0]:
                    mine.append((tier, kind, len(members), exact, t))
                del call
    return mine


def measure_again(kinds: list[str], max_bytes: int, repeats: int, ranks: Ranks,
                  clock: Clock) -> list[tuple]:
    """Every rank: the collective points of `kinds` once more, up to `max_bytes` with `repeats`
    timed runs a point (complete on rank 0)."""
    groups = make_groups(ranks)
    sizes = byte_sizes(max_bytes)
    progress = Progress(len(groups) * len(kinds) * len(sizes), enabled=ranks.rank == 0)
    mine = _collectives(groups, kinds, sizes, repeats, ranks, clock, progress)
    progress.close()
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, mine)
    return [p for part in everyone for p in part]


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"
