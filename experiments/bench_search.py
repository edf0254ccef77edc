"""Search time of the Duplex-aware planner: bert-sgmoe with 2 to 48 layers on 4 to 1024 GPUs, as a
table and a plot: `python -m experiments.bench_search`. Targets: <= 1 s for 8 layers at 64 GPUs,
<= 10 s for 48 layers, growing linearly in layers and flat in GPUs. The time is hidup.search's:
the dynamic programme plus lowering and estimating its best plans (capture is not counted)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hidup.models import capture_model, get_model
from hidup.profile import load_profile
from hidup.search import search

log = logging.getLogger(__name__)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_search", description=__doc__)
    ap.add_argument("--model", default="bert-sgmoe:paper", help="model NAME:SIZE")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16, 32, 48], help="layer counts")
    ap.add_argument("--gpus", type=int, nargs="+", default=[4, 64, 1024], help="world sizes")
    ap.add_argument("--cluster", default="v100-8x8-10gbps", help="profile name or path")
    ap.add_argument("--out", type=Path, default=Path("out/bench_search"),
                    help="folder for the table (JSON) and the plot (PNG)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    profile = load_profile(args.cluster)
    rows = []
    for layers in args.layers:
        for gpus in args.gpus:
            spec = get_model(args.model, gpus=gpus, layers=layers)
            graph = capture_model(spec, spec.batch)
            result = search(graph, gpus, profile, k=2)
            rows.append({"layers": layers, "gpus": gpus, "nodes": len(graph.ops),
                         "seconds": result.seconds, "labels": result.states,
                         "step_ms": result.estimate.step_time * 1e3})
            log.info("%2d layers %5d GPUs: %4d ops, %.2f s, %d labels", layers, gpus,
                     len(graph.ops), result.seconds, result.states)
    lines = [f"{'layers':>7}{'GPUs':>7}{'ops':>6}{'search s':>10}{'labels':>9}{'step ms':>10}"]
    lines += [f"{r['layers']:>7}{r['gpus']:>7}{r['nodes']:>6}{r['seconds']:>10.2f}{r['labels']:>9}"
              f"{r['step_ms']:>10.1f}" for r in rows]
    print("\n".join(lines))
    for (layers, gpus, limit) in ((8, 64, 1.0), (48, None, 10.0)):
        hits = [r for r in rows if r["layers"] == layers and (gpus is None or r["gpus"] == gpus)]
        if hits:
            worst = max(r["seconds"] for r in hits)
            where = f"{layers} layers" + (f" at {gpus} GPUs" if gpus else "")
            print(f"target <= {limit:g} s for {where}: {worst:.2f} s, "
                  f"{'met' if worst <= limit else 'MISSED'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_search.json").write_text(json.dumps(rows, indent=1) + "\n")
    _plot(rows, args.out / "bench_search.png")
    print(f"wrote {args.out / 'bench_search.json'} and {args.out / 'bench_search.png'}")
    return 0


def _plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for gpus in sorted({r["gpus"] for r in rows}):
        pts = [(r["layers"], r["seconds"]) for r in rows if r["gpus"] == gpus]
        ax.plot(*zip(*pts), marker="o", label=f"{gpus} GPUs")
    ax.axhline(10, color="red", lw=0.8, ls="--")
    ax.scatter([8], [1.0], marker="_", s=300, color="red")
    ax.set(xlabel="layers", ylabel="search time (s)", title="bert-sgmoe search time (red: targets)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
