"""Simulator speed: wall time to simulate one step of bert-sgmoe with 24 layers at 8 to 1024 GPUs,
with and without Duplex, and the events per second: `python -m experiments.bench_simulator`.
Targets: <= 0.1 s at 64 GPUs, <= 1 s at 1024 GPUs. `wall s` times simulate() on the lowered
Program; `lower s` is the lowering before it, shown apart."""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

from experiments import outputs
from hidup.cli import Parser
from hidup.models import capture_model, get_model
from hidup.planning.profile_file import load_profile
from hidup.strategy import fixed_strategy
from hidup.program import lower
from simulator.engine import simulate

log = logging.getLogger(__name__)
TARGETS = {64: 0.1, 1024: 1.0}


def parse_args(argv=None):
    ap = Parser(prog="python -m experiments.bench_simulator", description=__doc__)
    ap.add_argument("--model", default="bert-sgmoe:paper", help="model NAME:SIZE")
    ap.add_argument("--layers", type=int, default=24, help="layers of the model")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024], help="world sizes")
    ap.add_argument("--strategy", default="ddp", help="fixed strategy to simulate")
    ap.add_argument("--cluster", default="v100-1x4-nvlink", help="profile name or path")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    ap.add_argument("--out", type=Path, default=Path("out/bench_simulator"),
                    help="folder for the table (JSON) and the plot (PNG)")
    return ap.parse_args(argv)


def bench(args) -> list[dict]:
    profile = load_profile(args.cluster)
    rows = []
    for gpus in args.gpus:
        spec = get_model(args.model, gpus=gpus, layers=args.layers)
        graph = capture_model(spec, spec.batch)
        strategy = fixed_strategy(args.strategy, graph, gpus)
        for k in (1, 2):
            started = time.perf_counter()
            program = lower(graph, strategy, gpus, k, spec.name, optimizer="sgd")
            lowered = time.perf_counter() - started
            times, result = [], None
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = simulate(program, profile)
                times.append(time.perf_counter() - started)
            wall = statistics.median(times)
            rows.append({"gpus": gpus, "k": k, "tasks": len(program.tasks), "events": result.events,
                         "wall_s": wall, "events_per_s": result.events / wall,
                         "lower_s": lowered,
                         "step_ms": result.step_time * 1e3})
            log.info("%5d GPUs k=%d: %d tasks, %d events in %.3f s (%.0f events/s)", gpus, k,
                     len(program.tasks), result.events, wall, result.events / wall)
    return rows


def report(rows: list[dict]) -> list[str]:
    lines = [f"{'GPUs':>6}{'k':>3}{'tasks':>8}{'events':>9}{'wall s':>9}{'events/s':>11}"
             f"{'lower s':>9}{'target s':>10}"]
    for r in rows:
        target = TARGETS.get(r["gpus"])
        mark = "" if target is None else f"{target:g} {'met' if r['wall_s'] <= target else 'MISSED'}"
        lines.append(f"{r['gpus']:>6}{r['k']:>3}{r['tasks']:>8}{r['events']:>9}{r['wall_s']:>9.3f}"
                     f"{r['events_per_s']:>11.0f}{r['lower_s']:>9.3f}  {mark}")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    plt = outputs.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k in (1, 2):
        pts = [(r["gpus"], r["wall_s"]) for r in rows if r["k"] == k]
        ax.plot(*zip(*pts), marker="o", label=f"k={k}" + (" (Duplex)" if k == 2 else ""))
    for gpus, target in TARGETS.items():
        ax.scatter([gpus], [target], marker="_", s=300, color="red")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="seconds to simulate one step",
           title="bert-sgmoe, 24 layers (red: targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = bench(args)
    print("\n".join(report(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_simulator.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.out / "bench_simulator.png")
    print(f"wrote {args.out / 'bench_simulator.json'} and {args.out / 'bench_simulator.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
