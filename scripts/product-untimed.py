#!/usr/bin/env python3
"""Which shapes of a shape file still lack a session of the product (gemmrl.matmul-nn and
gemmrl.matmul-tn, `bench --impl pack:DIR`) in one mode on one device, counting only runs after
--after: what a budget-cut grid run left, for the next call on a warm machine (whose store
holds the first call's runs) or the next session (after merging them). No GPU needed:

    python3 scripts/product-untimed.py --device H200 --mode server --after 335 \\
        --shapes results/shapes/grid-by-flops.txt --out /tmp/left.txt

A shape counts as timed when both layouts have an `ok` measurement in that mode; the file's order
is kept (a by-FLOPs file stays smallest first). Writes a bench --shapes file and says how many
are left; exit 0 also when none is."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRODUCT = ("gemmrl.matmul-nn", "gemmrl.matmul-tn")


def timed(db: sqlite3.Connection, device: str, mode: str, after: int, acc: str) -> set:
    """(M, N, K) with an ok session of both product layouts in `mode` in a run after `after`."""
    rows = db.execute(
        "SELECT M, N, K, impl FROM measurements WHERE run_id > ? AND device LIKE ? AND mode = ? AND acc = ? "
        "AND status = 'ok' AND impl IN (?, ?)", (after, f"%{device}%", mode, acc, *PRODUCT)).fetchall()
    seen: dict = {}
    for M, N, K, impl in rows:
        seen.setdefault((M, N, K), set()).add(impl)
    return {k for k, v in seen.items() if len(v) == len(PRODUCT)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part of it (H200)")
    ap.add_argument("--mode", required=True, choices=("kernel", "offline", "server"))
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--after", type=int, default=0, help="count only runs with a larger id")
    ap.add_argument("--shapes", default="results/shapes/grid-by-flops.txt")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not Path(a.db).exists():
        raise SystemExit(f"no store at {a.db} (gemmrl store unpacks the committed one)")
    from gemmrl.core.problem import ProblemError
    from gemmrl.core.shapes import parse_shape_file

    try:
        shapes = [(p.M, p.N, p.K) for p in parse_shape_file(a.shapes)]
    except ProblemError as e:
        raise SystemExit(f"not an MxNxK shape file: {e}")
    db = sqlite3.connect(a.db)
    devices = sorted({d for (d,) in db.execute("SELECT DISTINCT device FROM runs WHERE device LIKE ?",
                                                (f"%{a.device}%",))})
    if len(devices) > 1:
        raise SystemExit(f"--device {a.device} names several GPUs in the store: {', '.join(devices)}")
    done = timed(db, a.device, a.mode, a.after, a.acc)
    left = [s for s in shapes if s not in done]
    Path(a.out).write_text(f"# {len(left)} of {len(shapes)} shapes of {a.shapes} without a session in {a.mode} mode of "
                           f"{' and '.join(PRODUCT)} ({a.acc}) on {a.device} after run {a.after}\n"
                           + "".join(f"{M}x{N}x{K}\n" for M, N, K in left))
    print(f"{len(left)} of {len(shapes)} shapes left ({len(shapes) - len(left)} timed in {a.mode} mode after run "
          f"{a.after}): {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
