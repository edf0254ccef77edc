"""The simulator against real runs on an emulated cluster: `python -m experiments.accuracy`.

For each cluster shape (--hosts x --ranks-per-host) an emulated cluster (hidup.emulation: hosts as
network namespaces, links limited with tc) is brought up, and for each link bandwidth it is
calibrated once, as a user would calibrate theirs: calibration.profile (microbenchmarks of
kernels and collectives; on one rank its kernels on the cpu-gloo-loopback profile's
collectives), then per model calibration.ops (every strategy's training step as hidup.train runs
it, SGD included, at k = 1 and 2, timed task by task in real steps; the searched plan is made
from it and its kernels added). Every
configuration (model x strategy x Duplex on/off) is then predicted from that one profile and
trained for real (hidup.train, median step after warm-up) in each of --rounds rounds; the
medians over rounds count. --recalibrate-each times each configuration's own kernels right
before its run instead (an easier test: the simulator adding up fresh kernel times). A speed
probe (a fixed one-thread workload, speed_probe_ms) is timed around each calibration of kernels
and each run; a configuration's drift is the one over the other, the machine's own change of
speed between its calibration and its run. Reports each error, the median and maximum absolute
error, the median drift and the median error with each prediction scaled by its drift (what is
left once the machine's drift is out), Kendall's tau per model and the regret of taking the
simulator's best per model and cluster; writes a CSV, a JSON summary and a
predicted-vs-measured plot to --out (default out/accuracy/, git-ignored; the README's results are
in experiments/results/accuracy/, which a --quick run may not write to). Needs root and iproute2
(as hidup.emulation).

--combine FOLDER ... runs nothing: it reads earlier runs' folders (their accuracy.csv) and reports
and writes their configurations as one table, e.g. runs of different cluster shapes or
bandwidths made one after another."""
from __future__ import annotations

import argparse
import csv
import functools
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import get_type_hints
from pathlib import Path

import torch

from experiments import outputs
from hidup.cli import Parser, parse_rate
from hidup.emulation.netns import Cluster, ClusterError, emulated
from hidup.models import capture_model, get_model
from hidup.planning.costs import kernel_coverage, load_profile
from hidup.planning.planfile import resolve_strategy, save_plan
from hidup.planning.search import SearchOptions, search
from hidup.strategy import ACROSS, fixed_strategy
from hidup.program import lower
from simulator.montecarlo import expected_step

log = logging.getLogger(__name__)
PROG = "python -m experiments.accuracy"
STRATEGIES = ("searched", "ddp", "megatron", "expert")  # the default set
MESH_STRATEGIES = tuple(ACROSS)  # 2-D: data parallel across the hosts, the named one inside
OPTIMIZER = "sgd"  # what every run trains with, calibration.ops times and the Program prices
ONE_RANK_BASE = "cpu-gloo-loopback"  # collectives of a one-rank calibration (none are run)


@dataclass
class Row:
    model: str
    strategy: str
    k: int
    bandwidth: str
    hosts: int
    ranks_per_host: int
    predicted_ms: float
    measured_ms: float
    predicted_computation_ms: float
    predicted_communication_ms: float
    predicted_overlap: float
    kernels_measured: float  # share of the Program's kernels with a measured time
    measured_low_ms: float = math.nan  # the fastest and slowest of the rounds' measurements
    measured_high_ms: float = math.nan
    drift: float = math.nan  # the machine's speed probe around the run / around the kernels'
    #   calibration, median over rounds (1.1: the machine was 10% slower when it ran)

    @property
    def spread(self) -> float:
        """How far apart the rounds measured the same configuration (slowest / fastest - 1)."""
        return self.measured_high_ms / self.measured_low_ms - 1.0

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1.0

    @property
    def error_at_run_speed(self) -> float:
        """The error had the kernels been timed at the speed the machine had when this ran
        (the prediction scaled by the drift): what is left once the machine's drift is out."""
        return self.predicted_ms * self.drift / self.measured_ms - 1.0

    @property
    def cluster(self) -> str:
        return f"{self.hosts}x{self.ranks_per_host} {self.bandwidth}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__)
    ap.add_argument("--models", nargs="+", default=["gpt:small", "bert-sgmoe:small"],
                    help="zoo models NAME:SIZE (CPU-feasible sizes)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                    help=f"of {STRATEGIES + MESH_STRATEGIES}; 'expert' and 'dp-expert' only "
                         f"apply to mixture-of-experts models; the dp- ones (a 2-D mesh of hosts "
                         f"x ranks per host) to clusters of 2 or more ranks per host")
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit", "10gbit"],
                    help="link rates to emulate, e.g. 100mbit 1gbit 10gbit")
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 3],
                    help="emulated machines, one cluster per count and --ranks-per-host "
                         "(default 2 3)")
    ap.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2],
                    help="ranks per machine, one cluster each (default 1 2)")
    ap.add_argument("--recalibrate-each", action="store_true",
                    help="time each configuration's kernels (calibration.ops) right before it "
                         "runs, instead of once per cluster, bandwidth and model")
    ap.add_argument("--steps", type=int, default=10, help="training steps per real run")
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over all configurations; the medians over rounds count "
                         "(default 2)")
    ap.add_argument("--ops-steps", type=int, default=None,
                    help="timed steps per strategy and micro-batch count in calibration.ops, "
                         "taken in turns (default 5, --quick 12; millisecond steps need "
                         "hundreds)")
    ap.add_argument("--max-bytes", default="32MB",
                    help="largest collective the calibration measures (calibration.profile)")
    ap.add_argument("--quick", action="store_true",
                    help="CI size: gpt:small, ddp and megatron, 1gbit, 2 hosts of 1 rank, 8 steps "
                         "per run (3 of warm-up), 12 calibration steps")
    ap.add_argument("--out", type=Path, default=outputs.default_out("accuracy"),
                    help="folder for accuracy.csv, accuracy.json, accuracy.png and the profiles "
                         "(default out/accuracy, git-ignored)")
    ap.add_argument("--combine", nargs="+", type=Path, metavar="FOLDER", default=None,
                    help="run nothing: report the configurations of earlier runs' folders "
                         "(each with the accuracy.csv a run wrote) as one table, and write it "
                         "to --out; the run flags above are then not used")
    ap.add_argument("--repredict", action="store_true",
                    help="with --combine: predict every configuration again with this version's "
                         "simulator, from the profile and plan its run kept in its folder (the "
                         "measured times stay): what a change to the simulator does to runs "
                         "already measured")
    ap.add_argument("--max-median-error", type=float, default=None,
                    help="exit 1 when the median absolute error exceeds this fraction (CI: 0.10)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.strategies = ["gpt:small"], ["ddp", "megatron"]
        args.bandwidths, args.ranks_per_host, args.hosts = ["1gbit"], [1], [2]
        args.steps, args.warmup = 8, 3
    if args.ops_steps is None:
        args.ops_steps = 12 if args.quick else 5
    bad = sorted(set(args.strategies) - set(STRATEGIES + MESH_STRATEGIES))
    if bad:
        ap.error(f"--strategies {bad}: choose from {list(STRATEGIES + MESH_STRATEGIES)}")
    for rate in args.bandwidths:
        try:
            parse_rate(rate)
        except ValueError as exc:
            ap.error(str(exc))
    for flag in ("rounds", "ops_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    gate = args.max_median_error
    if gate is not None and not (math.isfinite(gate) and gate >= 0):
        ap.error(f"--max-median-error {gate}: give a finite fraction >= 0, e.g. 0.10 for 10%")
    outputs.refuse_quick_into_results(ap, args.out, args.quick, "accuracy")
    if args.repredict and not args.combine:
        ap.error("--repredict re-predicts earlier runs: give their folders with --combine")
    if args.combine and args.out.resolve() in {f.resolve() for f in args.combine}:
        ap.error(f"--out {args.out} is one of the --combine folders: its accuracy.csv would be "
                 f"overwritten; give another --out")
    return args


def is_moe(model: str) -> bool:
    return "moe" in model or "switch" in model


# -- where a run keeps its profiles and plans (a re-prediction finds them by these names) -------

def base_path(folder: Path, hosts: int, ranks_per_host: int, bandwidth: str) -> Path:
    """The cluster's profile (calibration.profile)."""
    return folder / f"profile-{hosts}x{ranks_per_host}-{bandwidth}.json"


def kernels_path(folder: Path, base: Path, model: str, tag: str = "") -> Path:
    """`base` with the model's kernels (calibration.ops)."""
    return folder / f"{base.stem}-{model.replace(':', '-')}{tag}.json"


def plan_path(folder: Path, model: str, profile: Path) -> Path:
    """The plan searched with `profile`."""
    return folder / f"plan-{model.replace(':', '-')}-{profile.stem}.json"


def mesh_plan_path(folder: Path, model: str, name: str, hosts: int, ranks_per_host: int) -> Path:
    """The plan file of 2-D strategy `name`."""
    return folder / f"plan-{model.replace(':', '-')}-{name}-{hosts}x{ranks_per_host}.json"


def saved_inputs(folder: Path, row: Row) -> tuple[Path, str]:
    """The profile that a calibrated-once run in `folder` predicted `row` from and the strategy
    argument it ran (the searched or 2-D plan's file), as model_profile named them."""
    base = base_path(folder, row.hosts, row.ranks_per_host, row.bandwidth)
    kernels = kernels_path(folder, base, row.model)
    searched = kernels_path(folder, kernels, row.model, "-searched")
    profile = searched if searched.is_file() else kernels
    arg = str(plan_path(folder, row.model, kernels)) if row.strategy == "searched" else \
        str(mesh_plan_path(folder, row.model, row.strategy, row.hosts, row.ranks_per_host)) \
        if row.strategy in ACROSS else row.strategy
    for path in (profile, Path(arg) if arg != row.strategy else None):
        if path is not None and not path.is_file():
            raise ValueError(f"--repredict {folder}: {row.model} {row.strategy} on "
                             f"{row.cluster} was predicted from {path}, which is not there; "
                             f"re-predict only folders a run wrote, with their profiles and "
                             f"plans")
    return profile, arg


def repredicted(row: Row, folder: Path) -> Row:
    """`row` predicted again by this version's simulator from the profile and plan its run saved
    (the measured times stay as they were)."""
    profile, arg = saved_inputs(folder, row)
    result, coverage = predict(row.model, arg, row.k, profile, row.hosts * row.ranks_per_host)
    return replace(row, predicted_ms=result.step_time * 1e3,
                   predicted_computation_ms=result.computation * 1e3,
                   predicted_communication_ms=result.communication * 1e3,
                   predicted_overlap=result.overlap_ratio, kernels_measured=coverage)


def speed_probe_ms(repeats: int = 5) -> float:
    """The machine's speed now: the median time (ms) of a fixed workload (matmuls, GELU and
    layer norm at a small model's sizes, on one thread as each rank runs). Timed in this process
    while no cluster command runs, before and after the kernels' calibration and each run, so
    that a configuration's error can be told apart from the machine's drift between them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x0, w = torch.randn(256, 512, generator=gen), torch.randn(512, 512, generator=gen) / 23
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x = x0
            for _ in range(10):
                x = torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ w), (512,))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        torch.set_num_threads(threads)


def probed(work):
    """work()'s result and the speed probe's mean before and after it (ms)."""
    before = speed_probe_ms()
    result = work()
    return result, (before + speed_probe_ms()) / 2


def calibrate(cluster: Cluster, args, folder: Path) -> Path:
    """calibration.profile on the cluster as it is now: the profile file."""
    out = base_path(folder, cluster.hosts, cluster.ranks_per_host, cluster.bandwidth)
    # one rank has nothing to communicate with: its kernels on the CPU profile's collectives
    base = ["--base", ONE_RANK_BASE] if cluster.world == 1 else []
    _cluster_run(cluster, ["-m", "calibration.profile", "--out", str(out), "--repeats", "3",
                           "--max-bytes", args.max_bytes, *base], "calibration.profile")
    return out


@functools.lru_cache(maxsize=None)
def captured(model: str, world: int):
    """The model's graph at its batch for `world` ranks (captured once per experiment)."""
    spec = get_model(model, gpus=world)
    return spec, capture_model(spec, spec.batch)


def plan_for(model: str, profile_path: Path, world: int, folder: Path) -> Path:
    """The searched plan for this cluster (hidup.planning.search with its profile): the plan
    file."""
    graph = captured(model, world)[1]
    profile = load_profile(profile_path)
    result = search(graph, world, profile, SearchOptions(k=2, optimizer=OPTIMIZER))
    path = plan_path(folder, model, profile_path)
    save_plan(path, graph, result.strategy, world, model, profile.name, optimizer=OPTIMIZER)
    return path


def measure_kernels(cluster: Cluster, model: str, strategies: list[str], base: Path,
                    folder: Path, steps: int, micro_batches=(1, 2), tag: str = "") -> Path:
    """calibration.ops on the cluster: `base` plus the model's kernels, as a new profile."""
    out = kernels_path(folder, base, model, tag)
    _cluster_run(cluster, ["-m", "calibration.ops", "--model", model, "--strategy", *strategies,
                           "--micro-batches", *map(str, micro_batches), "--base", str(base),
                           "--optimizer", OPTIMIZER, "--steps", str(steps), "--out", str(out)],
                 "calibration.ops")
    return out


def predict(model: str, strategy: str, k: int, profile_path: Path, world: int):
    spec, graph = captured(model, world)
    program = lower(graph, resolve_strategy(strategy, graph, world), world, k, spec.name,
                    optimizer=OPTIMIZER)
    profile = load_profile(profile_path)
    return expected_step(program, profile), kernel_coverage(profile, program.tasks)


def measure(cluster: Cluster, model: str, strategy: str, k: int, args) -> float:
    """Median step time (ms) of a real run after warm-up."""
    out = _cluster_run(cluster, ["-m", "hidup.train", "--model", model, "--strategy", strategy,
                                 "--micro-batches", str(k), "--steps", str(args.steps),
                                 "--warmup", str(args.warmup), "--optimizer", OPTIMIZER, "--json"],
                       "hidup.train")
    return json.loads(out.strip().splitlines()[-1])["median_step_ms"]


def run_config(cluster: Cluster, model: str, arg: str, k: int, profile: Path, world: int, args,
               calibrated_at: float):
    """One round of one configuration, predicted from `profile` and run for real; with
    --recalibrate-each its kernels are timed first (calibration.ops on `profile`), so that both
    see the machine at the same speed (this VM's speed drifts by up to a quarter within a
    minute); (prediction, ms, coverage, drift): the drift is the speed probe around the run over
    `calibrated_at`, the probe around the calibration of the kernels it was predicted from."""
    if args.recalibrate_each:
        profile, calibrated_at = probed(lambda: measure_kernels(
            cluster, model, [arg], profile, args.out, args.ops_steps, [k], tag="-run"))
    result, coverage = predict(model, arg, k, profile, world)
    measured, speed = probed(lambda: measure(cluster, model, arg, k, args))
    return result, measured, coverage, speed / calibrated_at


def _medians(runs) -> tuple:
    """A configuration's Row figures from its rounds: medians of each, the kernels' coverage, the
    fastest and slowest measurement, and the median drift."""
    med = statistics.median
    return (med([r.step_time * 1e3 for r, *_ in runs]), med([m for _, m, *_ in runs]),
            med([r.computation * 1e3 for r, *_ in runs]),
            med([r.communication * 1e3 for r, *_ in runs]),
            med([r.overlap_ratio for r, *_ in runs]), min(c for _, _, c, _ in runs),
            min(m for _, m, *_ in runs), max(m for _, m, *_ in runs),
            med([d for *_, d in runs]))


def _cluster_run(cluster: Cluster, command: list[str], what: str, tries: int = 2) -> str:
    """Host 0's stdout of a torchrun command on the cluster; a failed run is tried again once
    (a rank of this VM was seen to abort once in ~80 runs), and the failure is logged."""
    for attempt in range(1, tries + 1):
        result = cluster.run(command, capture=True, timeout=1800)
        if result.ok:
            return result.stdout[0] or ""
        log.warning("%s on the emulated cluster failed (try %d of %d): %s", what, attempt,
                    tries, result.failure())
    raise RuntimeError(f"{what} on the emulated cluster failed {tries} times: {result.failure()}")


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


def read_rows(folder: Path) -> list[Row]:
    """The configurations an earlier run wrote to `folder`/accuracy.csv."""
    path = folder / "accuracy.csv"
    if not path.is_file():
        raise ValueError(f"--combine {folder}: no accuracy.csv there; give folders an "
                         f"experiments.accuracy run wrote (its --out)")
    columns = get_type_hints(Row)  # str, int or float: each converts its column's text
    needed = {f.name for f in fields(Row) if f.default is MISSING}  # older runs lack the rest
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = sorted(needed - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(f"--combine {folder}: accuracy.csv lacks the columns {missing}; "
                             f"re-run that experiment with this version to write them")
        try:
            return [Row(**{name: kind(line[name]) for name, kind in columns.items()
                           if name in line}) for line in reader]
        except ValueError as exc:
            raise ValueError(f"--combine {folder}: line {reader.line_num} of accuracy.csv: "
                             f"{exc}") from None


def combine(folders: list[Path], repredict: bool = False) -> tuple[list[Row], list[dict]]:
    """Every configuration of the runs in `folders`, and each run's folder and command; a
    configuration measured in two of them is refused (it would count twice). With `repredict`,
    each is predicted again by this version's simulator (repredicted)."""
    rows: list[Row] = []
    seen: dict[tuple, Path] = {}
    sources = []
    for folder in folders:
        ran = _command(folder)
        if repredict and ran and "--recalibrate-each" in ran:
            raise ValueError(f"--repredict {folder}: that run timed each configuration's "
                             f"kernels right before it ran (--recalibrate-each), and those "
                             f"profiles were not kept; re-predict runs calibrated once")
        for r in read_rows(folder):
            if repredict:
                r = repredicted(r, folder)
                log.info("%s %s k=%d on %s: re-predicted %.1f ms, measured %.1f ms, error "
                         "%+.1f%%", r.model, r.strategy, r.k, r.cluster, r.predicted_ms,
                         r.measured_ms, 100 * r.error)
            key = (r.model, r.strategy, r.k, r.cluster)
            if key in seen:
                raise ValueError(f"--combine: {r.model} {r.strategy} k={r.k} on {r.cluster} is "
                                 f"in both {seen[key]} and {folder}; combine runs of different "
                                 f"configurations")
            seen[key] = folder
            rows.append(r)
        sources.append({"folder": str(folder), "command": ran,
                        **({"repredicted": True} if repredict else {})})
    if not rows:
        raise ValueError(f"--combine: no configurations in {', '.join(map(str, folders))}")
    return rows, sources


def _command(folder: Path) -> str | None:
    """The command of the run that wrote `folder` (its accuracy.json), if it says."""
    summary = folder / "accuracy.json"
    try:
        return json.loads(summary.read_text()).get("command") if summary.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"--combine {folder}: {summary} is not the summary an "
                         f"experiments.accuracy run writes ({exc}); restore or delete "
                         f"it") from None


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def model_profile(cluster: Cluster, model: str, strategies: list[str], base: Path,
                  args) -> tuple[Path, dict[str, str], dict[str, float]]:
    """The profile to predict `model`'s configurations from, each strategy's argument (the
    searched one: the plan file), and the speed probe (ms) around the calibration that timed
    each strategy's kernels. Calibrated once: the fixed strategies' kernels at k = 1 and 2
    (calibration.ops on the cluster profile `base`), the plan searched with them, and its own
    kernels added. With --recalibrate-each: `base` (each run times its kernels before it, and
    probes the speed around that)."""
    fixed = [s for s in strategies if s != "searched"]  # never empty: run_model checks
    args_of = {s: mesh_plan(model, s, cluster, args.out) if s in ACROSS else s for s in fixed}
    if args.recalibrate_each and "searched" not in strategies:
        return base, args_of, {}
    kernels, speed = probed(lambda: measure_kernels(
        cluster, model, [args_of[s] for s in fixed], base, args.out, args.ops_steps))
    calibrated_at = dict.fromkeys(fixed, speed)
    profile = base if args.recalibrate_each else kernels
    if "searched" in strategies:  # the search needs the model's kernels
        plan = plan_for(model, kernels, cluster.world, args.out)
        args_of["searched"] = str(plan)
        calibrated_at["searched"] = speed
        if not args.recalibrate_each:
            profile, calibrated_at["searched"] = probed(lambda: measure_kernels(
                cluster, model, [str(plan)], kernels, args.out, args.ops_steps,
                tag="-searched"))
    return profile, args_of, calibrated_at


def mesh_plan(model: str, name: str, cluster: Cluster, folder: Path) -> str:
    """The plan file of a 2-D strategy of ACROSS on the cluster's hosts x ranks per host (a
    strategy name alone does not carry the mesh)."""
    graph = captured(model, cluster.world)[1]
    strategy = fixed_strategy(name, graph, cluster.world, cluster.hosts)
    path = mesh_plan_path(folder, model, name, cluster.hosts, cluster.ranks_per_host)
    save_plan(path, graph, strategy, cluster.world, model, optimizer=OPTIMIZER)
    return str(path)


def runnable(model: str, strategies: list[str], cluster: Cluster) -> list[str]:
    """The strategies that lower for `model` on the cluster's ranks at k = 1 and 2 (the others
    are logged with the reason and left out, e.g. a batch that does not split into 3 ranks, or
    a 2-D strategy on one rank per host)."""
    world = cluster.world
    spec, graph = captured(model, world)
    out = []
    for s in strategies:
        try:
            if s in ACROSS and cluster.ranks_per_host < 2:
                raise ValueError("a 2-D mesh needs 2 or more ranks per host")
            strategy = fixed_strategy(s, graph, world, cluster.hosts) if s in ACROSS else \
                None if s == "searched" else resolve_strategy(s, graph, world)
            if strategy is not None:
                for k in (1, 2):
                    lower(graph, strategy, world, k, spec.name)
            out.append(s)
        except ValueError as exc:
            log.warning("%s %s on %d ranks left out: %s", model, s, world, exc)
    return out


def run_model(cluster: Cluster, model: str, base: Path, args, started: float) -> list[Row]:
    """Every configuration of `model` on the cluster as it is now, over --rounds rounds."""
    strategies = runnable(model, [s for s in args.strategies
                                  if s not in ("expert", "dp-expert") or is_moe(model)], cluster)
    if not [s for s in strategies if s != "searched"]:
        log.warning("%s: no strategy runs on %d ranks; left out", model, cluster.world)
        return []
    profile, args_of, calibrated_at = model_profile(cluster, model, strategies, base, args)
    configs = [(s, k) for s in strategies for k in (1, 2)]
    seen: dict = {c: [] for c in configs}
    for round_ in range(args.rounds):
        for strategy, k in configs:
            seen[(strategy, k)].append(run_config(cluster, model, args_of[strategy], k, profile,
                                                  cluster.world, args,
                                                  calibrated_at.get(strategy, math.nan)))
            pred, measured, _, drift = seen[(strategy, k)][-1]
            log.info("[%.0f s] round %d/%d: %s %s k=%d on %s: predicted %.1f ms, measured "
                     "%.1f ms (the machine's speed probe %+.1f%% against the kernels' "
                     "calibration)", time.perf_counter() - started, round_ + 1, args.rounds,
                     model, strategy, k, cluster.bandwidth, pred.step_time * 1e3, measured,
                     100 * (drift - 1))
    rows = []
    for (strategy, k), runs in seen.items():
        rows.append(Row(model, strategy, k, cluster.bandwidth, cluster.hosts,
                        cluster.ranks_per_host, *_medians(runs)))
        r = rows[-1]
        log.info("%s %s k=%d on %s: predicted %.1f ms, measured %.1f ms, error %+.1f%%", model,
                 strategy, k, r.cluster, r.predicted_ms, r.measured_ms, 100 * r.error)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    started = time.perf_counter()
    command = "python -m experiments.accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.combine:
        try:
            rows, sources = combine(args.combine, args.repredict)
        except ValueError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        return report(rows, args, command, started, sources)
    try:
        for hosts in args.hosts:
            for rph in args.ranks_per_host:
                with emulated(hosts, rph, args.bandwidths[0]) as cluster:
                    for bandwidth in args.bandwidths:
                        cluster.set_link(bandwidth)
                        base = calibrate(cluster, args, args.out)
                        log.info("[%.0f s] %d hosts x %d ranks, %s: calibrated (%s)",
                                 time.perf_counter() - started, hosts, rph, bandwidth, base)
                        for model in args.models:
                            rows += run_model(cluster, model, base, args, started)
                            if rows:  # what is measured so far is kept if a later run fails
                                write_outputs(rows, summarize(rows), args.out, command)
    except (ClusterError, RuntimeError, ValueError) as exc:
        print(f"{PROG}: {exc}" + (f" (the {len(rows)} configurations measured before it are in "
                                  f"{args.out / 'accuracy.csv'})" if rows else ""),
              file=sys.stderr)
        return 2
    if not rows:
        print(f"{PROG}: no configuration could run", file=sys.stderr)
        return 2
    return report(rows, args, command, started)


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


if __name__ == "__main__":
    sys.exit(main())
