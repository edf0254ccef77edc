"""How noisy a cluster's links are: the same gloo all-reduces, timed again and again.

    python -m hidup.emulate up --hosts 2 --bandwidth 10gbit
    python -m hidup.emulate run -- -m experiments.link_noise
    python -m hidup.emulate down

Each round times --runs back-to-back all-reduces of every size (each call counts for its
slowest rank) and rank 0 prints the round's mean and median per size. At the end, per size:
- the round means' range and coefficient of variation: how far a collective point measured at
  one moment (calibration.profile) can be from the same point a minute later;
- the calls' tail: the median, 99th percentile and slowest call, and the calls over 10 ms with
  their share of all the time (stalls that a median hides and a step pays).
The simulator's accuracy on the emulated cluster cannot be better than these allow; compare
`up --kernel-defaults` (links as Linux sets a veth up) with the default (tuned) links."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from calibration.timing import Ranks
from hidup.cli import Parser

PROG = "python -m experiments.link_noise"
STALL = 0.010  # a call slower than this (s) is a stall


def parse_args(argv=None):
    ap = Parser(prog=PROG, description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 262144, 4 << 20],
                    help="all-reduce sizes in bytes (default 4096 262144 4194304)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    ap.add_argument("--runs", type=int, default=100,
                    help="back-to-back calls of each size per round (default 100)")
    ap.add_argument("--pause", type=float, default=5.0,
                    help="seconds between rounds, the links idle (default 5)")
    args = ap.parse_args(argv)
    for flag in ("rounds", "runs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: must be at least 1")
    if min(args.sizes) < 4:
        ap.error(f"--sizes {min(args.sizes)}: a size is at least 4 bytes (one float)")
    if args.pause < 0:
        ap.error(f"--pause {args.pause}: must be 0 or more")
    return args


def timed_calls(x: torch.Tensor, runs: int, ranks: Ranks) -> list[float]:
    """Seconds of `runs` back-to-back all-reduces of x, each its slowest rank's."""
    dist.all_reduce(x)  # warm-up
    ranks.barrier()
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        dist.all_reduce(x)
        seconds.append(time.perf_counter() - start)
    return ranks.max(seconds)


def summary(size: int, means: list[float], calls: list[float]) -> str:
    """One size's line: the round means' spread and the calls' tail (ms)."""
    ordered = sorted(calls)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    stalls = [c for c in calls if c > STALL]
    cv = statistics.pstdev(means) / statistics.fmean(means)
    return (f"{size:>9} B: round means {min(means) * 1e3:.2f}-{max(means) * 1e3:.2f} ms "
            f"(cv {cv:.0%}); calls median {statistics.median(calls) * 1e3:.2f}, p99 "
            f"{p99 * 1e3:.2f}, max {max(calls) * 1e3:.1f} ms; {len(stalls)} of {len(calls)} "
            f"over {STALL * 1e3:.0f} ms, {sum(stalls) / sum(calls):.0%} of the time")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = Ranks(os.environ, "gloo", torch.device("cpu"))
    rank = ranks.rank
    tensors = {n: torch.zeros(max(1, n // 4)) for n in args.sizes}
    means: dict[int, list[float]] = {n: [] for n in args.sizes}
    calls: dict[int, list[float]] = {n: [] for n in args.sizes}
    start = time.monotonic()
    if rank == 0:
        print(f"{ranks.world} ranks; per round, each size's mean / median (ms):",
              flush=True)
    try:
        for r in range(args.rounds):
            cells = []
            for n, x in tensors.items():
                seconds = timed_calls(x, args.runs, ranks)
                means[n].append(statistics.fmean(seconds))
                calls[n].extend(seconds)
                cells.append(f"{n} B {means[n][-1] * 1e3:.2f} / "
                             f"{statistics.median(seconds) * 1e3:.2f}")
            if rank == 0:
                print(f"round {r + 1}/{args.rounds} at {time.monotonic() - start:.0f} s: "
                      + ", ".join(cells), flush=True)
            if r + 1 < args.rounds:
                time.sleep(args.pause)
        if rank == 0:
            for n in args.sizes:
                print(summary(n, means[n], calls[n]), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
