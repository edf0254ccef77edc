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


class FitError(ValueError):
    """The points cannot be fitted: none for a kind, or a point that is not a valid time."""


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
    """alpha >= 0 and beta > 0 of one kind from (n, nbytes, seconds) rows."""
    n, nbytes, t = (np.asarray(col, dtype=float) for col in zip(*rows))
    # Start: the ring formula is linear in (alpha, 1/beta), so non-negative least squares on the
    # relative errors solves it exactly; then refine with the exact model (all-reduce's min).
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    share = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    design = np.column_stack([steps * _US, share * nbytes * _NS]) / t[:, None]
    start, _ = nnls(design, np.ones_like(t))
    start = np.maximum(start, [0.0, 1e-9])  # 1/beta strictly positive: a finite bandwidth

    def rel(x):
        return _link_times(kind, n, nbytes, x[0] * _US, x[1] * _NS) / t - 1.0

    fit = least_squares(rel, start, bounds=([0.0, 1e-12], [np.inf, np.inf]), x_scale="jac",
                        xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
    cost = LinkCost(float(fit.x[0] * _US), float(1.0 / (fit.x[1] * _NS)))
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
    predicted = overhead + np.maximum(f / flops_per_s, b / mem_per_s)  # Profile.kernel_time
    return flops_per_s, mem_per_s, float(overhead), residuals("roofline", predicted, t)


def _roofline(f, b, x):
    """Kernel times for parameters x = (log FLOP/s, log bytes/s, overhead in microseconds)."""
    return x[2] * _US + np.maximum(f / np.exp(x[0]), b / np.exp(x[1]))
