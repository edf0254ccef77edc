"""The simulator against the real V100 traces (`../shared/traces/`): the traced model
(`switch-trace:paper`) on 4 GPUs under DDP, under the plan the traced HiDup run executed (read
from its trace, written as a plan file), and under `expert` beside DeepSpeed's and FastMoE's runs;
and the HiDup prototype's run on 2 machines of 4 GPUs (`v100-2x4`, whose inter-machine links were
fitted from that trace) under its own traced plan. Each run is predicted with the optimizer its
trace ran.

`python -m experiments.switch_trace` prints the derivation of the HiDup plan, the table (traced
and predicted step, computation, communication, overlap; the error of the predicted step), and
the kernels that dominate each traced run; it writes the plan, a CSV and the table (Markdown)
to --out."""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from calibration.trace import (TraceError, breakdown, gpu_events, is_communication, load_trace,
                               steps, traced_update)
from calibration.traced_plan import derive_plan
from hidup.cli import Parser
from hidup.models import capture_model, get_model
from hidup.planning.planfile import PlanError, save_plan
from hidup.program import Compute
from simulator.predict import SimOptions, predict

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "v100-1x4-nvlink"
MODEL, GPUS = "switch-trace:paper", 4


def kernel_families(events: list[dict], top: int = 3) -> list[tuple[str, float]]:
    """The `top` kernel families by GPU milliseconds per step (NCCL kernels by collective)."""
    totals: dict[str, float] = {}
    for e in gpu_events(events):
        name = e["name"]
        if name.startswith("nccl"):
            family = "nccl " + name.split("_")[1]
        elif "gemm" in name:
            family = "GEMM"
        elif is_communication(e):
            family = "device copies"
        else:  # 'void at::native::(anonymous namespace)::foo<...>(...)' -> 'foo'
            family = name.split("<")[0].split("(")[0].rstrip(":").split("::")[-1]
            family = family.removeprefix("void ") or name[:40]
        totals[family] = totals.get(family, 0.0) + e["dur"] * 1e-3
    steps_ = len(steps(events))
    return [(f, t / steps_) for f, t in sorted(totals.items(), key=lambda x: -x[1])[:top]]


def update_seconds(result) -> float:
    """Rank 0's simulated seconds in the optimizer's update."""
    return sum(r.end - r.start for r in result.records[0]
               if isinstance(r.task, Compute) and r.task.phase == "update")


def main(argv=None) -> int:
    ap = Parser(prog="python -m experiments.switch_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=TRACES,
                    help="folder with ddp/hidup/deepspeed/fastmoe .json.gz (default: %(default)s)")
    ap.add_argument("--cluster", default="v100-1x4-nvlink",
                    help="profile to predict the 4-GPU runs with (default: %(default)s)")
    ap.add_argument("--two-machines", type=Path, default=TRACES.parent / "v100-2x4",
                    help="folder with the HiDup prototype's trace on 2 machines of 4 GPUs "
                         "(hidup.json.gz; skipped where absent) (default: %(default)s)")
    ap.add_argument("--two-machine-cluster", default="v100-2x4",
                    help="profile to predict that run with (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("out/switch_trace"),
                    help="folder for the plan, CSV and table (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except (TraceError, PlanError, ValueError, OSError) as exc:
        print(f"python -m experiments.switch_trace: error: {exc}", file=sys.stderr)
        return 2


def _traced_plan(events, gpus: int, where: str, path: Path) -> str:
    """The plan the traced HiDup run executed on `gpus` GPUs, read from its trace, written to
    `path` (its derivation printed); the plan file's path."""
    spec = get_model(MODEL, gpus=gpus)
    graph = capture_model(spec, spec.batch)
    plan, lines = derive_plan(events, graph, gpus)
    save_plan(path, graph, plan, gpus, spec.name, where)  # the cluster it was traced on
    print(f"The traced HiDup run's plan on {gpus} GPUs, read from its all-gathers ({path}):")
    print("\n".join("  " + line for line in lines))
    print("  everything else: the `expert` strategy (experts split across the GPUs, reached by "
          "all-to-all; the rest data parallel)\n")
    return str(path)


def _run(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    traces = {name: load_trace(args.traces / f"{name}.json.gz")
              for name in ("ddp", "hidup", "deepspeed", "fastmoe")}
    plan_path = _traced_plan(traces["hidup"], GPUS, "v100-1x4-nvlink",
                             args.out / "switch-trace-hidup-plan.json")
    runs = [  # system, trace, its events, GPUs, cluster, strategy, micro-batches, bucket MB,
        #       predicted run
        ("DDP", "ddp", traces["ddp"], GPUS, args.cluster, "ddp", 1, 25.0, "spmd"),
        ("HiDup (traced plan, Duplex)", "hidup", traces["hidup"], GPUS, args.cluster, plan_path,
         2, 0.0, "duplex"),
        ("DeepSpeed-MoE", "deepspeed", traces["deepspeed"], GPUS, args.cluster, "expert", 1,
         25.0, "spmd"),
        ("FastMoE", "fastmoe", traces["fastmoe"], GPUS, args.cluster, "expert", 1, 25.0, "spmd"),
    ]
    two = args.two_machines / "hidup.json.gz"
    if two.is_file():  # 2 machines of 4: its inter-machine links were fitted from this trace
        events = load_trace(two)
        path = _traced_plan(events, 2 * GPUS, "v100-2x4",
                            args.out / "switch-trace-hidup-2x4-plan.json")
        runs.append(("HiDup on 2 x 4 (traced plan, Duplex)", "v100-2x4/hidup", events, 2 * GPUS,
                     args.two_machine_cluster, path, 2, 0.0, "duplex"))
    rows = []
    for system, trace, events, gpus, cluster, strategy, k, bucket, which in runs:
        real, update = breakdown(events), traced_update(events)
        result = getattr(predict(MODEL, cluster, gpus, strategy, None, k,
                                 SimOptions(optimizer=update.optimizer, bucket_mb=bucket)), which)
        cmd = (f"--gpus {gpus} --cluster {Path(cluster).name.removesuffix('.json')} "
               f"--strategy {'PLAN' if strategy.endswith('.json') else strategy} "
               f"--optimizer {update.optimizer}"
               + (f" --micro-batches {k} --bucket-mb 0" if k > 1 else ""))
        rows.append({"system": system, "trace": f"{trace}.json.gz", "predict": cmd,
                     "traced_step_ms": real.wall * 1e3, "predicted_step_ms": result.step_time * 1e3,
                     "error": result.step_time / real.wall - 1,
                     "traced_computation_ms": real.computation * 1e3,
                     "predicted_computation_ms": result.computation * 1e3,
                     "traced_communication_ms": real.communication * 1e3,
                     "predicted_communication_ms": result.communication * 1e3,
                     "traced_overlap": real.overlap, "predicted_overlap": result.overlap_ratio,
                     "traced_update_ms": update.seconds * 1e3,
                     "predicted_update_ms": update_seconds(result) * 1e3})
    head = ("| system (trace) | predict flags | step traced / predicted (ms) | error | "
            "computation (ms) | communication (ms) | overlap | update (ms) |")
    table = [head, "|" + " --- |" * 8]
    for r in rows:
        table.append(
            f"| {r['system']} (`{r['trace']}`) | `{r['predict']}` | {r['traced_step_ms']:.1f} / "
            f"{r['predicted_step_ms']:.1f} | {r['error']:+.1%} | {r['traced_computation_ms']:.1f}"
            f" / {r['predicted_computation_ms']:.1f} | {r['traced_communication_ms']:.1f} / "
            f"{r['predicted_communication_ms']:.1f} | {r['traced_overlap']:.0%} / "
            f"{r['predicted_overlap']:.0%} | {r['traced_update_ms']:.1f} / "
            f"{r['predicted_update_ms']:.1f} |")
    print("switch-trace:paper, traced / predicted:")
    print("\n".join(table))
    print("\nWhere each traced run's GPU time went (kernel milliseconds per step):")
    for name, events in traces.items():
        print(f"  {name}: " + ", ".join(f"{f} {ms:.1f}" for f, ms in kernel_families(events)))
    with open(args.out / "switch_trace.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "switch_trace.md").write_text("\n".join(table) + "\n")
    print(f"\nwrote {plan_path}, {args.out / 'switch_trace.csv'} and {args.out / 'switch_trace.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
