"""Summary statistics of timing samples. Pure functions, no GPU."""

from __future__ import annotations

import math
import statistics


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    if not sorted_xs:
        raise ValueError("quantile of no samples")
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize_samples(samples_us: list[float]) -> dict:
    """median, mean, min, p10, p90, std (microseconds) and n of a list of per-call times."""
    xs = sorted(float(x) for x in samples_us)
    if not xs:
        raise ValueError("no samples to summarize")
    if any(not math.isfinite(x) or x <= 0 for x in xs):
        raise ValueError("timing samples must be finite and positive")
    return {
        "median_us": statistics.median(xs),
        "mean_us": statistics.fmean(xs),
        "min_us": xs[0],
        "p10_us": quantile(xs, 0.10),
        "p90_us": quantile(xs, 0.90),
        "std_us": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


def tflops(flops: int, time_us: float) -> float:
    return flops / (time_us * 1e-6) / 1e12


def roofline_floor_us(flops: int, min_bytes: int, matrix_tflops: float, bandwidth_gbs: float) -> float:
    """The time no implementation beats: the larger of the arithmetic and the memory term."""
    return max(flops / (matrix_tflops * 1e12), min_bytes / (bandwidth_gbs * 1e9)) * 1e6


def repeat_noise(t_first: float, t_repeat: float) -> float:
    """Relative disagreement of two timings of the same implementation."""
    return abs(t_repeat / t_first - 1.0)


def median_ci_rel(samples_us, z: float = 1.96) -> float:
    """Half-width of a distribution-free confidence interval of the median (order statistics:
    ranks n/2 -+ z*sqrt(n)/2), relative to the median; inf below 8 samples."""
    xs = sorted(float(x) for x in samples_us)
    n = len(xs)
    if n < 8:
        return math.inf
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half))
    med = statistics.median(xs)
    return (xs[hi] - xs[lo]) / 2 / med


def mean_ci_rel(samples_us, z: float = 1.96) -> float:
    """Half-width of the normal-approximation confidence interval of the mean (z * sd / sqrt(n)),
    relative to the mean; inf below 8 samples."""
    xs = [float(x) for x in samples_us]
    n = len(xs)
    if n < 8:
        return math.inf
    mean = statistics.fmean(xs)
    return z * statistics.stdev(xs) / math.sqrt(n) / mean


CI_RULES = {"median": median_ci_rel, "mean": mean_ci_rel}


def precise_enough(samples: dict, target_rel: float, z: float = 1.96, stat: str = "median") -> bool:
    """Whether every implementation's `stat` (median or mean) is known to within `target_rel`."""
    ci = CI_RULES[stat]
    return all(ci(v, z) <= target_rel for v in samples.values())
