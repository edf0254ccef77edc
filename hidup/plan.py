"""Plan a model for a cluster: `python -m hidup.plan --model M --cluster C --gpus N [--out PLAN]`.
Searches the Duplex-aware strategy (hidup.search), prints its placements, its predicted step time
with and without Duplex beside the expert strategies (ddp, megatron, expert, min-comm), and the
search time; --out writes the plan file that hidup.train and simulator.predict accept."""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from hidup.cli import Parser
from hidup.estimate import estimate
from hidup.models import capture_model, get_model, names
from hidup.profile import load_profile
from hidup.program import LoweringError, lower
from hidup.search import search
from hidup.strategy import fixed_strategies, save_plan

log = logging.getLogger(__name__)
PROG = "python -m hidup.plan"
KEY_OPS = ("linear", "einsum", "embedding", "conv2d", "scaled_dot_product_attention", "loss")


def parse_args(argv=None):
    ap = Parser(prog=PROG, description=" ".join(__doc__.split()))
    ap.add_argument("--model", default="bert-sgmoe:paper", help=f"model NAME:SIZE, one of {names()}")
    ap.add_argument("--cluster", default="v100-8x8-10gbps", help="profile name or path")
    ap.add_argument("--gpus", type=int, default=8, help="world size")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    ap.add_argument("--micro-batches", type=int, default=2, help="Duplex micro-batches k")
    ap.add_argument("--memory", type=float, default=32.0, help="device memory limit, GiB")
    ap.add_argument("--beam", type=int, default=16, help="states kept per cut of the search")
    ap.add_argument("--out", type=Path, default=None, help="write the chosen plan to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the search's progress")
    args = ap.parse_args(argv)
    for flag in ("gpus", "micro_batches", "beam"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.memory <= 0:
        ap.error("--memory must be positive (GiB)")
    return args


def plan(args) -> dict:
    profile = load_profile(args.cluster)
    spec = get_model(args.model, gpus=args.gpus)
    batch = args.batch or spec.batch
    graph = capture_model(spec, batch)
    baselines = fixed_strategies(graph, args.gpus)
    memory = args.memory * 2**30
    started = time.perf_counter()
    mincomm = search(graph, args.gpus, profile, 1, memory, objective="comm", beam=args.beam)
    baselines["min-comm"] = mincomm.strategy
    log.info("min-comm search: %.2f s", time.perf_counter() - started)
    found = search(graph, args.gpus, profile, args.micro_batches, memory, beam=args.beam,
                   baselines=baselines)
    chosen = replace(found.strategy, name=f"hidup({found.candidates[0][0].split()[0]})")
    rows = {"hidup": _times(graph, chosen, args.gpus, args.micro_batches, profile)}
    rows["hidup"]["chosen_k"] = found.k
    rows.update({n: _times(graph, s, args.gpus, args.micro_batches, profile)
                 for n, s in baselines.items()})
    return {"model": spec.name, "batch": batch, "cluster": profile.name, "gpus": args.gpus,
            "micro_batches": args.micro_batches, "chosen": found.candidates[0][0],
            "duplex": found.k > 1,
            "search_seconds": found.seconds, "labels": found.states,
            "dp_estimate_ms": found.dp_cost * 1e3, "plans": rows,
            "strategy": chosen, "graph": graph}


def _times(graph, strategy, world, k, profile) -> dict:
    out = {}
    for kk in (1, k):
        try:
            out[f"k{kk}_ms"] = estimate(lower(graph, strategy, world, kk), profile).step_time * 1e3
        except (LoweringError, ValueError) as exc:
            out[f"k{kk}_ms"] = None
            log.info("%s with k=%d cannot be lowered: %s", strategy.name, kk, exc)
    return out


def report(res: dict) -> list[str]:
    k, rows = res["micro_batches"], res["plans"]
    best = rows["hidup"][f"k{rows['hidup']['chosen_k']}_ms"]
    lines = [f"{res['model']} (batch {res['batch']}) on {res['cluster']}, {res['gpus']} GPUs: "
             f"searched in {res['search_seconds']:.2f} s ({res['labels']} labels), chose "
             f"{res['chosen']} ({'with' if res['duplex'] else 'without'} Duplex)", "",
             "placements of the key ops:"]
    graph, strategy = res["graph"], res["strategy"]
    for node in graph.ops:
        if any(key in node.op for key in KEY_OPS):
            lines.append(f"  {node.name} ({node.op.split('.')[1]}): {strategy.options[node.name]}")
    lines += ["", f"{'plan':<10}{'SPMD k=1 (ms)':>15}{f'Duplex k={k} (ms)':>18}{'hidup speedup':>15}"]
    for name, t in rows.items():
        cells = [f"{t[key]:.2f}" if t[key] is not None else "-" for key in ("k1_ms", f"k{k}_ms")]
        times = [t[key] for key in ("k1_ms", f"k{k}_ms") if t[key] is not None]
        fastest = min(times) if times else None
        gain = f"{fastest / best:.3f}x" if fastest and best else "-"
        lines.append(f"{name:<10}{cells[0]:>15}{cells[1]:>18}{gain:>15}")
    lines.append("(hidup speedup: this plan's best time, with or without Duplex, over hidup's)")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        res = plan(args)
        if args.out:
            save_plan(args.out, res["graph"], res["strategy"], args.gpus, res["model"])
    except (ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {k: v for k, v in res.items() if k not in ("graph", "strategy")}
        doc["options"] = {n: str(o) for n, o in res["strategy"].options.items()}
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(report(res)))
        if args.out:
            print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
