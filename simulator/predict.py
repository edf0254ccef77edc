"""Predict one training step of a model on a cluster, as plain SPMD (k=1) and with Duplex (k
micro-batches). By default it searches HiDup's plan and sets it beside the fixed strategies (ddp,
megatron, expert), says which it would run and why: `python -m simulator.predict`. With
`--strategy NAME|PLAN` it predicts that one strategy alone."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from hidup import models
from hidup.cli import Parser
from hidup.graph.capture import Graph
from hidup.models import capture_model
from hidup.planning.costs import Profile, load_profile
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import resolve_strategy, save_plan
from hidup.planning.search import search
from hidup.strategy import (NoMicroBatches, Strategy, fixed_strategies,
                                     microbatch_split)
from hidup.program import HOST_MODES, OPTIMIZERS, lower
from simulator.montecarlo import expected_step, step_time_interval
from simulator.report import Comparison, Prediction
from simulator.trace import write_trace

log = logging.getLogger(__name__)
PROG = "python -m simulator.predict"
SEARCH = "search"  # --strategy: HiDup's search beside the fixed strategies
def _setup(model: str, cluster: str, gpus: int, batch: int | None):
    """The model spec, the profile (refusing a world size it cannot describe), the batch and
    the captured graph."""
    spec = models.get_model(model, gpus=gpus)
    profile = load_profile(cluster)
    profile.check_world(gpus)
    batch = batch or spec.batch
    started = time.perf_counter()
    graph = capture_model(spec, batch)
    log.info("captured %s (batch %d): %d nodes in %.2f s", spec.name, batch, len(graph.nodes),
             time.perf_counter() - started)
    return spec, profile, batch, graph


def simulate(name: str, profile: Profile, batch: int, graph: Graph, plan: Strategy, gpus: int,
             k: int, samples: int = 0, noise: float = 0.1, bucket_mb: float = 25.0,
             mode: str = "graph", show_plan: bool = False, optimizer: str = "sgd") -> Prediction:
    """Lower `plan` for k=1 and for k micro-batches and simulate both (`name`: the model's, as
    reported), with `optimizer`'s update and state (hidup.program.OPTIMIZERS)."""
    results, intervals, memory = [], [], []
    bucket = int(bucket_mb * 2 ** 20)
    for program in [lower(graph, plan, gpus, n, name, bucket_bytes=bucket,
                                   optimizer=optimizer) for n in (1, k)]:
        started = time.perf_counter()
        results.append(expected_step(program, profile, mode=mode))  # simulate unless kernels vary
        log.info("%s k=%d: %d tasks simulated in %.3f s: %s", plan.name, program.k,
                 len(program.tasks), time.perf_counter() - started, results[-1])
        memory.append(peak_memory(program))
        if samples:
            intervals.append(step_time_interval(program, profile, samples, noise, mode=mode))
    return Prediction(name, batch, profile, gpus, plan, k, *results, graph, tuple(memory),
                      tuple(intervals) if samples else None, mode, show_plan, optimizer)


def predict(model: str, cluster: str, gpus: int, strategy: str, batch: int | None,
            k: int, samples: int = 0, noise: float = 0.1,
            bucket_mb: float = 25.0, mode: str = "graph", show_plan: bool = False,
            optimizer: str = "sgd") -> Prediction:
    """Capture, plan, lower for k=1 and for k micro-batches, and simulate both (the executor in
    `mode`: what the host costs where the profile has host figures)."""
    spec, profile, batch, graph = _setup(model, cluster, gpus, batch)
    plan = resolve_strategy(strategy, graph, gpus, profile.name)
    return simulate(spec.name, profile, batch, graph, plan, gpus, k, samples, noise, bucket_mb,
                    mode, show_plan, optimizer)


def compare(model: str, cluster: str, gpus: int, batch: int | None, k: int, samples: int = 0,
            noise: float = 0.1, bucket_mb: float = 25.0, mode: str = "graph",
            show_plan: bool = False, optimizer: str = "sgd") -> Comparison:
    """HiDup's Duplex-aware search (within a device's memory) and every fixed strategy that
    applies, each simulated with and without Duplex; the fastest that fits is chosen."""
    spec, profile, batch, graph = _setup(model, cluster, gpus, batch)
    return choose(spec.name, profile, batch, graph, gpus, k, samples, noise, bucket_mb, mode,
                  show_plan, optimizer)


def choose(name: str, profile: Profile, batch: int, graph: Graph, gpus: int, k: int,
           samples: int = 0, noise: float = 0.1, bucket_mb: float = 25.0, mode: str = "graph",
           show_plan: bool = False, optimizer: str = "sgd") -> Comparison:
    """`compare` on a captured graph (of any module: hidup.plan's too). Where the batch cannot
    be split into k micro-batches, plain SPMD only (k = 1), and the note says why."""
    plans, note, seconds = [], "", 0.0
    if k > 1:
        try:
            microbatch_split(graph, k)
        except NoMicroBatches as exc:
            note, k = f"no Duplex: {exc}", 1
    try:
        found = search(graph, gpus, profile, k, profile.device_memory, optimizer=optimizer)
        seconds = found.seconds
        plans.append(replace(found.strategy, name="hidup"))
        log.info("searched in %.2f s (%d labels)", found.seconds, found.states)
    except ValueError as exc:
        note = "; ".join(filter(None, [note, f"no searched plan: {exc}"]))
    plans += fixed_strategies(graph, gpus).values()
    if not plans:
        raise ValueError(f"no strategy applies to {name} on {gpus} GPUs ({note}); try "
                         f"another GPU count")
    predictions = [simulate(name, profile, batch, graph, p, gpus, k, 0, noise, bucket_mb, mode,
                            show_plan, optimizer) for p in plans]
    bests = [(p.best(), i) for i, p in enumerate(predictions)]
    fitting = [(best[1].step_time, i, best[0]) for best, i in bests if best is not None]
    if not fitting:
        peak = min(max(m.peak for _, _, m in p.runs()) for p in predictions)
        raise ValueError(f"no plan fits a device's {profile.device_memory / 2**30:.3g} GiB: the "
                         f"smallest needs {peak / 2**30:.3g} GiB per rank; use more GPUs or a "
                         f"smaller batch")
    _, chosen, chosen_k = min(fitting)
    if samples:  # the interval of the chosen plan only: every plan's would take long
        predictions[chosen] = simulate(name, profile, batch, graph, plans[chosen], gpus, k,
                                       samples, noise, bucket_mb, mode, show_plan, optimizer)
    return Comparison(tuple(predictions), chosen, chosen_k, seconds, note)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return value


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=" ".join(__doc__.split()))
    p.add_argument("--model", metavar="NAME:SIZE", default="bert-sgmoe:paper",
                   help=f"model NAME:SIZE from the zoo, one of {models.names()} "
                        f"(default: %(default)s)")
    p.add_argument("--cluster", metavar="NAME|PATH", default="v100-2x4",
                   help="a shipped profile name or the path of a profile JSON file "
                        "(default: %(default)s, two machines of 4 V100s)")
    p.add_argument("--gpus", metavar="N", type=_positive, default=8,
                   help="world size (default: %(default)s)")
    p.add_argument("--strategy", metavar="NAME|PATH", default=SEARCH,
                   help=f"'{SEARCH}': HiDup's searched plan beside the fixed strategies; or one "
                        f"strategy alone: a fixed one (ddp, megatron, expert) or the path of a "
                        f"plan file (default: %(default)s)")
    p.add_argument("--batch", metavar="B", type=_positive, default=None,
                   help="global batch size (default: the model's own)")
    p.add_argument("--micro-batches", metavar="K", type=_positive, default=2,
                   help="Duplex micro-batches per rank, k (default: %(default)s)")
    p.add_argument("--mode", choices=HOST_MODES, default="graph",
                   help="executor mode to predict ('eager': plain PyTorch): its host time per "
                        "task, where the profile has host figures (GPU profiles; on a CPU cluster "
                        "the host runs the kernels and this changes nothing) "
                        "(default: %(default)s)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="the optimizer training runs (hidup.train's default: adamw): its update "
                        "time and its state's memory count (default: %(default)s)")
    p.add_argument("--show-plan", action="store_true",
                   help="list every op's placements instead of the plan's one-line summary")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.add_argument("--trace", metavar="PATH", type=Path, default=None,
                   help="write the simulated Chrome trace of the Duplex run (of the chosen plan "
                        "with --strategy search) to this file: a track per stream, and the "
                        "host's where the profile has host figures")
    p.add_argument("--bucket-mb", metavar="MB", type=float, default=25.0,
                   help="gradient bucket size for the replicated parameters' all-reduces, as "
                        "DDP's bucket_cap_mb; 0: one all-reduce per parameter, as the HiDup "
                        "prototype (default: %(default)s)")
    p.add_argument("--monte-carlo", metavar="N", type=int, default=0,
                   help="also simulate N times with perturbed profile figures and report a 95%% "
                        "interval of the step time (of the chosen plan with --strategy search) "
                        "(default: off)")
    p.add_argument("--noise", metavar="SIGMA", type=float, default=0.1,
                   help="spread of the log-normal perturbation for --monte-carlo "
                        "(default: %(default)s, about 10%%)")
    p.add_argument("--save-plan", metavar="PATH", type=Path, default=None,
                   help="write the strategy (the chosen one with --strategy search) as a plan "
                        "file, for hidup.train --strategy PATH")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log progress (-v) or every detail (-vv)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.bucket_mb >= 0:
        parser.error(f"--bucket-mb {args.bucket_mb}: must be 0 or more megabytes")
    if args.monte_carlo < 0 or not args.noise >= 0:
        parser.error("--monte-carlo must be 0 or more samples and --noise 0 or more")
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    options = (args.batch, args.micro_batches, args.monte_carlo, args.noise, args.bucket_mb,
               args.mode, args.show_plan, args.optimizer)
    try:
        if args.strategy == SEARCH:
            report = compare(args.model, args.cluster, args.gpus, *options)
            shown = report.predictions[report.chosen]
        else:
            report = shown = predict(args.model, args.cluster, args.gpus, args.strategy, *options)
    except ValueError as exc:
        parser.exit(2, f"{PROG}: error: {' '.join(str(exc).split())}\n")
    if args.trace is not None:
        try:
            write_trace(args.trace, shown.duplex, f"{shown.strategy.name} k={shown.k}")
        except OSError as exc:
            parser.exit(2, f"{PROG}: error: cannot write the trace to {args.trace} "
                           f"({exc.strerror or exc})\n")
    if args.save_plan is not None:
        try:
            chosen_k = report.chosen_k if args.strategy == SEARCH else \
                (shown.best() or (shown.k, None))[0]
            save_plan(args.save_plan, shown.graph, shown.strategy, args.gpus, shown.model,
                      shown.profile.name, micro_batches=chosen_k, optimizer=args.optimizer)
        except OSError as exc:
            parser.exit(2, f"{PROG}: error: cannot write the plan to {args.save_plan} "
                           f"({exc.strerror or exc})\n")
    try:
        print(json.dumps(report.to_dict(), indent=1) if args.json else report, flush=True)
    except BrokenPipeError:  # piped into `head`: what was read is all that was wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
