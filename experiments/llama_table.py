"""Llama 3.1 8B on clusters of 8-GPU H100 machines, simulated on the profile built from hardware
figures (`h100-8x-ib-bf16`; docs/profiles.md).

1. torchtitan's published rows beside HiDup's prediction of the same run: Llama 3.1 8B on 8 H100s
   (96 GB HBM2e), FSDP, local batch 2 x 8192 tokens, bf16, selective activation checkpointing:
   5,762 tokens/s per GPU and 82.4 GiB in eager mode, 6,667 and 77.0 GiB with torch.compile (the
   torchtitan paper, arXiv 2410.06511, its 8-GPU FSDP table). HiDup's `fsdp` is predicted with no
   layer recomputed, with every layer recomputed selectively (the matmuls' and attention's
   outputs kept, as torchtitan's policy keeps them) and whole, the eager row with the `graph`
   mode's host cost and the compile row with `compile`'s (its kernels fused as Inductor fuses
   them), each with its peak memory at the profile's precision (bf16: each value at the dtype
   autocast gives it, float32 master weights, gradients and optimizer state, parameters gathered
   in bf16, as FSDP2's mixed precision; hidup.graph.dtypes) beside the published peak, and its
   kernel time split into library kernels (matmuls, attention) and the rest. The profile was
   built without these rows.
2. HiDup's chosen plan beside `fsdp` with every layer recomputed selectively (torchtitan's
   configuration) and the fixed strategies' best ranked runs (`fsdp`, and `fsdp+tp` on a 2-D
   mesh, each with the layers it recomputes to fit the device) on each --gpus.

`python -m experiments.llama_table [--gpus 8 64] [--out DIR]` prints both tables (`--gpus` with no
count: the first alone) and writes them
(Markdown) and the rows (JSON) to --out."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hidup.cli import Parser
from hidup.graph.dtypes import run_dtypes
from hidup.models import capture_model, get_model
from hidup.planning.fusion import generated, kernel_times
from hidup.planning.profile_file import load_profile
from hidup.planning.select import Goal, select_plan
from hidup.program import Compute, lower
from hidup.strategy import fixed_strategy, layers, recomputing
from simulator.predict import SimOptions, simulate

MODEL, SEQ, PER_GPU = "llama:8b", 8192, 2
TORCHTITAN = "fsdp, every layer selective"  # torchtitan's configuration
PUBLISHED = (("eager", "graph", 5762, 82.4), ("torch.compile", "compile", 6667, 77.0))


def tokens_per_gpu(step_s: float) -> float:
    return PER_GPU * SEQ / step_s


def published_rows(cluster: str, log) -> list[dict]:
    """torchtitan's two rows and HiDup's fsdp predictions of them, recomputing no layer, every
    layer selectively, every layer whole."""
    spec = get_model(MODEL, gpus=8)
    graph = capture_model(spec, PER_GPU * 8)
    profile = load_profile(cluster)
    base = fixed_strategy("fsdp", graph, 8)
    rows = []
    for label, mode, tokens, gib in PUBLISHED:
        for recompute in ("none", "selective", "all"):
            plan = recomputing(graph, base, layers(graph) if recompute != "none" else (),
                               selective=recompute == "selective")
            started = time.perf_counter()
            run = simulate(graph, plan, profile, 8, 1, SimOptions("adamw", mode), MODEL)
            step = run.spmd.step_time
            program = lower(run_dtypes(graph, profile.precision), plan, 8, 1, MODEL,
                            optimizer="adamw")
            library, other = kernel_split(program, profile, mode)
            rows.append({"torchtitan": label, "published_tokens_per_gpu": tokens,
                         "published_gib": gib, "mode": mode, "recompute": recompute,
                         "step_ms": step * 1e3, "tokens_per_gpu": tokens_per_gpu(step),
                         "error": tokens_per_gpu(step) / tokens - 1,
                         "peak_gib": run.memory[0].peak / 2**30,
                         "memory_error": run.memory[0].peak / 2**30 / gib - 1,
                         "library_kernels_ms": library * 1e3, "other_kernels_ms": other * 1e3})
            log(f"{label} ({mode}), recompute {recompute}: {step * 1e3:.0f} ms a step, "
                f"simulated in {time.perf_counter() - started:.1f} s")
    return rows


def kernel_split(program, profile, mode: str) -> tuple[float, float]:
    """Seconds of the step's library kernels (the model's ops whose code Inductor does not
    generate: matmuls, attention; hidup.planning.fusion.generated) and of its other kernels
    (generated code under `compile`, local conversions and the optimizer's update included) as
    `mode` prices them."""
    times = kernel_times(program, profile, mode)
    library = sum(times[t.id] for t in program.tasks if isinstance(t, Compute)
                  and t.phase != "update" and not generated(t) and t.id in times)
    return library, sum(times.values()) - library


def plan_rows(cluster: str, gpus: int, log) -> list[dict]:
    """HiDup's chosen plan and the fixed strategies it was chosen from, on `gpus` GPUs."""
    spec = get_model(MODEL, gpus=gpus)
    graph = capture_model(spec, PER_GPU * gpus)
    started = time.perf_counter()
    chosen = select_plan(graph, load_profile(cluster), Goal(gpus))
    log(f"{gpus} GPUs: planned in {time.perf_counter() - started:.1f} s, chose "
        f"{chosen.strategy.name} with k={chosen.k}")
    wanted = {"hidup", "fsdp", "fsdp+tp", chosen.strategy.name}
    hand = recomputing(graph, fixed_strategy("fsdp", graph, gpus), layers(graph), selective=True)
    rows = []
    for name, strategy in [(TORCHTITAN, hand), *chosen.candidates.items()]:
        if name not in wanted | {TORCHTITAN}:
            continue
        run = simulate(graph, strategy, chosen.profile, gpus, chosen.duplex_k,
                       SimOptions("adamw"), MODEL)
        best = run.best()
        k, result = best if best is not None else (1, run.spmd)
        memory = run.memory[0] if k == 1 else run.memory[1]
        rows.append({"gpus": gpus, "plan": name, "chosen": name == chosen.strategy.name,
                     "k": k, "fits": best is not None, "step_ms": result.step_time * 1e3,
                     "tokens_per_gpu": tokens_per_gpu(result.step_time),
                     "peak_gib": memory.peak / 2**30,
                     "recomputed_layers": len(strategy.recompute),
                     "selective_layers": len(strategy.selective),
                     "mesh": f"{strategy.parts}x{gpus // strategy.parts}"})
    return rows


def published_table(rows: list[dict]) -> str:
    lines = ["| torchtitan (published) | tokens/s per GPU | GiB | HiDup fsdp, layers recomputed "
             "| mode | step (ms) | tokens/s per GPU | error | peak (GiB) | error "
             "| library kernels (ms) | other kernels (ms) |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['torchtitan']} | {r['published_tokens_per_gpu']:,} | "
                     f"{r['published_gib']} | {r['recompute']} | {r['mode']} | "
                     f"{r['step_ms']:.0f} | {r['tokens_per_gpu']:,.0f} | {r['error']:+.1%} | "
                     f"{r['peak_gib']:.1f} | {r['memory_error']:+.1%} | "
                     f"{r['library_kernels_ms']:.0f} | {r['other_kernels_ms']:.0f} |")
    return "\n".join(lines)


def plans_table(rows: list[dict]) -> str:
    lines = ["| GPUs | plan | mesh | micro-batches | layers recomputed | step (ms) | "
             "tokens/s per GPU | peak (GiB) | fits |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = r["plan"] + (" (chosen)" if r["chosen"] else "")
        layers_ = f"{r['recomputed_layers']}" + (f" + {r['selective_layers']} selectively"
                                                  if r["selective_layers"] else "")
        lines.append(f"| {r['gpus']} | {name} | {r['mesh']} | {r['k']} | "
                     f"{layers_} | {r['step_ms']:.0f} | "
                     f"{r['tokens_per_gpu']:,.0f} | {r['peak_gib']:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = Parser(prog="python -m experiments.llama_table", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="h100-8x-ib-bf16",
                    help="profile of a cluster of 8-GPU machines (default: %(default)s)")
    ap.add_argument("--gpus", type=int, nargs="*", default=[8, 64, 128],
                    help="GPU counts of the plan table, multiples of 8 (default: 8 64 128); "
                         "none (--gpus alone): torchtitan's rows only")
    ap.add_argument("--out", type=Path, default=Path("out/llama_table"),
                    help="folder for the tables (Markdown) and rows (JSON) "
                         "(default: %(default)s)")
    ap.add_argument("--plans-only", action="store_true",
                    help="the plan table alone, without torchtitan's rows (as docs/ shows the "
                         "two tables apart)")
    args = ap.parse_args(argv)
    if args.plans_only and not args.gpus:
        ap.error("--plans-only needs GPU counts for its table (--gpus 8 64 128, the default)")
    if any(g < 8 or g % 8 for g in args.gpus):
        ap.error(f"--gpus {args.gpus}: give multiples of 8 (whole machines), 8 or more")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        published = [] if args.plans_only else published_rows(args.cluster, log)
        plans = [row for gpus in args.gpus for row in plan_rows(args.cluster, gpus, log)]
    except (ValueError, OSError) as exc:
        print(f"python -m experiments.llama_table: error: {exc}", file=sys.stderr)
        return 2
    tables = ([published_table(published)] if published else []) + \
        ([plans_table(plans)] if plans else [])
    text = (f"Llama 3.1 8B (llama:8b), local batch {PER_GPU} x {SEQ} tokens, AdamW, cluster "
            f"{args.cluster}\n\n" + "\n\n".join(tables))
    print(text)
    (args.out / "llama_table.md").write_text(text + "\n")
    (args.out / "llama_table.json").write_text(
        json.dumps({"published": published, "plans": plans}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
