"""Plan a model of the zoo for a cluster: `python -m hidup.planner --model M --cluster C --gpus N
[--out PLAN]`. Chooses the plan as hidup.plan() and simulator.predict do (hidup.planning.select:
the Duplex-aware search on the cluster's mesh, the fixed strategies as baselines), prints its
placements, the planner's estimated step time with and without Duplex beside the fixed
strategies, and the search time; --out writes the plan file that hidup.train and
simulator.predict accept."""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from hidup.cli import RECOMPUTE_HELP, Parser, number, parse_mesh
from hidup.cli.progress import progress, status_line
from hidup.models import capture_model, get_model, names
from hidup.graph.dtypes import PRECISIONS, run_dtypes
from hidup.planning.estimate import estimate
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.ranking import lowered_whole, plan_key
from hidup.planning.select import DUPLEX_K, Goal, select_plan
from hidup.strategy import describe, mesh_option
from hidup.program import MODES, OPTIMIZERS, LoweringError, lower

log = logging.getLogger(__name__)
PROG = "python -m hidup.planner"
KEY_OPS = ("linear", "einsum", "embedding", "conv2d", "scaled_dot_product_attention", "loss")


def parse_args(argv=None):
    ap = Parser(prog=PROG, description=" ".join(__doc__.split()))
    ap.add_argument("--model", default="bert-sgmoe:paper", help=f"model NAME:SIZE, one of {names()}")
    ap.add_argument("--cluster", default="v100-8x8-10gbps", help="profile name or path")
    ap.add_argument("--gpus", type=int, default=8, help="world size")
    ap.add_argument("--mesh", default=None, metavar="MACHINESxGPUS",
                    help="the device mesh, e.g. 8x8: plans with data parallel across the "
                         "machines and any split inside them (and the other way round) are "
                         "searched beside the plans over every GPU; 1xN: those only; "
                         "MACHINESxBLOCKSxGPUS (e.g. 8x2x4): a 3-D mesh, each machine's GPUs in "
                         "blocks, searched with each axis split over in turn (default: the "
                         "cluster's machines x GPUs per machine when --gpus fills whole "
                         "machines, else 1x--gpus)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    ap.add_argument("--micro-batches", type=int, default=None, metavar="K",
                    help="micro-batches per rank: 1 (plain SPMD), 2 or more (Duplex) (default: "
                         f"the faster of 1 and {DUPLEX_K})")
    ap.add_argument("--memory", type=float, default=None,
                    help="device memory limit, GiB (default: the cluster profile's, none if it "
                         "does not say)")
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                    help="the optimizer whose update time and state memory the plan is priced "
                         "with: the one hidup.train runs by default (default: adamw)")
    ap.add_argument("--mode", choices=MODES, default="graph",
                    help="the executor mode training will run (hidup.train's --compile, "
                         "--cuda-graphs): its host time per task, where the profile has host "
                         "figures, and for 'compile' Inductor's fused kernels rank the plans "
                         "(default: %(default)s)")
    ap.add_argument("--precision", choices=list(PRECISIONS), default=None,
                    help="the dtypes values, collectives and memory are counted at (bf16: mixed "
                         "precision under torch.autocast, float32 master weights, as "
                         "hidup.train --precision bf16 runs; default: the cluster profile's)")
    ap.add_argument("--beam", type=int, default=16, help="states kept per cut of the search")
    ap.add_argument("--exact", type=float, default=0.0, metavar="SECONDS",
                    help="time for the integer programme that proves the k=1 cost model's best "
                         "plan on each mesh (over all GPUs: among the plans the beam searches; on "
                         "a 2-D mesh: among those that split every op inside a machine; the beam "
                         "can miss it; hidup.plan() and simulator.predict do not run it); 0 "
                         "skips it (default: 0)")
    ap.add_argument("--recompute", default="auto", metavar="auto|none|all|N|LAYERS",
                    help=RECOMPUTE_HELP)
    ap.add_argument("--out", type=Path, default=None, help="write the chosen plan to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the search's progress")
    args = ap.parse_args(argv)
    for flag in ("gpus", "micro_batches", "beam"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.exact < math.inf:
        ap.error(f"--exact {args.exact}: give seconds, 0 or more (0 skips the proof)")
    if args.memory is not None and not 0 < args.memory < math.inf:
        ap.error(f"--memory {args.memory}: must be a positive number of GiB")
    if args.mesh is not None:
        args.mesh = parse_mesh(args.mesh, args.gpus, ap.error)
    return args


def plan(args) -> dict:
    profile = load_profile(args.cluster)
    spec = get_model(args.model, gpus=args.gpus)
    batch = args.batch or spec.batch
    progress(f"capturing {args.model}, batch {batch}")
    graph = capture_model(spec, batch)
    memory = args.memory * 2**30 if args.memory is not None else None
    goal = Goal(args.gpus, args.micro_batches, memory, args.optimizer, args.mesh,
                beam=args.beam, exact=args.exact, recompute=args.recompute, mode=args.mode,
                precision=args.precision, grows=spec.grows)
    chosen = select_plan(graph, profile, goal)
    found, k = chosen.search, chosen.duplex_k
    typed = run_dtypes(graph, chosen.goal.precision, chosen.profile.device)
    rows, whole = {}, lowered_whole(chosen.ranked)
    for i, (name, s) in enumerate(chosen.candidates.items()):
        progress("pricing the plans for the table: plan", i + 1, len(chosen.candidates))
        rows[name] = _times(typed, s, args.gpus, k, chosen.profile, args.optimizer, args.mode,
                            whole, chosen.programs.get(name, {}))
    rows[chosen.strategy.name]["chosen_k"] = chosen.k
    limit = chosen.profile.device_memory
    return {"model": spec.name, "batch": batch, "cluster": profile.name, "gpus": args.gpus,
            "mesh": list(chosen.goal.mesh),
            "chosen_mesh": list(chosen.strategy.mesh.shape) if chosen.strategy.mesh
            else [args.gpus], "chosen_dp": list(chosen.strategy.dp),
            "micro_batches": k, "optimizer": args.optimizer, "mode": args.mode,
            "chosen": chosen.strategy.name,
            "chosen_k": chosen.k, "searched": chosen.searched,
            "description": describe(graph, chosen.strategy),
            "memory_limit_gib": None if limit is None else limit / 2**30,
            "precision": chosen.goal.precision,
            "duplex": chosen.k > 1, "notes": list(chosen.notes),
            "search_seconds": found.seconds if found else 0.0,
            "labels": found.states if found else 0,
            "exact": [{"machines": m, "exact_ms": c * 1e3, "bound_ms": b * 1e3, "optimal": o,
                       "beam_ms": beam * 1e3} for m, c, b, o, beam in
                      (found.exact if found else ())],
            "dp_estimate_ms": found.dp_cost * 1e3 if found else None, "plans": rows,
            "strategy": chosen.strategy, "graph": graph}


def _times(graph, strategy, world, k, profile, optimizer: str, mode: str, whole,
           lowered: dict) -> dict:
    """The plan's estimated step (ms) and peak memory (GiB) with one micro-batch and with k:
    as the ranking priced it where it ranked it whole (`whole`: ranking.lowered_whole), else
    from its Program as the search lowered it (`lowered`: Selection.programs, by count), else
    lowered here."""
    out, key = {}, plan_key(strategy)
    for kk in (1, k):
        seen = whole.get((key, kk))
        if seen is not None:
            out[f"k{kk}_ms"], out[f"k{kk}_gib"] = seen.step_time * 1e3, seen.peak / 2**30
            continue
        try:
            program = lowered.get(kk) or lower(graph, strategy, world, kk, optimizer=optimizer)
        except (LoweringError, ValueError) as exc:
            out[f"k{kk}_ms"] = out[f"k{kk}_gib"] = None
            log.info("%s with k=%d cannot be lowered: %s", strategy.name, kk, exc)
            continue
        out[f"k{kk}_ms"] = estimate(program, profile, mode).step_time * 1e3
        out[f"k{kk}_gib"] = peak_memory(program).peak / 2**30
    return out


def exact_line(proof: dict, gpus: int) -> str:
    """What the integer programme proved on one mesh, in which space, and the beam's best
    plan of the same (k = 1) cost model beside it."""
    exact, bound, beam = proof["exact_ms"], proof["bound_ms"], proof["beam_ms"]
    if proof["machines"] > 1:
        space = (f"on {proof['machines']} machines, among the plans that split every op inside "
                 f"a machine (data parallel across the machines)")
        outside = f"the beam also splits ops over all {gpus} GPUs"
    else:
        space, outside = f"over all {gpus} GPUs, among the plans the beam searches", ""
    if proof["optimal"]:
        found = f"best plan {exact:.2f} ms, proven optimal there"
    else:
        found = (f"best plan found in --exact's time {exact:.2f} ms; no plan there is below "
                 f"{bound:.2f} ms")
    if beam < (exact if proof["optimal"] else bound) * (1 - 1e-9):
        beside = f"the beam's best {beam:.2f} ms is below it ({outside})"
    elif proof["optimal"]:
        beside = f"the beam's best {beam:.2f} ms, {beam / exact - 1:+.1%} over that optimum"
    else:
        beside = f"the beam's best {beam:.2f} ms, at most {beam / bound - 1:+.1%} over the optimum"
    return f"k=1 cost model {space}: {found}; {beside}"


def report(res: dict) -> list[str]:
    k, rows, chosen_k = res["micro_batches"], res["plans"], res["chosen_k"]
    best = rows[res["chosen"]][f"k{chosen_k}_ms"]
    duplex = f"with Duplex (k={chosen_k})" if res["duplex"] else "without Duplex"
    what = f"the searched plan ({res['description']})" if res["searched"] else \
        f"the fixed strategy {res['chosen']}, which no searched plan beat ({res['description']})"
    limit = res["memory_limit_gib"]
    lines = [f"{res['model']} (batch {res['batch']}) on {res['cluster']}, {res['gpus']} GPUs"
             f"{'' if limit is None else f', {limit:.3g} GiB each'}, optimizer "
             f"{res['optimizer']}: searched in "
             f"{res['search_seconds']:.2f} s ({res['labels']} labels)",
             f"chose {what}, {duplex}", *res["notes"]]
    lines += [exact_line(proof, res["gpus"]) for proof in res["exact"]]
    graph, strategy = res["graph"], res["strategy"]
    mesh, machines = res["mesh"], res["mesh"][0]
    if len(mesh) == 3:
        lines.append(f"mesh {'x'.join(map(str, mesh))}: searched on it with each axis split "
                     f"over in turn (data parallel over the others) and over all {res['gpus']} "
                     f"GPUs")
    elif machines > 1:
        lines.append(f"mesh {machines}x{mesh[1]}: searched on it both ways round (data parallel "
                     f"across the machines, any split inside; data parallel inside each, any "
                     f"split across) and over all {res['gpus']} GPUs")
    if strategy.mesh:
        dims = f"over each machine's {strategy.parts} GPUs, across the machines" \
            if strategy.dp == ("gpus",) else f"across {machines} machines, inside one" \
            if len(strategy.dp) == 1 else \
            ", ".join([*strategy.dp, strategy.split_axis]) + ": data parallel, then split"
        lines += ["", f"placements of the key ops per mesh dimension ([{dims}]):"]
    else:
        lines += ["", "placements of the key ops:"]
    for node in graph.ops:
        if any(key in node.op for key in KEY_OPS):
            lines.append(f"  {node.name} ({node.op.split('.')[1]}): "
                         f"{mesh_option(graph, strategy, node.name)}")
    head = ("SPMD k=1 (ms)", f"Duplex k={k} (ms)", f"peak k=1 / k={k} (GiB)", "hidup speedup")
    width, over = max(12, *map(len, rows)), False
    lines += ["", f"{'plan':<{width}}" + "".join(f"  {h}" for h in head)]
    for name, t in rows.items():
        times = [t[key] for key in ("k1_ms", f"k{k}_ms") if t[key] is not None]
        fastest = min(times) if times else None
        peaks = [t[key] for key in ("k1_gib", f"k{k}_gib")]
        starred = limit is not None and any(g is not None and g > limit for g in peaks)
        over |= starred
        cells = [f"{t['k1_ms']:.2f}" if t["k1_ms"] is not None else "-",
                 f"{t[f'k{k}_ms']:.2f}" if t[f"k{k}_ms"] is not None else "-",
                 " / ".join("-" if g is None else number(g, 3) for g in peaks)
                 + ("*" if starred else ""),
                 f"{fastest / best:.3f}x" if fastest and best else "-"]
        lines.append(f"{name:<{width}}" + "".join(f"  {c:>{len(h)}}"
                                                  for c, h in zip(cells, head)))
    lines.append("(hidup speedup: this plan's best time, with or without Duplex, over hidup's" +
                 ("; *: over the memory limit in one of its runs; the search keeps only runs "
                  "that fit)" if over else ")"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        with status_line(args.verbose):
            res = plan(args)
        if args.out:
            save_plan(args.out, res["graph"], res["strategy"], args.gpus, res["model"],
                      res["cluster"], micro_batches=res["chosen_k"],
                      optimizer=args.optimizer, precision=res["precision"])
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
