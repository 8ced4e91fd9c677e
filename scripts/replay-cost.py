#!/usr/bin/env python3
"""Kernel mode's per-replay fixed cost, read off the store (no GPU): every kernel-mode session
that timed torch.matmul twice (torch.matmul@repeat) with graphs of different lengths tells how
much a replay's fixed cost adds to a call (gemmrl.report.noise.replay_fixed_cost), per device;
and how many of the repeat disagreements beyond 2% it accounts for.

    python3 scripts/replay-cost.py --db results/gemmrl.sqlite [--runs 1-131] [--json OUT]

Graphs were sized from one cold call until 3dfcded, so their lengths varied; since then every
implementation of a session holds the same number of calls, and new sessions show no spread.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUERY = """SELECT a.device, a.median_us, b.median_us, a.details, b.details FROM measurements a
JOIN measurements b ON a.session = b.session AND a.M = b.M AND a.N = b.N AND a.K = b.K
 AND a.mode = b.mode AND a.acc = b.acc AND a.dtype = b.dtype
WHERE a.mode = 'kernel' AND a.impl = 'torch.matmul' AND b.impl = 'torch.matmul@repeat'
 AND a.status = 'ok' AND b.status = 'ok' AND a.run_id BETWEEN ? AND ?"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--runs", default=None, metavar="A-B", help="only these store runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from gemmrl.report.noise import replay_fixed_cost
    from gemmrl.store.db import unpack_if_missing

    lo, hi = 0, 1 << 62
    if args.runs:
        try:
            lo, hi = (int(x) for x in args.runs.split("-"))
        except ValueError:
            ap.error(f"--runs: expected A-B, got {args.runs!r}")
    unpack_if_missing(args.db)
    if not Path(args.db).exists():
        ap.error(f"no store at {args.db}")
    by = defaultdict(list)
    for dev, t1, t2, d1, d2 in sqlite3.connect(f"file:{args.db}?mode=ro", uri=True).execute(QUERY, (lo, hi)):
        n1, n2 = json.loads(d1).get("calls_per_replay"), json.loads(d2).get("calls_per_replay")
        if n1 and n2:
            by[dev].append((t1, t2, n1, n2))
    out = {dev: replay_fixed_cost(pairs) for dev, pairs in sorted(by.items())}
    for dev, r in out.items():
        x = r.get("fixed_cost_us")
        print(f"{dev}: {r['pairs']} repeat pairs, fitted on {r['fitted_on']}: fixed cost "
              + (f"{x:.2f} us a replay" if x is not None else "not measurable (no spread)")
              + f"; beyond 2%: {r['beyond_tolerance']}"
              + (f", {r['beyond_tolerance_without_it']} once X / calls is taken off" if x is not None else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
