"""The search's reward for one candidate on one problem (shared/measuring.md, Reward).

    reward = speedup - length_penalty - error_penalty, never below 0; 0 for any failed check

speedup = best baseline time / candidate time, both measured in the mode being tuned (the same
clock, ideally the same timing session). The penalties are small on purpose (0.10 at most in
all, typically under 0.01): they break ties between kernels of about equal speed in favour of
short, accurate code, as in CUDA-L2, and never outweigh a speed difference of more than 10% of
the baseline's time.

Pure Python: no torch, no GPU, so policies and tests can call it anywhere.
"""

from __future__ import annotations

import math

# Code length. Rendered kernels are 9-11 kB today (CUTLASS ~9 kB, raw ~10.6 kB): they pay
# 0.001-0.003. An LLM-written kernel that balloons to 58 kB pays the cap.
LENGTH_FREE_BYTES = 8 * 1024  # no penalty up to this many bytes of source
LENGTH_PENALTY_PER_10KB = 0.01  # per 10 KiB beyond the free allowance
LENGTH_PENALTY_CAP = 0.05

# Numerical error, relative to the reference library's own error on the same inputs. verify()
# already rejects anything over 2x the reference (REF_FACTOR), so a passing fp32-accumulate
# kernel pays at most 0.02; fp16-accumulate problems, judged against a fixed bound, may pay
# up to the cap.
ERROR_PENALTY_SLOPE = 0.02  # per unit of (rel_err / ref_err - 1)
ERROR_PENALTY_CAP = 0.05
ERROR_FLOOR = 1e-4  # ref_err below this (tiny K, exact sums) counts as this: verify's REF_FLOOR


def length_penalty(source_len: int | None) -> float:
    if not source_len or source_len <= LENGTH_FREE_BYTES:
        return 0.0
    over = (source_len - LENGTH_FREE_BYTES) / (10 * 1024)
    return min(LENGTH_PENALTY_CAP, LENGTH_PENALTY_PER_10KB * over)


def error_penalty(rel_err: float | None, ref_err: float | None) -> float:
    if rel_err is None:
        return 0.0  # not measured (e.g. a simulation): no evidence either way
    if not math.isfinite(rel_err):
        return ERROR_PENALTY_CAP
    denom = max(ref_err if ref_err is not None and math.isfinite(ref_err) else 0.0, ERROR_FLOOR)
    return min(ERROR_PENALTY_CAP, ERROR_PENALTY_SLOPE * max(0.0, rel_err / denom - 1.0))


def reward(best_baseline_us: float | None, candidate_us: float | None, passed: bool,
           rel_err: float | None = None, ref_err: float | None = None,
           source_len: int | None = None) -> float:
    """0 when the candidate failed any check or has no usable time; otherwise the speedup over
    the best baseline minus the length and error penalties, floored at 0."""
    if not passed:
        return 0.0
    for t in (best_baseline_us, candidate_us):
        # a time that is missing, not finite or not positive is no evidence of speed (a
        # non-positive kernel time is physically impossible: treated as a failure, not a win)
        if t is None or not math.isfinite(t) or t <= 0:
            return 0.0
    speedup = best_baseline_us / candidate_us
    return max(0.0, speedup - length_penalty(source_len) - error_penalty(rel_err, ref_err))
