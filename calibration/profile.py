"""Measure a cluster and write its HiDup Profile. Every rank, started by torchrun, times kernels
(mm, bmm, element-wise add / mul / relu, tiny ops) and the four collectives as hidup.execute
issues them, over sizes and group sizes, then computation and communication alone and at once;
rank 0 fits the figures (calibration.fit) and writes the profile JSON:

    torchrun --nproc-per-node 2 -m calibration.profile --out PROFILE.json

On one rank (one GPU, say) there is nothing to communicate with: `--base PROFILE` keeps that
profile's collectives and interference and the run measures the device's kernels only:

    torchrun --nproc-per-node 1 -m calibration.profile --base v100-1x4-nvlink --out GPU.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from calibration.fit import FitError, fit_links, fit_roofline
from hidup.cli import Parser
from hidup.cluster import default_threads
from hidup.profile import Profile, ProfileError, load_profile
from hidup.program import COLLECTIVES

log = logging.getLogger(__name__)
PROG = "calibration.profile"
LAUNCH = "torchrun --nproc-per-node 2 -m calibration.profile --out PROFILE"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
_UNITS = {"": 1, "B": 1, "KB": 2 ** 10, "KIB": 2 ** 10, "MB": 2 ** 20, "MIB": 2 ** 20,
          "GB": 2 ** 30, "GIB": 2 ** 30}
_RUN_SECONDS, _MAX_CALLS = 2e-3, 1000  # a kernel's timed run repeats it to last 2 ms
_SPAN_SECONDS, _MAX_RUNS = 0.1, 500  # a collective's runs span this long, if it is cheap


class UsageError(Exception):
    """A bad flag, output path or launch: one line, exit code 2."""


# -- command line ------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes from '256MB', '4MiB', '1024' (binary units: 1KB = 1024 bytes)."""
    match = re.fullmatch(r"\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write it like 256MB, 4MiB "
                                         f"or 1024 (bytes)")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1KB (the smallest "
                                         f"tensor measured); give e.g. 4MB")
    return int(value)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= 1, e.g. 5")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="the profile file to write (.json); its folder must exist")
    ap.add_argument("--name", help="the profile's name (default: the --out file's stem)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="torch.distributed backend: nccl if CUDA is available, else gloo "
                         "(default: auto)")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes and few repeats (CI, under a minute); a rough profile")
    ap.add_argument("--repeats", type=_positive_int,
                    help="timed runs per point, of which the median counts (default 5, 3 with "
                         "--quick; three times as many for points under 10 ms)")
    ap.add_argument("--max-bytes", type=parse_size,
                    help="largest collective tensor, e.g. 256MB (binary units; default 256MB, "
                         "4MB with --quick); sizes go from 1KB up by x4")
    ap.add_argument("--base", metavar="NAME|PATH",
                    help="one rank (e.g. one GPU): measure the device's kernels only and take the "
                         "collectives and interference from this profile (shipped name or file)")
    ap.add_argument("--json", action="store_true",
                    help="print a machine-readable summary on stdout (the report goes to stderr)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every measured point")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.max_bytes = args.max_bytes or (4 if args.quick else 256) * 2 ** 20
    args.name = args.name or args.out.stem
    return args


def torchrun_env() -> dict[str, str]:
    """The variables torchrun sets; a UsageError naming the missing ones when not under it."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise UsageError(f"not started by torchrun ({', '.join(missing)} not set); run: {LAUNCH}")
    return {k: os.environ[k] for k in TORCHRUN_ENV}


def check_out(out: Path) -> str | None:
    """Why the profile cannot be written to `out`, or None (checked before measuring)."""
    folder = out.parent
    if out.suffix != ".json":
        return f"--out {out}: a profile file's name must end in .json; give e.g. {out.stem}.json"
    if out.is_dir():
        return f"--out {out}: is a folder; give a file path such as {out / 'profile.json'}"
    if not folder.is_dir():
        return f"--out {out}: the folder {folder} does not exist; create it or choose another"
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        return f"--out {out}: cannot write in {folder} (permission denied); choose a writable path"
    return None


# -- timing ------------------------------------------------------------------------------------

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
    """Median seconds of one collective over `group`. After a barrier, the runs are single calls
    back to back (each collective lines the ranks up for the next, with no barrier's skew), and
    a run counts for its slowest rank, so that every rank of the group agrees on the time.
    Single calls, and cheap ones spread over at least 0.1 s: on a shared CPU, spells of
    scheduler delays (a tick is 1-4 ms) would otherwise make whole points slow."""
    fn()
    once = ranks.max([clock.per_call(fn)], group)[0]  # the same number of runs on every rank
    runs = max(runs_per_point(once, repeats), min(_MAX_RUNS, math.ceil(_SPAN_SECONDS / once)))
    ranks.barrier(group)
    times = [clock.per_call(fn) for _ in range(runs)]
    return statistics.median(ranks.max(times, group))


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


def collective_call(kind: str, nbytes: int, n: int, group, device) -> tuple[Callable, int]:
    """The call of hidup.execute for a whole tensor of about nbytes over a group of n ranks
    (float32, numel a multiple of n), and the exact nbytes: the gathered / reduced tensor, or the
    local tensor of an all-to-all, as hidup.program's Convert.bytes counts it."""
    numel = max(n, nbytes // 4 // n * n)
    whole = torch.zeros(numel, device=device)  # zeros: sums stay finite and normal
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(whole, group=group)), 4 * numel
    if kind == "all_gather":
        part = torch.zeros(numel // n, device=device)
        return (lambda: dist.all_gather_into_tensor(whole, part, group=group)), 4 * numel
    if kind == "reduce_scatter":
        part = torch.zeros(numel // n, device=device)
        return (lambda: dist.reduce_scatter_tensor(part, whole, group=group)), 4 * numel
    recv = torch.empty_like(whole)
    return (lambda: dist.all_to_all_single(recv, whole, group=group)), 4 * numel


def group_sizes(world: int, local: int) -> list[int]:
    """The whole world and, when it is larger than 2, groups of 2, 4, ... and of one node."""
    sizes = {world} | {2 ** e for e in range(1, int(math.log2(world)) + 1) if 2 ** e < world}
    if 1 < local < world:
        sizes.add(local)
    return sorted(sizes)


def make_groups(ranks: Ranks) -> list[tuple[tuple[int, ...], str, object]]:
    """This rank's group of each size: (members, tier, process group). Ranks are split into
    consecutive blocks; every rank creates every block's group, as dist.new_group requires."""
    mine = []
    for size in group_sizes(ranks.world, ranks.local):
        for first in range(0, ranks.world - size + 1, size):
            members = tuple(range(first, first + size))
            handle = dist.new_group(list(members)) if size < ranks.world else dist.group.WORLD
            if ranks.rank in members:
                tier = "intra" if len({ranks.node(r) for r in members}) == 1 else "inter"
                mine.append((members, tier, handle))
    return mine


def byte_sizes(max_bytes: int) -> list[int]:
    sizes = [2 ** 10 * 4 ** e for e in range(20) if 2 ** 10 * 4 ** e <= max_bytes]
    return sizes if sizes[-1] == max_bytes else sizes + [max_bytes]


class Progress:
    """One line on stderr, rewritten in place with \\r: item i/N, elapsed time, what runs now."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.i, self.start, self.width = total, enabled, 0, time.time(), 0

    def step(self, what: str) -> None:
        self.i += 1
        if not self.enabled:
            return
        done = round(30 * (self.i - 1) / self.total)
        line = (f"[{'#' * done}{'.' * (30 - done)}] {self.i}/{self.total} "
                f"{time.time() - self.start:5.1f} s  {what}")
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\rmeasured {self.total} items in {time.time() - self.start:.1f} s"
                             .ljust(self.width + 1) + "\n")


# -- measuring ---------------------------------------------------------------------------------

def interference(ranks: Ranks, clock: Clock, quick: bool, trials: int,
                 progress: Progress) -> tuple[float, float]:
    """How much matmuls and world all-reduces slow down when they run at once: each alone, then
    both (the all-reduces from a thread, as a communication stream issues them while the compute
    stream runs). Median of a few trials, slowest rank, at least 1.0: (computation, comm)."""
    gpu = clock.cuda
    n = (2048 if quick else 4096) if gpu else (256 if quick else 512)
    nbytes = ((64 if quick else 256) if gpu else (1 if quick else 16)) * 2 ** 20
    window = 0.15 if quick else 0.5  # seconds of each loop
    matmul = _mm(n, 0, ranks.device)
    reduce, _ = collective_call("all_reduce", nbytes, ranks.world, dist.group.WORLD, ranks.device)
    side = torch.cuda.Stream(ranks.device) if gpu else None

    def reduces(calls: int) -> float:  # seconds per all-reduce, `calls` back to back
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

    matmul(), reduce(), clock.sync()  # warm-up
    calls = max(3, math.ceil(window / ranks.max([reduces(1)])[0]))
    factors = []
    for _ in range(trials):
        progress.step(f"interference: {n}x{n} matmuls alone")
        ranks.barrier()
        end = time.perf_counter() + window
        compute_alone = matmuls(lambda: time.perf_counter() > end)
        progress.step(f"interference: {_size(nbytes)} all-reduces alone")
        ranks.barrier()
        comm_alone = reduces(calls)
        progress.step("interference: matmuls and all-reduces at once")
        ranks.barrier()
        both: dict[str, float] = {}
        thread = threading.Thread(target=lambda: both.update(comm=reduces(calls)))
        thread.start()
        compute_both = matmuls(lambda: not thread.is_alive())
        thread.join()
        factors.append((compute_both / compute_alone, both["comm"] / comm_alone))
    compute, comm = ranks.max([statistics.median(f[0] for f in factors),
                               statistics.median(f[1] for f in factors)])
    return max(1.0, compute), max(1.0, comm)  # measuring noise must not make things faster


def measure(args, ranks: Ranks, clock: Clock) -> tuple[list, list, tuple[float, float]]:
    """Every rank: kernel points (flops, bytes, seconds of the slowest rank), collective points
    (tier, kind, n, nbytes, seconds) of every group (complete on rank 0), interference factors."""
    todo = kernels(args.quick, ranks.device)
    groups = make_groups(ranks) if ranks.world > 1 else []  # one rank: kernels only
    sizes = byte_sizes(args.max_bytes)
    trials = 2 if args.quick else 5  # interference trials
    progress = Progress(len(todo) + len(groups) * len(COLLECTIVES) * len(sizes)
                        + 3 * trials * bool(groups),
                        enabled=ranks.rank == 0)
    seconds = []
    for k in todo:
        progress.step(k.label)
        seconds.append(time_kernel(k.make(), clock, args.repeats))
        log.debug("%s: %.3g s", k.label, seconds[-1])
    seconds = ranks.max(seconds)  # the slowest rank's figure
    kernel_points = [(k.flops, k.bytes, t) for k, t in zip(todo, seconds)]
    mine = []
    for members, tier, group in groups:
        for kind in COLLECTIVES:
            for nbytes in sizes:
                progress.step(f"{kind} over {len(members)} ranks ({tier}-node), {_size(nbytes)}")
                call, exact = collective_call(kind, nbytes, len(members), group, ranks.device)
                t = time_collective(call, clock, args.repeats, ranks, group)
                log.debug("%s n=%d %d bytes: %.3g s", kind, len(members), exact, t)
                if ranks.rank == members[0]:  # one report per group
                    mine.append((tier, kind, len(members), exact, t))
                del call
    factors = interference(ranks, clock, args.quick, trials, progress) if groups else None
    progress.close()
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, mine)
    return kernel_points, [p for part in everyone for p in part], factors


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


# -- provenance, fit, output -------------------------------------------------------------------

def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(s.split(":", 1)[1].strip() for s in lines if s.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return (f"CPU {model} ({os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch "
            f"threads per rank)")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("numpy", "scipy", "simpy", "hidup"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def device_memory(ranks: Ranks) -> float:
    """Bytes of memory one rank may use: its GPU's, or on a CPU its share of the host's RAM."""
    if ranks.device.type == "cuda":
        return float(torch.cuda.get_device_properties(ranks.device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks.local)


def provenance(ranks: Ranks, command: str) -> dict:
    """Where and how the profile was measured (every rank takes part: hosts and devices)."""
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, (socket.gethostname(), describe_device(ranks.device)))
    devices: dict[str, int] = {}
    for _, name in everyone:
        devices[name] = devices.get(name, 0) + 1
    return {"host": everyone[0][0], "hosts": list(dict.fromkeys(h for h, _ in everyone)),
            "devices": [f"{count} x {name}" for name, count in devices.items()],
            "world": ranks.world, "nnodes": ranks.nnodes, "ranks_per_node": ranks.local,
            "device_memory": device_memory(ranks),
            "backend": ranks.backend,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command, "versions": versions()}


def fit_profile(args, ranks: Ranks, kernel_points, link_points, factors, prov,
                base: Profile | None = None):
    """The Profile, the report's lines and the machine-readable summary. Measured on one rank,
    the collectives and interference are `base`'s."""
    flops, mem, overhead, roof = fit_roofline(kernel_points)
    if not link_points:
        return _kernels_on_base(args, ranks, base, prov, (flops, mem, overhead, roof))
    links, fits = {}, {}
    for tier in ("intra", "inter"):
        points = [p[1:] for p in link_points if p[0] == tier]
        if points:
            links[tier], fits[tier] = fit_links(points)
    note = "" if "intra" in links else (" No group inside one node: the intra-node tier repeats "
                                        "the inter-node figures.")
    source = (f"Measured by calibration.profile on {prov['host']} ({ranks.world} ranks, "
              f"{ranks.nnodes} node(s) x {ranks.local}, backend {ranks.backend}, "
              f"{prov['date']}) with `{prov['command']}`, fitted with calibration.fit: a roofline "
              f"of {roof.points} kernels (rms error {roof.rms:.1%}), alpha and bus bandwidth per "
              f"collective kind and tier, interference from matmuls and all-reduces alone and at "
              f"once.{note}")
    intra = links["intra"] if "intra" in links else links["inter"]
    inter = links["inter"] if ranks.nnodes > 1 else None
    profile = Profile(args.name, source, flops, mem, overhead, intra, ranks.local, inter,
                      factors[0], factors[1], prov,
                      collective_points=[[t, kind, n, b, sec] for t, kind, n, b, sec in link_points],
                      device_memory=prov.get("device_memory"))
    lines = [_roofline_line(flops, mem, overhead, roof)]
    summary = {"name": args.name, "out": str(args.out), "flops": flops, "mem_bandwidth": mem,
               "op_overhead": overhead, "roofline_fit": _fit_dict(roof), "collectives": {},
               "interference": {"compute": factors[0], "communication": factors[1]}}
    for tier, costs in links.items():
        sizes = sorted({p[2] for p in link_points if p[0] == tier})
        lines.append(f"{tier}-node collectives (groups of {', '.join(map(str, sizes))} ranks):")
        summary["collectives"][tier] = {}
        for kind, cost in costs.items():
            r = fits[tier][kind]
            lines.append(f"  {kind:<15} {cost.alpha * 1e6:8.3g} us/step, {cost.beta / 1e9:7.4g} "
                         f"GB/s bus; {r.points} points, rms error {r.rms:.1%}, max {r.max:.1%}")
            summary["collectives"][tier][kind] = {"alpha": cost.alpha, "bus_bandwidth": cost.beta,
                                                  **_fit_dict(r)}
    lines.append(f"interference: computation x{factors[0]:.3f}, communication "
                 f"x{factors[1]:.3f} (1.0: none)")
    return profile, lines, summary


def _kernels_on_base(args, ranks: Ranks, base: Profile, prov, fit):
    """One rank's profile: its device's roofline, `base`'s collectives and interference."""
    flops, mem, overhead, roof = fit
    source = (f"Kernels measured by calibration.profile on one rank of {prov['host']} "
              f"({prov['devices'][0]}, {prov['date']}) with `{prov['command']}`, fitted with "
              f"calibration.fit: a roofline of {roof.points} kernels (rms error {roof.rms:.1%}). "
              f"Collectives and interference from profile {base.name} ({base.source})")
    profile = replace(base, name=args.name, source=source, flops=flops, mem_bandwidth=mem,
                      op_overhead=overhead, provenance=prov, kernels=None, kernel_quantiles=None,
                      device_memory=prov.get("device_memory", base.device_memory))
    lines = [_roofline_line(*fit), f"collectives and interference: profile {base.name}"]
    summary = {"name": args.name, "out": str(args.out), "flops": flops, "mem_bandwidth": mem,
               "op_overhead": overhead, "roofline_fit": _fit_dict(roof), "base": base.name}
    return profile, lines, summary


def _roofline_line(flops, mem, overhead, roof) -> str:
    return (f"roofline of {roof.points} kernels: {flops / 1e9:.4g} GFLOP/s, {mem / 1e9:.4g} GB/s "
            f"memory, {overhead * 1e6:.3g} us per kernel; rms error {roof.rms:.1%}, "
            f"max {roof.max:.1%}")


def _fit_dict(r) -> dict:
    return {"points": r.points, "rms_error": r.rms, "max_error": r.max}


def write_profile(profile: Profile, out: Path) -> None:
    """Write through a temporary file in the same folder, check it loads, then rename it."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(profile.to_json())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # a normal file's mode, not mkstemp's 0600
        load_profile(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None) -> int:
    """`torchrun --nproc-per-node N -m calibration.profile --out PROFILE.json`."""
    args = parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose and rank0 else logging.WARNING)
    try:
        env = torchrun_env()
        if int(env["WORLD_SIZE"]) < 2 and not args.base:
            raise UsageError(f"WORLD_SIZE is 1: collectives need at least 2 ranks; run: {LAUNCH}; "
                             f"or, to measure one device's kernels, add --base PROFILE for the "
                             f"collectives")
        base = load_profile(args.base) if args.base else None
        backend = args.backend if args.backend != "auto" else (
            "nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs and none is available; use "
                             "--backend gloo (or auto)")
    except (UsageError, ProfileError) as exc:
        if rank0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    # torch 2.13 deprecates the two calls hidup.execute makes; they are what is measured here
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.\w+` is deprecated")
    device = torch.device("cpu")
    torch.set_num_threads(default_threads())  # as hidup.train runs
    if backend == "nccl":
        device = torch.device("cuda", int(env["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        return run(args, argv, Ranks(env, backend, device), base)
    finally:
        dist.destroy_process_group()


def run(args, argv, ranks: Ranks, base: Profile | None = None) -> int:
    """Check the output path, measure on every rank, then fit, write and report on rank 0."""
    problem = [check_out(args.out) if ranks.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)  # every rank stops if rank 0 cannot write
    if problem[0]:
        if ranks.rank == 0:
            print(f"{PROG}: error: {problem[0]}", file=sys.stderr)
        return 2
    start = time.time()
    kernel_points, link_points, factors = measure(args, ranks, Clock(ranks.device))
    nodes = f" --nnodes {ranks.nnodes}" if ranks.nnodes > 1 else ""
    command = (f"torchrun --nproc-per-node {ranks.local}{nodes} -m calibration.profile "
               f"{shlex.join(sys.argv[1:] if argv is None else argv)}")
    prov = provenance(ranks, command)
    if ranks.rank != 0:
        return 0
    try:
        profile, lines, summary = fit_profile(args, ranks, kernel_points, link_points, factors,
                                              prov, base)
        write_profile(profile, args.out)
    except (FitError, ProfileError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    summary["seconds"] = time.time() - start
    lines.append(f"wrote {args.out} (profile {args.name}) in {summary['seconds']:.0f} s")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
