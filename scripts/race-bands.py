#!/usr/bin/env python3
"""What a race (`gemmrl bench --impl baselines --impl race:K[:built][:FIELD...] --retime`) changed,
by FLOPs band, from the store alone (no GPU).

For each shape the given runs timed gemmrl's tuned winner on (kernel mode):
- now: the faster of cuBLASLt autotuned NN and TN over the winner, medians of the race's own
  session (the latest of the given runs that timed the shape);
- before: the same ratio in the latest earlier run that timed the winner beside both layouts
  (another session: a few percent of session-to-session noise applies to that column);
- the kernel chosen before and after (the passed verifications of those runs), and whether the
  new one differs from the old in a field `--field` names (e.g. epi_n: won by a wider epilogue
  subtile).

    python3 scripts/race-bands.py --device H200 --runs 166 --field epi_n \\
        --json results/h200/epi-race-bands-run166.json --md results/h200/epi-race-bands-run166.md
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

LT = ("cuBLASLt-auto-tuning-nn", "cuBLASLt-auto-tuning-tn")
SUBJECT = "gemmrl-tuned"


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def kernel_ratios(db, device: str, acc: str, dtype: str = "fp16") -> dict:
    """(M, N, K) -> {run_id: best cuBLASLt autotuned median / subject median} over the kernel-mode
    sessions that timed the subject beside both cuBLASLt layouts."""
    per = defaultdict(lambda: defaultdict(dict))
    q = ("SELECT run_id, M, N, K, impl, median_us FROM measurements WHERE device=? AND acc=? AND dtype=? "
         "AND mode='kernel' AND status='ok' AND median_us > 0 AND impl IN (?, ?, ?)")
    for run, M, N, K, impl, t in db.execute(q, (device, acc, dtype, SUBJECT, *LT)):
        per[(M, N, K)][run][impl] = t
    out = {}
    for shape, runs in per.items():
        r = {run: min(v[lt] for lt in LT) / v[SUBJECT] for run, v in runs.items()
             if SUBJECT in v and all(lt in v for lt in LT)}
        if r:
            out[shape] = r
    return out


def chosen(db, device: str, acc: str, dtype: str = "fp16") -> dict:
    """(M, N, K) -> [(run_id, chosen kernel dict)] from the subject's passed verifications, oldest first."""
    out = defaultdict(list)
    q = ("SELECT run_id, M, N, K, details FROM verifications WHERE device=? AND acc=? AND dtype=? AND impl=? "
         "AND passed=1 ORDER BY id")
    for run, M, N, K, details in db.execute(q, (device, acc, dtype, SUBJECT)):
        c = (json.loads(details).get("impl") or {}).get("chosen")
        if isinstance(c, dict) and "name" in c:
            out[(M, N, K)].append((run, c))
    return out


def race_rows(db, device: str, acc: str, runs: list[int], field: str | None = None, dtype: str = "fp16") -> list[dict]:
    ratios, picks = kernel_ratios(db, device, acc, dtype), chosen(db, device, acc, dtype)
    first, wanted = min(runs), set(runs)
    rows = []
    for shape, r in sorted(ratios.items(), key=lambda kv: (2 * kv[0][0] * kv[0][1] * kv[0][2], kv[0])):
        now_runs = [run for run in r if run in wanted]
        if not now_runs:
            continue
        run = max(now_runs)
        earlier = [x for x in r if x < first]
        old = [c for x, c in picks.get(shape, []) if x < first]
        new = [c for x, c in picks.get(shape, []) if x == run]
        row = {"M": shape[0], "N": shape[1], "K": shape[2], "flops": 2 * shape[0] * shape[1] * shape[2],
               "run": run, "now": r[run], "before": r[max(earlier)] if earlier else None,
               "before_run": max(earlier) if earlier else None,
               "kernel": new[-1]["name"] if new else None, "kernel_before": old[-1]["name"] if old else None}
        row["changed"] = bool(new and old and new[-1]["name"] != old[-1]["name"])
        if field:
            nv = (new[-1].get("spec") or {}).get(field) if new else None
            ov = (old[-1].get("spec") or {}).get(field) if old else None
            row["won_by_field"] = bool(row["changed"] and nv != ov)
        rows.append(row)
    return rows


def bands(rows: list[dict]) -> list[dict]:
    """Rows grouped by floor(log2(FLOPs)), with an 'all' row last."""
    groups = defaultdict(list)
    for r in rows:
        groups[int(math.log2(r["flops"]))].append(r)

    def summary(label, rs):
        return {"flops": label, "shapes": len(rs), "changed": sum(r["changed"] for r in rs),
                "won_by_field": sum(r.get("won_by_field", False) for r in rs),
                "now": geomean([r["now"] for r in rs]),
                "before": geomean([r["before"] for r in rs if r["before"]]),
                "at_or_above_1": sum(r["now"] >= 1.0 for r in rs),
                "at_or_above_0.98": sum(r["now"] >= 0.98 for r in rs)}

    return [summary(f"2^{b}", groups[b]) for b in sorted(groups)] + [summary("all", rows)]


def markdown(table: list[dict], field: str | None) -> str:
    won = f" | won by a new {field}" if field else ""
    lines = [f"| FLOPs | shapes | winner changed{won} | now vs cuBLASLt autotuned | before | now at >= 1.0 |",
             "| --- | --- | --- |" + (" --- |" if field else "") + " --- | --- | --- |"]
    for b in table:
        cells = [b["flops"], b["shapes"], b["changed"]] + ([b["won_by_field"]] if field else []) + [
            f"{b['now']:.3f}", f"{b['before']:.3f}" if b["before"] == b["before"] else "-", b["at_or_above_1"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU, or a unique part of its name")
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--runs", required=True, help="the race's runs, comma-separated (e.g. 161,162,163)")
    ap.add_argument("--field", default=None, help="a spec field: count the new winners that differ in it")
    ap.add_argument("--json", default=None, help="write every shape's row and the bands here")
    ap.add_argument("--md", default=None, help="write the bands as a markdown table here")
    a = ap.parse_args(argv)
    try:
        runs = sorted({int(x) for x in a.runs.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--runs takes run ids separated by commas, got {a.runs!r}")
    if not runs:
        ap.error("--runs names no run")
    if not Path(a.db).exists():
        ap.error(f"no store at {a.db} (python3 -m gemmrl.cli store unpacks the committed one)")
    from gemmrl.store.db import device_by_part

    db = sqlite3.connect(f"file:{a.db}?mode=ro", uri=True)
    names = [r[0] for r in db.execute("SELECT DISTINCT device FROM measurements")]
    try:
        device = device_by_part(a.device, names)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if device not in names:
        raise SystemExit(f"--device {a.device!r} names none of the store's devices ({', '.join(names)})")
    rows = race_rows(db, device, a.acc, runs, a.field)
    if not rows:
        print(f"runs {a.runs} timed no {SUBJECT} beside cuBLASLt autotuned on {device} ({a.acc})", file=sys.stderr)
        return 1
    table = bands(rows)
    text = markdown(table, a.field)
    print(text, end="")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device, "acc": a.acc, "runs": runs, "field": a.field,
                                            "bands": table, "shapes": rows}, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(f"# {device}, {a.acc}: the race of runs {', '.join(map(str, runs))}, by FLOPs\n\n"
                              "'now': the race's winner over the faster of cuBLASLt autotuned NN and TN in the "
                              "race's own session (geomean of medians); 'before': the old winner's ratio in its "
                              "latest earlier session beside both (session-to-session noise of a few percent "
                              "applies to that column). `scripts/race-bands.py`.\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
