"""Report stage: speedup and timing tables, summary statistics, files on disk.

Pure functions on measurement records (dicts as the store returns them); no torch, no GPU.
A record has M, N, K, dtype, acc, impl, mode ('kernel' | 'offline' | 'server'), median_us,
mean_us, min_us, p90_us, n and device. Baselines carry CUDA-L2's display names (BASELINE_IMPLS);
any other impl is a candidate; '<impl>@repeat' is a second timing of <impl> in the same run,
used only to measure noise.

Speedup = baseline time / subject time, where a time is the median in kernel and offline modes
and the mean in server mode (_Rec.time); a server-mode record of protocol v5 or a kernel-mode
record of protocol v3 carries, in details['paired'], the median within-round ratio to every
implementation timed beside it, and those ratios are used instead (_Rec.over). Tables hold floats (None for an empty cell); the CSV
writer prints them with 3 decimals as CUDA-L2's eval_results files do. Matplotlib is imported
only when plots are written, so the tables and the summary work without it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import operator
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from gemmrl.bench.stats import roofline_floor_us
from gemmrl.bench.stats import tflops as stats_tflops
from gemmrl.core.problem import Problem, ProblemError, bucket_label, size_bucket

MODES = ("kernel", "offline", "server")
REPEAT_SUFFIX = "@repeat"
BEST_BASELINE = "best-baseline"
BEST_BASELINE_ALL = "best-baseline-all"

# Baseline families in CUDA-L2's column order: (family column stem, its layouts' impl names).
# A family of two layouts gets '-tn', '-nn' and '-max' columns; a single impl gets one column.
BASELINE_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.matmul", ("torch.matmul",)),
    ("cuBLAS", ("cuBLAS-tn", "cuBLAS-nn")),
    ("cuBLASLt-heuristic", ("cuBLASLt-heuristic-tn", "cuBLASLt-heuristic-nn")),
    ("cuBLASLt-auto-tuning", ("cuBLASLt-auto-tuning-tn", "cuBLASLt-auto-tuning-nn")),
    ("cuBLASLt-exhaustive", ("cuBLASLt-exhaustive-tn", "cuBLASLt-exhaustive-nn")),
    ("torch.compile", ("torch.compile",)),
)
BASELINE_IMPLS: tuple[str, ...] = tuple(i for _, impls in BASELINE_FAMILIES for i in impls)
# measured on a subset only (optional, slow): best-baseline leaves them out, so it exists wherever
# the core baselines do; best-baseline-all takes them in, on the shapes that have all of them
OPTIONAL_BASELINE_STEMS = ("cuBLASLt-exhaustive", "torch.compile")
CORE_BASELINE_IMPLS: tuple[str, ...] = tuple(
    i for stem, impls in BASELINE_FAMILIES if stem not in OPTIONAL_BASELINE_STEMS for i in impls)

TIMES_COLUMNS = ["mnk", "M", "N", "K", "impl", "median_us", "mean_us", "p90_us", "n",
                 "tflops", "roofline_fraction", "bound"]

_REQUIRED = ("M", "N", "K", "dtype", "acc", "impl", "mode", "median_us")
_STAT_KEYS = ("count", "mean", "geomean", "median", "min", "max", "share_slower")
NOISE_TOLERANCE = 0.02
# the mode whose reports compare mean times, or paired ratios where recorded (the others compare
# medians): _Rec.time, _Rec.over
SERVER_STAT_MODE = "server"
# the modes whose records may carry paired ratios (server v5, kernel v3), which the reports prefer
PAIRED_MODES = ("kernel", "server")


class ReportError(ValueError):
    """Records or arguments the report stage cannot use; the message says which and why."""


# ----------------------------------------------------------------------------- records


def _positive_time(rec: dict, key: str, where: str, required: bool) -> float | None:
    value = rec.get(key)
    if value is None:
        if required:
            raise ReportError(f"{where}: {key} is missing")
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ReportError(f"{where}: {key}={rec.get(key)!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        if required:
            raise ReportError(f"{where}: {key}={value!r} must be a positive finite time")
        return None
    return value


def _problem(rec: dict, where: str) -> Problem:
    try:
        M, N, K = (operator.index(rec[k]) for k in ("M", "N", "K"))
        return Problem(int(M), int(N), int(K), str(rec["dtype"]), str(rec["acc"]))
    except TypeError:
        raise ReportError(f"{where}: M, N, K must be integers, got "
                          f"{rec.get('M')!r}, {rec.get('N')!r}, {rec.get('K')!r}") from None
    except ProblemError as e:
        raise ReportError(f"{where}: {e}") from None


class _Rec:
    """A checked record: its Problem, impl, mode, times and device."""

    __slots__ = ("problem", "impl", "mode", "median", "mean", "p90", "n", "device", "paired", "ci_reached",
                 "protocol")

    def __init__(self, rec: dict, index: int):
        if not isinstance(rec, dict):
            raise ReportError(f"record {index}: expected a dict, got {type(rec).__name__}")
        missing = [k for k in _REQUIRED if k not in rec]
        where = f"record {index} ({rec.get('impl', '?')} {rec.get('M', '?')}_{rec.get('N', '?')}_" \
                f"{rec.get('K', '?')} {rec.get('mode', '?')})"
        if missing:
            raise ReportError(f"{where}: missing {', '.join(missing)}")
        self.problem = _problem(rec, where)
        self.impl = str(rec["impl"])
        self.mode = str(rec["mode"])
        if not self.impl or not self.mode:
            raise ReportError(f"{where}: impl and mode must be non-empty")
        self.median = _positive_time(rec, "median_us", where, required=True)
        self.mean = _positive_time(rec, "mean_us", where, required=False)
        self.p90 = _positive_time(rec, "p90_us", where, required=False)
        n = rec.get("n")
        self.n = None if n is None else int(n)
        self.device = None if rec.get("device") is None else str(rec["device"])
        self.protocol = None if rec.get("protocol") is None else str(rec["protocol"])
        details = rec.get("details")
        # a mode timed with a precision target: whether sampling met it (False: stopped at a cap)
        reached = details.get("ci_reached") if isinstance(details, dict) else None
        self.ci_reached = reached if isinstance(reached, bool) else None
        self.paired: dict[str, float] = {}  # other impl -> t_other / t_self, in the same rounds
        raw = details.get("paired") if isinstance(details, dict) and self.mode in PAIRED_MODES else None
        if isinstance(raw, dict):
            for other in raw:
                v = _positive_time(raw, other, where, required=False)
                if v is not None:
                    self.paired[str(other)] = v

    @property
    def time(self) -> float:
        """The time the report shows: the mean in server mode (as CUDA-L2 reports it; its cold
        calls make the distribution bimodal, and the median then jumps between the modes: timed
        twice it agreed within 2% on 78% of shapes where the mean did on 94-100%), the median in
        kernel and offline modes. Ratios in server mode prefer `over`."""
        if self.mode == SERVER_STAT_MODE and self.mean is not None:
            return self.mean
        return self.median

    def over(self, other: "_Rec") -> float:
        """other's time over this one's: the median of the two's within-round ratios where this
        record has it (bench.stats.PairedRounds; server protocol v5, kernel protocol v3: the
        machine state a round's calls share, idle gaps or the clock, divides out), else the
        ratio of their times."""
        paired = self.paired.get(other.impl)
        if paired is not None:
            return paired
        return other.time / self.time


def _check(records: Iterable[dict]) -> list[_Rec]:
    """Validate every record; reject two records for one (shape, impl, mode)."""
    if records is None:
        raise ReportError("records is None")
    out, seen = [], {}
    for i, rec in enumerate(records):
        r = _Rec(rec, i)
        key = (r.problem.key(), r.impl, r.mode, r.device)
        if key in seen:
            raise ReportError(
                f"records {seen[key]} and {i} both time {r.impl} on {r.problem.mnk} "
                f"({r.problem.precision}, mode {r.mode}, device {r.device}); "
                "pass one run's records (keep one record per shape, impl and mode)")
        seen[key] = i
        out.append(r)
    return out


def _single_setting(recs: Sequence[_Rec], what: str) -> None:
    """One table compares one device and one precision; mixing them would be meaningless."""
    precisions = sorted({r.problem.precision for r in recs})
    devices = sorted({str(r.device) for r in recs})
    if len(precisions) > 1:
        raise ReportError(f"{what}: records mix precisions {precisions}; "
                          "split them first (split_records)")
    if len(devices) > 1:
        raise ReportError(f"{what}: records mix devices {devices}; split them first (split_records)")


def split_records(records: Iterable[dict]) -> dict[tuple[str | None, str], list[dict]]:
    """Group records by (device, precision tag), e.g. ('NVIDIA H100 80GB HBM3', 'F32F16F16F32'),
    so each group can go to write_results with its own prefix."""
    groups: dict[tuple[str | None, str], list[dict]] = defaultdict(list)
    for i, rec in enumerate(records):
        r = _Rec(rec, i)
        groups[(r.device, r.problem.precision)].append(rec)
    return dict(groups)


def modes_present(records: Iterable[dict]) -> list[str]:
    """Modes in the records: kernel, offline, server first (in that order), others sorted."""
    found = {str(r["mode"]) for r in records if "mode" in r}
    return [m for m in MODES if m in found] + sorted(found - set(MODES))


def _sorted_modes(found: Iterable[str]) -> list[str]:
    found = set(found)
    return [m for m in MODES if m in found] + sorted(found - set(MODES))


def _shape_sort_key(p: Problem) -> tuple:
    return (p.M, p.N, p.K, p.dtype, p.acc)


def is_baseline(impl: str) -> bool:
    return impl in BASELINE_IMPLS


def is_repeat(impl: str) -> bool:
    return impl.endswith(REPEAT_SUFFIX)


# ----------------------------------------------------------------------------- speedups


def _speedup_plan(present: set[str], subject: str | None):
    """Columns and, for each, the baseline impls whose fastest time is the column's baseline.
    Returns (columns after 'mnk', [impl tuple per column], all baseline impls present)."""
    columns, sources = [], []
    for stem, impls in BASELINE_FAMILIES:
        have = [i for i in impls if i in present]
        if not have:
            continue
        if len(impls) == 1:
            columns.append(stem)
            sources.append(tuple(have))
            continue
        for impl in have:  # CUDA-L2 order: -tn, then -nn, then -max
            columns.append(impl)
            sources.append((impl,))
        columns.append(f"{stem}-max")
        sources.append(tuple(have))
    core = tuple(i for i in CORE_BASELINE_IMPLS if i in present and i != subject)
    pool = tuple(i for i in BASELINE_IMPLS if i in present and i != subject)
    if core:
        columns.append(BEST_BASELINE)
        sources.append(core)
    if pool != core:
        columns.append(BEST_BASELINE_ALL)
        sources.append(pool)
    return columns, sources


def speedup_rows(records: Iterable[dict], subject: str, mode: str) -> tuple[list[str], list[list]]:
    """CUDA-L2's eval_results table for one mode: speedup of `subject` over each baseline.

    Columns: 'mnk', then per baseline family present in this mode, in CUDA-L2's order,
    'torch.matmul'; 'cuBLAS-tn', 'cuBLAS-nn', 'cuBLAS-max'; the cuBLASLt heuristic, auto-tuning
    and exhaustive families the same way; 'torch.compile'; then 'best-baseline' and, when an
    optional baseline (exhaustive, torch.compile: measured on a subset) is present,
    'best-baseline-all'. A '-max' cell is against the faster layout of its family (smaller time),
    'best-baseline' against the fastest of the core baselines (torch.matmul, cuBLAS, cuBLASLt
    heuristic and auto-tuning), 'best-baseline-all' against the fastest of every baseline present
    (the subject excluded if it is itself a baseline). Rows: every shape that has
    any record in this mode, sorted by M, N, K. A cell is None when the subject or any baseline it
    needs has no time for that shape ('-max' and 'best-baseline' need all of theirs, so a missing
    baseline never makes a speedup look larger).
    """
    if not subject:
        raise ReportError("speedup_rows needs a subject impl name")
    if is_repeat(subject):
        raise ReportError(f"subject {subject!r} is a repeat timing, not an implementation")
    recs = [r for r in _check(records) if r.mode == mode]
    _single_setting(recs, f"speedup_rows(mode={mode!r})")
    by: dict[tuple, dict[str, _Rec]] = defaultdict(dict)
    problems: dict[tuple, Problem] = {}
    for r in recs:
        by[r.problem.key()][r.impl] = r
        problems[r.problem.key()] = r.problem
    present = {r.impl for r in recs}
    cols, sources = _speedup_plan(present, subject)
    rows = []
    for key in sorted(problems, key=lambda k: _shape_sort_key(problems[k])):
        t = by[key]
        row: list = [problems[key].mnk]
        subj = t.get(subject)
        for impls in sources:
            if subj is None or any(i not in t for i in impls):
                row.append(None)
            else:
                row.append(min(subj.over(t[i]) for i in impls))
        rows.append(row)
    return ["mnk"] + cols, rows


def versus_rows(records: Iterable[dict], subject: str, other: str) -> tuple[list[str], list[list]]:
    """Head to head: the speedup of `subject` over one other implementation (a seed system such as
    'cuda-l2', or any impl), per shape, one column per mode where either has records (kernel,
    offline, server order). A cell is other's median / subject's median, None unless both have a
    time for that shape and mode. Rows: shapes with any record of either, in M, N, K order."""
    if not subject or not other or subject == other:
        raise ReportError(f"versus_rows needs two different impls, got {subject!r} and {other!r}")
    recs = [r for r in _check(records) if r.impl in (subject, other)]
    _single_setting(recs, "versus_rows")
    modes = _sorted_modes(r.mode for r in recs)
    by: dict[tuple, dict[tuple[str, str], _Rec]] = defaultdict(dict)
    problems: dict[tuple, Problem] = {}
    for r in recs:
        by[r.problem.key()][(r.impl, r.mode)] = r
        problems[r.problem.key()] = r.problem
    rows = []
    for key in sorted(problems, key=lambda k: _shape_sort_key(problems[k])):
        t = by[key]
        row: list = [problems[key].mnk]
        for mode in modes:
            s, o = t.get((subject, mode)), t.get((other, mode))
            row.append(None if s is None or o is None else s.over(o))
        rows.append(row)
    return ["mnk"] + modes, rows


def family_breakdown(records: Iterable[dict], subject: str, family_of: dict, mode: str = "kernel",
                     column: str = "cuBLASLt-auto-tuning-max") -> dict:
    """Where each kernel family wins and loses: the subject's speedup in `column`, grouped by
    the family of the winner on each shape (`family_of`: mnk -> family) and by FLOPs bucket.
    {family: {'all': stats, 'buckets': {label: stats}}}; shapes without a family are left out."""
    columns, rows = speedup_rows(records, subject, mode)
    if column not in columns:
        return {}
    j = columns.index(column)
    per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        fam = family_of.get(row[0])
        if fam is None or row[j] is None:
            continue
        per[fam][size_bucket(_mnk_problem(row[0]).flops)].append(row[j])
    out = {}
    for fam in sorted(per):
        allv = [v for vals in per[fam].values() for v in vals]
        out[fam] = {"all": _stats(allv),
                    "buckets": {bucket_label(b): _stats(per[fam][b]) for b in sorted(per[fam])}}
    return out


def write_versus(records: Iterable[dict], out_dir: str | os.PathLike, subject: str, other: str,
                 prefix: str, provenance: dict | None = None) -> list[Path]:
    """'<prefix>_vs_<other>.csv' (versus_rows) and '<prefix>_vs_<other>_summary.json': per mode
    the statistics of the subject's speedup over `other` (share_slower: shapes where the subject
    is the slower one), and how many shapes each has alone (the other rejected or missing)."""
    records = list(records)
    columns, rows = versus_rows(records, subject, other)
    stem = f"{prefix}_vs_{other.replace('.', '_').replace(':', '_').replace('/', '_')}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = [r for r in _check(records) if r.impl in (subject, other)]
    summary: dict[str, Any] = {"subject": subject, "versus": other, "provenance": provenance or {},
                               "modes": {}}
    for j, mode in enumerate(columns[1:], 1):
        have = {impl: {r.problem.key() for r in recs if r.impl == impl and r.mode == mode}
                for impl in (subject, other)}
        summary["modes"][mode] = {
            **_stats([row[j] for row in rows]),
            f"only_{subject}": len(have[subject] - have[other]),
            f"only_{other}": len(have[other] - have[subject]),
        }
    return [write_csv(out_dir / f"{stem}.csv", columns, rows),
            write_json(out_dir / f"{stem}_summary.json", summary)]


def _mnk_problem(mnk: str, like: Problem | None = None) -> Problem:
    M, N, K = (int(x) for x in mnk.split("_"))
    if like is None:
        return Problem(M, N, K)
    return Problem(M, N, K, like.dtype, like.acc)


# ----------------------------------------------------------------------------- times


def _check_peaks(peaks: dict | None) -> tuple[float, float] | None:
    if peaks is None:
        return None
    try:
        tf, bw = float(peaks["matrix_tflops"]), float(peaks["bandwidth_gbs"])
    except (KeyError, TypeError, ValueError):
        raise ReportError("peaks must be {'matrix_tflops': float, 'bandwidth_gbs': float}, "
                          f"got {peaks!r}") from None
    if not (math.isfinite(tf) and tf > 0 and math.isfinite(bw) and bw > 0):
        raise ReportError(f"peaks must be positive and finite, got {peaks!r}")
    return tf, bw


def roofline(problem: Problem, median_us: float, peaks: dict) -> tuple[float, str]:
    """(fraction of the roofline reached, 'compute' | 'memory'): floor time / measured time,
    floor = max(flops / peak matrix rate, min_bytes / peak bandwidth)."""
    tf, bw = _check_peaks(peaks)
    floor_us = roofline_floor_us(problem.flops, problem.min_bytes, tf, bw)
    compute_bound = problem.flops / (tf * 1e12) >= problem.min_bytes / (bw * 1e9)
    return floor_us / median_us, ("compute" if compute_bound else "memory")


def _impl_sort_key(impl: str) -> tuple:
    if impl in BASELINE_IMPLS:
        return (0, BASELINE_IMPLS.index(impl), impl)
    return (1, 0, impl)  # candidates alphabetically; 'x@repeat' right after 'x'


def times_rows(records: Iterable[dict], mode: str, peaks: dict | None) -> tuple[list[str], list[list]]:
    """One row per (shape, impl) in `mode`: TIMES_COLUMNS. tflops from the median; roofline
    fraction and bound are None when peaks is None. Sorted by M, N, K, then baselines in CUDA-L2's
    order, then other impls by name. Repeat timings are kept (as their own impl)."""
    pk = _check_peaks(peaks)
    recs = [r for r in _check(records) if r.mode == mode]
    _single_setting(recs, f"times_rows(mode={mode!r})")
    recs.sort(key=lambda r: (_shape_sort_key(r.problem), _impl_sort_key(r.impl)))
    rows = []
    for r in recs:
        p = r.problem
        tflops = stats_tflops(p.flops, r.time)
        frac, bound = (None, None) if pk is None else roofline(p, r.time, peaks)
        rows.append([p.mnk, p.M, p.N, p.K, r.impl, r.median, r.mean, r.p90, r.n,
                     tflops, frac, bound])
    return list(TIMES_COLUMNS), rows


# ----------------------------------------------------------------------------- statistics


def _stats(values: Sequence[float]) -> dict:
    """count, mean, geomean (exp of mean log), median, min, max, share_slower (< 1)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"count": 0}
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ReportError("speedups must be positive and finite")
    return {
        "count": int(v.size),
        "mean": float(np.mean(v)),
        "geomean": float(np.exp(np.mean(np.log(v)))),
        "median": float(np.median(v)),
        "min": float(np.min(v)),
        "max": float(np.max(v)),
        "share_slower": float(np.mean(v < 1.0)),
    }


def geomean(values: Iterable[float]) -> float:
    """exp(mean(log(values))); ReportError for an empty or non-positive input."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0 or np.any(~np.isfinite(v)) or np.any(v <= 0):
        raise ReportError("geomean needs one or more positive finite values")
    return float(np.exp(np.mean(np.log(v))))


def _column_summary(columns: list[str], rows: list[list], like: Problem | None) -> dict:
    out = {}
    for j, col in enumerate(columns):
        if col == "mnk":
            continue
        values = [row[j] for row in rows]
        entry = _stats(values)
        per_bucket: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            if row[j] is not None:
                per_bucket[size_bucket(_mnk_problem(row[0], like).flops)].append(row[j])
        entry["buckets"] = {bucket_label(b): {"bucket": b, **_stats(per_bucket[b])}
                            for b in sorted(per_bucket)}
        out[col] = entry
    return out


def _noise(recs: Sequence[_Rec]) -> dict:
    """Per mode, per '<impl>@repeat': |t_repeat / t - 1| over shapes timed both ways (server
    and kernel modes: the paired ratio where recorded, _Rec.over)."""
    by = defaultdict(dict)  # (mode, shape key) -> impl -> record
    for r in recs:
        by[(r.mode, r.problem.key())][r.impl] = r
    out: dict[str, dict] = {}
    pairs = sorted({(r.mode, r.impl[: -len(REPEAT_SUFFIX)]) for r in recs if is_repeat(r.impl)})
    for mode in _sorted_modes(m for m, _ in pairs):
        out[mode] = {}
        for _, impl in [p for p in pairs if p[0] == mode]:
            devs = [(abs(t[impl].over(t[impl + REPEAT_SUFFIX]) - 1.0), t[impl].problem.mnk)
                    for (m, _k), t in by.items()
                    if m == mode and impl in t and impl + REPEAT_SUFFIX in t]
            if not devs:
                out[mode][impl] = {"count": 0}
                continue
            d = np.asarray([x for x, _ in devs])
            out[mode][impl] = {
                "count": int(d.size),
                "median": float(np.median(d)),
                "p90": float(np.percentile(d, 90)),
                "max": float(np.max(d)),
                "share_within_2pct": float(np.mean(d <= NOISE_TOLERANCE)),
                "worst": max(devs)[1],
            }
    return out


def _precision(recs: Sequence[_Rec]) -> dict:
    """Per mode: of the shapes timed with a precision target (records with `ci_reached`),
    how many stopped at a cap before meeting it, and which (a shape counts as reached only if
    every record of it says so)."""
    by: dict[str, dict] = defaultdict(dict)  # mode -> shape -> reached
    for r in recs:
        if r.ci_reached is None:
            continue
        key = r.problem.mnk
        by[r.mode][key] = by[r.mode].get(key, True) and r.ci_reached
    out = {}
    for mode in _sorted_modes(by):
        missed = sorted(k for k, ok in by[mode].items() if not ok)
        out[mode] = {"shapes_with_target": len(by[mode]), "target_not_reached": len(missed),
                     "not_reached": missed}
    return out


def _protocols(recs: Sequence[_Rec], subject: str) -> dict:
    """Per mode: how many shapes the subject's records timed under each measuring protocol (the
    store's `protocol`, e.g. 'offline:v2' or 'offline:v3:ci=0.005'). A mode whose shapes come
    from sessions of different protocols mixes yardsticks: retime the older ones before reading
    a change between reports as a change in the kernels."""
    by: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for r in recs:
        if r.impl == subject and r.protocol is not None:
            by[r.mode][r.protocol] += 1
    return {mode: dict(sorted(by[mode].items())) for mode in _sorted_modes(by)}


def _roofline_summary(recs: Sequence[_Rec], peaks: dict) -> dict:
    """Per mode, per impl: median and max roofline fraction, and the shapes beyond the physical
    floor (fraction > 1: a timing or correctness problem, or peaks measured too low)."""
    out: dict[str, dict] = {}
    for mode in _sorted_modes(r.mode for r in recs):
        per_impl: dict[str, list] = defaultdict(list)
        for r in recs:
            if r.mode == mode and not is_repeat(r.impl):
                frac, bound = roofline(r.problem, r.time, peaks)
                per_impl[r.impl].append((frac, bound, r.problem.mnk))
        out[mode] = {}
        for impl in sorted(per_impl, key=_impl_sort_key):
            f = np.asarray([x[0] for x in per_impl[impl]])
            out[mode][impl] = {
                "count": int(f.size),
                "median_fraction": float(np.median(f)),
                "max_fraction": float(np.max(f)),
                "memory_bound_shapes": sum(1 for x in per_impl[impl] if x[1] == "memory"),
                "beyond_floor": [x[2] for x in per_impl[impl] if x[0] > 1.0],
            }
    return out


def summarize(records: Iterable[dict], subject: str | None, peaks: dict | None = None) -> dict:
    """Summary of a run, JSON-ready (no NaN; absent statistics are omitted).

    {'subject', 'modes': {mode: {'shapes', 'columns': {column: {count, mean, geomean, median,
    min, max, share_slower, 'buckets': {label: {bucket, ...same stats}}}}}},
     'noise': {mode: {impl: {count, median, p90, max, share_within_2pct, worst}}},
     'precision': {mode: {shapes_with_target, target_not_reached, not_reached}}  (only where
     host timing had a precision target),
     'protocols': {mode: {protocol: shapes}}  (the subject's records, where they name one),
     'roofline': {mode: {impl: {...}}}  (only with peaks)}.
    Modes are those where the subject has records; with subject None, 'modes' is empty."""
    records = list(records)
    recs = _check(records)
    out: dict[str, Any] = {"subject": subject, "modes": {}}
    if subject is not None:
        for mode in _sorted_modes(r.mode for r in recs if r.impl == subject):
            cols, rows = speedup_rows(records, subject, mode)
            like = next(r.problem for r in recs if r.mode == mode)
            out["modes"][mode] = {
                "shapes": sum(1 for row in rows if any(v is not None for v in row[1:])),
                "columns": _column_summary(cols, rows, like),
            }
    out["noise"] = _noise(recs)
    if precision := _precision(recs):
        out["precision"] = precision
    if subject is not None and (protocols := _protocols(recs, subject)):
        out["protocols"] = protocols
    if peaks is not None:
        _check_peaks(peaks)
        out["roofline"] = _roofline_summary(recs, peaks)
    return out


# ----------------------------------------------------------------------------- files


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False) -> Path:
    """Write `path` via a temp file in the same folder and os.replace: readers see the old file
    or the whole new one, and a failure leaves no temp file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else
                                                        {"newline": "", "encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


# Speedups and microseconds: 3 decimals (CUDA-L2's format). TFLOP/s and roofline fractions span
# orders of magnitude (tiny shapes reach 0.03 TFLOP/s): 4 significant digits instead.
_CELL_FORMAT = {"tflops": ".4g", "roofline_fraction": ".4g"}


def _cell(value: Any, column: str) -> str:
    if value is None:
        return ""
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return ""
        return format(float(value), _CELL_FORMAT.get(column, ".3f"))
    return str(value)


def table_csv(columns: list[str], rows: list[list]) -> str:
    """CSV text: floats with 3 decimals (tflops and roofline_fraction: 4 significant digits),
    empty cells for None."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([_cell(v, c) for v, c in zip(row, columns)])
    return buf.getvalue()


def write_csv(path: str | os.PathLike, columns: list[str], rows: list[list]) -> Path:
    """The table as CSV at `path`; gzip-compressed where `path` ends in .gz (deterministic: no
    name or time in the header, so the same table gives the same bytes)."""
    text = table_csv(columns, rows)
    if str(path).endswith(".gz"):
        import gzip

        data = gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
        return atomic_write(path, lambda f: f.write(data), binary=True)
    return atomic_write(path, lambda f: f.write(text))


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python, tuples -> lists, other objects -> str."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (bool, type(None), str)):
        return obj
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return x if math.isfinite(x) else None
    return str(obj)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    text = json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n"
    return atomic_write(path, lambda f: f.write(text))


def write_results(records: Iterable[dict], out_dir: str | os.PathLike, subject: str | None,
                  peaks: dict | None, provenance: dict | None, prefix: str,
                  plots: bool = True) -> list[Path]:
    """Write one run's report into out_dir; return the paths written.

    Per mode: '<prefix>_speedup_<mode>.csv' (modes where the subject has records; none when
    subject is None) and '<prefix>_times_<mode>.csv.gz' (gzip; an uncompressed one of an earlier
    report is removed); then '<prefix>_summary.json' (subject, prefix,
    provenance, peaks and summarize()); then, unless subject is None or plots is False, PNGs
    beside them (see plots.py): '<prefix>_speedup_vs_flops.png',
    '<prefix>_speedup_distribution.png' (when the subject has records) and '<prefix>_tflops.png'.
    With subject None only the times CSVs and the summary (noise, roofline) are written.
    Records must be one device and one precision (split_records). Every file is written to a
    temp file and renamed into place."""
    if not prefix or "/" in prefix or os.sep in prefix:
        raise ReportError(f"prefix must be a plain file-name stem, got {prefix!r}")
    records = list(records)
    recs = _check(records)
    _single_setting(recs, "write_results")
    _check_peaks(peaks)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    modes = _sorted_modes(r.mode for r in recs)
    speedups: dict[str, tuple[list[str], list[list]]] = {}
    if subject is not None:
        for mode in _sorted_modes(r.mode for r in recs if r.impl == subject):
            speedups[mode] = speedup_rows(records, subject, mode)
            written.append(write_csv(out_dir / f"{prefix}_speedup_{mode}.csv", *speedups[mode]))
    times: dict[str, tuple[list[str], list[list]]] = {}
    for mode in modes:
        times[mode] = times_rows(records, mode, peaks)
        # every implementation's times per shape: the bulk of a report, for programs to read, so
        # compressed (a fifth of the size; the committed results must fit a device call's carry)
        written.append(write_csv(out_dir / f"{prefix}_times_{mode}.csv.gz", *times[mode]))
        stale = out_dir / f"{prefix}_times_{mode}.csv"  # written uncompressed before
        if stale.exists():
            stale.unlink()

    summary = {"prefix": prefix, "provenance": provenance or {}, "peaks": peaks}
    summary.update(summarize(records, subject, peaks))
    written.append(write_json(out_dir / f"{prefix}_summary.json", summary))  # one per subject

    if plots and subject is not None and recs:
        from gemmrl.report import plots as _plots  # matplotlib only when plotting

        device = (provenance or {}).get("device") or next(
            (r.device for r in recs if r.device), None)
        if speedups:
            written.append(_plots.plot_speedup_vs_flops(
                speedups, out_dir / f"{prefix}_speedup_vs_flops.png", subject=subject, device=device))
            written.append(_plots.plot_distribution(
                speedups, out_dir / f"{prefix}_speedup_distribution.png", subject=subject,
                device=device))
        written.append(_plots.plot_tflops(
            times, out_dir / f"{prefix}_tflops.png", device=device, peaks=peaks))
    return written
