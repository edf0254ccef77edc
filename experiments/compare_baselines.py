"""The searched plan against the expert strategies, simulated: `python -m experiments.compare_baselines`.
For each paper model and GPU count: HiDup (searched plan, Duplex) and every baseline as those
systems run (ddp, megatron, expert, min-comm: no Duplex), with the baselines given Duplex too."""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from experiments.paper_figures import paper_baselines
from hidup.cli import Parser
from hidup.models import capture_model, get_model
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.program import LoweringError, lower
from hidup.strategy import Mesh, describe
from simulator import simulate

OPTIMIZER = "sgd"  # the update these figures price: SGD's, one pass over the parameters

log = logging.getLogger(__name__)
MODELS = ("bert-sgmoe:paper", "bert-switch:paper", "vit-sgmoe:paper", "vit-switch:paper")


def parse_args(argv=None):
    ap = Parser(prog="python -m experiments.compare_baselines", description=__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="models NAME:SIZE")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64], help="world sizes")
    ap.add_argument("--cluster", default="v100-8x8-10gbps", help="profile name or path")
    ap.add_argument("--memory", type=float, default=32.0, help="device memory limit, GiB")
    ap.add_argument("--out", type=Path, default=Path("out/compare_baselines.json"),
                    help="also write the table as JSON here")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.memory) and args.memory > 0):
        ap.error(f"--memory {args.memory}: give the device memory in GiB, a positive finite "
                 f"number, e.g. 32")
    return args


def simulated_ms(graph, strategy, gpus, k, profile) -> float | None:
    try:
        return simulate(lower(graph, strategy, gpus, k, optimizer=OPTIMIZER),
                        profile).step_time * 1e3
    except (LoweringError, ValueError) as exc:
        log.info("%s k=%d: %s", strategy.name, k, exc)
        return None


def compare(model: str, gpus: int, profile, memory: float) -> dict:
    spec = get_model(model, gpus=gpus)
    graph = capture_model(spec, spec.batch)
    machines = profile.mesh(gpus)[0]  # a 2-D mesh where the GPUs fill whole machines
    baselines = paper_baselines(graph, gpus, machines)  # the paper's (fsdp: simulator.predict)
    baselines["min-comm"] = search(graph, gpus, profile, SearchOptions(k=1, memory=memory, objective="comm", optimizer=OPTIMIZER)).strategy
    found = search(graph, gpus, profile, SearchOptions(
        k=2, memory=memory, mesh=Mesh.of_machines(machines, gpus // machines),
        optimizer=OPTIMIZER), baselines=baselines)
    row = {"model": model, "gpus": gpus, "chosen": found.candidates[0][0],
           "hidup_ms": simulated_ms(graph, found.strategy, gpus, found.k, profile),
           "search_s": found.seconds, "dp_estimate_ms": found.dp_cost * 1e3,
           "description": describe(graph, found.strategy)}
    for name, strategy in baselines.items():
        row[name] = {"k1_ms": simulated_ms(graph, strategy, gpus, 1, profile),
                     "k2_ms": simulated_ms(graph, strategy, gpus, 2, profile)}
    return row


NAMES = ("ddp", "megatron", "expert", "min-comm", "dp-megatron", "dp-expert")


def table(rows) -> list[str]:
    """The rows as a Markdown table (what docs/paper_evaluation.md shows), then its legend."""
    lines = ["| model | GPUs | HiDup | " + " | ".join(NAMES) +
             " | speedup | vs +Duplex | DP err | chosen |", "|" + " --- |" * (len(NAMES) + 7)]
    for r in rows:
        plain = [r[n]["k1_ms"] for n in NAMES if r.get(n) and r[n]["k1_ms"]]
        duplexed = [r[n]["k2_ms"] for n in NAMES if r.get(n) and r[n]["k2_ms"]]
        cells = [f"{r[n]['k1_ms']:.1f}" if r.get(n) and r[n]["k1_ms"] else "-" for n in NAMES]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['hidup_ms']:.1f} | {' | '.join(cells)} "
                     f"| {min(plain) / r['hidup_ms']:.2f}× | {min(duplexed) / r['hidup_ms']:.2f}× "
                     f"| {r['dp_estimate_ms'] / r['hidup_ms'] - 1:+.1%} | {r['chosen']} |")
    lines += ["", "times: simulated step (ms); baselines as their systems run (k=1); speedup: the "
                  "best baseline over HiDup; vs +Duplex: the best baseline given Duplex (k=2); "
                  "DP err: the dynamic programme's own estimate of its plan against the "
                  "simulator; dp-: a 2-D mesh, data parallel across machines, the named strategy "
                  "inside"]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    profile = load_profile(args.cluster)
    rows = []
    for model in args.models:
        for gpus in args.gpus:
            rows.append(compare(model, gpus, profile, args.memory * 2**30))
            print(f"{model} {gpus} GPUs done", file=sys.stderr)
    print("\n".join(table(rows)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
