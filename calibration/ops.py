"""Measure a model's kernels on this cluster and add them to a profile. Every rank, started by
torchrun, runs the training step as hidup.train runs it (hidup.Trainer: the compiled step of
hidup.runtime.step, then the torch.optim --optimizer and the schedule) for the given strategies
and micro-batch counts, with a clock read between the graph nodes of consecutive tasks: a
node's forward or backward, a local slice, and the packing and unpacking of a collective's
tensors (on a CPU the host does it: it is not hidden as on a GPU). What the step spends outside
the graph (the optimizer's step, the Trainer's bookkeeping) is the update task's time,
so that the kernels add up to the step that trains. By default (more than one
rank) the collectives run for real, as in training: each kernel's time then includes what the
transfers around it take from the cores (on a CPU, the network stack and gloo's threads share
them with the kernels), and the time a rank spends waiting for its peers or for a transfer is
left out (the wait is its collective's part, not a kernel's); the profile says so
(`kernels_in_situ`), and the simulator does not slow these kernels again by the interference
factor. `--collectives local` stands the collectives in by local copies (same shapes, no
communication), as on one rank. Rank 0 writes the base profile with the mean time of each
kernel (by hidup.planning.costs.kernel_key: a step is a sum of kernels, and a sum's expectation
is the sum of means; occasional slow runs count as in a real step) on the slowest rank (ranks
meet at every collective, so the slowest one sets the pace); the simulator then uses these
instead of the roofline wherever a Program has the same kernel. It also writes each kernel's
spread over every rank's runs (16 equally likely values): from it simulator.montecarlo draws
each rank's kernel times, so that a collective waits for its slowest member as it does in a real
step (the expected maximum at each rendezvous):

    torchrun --nproc-per-node 2 -m calibration.ops --model gpt:tiny --strategy ddp megatron \\
        --micro-batches 1 2 --base PROFILE.json --out PROFILE-gpt.json

All ranks measure at once, so ranks that share a machine's cores slow each other as in a real
run. The configurations (each strategy at each micro-batch count) are built first and then timed
in turns, one step of each per round, so that a drift of the machine's speed during the
calibration lands on all of them alike."""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from hidup.cli import Parser
from hidup.cli.collector import no_gc
from hidup.graph.capture import capture
from hidup.models import get_model, names
from hidup.planning.costs import ProfileError, kernel_key, timing_key
from hidup.planning.planfile import resolve_strategy
from hidup.planning.profile_file import load_profile
from hidup.program.tasks import Compute, Convert
from hidup.runtime.launch import default_threads
from hidup.runtime.passes import TaskClock

log = logging.getLogger(__name__)
PROG = "calibration.ops"


class KernelTimer:
    """One configuration (model, strategy, micro-batches) as hidup.train runs it (hidup.Trainer:
    the compiled step, then the torch.optim `optimizer` and the schedule), with a clock between
    the graph's tasks. Each `step()` trains one step; after `start()`, each step's kernels are
    kept. What a step spends outside the graph (the optimizer, the Trainer's own bookkeeping)
    is the update task's time. With `real`, the step's collectives run for real over the
    default process group (every rank must step the same configurations in the same order);
    their waits are not counted. The learning rate is 0: the parameters stay as they are."""

    def __init__(self, model: str, strategy: str, world: int, k: int, batch: int | None = None,
                 real: bool = False, optimizer: str = "adamw"):
        from hidup.api import Plan
        from hidup.runtime.trainer import Trainer
        from hidup.train import optimizer_factory

        self.spec = get_model(model, gpus=world)
        self.batch = batch or self.spec.batch
        torch.manual_seed(0)
        net = self.spec.build()
        graph = capture(net, self.spec.inputs(self.batch, torch.Generator().manual_seed(0)))
        plan = Plan.of(graph, resolve_strategy(strategy, graph, world), world, k, model=model,
                       optimizer=optimizer)
        self.trainer = Trainer(net, plan, optimizer_factory(optimizer, 0.0),
                               lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))
        self.real = real
        if not real:
            self.trainer.executor.stand_in_collectives()
        self.clock = self.trainer.executor.clock = TaskClock()
        self.steps = 0
        self.outside: list[float] = []  # per kept step: its wall time outside the graph
        self.walls: list[float] = []  # per kept step: its wall time

    def start(self) -> None:
        """Keep the steps from here on (the ones before were warm-up)."""
        self.clock.seconds.clear()
        self.outside.clear()
        self.walls.clear()

    def step(self) -> None:
        data = self.spec.inputs(self.batch, torch.Generator().manual_seed(1 + self.steps))
        self.steps += 1
        self.clock.first, start = None, time.perf_counter()
        self.trainer.step(*data)
        wall = time.perf_counter() - start
        self.outside.append(wall - (self.clock.last - self.clock.first))
        self.walls.append(wall)

    def times(self) -> dict[str, list[float]]:
        """Seconds of each kernel (by timing_key) over the kept steps (every occurrence:
        micro-batches, layers of the same shapes)."""
        program = self.trainer.program
        times = kernel_times(program, self.clock.seconds, len(self.outside), self.real)
        [update] = [t for t in program.tasks if isinstance(t, Compute) and t.phase == "update"]
        key = timing_key(update, program.tasks)  # a Program ends with its one update task
        times[key] = [a + b for a, b in zip(times[key], self.outside)]
        return times


def breakdown(timer: KernelTimer, times: dict[str, list[float]]) -> tuple[float, float]:
    """This rank's (median step, mean kernels per step) in seconds over the kept steps, `times`
    being timer.times(): the rest of a step is what the rank waited (for its peers, for
    transfers), which the simulator's collectives and rendezvous must account for."""
    steps = len(timer.walls)
    return statistics.median(timer.walls), sum(map(sum, times.values())) / steps


def measure_in_turns(timers: list[KernelTimer], steps: int, warmup: int) -> None:
    """`warmup` steps of each timer, then `steps` rounds of one step of each in turn: a drift
    of the machine's speed (this VM's drifts by up to 1.9x within a minute) lands on every
    configuration alike instead of on whichever was measured while it lasted. Python's garbage
    collector is paused meanwhile (hidup.cli.collector): its passes would land on the kernels."""
    with no_gc(collect=True):
        for timer in timers:
            for _ in range(warmup):
                timer.step()
            timer.start()
        for _ in range(steps):
            for timer in timers:
                timer.step()


def measure_kernels(model: str, strategy: str, world: int, k: int, steps: int = 5,
                    warmup: int = 2, batch: int | None = None, real: bool = False,
                    optimizer: str = "adamw") -> dict[str, list[float]]:
    """Seconds of each kernel of one configuration's training step (KernelTimer) over `steps`
    timed steps after `warmup`."""
    timer = KernelTimer(model, strategy, world, k, batch, real, optimizer)
    measure_in_turns([timer], steps, warmup)
    return timer.times()


def kernel_times(program, seconds: dict[tuple[int, bool], list[float]], steps: int,
                 real: bool = False) -> dict[str, list[float]]:
    """Per-task timings -> per-kernel timings: a task's compute, a collective's issuing ('issue
    KEY'), and its unpacking ('finish KEY', at its Wait). Issuing is the packing of its input
    and, with `real` (collectives on the network), the call that hands it to the network: on a
    CPU that call takes the host's time (gloo's threads start the transfer on the cores the
    step computes on), so a Duplex step cannot compute meanwhile. That call is also recorded
    alone ('call KEY'): calibration.profile timed it inside the collective's own time, which the
    simulator then shortens by it. A stand-in call (a local copy) is left out. A task that
    recorded no graph node costs nothing in the compiled step."""
    out: dict[str, list[float]] = {}
    for task in program.tasks:
        times = seconds.get((task.id, False), [0.0] * steps)
        if real and isinstance(task, Convert) and task.collective:
            calls = seconds.get((task.id, True), [0.0] * len(times))
            out.setdefault(f"call {kernel_key(task)}", []).extend(calls)
            times = [a + b for a, b in zip(times, calls)]
        out.setdefault(timing_key(task, program.tasks), []).extend(times)
    return out


STALL = 10.0  # a run over this many times its kernel's median ...
STALL_SECONDS = 1e-3  # ... and over it by more than this is a stall of the machine


def without_stalls(seconds: list[float]) -> tuple[list[float], list[float]]:
    """One kernel's runs, and apart the stalls among them: runs over STALL x the median and
    more than STALL_SECONDS over it (the machine stopped the process: a page-in, another
    process), which one step in a calibration may meet and the runs it predicts do not. Slower
    runs short of that stay (a slow run in fifty counts, as it does in a real step)."""
    if not seconds:
        return [], []
    median = statistics.median(seconds)
    limit = max(STALL * median, median + STALL_SECONDS)
    return [t for t in seconds if t <= limit], [t for t in seconds if t > limit]


def quantiles(seconds: list[float], points: int = 16) -> list[float]:
    """A kernel's timings reduced to `points` equally likely values (fewer if fewer runs): the
    mean of each `points`-th of the sorted runs, so that drawing one of them at random keeps the
    measured mean (up to bins one run apart in size: a slow run in fifty still counts, as it does
    in a real step; stalls are left out before, by without_stalls)."""
    ordered = sorted(seconds)
    m = min(points, len(ordered))
    cuts = [round(i * len(ordered) / m) for i in range(m + 1)]
    return [statistics.fmean(ordered[a:b]) for a, b in zip(cuts, cuts[1:])]


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"model NAME:SIZE, one of {names()}")
    ap.add_argument("--strategy", nargs="+", default=["ddp"],
                    help="strategies whose kernels to measure: ddp, fsdp, megatron, megatron-sp, "
                         "expert, a plan file")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2],
                    help="micro-batch counts to measure (default 1 2: plain SPMD and Duplex)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps per configuration (one step of each configuration per "
                         "round, in turns)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--collectives", choices=("real", "local"), default="real",
                    help="real (default): time the kernels in real steps, collectives on the "
                         "network, so each kernel's time includes what the transfers around it "
                         "take from the cores; local: stand the collectives in by local copies "
                         "(one rank, or kernels alone)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="the torch.optim optimizer whose step is timed, as hidup.train "
                         "--optimizer runs it (default adamw, as hidup.train)")
    ap.add_argument("--base", required=True,
                    help="the profile to add the kernels to (shipped name or file)")
    ap.add_argument("--out", type=Path, required=True, help="the profile file to write (.json)")
    args = ap.parse_args(argv)
    ap.at_least_one(args, "steps", "batch")
    if args.warmup < 0 or min(args.micro_batches) < 1:
        ap.error("--warmup must be >= 0 and every --micro-batches >= 1")
    if args.out.suffix != ".json" or not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: give a .json file in an existing folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"{PROG}: %(message)s")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        base = load_profile(args.base)
    except ProfileError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(default_threads())
    in_situ = world > 1 and args.collectives == "real"
    if world > 1:  # to run the collectives (or only to start and finish together)
        dist.init_process_group("gloo")
    times: dict[str, list[float]] = {}
    try:
        start = time.perf_counter()
        timers = []
        configurations = [(strategy, k) for strategy in args.strategy
                          for k in args.micro_batches]
        for strategy, k in configurations:
            timers.append(KernelTimer(args.model, strategy, world, k, args.batch,
                                      real=in_situ, optimizer=args.optimizer))
            if rank == 0:
                log.info("%s %s k=%d built (%d of %d), %.1f s", args.model, strategy, k,
                         len(timers), len(configurations), time.perf_counter() - start)
        measure_in_turns(timers, args.steps, args.warmup)
        for timer, (strategy, k) in zip(timers, configurations):
            mine = timer.times()
            for key, values in mine.items():
                times.setdefault(key, []).extend(values)
            if rank == 0:
                step, kernels = breakdown(timer, mine)
                log.info("%s k=%d: step %.1f ms on rank 0 (median of %d, clock reads in it), "
                         "its kernels %.1f ms, waiting %.1f ms", strategy, k, step * 1e3,
                         len(timer.walls), kernels * 1e3, (step - kernels) * 1e3)
        if rank == 0:
            log.info("%d configurations timed in turns, %d steps each: %d kernels, %.1f s",
                     len(timers), args.steps, len(times), time.perf_counter() - start)
        runs = [times]
        if world > 1:  # every rank's timings: a step waits for its slowest rank
            runs = [None] * world
            dist.all_gather_object(runs, times)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    if rank != 0:
        return 0
    keys = sorted({key for r in runs for key in r})
    for r in runs:
        for key in keys:
            if key in r:
                r[key], stalls = without_stalls(r[key])
                if stalls:
                    log.warning("kernel %s: %d of %d runs left out as stalls (%s ms; the "
                                "median is %.3g ms); if the machine is busy, calibrate again "
                                "on an idle one", key, len(stalls), len(stalls) + len(r[key]),
                                ", ".join(f"{1e3 * t:.3g}" for t in stalls),
                                1e3 * statistics.median(r[key]))
    kernels = dict(base.kernels or {})
    kernels.update({key: max(statistics.fmean(r[key]) for r in runs if key in r) for key in keys})
    spreads = dict(base.kernel_quantiles or {})
    spreads.update({key: quantiles([t for r in runs for t in r.get(key, ())]) for key in keys})
    command = "calibration.ops " + " ".join(sys.argv[1:] if argv is None else argv)
    source = (f"{base.source} Kernels of {args.model} measured by `{command}` on {world} "
              f"rank(s) ({'in real steps' if in_situ else 'collectives stood in locally'}), "
              f"mean of {args.steps} steps on the slowest rank (stalls left out: runs over "
              f"{STALL:g}x their kernel's median and {1e3 * STALL_SECONDS:g} ms over it), and "
              f"their spread over all ranks.")
    profile = replace(base, name=args.out.stem, source=source, kernels=kernels,
                      kernel_quantiles=spreads, kernels_in_situ=in_situ)
    args.out.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    print(f"{PROG}: {len(times)} kernels measured ({sum(map(len, times.values()))} timings); "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
