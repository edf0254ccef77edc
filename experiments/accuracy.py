"""The simulator against real runs on an emulated cluster: `python -m experiments.accuracy`.

For each cluster shape (--hosts x --ranks-per-host) an emulated cluster (hidup.emulation: hosts as
network namespaces, links limited with tc) is brought up, and for each link bandwidth it is
calibrated once, as a user would calibrate theirs: calibration.profile (microbenchmarks of
kernels and collectives; on one rank its kernels on the cpu-gloo-loopback profile's
collectives), then per model calibration.ops (every strategy's training step as hidup.train runs
it, SGD included, at k = 1 and 2, timed task by task in real steps; the searched plan is made
from it and its kernels added). Every
configuration (model x strategy x Duplex on/off) is then predicted from that one profile and
trained for real (hidup.train, median step after warm-up) in each of --rounds rounds; the
medians over rounds count. --recalibrate-each times each configuration's own kernels right
before its run instead (an easier test: the simulator adding up fresh kernel times). A speed
probe (a fixed one-thread workload, speed_probe_ms) is timed around each calibration of kernels
and each run; a configuration's drift is the one over the other, the machine's own change of
speed between its calibration and its run. Reports each error, the median and maximum absolute
error, the median drift and the median error with each prediction scaled by its drift (what is
left once the machine's drift is out), Kendall's tau per model and the regret of taking the
simulator's best per model and cluster; writes a CSV, a JSON summary and a
predicted-vs-measured plot to --out (default out/accuracy/, git-ignored; the results in docs/ are
in experiments/results/accuracy/, which a --quick run may not write to). Needs root and iproute2
(as hidup.emulation).

--combine FOLDER ... runs nothing: it reads earlier runs' folders (their accuracy.csv) and reports
and writes their configurations as one table, e.g. runs of different cluster shapes or
bandwidths made one after another."""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

from experiments import outputs
from experiments.accuracy_combine import combine
from experiments.accuracy_report import PROG, report, summarize, write_outputs
from experiments.accuracy_rows import Row
from experiments.accuracy_runs import calibrate, run_model
from hidup.cli import Parser, parse_rate
from hidup.emulation.netns import ClusterError, emulated
from hidup.strategy import ACROSS

log = logging.getLogger(__name__)
STRATEGIES = ("searched", "ddp", "megatron", "expert")  # the default set
MESH_STRATEGIES = tuple(ACROSS)  # 2-D: data parallel across the hosts, the named one inside


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__)
    ap.add_argument("--models", nargs="+", default=["gpt:small", "bert-sgmoe:small"],
                    help="zoo models NAME:SIZE (CPU-feasible sizes)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                    help=f"of {STRATEGIES + MESH_STRATEGIES}; 'expert' and 'dp-expert' only "
                         f"apply to mixture-of-experts models; the dp- ones (a 2-D mesh of hosts "
                         f"x ranks per host) to clusters of 2 or more ranks per host")
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit", "10gbit"],
                    help="link rates to emulate, e.g. 100mbit 1gbit 10gbit")
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 3],
                    help="emulated machines, one cluster per count and --ranks-per-host "
                         "(default 2 3)")
    ap.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2],
                    help="ranks per machine, one cluster each (default 1 2)")
    ap.add_argument("--recalibrate-each", action="store_true",
                    help="time each configuration's kernels (calibration.ops) right before it "
                         "runs, instead of once per cluster, bandwidth and model")
    ap.add_argument("--steps", type=int, default=10, help="training steps per real run")
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over all configurations; the medians over rounds count "
                         "(default 2)")
    ap.add_argument("--ops-steps", type=int, default=None,
                    help="timed steps per strategy and micro-batch count in calibration.ops, "
                         "taken in turns (default 5, --quick 12; millisecond steps need "
                         "hundreds)")
    ap.add_argument("--max-bytes", default="32MB",
                    help="largest collective the calibration measures (calibration.profile)")
    ap.add_argument("--quick", action="store_true",
                    help="CI size: gpt:small, ddp and megatron, 1gbit, 2 hosts of 1 rank, 8 steps "
                         "per run (3 of warm-up), 12 calibration steps")
    ap.add_argument("--out", type=Path, default=outputs.default_out("accuracy"),
                    help="folder for accuracy.csv, accuracy.json, accuracy.png and the profiles "
                         "(default out/accuracy, git-ignored)")
    ap.add_argument("--combine", nargs="+", type=Path, metavar="FOLDER", default=None,
                    help="run nothing: report the configurations of earlier runs' folders "
                         "(each with the accuracy.csv a run wrote) as one table, and write it "
                         "to --out; the run flags above are then not used")
    ap.add_argument("--repredict", action="store_true",
                    help="with --combine: predict every configuration again with this version's "
                         "simulator, from the profile and plan its run kept in its folder (the "
                         "measured times stay): what a change to the simulator does to runs "
                         "already measured")
    ap.add_argument("--max-median-error", type=float, default=None,
                    help="exit 1 when the median absolute error exceeds this fraction (CI: 0.10)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.strategies = ["gpt:small"], ["ddp", "megatron"]
        args.bandwidths, args.ranks_per_host, args.hosts = ["1gbit"], [1], [2]
        args.steps, args.warmup = 8, 3
    if args.ops_steps is None:
        args.ops_steps = 12 if args.quick else 5
    bad = sorted(set(args.strategies) - set(STRATEGIES + MESH_STRATEGIES))
    if bad:
        ap.error(f"--strategies {bad}: choose from {list(STRATEGIES + MESH_STRATEGIES)}")
    for rate in args.bandwidths:
        try:
            parse_rate(rate)
        except ValueError as exc:
            ap.error(str(exc))
    ap.at_least_one(args, "rounds", "ops_steps")
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    gate = args.max_median_error
    if gate is not None and not (math.isfinite(gate) and gate >= 0):
        ap.error(f"--max-median-error {gate}: give a finite fraction >= 0, e.g. 0.10 for 10%")
    outputs.refuse_quick_into_results(ap, args.out, args.quick, "accuracy")
    if args.repredict and not args.combine:
        ap.error("--repredict re-predicts earlier runs: give their folders with --combine")
    if args.combine and args.out.resolve() in {f.resolve() for f in args.combine}:
        ap.error(f"--out {args.out} is one of the --combine folders: its accuracy.csv would be "
                 f"overwritten; give another --out")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    started = time.perf_counter()
    command = "python -m experiments.accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.combine:
        try:
            rows, sources = combine(args.combine, args.repredict)
        except ValueError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        return report(rows, args, command, started, sources)
    try:
        for hosts in args.hosts:
            for rph in args.ranks_per_host:
                with emulated(hosts, rph, args.bandwidths[0]) as cluster:
                    for bandwidth in args.bandwidths:
                        cluster.set_link(bandwidth)
                        base = calibrate(cluster, args, args.out)
                        log.info("[%.0f s] %d hosts x %d ranks, %s: calibrated (%s)",
                                 time.perf_counter() - started, hosts, rph, bandwidth, base)
                        for model in args.models:
                            rows += run_model(cluster, model, base, args, started)
                            if rows:  # what is measured so far is kept if a later run fails
                                write_outputs(rows, summarize(rows), args.out, command)
    except (ClusterError, RuntimeError, ValueError) as exc:
        print(f"{PROG}: {exc}" + (f" (the {len(rows)} configurations measured before it are in "
                                  f"{args.out / 'accuracy.csv'})" if rows else ""),
              file=sys.stderr)
        return 2
    if not rows:
        print(f"{PROG}: no configuration could run", file=sys.stderr)
        return 2
    return report(rows, args, command, started)


if __name__ == "__main__":
    sys.exit(main())
