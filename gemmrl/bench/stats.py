"""Summary statistics of timing samples. Pure functions, no GPU."""

from __future__ import annotations

import itertools
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


# A time this many times under the roofline floor is no measurement. Legitimate kernels come near
# the floor (the measured bandwidth is a copy's and a read's, and skinny GEMMs reached 1.1 of it on
# an H200); 1.5 leaves room for that and still catches a timer, a graph or a kernel that skipped
# the work (an H100 session of 2026-11-25 timed every implementation of one shape at 13-52 times
# the floor after a CUDA-L2 kernel that synchronizes the device inside each call ran among them).
BEYOND_FLOOR = 1.5


def judge_floor(problem, results: dict, peaks: dict | None, trusted: set) -> dict:
    """One timing session's results (name -> {'status', 'median_us', ...}) with every time that
    beats the physical floor by more than BEYOND_FLOOR marked 'invalid' (reason kept). If a
    trusted implementation (a library baseline, or its repeat) is among them, the whole session
    is unreliable and every result is marked. Without measured peaks, unchanged."""
    if not peaks or not peaks.get("matrix_tflops") or not peaks.get("bandwidth_gbs"):
        return results
    floor = roofline_floor_us(problem.flops, problem.min_bytes, peaks["matrix_tflops"], peaks["bandwidth_gbs"])
    bad = {n for n, r in results.items() if r.get("status") == "ok" and r.get("median_us") is not None
           and r["median_us"] * BEYOND_FLOOR < floor}
    if not bad:
        return results
    why = {n: f"{results[n]['median_us']:.3g} us is {floor / results[n]['median_us']:.1f}x faster than the "
              f"physical floor ({floor:.3g} us at {peaks['matrix_tflops']:.0f} TFLOP/s, {peaks['bandwidth_gbs']:.0f} GB/s)"
           for n in bad}
    if any(n in trusted or n.split("@")[0] in trusted for n in bad):
        names = ", ".join(sorted(bad))
        marked = set(results)
        reason = {n: f"session beyond the physical floor ({names}): its timings are not measurements"
                  + (f"; {why[n]}" if n in why else "") for n in marked}
    else:
        marked, reason = bad, why
    out = dict(results)
    for n in marked:
        r = dict(out[n])
        r["details"] = {**r.get("details", {}), "reason": reason[n], "was": r.get("status")}
        r["status"] = "invalid"
        out[n] = r
    return out


def paired_over(paired: dict, other, t_self: float, t_other: float) -> float:
    """`other`'s time over this implementation's in one session: this record's paired ratio to
    `other` (PairedRounds: the median within-round t_other / t_self; kernel protocol v3, server
    v5) where it holds a positive finite number, else the ratio of the two times."""
    r = paired.get(other) if paired else None
    if isinstance(r, (int, float)) and math.isfinite(r) and r > 0:
        return float(r)
    return t_other / t_self


def repeat_noise(t_first: float, t_repeat: float) -> float:
    """Relative disagreement of two timings of the same implementation."""
    return abs(t_repeat / t_first - 1.0)


def median_ci_rel(samples_us, z: float = 1.96) -> float:
    """Half-width of a distribution-free confidence interval of the median (order statistics:
    ranks n/2 -+ z*sqrt(n)/2), relative to the median; inf below 8 samples."""
    xs = sorted(float(x) for x in samples_us)
    if len(xs) < 8:
        return math.inf
    return _median_ci_half(xs, z) / statistics.median(xs)


def _median_ci_half(xs: list[float], z: float) -> float:
    """Half-width of the order-statistic CI of the median of sorted `xs` (8 or more values):
    ranks n/2 -+ z*sqrt(n)/2."""
    n = len(xs)
    half = z * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return (xs[hi] - xs[lo]) / 2


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


class PairedRounds:
    """Server mode's paired comparison. The calls of one round share the machine's state (every
    implementation waits the same idle gap: gaps='round'), so their times move together; the
    time of j relative to i is taken as the median over rounds of t_j / t_i within a round
    (exp of the median log-ratio), which that shared state divides out.

    Checked on 4 copies of torch.matmul timed 1,500 rounds per shape (results/logs/server-noise-
    trace-2026-11-22d.csv.gz), with known factors applied to copies (1.05; 0.8, 1.1, 1.5):
    copies agreed with the truth within 2% in 92% of 150-round chunks and all 300-round chunks,
    against 65% and 85% by the ratio of means; bias under 0.1%. (A one-pivot variant, each call
    over its round's median call, was biased by 0.7% when implementations differ.)"""

    CHECK_EVERY = 10  # rounds between precision checks (a check sorts every pair's ratios)

    def __init__(self):
        self.rounds: list[dict[str, float]] = []  # per round: name -> log(time), taken once
        self._checked_at, self._precise = -1, False

    def add_round(self, times_us: dict[str, float]) -> None:
        """One round's per-implementation times (those timed ok in it)."""
        if any(not (math.isfinite(t) and t > 0) for t in times_us.values()):
            raise ValueError("timing samples must be finite and positive")
        if times_us:
            self.rounds.append({n: math.log(t) for n, t in times_us.items()})

    def log_ratios(self, i: str, j: str) -> list[float]:
        """log(t_j / t_i) in every round that timed both."""
        return [r[j] - r[i] for r in self.rounds if i in r and j in r]

    def ratio(self, i: str, j: str) -> float | None:
        """t_j / t_i as the median of the rounds' ratios; None without a common round."""
        lr = self.log_ratios(i, j)
        return math.exp(statistics.median(lr)) if lr else None

    def ratios(self, names) -> dict[str, dict[str, float]]:
        """{i: {j: t_j / t_i}} for every ordered pair of `names` with a common round."""
        names = list(names)
        out: dict[str, dict[str, float]] = {n: {} for n in names}
        for a, b in itertools.combinations(names, 2):
            r = self.ratio(a, b)
            if r is not None:
                out[a][b], out[b][a] = r, 1.0 / r
        return out

    def precise_enough(self, names, target_rel: float, z: float = 1.96, *, fresh: bool = False) -> bool:
        """Whether every pair's median ratio is known to within `target_rel` (order-statistic CI
        of the median log-ratio); checked every CHECK_EVERY rounds, the last answer kept between
        (`fresh`: check now, on every round so far)."""
        n = len(self.rounds)
        if not fresh and n - self._checked_at < self.CHECK_EVERY and self._checked_at >= 0:
            return self._precise
        self._checked_at = n
        names = list(names)
        ok = len(names) < 2 or all(
            _log_median_ci(self.log_ratios(a, b), z) <= math.log1p(target_rel)
            for a, b in itertools.combinations(names, 2))
        self._precise = ok
        return ok


def _log_median_ci(logs: list[float], z: float) -> float:
    """Half-width of the order-statistic CI of the median of `logs`; inf below 8 values."""
    return _median_ci_half(sorted(logs), z) if len(logs) >= 8 else math.inf


# Kernel mode's precision (gemmrl bench's default since the sixteenth session): past 10 rounds, sample until
# every paired ratio (timing.KernelSettings.stat) is known to within 0.5%, for at most 3 s of
# rounds per shape. Replayed on traces of 160-200 rounds per shape on an H100 (66 shapes,
# scripts/kernel-noise.py), this rule stopped after a median 16-21 rounds (at most 34), and three
# copies of torch.matmul then agreed within 0.49%. The same target on the medians missed on 34 of
# the subset's 100 shapes within 3 s (run 137), and two medians of torch.matmul differed by 2.39%.
KERNEL_CI = 0.005
KERNEL_MAX_S = 3.0
KERNEL_MAX_ROUNDS = 400


def kernel_precision(quick: bool, kernel_ci: float | None, kernel_max_s: float | None,
                     stat: str = "paired") -> dict:
    """KernelSettings fields for `bench`'s kernel timing: the precision target on `stat` unless
    --quick (v1: 10 to 40 rounds, then 0.5 s per shape)."""
    if quick:
        return {}
    return {"target_ci": KERNEL_CI if kernel_ci is None else kernel_ci, "max_rounds": KERNEL_MAX_ROUNDS,
            "max_s": KERNEL_MAX_S if kernel_max_s is None else kernel_max_s, "stat": stat}
