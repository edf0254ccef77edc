"""experiments.accuracy's real runs on the emulated cluster: calibrating it (calibration.profile,
calibration.ops), each configuration predicted and trained for real (hidup.train) over the
rounds, and the speed probe timed around each calibration and run (the machine's drift)."""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch

from experiments.accuracy_predict import (
    OPTIMIZER,
    base_path,
    kernels_path,
    mesh_plan,
    plan_for,
    predict,
    runnable,
)
from experiments.accuracy_rows import Row
from hidup.emulation.netns import Cluster
from hidup.strategy import ACROSS

log = logging.getLogger(__name__)
ONE_RANK_BASE = "cpu-gloo-loopback"  # collectives of a one-rank calibration (none are run)


def is_moe(model: str) -> bool:
    return "moe" in model or "switch" in model


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


def measure_kernels(cluster: Cluster, model: str, strategies: list[str], base: Path,
                    folder: Path, steps: int, micro_batches=(1, 2), tag: str = "") -> Path:
    """calibration.ops on the cluster: `base` plus the model's kernels, as a new profile."""
    out = kernels_path(folder, base, model, tag)
    _cluster_run(cluster, ["-m", "calibration.ops", "--model", model, "--strategy", *strategies,
                           "--micro-batches", *map(str, micro_batches), "--base", str(base),
                           "--optimizer", OPTIMIZER, "--steps", str(steps), "--out", str(out)],
                 "calibration.ops")
    return out


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
