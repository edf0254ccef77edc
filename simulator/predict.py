"""Predict one training step of a model on a cluster under a strategy, as plain SPMD (k=1) and with
Duplex (k micro-batches): `python -m simulator.predict --model gpt:small --gpus 4`."""
from __future__ import annotations

import argparse
import json
import logging
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hidup import models
from hidup.capture import Graph
from hidup.cli import Parser
from hidup.memory import MemoryReport, peak_memory
from hidup.models import capture_model
from hidup.profile import Profile, load_profile
from hidup.program import HOST_MODES, lower
from hidup.strategy import Strategy, resolve_strategy, save_plan
from simulator.engine import Result
from simulator.montecarlo import Interval, expected_step, step_time_interval
from simulator.trace import write_trace

log = logging.getLogger(__name__)
PROG = "python -m simulator.predict"
COLUMNS = ("step (ms)", "computation (ms)", "communication (ms)", "overlap", "exposed comm (ms)",
           "peak mem (MiB)")


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

    @property
    def speedup(self) -> float:
        return self.spmd.step_time / self.duplex.step_time if self.duplex.step_time else 1.0

    def rows(self) -> list[tuple[str, Result, MemoryReport]]:
        return [("SPMD (k=1)", self.spmd, self.memory[0]),
                (f"Duplex (k={self.k})", self.duplex, self.memory[1])]

    def to_dict(self) -> dict:
        return {"model": self.model, "batch": self.batch, "cluster": self.profile.name,
                "gpus": self.gpus, "strategy": self.strategy.name, "micro_batches": self.k,
                "mode": self.mode,
                "spmd": _result_dict(self.spmd, 1, self.memory[0]),
                "duplex": _result_dict(self.duplex, self.k, self.memory[1]),
                "speedup": self.speedup,
                "monte_carlo": None if self.intervals is None else
                {name: {"mean_ms": i.mean * 1e3, "low_ms": i.low * 1e3, "high_ms": i.high * 1e3,
                        "level": i.level, "samples": i.samples}
                 for name, i in zip(("spmd", "duplex"), self.intervals)},
                "plan": {"options": {n: str(o) for n, o in self.strategy.options.items()},
                         "placements": {n: str(p) for n, p in self.strategy.placements.items()}}}

    def __str__(self) -> str:
        head = (f"model {self.model} (batch {self.batch}), cluster {self.profile.name}, "
                f"{self.gpus} GPUs, strategy {self.strategy.name}")
        if self.profile.host is not None:
            head += (f", executor mode {self.mode} ({self.profile.host[self.mode] * 1e6:.3g} us "
                     f"of host time per task)")
        noise = [] if self.intervals is None else [
            f"Monte-Carlo, profile figures perturbed: SPMD {self.intervals[0]}; "
            f"Duplex {self.intervals[1]}"]
        return "\n".join([head, "", *_table(self.rows()),
                          f"speedup of Duplex over SPMD: {self.speedup:.3f}x", *noise, "",
                          *_plan_lines(self.strategy)])


def _result_dict(r: Result, k: int, m: MemoryReport) -> dict:
    return {"k": k, "step_time_ms": r.step_time * 1e3, "computation_ms": r.computation * 1e3,
            "communication_ms": r.communication * 1e3, "overlap_ratio": r.overlap_ratio,
            "exposed_communication_ms": r.exposed_communication * 1e3,
            "peak_memory_bytes": m.peak, "memory": asdict(m)}


def _table(rows: list[tuple[str, Result, MemoryReport]]) -> list[str]:
    width = max(len(name) for name, _, _ in rows)
    lines = [" " * width + "".join(f"  {c:>{len(c)}}" for c in COLUMNS)]
    for name, r, m in rows:
        cells = (f"{r.step_time * 1e3:.4g}", f"{r.computation * 1e3:.4g}",
                 f"{r.communication * 1e3:.4g}", f"{r.overlap_ratio:.1%}",
                 f"{r.exposed_communication * 1e3:.4g}", f"{m.peak / 2**20:.4g}")
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


def predict(model: str, cluster: str, gpus: int, strategy: str, batch: int | None,
            k: int, samples: int = 0, noise: float = 0.1,
            bucket_mb: float = 25.0, mode: str = "graph") -> Prediction:
    """Capture, plan, lower for k=1 and for k micro-batches, and simulate both (the executor in
    `mode`: what the host costs where the profile has host figures)."""
    spec = models.get_model(model, gpus=gpus)
    profile = load_profile(cluster)
    batch = batch or spec.batch
    started = time.perf_counter()
    graph = capture_model(spec, batch)
    log.info("captured %s (batch %d): %d nodes in %.2f s", spec.name, batch, len(graph.nodes),
             time.perf_counter() - started)
    plan = resolve_strategy(strategy, graph, gpus)
    results, intervals, memory = [], [], []
    bucket = int(bucket_mb * 2 ** 20)
    for program in [lower(graph, plan, gpus, n, spec.name, bucket_bytes=bucket) for n in (1, k)]:
        started = time.perf_counter()
        results.append(expected_step(program, profile, mode=mode))  # simulate unless kernels vary
        log.info("simulated k=%d: %d tasks in %.3f s: %s", program.k, len(program.tasks),
                 time.perf_counter() - started, results[-1])
        memory.append(peak_memory(program))
        if samples:
            intervals.append(step_time_interval(program, profile, samples, noise, mode=mode))
    return Prediction(spec.name, batch, profile, gpus, plan, k, *results, graph, tuple(memory),
                      tuple(intervals) if samples else None, mode)


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
    p.add_argument("--model", metavar="NAME:SIZE", default="gpt:small",
                   help=f"model NAME:SIZE from the zoo, one of {models.names()} "
                        f"(default: %(default)s)")
    p.add_argument("--cluster", metavar="NAME|PATH", default="v100-1x4-nvlink",
                   help="a shipped profile name or the path of a profile JSON file "
                        "(default: %(default)s)")
    p.add_argument("--gpus", metavar="N", type=_positive, default=4,
                   help="world size (default: %(default)s)")
    p.add_argument("--strategy", metavar="NAME|PATH", default="megatron",
                   help="a fixed strategy (ddp, megatron) or the path of a plan file "
                        "(default: %(default)s)")
    p.add_argument("--batch", metavar="B", type=_positive, default=None,
                   help="global batch size (default: the model's own)")
    p.add_argument("--micro-batches", metavar="K", type=_positive, default=2,
                   help="Duplex micro-batches per rank, k (default: %(default)s)")
    p.add_argument("--mode", choices=HOST_MODES, default="graph",
                   help="executor mode to predict ('eager': plain PyTorch): its host time per "
                        "task, where the profile has host figures (GPU profiles; on a CPU cluster "
                        "the host runs the kernels and this changes nothing) "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.add_argument("--trace", metavar="PATH", type=Path, default=None,
                   help="write the Duplex run's simulated Chrome trace to this file (a track per "
                        "stream, and the host's where the profile has host figures)")
    p.add_argument("--bucket-mb", metavar="MB", type=float, default=25.0,
                   help="gradient bucket size for the replicated parameters' all-reduces, as "
                        "DDP's bucket_cap_mb; 0: one all-reduce per parameter, as the HiDup "
                        "prototype (default: %(default)s)")
    p.add_argument("--monte-carlo", metavar="N", type=int, default=0,
                   help="also simulate N times with perturbed profile figures and report a 95%% "
                        "interval of the step time (default: off)")
    p.add_argument("--noise", metavar="SIGMA", type=float, default=0.1,
                   help="spread of the log-normal perturbation for --monte-carlo "
                        "(default: %(default)s, about 10%%)")
    p.add_argument("--save-plan", metavar="PATH", type=Path, default=None,
                   help="write the strategy as a plan file (for hidup.train --strategy PATH)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log progress (-v) or every detail (-vv)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.bucket_mb >= 0:
        parser.error(f"--bucket-mb {args.bucket_mb}: must be 0 or more megabytes")
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        prediction = predict(args.model, args.cluster, args.gpus, args.strategy,
                             args.batch, args.micro_batches, args.monte_carlo, args.noise,
                             args.bucket_mb, args.mode)
    except ValueError as exc:
        parser.exit(2, f"{PROG}: error: {' '.join(str(exc).split())}\n")
    if args.trace is not None:
        try:
            write_trace(args.trace, prediction.duplex,
                        f"{prediction.strategy.name} k={prediction.k}")
        except OSError as exc:
            parser.exit(2, f"{PROG}: error: cannot write the trace to {args.trace} "
                           f"({exc.strerror or exc})\n")
    if args.save_plan is not None:
        try:
            save_plan(args.save_plan, prediction.graph, prediction.strategy, args.gpus,
                      prediction.model)
        except OSError as exc:
            parser.exit(2, f"{PROG}: error: cannot write the plan to {args.save_plan} "
                           f"({exc.strerror or exc})\n")
    print(json.dumps(prediction.to_dict(), indent=1) if args.json else prediction)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
