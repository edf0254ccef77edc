"""Monte-Carlo: how sure is a prediction? Simulate a Program under profiles whose figures are
perturbed at random (log-normal, spread `sigma`) and report the mean and a confidence interval."""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import Callable

from hidup.cli import number
from hidup.planning.costs import LinkCost, Profile
from hidup.program import Program
from simulator.engine import simulate
from simulator.records import Result


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # the (1 - level) / 2 quantile
    high: float
    level: float
    samples: int

    def __str__(self) -> str:
        return (f"{number(self.mean * 1e3)} ms ({self.level:.0%} interval "
                f"{number(self.low * 1e3)} - {number(self.high * 1e3)} ms, {self.samples} samples)")


def scale_times(profile: Profile, factor: Callable[[str], float]) -> Profile:
    """The profile with every time figure multiplied by a factor of its own: `factor(what)` is
    called once per figure, `what` being 'compute' (the device's FLOP/s and memory bandwidth,
    which divide, the per-kernel overhead, each measured kernel) or 'communication' (each
    collective's latency, its bus bandwidth, which divides, and its measured times: one factor
    per tier and kind)."""
    def tier(costs):
        return None if costs is None else {
            k: LinkCost(c.alpha * factor("communication"), c.beta / factor("communication"))
            for k, c in costs.items()}

    curve: dict = {}
    points = [[t, kind, n, b, sec * curve.setdefault((t, kind), factor("communication"))]
              for t, kind, n, b, sec in profile.collective_points or ()]
    kernels = {key: sec * factor("compute") for key, sec in (profile.kernels or {}).items()}
    return replace(profile, flops=profile.flops / factor("compute"),
                   mem_bandwidth=profile.mem_bandwidth / factor("compute"),
                   op_overhead=profile.op_overhead * factor("compute"),
                   collectives=tier(profile.collectives), inter_node=tier(profile.inter_node),
                   collective_points=points or None, kernels=kernels or None)


def perturb(profile: Profile, rng: random.Random, sigma: float) -> Profile:
    """Every time figure times its own log-normal factor exp(N(0, sigma))."""
    return scale_times(profile, lambda _: math.exp(rng.gauss(0.0, sigma)))


def step_time_interval(program: Program, profile: Profile, samples: int = 100,
                       sigma: float = 0.1, level: float = 0.95, seed: int = 0,
                       mode: str = "graph") -> Interval:
    """Mean and central `level` interval of the simulated step time under perturbed profiles."""
    if samples < 2 or not 0 < level < 1 or sigma < 0:
        raise ValueError(f"Monte-Carlo needs samples >= 2 (got {samples}), 0 < level < 1 (got "
                         f"{level}) and sigma >= 0 (got {sigma})")
    rng = random.Random(seed)
    times = sorted(simulate(program, perturb(profile, rng, sigma), mode=mode).step_time
                   for _ in range(samples))
    tail = (1 - level) / 2
    q = statistics.quantiles(times, n=1000, method="inclusive")
    return Interval(statistics.fmean(times), q[max(0, round(tail * 1000) - 1)],
                    q[min(998, round((1 - tail) * 1000) - 1)], level, samples)


def expected_step(program: Program, profile: Profile, samples: int = 32,
                  seed: int = 0, mode: str = "graph") -> Result:
    """The step as a real run averages it: where the profile has the measured spread of its
    kernels (calibration.ops on several ranks) and the Program several ranks, `samples` steps in
    which every rank's kernels take times drawn from that spread, so each collective waits for
    its slowest member as it does for real; the mean of their figures (the records: the first
    sample's). Else the one step the profile's means give. `mode`: the executor mode (host
    figures, where the profile has them)."""
    if program.world == 1 or not profile.kernel_quantiles:
        return simulate(program, profile, mode=mode)
    if samples < 1:
        raise ValueError(f"expected_step needs samples >= 1, got {samples}")
    rng = random.Random(seed)
    runs = [simulate(program, profile, noise=rng, mode=mode) for _ in range(samples)]
    mean = {f: statistics.fmean(getattr(r, f) for r in runs)
            for f in ("step_time", "computation", "communication", "overlap_ratio",
                      "exposed_communication")}
    return replace(runs[0], **mean, events=sum(r.events for r in runs))
