"""The paper's figures and tables (experiments.paper), computed on the simulator: the systems
compared (HiDup's searched plan with Duplex, the expert strategies, ddp) and one function per
figure, each returning its table as a Figure; FIGURES names them for the command."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from calibration.derive import parse_rate, with_inter_link
from hidup.cli import number
from hidup.models import capture_model, get_model
from hidup.planning.planfile import save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.program import LoweringError, lower
from hidup.runtime.data import build_vocabulary
from hidup.strategy import Mesh, fixed_strategies
from simulator.engine import simulate
from simulator.montecarlo import scale_times

OPTIMIZER = "sgd"  # the update these figures price: SGD's, one pass over the parameters
# the strategies the paper compared HiDup with (fsdp is compared in simulator.predict and
# hidup.planner, not in the paper's figures)
PAPER = ("ddp", "megatron", "expert", "dp-megatron", "dp-expert")


def paper_baselines(graph, gpus: int, machines: int = 1) -> dict:
    """The fixed strategies of the paper's comparison that apply (on a mesh of `machines`)."""
    return {name: s for name, s in fixed_strategies(
        graph, gpus, Mesh.of_machines(machines, gpus // machines)).items() if name in PAPER}

log = logging.getLogger(__name__)
MEMORY = 32 * 2 ** 30  # a V100's memory: the search keeps plans that fit
CONVERGENCE_BATCH = 32  # sequences per step, both ranks together


@dataclass
class Figure:
    """A figure's table (columns, rows of values) and how to draw it."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)
        log.info("%s: %s", self.name, ", ".join(f"{k} {cell(v)}" for k, v in row.items()))


def cell(v) -> str:
    """A table's cell: a float to 4 significant digits, written out in full above 9999."""
    return number(v) if isinstance(v, float) else str(v)


# -- the systems ---------------------------------------------------------------------------------

def graph_of(model: str, gpus: int, **overrides):
    spec = get_model(model, gpus=gpus, **overrides)
    return capture_model(spec, spec.batch)


def run(graph, strategy, gpus: int, k: int, profile):
    """The simulated step of a strategy with k micro-batches; None if it cannot be lowered."""
    try:
        return simulate(lower(graph, strategy, gpus, k, optimizer=OPTIMIZER), profile)
    except (LoweringError, ValueError) as exc:
        log.info("%s k=%d on %d GPUs: %s", strategy.name, k, gpus, exc)
        return None


def hidup(graph, gpus: int, profile, k: int = 2, machines: int = 1, exact: float = 0.0):
    """HiDup: the searched plan (the dynamic programme's best, priced for Duplex and for plain
    SPMD, and the expert strategies, ranked with Duplex and without; on a 2-D mesh of `machines`
    also the plans searched on it and its baselines; with `exact` seconds also the integer
    programme's proven k = 1 plan), Duplex where it pays; (simulated Result, search result)."""
    options = SearchOptions(k=k, memory=MEMORY, mesh=Mesh.of_machines(machines, gpus // machines),
                            exact=exact, optimizer=OPTIMIZER)
    found = search(graph, gpus, profile, options, baselines=paper_baselines(graph, gpus, machines))
    return run(graph, found.strategy, gpus, found.k, profile), found


def on_mesh(candidate: str) -> bool:
    """A ranked plan on a 2-D mesh: searched there ('search-2d#0 k=2'), on it turned around
    ('search-2dt#0 k=2') or a dp- baseline."""
    return "-2d#" in candidate or "-2dt#" in candidate or candidate.startswith("dp-")


def best_estimates(found) -> tuple[float, float]:
    """(best 1-D, best 2-D) estimated step time (ms) among a search's ranked plans."""
    best = [min((t * 1e3 for name, t in found.candidates if on_mesh(name) == two_d),
                default=math.nan) for two_d in (False, True)]
    return best[0], best[1]


def systems(graph, gpus: int, profile, names=("expert", "ddp"), machines: int = 1,
            exact: float = 0.0) -> tuple[dict, object]:
    """({system: simulated Result or None}, HiDup's search result): HiDup (searched on a mesh of
    `machines` and over all GPUs) and the named baselines (one micro-batch each)."""
    result, found = hidup(graph, gpus, profile, machines=machines, exact=exact)
    out = {"hidup": result}
    fixed = paper_baselines(graph, gpus)
    for name in names:
        out[name] = run(graph, fixed[name], gpus, 1, profile) if name in fixed else None
    return out, found


def ms(result) -> float:
    return result.step_time * 1e3 if result is not None else math.nan


def best_baseline(got: dict) -> float:
    """The fastest baseline's step time (ms) of a systems() result."""
    return min((ms(r) for name, r in got.items() if name != "hidup" and r is not None),
               default=math.nan)


def two_machines(rate_gbit: float | None = None):
    """2 machines x 4 GPUs (v100-2x4), the link at `rate_gbit` Gbit/s (None: as measured)."""
    base = load_profile("v100-2x4")
    if rate_gbit is None:
        return base
    return with_inter_link(base, parse_rate(f"{rate_gbit}gbit"), name=f"v100-2x4-{rate_gbit:g}gbit")


# -- the figures ---------------------------------------------------------------------------------

def scaling(args) -> Figure:
    fig = Figure("scaling", "Per-step time, 8 machines x 8 V100, 9.71 Gbit/s (paper Fig. 7)",
                 ["model", "gpus", "hidup_ms", "expert_ms", "speedup", "plan", "best_1d_ms",
                  "best_2d_ms", "gain_2d"])
    profile = load_profile("v100-8x8-10gbps")
    for model in args.models:
        for gpus in args.gpus or ([8, 16] if args.quick else [8, 16, 32, 64]):
            got, found = systems(graph_of(model, gpus), gpus, profile, ("expert",),
                                 profile.mesh(gpus)[0], args.exact)
            flat, mesh = best_estimates(found)
            fig.add(model=model, gpus=gpus, hidup_ms=ms(got["hidup"]), expert_ms=ms(got["expert"]),
                    speedup=ms(got["expert"]) / ms(got["hidup"]), plan=found.candidates[0][0],
                    best_1d_ms=flat, best_2d_ms=mesh, gain_2d=flat / mesh)
    return fig


def one_machine(args) -> Figure:
    fig = Figure("one-machine", "Per-step time on one machine of 8 V100 (paper Fig. 8)",
                 ["model", "gpus", "hidup_ms", "expert_ms", "ddp_ms", "plan"])
    profile = load_profile("v100-8x8-10gbps")
    for model in args.models:
        for gpus in args.gpus or ([1, 4] if args.quick else [1, 2, 4, 8]):
            got, found = systems(graph_of(model, gpus), gpus, profile, exact=args.exact)
            plan = found.candidates[0][0]
            fig.add(model=model, gpus=gpus, hidup_ms=ms(got["hidup"]), expert_ms=ms(got["expert"]),
                    ddp_ms=ms(got["ddp"]), plan=plan)
    return fig


def bandwidth(args) -> Figure:
    fig = Figure("bandwidth", "Per-step time, 2 machines x 4 V100, link rate swept (paper Fig. 9)",
                 ["model", "gbit", "hidup_ms", "expert_ms", "ddp_ms", "speedup", "plan"])
    rates = [1, 10, 100] if args.quick else [1, 2, 5, 10, 20, 50, 100]
    for model in args.models:
        graph = graph_of(model, 8)
        for rate in rates:
            got, found = systems(graph, 8, two_machines(rate), exact=args.exact)
            plan = found.candidates[0][0]
            best = best_baseline(got)
            fig.add(model=model, gbit=rate, hidup_ms=ms(got["hidup"]), expert_ms=ms(got["expert"]),
                    ddp_ms=ms(got["ddp"]), speedup=best / ms(got["hidup"]), plan=plan)
    return fig


def batch(args) -> Figure:
    fig = Figure("batch", "Per-step time, 2 machines x 4 V100, per-GPU batch swept (paper Fig. 10)",
                 ["model", "per_gpu_batch", "hidup_ms", "expert_ms", "ddp_ms", "speedup", "plan"])
    profile = two_machines()
    for model in args.models:
        for per_gpu in [2, 8] if args.quick else [8, 16, 32, 64]:
            got, found = systems(graph_of(model, 8, per_gpu=per_gpu), 8, profile)
            plan = found.candidates[0][0]
            best = best_baseline(got)
            fig.add(model=model, per_gpu_batch=per_gpu, hidup_ms=ms(got["hidup"]),
                    expert_ms=ms(got["expert"]), ddp_ms=ms(got["ddp"]),
                    speedup=best / ms(got["hidup"]), plan=plan)
    return fig


def breakdown(args) -> Figure:
    fig = Figure("breakdown", "Per-step time breakdown, rank 0 (paper Table III)",
                 ["model", "cluster", "system", "wall_s", "total_s", "computation_s",
                  "communication_s", "overlap_ratio"])
    clusters = [("one machine", load_profile("v100-8x8-10gbps")),
                ("two machines 100 Gbit/s", two_machines(100)),
                ("two machines 30 Gbit/s", two_machines(30))]
    for model in args.models[:1]:
        graph = graph_of(model, 8)
        for where, profile in clusters:
            for system, r in systems(graph, 8, profile)[0].items():
                if r is None:
                    continue
                fig.add(model=model, cluster=where, system=system, wall_s=r.step_time,
                        total_s=r.computation + r.communication, computation_s=r.computation,
                        communication_s=r.communication, overlap_ratio=r.overlap_ratio)
    return fig


def robustness(args) -> Figure:
    fig = Figure("robustness", "Plans searched with a wrong profile, simulated with the right one, "
                 "2 machines x 4 V100 (paper Table IV)",
                 ["model", "error", "draws", "mean_relative_time", "max_relative_time"])
    draws = 3 if args.quick else 10
    profile = two_machines()
    for model in args.models[:1]:
        graph = graph_of(model, 8)
        right = ms(hidup(graph, 8, profile)[0])

        def relative(wrong) -> float:
            found = hidup(graph, 8, wrong)[1]  # planned with the wrong figures
            return ms(run(graph, found.strategy, 8, found.k, profile)) / right

        rng = random.Random(0)
        for level in [0.2, 0.8] if args.quick else [0.1, 0.2, 0.5, 0.8]:
            rel = [relative(scale_times(profile, lambda _: rng.uniform(1 - level, 1 + level)))
                   for _ in range(draws)]
            fig.add(model=model, error=f"{level:.0%} random noise", draws=draws,
                    mean_relative_time=sum(rel) / len(rel), max_relative_time=max(rel))
        for comm in [-0.5, 1.0] if args.quick else [-0.5, -0.2, 0.2, 1.0]:
            rel = relative(scale_times(profile, lambda what: 1 + comm
                                       if what == "communication" else 1.0))
            fig.add(model=model, error=f"{comm:+.0%} communication", draws=1,
                    mean_relative_time=rel, max_relative_time=rel)
    return fig


def search_time(args) -> Figure:
    repeats = 1 if args.quick else 3
    fig = Figure("search-time", "Search time of bert-sgmoe (paper Fig. 12), the whole "
                 "hidup.planning.search call on v100-8x8-10gbps, on its machines x GPUs mesh "
                 f"(and over every GPU); the median of {repeats} searches, each on a freshly "
                 "captured graph", ["model", "layers", "gpus", "mesh", "ops", "seconds"])
    profile = load_profile("v100-8x8-10gbps")
    model = "bert-sgmoe:tiny" if args.quick else "bert-sgmoe:paper"
    for layers in args.layers or ([2, 4] if args.quick else [2, 8, 16, 32, 48]):
        for gpus in args.gpus or ([4, 16] if args.quick else [4, 16, 64, 256, 1024]):
            machines, per = profile.mesh(gpus)
            seconds = []
            for _ in range(repeats):  # this VM's speed drifts: one search is a noisy figure
                graph = graph_of(model, gpus, layers=layers)
                seconds.append(search(graph, gpus, profile, SearchOptions(
                    k=2, mesh=Mesh.of_machines(machines, per), optimizer=OPTIMIZER)).seconds)
            fig.add(model=model, layers=layers, gpus=gpus, mesh=f"{machines}x{per}",
                    ops=len(graph.ops), seconds=statistics.median(seconds))
    for layers, gpus, limit in ((8, 64, 1.0), (48, None, 10.0)):  # the planner's own targets
        hits = [r for r in fig.rows if r["layers"] == layers and gpus in (None, r["gpus"])]
        if hits:
            worst = max(r["seconds"] for r in hits)
            fig.notes.append(f"target <= {limit:g} s for {layers} layers"
                             f"{f' at {gpus} GPUs' if gpus else ''}: {worst:.2f} s, "
                             f"{'met' if worst <= limit else 'MISSED'}")
    return fig


def convergence(args) -> Figure:
    fig = Figure("convergence", "bert-sgmoe:tiny trained for real on WikiText-2, 2 ranks (gloo): "
                 f"searched plan with Duplex vs ddp, batch {CONVERGENCE_BATCH}, lr {args.lr:g}, "
                 "same seed and data order (paper Sec. VI.H)",
                 ["step", "hidup_loss", "ddp_loss", "difference"])
    model, ranks = "bert-sgmoe:tiny", 2
    if not args.data.is_file():
        raise ValueError(f"--data {args.data}: no such file; give a WikiText-format text file "
                         f"(e.g. shared/data/wikitext-2/valid.txt)")
    steps = args.steps or (20 if args.quick else 300)
    with tempfile.TemporaryDirectory() as tmp:
        spec = get_model(model, gpus=ranks, vocab=len(build_vocabulary(args.data)))
        graph = capture_model(spec, CONVERGENCE_BATCH)  # as hidup.train builds it for this data
        found = search(graph, ranks, load_profile("cpu-gloo-loopback"),
                       SearchOptions(k=2, optimizer=OPTIMIZER))
        plan = Path(tmp) / "plan.json"
        save_plan(plan, graph, found.strategy, ranks, model, "cpu-gloo-loopback")
        losses = {name: _train(model, strategy, k, ranks, steps, args)
                  for name, strategy, k in (("hidup", str(plan), 2), ("ddp", "ddp", 1))}
    for i, (a, b) in enumerate(zip(losses["hidup"], losses["ddp"])):
        fig.add(step=i + 1, hidup_loss=a, ddp_loss=b, difference=a - b)
    worst = max(abs(r["difference"]) for r in fig.rows)
    fig.notes.append(f"searched plan ({found.strategy.name}) run with 2 micro-batches; {steps} steps; "
                     f"largest |loss difference| {worst:.2e}; final loss {losses['hidup'][-1]:.4f} "
                     f"(HiDup) vs {losses['ddp'][-1]:.4f} (ddp), first {losses['ddp'][0]:.4f}")
    return fig


def _train(model: str, strategy: str, k: int, ranks: int, steps: int, args) -> list[float]:
    """Losses of `hidup.train` under torchrun on this machine (global batch CONVERGENCE_BATCH)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), "-m", "hidup.train", "--model", model,
           "--strategy", strategy, "--micro-batches", str(k), "--steps", str(steps),
           "--warmup", "0", "--data", str(args.data), "--optimizer", "sgd", "--lr", str(args.lr),
           "--batch", str(CONVERGENCE_BATCH), "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log.info("convergence: %s", " ".join(cmd[2:]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("hidup.train")]
        raise RuntimeError(f"hidup.train --strategy {strategy} failed: "
                           f"{said[-1] if said else done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["losses"]


FIGURES: dict[str, Callable[[argparse.Namespace], Figure]] = {
    "scaling": scaling, "one-machine": one_machine, "bandwidth": bandwidth, "batch": batch,
    "breakdown": breakdown, "robustness": robustness, "search-time": search_time,
    "convergence": convergence}
