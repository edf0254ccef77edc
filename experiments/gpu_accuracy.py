"""The simulator against real single-GPU steps: `python -m experiments.gpu_accuracy
experiments/results/gpu/*.json` reads the rows `experiments.executor_overhead --busy --out` wrote
on a GPU (hidup's ddp plan on one device, SGD in the step; experiments/gpu_table.sh makes them),
takes each executor mode's host seconds per task from the rows with --fit-k micro-batches (the
host's time to issue one step, at most the step itself, over the tasks it issues), and
predicts every hidup row with the shipped profile of its precision (h100 for fp32, h100-bf16
for bf16) and those host figures.
Rows of other k are out of sample. With --write, the host figures go into the profiles' files.

`--fit-models MODEL ...` fits them on those models' rows only: the other models' rows are out
of sample too. `--profiles bf16=PROFILE[,fp32=PROFILE]` predicts a precision's rows with another
profile, a shipped name or a profile file's path (e.g. one calibration.from_trace fitted from
another GPU's eager traces, experiments.eager_trace); with --write its host figures go into that
file.

Each row prints measured and predicted step, the error, and the GPU's busy time (the union of
the step's kernels), which the profile predicts as its kernel time."""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.planning.costs import Profile
from hidup.planning.profile_file import ProfileError, load_profile, profile_path
from hidup.program import lower
from hidup.strategy import fixed_strategy
from simulator.engine import simulate

PROG = "python -m experiments.gpu_accuracy"
PROFILES = {"fp32": "h100", "bf16": "h100-bf16"}
PROFILE_DIR = Path(__file__).resolve().parent.parent / "hidup" / "profiles"


def host_figures(rows: list[dict], fit_k: int,
                 models: frozenset[str] = frozenset()) -> dict[str, dict[str, float]]:
    """precision -> executor mode -> median host seconds per task over the rows with fit_k (of
    `models` only, where given). A step's host time counts at most the step's own: in a run of
    steps the host issues one step per step. (Issued alone, right after a sync, a step's host
    time reads up to 1.7x the step in host-bound runs on an H100, eager's too.)"""
    per: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if in_sample(r, fit_k, models) and r.get("tasks") and r.get("host_ms") is not None:
            mode = r["contestant"].removeprefix("hidup ")
            host = 1e-3 * min(r["host_ms"], r["median_ms"])
            per.setdefault((r["precision"], mode), []).append(host / r["tasks"])
    out: dict[str, dict[str, float]] = {}
    for (precision, mode), values in sorted(per.items()):
        out.setdefault(precision, {})[mode] = statistics.median(values)
    return out


def in_sample(row: dict, fit_k: int, models: frozenset[str] = frozenset()) -> bool:
    """Whether the host figures are fitted on this row: its k is fit_k, and its model one of
    `models` (any, where empty)."""
    return row["k"] == fit_k and (not models or row["model"] in models)


@functools.cache
def _captured(model: str, batch: int | None):
    """The model's spec and graph at the runs' batch (once per model: rows share it)."""
    spec = get_model(model, gpus=1)
    example = spec.inputs(batch or spec.batch, torch.Generator().manual_seed(0))
    return spec, capture(spec.build(), example)


def predict(row: dict, profile: Profile, batch: int | None) -> tuple[float, float]:
    """Predicted step and kernel seconds of one hidup row (ddp on one device, SGD) on `profile`
    (its precision's, with the fitted host figures)."""
    spec, graph = _captured(row["model"], batch)
    program = lower(graph, fixed_strategy("ddp", graph, 1), 1, row["k"], spec.name,
                    optimizer="sgd")
    result = simulate(program, profile, mode=row["contestant"].removeprefix("hidup "))
    return result.step_time, result.computation


def parse_profiles(text: str) -> dict[str, str]:
    """'bf16=NAME_OR_PATH[,fp32=NAME_OR_PATH]' over the shipped defaults."""
    out = dict(PROFILES)
    for item in filter(None, text.split(",")):
        precision, sep, value = item.partition("=")
        if not sep or precision not in PROFILES or not value:
            raise ValueError(f"{item!r}: give PRECISION=PROFILE, PRECISION one of "
                             f"{', '.join(PROFILES)}, PROFILE a shipped name or a file's path")
        out[precision] = value
    return out


def write_host(precision: str, host: dict[str, float], source: str,
               profiles: dict[str, str] = PROFILES) -> Path:
    """The host figures into the profile file of `precision`, with where they came from."""
    path = profile_path(profiles[precision])
    doc = json.loads(path.read_text())
    doc["host"] = host
    doc.setdefault("provenance", {})["host_figures"] = source
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="JSON files of executor_overhead --out")
    ap.add_argument("--fit-k", type=int, default=1,
                    help="the micro-batch count whose rows give the host figures (default 1)")
    ap.add_argument("--fit-models", nargs="+", default=[], metavar="MODEL",
                    help="fit the host figures on these models' rows only, e.g. bert-sgmoe:paper; "
                         "the others' are out of sample (default: every model's)")
    ap.add_argument("--batch", type=int, default=None, help="the runs' global batch (default: "
                    "the model's, as executor_overhead's)")
    ap.add_argument("--profiles", default="", metavar="PRECISION=PROFILE[,...]",
                    help="the profile that predicts each precision's rows (and that --write "
                         "writes into): a shipped name or a profile file's path, e.g. "
                         "'bf16=h200-bf16.json' (default: fp32=h100,bf16=h100-bf16)")
    ap.add_argument("--write", action="store_true",
                    help="write the host figures into the profiles' files (hidup/profiles/"
                         "h100*.json, or --profiles' files)")
    args = ap.parse_args(argv)
    try:  # a missing or broken profile is an error now, not mid-table
        profiles = parse_profiles(args.profiles)
        loaded = {precision: load_profile(name) for precision, name in profiles.items()}
    except (ValueError, ProfileError) as exc:
        ap.error(f"--profiles {exc}")
    rows, setups = [], set()
    for path in args.results:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"{path}: not a JSON file of executor_overhead --out ({exc})")
        setups.add(doc.get("setup", "?"))
        rows += doc.get("rows", [])
    fit_models = frozenset(args.fit_models)
    hosts = host_figures(rows, args.fit_k, fit_models)
    of = f" of {', '.join(sorted(fit_models))}" if fit_models else ""
    if not hosts:
        ap.error(f"no hidup row{of} with k={args.fit_k} and host figures (run executor_overhead "
                 f"with --busy on a GPU)")
    print(f"{PROG} {' '.join(map(str, argv if argv is not None else sys.argv[1:]))}")
    print("runs: " + "; ".join(sorted(setups)))
    if args.profiles:
        print("profiles: " + ", ".join(f"{p} {profiles[p]}" for p in sorted(hosts)))
    for precision, host in hosts.items():
        figures = ", ".join(f"{m} {1e6 * s:.1f} us" for m, s in host.items())
        print(f"host per task ({precision}, from k={args.fit_k}{of}): {figures}")
        if args.write:
            flags = f"--fit-k {args.fit_k}" + (
                f" --fit-models {' '.join(sorted(fit_models))}" if fit_models else "")
            source = (f"host seconds per task per executor mode, by `{PROG}` ({flags}): the "
                      f"median over its rows of the host's time to issue one "
                      f"step (at most the step) over the tasks issued, in runs of `bash "
                      f"experiments/gpu_table.sh` ({'; '.join(sorted(setups))})")
            path = write_host(precision, host, source, profiles)
            shown = f"hidup/profiles/{path.name}" if path.parent.resolve() == PROFILE_DIR else path
            print(f"  written into {shown}")
    print(f"{'model':18s} {'prec':4s} k  {'mode':11s} {'measured':>9s} {'predicted':>9s} "
          f"{'error':>7s} {'busy':>7s} {'kernels':>8s}")
    priced = {precision: replace(loaded[precision], host=host) for precision, host in hosts.items()}
    errors = []
    for r in rows:
        if not r["contestant"].startswith("hidup ") or r["precision"] not in hosts:
            continue
        step, kernels = predict(r, priced[r["precision"]], args.batch)
        err = 1e3 * step / r["median_ms"] - 1
        sample = "in " if in_sample(r, args.fit_k, fit_models) else "out"
        if sample == "out":
            errors.append(abs(err))
        busy = "" if r.get("busy_ms") is None else f"{r['busy_ms']:7.2f}"
        print(f"{r['model']:18s} {r['precision']:4s} {r['k']}  "
              f"{r['contestant'].removeprefix('hidup '):11s} {r['median_ms']:9.2f} "
              f"{1e3 * step:9.2f} {100 * err:+6.1f}% {busy} {1e3 * kernels:8.2f}  {sample}")
    if errors:
        print(f"out of sample ({len(errors)} rows): median |error| "
              f"{100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
