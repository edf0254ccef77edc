"""Fit a Profile's figures to measured times with scipy.optimize.least_squares on relative errors:
per collective kind a latency per step and a bus bandwidth (hidup.planning.costs.LinkCost's ring /
tree formulas), and for kernels a roofline (peak FLOP/s, memory bandwidth, per-kernel overhead, as
hidup.planning.costs.Profile.kernel_time). Pure functions on plain numbers, no torch: the
microbenchmark CLI (calibration.profile) and fits from profiler traces share them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, nnls

from hidup.planning.costs import LinkCost
from hidup.program import COLLECTIVES

_US, _NS = 1e-6, 1e-9  # fit units: alpha in microseconds, 1/beta in nanoseconds per byte


# What points can show bounds what a fit may say. A collective's time is latency steps plus its
# bytes over the bus bandwidth, so each point's bytes over its whole time is a bandwidth the link
# at least has; a fit may put at most half of even the largest message's time into latency
# (BANDWIDTH_MARGIN = 2: at most twice the fastest bandwidth any point showed): beyond that the
# points do not tell the bandwidth, only that the times are latency. And no step's latency is
# longer than the quickest point's whole time per step.
BANDWIDTH_MARGIN = 2.0
# A kernel's rates the same way, with more room: a model's kernels run well below the device's
# peak (on the shipped H100 bf16 traces the fitted FLOP rate, which the whole steps set, is 2.0x
# the fastest op kind's), so a fitted rate may be up to 4x the fastest a kernel showed.
RATE_MARGIN = 4.0


class FitError(ValueError):
    """The points cannot be fitted: none for a kind, or a point that is not a valid time."""


class BoundError(FitError):
    """A fitted figure ended on the bound its points allow: they do not determine it (times
    under load, or sizes too small to show a bandwidth). `kind`: the collective's."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Residuals:
    """How far a fit is from its points: relative errors model / measured - 1."""

    label: str
    points: int
    rms: float  # root mean square of the relative errors
    max: float  # largest absolute relative error

    def __str__(self) -> str:
        return f"{self.label}: {self.points} points, rms error {self.rms:.1%}, max {self.max:.1%}"


def residuals(label: str, predicted, measured) -> Residuals:
    """The relative errors of `predicted` against `measured` times, summed up."""
    rel = np.asarray(predicted, dtype=float) / np.asarray(measured, dtype=float) - 1.0
    return Residuals(label, len(rel), float(np.sqrt(np.mean(rel ** 2))),
                     float(np.max(np.abs(rel))))


# -- collectives -------------------------------------------------------------------------------

def fit_links(points, kinds=COLLECTIVES) -> tuple[dict[str, LinkCost], dict[str, Residuals]]:
    """One LinkCost per kind from points (kind, group size n, nbytes of the whole tensor, seconds),
    pooling all group sizes of a kind; and the residuals of each kind's fit."""
    by_kind: dict[str, list] = {kind: [] for kind in kinds}
    for point in points:
        kind, n, nbytes, seconds = point
        if kind not in by_kind:
            raise FitError(f"point {point}: unknown collective kind {kind!r}; the kinds are "
                           f"{list(kinds)}")
        if not (n >= 2 and nbytes >= 0 and seconds > 0 and math.isfinite(seconds)):
            raise FitError(f"point {point}: needs a group of n >= 2 ranks, nbytes >= 0 and a "
                           f"positive finite time in seconds")
        by_kind[kind].append((n, nbytes, seconds))
    links, report = {}, {}
    for kind, rows in by_kind.items():
        if not rows:
            raise FitError(f"no measured points for collective {kind!r}; measure it (every kind "
                           f"in {list(kinds)} needs at least one point)")
        links[kind], report[kind] = fit_link(kind, rows)
    return links, report


def _link_times(kind: str, n, nbytes, alpha: float, inv_beta: float):
    """LinkCost.time for arrays of points, with 1/beta (vectorised, same formulas)."""
    if kind == "all_reduce":
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * inv_beta
        tree = 2 * np.ceil(np.log2(n)) * alpha + 2 * nbytes * inv_beta
        return np.minimum(ring, tree)
    return (n - 1) * alpha + (n - 1) / n * nbytes * inv_beta


def fit_link(kind: str, rows) -> tuple[LinkCost, Residuals]:
    """alpha >= 0 and beta > 0 of one kind from (n, nbytes, seconds) rows, each within what the
    points can show (BANDWIDTH_MARGIN). BoundError where the bandwidth ends on its bound: the
    points show none. A latency on its bound is kept: it says the quickest point is all
    latency, which a small message nearly is, and the bandwidth still comes from the large."""
    n, nbytes, t = (np.asarray(col, dtype=float) for col in zip(*rows))
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    share = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    shown = float(np.max(share * nbytes / t))  # the fastest bus bandwidth a point showed
    if shown <= 0:
        raise FitError(f"collective {kind}: every point moves 0 bytes, which shows no bandwidth; "
                       f"measure sizes above 0 bytes")
    fewest = np.minimum(steps, 2 * np.ceil(np.log2(n))) if kind == "all_reduce" else steps
    lower = np.array([0.0, 1.0 / (BANDWIDTH_MARGIN * shown) / _NS])  # alpha (us), 1/beta (ns/B)
    upper = np.array([float(np.min(t / fewest)) / _US, np.inf])  # (all-reduce: ring or tree)
    # Start: the ring formula is linear in (alpha, 1/beta), so non-negative least squares on the
    # relative errors solves it exactly; then refine with the exact model (all-reduce's min).
    design = np.column_stack([steps * _US, share * nbytes * _NS]) / t[:, None]
    start, _ = nnls(design, np.ones_like(t))
    start = np.array([min(start[0], upper[0] * 0.999), max(start[1], lower[1] * 1.001)])

    def rel(x):
        return _link_times(kind, n, nbytes, x[0] * _US, x[1] * _NS) / t - 1.0

    fit = least_squares(rel, start, bounds=(lower, upper), x_scale="jac",
                        xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
    cost = LinkCost(float(fit.x[0] * _US), float(1.0 / (fit.x[1] * _NS)))
    if fit.x[1] <= lower[1] * (1 + 1e-6):
        raise BoundError(kind, f"collective {kind}: the fitted bus bandwidth ends on its bound "
                               f"({cost.beta / 1e9:.3g} GB/s, {BANDWIDTH_MARGIN:g}x the fastest "
                               f"of its {len(t)} points): their times are latency and show no "
                               f"bandwidth; measure larger sizes (--max-bytes) and more repeats "
                               f"(--repeats), on a quieter machine")
    predicted = [cost.time(kind, b, int(k)) for k, b in zip(n, nbytes)]  # the model itself
    return cost, residuals(kind, predicted, t)


# -- kernels -----------------------------------------------------------------------------------

def fit_roofline(points) -> tuple[float, float, float, Residuals]:
    """(FLOP/s, memory bytes/s, overhead seconds, residuals) of the roofline
    t = overhead + max(flops / F, bytes / B) fitted to points (flops, bytes, seconds)."""
    rows = []
    for point in points:
        flops, nbytes, seconds = point
        if not (flops >= 0 and nbytes >= 0 and seconds > 0 and math.isfinite(seconds)):
            raise FitError(f"kernel point {point}: needs flops >= 0, bytes >= 0 and a positive "
                           f"finite time in seconds")
        rows.append((flops, nbytes, seconds))
    if not rows:
        raise FitError("no kernel points to fit a roofline to; measure some kernels")
    f, b, t = (np.asarray(col, dtype=float) for col in zip(*rows))
    if not f.any() or not b.any():
        raise FitError("the kernel points need some with FLOPs and some with memory traffic to "
                       "fit both the FLOP rate and the memory bandwidth")
    # Start from bounds the data gives: no kernel beats the peak rates (F >= flops/t for every
    # point, B >= bytes/t), and the fastest kernel takes at least the overhead.
    start = np.array([math.log(np.max(f / t)), math.log(np.max(b / t)), 0.5 * t.min() / _US])

    def log_error(x):
        return np.log(np.maximum(_roofline(f, b, x), 1e-300) / t)  # no log(0) at overhead 0

    fit = least_squares(log_error, start, bounds=([-np.inf, -np.inf, 0.0], np.inf),
                        x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=5000)
    flops_per_s, mem_per_s, overhead = math.exp(fit.x[0]), math.exp(fit.x[1]), fit.x[2] * _US
    check_roofline(flops_per_s, mem_per_s, f, b, t)
    predicted = overhead + np.maximum(f / flops_per_s, b / mem_per_s)  # Profile.kernel_time
    return flops_per_s, mem_per_s, float(overhead), residuals("roofline", predicted, t)


def check_roofline(flops_per_s: float, mem_per_s: float, f, b, t) -> None:
    """BoundError where a fitted rate is beyond what kernel points (flops f, bytes b, seconds t)
    can show: more than RATE_MARGIN times the fastest a kernel ran."""
    for rate, work, what in ((flops_per_s, f, "FLOP rate"), (mem_per_s, b, "memory bandwidth")):
        shown = float(np.max(np.asarray(work, dtype=float) / np.asarray(t, dtype=float)))
        if rate > RATE_MARGIN * shown:
            raise BoundError("kernels", f"kernels: the fitted {what} ({rate:.3g}/s) is over "
                                        f"{RATE_MARGIN:g}x the fastest of its {len(t)} kernels "
                                        f"({shown:.3g}/s): their times do not show it; measure "
                                        f"again with more repeats (--repeats), on a quieter "
                                        f"machine")


def _roofline(f, b, x):
    """Kernel times for parameters x = (log FLOP/s, log bytes/s, overhead in microseconds)."""
    return x[2] * _US + np.maximum(f / np.exp(x[0]), b / np.exp(x[1]))
