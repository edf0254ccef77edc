"""Measure real step time with and without Duplex, side by side: `python -m experiments.duplex_speedup`.

Runs `torchrun -m hidup.train` for k=1 and k=2 micro-batches alternately (so that machine noise
hits both alike), optionally inside a private network namespace whose loopback is rate-limited
with `tc` (root and iproute2 needed), and prints the median step times and their ratio."""
from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from hidup.cli import Parser

log = logging.getLogger(__name__)


def parse_args(argv=None):
    ap = Parser(prog="python -m experiments.duplex_speedup", description=__doc__)
    ap.add_argument("--model", default="gpt:small", help="model NAME:SIZE")
    ap.add_argument("--strategy", default="megatron", help="'ddp', 'megatron' or a plan file")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (processes) on this machine")
    ap.add_argument("--bandwidth", default="1gbit",
                    help="tc rate of the ranks' loopback link, e.g. 1gbit; 'none' for plain loopback")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each setting, alternating")
    ap.add_argument("--steps", type=int, default=8, help="steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps per run left out of the median")
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.repeats < 1:
        ap.error("--ranks and --repeats must be at least 1")
    return args


@contextmanager
def limited_loopback(rate: str):
    """A fresh network namespace of our own whose loopback runs at `rate`; always deleted."""
    if rate == "none":
        yield []
        return
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("experiments.duplex_speedup: --bandwidth needs root and iproute2 (ip, tc); "
                         "run as root or pass --bandwidth none")
    name = f"hidup-dx-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                        "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"], check=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def run_once(prefix, args, k: int) -> float:
    cmd = prefix + ["torchrun", "--nproc-per-node", str(args.ranks), "-m", "hidup.train",
                    "--model", args.model, "--strategy", args.strategy, "--micro-batches", str(k),
                    "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"experiments.duplex_speedup: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["median_step_ms"]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    times = {1: [], 2: []}
    with limited_loopback(args.bandwidth) as prefix:
        for r in range(args.repeats):
            for k in (1, 2):
                times[k].append(run_once(prefix, args, k))
                log.info("run %d/%d  k=%d  median step %.1f ms", r + 1, args.repeats, k, times[k][-1])
    spmd, duplex = statistics.median(times[1]), statistics.median(times[2])
    result = {"model": args.model, "strategy": args.strategy, "ranks": args.ranks,
              "bandwidth": args.bandwidth, "spmd_ms": spmd, "duplex_ms": duplex,
              "speedup": spmd / duplex, "runs_ms": {str(k): v for k, v in times.items()}}
    print(f"{args.model} {args.strategy} {args.ranks} ranks, loopback {args.bandwidth}: "
          f"SPMD {spmd:.1f} ms, Duplex {duplex:.1f} ms per step, speedup {spmd / duplex:.2f}x "
          f"(median of {args.repeats} runs each)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
