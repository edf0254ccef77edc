"""How far the search's dynamic programme is from the best plan of its own cost model:
`python -m experiments.search_exactness`. For each model, GPU count and mesh (all GPUs, and the
cluster's machines x GPUs where they fill whole machines), the programme priced for plain SPMD
(k = 1) with the given beam against the integer programme (hidup.planning.exact), which proves
its plan optimal for the same model; and the programme a search for Duplex runs (k = 2, each
plan priced with two micro-batches and with one): its best plan with one micro-batch against
the same optimum. Writes search_exactness.csv."""
from __future__ import annotations

import csv
import logging
import sys
import time
from pathlib import Path

from hidup.cli import Parser
from hidup.models import capture_model, get_model
from hidup.planning.exact import exact_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import Search, SearchOptions
from hidup.planning.search import programme
from hidup.strategy import Mesh
from experiments.outputs import default_out, note

OPTIMIZER = "sgd"  # the update these figures price: SGD's, one pass over the parameters

log = logging.getLogger(__name__)
MODELS = ("bert-sgmoe:paper", "bert-switch:paper", "gpt:paper")
COLUMNS = ["model", "gpus", "mesh", "beam_ms", "beam_s", "exact_ms", "bound_ms", "optimal",
           "exact_s", "gap", "duplex_ms", "duplex_gap"]


def parse_args(argv=None):
    ap = Parser(prog="python -m experiments.search_exactness", description=__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="models NAME:SIZE")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64], help="world sizes")
    ap.add_argument("--cluster", default="v100-8x8-10gbps", help="profile name or path")
    ap.add_argument("--memory", type=float, default=32.0, help="device memory limit, GiB")
    ap.add_argument("--beam", type=int, default=16, help="states the programme keeps per cut")
    ap.add_argument("--time-limit", type=float, default=300.0,
                    help="seconds the integer programme may take per case (then: its best plan "
                         "and a proven lower bound)")
    ap.add_argument("--out", type=Path, default=default_out("search_exactness"),
                    help="folder for search_exactness.csv")
    args = ap.parse_args(argv)
    if args.beam < 1 or not args.time_limit > 0 or not args.memory > 0:
        ap.error(f"--beam {args.beam}, --time-limit {args.time_limit}, --memory {args.memory}: "
                 f"each must be positive (defaults 16, 300 and 32)")
    return args


def compare(graph, gpus: int, machines: int, profile, memory: float, beam: int,
            time_limit: float) -> dict:
    mesh = Mesh.of_machines(machines, gpus // machines)
    dp = Search(graph, gpus, profile, SearchOptions(k=1, memory=memory, beam=beam, mesh=mesh,
                                                    dp=mesh and "machines", optimizer=OPTIMIZER))
    started = time.perf_counter()
    beam_cost = dp.run()[0].cost
    beam_s = time.perf_counter() - started
    exact = exact_plan(dp, time_limit=time_limit)
    duplex = programme(graph, gpus, profile, SearchOptions(
        k=2, memory=memory, beam=beam, mesh=mesh, dp=mesh and "machines", optimizer=OPTIMIZER))
    duplex_cost = min(label.plain for label in duplex.run())
    return {"beam_ms": beam_cost * 1e3, "beam_s": beam_s, "exact_ms": exact.cost * 1e3,
            "bound_ms": exact.bound * 1e3, "optimal": exact.optimal, "exact_s": exact.seconds,
            "gap": beam_cost / exact.cost - 1, "duplex_ms": duplex_cost * 1e3,
            "duplex_gap": duplex_cost / exact.cost - 1}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    profile = load_profile(args.cluster)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'model':<20}{'GPUs':>5}{'mesh':>7}{'beam ms':>11}{'exact ms':>11}{'gap':>8}"
          f"{'beam s':>8}{'exact s':>9}{'k=2 ms':>11}{'gap':>8}")
    for model in args.models:
        for gpus in args.gpus:
            spec = get_model(model, gpus=gpus)
            graph = capture_model(spec, spec.batch)
            for machines in sorted({1, profile.mesh(gpus)[0]}):
                row = {"model": model, "gpus": gpus, "mesh": f"{machines}x{gpus // machines}"}
                row.update(compare(graph, gpus, machines, profile, args.memory * 2**30,
                                   args.beam, args.time_limit))
                rows.append(row)
                proven = "" if row["optimal"] else f" (not proven: bound {row['bound_ms']:.1f})"
                print(f"{model:<20}{gpus:>5}{row['mesh']:>7}{row['beam_ms']:>11.1f}"
                      f"{row['exact_ms']:>11.1f}{row['gap']:>+8.1%}{row['beam_s']:>8.2f}"
                      f"{row['exact_s']:>9.1f}{row['duplex_ms']:>11.1f}{row['duplex_gap']:>+8.1%}"
                      f"{proven}", flush=True)
    with open(args.out / "search_exactness.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"the programme's cost (ms) of its cheapest plan, k = 1, beam {args.beam}, against the "
          f"integer programme's proven optimum; k=2: the Duplex search's programme, its best plan "
          f"with one micro-batch; wrote {args.out / 'search_exactness.csv'}")
    print(note(args.out, "search_exactness"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
