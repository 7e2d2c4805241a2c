"""How the benchmarks state their figures, so that none can be misread:
a figure measured over rounds carries its spread (n, median, min-max), and a comparison
says "N x faster" or "N x slower" with N >= 1, never a ratio below 1 called faster."""
from __future__ import annotations

import statistics


def spread(values) -> dict:
    """{n, median, min, max} of the values measured over rounds."""
    values = list(values)
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def show(s: dict, unit: str, digits: int = 2) -> str:
    """'2.88 s (median of 3, 2.80-3.10)'; a single value as just '2.88 s (1 run)'."""
    value = f"{s['median']:.{digits}f} {unit}"
    if s["n"] == 1:
        return f"{value} (1 run)"
    return f"{value} (median of {s['n']}, {s['min']:.{digits}f}-{s['max']:.{digits}f})"


def faster(ours: float, theirs: float, *, higher_is_better: bool) -> str:
    """'1.39 x faster' or '1.96 x slower': ours against theirs, both rates
    (higher_is_better, GB/s) or both times (seconds)."""
    if ours <= 0 or theirs <= 0:
        return "not comparable (no time measured)"
    ratio = ours / theirs if higher_is_better else theirs / ours
    if abs(ratio - 1) < 0.005:
        return "as fast"
    return f"{ratio:.2f} x faster" if ratio > 1 else f"{1 / ratio:.2f} x slower"


def multiple(ours: float, floor: float | None, name: str) -> str:
    """'1.23 x the floor' (a time over the least time it could take); 'no floor
    measured' when there is none."""
    if floor is None or floor <= 0:
        return f"{name}: none measured"
    return f"{ours / floor:.2f} x {name}"
