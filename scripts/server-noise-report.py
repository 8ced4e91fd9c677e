"""The agreement table of a server-noise trace (scripts/server-noise.py), as markdown; no GPU:

    python scripts/server-noise-report.py results/logs/server-noise-trace-2026-11-22d.csv.gz
"""

from __future__ import annotations

import csv
import gzip
import sys

from gemmrl.report.noise import agreement_table


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    path = sys.argv[1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    print("| gaps | rounds | statistic | pairs | within 2% | median | p90 | max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in agreement_table(rows, (150, 300, 450, 750, 1500), warmup_rounds=3):
        print(f"| {r['gaps']} | {r['rounds']} | {r['stat']} | {r['pairs']} | {r['within']:.0%} | "
              f"{r['median']:.2%} | {r['p90']:.2%} | {r['max']:.2%} |")


if __name__ == "__main__":
    main()
