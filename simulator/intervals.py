"""Time intervals: merging busy periods and measuring how much of a span they cover."""
from __future__ import annotations

import bisect


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def covered(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """How much of [start, end] the disjoint intervals `busy` cover."""
    total, i = 0.0, bisect.bisect_right(busy, (start, start))
    i = max(i - 1, 0)  # the interval before may reach into [start, end]
    while i < len(busy) and busy[i][0] < end:
        total += max(0.0, min(end, busy[i][1]) - max(start, busy[i][0]))
        i += 1
    return total
