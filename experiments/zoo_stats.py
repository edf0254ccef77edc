"""Node counts and capture / annotate times of every zoo model: `python -m experiments.zoo_stats`."""
from __future__ import annotations

import sys
import time

from hidup.cli import Parser
from hidup.graph import ops
from hidup.models import capture_model, get_model, names


def main(argv=None) -> int:
    ap = Parser(prog="python -m experiments.zoo_stats", description=__doc__)
    ap.add_argument("--size", default="paper", help="size preset to measure (tiny, paper, ...)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs the models are made for (experts)")
    args = ap.parse_args(argv)
    print(f"{'model':<22}{'nodes':>7}{'ops':>6}{'options':>9}{'capture s':>11}{'annotate s':>12}")
    for name in names():
        if not name.endswith(f":{args.size}"):
            continue
        spec = get_model(name, gpus=args.gpus)
        started = time.perf_counter()
        graph = capture_model(spec, spec.batch)
        captured = time.perf_counter()
        n_options = sum(len(ops.options(n, n.in_metas(graph))) for n in graph.ops)
        done = time.perf_counter()
        print(f"{name:<22}{len(graph.nodes):>7}{len(graph.ops):>6}{n_options:>9}"
              f"{captured - started:>11.2f}{done - captured:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
