"""A profile's file: versioned JSON (format "hidup-profile", hidup.planning.costs.PROFILE_VERSION),
as Profile.to_json writes it. The profiles that ship with the package, by name (hidup/profiles);
reading a file and checking every key of it (load_profile, from_dict), each fault a ProfileError
that says what to fix."""
from __future__ import annotations

import json
import logging
import math
from importlib import resources
from pathlib import Path

from hidup.graph.dtypes import PRECISIONS
from hidup.planning.costs import (OPTIONAL_KEYS, PROFILE_FORMAT, PROFILE_VERSION, LinkCost,
                                  Profile, ProfileError)
from hidup.program.tasks import COLLECTIVES, HOST_MODES

log = logging.getLogger(__name__)

_SCALARS = ("flops", "mem_bandwidth", "op_overhead", "gpus_per_node")
_KEYS = {"format", "version", "name", "source", "collectives", "inter_node", "interference",
         *_SCALARS}
# the optional keys (OPTIONAL_KEYS, which Profile.to_dict leaves out where unset):
# provenance: where a measured profile was taken (host, devices, date, versions);
# kernels: measured seconds of kernels by kernel_key (calibration.ops), used before the roofline;
# collective_points: [tier ("intra"/"inter"/"column"), kind, group size, bytes, seconds] as
# measured by calibration.profile, interpolated before the fitted formulas ("column": one rank on
# each of several machines, alone on their links, as a 2-D mesh's columns are);
# kernel_quantiles: each measured kernel's spread (calibration.ops): its seconds at evenly spaced
# quantiles over every rank's runs, from which simulator.montecarlo draws per rank;
# host: on a GPU, seconds the host spends issuing one task, per executor mode or plain PyTorch
# ("eager"; hidup.program.HOST_MODES);
# device_memory: bytes of memory per device (a GPU's, or a CPU rank's share of its host's RAM);
# kernels_in_situ: true when calibration.ops timed the kernels in real steps, collectives on the
# network: their times include what the transfers around them take from the device, so the
# simulator does not slow them again by the interference factor;
# precision: what the kernels were timed at, and what plans on the profile are made for unless
# told otherwise: "fp32" (the default) or "bf16" (mixed precision under torch.autocast);
# device: the devices' type as torch names it ("cuda", the default, or "cpu"), whose autocast
# policy gives each value's dtype under bf16;
# comm_lanes: how many collectives a rank runs at once (gloo's two worker threads: 2; NCCL's
# stream: 1, the default);
# pair_points: [tier, kind, group size, bytes, ratio] as measured by calibration.profile: two such
# collectives in flight at once took `ratio` times as long as one after the other (0.5: the link
# fits both; 1: they share it)
TIERS = ("intra", "inter", "column")  # of collective_points and pair_points


def shipped_names() -> list[str]:
    """Names of the profiles that ship with the package."""
    folder = resources.files("hidup") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir()
                  if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (e.g. 'v100-1x4-nvlink'), or the profile file at a path."""
    return _read(profile_path(name_or_path))


def profile_path(name_or_path: str | Path) -> Path:
    """The file of a profile: the path itself, or a shipped name's file in hidup/profiles."""
    text = str(name_or_path)
    if Path(text).is_file() or text.endswith(".json") or "/" in text:
        return Path(text)
    path = resources.files("hidup") / "profiles" / f"{text}.json"
    if not path.is_file():
        raise ProfileError(f"unknown cluster profile {text!r}; choose one of {shipped_names()} "
                           f"or give the path of a profile file")
    return Path(str(path))


def _read(path: Path) -> Profile:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"profile file {path}: cannot read it ({exc.strerror or exc}); "
                           f"check the path") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile file {path}: not valid JSON ({exc}); fix or re-create "
                           f"it") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(f"profile file {path}: not UTF-8 text (byte {exc.start}: "
                           f"{exc.reason}); give a profile JSON file, as calibration.profile "
                           f"writes") from exc
    profile = from_dict(doc, f"profile file {path}")
    log.debug("loaded %s from %s", profile, path)
    return profile


def from_dict(doc, where: str = "profile") -> Profile:
    """Check a decoded profile document and build the Profile; `where` names it in errors."""
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{where}: not a HiDup profile (no \"format\": \"{PROFILE_FORMAT}\"); "
                           f"give a profile file")
    if doc.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{where}: version {doc.get('version')}, this HiDup reads version "
                           f"{PROFILE_VERSION}; re-create the profile")
    unknown, missing = sorted(set(doc) - _KEYS - OPTIONAL_KEYS), sorted(_KEYS - set(doc))
    if unknown or missing:
        what = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
        raise ProfileError(f"{where}: {what}; the keys are {sorted(_KEYS)} (optional: "
                           f"{sorted(OPTIONAL_KEYS)})")
    provenance = doc.get("provenance")
    if provenance is not None and not isinstance(provenance, dict):
        raise ProfileError(f"{where}: \"provenance\" must be an object (host, devices, date, "
                           f"versions), got {type(provenance).__name__}")
    kernels = doc.get("kernels")
    if kernels is not None:
        if not isinstance(kernels, dict):
            raise ProfileError(f"{where}: \"kernels\" must map kernel keys to seconds, got "
                               f"{type(kernels).__name__}")
        kernels = {str(k): _number(v, f"kernels[{k!r}]", where, zero_ok=True)
                   for k, v in kernels.items()}
    spreads = doc.get("kernel_quantiles")
    if spreads is not None:
        if not isinstance(spreads, dict) or not all(
                isinstance(v, list) and v for v in spreads.values()):
            raise ProfileError(f"{where}: \"kernel_quantiles\" must map kernel keys to non-empty "
                               f"lists of seconds")
        spreads = {str(k): sorted(_number(x, f"kernel_quantiles[{k!r}]", where, zero_ok=True)
                                  for x in v) for k, v in spreads.items()}
    host = doc.get("host")
    if host is not None:
        if not isinstance(host, dict) or not host or set(host) - set(HOST_MODES):
            raise ProfileError(f"{where}: \"host\" must map executor modes "
                               f"({', '.join(HOST_MODES)}) "
                               f"to the seconds of host time per task, got {host!r}")
        host = {k: _number(v, f"host[{k!r}]", where, zero_ok=True) for k, v in host.items()}
    in_situ = doc.get("kernels_in_situ", False)
    if not isinstance(in_situ, bool):
        raise ProfileError(f"{where}: \"kernels_in_situ\" must be true or false, got "
                           f"{in_situ!r}")
    memory = doc.get("device_memory")
    if memory is not None:
        memory = _number(memory, "device_memory", where)
    points = doc.get("collective_points")
    if points is not None:
        points = [_point(p, where) for p in (points if isinstance(points, list) else [points])]
    pairs = doc.get("pair_points")
    if pairs is not None:
        pairs = [_point(p, where, "pair_points", "ratio")
                 for p in (pairs if isinstance(pairs, list) else [pairs])]
    lanes = doc.get("comm_lanes", 1)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ProfileError(f"{where}: comm_lanes must be a whole number >= 1 (collectives "
                           f"a rank runs at once), got {lanes!r}")
    precision, device = doc.get("precision", "fp32"), doc.get("device", "cuda")
    if precision not in PRECISIONS or device not in ("cuda", "cpu"):
        raise ProfileError(f"{where}: precision must be \"fp32\" or \"bf16\" and device "
                           f"\"cuda\" or \"cpu\", got {precision!r} and {device!r}")
    values = {k: _number(doc[k], k, where, zero_ok=k == "op_overhead") for k in _SCALARS}
    if values["gpus_per_node"] != int(values["gpus_per_node"]):
        raise ProfileError(f"{where}: gpus_per_node must be a whole number")
    inter = None if doc["inter_node"] is None else _collectives(doc["inter_node"], where, "inter_node")
    factors = doc["interference"]
    if not isinstance(factors, dict) or not \
            {"compute", "communication"} <= set(factors) <= {"compute", "communication", "latency"}:
        raise ProfileError(f"{where}: \"interference\" must be {{\"compute\": factor, "
                           f"\"communication\": factor}}, optionally with \"latency\": factor "
                           f"(1.0: none)")
    slow = {k: _number(v, f"interference.{k}", where) for k, v in factors.items()}
    if min(slow.values()) < 1.0:
        raise ProfileError(f"{where}: interference factors slow things down: each must be >= 1.0")
    return Profile(str(doc["name"]), str(doc["source"]), values["flops"],
                   values["mem_bandwidth"], values["op_overhead"],
                   _collectives(doc["collectives"], where), int(values["gpus_per_node"]), inter,
                   slow["compute"], slow["communication"], provenance, kernels, points,
                   spreads, host, memory, in_situ, slow.get("latency"), lanes, pairs,
                   precision, device)


def _point(p, where: str, key: str = "collective_points", value: str = "seconds") -> list:
    ok = (isinstance(p, list) and len(p) == 5 and p[0] in TIERS and p[1] in COLLECTIVES
          and isinstance(p[2], int) and p[2] >= 2)
    if not ok:
        raise ProfileError(f"{where}: {key} holds {p!r}; each must be [tier "
                           f"({'/'.join(TIERS)}), kind ({'/'.join(COLLECTIVES)}), group size >= 2, "
                           f"bytes, {value}]")
    return [p[0], p[1], p[2], _number(p[3], f"{key} bytes", where, zero_ok=True),
            _number(p[4], f"{key} {value}", where)]


def _collectives(doc, where: str, tier: str = "collectives") -> dict[str, LinkCost]:
    if not isinstance(doc, dict) or set(doc) != set(COLLECTIVES):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ProfileError(f"{where}: \"{tier}\" must have exactly the kinds "
                           f"{list(COLLECTIVES)}, got {got}")
    out = {}
    for kind in COLLECTIVES:
        cost = doc[kind]
        if not isinstance(cost, dict) or set(cost) != {"alpha", "bus_bandwidth"}:
            raise ProfileError(f"{where}: {tier}.{kind} must be {{\"alpha\": seconds per step, "
                               f"\"bus_bandwidth\": bytes/s}}")
        alpha = _number(cost["alpha"], f"{tier}.{kind}.alpha", where, zero_ok=True)
        out[kind] = LinkCost(alpha, _number(cost["bus_bandwidth"], f"{tier}.{kind}.bus_bandwidth",
                                            where))
    return out


def _number(value, key: str, where: str, zero_ok: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ProfileError(f"{where}: {key} must be a {'non-negative' if zero_ok else 'positive'} "
                           f"number, got {value!r}")
    return float(value)
