"""Monte-Carlo: how sure is a prediction? Simulate a Program under profiles whose figures are
perturbed at random (log-normal, spread `sigma`) and report the mean and a confidence interval."""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

from hidup.program import Program
from simulator.engine import simulate
from hidup.profile import LinkCost, Profile


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # the (1 - level) / 2 quantile
    high: float
    level: float
    samples: int

    def __str__(self) -> str:
        return (f"{self.mean * 1e3:.4g} ms ({self.level:.0%} interval {self.low * 1e3:.4g} - "
                f"{self.high * 1e3:.4g} ms, {self.samples} samples)")


def perturb(profile: Profile, rng: random.Random, sigma: float) -> Profile:
    """Every speed and latency figure times its own log-normal factor exp(N(0, sigma))."""
    def f(x: float) -> float:
        return x * math.exp(rng.gauss(0.0, sigma))

    def tier(costs):
        return None if costs is None else {k: LinkCost(f(c.alpha), f(c.beta)) for k, c in costs.items()}

    curve = {}  # measured collective times: one factor per tier and kind
    points = [[t, kind, n, b, sec * curve.setdefault((t, kind), f(1.0))]
              for t, kind, n, b, sec in profile.collective_points or ()]
    return replace(profile, flops=f(profile.flops), mem_bandwidth=f(profile.mem_bandwidth),
                   op_overhead=f(profile.op_overhead), collectives=tier(profile.collectives),
                   inter_node=tier(profile.inter_node), collective_points=points or None)


def step_time_interval(program: Program, profile: Profile, samples: int = 100,
                       sigma: float = 0.1, level: float = 0.95, seed: int = 0) -> Interval:
    """Mean and central `level` interval of the simulated step time under perturbed profiles."""
    if samples < 2 or not 0 < level < 1 or sigma < 0:
        raise ValueError(f"Monte-Carlo needs samples >= 2 (got {samples}), 0 < level < 1 (got "
                         f"{level}) and sigma >= 0 (got {sigma})")
    rng = random.Random(seed)
    times = sorted(simulate(program, perturb(profile, rng, sigma)).step_time
                   for _ in range(samples))
    tail = (1 - level) / 2
    q = statistics.quantiles(times, n=1000, method="inclusive")
    return Interval(statistics.fmean(times), q[max(0, round(tail * 1000) - 1)],
                    q[min(998, round((1 - tail) * 1000) - 1)], level, samples)
