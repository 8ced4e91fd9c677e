"""Runs that measured the tuned winners apart from the rest: pure analysis of the store (no GPU).

A report row is the ratio of one session (the latest that timed the shape), so a call whose
yardstick moved, for the baseline or for one kind of kernel, carries that shift into the report
until its shapes are timed again. Here, for every (shape, kernel) timed in a run and outside it
(the kernel a session timed is the one its run's passed verification of gemmrl-tuned names), the
ratio over the baseline (the faster of its NN and TN rows over gemmrl-tuned's median, as the
reports take it) in the run over the median of its sessions outside it, by kernel class. The
H200 fp32 grid's four-GPU retime (runs 288-291) read split-K kernels with a separate reduction
8.5% high this way while every other class read within 0.2% (results/README.md, 2026-11-29).
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
from collections import defaultdict

SUBJECT = "gemmrl-tuned"
BASELINE = "cuBLASLt-auto-tuning"
CLASSES = ("splitk-sr", "splitk", "streamk", "cutlass", "raw", "other")


def kernel_class(name: str) -> str:
    """The class of a kernel by its name (space/cutlass_sm90.py's and space/raw's naming)."""
    if name.startswith("sm90_"):
        if "_splitk" in name:
            return "splitk-sr" if "sr_" in name else "splitk"
        return "streamk" if "_streamk" in name else "cutlass"
    return "raw" if name.startswith("raw_") else "other"


def ratios(db: sqlite3.Connection, device: str, acc: str, dtype: str = "fp16", mode: str = "kernel",
           baseline: str = BASELINE) -> list[tuple]:
    """[(run, M, N, K, kernel, ratio)] per session that timed gemmrl-tuned and the baseline, in
    measurement order, where the session's run verified which kernel it timed."""
    chosen = {}
    for run, M, N, K, details in db.execute(
            "SELECT run_id, M, N, K, details FROM verifications WHERE device=? AND acc=? AND dtype=? AND impl=? "
            "AND passed=1 ORDER BY id", (device, acc, dtype, SUBJECT)):
        name = ((json.loads(details or "{}").get("impl") or {}).get("chosen") or {}).get("name")
        if name:
            chosen[(run, M, N, K)] = name
    sessions: dict = {}
    for run, session, M, N, K, impl, med in db.execute(
            "SELECT run_id, session, M, N, K, impl, median_us FROM measurements WHERE device=? AND acc=? AND "
            "dtype=? AND mode=? AND status='ok' AND median_us > 0 AND impl IN (?, ?, ?) ORDER BY id",
            (device, acc, dtype, mode, SUBJECT, f"{baseline}-nn", f"{baseline}-tn")):
        sessions.setdefault((run, session, M, N, K), {})[impl] = med
    out = []
    for (run, _s, M, N, K), got in sessions.items():
        base = [v for k, v in got.items() if k != SUBJECT]
        name = chosen.get((run, M, N, K))
        if SUBJECT in got and base and name:
            out.append((run, M, N, K, name, min(base) / got[SUBJECT]))
    return out


def bias(rows, runs: set[int]) -> dict[str, list[float]]:
    """class -> [ratio in the runs / the median ratio of the sessions outside them] per (shape,
    kernel) timed in both (the runs' last session; the median, so that one other run's shift does
    not stand in for the rest)."""
    by: dict = defaultdict(list)
    for r in rows:
        by[r[1:5]].append((r[0], r[5]))
    out: dict = defaultdict(list)
    for (_M, _N, _K, name), seen in by.items():
        inside = [s for s in seen if s[0] in runs]
        outside = [s for s in seen if s[0] not in runs]
        if inside and outside:
            out[kernel_class(name)].append(inside[-1][1] / statistics.median(s[1] for s in outside))
    return dict(out)


def latest_from(rows, runs: set[int]) -> dict[str, list[tuple[int, int, int]]]:
    """class -> the shapes whose latest session here (the one a report reads) is one of the runs'."""
    latest = {}
    for run, M, N, K, name, _r in rows:
        latest[(M, N, K)] = (run, name)
    out: dict = defaultdict(list)
    for shape, (run, name) in latest.items():
        if run in runs:
            out[kernel_class(name)].append(shape)
    return dict(out)


def parse_runs(text: str) -> set[int]:
    """'288-291,300' -> {288, 289, 290, 291, 300} (the scripts' --runs)."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--runs {text!r}: give run ids and ranges, e.g. 288-291,300") from None
        if b < a:
            raise ValueError(f"--runs {text!r}: {part} runs backwards")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("--runs names no run")
    return out


def format_runs(runs) -> str:
    """{288, 289, 290, 291, 300} -> '288-291,300', what parse_runs reads back. Pure."""
    out, ids = [], sorted(set(runs))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


SLOW_SHARE = 0.05  # a run with this share of its small-shape library sessions slow flatters what it timed


def slow_rows(db: sqlite3.Connection, rows, device: str, share: float = SLOW_SHARE) -> dict:
    """The report rows (ratios' rows) whose latest session is a slow-library run's (slow_runs):
    {'share', 'runs' (format_runs), 'rows': {class: count}}, what `gemmrl targets` names beside the
    table. A slow library session beside ours reads our kernel faster than it is (H200 run 161:
    cuBLASLt 8.1 us at 128x512x4096 where five other runs read 7.1-7.2, so the row read 1.144 for
    0.954, 2026-11-30)."""
    slow = slow_runs(db, device, share)
    late = latest_from(rows, slow) if slow else {}
    return {"share": share, "runs": format_runs(slow) if slow else "",
            "rows": {k: len(v) for k, v in sorted(late.items()) if v}}


def slow_runs(db: sqlite3.Connection, device: str, share: float, min_sessions: int = 10, **kw) -> set[int]:
    """The runs whose small-shape library sessions ran slow in `share` or more of `min_sessions` or
    more (library_state, its keywords passed on): what scripts/library-state.py --min-slow lists."""
    return {run for run, v in library_state(db, device, **kw).items()
            if v["sessions"] >= min_sessions and v["slow"] >= share}


def quantile(a: list[float], q: float) -> float:
    a = sorted(a)
    return a[min(len(a) - 1, int(q * len(a)))]


def geo_median(factors: list[float]) -> float:
    return math.exp(quantile([math.log(x) for x in factors], 0.5))


def scan(rows, min_pairs: int = 8, threshold: float = 0.03) -> list[dict]:
    """Every (run, class) whose median factor against the same kernels' other sessions is off 1 by
    more than `threshold`, over `min_pairs` pairs or more: {run, class, pairs, median, report_rows}
    (report_rows: the shapes whose latest session is that run's, with a kernel of that class),
    by run."""
    out = []
    for run in sorted({r[0] for r in rows}):
        found = bias(rows, {run})
        late = latest_from(rows, {run})
        for k in CLASSES:
            f = found.get(k, [])
            if len(f) >= min_pairs and abs(geo_median(f) - 1) > threshold:
                out.append({"run": run, "class": k, "pairs": len(f), "median": round(geo_median(f), 4),
                            "report_rows": len(late.get(k, []))})
    return out


# the libraries' own kernels: the same choice in every session of one library version
LIBRARY_IMPLS = ("torch.matmul", "torch.matmul-tn", "cuBLAS-nn", "cuBLAS-tn", "cuBLASLt-heuristic-nn",
                 "cuBLASLt-heuristic-tn")


def library_state(db: sqlite3.Connection, device: str, under_us: float = 15.0, above: float = 1.07,
                  min_sessions: int = 3, runs=None) -> dict[int, dict]:
    """Runs whose library baselines ran slow, from the store alone: for every (shape, dtype, acc,
    implementation of LIBRARY_IMPLS, cuBLAS version) timed in kernel mode under `under_us` in
    `min_sessions` sessions or more, each session's time over the fastest of them; per run
    (`runs`, else every run), {'sessions': how many such sessions, 'slow': the share more than
    `above` over the fastest, 'state': the medians of the GPU state its sessions recorded
    (env.gpu_state: temp_c, mem_temp_c, sm_mhz, mem_mhz, power_w) with 'sessions' counting them
    and 'clock_events': {reason: sessions}}. One stored algorithm ran 7-12% slower on small shapes
    in some runs than in others (H200, runs 150-476 against 486 on, results/README.md
    2026-11-30): a run with many slow sessions flatters every kernel of ours timed beside them."""
    cublas = {}
    for run, prov in db.execute("SELECT id, provenance FROM runs"):
        try:
            cublas[run] = str((json.loads(prov or "{}") or {}).get("cublas") or "")
        except ValueError:
            cublas[run] = ""
    marks = ", ".join("?" * len(LIBRARY_IMPLS))
    groups: dict = defaultdict(list)
    for run, session, M, N, K, dt, acc, impl, med, details in db.execute(
            "SELECT run_id, session, M, N, K, dtype, acc, impl, median_us, details FROM measurements WHERE "
            f"device=? AND mode='kernel' AND status='ok' AND median_us > 0 AND median_us < ? AND impl IN ({marks})",
            (device, under_us, *LIBRARY_IMPLS)):
        groups[(M, N, K, dt, acc, impl, cublas.get(run, ""))].append((run, session, med, details))
    per_run: dict = defaultdict(lambda: {"n": 0, "slow": 0, "states": {}})
    for seen in groups.values():
        if len(seen) < min_sessions:
            continue
        fastest = min(s[2] for s in seen)
        for run, session, med, details in seen:
            if runs is not None and run not in runs:
                continue
            got = per_run[run]
            got["n"] += 1
            got["slow"] += med > above * fastest
            if session not in got["states"]:
                try:
                    state = (json.loads(details or "{}") or {}).get("gpu_state")
                except ValueError:
                    state = None
                if isinstance(state, dict) and state:
                    got["states"][session] = state
    out = {}
    for run, got in sorted(per_run.items()):
        states = list(got["states"].values())
        summary: dict = {"sessions": len(states)}
        for key in ("temp_c", "mem_temp_c", "sm_mhz", "mem_mhz", "power_w"):
            vals = [s[key] for s in states if isinstance(s.get(key), (int, float))]
            if vals:
                summary[key] = statistics.median(vals)
        events: dict = defaultdict(int)
        for s in states:
            for e in s.get("clock_events") or []:
                events[e] += 1
        if events:
            summary["clock_events"] = dict(sorted(events.items()))
        out[run] = {"sessions": got["n"], "slow": round(got["slow"] / got["n"], 4), "state": summary}
    return out


def pack_without_runs(store, device: str, runs, pack_dir, work_dir) -> tuple[list[tuple[int, int, int]], list[str]]:
    """What the export of a pack would change were `runs`' measurements not in the store (the runs
    library_state finds slow: their library sessions flatter the kernels timed beside them). The
    pack at `pack_dir` is exported again, with its own dtype, accumulator and min_speedup, from a
    copy of the store (in `work_dir`) without those runs' measurements; the store is not touched.
    Returns the (M, N, K) whose entries would come, go or change (pack.changed_shapes, against
    `pack_dir`) and pack.pack_changes' lines: the shapes to time again in today's state, so that
    the export's medians stop resting on the slow runs (H200, 2026-11-30: 20-30 kernel entries a
    pack). Where the copy has nothing to export, every entry goes. Raises PackError where
    `pack_dir` holds no pack."""
    from pathlib import Path

    from gemmrl.runtime.pack import MANIFEST, PackError, changed_shapes, export_pack, pack_changes
    from gemmrl.store.db import Store

    pack_dir, work_dir = Path(pack_dir), Path(work_dir)
    try:
        old = json.loads((pack_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise PackError(f"{pack_dir}: no readable {MANIFEST} ({e})") from None
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "without-runs.sqlite"
    path.unlink(missing_ok=True)
    copy = sqlite3.connect(path)
    try:
        store.db.backup(copy)
        runs = sorted({int(r) for r in runs})
        for i in range(0, len(runs), 500):
            chunk = runs[i:i + 500]
            copy.execute(f"DELETE FROM measurements WHERE run_id IN ({', '.join('?' * len(chunk))})", chunk)
        copy.commit()
    finally:
        copy.close()
    other = Store(path)
    try:
        new_dir = export_pack(other, device, work_dir / "pack", old.get("dtype", "fp16"), old.get("acc", "fp32"),
                              min_speedup=float(old.get("min_speedup", 1.0)))
        new = json.loads((new_dir / MANIFEST).read_text())
    except PackError as e:
        if not str(e).startswith("nothing to export"):
            raise
        new = {"entries": [], "lt_algos": []}  # every entry rested on those runs
    finally:
        other.close()
    return changed_shapes(new, old), pack_changes(new, old)
