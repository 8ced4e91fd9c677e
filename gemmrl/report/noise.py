"""How many rounds a host timing mode needs for two timings of one implementation to agree:
pure analysis of a trace of every sample (scripts/server-noise.py writes one; no GPU).

A trace row is (shape, gaps, round, name, time_us), several `name`s being the same call timed
under different names. For a chunk size n, the rounds are cut into consecutive chunks of n;
in each chunk every pair of names is compared by a statistic (median, mean or 10%-trimmed
mean) of its n samples, or by the paired statistic (bench.stats.PairedRounds: the median over
the chunk's rounds of the two's within-round time ratio). The disagreements |s_j / s_i - 1| over all shapes, chunks and pairs say
what a run of n rounds would report as noise.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from typing import Iterable

from gemmrl.bench.stats import PairedRounds

STATISTICS = ("median", "mean", "trimmed", "paired")


def _stat(values: list[float], stat: str) -> float:
    if stat == "median":
        return statistics.median(values)
    if stat == "mean":
        return statistics.fmean(values)
    if stat == "trimmed":
        v = sorted(values)
        k = len(v) // 10
        return statistics.fmean(v[k:len(v) - k])
    raise ValueError(f"stat must be one of {STATISTICS}, got {stat!r}")


def chunk_disagreements(rows: Iterable[dict], n: int, stat: str, *, warmup_rounds: int = 0) -> dict[str, list[float]]:
    """Per gap scheme: the relative disagreements of every pair of names within every chunk of
    `n` consecutive rounds (rounds below `warmup_rounds` left out; a chunk missing a name's
    sample is skipped)."""
    if n < 1:
        raise ValueError(f"chunk size must be >= 1, got {n}")
    if stat not in STATISTICS:
        raise ValueError(f"stat must be one of {STATISTICS}, got {stat!r}")
    data: dict = defaultdict(lambda: defaultdict(dict))  # (shape, gaps) -> name -> round -> us
    for r in rows:
        rnd = int(r["round"])
        if rnd < warmup_rounds:
            continue
        t = float(r["time_us"])
        if not t > 0:
            raise ValueError(f"time_us must be positive, got {r['time_us']!r} ({r['shape']} round {rnd})")
        data[(r["shape"], r["gaps"])][r["name"]][rnd] = t
    out: dict[str, list[float]] = defaultdict(list)
    for (_shape, gaps), per_name in sorted(data.items()):
        names = sorted(per_name)
        rounds = sorted(set().union(*(per_name[x].keys() for x in names)))
        for c0 in range(0, len(rounds) - n + 1, n):
            chunk = rounds[c0:c0 + n]
            if any(rd not in per_name[x] for x in names for rd in chunk):
                continue
            if stat == "paired":
                paired = PairedRounds()
                for rd in chunk:
                    paired.add_round({x: per_name[x][rd] for x in names})
                out[gaps] += [abs(paired.ratio(i, j) - 1) for i, j in itertools.combinations(names, 2)]
                continue
            s = {x: _stat([per_name[x][rd] for rd in chunk], stat) for x in names}
            out[gaps] += [abs(s[j] / s[i] - 1) for i, j in itertools.combinations(names, 2)]
    return dict(out)


def agreement_table(rows: list[dict], sizes: Iterable[int], stats: Iterable[str] = STATISTICS, *,
                    tolerance: float = 0.02, warmup_rounds: int = 0) -> list[dict]:
    """One row per (gaps, n, stat): pairs compared, the share within `tolerance`, median, p90
    and max disagreement."""
    table = []
    for n in sizes:
        for stat in stats:
            for gaps, d in sorted(chunk_disagreements(rows, n, stat, warmup_rounds=warmup_rounds).items()):
                if not d:
                    continue
                d = sorted(d)
                table.append({"gaps": gaps, "rounds": n, "stat": stat, "pairs": len(d),
                              "within": sum(x <= tolerance for x in d) / len(d),
                              "median": statistics.median(d), "p90": d[int(0.9 * (len(d) - 1))],
                              "max": d[-1]})
    table.sort(key=lambda r: (r["gaps"], r["rounds"], STATISTICS.index(r["stat"])))
    return table


REPEAT = "@repeat"
REPEAT_STATS = ("median", "mean", "paired")


def repeat_agreement(records: Iterable[dict], tolerance: float = 0.02) -> dict:
    """How well an implementation timed twice in one session agreed with itself, from stored
    measurement records (dicts with M, N, K, impl, mode, median_us, mean_us, status, details):
    for every mode and every '<impl>' with an '<impl>@repeat' beside it, over the shapes where
    both are ok, |t_repeat / t - 1| by the median, the mean and (server mode) the paired ratio
    the reports compare (details.paired); the share within `tolerance`, median, p90, max and the
    worst shape. Where the timing had a precision target, how many shapes met it before the cap
    (details.ci_reached). Pure: tested on the CPU."""
    by: dict[tuple, dict] = defaultdict(dict)  # (mode, shape) -> impl -> record
    for r in records:
        if r.get("status", "ok") != "ok":
            continue
        by[(r["mode"], f"{r['M']}x{r['N']}x{r['K']}")][r["impl"]] = r
    out: dict[str, dict] = {}
    for (mode, shape), recs in sorted(by.items()):
        for impl, r in recs.items():
            twin = recs.get(impl + REPEAT)
            if impl.endswith(REPEAT) or twin is None:
                continue
            entry = out.setdefault(mode, {}).setdefault(impl, {"devs": defaultdict(list), "with_target": 0,
                                                                "target_reached": 0})
            for stat in REPEAT_STATS:
                if stat == "paired":
                    ratio = (r.get("details") or {}).get("paired", {}).get(impl + REPEAT)
                    dev = None if not ratio else abs(ratio - 1.0)
                else:
                    a, b = r.get(f"{stat}_us"), twin.get(f"{stat}_us")
                    dev = abs(b / a - 1.0) if a and b else None
                if dev is not None:
                    entry["devs"][stat].append((dev, shape))
            reached = (r.get("details") or {}).get("ci_reached")
            if isinstance(reached, bool):
                entry["with_target"] += 1
                entry["target_reached"] += reached
    for mode in out:
        for impl, entry in out[mode].items():
            stats = {}
            for stat, devs in entry.pop("devs").items():
                d = sorted(devs)
                vals = [x for x, _ in d]
                stats[stat] = {"shapes": len(d), "within": sum(x <= tolerance for x in vals),
                               "share_within": sum(x <= tolerance for x in vals) / len(d),
                               "median": statistics.median(vals), "p90": vals[int(0.9 * (len(vals) - 1))],
                               "max": vals[-1], "worst": d[-1][1]}
            entry["stats"] = stats
    return out


def replay_fixed_cost(pairs: Iterable[tuple[float, float, int, int]], min_spread: float = 0.02,
                      tolerance: float = 0.02) -> dict:
    """Kernel mode's per-replay fixed cost, from one implementation timed twice in a session whose
    two graphs held different numbers of calls: pairs (t1_us, t2_us, calls1, calls2) of per-call
    times. Each replay's fixed cost X lands on the per-call time as X / calls, so
    t2 - t1 = X (1/calls2 - 1/calls1); X is fitted by least squares through the origin over the
    pairs whose 1/calls differ by more than `min_spread`. Also how many pairs disagree beyond
    `tolerance` as timed, and after X / calls is taken off each. Pure: tested on the CPU."""
    pairs = [(t1, t2, n1, n2) for t1, t2, n1, n2 in pairs if t1 > 0 and t2 > 0 and n1 >= 1 and n2 >= 1]
    spread = [(1.0 / n2 - 1.0 / n1, t2 - t1) for t1, t2, n1, n2 in pairs if abs(1.0 / n2 - 1.0 / n1) > min_spread]
    out = {"pairs": len(pairs), "fitted_on": len(spread),
           "beyond_tolerance": sum(abs(t2 / t1 - 1.0) > tolerance for t1, t2, _, _ in pairs)}
    if not spread:
        return out
    x = sum(dx * dy for dx, dy in spread) / sum(dx * dx for dx, _ in spread)
    out["fixed_cost_us"] = x
    out["beyond_tolerance_without_it"] = sum(
        abs((t2 - x / n2) / (t1 - x / n1) - 1.0) > tolerance for t1, t2, n1, n2 in pairs if t1 > x / n1 and t2 > x / n2)
    return out
