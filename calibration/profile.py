"""Measure a cluster and write its HiDup Profile. Every rank, started by torchrun, times kernels
(mm, bmm, element-wise add / mul / relu, tiny ops) and the four collectives as
hidup.runtime.execute issues them, over sizes and group sizes, pairs of each collective in flight at
once where the backend runs several (gloo), then computation and communication alone and at once
(calibration.measure); rank 0 fits the figures (calibration.fit) and writes the
profile JSON:

    torchrun --nproc-per-node 2 -m calibration.profile --out PROFILE.json

On one rank (one GPU, say) there is nothing to communicate with: `--base PROFILE` keeps that
profile's collectives and interference and the run measures the device's kernels only:

    torchrun --nproc-per-node 1 -m calibration.profile --base v100-1x4-nvlink --out GPU.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shlex
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from calibration.fit import BoundError, FitError, fit_link, fit_links, fit_roofline
from calibration.measure import lanes as measure_lanes
from calibration.measure import measure, measure_again
from calibration.timing import Clock, Ranks
from hidup.cli import Parser
from hidup.planning.costs import Profile, ProfileError
from hidup.planning.profile_file import load_profile
from hidup.runtime.launch import default_threads

log = logging.getLogger(__name__)
PROG = "calibration.profile"
LAUNCH = "torchrun --nproc-per-node 2 -m calibration.profile --out PROFILE"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
_UNITS = {"": 1, "B": 1, "KB": 2 ** 10, "KIB": 2 ** 10, "MB": 2 ** 20, "MIB": 2 ** 20,
          "GB": 2 ** 30, "GIB": 2 ** 30}


class UsageError(Exception):
    """A bad flag, output path or launch: one line, exit code 2."""


# -- command line ------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes from '256MB', '4MiB', '1024' (binary units: 1KB = 1024 bytes)."""
    match = re.fullmatch(r"\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write it like 256MB, 4MiB "
                                         f"or 1024 (bytes)")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1KB (the smallest "
                                         f"tensor measured); give e.g. 4MB")
    return int(value)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= 1, e.g. 5")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="the profile file to write (.json); its folder must exist")
    ap.add_argument("--name", help="the profile's name (default: the --out file's stem)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="torch.distributed backend: nccl if CUDA is available, else gloo "
                         "(default: auto)")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes and few repeats (CI, under a minute); a rough profile")
    ap.add_argument("--repeats", type=_positive_int,
                    help="timed runs per point: a kernel's median counts, a collective's mean "
                         "(each run at its slowest rank) (default 5, 3 with --quick; three "
                         "times as many for points under 10 ms)")
    ap.add_argument("--max-bytes", type=parse_size,
                    help="largest collective tensor, e.g. 256MB (binary units; default 256MB, "
                         "16MB with --quick); sizes go from 1KB up by x4; a collective whose "
                         "points show no bandwidth is measured again up to 4x larger")
    ap.add_argument("--base", metavar="NAME|PATH",
                    help="one rank (e.g. one GPU): measure the device's kernels only and take the "
                         "collectives and interference from this profile (shipped name or file)")
    ap.add_argument("--json", action="store_true",
                    help="print a machine-readable summary on stdout (the report goes to stderr)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every measured point")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    # --quick's largest, 16MB, takes some 20 ms even on loopback gloo: well above the scheduler's
    # ticks (1-4 ms) that a loaded machine adds to every small message's time (up to 4MB the
    # points of a loaded run could all look like latency and show no bandwidth)
    args.max_bytes = args.max_bytes or (16 if args.quick else 256) * 2 ** 20
    args.name = args.name or args.out.stem
    return args


def torchrun_env() -> dict[str, str]:
    """The variables torchrun sets; a UsageError naming the missing ones when not under it."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise UsageError(f"not started by torchrun ({', '.join(missing)} not set); run: {LAUNCH}")
    return {k: os.environ[k] for k in TORCHRUN_ENV}


def check_out(out: Path) -> str | None:
    """Why the profile cannot be written to `out`, or None (checked before measuring)."""
    folder = out.parent
    if out.suffix != ".json":
        return f"--out {out}: a profile file's name must end in .json; give e.g. {out.stem}.json"
    if out.is_dir():
        return f"--out {out}: is a folder; give a file path such as {out / 'profile.json'}"
    if not folder.is_dir():
        return f"--out {out}: the folder {folder} does not exist; create it or choose another"
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        return f"--out {out}: cannot write in {folder} (permission denied); choose a writable path"
    return None


# -- provenance, fit, output -------------------------------------------------------------------

def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(s.split(":", 1)[1].strip() for s in lines if s.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return (f"CPU {model} ({os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch "
            f"threads per rank)")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("numpy", "scipy", "simpy", "hidup"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def device_memory(ranks: Ranks) -> float:
    """Bytes of memory one rank may use: its GPU's, or on a CPU its share of the host's RAM."""
    if ranks.device.type == "cuda":
        return float(torch.cuda.get_device_properties(ranks.device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks.local)


def provenance(ranks: Ranks, command: str) -> dict:
    """Where and how the profile was measured (every rank takes part: hosts and devices)."""
    everyone: list = [None] * ranks.world
    dist.all_gather_object(everyone, (socket.gethostname(), describe_device(ranks.device)))
    devices: dict[str, int] = {}
    for _, name in everyone:
        devices[name] = devices.get(name, 0) + 1
    return {"host": everyone[0][0], "hosts": list(dict.fromkeys(h for h, _ in everyone)),
            "devices": [f"{count} x {name}" for name, count in devices.items()],
            "world": ranks.world, "nnodes": ranks.nnodes, "ranks_per_node": ranks.local,
            "device_memory": device_memory(ranks),
            "backend": ranks.backend,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command, "versions": versions()}


AGAIN_BYTES, AGAIN_REPEATS = 4, 3  # a kind measured again: sizes up to 4x, 3x the repeats


def unshown_kinds(link_points) -> list[str]:
    """The collective kinds whose fit, in some tier, ends on the bandwidth bound its points
    allow (calibration.fit.BoundError)."""
    rows: dict[tuple[str, str], list] = {}
    for tier, kind, n, nbytes, seconds in link_points:
        if tier != "column":
            rows.setdefault((tier, kind), []).append((n, nbytes, seconds))
    kinds = set()
    for (_, kind), points in rows.items():
        try:
            fit_link(kind, points)
        except BoundError:
            kinds.add(kind)
    return sorted(kinds)


def fit_profile(args, ranks: Ranks, kernel_points, link_points, factors, prov,
                base: Profile | None = None, pair_points=(), lanes: int = 1):
    """The Profile, the report's lines and the machine-readable summary. Measured on one rank,
    the collectives and interference are `base`'s. `pair_points`: how much longer two
    collectives in flight at once took than one after the other, measured where the backend
    runs `lanes` > 1 of them at once."""
    flops, mem, overhead, roof = fit_roofline(kernel_points)
    if not link_points:
        return _kernels_on_base(args, ranks, base, prov, (flops, mem, overhead, roof))
    links, fits = {}, {}
    for tier in ("intra", "inter"):
        points = [p[1:] for p in link_points if p[0] == tier]
        if points:
            links[tier], fits[tier] = fit_links(points)
    pairs_note = (f", {lanes} collectives in flight at once (the backend's lanes) and pairs of "
                  f"each kind in flight timed against one after the other") if pair_points else ""
    note = "" if "intra" in links else (" No group inside one node: the intra-node tier repeats "
                                        "the inter-node figures.")
    source = (f"Measured by calibration.profile on {prov['host']} ({ranks.world} ranks, "
              f"{ranks.nnodes} node(s) x {ranks.local}, backend {ranks.backend}, "
              f"{prov['date']}) with `{prov['command']}`, fitted with calibration.fit: a roofline "
              f"of {roof.points} kernels (rms error {roof.rms:.1%}), alpha and bus bandwidth per "
              f"collective kind and tier, interference from matmuls and large and small "
              f"all-reduces alone and at once{pairs_note}.{note}")
    intra = links["intra"] if "intra" in links else links["inter"]
    inter = links["inter"] if ranks.nnodes > 1 else None
    profile = Profile(args.name, source, flops, mem, overhead, intra, ranks.local, inter,
                      factors[0], factors[1], prov,
                      collective_points=[[t, kind, n, b, sec] for t, kind, n, b, sec in link_points],
                      device_memory=prov.get("device_memory"), interference_latency=factors[2],
                      comm_lanes=lanes,
                      pair_points=[list(p) for p in pair_points] or None,
                      device=ranks.device.type)  # its autocast policy types a bf16 run
    lines = [_roofline_line(flops, mem, overhead, roof)]
    summary = {"name": args.name, "out": str(args.out), "flops": flops, "mem_bandwidth": mem,
               "op_overhead": overhead, "roofline_fit": _fit_dict(roof), "collectives": {},
               "interference": {"compute": factors[0], "communication": factors[1],
                                "latency": factors[2]}}
    columns = sorted({p[2] for p in link_points if p[0] == "column"})
    if columns:
        lines.append(f"mesh-column collectives (one rank on each node, groups of "
                     f"{', '.join(map(str, columns))}): kept as measured, used before the "
                     f"inter-node fit for such groups")
    for tier, costs in links.items():
        sizes = sorted({p[2] for p in link_points if p[0] == tier})
        lines.append(f"{tier}-node collectives (groups of {', '.join(map(str, sizes))} ranks):")
        summary["collectives"][tier] = {}
        for kind, cost in costs.items():
            r = fits[tier][kind]
            lines.append(f"  {kind:<15} {cost.alpha * 1e6:8.3g} us/step, {cost.beta / 1e9:7.4g} "
                         f"GB/s bus; {r.points} points, rms error {r.rms:.1%}, max {r.max:.1%}")
            summary["collectives"][tier][kind] = {"alpha": cost.alpha, "bus_bandwidth": cost.beta,
                                                  **_fit_dict(r)}
    if pair_points:
        lines.append(f"two collectives in flight at once ({lanes} lanes), as a share of one "
                     f"after the other:")
        summary["lanes"], summary["pairs"] = lanes, [list(p) for p in pair_points]
        for tier, kind, n, nbytes, ratio in pair_points:
            lines.append(f"  {tier:<6} {kind:<15} {n} ranks {nbytes / 2 ** 20:5g} MB: x{ratio:.3f}")
    lines.append(f"interference: computation x{factors[0]:.3f}, communication "
                 f"x{factors[1]:.3f}, a collective's latency x{factors[2]:.3f} (1.0: none)")
    return profile, lines, summary


def _kernels_on_base(args, ranks: Ranks, base: Profile, prov, fit):
    """One rank's profile: its device's roofline, `base`'s collectives and interference."""
    flops, mem, overhead, roof = fit
    source = (f"Kernels measured by calibration.profile on one rank of {prov['host']} "
              f"({prov['devices'][0]}, {prov['date']}) with `{prov['command']}`, fitted with "
              f"calibration.fit: a roofline of {roof.points} kernels (rms error {roof.rms:.1%}). "
              f"Collectives and interference from profile {base.name} ({base.source})")
    profile = replace(base, name=args.name, source=source, flops=flops, mem_bandwidth=mem,
                      op_overhead=overhead, provenance=prov, kernels=None, kernel_quantiles=None,
                      device_memory=prov.get("device_memory", base.device_memory))
    lines = [_roofline_line(*fit), f"collectives and interference: profile {base.name}"]
    summary = {"name": args.name, "out": str(args.out), "flops": flops, "mem_bandwidth": mem,
               "op_overhead": overhead, "roofline_fit": _fit_dict(roof), "base": base.name}
    return profile, lines, summary


def _roofline_line(flops, mem, overhead, roof) -> str:
    return (f"roofline of {roof.points} kernels: {flops / 1e9:.4g} GFLOP/s, {mem / 1e9:.4g} GB/s "
            f"memory, {overhead * 1e6:.3g} us per kernel; rms error {roof.rms:.1%}, "
            f"max {roof.max:.1%}")


def _fit_dict(r) -> dict:
    return {"points": r.points, "rms_error": r.rms, "max_error": r.max}


def write_profile(profile: Profile, out: Path) -> None:
    """Write through a temporary file in the same folder, check it loads, then rename it."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(profile.to_json())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # a normal file's mode, not mkstemp's 0600
        load_profile(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None) -> int:
    """`torchrun --nproc-per-node N -m calibration.profile --out PROFILE.json`."""
    args = parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose and rank0 else logging.WARNING)
    try:
        env = torchrun_env()
        if int(env["WORLD_SIZE"]) < 2 and not args.base:
            raise UsageError(f"WORLD_SIZE is 1: collectives need at least 2 ranks; run: {LAUNCH}; "
                             f"or, to measure one device's kernels, add --base PROFILE for the "
                             f"collectives")
        base = load_profile(args.base) if args.base else None
        backend = args.backend if args.backend != "auto" else (
            "nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs and none is available; use "
                             "--backend gloo (or auto)")
    except (UsageError, ProfileError) as exc:
        if rank0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    # torch 2.13 deprecates the two calls hidup.runtime.execute makes; they are what is measured
    # here
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.\w+` is deprecated")
    device = torch.device("cpu")
    torch.set_num_threads(default_threads())  # as hidup.train runs
    if backend == "nccl":
        device = torch.device("cuda", int(env["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        return run(args, argv, Ranks(env, backend, device), base)
    finally:
        dist.destroy_process_group()


def run(args, argv, ranks: Ranks, base: Profile | None = None) -> int:
    """Check the output path, measure on every rank, then fit, write and report on rank 0."""
    problem = [check_out(args.out) if ranks.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)  # every rank stops if rank 0 cannot write
    if problem[0]:
        if ranks.rank == 0:
            print(f"{PROG}: error: {problem[0]}", file=sys.stderr)
        return 2
    start = time.time()
    clock = Clock(ranks.device)
    kernel_points, link_points, pair_points, factors = measure(args, ranks, clock)
    # a kind whose points show no bandwidth (its fit ends on the bound they allow: times under
    # load, sizes too small) is measured again, larger and with more repeats; the fit below
    # refuses it if it stays so
    again = [unshown_kinds(link_points) if ranks.rank == 0 else None]
    dist.broadcast_object_list(again, src=0)
    if again[0]:
        max_bytes, repeats = args.max_bytes * AGAIN_BYTES, args.repeats * AGAIN_REPEATS
        if ranks.rank == 0:
            print(f"{PROG}: the {', '.join(again[0])} points show no bandwidth; measuring "
                  f"them again up to {max_bytes / 2 ** 20:g} MB with {repeats} repeats",
                  file=sys.stderr)
        points = measure_again(again[0], max_bytes, repeats, ranks, clock)
        link_points = [p for p in link_points if p[1] not in again[0]] + points
    nodes = f" --nnodes {ranks.nnodes}" if ranks.nnodes > 1 else ""
    command = (f"torchrun --nproc-per-node {ranks.local}{nodes} -m calibration.profile "
               f"{shlex.join(sys.argv[1:] if argv is None else argv)}")
    prov = provenance(ranks, command)
    if ranks.rank != 0:
        return 0
    try:
        profile, lines, summary = fit_profile(args, ranks, kernel_points, link_points, factors,
                                              prov, base, pair_points,
                                              measure_lanes(ranks.backend))
        write_profile(profile, args.out)
    except (FitError, ProfileError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    summary["seconds"] = time.time() - start
    lines.append(f"wrote {args.out} (profile {args.name}) in {summary['seconds']:.0f} s")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
