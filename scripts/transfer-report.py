#!/usr/bin/env python3
"""What a tune seeded from another GPU (`gemmrl tune --transfer-from SOURCE`) kept of the
source's choices, from the store alone (no GPU): per shape tuned on TARGET, the source's winner,
whether the target timed it, its time there over the target's fastest candidate (the search's
own timing, one session per batch), and whether the target's final winner is the same kernel.

    python3 scripts/transfer-report.py --db results/gemmrl.sqlite --source "NVIDIA H200" \
        --target "NVIDIA H100 80GB HBM3" --acc fp32 --csv results/h100/transfer-from-h200.csv

A ratio of 1.00 means the source's winner was the target's fastest candidate too; 1.05 means
shipping the source's pack unchanged would have cost 5% on that shape against what the few
candidates timed on the target found.
"""

from __future__ import annotations

import argparse
import csv
import math
import sqlite3
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rows(db_path: str, source: str, target: str, acc: str, dtype: str = "fp16", runs=None) -> list[dict]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    won = {}
    for dev, M, N, K, info in db.execute("SELECT device, M, N, K, info FROM tuning WHERE impl='gemmrl-tuned' "
                                         "AND dtype=? AND acc=? AND device IN (?, ?)", (dtype, acc, source, target)):
        won[(dev, M, N, K)] = info.split()[0]
    timed: dict = {}
    for M, N, K, cand, t, run in db.execute("SELECT M, N, K, candidate, time_us, run_id FROM trials WHERE device=? "
                                            "AND dtype=? AND acc=? AND status='ok' AND time_us > 0",
                                            (target, dtype, acc)):
        if runs and run not in runs:
            continue
        best = timed.setdefault((M, N, K), {})
        best[cand] = min(t, best.get(cand, math.inf))
    out = []
    for (M, N, K), times in sorted(timed.items(), key=lambda kv: 2 * kv[0][0] * kv[0][1] * kv[0][2]):
        theirs = won.get((source, M, N, K))
        ours = won.get((target, M, N, K))
        fastest = min(times.values())
        out.append({"M": M, "N": N, "K": K, "source_winner": theirs or "", "target_winner": ours or "",
                    "same": int(theirs is not None and theirs == ours), "candidates": len(times),
                    "source_winner_timed": int(theirs in times),
                    "source_winner_over_fastest": round(times[theirs] / fastest, 4) if theirs in times else ""})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--source", required=True, help="the GPU the prior came from, as the store names it")
    ap.add_argument("--target", required=True, help="the GPU tuned with --transfer-from")
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--csv", default=None, help="write the per-shape rows here")
    ap.add_argument("--run", type=int, action="append", default=None,
                    help="only the trials of this store run (repeatable): e.g. the transfer tune's own first batch, "
                         "before a later search added candidates timed in other sessions")
    args = ap.parse_args(argv)
    if not Path(args.db).exists():
        ap.error(f"no store at {args.db}")
    got = rows(args.db, args.source, args.target, args.acc, runs=set(args.run or ()))
    if not got:
        print(f"no {args.acc} trials on {args.target!r} in {args.db}", file=sys.stderr)
        return 1
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(got[0]))
            w.writeheader()
            w.writerows(got)
    ratios = [r["source_winner_over_fastest"] for r in got if r["source_winner_timed"]]
    print(f"{len(got)} shapes tuned on {args.target} ({args.acc} accumulate"
          + (f", runs {', '.join(map(str, args.run))}" if args.run else "") + "), "
          f"{sum(r['candidates'] for r in got)} candidates timed")
    print(f"- {args.source}'s winner timed there: {len(ratios)}; the target's final winner too: "
          f"{sum(r['same'] for r in got)}")
    if ratios:
        geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
        print(f"- its time over the fastest candidate: geomean {geo:.3f}, median {statistics.median(ratios):.3f}, "
              f"max {max(ratios):.3f}; within 1% on {sum(x <= 1.01 for x in ratios)}, "
              f"over 5% on {sum(x > 1.05 for x in ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
