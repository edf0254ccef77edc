"""Derive a cluster profile from a measured one: other machine sizes, another inter-node link.

`python -m calibration.derive --base v100-2x4 --gpus-per-node 8 --inter-bandwidth 9.71gbit
--name v100-8x8-10gbps --out PROFILE` keeps the base's device and intra-node figures and
latencies, and scales every inter-node collective's bus bandwidth by the new link rate over the
base's fastest inter-node bus bandwidth (taken as its link's rate: the base link's speed may not
be recorded), so each kind keeps its measured efficiency relative to the link.

`python -m calibration.derive --base h100-bf16 --hardware calibration/hardware/h100-sxm-8x-ndr400.json
--name h100-8x-ib-bf16 --out PROFILE` makes a cluster from a one-GPU profile and hardware figures
instead (from_hardware): the base's kernel efficiency, the device's memory, NVLink and network
collectives from data sheets and published NCCL-tests figures, each with its source."""
from __future__ import annotations

import argparse
import json
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


KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def read_hardware(path: Path) -> dict:
    """A hardware figures file (format 'hidup-hardware'; calibration/hardware/), checked: GPUs per
    machine, the device's memory and bandwidth beside the base GPU's, each intra-node collective
    kind's bus bandwidth and latency per step, and the link between machines, each with its
    source. A missing or bad figure is a one-line ProfileError naming it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"hardware file {path}: cannot read it ({exc})") from exc

    def number(where: dict, key: str, what: str) -> float:
        value = where.get(key) if isinstance(where, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ProfileError(f"hardware file {path}: {what} {key!r} is {value!r}; give a "
                               f"positive number (see calibration/hardware/ for an example)")
        return float(value)

    if not isinstance(doc, dict) or doc.get("format") != "hidup-hardware":
        raise ProfileError(f"hardware file {path}: not a HiDup hardware file (no \"format\": "
                           f"\"hidup-hardware\"); see calibration/hardware/ for an example")
    number(doc, "gpus_per_node", "the top level's")
    for key in ("memory_gib", "mem_bandwidth", "base_mem_bandwidth"):
        number(doc.get("device"), key, "device's")
    for kind in KINDS:
        for key in ("bus_bandwidth", "latency"):
            number(doc.get("intra_node", {}).get(kind), key, f"intra_node {kind}'s")
    for key in ("link_bandwidth", "latency"):
        number(doc.get("inter_node"), key, "inter_node's")
    for part in ("device", "intra_node", "inter_node"):
        if not str(doc[part].get("source", "")).strip():
            raise ProfileError(f"hardware file {path}: {part} has no \"source\"; say where its "
                               f"figures come from")
    return doc


def from_hardware(base: Profile, doc: dict, name: str) -> Profile:
    """A cluster's profile from a one-GPU profile and hardware figures (read_hardware): the
    base's kernel efficiency (its fitted compute throughput, per-kernel overhead and host cost
    per mode), its memory bandwidth scaled to the device's by the data sheets' ratio, and the
    collectives' figures of the file, inside a machine and across machines (every kind bound by
    each machine's link). The base's per-kernel times, measured for its traced models' shapes
    on its own memory, are left out."""
    dev, intra, inter = doc["device"], doc["intra_node"], doc["inter_node"]
    return replace(
        base, name=name, gpus_per_node=int(doc["gpus_per_node"]),
        mem_bandwidth=base.mem_bandwidth * dev["mem_bandwidth"] / dev["base_mem_bandwidth"],
        collectives={k: LinkCost(intra[k]["latency"], intra[k]["bus_bandwidth"]) for k in KINDS},
        inter_node={k: LinkCost(inter["latency"], inter["link_bandwidth"]) for k in KINDS},
        device_memory=dev["memory_gib"] * 2**30, kernels=None, kernel_quantiles=None,
        kernels_in_situ=False, collective_points=None, pair_points=None,
        source=f"Derived by calibration.derive from {base.name}'s kernel efficiency and hardware "
               f"figures: {doc.get('description', '')} Device: {dev['source']} Inside a "
               f"machine: {intra['source']} Between machines: {inter['source']}",
        provenance={"base": base.name, "base_source": base.source, "hardware": doc})


def main(argv=None) -> int:
    ap = Parser(prog="python -m calibration.derive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the measured profile, a name or a path")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per machine of the derived cluster (default: the base's)")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--inter-bandwidth", metavar="RATE",
                     help="the inter-node link's rate in bits per second with its unit, e.g. "
                          "9.71gbit, 100mbit, 10gbps: the base's measured cluster with another "
                          "link")
    how.add_argument("--hardware", type=Path, metavar="FILE",
                     help="hardware figures (GPUs per machine, device memory and bandwidth, "
                          "NVLink and network collectives, each with its source; e.g. "
                          "calibration/hardware/h100-sxm-8x-ndr400.json): a cluster from the "
                          "base's one-GPU kernel efficiency and these figures")
    ap.add_argument("--name", required=True, help="the derived profile's name")
    ap.add_argument("--out", type=Path, required=True, help="where to write it")
    args = ap.parse_args(argv)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node {args.gpus_per_node}: must be 1 or more")
    if not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: folder {args.out.parent} does not exist; create it first")
    try:
        rate = None if args.hardware else parse_rate(args.inter_bandwidth)
    except ValueError as exc:
        ap.error(f"--inter-{exc}")  # "--inter-bandwidth '1': give a positive rate ..."
    try:
        base = load_profile(args.base)
        if args.hardware:
            derived = from_hardware(base, read_hardware(args.hardware), args.name)
            if args.gpus_per_node is not None:
                derived = replace(derived, gpus_per_node=args.gpus_per_node)
            derived = replace(derived, provenance={
                **derived.provenance, "command": "python -m calibration.derive "
                + " ".join(sys.argv[1:] if argv is None else argv)})
            return _write(args.out, derived)
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
    return _write(args.out, derived)


def _write(out: Path, derived: Profile) -> int:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(derived.to_json())
    os.replace(tmp, out)
    print("\n".join(describe(derived)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
