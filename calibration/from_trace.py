"""Fit a Profile from PyTorch-profiler Chrome traces of real runs.

A trace records kernel durations but not the shapes they ran on, so each trace is paired with
the Program of the same run: `--model` (with its batch) on `--gpus` ranks under the strategy
named beside the trace (`TRACE=STRATEGY`: ddp, expert, megatron, a plan file, or `traced` — the
plan read from the trace's own collectives, calibration.traced_plan). Then:

- kernels: per forward op kind (linear, einsum, layer norm, element-wise add / mul / relu) the
  trace's GPU time per step (every kernel launched under the op, found by external id) against
  the Program's FLOPs and bytes of that kind: one point per kind and trace, fitted to the
  roofline t = overhead + max(flops / F, bytes / B) (calibration.fit.fit_roofline);
- collectives: an all-gather or reduce-scatter whose chunk copies the trace records is sized by
  them; otherwise, per kind, the trace's NCCL kernels of a step in issue order are paired with
  the Program's collectives of that kind in order (bytes from the Program; where the Program has
  more, its smallest are left out, e.g. the loss's scalar all-reduce that the real run did not
  issue). Each kernel's time is its shortest over the profiled steps (an NCCL kernel also spins
  while it waits for its peers). Fitted to the ring / tree formulas per link tier
  (calibration.fit.fit_link). A trace whose ranks span machines (--gpus > --gpus-per-node)
  calibrates the inter-node tier.

The Program prices the update of the optimizer whose step the trace records
(`Optimizer.step#SGD.step`: the shipped V100 and H100 traces all ran SGD), or --optimizer's where
it records none.

The kernels' times in a trace already include whatever slowed them while they overlapped, so
the profile's interference factors are 1.0 (or the --base profile's). Figures no trace gives
come from --base; without one, every kind must be measured.

Reading a trace and pairing it with its Program is calibration.traced_run; this module fits and
writes the profile:

`python -m calibration.from_trace ddp.json.gz=ddp hidup.json.gz=traced --model
switch-trace:paper --gpus 4 --gpus-per-node 4 --name v100-1x4-nvlink --out PROFILE`
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from calibration.fit import (FitError, Residuals, check_roofline, fit_link, fit_roofline,
                             residuals)
from calibration.trace import TraceError
from calibration.traced_run import TracedRun, issued_tasks, read_run
from hidup.cli import Parser
from hidup.models import capture_model, get_model
from hidup.planning.costs import LinkCost, Profile, ProfileError
from hidup.planning.planfile import PlanError
from hidup.planning.profile_file import load_profile
from hidup.program import COLLECTIVES, HOST_MODES, OPTIMIZERS, Program, kernel_tasks


def fit_profile(runs: list[TracedRun], name: str, gpus_per_node: int, base: Profile | None,
                world: int, links_only: bool = False) -> tuple[Profile, list[Residuals]]:
    """The Profile fitted to the runs' points, with figures no run gives taken from `base`
    (and the device figures too if `links_only`)."""
    report = []
    points = [p for run in runs for p in run.kernel_points.values()]
    if points and not links_only:
        flops, mem, overhead, res = fit_roofline(points)
        flops, mem, overhead, res = fit_kernels(runs, (flops, mem, overhead))
        report += res
    elif base:
        flops, mem, overhead = base.flops, base.mem_bandwidth, base.op_overhead
    else:
        raise FitError("no kernel points in the traces and no --base profile to take the device "
                       "figures from")
    spans = world > gpus_per_node
    tier: dict[str, LinkCost] = {}
    for kind in COLLECTIVES:
        rows = [(n, b, s) for run in runs for k, n, b, s in run.link_points if k == kind]
        if rows:
            tier[kind], res = fit_link(kind, rows)
            report.append(replace(res, label=f"{'inter-node' if spans else 'intra-node'} {kind}"))
    fallback = (base.inter_node if spans else base.collectives) if base else None
    missing = [k for k in COLLECTIVES if k not in tier]
    if missing and not fallback:
        raise FitError(f"the traces have no {missing} collectives to fit; give a --base profile "
                       f"for them")
    tier.update({k: fallback[k] for k in missing})
    intra = base.collectives if spans and base else tier
    inter = tier if spans else (base.inter_node if base else None)
    factors = (base.interference_compute, base.interference_comm) if base else (1.0, 1.0)
    profile = Profile(name, "", flops, mem, overhead, intra, gpus_per_node, inter, *factors,
                      interference_latency=base.interference_latency if base else None)
    return profile, report


def fit_kernels(runs: list[TracedRun], start: tuple[float, float, float]
                ) -> tuple[float, float, float, list[Residuals]]:
    """The roofline (FLOP/s, bytes/s, overhead) fitted jointly to the forward op kinds' points
    and to each trace's whole-step computation (every kernel of the Program, forward, backward
    and update, against the trace's summed computation kernel time), each whole step weighted as
    much as all the op points together (the step is what the simulator must get right); `start`
    is the op points' own fit."""
    points = [p for run in runs for p in run.kernel_points.values()]
    f, b, t = (np.asarray(c, dtype=float) for c in zip(*points))
    steps_ = [_kernels(run.program) for run in runs]
    measured = np.array([run.computation for run in runs])
    weight = math.sqrt(len(points))

    def model(x):
        rate, mem, overhead = math.exp(x[0]), math.exp(x[1]), x[2] * 1e-6
        ops = overhead + np.maximum(f / rate, b / mem)
        whole = np.array([np.sum(overhead + np.maximum(sf / rate, sb / mem)) for sf, sb in steps_])
        return ops, whole

    def error(x):
        ops, whole = model(x)
        return np.concatenate([np.log(ops / t), weight * np.log(whole / measured)])

    x0 = [math.log(start[0]), math.log(start[1]), start[2] * 1e6]
    fit = least_squares(error, x0, bounds=([-np.inf, -np.inf, 0.0], np.inf), x_scale="jac")
    check_roofline(math.exp(fit.x[0]), math.exp(fit.x[1]), f, b, t)
    ops, whole = model(fit.x)
    return (math.exp(fit.x[0]), math.exp(fit.x[1]), fit.x[2] * 1e-6,
            [residuals("kernels: forward op kinds", ops, t),
             residuals("kernels: whole-step computation", whole, measured)])


def _kernels(program: Program) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs and bytes of every compute-stream kernel of the Program."""
    tasks = kernel_tasks(program.tasks)
    return (np.array([getattr(t, "flops", 0.0) for t in tasks], dtype=float),
            np.array([t.bytes for t in tasks], dtype=float))


def predicted_computation(program: Program, profile: Profile) -> float:
    """The Program's kernel seconds per step (one rank)."""
    return sum(profile.compute_time(t) for t in kernel_tasks(program.tasks))


def main(argv=None) -> int:
    ap = Parser(prog="python -m calibration.from_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", metavar="TRACE=STRATEGY[@MODEL]",
                    help="a PyTorch-profiler trace (.json or .json.gz) and the strategy it ran: "
                         "ddp, expert, megatron, a plan file, or 'traced' (read from the trace); "
                         "@NAME:SIZE names its model where it is not --model's")
    ap.add_argument("--model", default=None,
                    help="the zoo model the traces ran, NAME:SIZE (needed unless every trace "
                         "names its own)")
    ap.add_argument("--gpus", type=int, required=True, help="ranks of the traced job")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="ranks per machine (default: --gpus, one machine)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    ap.add_argument("--base", default=None, metavar="NAME|PATH",
                    help="a profile whose figures are kept where the traces give none")
    ap.add_argument("--links-only", action="store_true",
                    help="fit only the collectives; keep --base's device figures (FLOP/s, memory "
                         "bandwidth, overhead)")
    ap.add_argument("--host-mode", choices=HOST_MODES, default=None,
                    help="also fit the host's seconds per task from the traces' host busy time "
                         "(hidup.planning.costs's host figures), as this mode's: 'eager' for "
                         "traces of plain PyTorch steps (default: no host figures)")
    ap.add_argument("--profiler-overhead-us", type=float, default=0.0, metavar="US",
                    help="microseconds the profiler added per recorded host event, taken off the "
                         "host busy time (default: 0; the H100 traces: 2.94, see docs/simulator_accuracy.md)")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                    help="the optimizer whose update the traced steps ran, for traces that record "
                         "no optimizer step (a trace's own Optimizer.step#NAME range wins; "
                         "default: %(default)s)")
    ap.add_argument("--name", default=None, help="the profile's name (default: --out's stem)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except (TraceError, ProfileError, PlanError, FitError, ValueError) as exc:
        print(f"python -m calibration.from_trace: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    per_node = args.gpus_per_node or args.gpus
    if args.gpus < 1 or per_node < 1 or args.gpus % per_node:
        raise ValueError(f"--gpus {args.gpus} and --gpus-per-node {per_node}: both must be "
                         f"positive and --gpus a multiple of --gpus-per-node")
    if not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: folder {args.out.parent} does not exist; create it")
    if not args.profiler_overhead_us >= 0:
        raise ValueError(f"--profiler-overhead-us {args.profiler_overhead_us}: must be 0 or more")
    pairs = []
    for item in args.traces:
        path, sep, strategy = item.rpartition("=")
        strategy, at, model = strategy.partition("@")
        if not sep or not path or (at and not model):
            raise ValueError(f"{item!r}: give TRACE=STRATEGY or TRACE=STRATEGY@NAME:SIZE, e.g. "
                             f"ddp.json.gz=ddp")
        if not (model or args.model):
            raise ValueError(f"{item!r} names no model and --model is not given: add "
                             f"@NAME:SIZE or --model NAME:SIZE")
        pairs.append((Path(path), strategy, model or args.model))
    base = load_profile(args.base) if args.base else None
    if args.links_only and not base:
        raise ValueError("--links-only keeps the device figures of a --base profile; give --base")
    graphs: dict[str, tuple] = {}
    runs = []
    for i, (path, strategy, model) in enumerate(pairs, 1):
        print(f"[{i}/{len(pairs)}] {path} = {strategy} ({model})", file=sys.stderr, flush=True)
        if model not in graphs:
            spec = get_model(model, gpus=args.gpus)
            batch = args.batch or spec.batch
            graphs[model] = spec.name, batch, capture_model(spec, batch)
        name_, batch, graph = graphs[model]
        runs.append(read_run(path, strategy, graph, name_, args.gpus,
                             args.profiler_overhead_us * 1e-6, args.optimizer))
    models_ = ", ".join(f"{n} (batch {b})" for n, b, _ in graphs.values())
    name = args.name or args.out.name.removesuffix(".json")
    profile, report = fit_profile(runs, name, per_node, base, args.gpus, args.links_only)
    traces = ", ".join(f"{r.path.name} ({r.strategy})" for r in runs)
    source = (f"Fitted by calibration.from_trace from PyTorch-profiler traces {traces} of "
              f"{models_} on {args.gpus} GPUs, {per_node} per machine: kernel "
              f"times per forward op kind against the Program's FLOPs and bytes, collective "
              f"kernel times against the Program's collectives' bytes"
              + (f"; other figures from {base.name}" if base else "")
              + (" (device figures too: --links-only)" if args.links_only else "") + ".")
    if args.host_mode:
        per_task = statistics.fmean(r.host / issued_tasks(r.program) for r in runs)
        profile = replace(profile, host={args.host_mode: per_task})
        source += (f" Host: {per_task * 1e6:.3g} us per task ({args.host_mode}), the traces' "
                   f"host busy time per step (less {args.profiler_overhead_us:g} us per recorded "
                   f"event, the profiler's) over the Program's tasks.")
    provenance = {"traces": [str(r.path) for r in runs], "strategies": [r.strategy for r in runs],
                  "models": [r.model for r in runs], "batch": sorted({b for _, b, _ in
                                                                       graphs.values()}),
                  "gpus": args.gpus,
                  "gpus_per_node": per_node, "base": base.name if base else None,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "host": platform.node(), "command": "python -m calibration.from_trace "
                  + " ".join(sys.argv[1:])}
    profile = replace(profile, source=source, provenance=provenance)
    for run in runs:
        print(f"{run.path}: " + "; ".join(run.notes))
    print(f"fitted: {profile}")
    if profile.inter_node:
        print("inter-node: " + ", ".join(f"{k} {c}" for k, c in profile.inter_node.items()))
    for res in report:
        print(f"  residuals {res}")
    for run in runs:
        predicted = predicted_computation(run.program, profile)
        print(f"  check: {run.path.name}: predicted kernel time {predicted * 1e3:.1f} ms, traced "
              f"{run.computation * 1e3:.1f} ms ({predicted / run.computation - 1:+.1%} off)"
              + (f"; host {run.host * 1e3:.1f} ms per step, {issued_tasks(run.program)} tasks"
                 if args.host_mode else ""))
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(profile.to_json())
    load_profile(tmp)  # what was written reads back
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
