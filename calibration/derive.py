"""Derive a cluster profile from a measured one: other machine sizes, another inter-node link.

`python -m calibration.derive --base v100-2x4 --gpus-per-node 8 --inter-bandwidth 9.71gbit
--name v100-8x8-10gbps --out PROFILE` keeps the base's device and intra-node figures and
latencies, and scales every inter-node collective's bus bandwidth by the new link rate over the
base's fastest inter-node bus bandwidth (taken as its link's rate: the base link's speed may not
be recorded), so each kind keeps its measured efficiency relative to the link."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from hidup.cli import Parser, parse_rate
from hidup.planning.costs import LinkCost, Profile, ProfileError
from hidup.planning.profile_file import load_profile


def _si(value: float, unit: str) -> str:
    """'1.21 GB/s', '100 Mbit/s': three figures and an SI prefix."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def readable_rate(bytes_per_s: float) -> str:
    """'1.21 GB/s (9.71 Gbit/s)'."""
    return f"{_si(bytes_per_s, 'B/s')} ({_si(bytes_per_s * 8, 'bit/s')})"


def describe(profile: Profile) -> list[str]:
    """The derived profile in readable figures: one line per collective kind and link tier."""
    lines = [f"profile {profile.name}: {profile.gpus_per_node} GPUs per machine, "
             f"{profile.flops / 1e12:.3g} TFLOP/s, {profile.op_overhead * 1e6:.2f} us per kernel"]
    for tier, costs in (("intra-node", profile.collectives), ("inter-node", profile.inter_node)):
        for kind, cost in costs.items():
            lines.append(f"  {tier} {kind:<14} latency {cost.alpha * 1e6:7.2f} us per step, "
                         f"bus bandwidth {readable_rate(cost.beta)}")
    return lines


def link_rate(profile: Profile) -> float:
    """The inter-node link's rate as a profile sees it: its fastest collective's bus bandwidth."""
    return max(c.beta for c in profile.inter_node.values())


def with_inter_link(base: Profile, link_bytes_per_s: float, gpus_per_node: int | None = None,
                    name: str | None = None) -> Profile:
    """`base` with its inter-node bus bandwidths scaled to a link of `link_bytes_per_s`."""
    if not base.inter_node:
        raise ProfileError(f"profile {base.name} has no inter-node tier to scale; derive from a "
                           f"profile measured across machines (e.g. v100-2x4)")
    scale = link_bytes_per_s / link_rate(base)
    inter = {k: LinkCost(c.alpha, c.beta * scale) for k, c in base.inter_node.items()}
    kept = [p for p in base.collective_points or () if p[0] == "intra"]  # not another link's
    pairs = [p for p in base.pair_points or () if p[0] == "intra"]
    return replace(base, name=name or base.name, inter_node=inter,
                   gpus_per_node=gpus_per_node or base.gpus_per_node,
                   collective_points=kept or None, pair_points=pairs or None)


def main(argv=None) -> int:
    ap = Parser(prog="python -m calibration.derive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the measured profile, a name or a path")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per machine of the derived cluster (default: the base's)")
    ap.add_argument("--inter-bandwidth", required=True, metavar="RATE",
                    help="the inter-node link's rate in bits per second with its unit, e.g. "
                         "9.71gbit, 100mbit, 10gbps")
    ap.add_argument("--name", required=True, help="the derived profile's name")
    ap.add_argument("--out", type=Path, required=True, help="where to write it")
    args = ap.parse_args(argv)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node {args.gpus_per_node}: must be 1 or more")
    if not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: folder {args.out.parent} does not exist; create it first")
    try:
        rate = parse_rate(args.inter_bandwidth)
    except ValueError as exc:
        ap.error(f"--inter-{exc}")  # "--inter-bandwidth '1': give a positive rate ..."
    try:
        base = load_profile(args.base)
        derived = with_inter_link(base, rate, args.gpus_per_node, args.name)
        derived = replace(derived, source=(
            f"Derived by calibration.derive from {base.name} ({base.source}) with "
            f"{derived.gpus_per_node} GPUs per machine and the inter-node bus bandwidths scaled "
            f"to a {args.inter_bandwidth} link (x{rate / link_rate(base):.4g} of the base's "
            f"fastest inter-node bus bandwidth)."),
            provenance={"base": base.name, "command": "python -m calibration.derive "
                        + " ".join(sys.argv[1:] if argv is None else argv)})
    except (ValueError, ProfileError) as exc:
        print(f"python -m calibration.derive: error: {exc}", file=sys.stderr)
        return 2
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(derived.to_json())
    os.replace(tmp, args.out)
    print("\n".join(describe(derived)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
