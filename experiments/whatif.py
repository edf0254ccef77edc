"""What if the machines' link were faster or slower? For a model on N GPUs over H machines, sweep
the inter-machine link rate, search the best plan at each point with Duplex and without, and
predict both step times (simulator); mark where Duplex pays off and where it stops:

    python -m experiments.whatif --model bert-sgmoe:paper --gpus 8 --bandwidth 1gbit:100gbit

The cluster is --base (a measured profile; default v100-2x4, two machines of 4 V100) with its
machines regrouped to N/H GPUs each and its inter-machine bus bandwidths scaled to each rate
(calibration.derive); the GPUs inside a machine keep the base's figures. Prints the table and
writes whatif.csv and whatif.png to --out (default out/whatif/, git-ignored; the figure in docs/
is refreshed with `--out experiments/results/whatif`)."""
from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
import time
from pathlib import Path

from calibration.derive import parse_rate, with_inter_link
from experiments import outputs
from experiments.paper_figures import hidup, ms
from experiments.paper_plots import log_ticks, save_png
from hidup.cli import Parser, command_logs
from hidup.models import capture_model, get_model
from hidup.planning.costs import ProfileError
from hidup.planning.profile_file import load_profile

log = logging.getLogger(__name__)
PROG = "python -m experiments.whatif"
COLUMNS = ["gbit", "duplex_ms", "plain_ms", "duplex_gain", "duplex_plan", "plain_plan"]


def parse_range(text: str) -> tuple[float, float]:
    """'1gbit:100gbit' (or one rate) -> (low, high) in bytes/s."""
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"--bandwidth {text!r}: give LOW:HIGH (e.g. 1gbit:100gbit) or one rate")
    try:
        low, high = (parse_rate(p) for p in (parts * 2)[:2])
    except ValueError as exc:  # "bandwidth '1': give a positive rate ..."
        raise ValueError(f"--{exc}") from None
    if low > high:
        raise ValueError(f"--bandwidth {text!r}: the low rate is above the high one; give "
                         f"LOW:HIGH, e.g. 1gbit:100gbit")
    return low, high


def rates(low: float, high: float, points: int) -> list[float]:
    """`points` rates spaced evenly on a log scale from low to high (bytes/s)."""
    if points == 1 or low == high:
        return [low]
    step = (math.log(high) - math.log(low)) / (points - 1)
    return [math.exp(math.log(low) + i * step) for i in range(points)]


def sweep(model: str, gpus: int, hosts: int, base, link_rates: list[float]) -> list[dict]:
    spec = get_model(model, gpus=gpus)
    graph = capture_model(spec, spec.batch)
    rows = []
    for i, rate in enumerate(link_rates, 1):
        profile = with_inter_link(base, rate, gpus // hosts, f"{base.name}-{rate * 8 / 1e9:g}gbit")
        best = {}
        for k in (2, 1):  # with Duplex (it may still pick one micro-batch), and without
            result, found = hidup(graph, gpus, profile, k)
            best[k] = (ms(result), found.candidates[0][0])
        rows.append({"gbit": rate * 8 / 1e9, "duplex_ms": best[2][0], "plain_ms": best[1][0],
                     "duplex_gain": best[1][0] / best[2][0], "duplex_plan": best[2][1],
                     "plain_plan": best[1][1]})
        log.info("[%d/%d] %.3g Gbit/s: %.1f ms with Duplex (%s), %.1f ms without (%s)", i,
                 len(link_rates), rows[-1]["gbit"], best[2][0], best[2][1], best[1][0], best[1][1])
    return rows


def pays_off(rows: list[dict], threshold: float) -> tuple[float, float] | None:
    """The range of rates (Gbit/s) swept where Duplex makes the step at least `threshold` times
    faster: (lowest, highest); None if nowhere. Duplex hides the shorter of computation and
    communication, so it pays least where either one dwarfs the other: on slow links (all
    communication) and on fast ones (little communication)."""
    paying = [r["gbit"] for r in rows if r["duplex_gain"] >= threshold]
    return (min(paying), max(paying)) if paying else None


def plot(rows: list[dict], band: tuple[float, float] | None, title: str, path: Path) -> None:
    plt = outputs.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    x = [r["gbit"] for r in rows]
    a.plot(x, [r["plain_ms"] for r in rows], marker="o", label="best plan, no Duplex")
    a.plot(x, [r["duplex_ms"] for r in rows], marker="o", label="best plan with Duplex")
    b.plot(x, [r["duplex_gain"] for r in rows], marker="o", color="C2")
    b.axhline(1.0, color="k", lw=0.6)
    for ax in (a, b):
        log_ticks(ax, [float(f"{v:.3g}") for v in x])
        ax.set_xlabel("inter-machine link (Gbit/s)")
        if band is not None:
            ax.axvspan(*band, color="green", alpha=0.08)
            for edge in band:
                if x[0] < edge < x[-1]:
                    ax.axvline(edge, color="red", ls="--", lw=0.8)
    a.set(ylabel="predicted step (ms)", yscale="log")
    b.set(ylabel="Duplex gain (no Duplex / Duplex)")
    b.set_title("green: Duplex pays off; red: where it stops" if band else
                "Duplex does not pay off here", fontsize=8)
    for i, r in enumerate(rows):  # the plans where they change
        if i == 0 or r["duplex_plan"] != rows[i - 1]["duplex_plan"]:
            a.annotate(r["duplex_plan"], (r["gbit"], r["duplex_ms"]), fontsize=6,
                       textcoords="offset points", xytext=(2, 6))
    a.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert-sgmoe:paper", help="model NAME:SIZE")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    ap.add_argument("--hosts", type=int, default=2,
                    help="machines the GPUs are spread over, GPUs/hosts each (default 2)")
    ap.add_argument("--bandwidth", default="1gbit:100gbit",
                    help="inter-machine link rates LOW:HIGH, e.g. 1gbit:100gbit (or one rate)")
    ap.add_argument("--points", type=int, default=7, help="rates swept, log-spaced (default 7)")
    ap.add_argument("--base", default="v100-2x4",
                    help="measured profile whose machines and collectives are scaled (name or "
                         "path; default v100-2x4)")
    ap.add_argument("--threshold", type=float, default=1.05,
                    help="Duplex pays off while it makes the step at least this much faster "
                         "(default 1.05)")
    ap.add_argument("--out", type=Path, default=outputs.default_out("whatif"),
                    help="folder for whatif.csv and whatif.png (default out/whatif, git-ignored; "
                         "experiments/results/whatif holds the figure in docs/)")
    args = ap.parse_args(argv)
    if args.gpus < 2:
        ap.error(f"--gpus {args.gpus}: needs 2 or more (a link between machines)")
    if args.hosts < 2 or args.gpus % args.hosts:
        ap.error(f"--hosts {args.hosts}: needs 2 or more machines that divide --gpus {args.gpus}")
    if args.points < 1:
        ap.error(f"--points must be at least 1, got {args.points}")
    if not (math.isfinite(args.threshold) and args.threshold >= 1.0):
        ap.error(f"--threshold {args.threshold}: the gain must be a finite number, and below 1.0 "
                 f"is a loss; give >= 1.0, e.g. 1.05")
    try:
        args.range = parse_range(args.bandwidth)
        get_model(args.model, gpus=args.gpus)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command_logs(PROG, __name__, "experiments")
    started = time.perf_counter()
    try:
        base = load_profile(args.base)
        rows = sweep(args.model, args.gpus, args.hosts, base, rates(*args.range, args.points))
    except (ValueError, ProfileError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    band = pays_off(rows, args.threshold)
    title = (f"{args.model} on {args.gpus} GPUs over {args.hosts} machines ({base.name} "
             f"scaled)")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "whatif.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()}
                         for r in rows)
    plot(rows, band, title, args.out / "whatif.png")
    print(f"{title}: predicted step (ms)\n")
    print("| link (Gbit/s) | with Duplex | without | gain | plan with Duplex | plan without |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['gbit']:.3g} | {r['duplex_ms']:.1f} | {r['plain_ms']:.1f} | "
              f"{r['duplex_gain']:.2f}x | {r['duplex_plan']} | {r['plain_plan']} |")
    low, high = rows[0]["gbit"], rows[-1]["gbit"]
    if band is None:
        print(f"\nDuplex gains less than {args.threshold:g}x everywhere from {low:.3g} to "
              f"{high:.3g} Gbit/s")
    else:
        print(f"\nDuplex pays off (>= {args.threshold:g}x) from {band[0]:.3g} to {band[1]:.3g} "
              f"Gbit/s" + (f"; below {band[0]:.3g} communication dwarfs computation, there is "
                           f"little to hide it under" if band[0] > low else "")
              + (f"; above {band[1]:.3g} too little communication is left to hide"
                 if band[1] < high else ""))
    print(f"wrote {args.out / 'whatif.csv'} and {args.out / 'whatif.png'}")
    print(f"{PROG}: {time.perf_counter() - started:.0f} s", file=sys.stderr)  # (stdout: the
    #   same for the same flags, as docs/whatif.md shows it)
    print(outputs.note(args.out, "whatif"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
