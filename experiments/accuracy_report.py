"""experiments.accuracy's report: the summary of the Rows (errors, the measurements' spread, the
machine's drift, Kendall's tau, regret), the files a run writes (accuracy.csv, accuracy.json,
accuracy.png) and the table it prints."""
from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from experiments import outputs
from experiments.accuracy_rows import Row

PROG = "python -m experiments.accuracy"


def kendall(rows: list[Row]) -> float | None:
    """Kendall's tau of predicted against measured times; None for one configuration (no
    ranking to compare)."""
    from scipy.stats import kendalltau

    if len(rows) < 2:
        return None
    return float(kendalltau([r.predicted_ms for r in rows], [r.measured_ms for r in rows])[0])


def regret(rows: list[Row]) -> float:
    """Measured time of the simulator's pick / measured best."""
    pick = min(rows, key=lambda r: r.predicted_ms)
    return pick.measured_ms / min(r.measured_ms for r in rows)


def summarize(rows: list[Row]) -> dict:
    errors = [abs(r.error) for r in rows]
    models = sorted({r.model for r in rows})
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.cluster), []).append(r)
    spreads = [r.spread for r in rows if math.isfinite(r.spread)]
    probed_rows = [r for r in rows if math.isfinite(r.drift)]  # older runs have no probe
    drift = {"median_abs_drift": statistics.median(abs(r.drift - 1) for r in probed_rows),
             "max_abs_drift": max(abs(r.drift - 1) for r in probed_rows),
             "median_abs_error_at_run_speed": statistics.median(
                 abs(r.error_at_run_speed) for r in probed_rows),
             "drift_probed": len(probed_rows)} if probed_rows else {}
    return {"configurations": len(rows),
            "median_abs_error": statistics.median(errors),
            # the measurement's own noise: how far apart one configuration's rounds were
            "median_round_spread": statistics.median(spreads) if spreads else None,
            "max_round_spread": max(spreads) if spreads else None,
            "max_abs_error": max(errors),
            "kendall_tau": {m: kendall([r for r in rows if r.model == m]) for m in models},
            "kendall_tau_per_cluster": {f"{m} on {c}": kendall(g)
                                        for (m, c), g in sorted(groups.items())},
            "regret": {f"{m} on {c}": regret(g) for (m, c), g in sorted(groups.items())},
            **drift}


def write_outputs(rows: list[Row], summary: dict, folder: Path, command: str,
                  sources: list[dict] | None = None) -> None:
    with open(folder / "accuracy.csv", "w", newline="") as f:
        writer = csv.writer(f)
        fields = list(asdict(rows[0]))
        writer.writerow(fields + ["error"])
        for r in rows:
            writer.writerow([getattr(r, k) for k in fields] + [f"{r.error:+.4f}"])
    about = dict(summary, command=command, **({"sources": sources} if sources else {}))
    (folder / "accuracy.json").write_text(json.dumps(about, indent=1))
    plt = outputs.pyplot()

    fig, ax = plt.subplots(figsize=(6, 5.5))
    markers = {"searched": "*", "ddp": "o", "megatron": "s", "expert": "^", "dp-megatron": "D",
               "dp-expert": "v"}
    for model in sorted({r.model for r in rows}):
        for strategy, marker in markers.items():
            mine = [r for r in rows if r.model == model and r.strategy == strategy]
            if mine:
                ax.scatter([r.measured_ms for r in mine], [r.predicted_ms for r in mine],
                           marker=marker, label=f"{model} {strategy}", alpha=0.8)
    lo = min(min(r.measured_ms, r.predicted_ms) for r in rows) * 0.8
    hi = max(max(r.measured_ms, r.predicted_ms) for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for f, style in ((1.1, "k:"), (0.9, "k:")):
        ax.plot([lo, hi], [lo * f, hi * f], style, lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms)",
           ylabel="predicted step (ms)",
           title=f"simulator vs real runs: median |error| {summary['median_abs_error']:.1%}, "
                 f"max {summary['max_abs_error']:.1%}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "accuracy.png", dpi=120)


def report(rows: list[Row], args, command: str, started: float,
           sources: list[dict] | None = None) -> int:
    """Write the outputs, print the table and its summary; 1 where the median misses
    --max-median-error."""
    summary = summarize(rows)
    write_outputs(rows, summary, args.out, command, sources)
    print("| model | strategy | Duplex | cluster | predicted (ms) | measured (ms) | error | "
          "rounds measured (ms) | machine's drift |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rounds = (f"{r.measured_low_ms:.1f}-{r.measured_high_ms:.1f}"
                  if math.isfinite(r.spread) else "-")
        drift = f"{100 * (r.drift - 1):+.1f}%" if math.isfinite(r.drift) else "-"
        print(f"| {r.model} | {r.strategy} | {'on' if r.k > 1 else 'off'} | {r.cluster} | "
              f"{r.predicted_ms:.1f} | {r.measured_ms:.1f} | {100 * r.error:+.1f}% | {rounds} | "
              f"{drift} |")
    if any(src.get("repredicted") for src in sources or ()):
        print("\npredicted again by this version's simulator from the profiles and plans each "
              "run kept; measured as those runs measured")
    print(f"\n{summary['configurations']} configurations: median |error| "
          f"{summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}")
    if summary["median_round_spread"] is not None:
        print(f"the measurements' own spread (slowest round / fastest - 1, per configuration): "
              f"median {summary['median_round_spread']:.1%}, max "
              f"{summary['max_round_spread']:.1%}")
    if "median_abs_drift" in summary:
        print(f"the machine's drift (a fixed workload timed around each run against around the "
              f"calibration of its kernels; {summary['drift_probed']} configurations): median "
              f"{summary['median_abs_drift']:.1%}, max {summary['max_abs_drift']:.1%}; median "
              f"|error| with each prediction scaled by its drift "
              f"{summary['median_abs_error_at_run_speed']:.1%}")
    print("Kendall tau: " + ", ".join(f"{m} {_tau(t)}" for m, t in summary["kendall_tau"].items()))
    print("Kendall tau per model and cluster (the ranking a user calibrating one cluster sees): " +
          ", ".join(f"{g} {_tau(t)}" for g, t in summary["kendall_tau_per_cluster"].items()))
    print("regret (measured time of the simulator's pick / measured best): " +
          ", ".join(f"{g} {v:.3f}" for g, v in summary["regret"].items()))
    print(f"wrote {args.out / 'accuracy.csv'}, accuracy.json, accuracy.png in "
          f"{time.perf_counter() - started:.0f} s")
    print(outputs.note(args.out, "accuracy"))
    if args.max_median_error is not None and summary["median_abs_error"] > args.max_median_error:
        print(f"{PROG}: median |error| {summary['median_abs_error']:.1%} exceeds "
              f"{args.max_median_error:.0%}", file=sys.stderr)
        return 1
    return 0


def _tau(t: float | None) -> str:
    return "- (one configuration)" if t is None else f"{t:.2f}"
