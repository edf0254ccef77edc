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
from dataclasses import dataclass, replace
from pathlib import Path

from hidup import models
from hidup.cli import RECOMPUTE_HELP, Parser, parse_mesh
from hidup.cli.progress import progress, status_line
from hidup.graph.capture import Graph
from hidup.graph.dtypes import PRECISIONS, run_dtypes
from hidup.models import capture_model
from hidup.planning.costs import Profile
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import Plan, resolve_strategy, save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.select import DUPLEX_K, SEARCH, Goal, select_plan
from hidup.strategy import (ACROSS, FIXED, Mesh, NoMicroBatches, Strategy, parse_recompute,
                            recomputing, selective_part)
from hidup.program import BUCKET_BYTES, HOST_MODES, OPTIMIZERS, Program, lower
from hidup.program.tasks import LoweringError
from simulator.montecarlo import expected_step, step_time_interval
from simulator.report import Comparison, Prediction
from simulator.trace import write_trace

log = logging.getLogger(__name__)
PROG = "python -m simulator.predict"
@dataclass(frozen=True)
class SimOptions:
    """How a plan is simulated, beside the plan, the profile, the world size and k."""

    optimizer: str = "adamw"  # whose update and state count (hidup.program.OPTIMIZERS)
    mode: str = "graph"  # the executor mode whose host cost is simulated (GPU profiles)
    bucket_mb: float = 25.0  # gradient buckets of the replicated parameters' all-reduces
    samples: int = 0  # Monte-Carlo runs with perturbed profile figures (0: none)
    noise: float = 0.1  # their log-normal spread
    show_plan: bool = False  # the report lists every op's placements
    recompute: str = "auto"  # predict()'s strategy with these layers recomputed (parse_recompute;
    #   'auto' and 'none': as it is)
    precision: str | None = None  # 'fp32' or 'bf16': the dtypes of the run's values
    #   (hidup.graph.dtypes); None: the profile's


def _setup(model: str, cluster: str, gpus: int, batch: int | None):
    """The model spec, the profile, the batch and the captured graph."""
    spec = models.get_model(model, gpus=gpus)
    profile = load_profile(cluster)
    batch = batch or spec.batch
    started = time.perf_counter()
    progress(f"capturing {spec.name}, batch {batch}")
    graph = capture_model(spec, batch)
    log.info("captured %s (batch %d): %d nodes in %.2f s", spec.name, batch, len(graph.nodes),
             time.perf_counter() - started)
    return spec, profile, batch, graph


def simulate(graph: Graph, plan: Strategy, profile: Profile, gpus: int, k: int,
             options: SimOptions = SimOptions(), name: str = "model",
             lowered: dict[int, Program] | None = None) -> Prediction:
    """Lower `plan` for k=1 and for k micro-batches and simulate both (`name`: the model's, as
    reported). Where the batch does not split into k micro-batches on each rank, Duplex is not
    simulated: the Prediction has k = 1 and says why in its notes. `lowered`: Programs of the
    plan already lowered, by micro-batch count (Selection.programs), used where they were
    lowered as this run would lower them (its precision, optimizer and buckets)."""
    results, intervals, memory = [], [], []
    bucket = int(options.bucket_mb * 2 ** 20)
    precision = options.precision or profile.precision
    graph = run_dtypes(graph, precision, profile.device)

    def lowered_with(count: int) -> Program:
        done = (lowered or {}).get(count)
        if done is not None and bucket == BUCKET_BYTES and done.optimizer == options.optimizer \
                and done.precision == precision and done.world == gpus:
            return replace(done, model=name, strategy=plan.name)
        return lower(graph, plan, gpus, count, name, bucket_bytes=bucket,
                     optimizer=options.optimizer)

    programs = [lowered_with(1)]
    notes = ()
    if k > 1:
        try:
            programs.append(lowered_with(k))
        except (LoweringError, NoMicroBatches) as exc:  # the batch does not split so
            notes, k = (f"no Duplex with {k} micro-batches: {exc}",), 1
    for program in programs:
        progress(f"simulating {plan.name} with k={program.k}")
        started = time.perf_counter()
        results.append(expected_step(program, profile, mode=options.mode))  # simulated unless
        # the profile's kernels vary
        log.info("%s k=%d: %d tasks simulated in %.3f s: %s", plan.name, program.k,
                 len(program.tasks), time.perf_counter() - started, results[-1])
        memory.append(peak_memory(program))
        if options.samples:
            intervals.append(step_time_interval(program, profile, options.samples, options.noise,
                                                mode=options.mode))
    if len(programs) == 1:  # no Duplex: its run is the SPMD one
        results, memory, intervals = results * 2, memory * 2, intervals * 2
    batch = graph.user_inputs[0].out.shape[0] if graph.user_inputs[0].out.shape else 1
    return Prediction(name, batch, profile, gpus, plan, k, *results, graph, tuple(memory),
                      tuple(intervals) if options.samples else None, options.mode,
                      options.show_plan, options.optimizer, notes)


def predict(model: str, cluster: str, gpus: int, strategy: str, batch: int | None = None,
            k: int = DUPLEX_K, options: SimOptions = SimOptions(), mesh: Mesh | None = None
            ) -> Prediction:
    """A zoo model captured, one strategy (a fixed one's name, of a `mesh` for
    hsdp, dp-megatron, fsdp+tp, tp+ep..., or a plan file) lowered for k=1 and for k
    micro-batches, and both simulated."""
    spec, profile, batch, graph = _setup(model, cluster, gpus, batch)
    profile.check_world(gpus)
    plan = resolve_strategy(strategy, graph, gpus, profile.name, mesh)
    if options.recompute != "auto":
        plan = recomputing(graph, plan, parse_recompute(options.recompute, graph),
                           selective_part(options.recompute)[0])
    return simulate(graph, plan, profile, gpus, k, options, spec.name)


def predict_plan(plan: Plan, cluster: str | None = None,
                 options: SimOptions | None = None) -> Prediction:
    """A hidup.Plan (from hidup.plan or hidup.Plan.load(path, model)) simulated on `cluster`
    (default: the one it was made for) as plain SPMD (k=1) and with Duplex (its micro-batches,
    or DUPLEX_K for a plan of one, where the batch splits so), within the memory it was planned
    for; str() is this command's report."""
    if plan.graph is None:
        raise ValueError("this plan was loaded without its model: load it with "
                         "hidup.Plan.load(path, model) to simulate it")
    cluster = cluster or plan.cluster
    if cluster is None:
        raise ValueError("this plan names no cluster: give predict_plan(plan, cluster=NAME)")
    profile = load_profile(cluster)
    profile.check_world(plan.gpus)
    if plan.memory is not None:
        profile = replace(profile, device_memory=plan.memory)
    options = options or SimOptions(optimizer=plan.optimizer)
    k = plan.micro_batches if plan.micro_batches > 1 else DUPLEX_K
    return simulate(plan.graph, plan.strategy, profile, plan.gpus, k, options, plan.model)


def compare(model: str, cluster: str, goal: Goal, batch: int | None = None,
            options: SimOptions = SimOptions()) -> Comparison:
    """A zoo model's plan chosen for `goal` (hidup.planning.select, as hidup.plan() and
    hidup.planner choose it), simulated beside every plan it was chosen from (the searched plan
    and the fixed strategies), each with and without Duplex."""
    spec, profile, batch, graph = _setup(model, cluster, goal.gpus, batch)
    chosen = select_plan(graph, profile, replace(goal, grows=spec.grows))
    options = replace(options, optimizer=goal.optimizer)
    quiet = replace(options, samples=0)  # the interval of the chosen plan only
    names = list(chosen.candidates)
    predictions = [simulate(graph, s, chosen.profile, goal.gpus, chosen.duplex_k,
                            options if name == chosen.strategy.name else quiet, spec.name,
                            chosen.programs.get(name))
                   for name, s in chosen.candidates.items()]
    found = chosen.search
    return Comparison(tuple(predictions), names.index(chosen.strategy.name), chosen.k,
                      found.seconds if found else 0.0, "; ".join(chosen.notes))


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
                        f"strategy alone: a fixed one ({', '.join(FIXED)}; on a --mesh of 2 or "
                        f"more machines also {', '.join(ACROSS)}) or the path of a plan "
                        f"file (default: %(default)s)")
    p.add_argument("--batch", metavar="B", type=_positive, default=None,
                   help="global batch size (default: the model's own)")
    p.add_argument("--micro-batches", metavar="K", type=_positive, default=None,
                   help=f"micro-batches per rank: 1 (plain SPMD), 2 or more (Duplex); the "
                        f"Duplex column's k (default: the faster of 1 and {DUPLEX_K})")
    p.add_argument("--memory", metavar="GIB", type=float, default=None,
                   help="device memory limit in GiB (default: the cluster profile's)")
    p.add_argument("--mesh", metavar="MACHINESxGPUS", default=None,
                   help="the device mesh the search runs on beside the 1-D one, e.g. 2x4, or "
                        "a 3-D one, MACHINESxBLOCKSxGPUS (e.g. 2x2x2: each machine's GPUs in "
                        "blocks), and a mesh --strategy NAME's (hsdp+tp needs 3-D) (default: "
                        "the cluster's machines x GPUs per machine when --gpus fills whole "
                        "machines)")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="the dtypes values, collectives and memory are counted at (bf16: mixed "
                        "precision under torch.autocast, float32 master weights; default: the "
                        "cluster profile's)")
    p.add_argument("--mode", choices=HOST_MODES, default="graph",
                   help="executor mode to predict ('eager': plain PyTorch): its host time per "
                        "task, where the profile has host figures (GPU profiles; on a CPU cluster "
                        "the host runs the kernels), and with 'compile' the ops Inductor fuses "
                        "priced as one kernel per group (docs/design.md); the search ranks its "
                        "plans by it too (default: %(default)s)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                   help="the optimizer training runs (hidup.train's default: adamw): its update "
                        "time and its state's memory count (default: %(default)s)")
    p.add_argument("--recompute", default="auto", metavar="auto|none|all|N|LAYERS",
                   help=RECOMPUTE_HELP + "; with --strategy NAME|PLAN, auto is none")
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


def _run(args, mesh, options: SimOptions):
    """(the report, the prediction shown) of the command's arguments: the searched plan beside
    the baselines, or one strategy."""
    if args.strategy == SEARCH:
        goal = Goal(args.gpus, args.micro_batches,
                    None if args.memory is None else args.memory * 2**30, args.optimizer,
                    mesh, recompute=args.recompute, mode=args.mode, precision=args.precision)
        report = compare(args.model, args.cluster, goal, args.batch, options)
        return report, report.predictions[report.chosen]
    shown = predict(args.model, args.cluster, args.gpus, args.strategy, args.batch,
                    args.micro_batches or DUPLEX_K, replace(options, recompute=args.recompute),
                    Mesh.of_machines(*mesh) if mesh else None)
    return shown, shown


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.bucket_mb >= 0:
        parser.error(f"--bucket-mb {args.bucket_mb}: must be 0 or more megabytes")
    if args.monte_carlo < 0 or not args.noise >= 0:
        parser.error("--monte-carlo must be 0 or more samples and --noise 0 or more")
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.memory is not None and not 0 < args.memory < float("inf"):
        parser.error(f"--memory {args.memory}: must be a positive number of GiB")
    mesh = None if args.mesh is None else parse_mesh(args.mesh, args.gpus, parser.error)
    options = SimOptions(args.optimizer, args.mode, args.bucket_mb, args.monte_carlo, args.noise,
                         args.show_plan, precision=args.precision)
    try:
        with status_line(args.verbose > 0):
            report, shown = _run(args, mesh, options)
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
