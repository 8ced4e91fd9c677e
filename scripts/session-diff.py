#!/usr/bin/env python3
"""What a session changed on one GPU and accumulator, per shape list: the kernel-mode ratio over
cuBLASLt autotuned (the report's speedup CSV, column cuBLASLt-auto-tuning-max: what the targets
read) and the stored winner (the store's tuning table, impl gemmrl-tuned), before and after.

Before is a git revision (the session's first commit: its committed CSV and store) or an explicit
CSV and store; after is the working tree's CSV and store (run `gemmrl report` first). For each
list (a shapes file, as the device steps took it) and for the whole grid: shapes, winners
changed, shapes up or down by more than --band, the geometric mean of after/before over the list
and over its changed and kept winners, and the shapes at --threshold or more before and after.
The changed winners are also counted by which spec fields changed (CUTLASS names parsed back to
their specs; other families by name).

    python3 scripts/session-diff.py --device H200 --acc fp32 --before-rev ed5ea8b \\
        --list results/shapes/h200-fp32-smallk-below-2026-11-29f.txt --json /tmp/diff.json

A shape on several lists counts in each. Ratios before are each shape's session then (often on
another GPU of the same model): a few percent of session-to-session noise applies to one shape."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMN = "cuBLASLt-auto-tuning-max"
PRECISIONS = {"fp32": "F32F16F16F32", "fp16": "F16F16F16F16"}


def read_ratios(text: str, column: str = COLUMN) -> dict:
    """'MxNxK' -> the column's ratio, from a speedup CSV's text (shapes written M_N_K); shapes
    with an empty cell are left out."""
    rows = csv.DictReader(io.StringIO(text))
    if rows.fieldnames is None or "mnk" not in rows.fieldnames or column not in rows.fieldnames:
        raise ValueError(f"not a speedup CSV with columns mnk and {column}")
    return {r["mnk"].replace("_", "x"): float(r[column]) for r in rows if r[column]}


def read_winners(db: str | Path, device: str, acc: str, dtype: str = "fp16") -> dict:
    """'MxNxK' -> the stored winner's kernel name (the tuning table's info, first word), for the
    one device whose name holds `device`."""
    from gemmrl.store.db import device_by_part

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        devices = sorted({d for (d,) in con.execute("SELECT DISTINCT device FROM tuning")})
        name = device_by_part(device, devices, "of the store's devices")
        if name not in devices:
            raise ValueError(f"--device {device!r} names 0 of the store's devices ({', '.join(devices)})")
        q = "SELECT M, N, K, info FROM tuning WHERE device=? AND acc=? AND dtype=? AND impl='gemmrl-tuned'"
        return {f"{m}x{n}x{k}": info.split()[0] for m, n, k, info in con.execute(q, (name, acc, dtype))}
    finally:
        con.close()


def read_list(path: str | Path) -> list[str]:
    """The shapes of a list file: the first word of each line that is neither blank nor a comment."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line.split()[0])
    return out


def changed_fields(old: str, new: str) -> str:
    """Which spec fields differ between two CUTLASS kernel names ('+'-joined, in field order), or
    'family' where either is not one."""
    from dataclasses import fields

    from gemmrl.space.cutlass_sm90 import CutlassSpec

    try:
        a, b = CutlassSpec.from_name(old), CutlassSpec.from_name(new)
    except ValueError:
        return "family"
    return "+".join(f.name for f in fields(a) if getattr(a, f.name) != getattr(b, f.name)) or "none"


def geomean(xs) -> float | None:
    """The report's geometric mean of the positive values; None where there are none."""
    from gemmrl.report.export import geomean as report_geomean

    xs = [x for x in xs if x > 0]
    return report_geomean(xs) if xs else None


def summarize(shapes, before: dict, after: dict, win_before: dict, win_after: dict, threshold: float,
              band: float) -> dict:
    """One list's row: the shapes with a ratio on both sides, compared (pure)."""
    both = [s for s in dict.fromkeys(shapes) if s in before and s in after]
    changed = [s for s in both if win_before.get(s) != win_after.get(s)]
    kept = [s for s in both if s not in changed]
    ratio = {s: after[s] / before[s] for s in both}
    drops = sorted((ratio[s], s) for s in both if ratio[s] < 1 - band)
    return {
        "shapes": len(both), "missing": len(set(shapes)) - len(both),
        "winners_changed": len(changed),
        "up": sum(ratio[s] > 1 + band for s in both), "down": len(drops),
        "after_over_before": geomean(ratio[s] for s in both),
        "changed_after_over_before": geomean(ratio[s] for s in changed),
        "kept_after_over_before": geomean(ratio[s] for s in kept),
        "at_threshold_before": sum(before[s] >= threshold for s in both),
        "at_threshold_after": sum(after[s] >= threshold for s in both),
        "geomean_before": geomean(before[s] for s in both), "geomean_after": geomean(after[s] for s in both),
        "largest_drops": [{"shape": s, "before": before[s], "after": after[s]} for _, s in drops[:3]],
        "fields": dict(Counter(changed_fields(win_before[s], win_after[s]) if s in win_before and s in win_after
                               else "new" for s in changed).most_common()),
    }


def _fmt(x, digits=3):
    return "" if x is None else f"{x:.{digits}f}"


def table(rows: dict, threshold: float) -> str:
    head = ("| list | shapes | winners changed | up | down | after/before | changed | kept "
            f"| at {threshold} before -> after |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['shapes']} | {r['winners_changed']} | {r['up']} | {r['down']} "
                     f"| {_fmt(r['after_over_before'], 4)} | {_fmt(r['changed_after_over_before'], 4)} "
                     f"| {_fmt(r['kept_after_over_before'], 4)} | {r['at_threshold_before']} -> "
                     f"{r['at_threshold_after']} |")
    return "\n".join(lines)


def _git_show(rev: str, path: str) -> bytes:
    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True)
    if r.returncode:
        raise ValueError(f"git show {rev}:{path}: {r.stderr.decode().strip()}")
    return r.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", required=True, help="the GPU: a unique part of its name (H200)")
    ap.add_argument("--acc", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("--before-rev", help="a git revision: its committed speedup CSV and store")
    ap.add_argument("--before-csv", help="instead of --before-rev: the speedup CSV before")
    ap.add_argument("--before-db", help="instead of --before-rev: the store before (an unpacked .sqlite)")
    ap.add_argument("--csv", help="the speedup CSV after (default: the working tree's, results/<gpu>/...)")
    ap.add_argument("--db", default=str(ROOT / "results" / "gemmrl.sqlite"), help="the store after")
    ap.add_argument("--list", action="append", default=[], help="a shapes file (repeatable)")
    ap.add_argument("--threshold", type=float, default=0.98)
    ap.add_argument("--band", type=float, default=0.005, help="up/down beyond this fraction (default 0.005)")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args(argv)
    if bool(a.before_rev) == bool(a.before_csv or a.before_db):
        ap.error("give --before-rev, or --before-csv and --before-db")
    if not a.before_rev and not (a.before_csv and a.before_db):
        ap.error("--before-csv and --before-db go together")
    # the report's folder for this GPU (results/h200 for 'H200' or 'NVIDIA H200'), where a CSV is not given
    gpu = next((d.name for d in sorted((ROOT / "results").glob("h[0-9]*")) if d.is_dir() and d.name in a.device.lower()),
               None)
    if gpu is None and (a.before_rev or not a.csv):
        ap.error(f"no results/<gpu> folder named in --device {a.device!r}: give --csv and --before-csv")
    rel = f"results/{gpu}/gemmrl-tuned_{gpu}_{PRECISIONS[a.acc]}_speedup_kernel.csv"
    for f in a.list:
        if not Path(f).is_file():
            ap.error(f"--list {f}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if a.before_rev:
                before_text = _git_show(a.before_rev, rel).decode()
                packed = Path(tmp) / "gemmrl.sqlite.xz"
                packed.write_bytes(_git_show(a.before_rev, "results/gemmrl.sqlite.xz"))
                from gemmrl.store.db import decompress

                before_db = decompress(packed, Path(tmp) / "gemmrl.sqlite")
            else:
                before_text, before_db = Path(a.before_csv).read_text(), a.before_db
            after_text = Path(a.csv or ROOT / rel).read_text()
            before, after = read_ratios(before_text), read_ratios(after_text)
            win_before = read_winners(before_db, a.device, a.acc)
            win_after = read_winners(a.db, a.device, a.acc)
        except (OSError, ValueError, sqlite3.Error) as e:
            print(f"session-diff: {e}", file=sys.stderr)
            return 2
    rows = {"all": summarize(list(after), before, after, win_before, win_after, a.threshold, a.band)}
    for f in a.list:
        rows[Path(f).stem] = summarize(read_list(f), before, after, win_before, win_after, a.threshold, a.band)
    print(table(rows, a.threshold))
    every = rows["all"]
    print(f"\ngeomean {_fmt(every['geomean_before'], 4)} -> {_fmt(every['geomean_after'], 4)}; below {a.threshold}: "
          f"{every['shapes'] - every['at_threshold_before']} -> {every['shapes'] - every['at_threshold_after']}; "
          f"winners changed {every['winners_changed']}")
    print("changed fields (all):", ", ".join(f"{k} {v}" for k, v in every["fields"].items()) or "none")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "acc": a.acc, "threshold": a.threshold,
                                            "band": a.band, "before_rev": a.before_rev, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
