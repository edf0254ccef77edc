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
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hidup import models
from hidup.capture import Graph
from hidup.cli import Parser
from hidup.memory import MemoryReport, peak_memory
from hidup.models import capture_model
from hidup.profile import Profile, load_profile
from hidup.program import HOST_MODES, lower
from hidup.search import search
from hidup.strategy import (Strategy, describe, fixed_strategies, resolve_strategy, save_plan,
                            summarize)
from simulator.engine import Result
from simulator.montecarlo import Interval, expected_step, step_time_interval
from simulator.trace import write_trace

log = logging.getLogger(__name__)
PROG = "python -m simulator.predict"
SEARCH = "search"  # --strategy: HiDup's search beside the fixed strategies
COLUMNS = ("step (ms)", "computation (ms)", "communication (ms)", "overlap", "exposed comm (ms)",
           "peak mem (GiB)")


@dataclass(frozen=True)
class Prediction:
    """Both simulated runs of one model, cluster, world size and strategy."""

    model: str
    batch: int
    profile: Profile
    gpus: int
    strategy: Strategy
    k: int
    spmd: Result
    duplex: Result
    graph: Graph
    memory: tuple[MemoryReport, MemoryReport]  # peak memory per rank: SPMD, Duplex
    intervals: tuple[Interval, Interval] | None = None  # Monte-Carlo step times: SPMD, Duplex
    mode: str = "graph"  # the executor mode whose host cost was simulated (GPU profiles)
    show_plan: bool = False  # print every op's placements, not the summary

    @property
    def speedup(self) -> float:
        return self.spmd.step_time / self.duplex.step_time if self.duplex.step_time else 1.0

    def runs(self) -> list[tuple[int, Result, MemoryReport]]:
        """(micro-batches, simulated step, memory) of SPMD and of Duplex."""
        return [(1, self.spmd, self.memory[0]), (self.k, self.duplex, self.memory[1])]

    def fits(self, memory: MemoryReport) -> bool:
        return self.profile.fits(memory.peak) is not False

    def best(self) -> tuple[int, Result] | None:
        """The faster of SPMD and Duplex among those that fit a device; None if neither does."""
        fitting = [(k, r) for k, r, m in self.runs() if self.fits(m)]
        return min(fitting, key=lambda kr: kr[1].step_time) if fitting else None

    def rows(self) -> list[tuple[str, Result, MemoryReport]]:
        return [("SPMD (k=1)", self.spmd, self.memory[0]),
                (f"Duplex (k={self.k})", self.duplex, self.memory[1])]

    def to_dict(self) -> dict:
        return {"model": self.model, "batch": self.batch, "cluster": self.profile.name,
                "gpus": self.gpus, "strategy": self.strategy.name, "micro_batches": self.k,
                "mode": self.mode, "notes": list(self.strategy.notes),
                "device_memory_bytes": self.profile.device_memory,
                "spmd": _result_dict(self.spmd, 1, self.memory[0], self.profile),
                "duplex": _result_dict(self.duplex, self.k, self.memory[1], self.profile),
                "speedup": self.speedup,
                "monte_carlo": None if self.intervals is None else
                {name: {"mean_ms": i.mean * 1e3, "low_ms": i.low * 1e3, "high_ms": i.high * 1e3,
                        "level": i.level, "samples": i.samples}
                 for name, i in zip(("spmd", "duplex"), self.intervals)},
                "plan": {"summary": summarize(self.graph, self.strategy),
                         "options": {n: str(o) for n, o in self.strategy.options.items()},
                         "placements": {n: str(p) for n, p in self.strategy.placements.items()}}}

    def __str__(self) -> str:
        head = f"{_setting(self.model, self.batch, self.profile, self.gpus)}, " \
               f"strategy {self.strategy.name}"
        if self.profile.host is not None:
            head += (f", executor mode {self.mode} ({self.profile.host[self.mode] * 1e6:.3g} us "
                     f"of host time per task)")
        noise = [] if self.intervals is None else [
            f"Monte-Carlo, profile figures perturbed: SPMD {self.intervals[0]}; "
            f"Duplex {self.intervals[1]}"]
        return "\n".join([head, *_notes(self.strategy), "", *_table(self.rows()),
                          f"speedup of Duplex over SPMD: {self.speedup:.3f}x",
                          *self._memory_lines(), *noise, "", *self.plan_lines()])

    def _memory_lines(self) -> list[str]:
        limit = self.profile.device_memory
        over = [f"{name} needs {m.peak / 2**30:.3g} GiB per rank" for name, _, m in self.rows()
                if not self.fits(m)]
        if not over:
            return []
        return [f"does not fit a device's {limit / 2**30:.3g} GiB: {' and '.join(over)}; choose "
                f"more GPUs, a smaller batch, or a strategy that splits the weights"]

    def plan_lines(self) -> list[str]:
        if self.show_plan:
            return _plan_lines(self.strategy)
        return [f"plan {self.strategy.name}: {describe(self.graph, self.strategy)} "
                f"(every op's placements: --show-plan)"]


@dataclass(frozen=True)
class Comparison:
    """HiDup's searched plan and the fixed strategies, each predicted with and without Duplex,
    and the one to run: the fastest that fits a device."""

    predictions: tuple[Prediction, ...]  # the searched plan first (where the search found one)
    chosen: int  # index into predictions
    chosen_k: int
    search_seconds: float
    search_note: str = ""  # why there is no searched plan, where there is none

    def __str__(self) -> str:
        first = self.predictions[0]
        k = first.k
        lines = [_setting(first.model, first.batch, first.profile, first.gpus), ""]
        if self.search_note:
            lines += [self.search_note, ""]
        head = ("plan", "SPMD k=1 (ms)", f"Duplex k={k} (ms)", "Duplex gain", "peak mem (GiB)")
        width = max(len(head[0]), *(len(p.strategy.name) for p in self.predictions))
        lines.append(f"{head[0]:<{width}}" + "".join(f"  {h}" for h in head[1:]))
        for i, p in enumerate(self.predictions):
            mem = max(m.peak for _, _, m in p.runs()) / 2**30
            cells = [_ms(p, 0), _ms(p, 1), f"{p.speedup:.3f}x", f"{mem:.3g}"]
            mark = "  <- chosen" if i == self.chosen else ""
            lines.append(f"{p.strategy.name:<{width}}" + "".join(
                f"  {c:>{len(h)}}" for c, h in zip(cells, head[1:])) + mark)
        lines += ["(*: does not fit a device's memory)", "", self.why(), ""]
        chosen = self.predictions[self.chosen]
        lines += [f"{chosen.strategy.name}, simulated:", *_table(chosen.rows()),
                  *_notes(chosen.strategy), "", *chosen.plan_lines()]
        return "\n".join(lines)

    def why(self) -> str:
        """One line: what was chosen and why, against the best other plan."""
        chosen = self.predictions[self.chosen]
        k, result = chosen.best()
        duplex = f"with Duplex (k={k})" if k > 1 else "without Duplex"
        line = (f"chose {chosen.strategy.name} {duplex}: {result.step_time * 1e3:.4g} ms a step; "
                f"{describe(chosen.graph, chosen.strategy)}")
        others = [(p, p.best()) for i, p in enumerate(self.predictions) if i != self.chosen]
        others = [(p, b) for p, b in others if b is not None]
        if others:
            rival, (rk, rr) = min(others, key=lambda pb: pb[1][1].step_time)
            line += (f"; {rr.step_time / result.step_time:.3f}x faster than the next best, "
                     f"{rival.strategy.name} {'with Duplex' if rk > 1 else 'without Duplex'} "
                     f"({rr.step_time * 1e3:.4g} ms)")
        spmd, duplex_run = chosen.spmd, chosen.duplex
        if k > 1:
            line += (f"; Duplex hides {duplex_run.overlap_ratio:.0%} of its communication behind "
                     f"computation (SPMD {spmd.overlap_ratio:.0%})")
        elif chosen.fits(chosen.memory[1]):
            line += (f"; Duplex would take {duplex_run.step_time * 1e3:.4g} ms: its extra "
                     f"kernels cost more than the communication it hides")
        return line

    def to_dict(self) -> dict:
        chosen = self.predictions[self.chosen]
        return {"model": chosen.model, "batch": chosen.batch, "cluster": chosen.profile.name,
                "gpus": chosen.gpus, "micro_batches": chosen.k,
                "device_memory_bytes": chosen.profile.device_memory,
                "chosen": {"strategy": chosen.strategy.name, "k": self.chosen_k,
                           "why": self.why()},
                "search_seconds": self.search_seconds, "search_note": self.search_note or None,
                "plans": [p.to_dict() for p in self.predictions]}


def _ms(p: Prediction, i: int) -> str:
    _, result, memory = p.runs()[i]
    return f"{result.step_time * 1e3:.4g}" + ("" if p.fits(memory) else "*")


def _setting(model: str, batch: int, profile: Profile, gpus: int) -> str:
    machines, per = -(-gpus // profile.gpus_per_node), min(gpus, profile.gpus_per_node)
    where = f"{machines} machine{'s' if machines > 1 else ''} of {per}"
    memory = "" if profile.device_memory is None else \
        f", {profile.device_memory / 2**30:.3g} GiB each"
    return f"model {model} (batch {batch}), cluster {profile.name}: {gpus} GPUs, {where}{memory}"


def _notes(strategy: Strategy) -> list[str]:
    return [f"note: {note}" for note in strategy.notes]


def _result_dict(r: Result, k: int, m: MemoryReport, profile: Profile) -> dict:
    return {"k": k, "step_time_ms": r.step_time * 1e3, "computation_ms": r.computation * 1e3,
            "communication_ms": r.communication * 1e3, "overlap_ratio": r.overlap_ratio,
            "exposed_communication_ms": r.exposed_communication * 1e3,
            "peak_memory_bytes": m.peak, "fits": profile.fits(m.peak), "memory": asdict(m)}


def _table(rows: list[tuple[str, Result, MemoryReport]]) -> list[str]:
    width = max(len(name) for name, _, _ in rows)
    lines = [" " * width + "".join(f"  {c:>{len(c)}}" for c in COLUMNS)]
    for name, r, m in rows:
        cells = (f"{r.step_time * 1e3:.4g}", f"{r.computation * 1e3:.4g}",
                 f"{r.communication * 1e3:.4g}", f"{r.overlap_ratio:.1%}",
                 f"{r.exposed_communication * 1e3:.4g}", f"{m.peak / 2**30:.3g}")
        row = "".join(f"  {v:>{len(c)}}" for v, c in zip(cells, COLUMNS))
        lines.append(f"{name:<{width}}{row}")
    return lines


def _plan_lines(strategy: Strategy) -> list[str]:
    """One line per op node, then the parameter and input placements grouped by placement."""
    lines = [f"plan {strategy.name}: op (input placements) -> output placement"]
    lines += [f"  {name}: {option}" for name, option in strategy.options.items()]
    groups: dict[str, list[str]] = {}
    for name, p in strategy.placements.items():
        groups.setdefault(str(p), []).append(name)
    lines.append("placements of parameters, buffers and inputs:")
    for p, names in sorted(groups.items()):
        lines.append(textwrap.fill(", ".join(names), width=100, break_on_hyphens=False,
                                   initial_indent=f"  {p} ({len(names)}): ",
                                   subsequent_indent="      "))
    return lines


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


def _simulate(spec, profile: Profile, batch: int, graph: Graph, plan: Strategy, gpus: int, k: int,
              samples: int = 0, noise: float = 0.1, bucket_mb: float = 25.0,
              mode: str = "graph", show_plan: bool = False) -> Prediction:
    """Lower `plan` for k=1 and for k micro-batches and simulate both."""
    results, intervals, memory = [], [], []
    bucket = int(bucket_mb * 2 ** 20)
    for program in [lower(graph, plan, gpus, n, spec.name, bucket_bytes=bucket) for n in (1, k)]:
        started = time.perf_counter()
        results.append(expected_step(program, profile, mode=mode))  # simulate unless kernels vary
        log.info("%s k=%d: %d tasks simulated in %.3f s: %s", plan.name, program.k,
                 len(program.tasks), time.perf_counter() - started, results[-1])
        memory.append(peak_memory(program))
        if samples:
            intervals.append(step_time_interval(program, profile, samples, noise, mode=mode))
    return Prediction(spec.name, batch, profile, gpus, plan, k, *results, graph, tuple(memory),
                      tuple(intervals) if samples else None, mode, show_plan)


def predict(model: str, cluster: str, gpus: int, strategy: str, batch: int | None,
            k: int, samples: int = 0, noise: float = 0.1,
            bucket_mb: float = 25.0, mode: str = "graph", show_plan: bool = False) -> Prediction:
    """Capture, plan, lower for k=1 and for k micro-batches, and simulate both (the executor in
    `mode`: what the host costs where the profile has host figures)."""
    spec, profile, batch, graph = _setup(model, cluster, gpus, batch)
    plan = resolve_strategy(strategy, graph, gpus, profile.name)
    return _simulate(spec, profile, batch, graph, plan, gpus, k, samples, noise, bucket_mb, mode,
                     show_plan)


def compare(model: str, cluster: str, gpus: int, batch: int | None, k: int, samples: int = 0,
            noise: float = 0.1, bucket_mb: float = 25.0, mode: str = "graph",
            show_plan: bool = False) -> Comparison:
    """HiDup's Duplex-aware search (within a device's memory) and every fixed strategy that
    applies, each simulated with and without Duplex; the fastest that fits is chosen."""
    spec, profile, batch, graph = _setup(model, cluster, gpus, batch)
    plans, note, seconds = [], "", 0.0
    try:
        found = search(graph, gpus, profile, k, profile.device_memory)
        seconds = found.seconds
        plans.append(replace(found.strategy, name="hidup"))
        log.info("searched in %.2f s (%d labels)", found.seconds, found.states)
    except ValueError as exc:
        note = f"no searched plan: {exc}"
    plans += fixed_strategies(graph, gpus).values()
    if not plans:
        raise ValueError(f"no strategy applies to {spec.name} on {gpus} GPUs ({note}); try "
                         f"another GPU count")
    predictions = [_simulate(spec, profile, batch, graph, p, gpus, k, 0, noise, bucket_mb, mode,
                             show_plan) for p in plans]
    fitting = [(p.best()[1].step_time, i, p.best()[0]) for i, p in enumerate(predictions)
               if p.best() is not None]
    if not fitting:
        peak = min(max(m.peak for _, _, m in p.runs()) for p in predictions)
        raise ValueError(f"no plan fits a device's {profile.device_memory / 2**30:.3g} GiB: the "
                         f"smallest needs {peak / 2**30:.3g} GiB per rank; use more GPUs or a "
                         f"smaller --batch")
    _, chosen, chosen_k = min(fitting)
    if samples:  # the interval of the chosen plan only: every plan's would take long
        predictions[chosen] = _simulate(spec, profile, batch, graph, plans[chosen], gpus, k,
                                        samples, noise, bucket_mb, mode, show_plan)
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
               args.mode, args.show_plan)
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
            save_plan(args.save_plan, shown.graph, shown.strategy, args.gpus, shown.model,
                      shown.profile.name)
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
