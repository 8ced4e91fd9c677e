#!/usr/bin/env python3
"""What cuBLASLt autotuned chose where gemmrl-tuned runs behind it: per shape below a ratio in a
report's kernel-mode speedup CSV, the stored autotuned algorithm of each layout (its tile, split-K,
cluster), turned into our orientation, and whether the CUTLASS search pool holds that tile.

cuBLAS is column-major: the harness computes row-major C = A B as C^T = B^T A^T
(gemmrl/baselines/cublas_baselines.cu), so a cuBLAS tile m x n lies n along our M and m along
our N, and its wgmma rows (m) run along our N: its faithful twin is our swapped kernel (swap_ab)
with tile_m = m and tile_n = n; our plain kernel with tile_m = n, tile_n = m is the same output
tile with the wgmma rows along M (possible where n is a multiple of 64). Grouped by tile and
split-K, most frequent first, a few example shapes each. No GPU needed:

    python3 scripts/lt-tiles.py --csv results/h100/gemmrl-tuned_h100_F32F16F16F32_speedup_kernel.csv \\
        --device H100 --below 0.98
"""

from __future__ import annotations

import argparse
import csv
import json
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gemmrl.baselines import cublas as _cublas  # noqa: E402

# the enums' tables (gemmrl.baselines.cublas's CUDA 11 ones; load_enums adds the header's): copies,
# so that this script's additions stay its own
LT_TILES, LT_CLUSTERS = dict(_cublas.LT_TILES), dict(_cublas.LT_CLUSTERS)


def load_enums(header: Path | None) -> str:
    """Take the tile and cluster numbers from `header` (cublasLt.h; None: look where the cuBLAS
    baseline's build does, and in this checkout's .ext/*/nvidia/cu13) into LT_TILES and
    LT_CLUSTERS; returns where they came from, for the report's first line."""
    from gemmrl.baselines.cublas import lt_enum_tables

    tiles, clusters, source = lt_enum_tables(header, tuple(sorted(ROOT.glob(".ext/*/nvidia/cu13"))))
    LT_TILES.update(tiles)
    LT_CLUSTERS.update(clusters)
    return source


def parse_info(info: str) -> dict | None:
    """The tile, split-K and cluster of a stored autotuned choice's info string (the baseline's
    algorithm description), or None."""
    from gemmrl.baselines.cublas import parse_description

    d = parse_description(info or "")
    if not {"tile", "splitk", "cluster"} <= d.keys():
        return None
    return {"tile": LT_TILES.get(d["tile"]), "tile_id": d["tile"], "splitk": d["splitk"],
            "cluster": LT_CLUSTERS.get(d["cluster"])}


def ours(choice: dict, pool: set) -> dict:
    """The choice in our orientation: its output tile over (M, N), and whether the pool holds its
    swapped twin (tile_m = cuBLAS's m along our N) and the plain kernel of that output tile."""
    if choice["tile"] is None:
        return {"over_mn": f"tile {choice['tile_id']}", "swapped": None, "plain": None}
    m, n = choice["tile"]
    return {"over_mn": f"{n}x{m}", "swapped": (m, n, True) in pool, "plain": (n, m, False) in pool}


def pool_tiles(layout: str, dtype: str = "fp16", acc: str = "fp32") -> set:
    """(tile_m, tile_n, swap_ab) of every spec in the CUTLASS search pool of a layout."""
    from gemmrl.space import cutlass_sm90

    specs = cutlass_sm90.enumerate_specs(layout, dtype, acc)
    return {(s.tile_m, s.tile_n, s.swap_ab) for s in specs + cutlass_sm90.swapped_twins(specs)}


def losing_shapes(csv_path: Path, below: float, column: str) -> dict:
    """{(M, N, K): ratio} of the CSV's shapes whose `column` ratio is below `below`."""
    out = {}
    for row in csv.DictReader(open(csv_path)):
        v = row.get(column) or ""
        if v and float(v) < below:
            out[tuple(int(x) for x in row["mnk"].split("_"))] = float(v)
    return out


def table(db: sqlite3.Connection, device: str, acc: str, shapes: dict) -> list[dict]:
    """One row per (shape, layout) with a stored autotuned choice."""
    from gemmrl.runtime.pack import LT_IMPL  # the autotuned baseline whose stored choices these are

    pools = {layout: pool_tiles(layout, acc=acc) for layout in ("NN", "TN")}
    rows = []
    for (M, N, K), ratio in sorted(shapes.items(), key=lambda kv: kv[1]):
        for layout in ("NN", "TN"):
            got = db.execute("SELECT info FROM tuning WHERE device=? AND M=? AND N=? AND K=? AND acc=? AND impl=?",
                             (device, M, N, K, acc, LT_IMPL.format(layout.lower()))).fetchone()
            choice = parse_info(got[0]) if got else None
            if choice is None:
                continue
            rows.append({"shape": f"{M}x{N}x{K}", "layout": layout, "ratio": ratio, **choice,
                         **ours(choice, pools[layout])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", required=True, help="a report's kernel-mode speedup CSV (gemmrl report)")
    ap.add_argument("--device", required=True, help="the GPU in the store, or a unique part of its name")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--below", type=float, default=0.98, help="shapes whose ratio is below this (default 0.98)")
    ap.add_argument("--column", default="cuBLASLt-auto-tuning-max", help="the CSV column to read the ratio from")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--header", help="cublasLt.h to read the tile numbers from (default: where the cuBLAS "
                                     "baseline's build finds it, or .ext/*/nvidia/cu13/include)")
    a = ap.parse_args(argv)
    if not Path(a.csv).is_file():
        ap.error(f"{a.csv}: no such file")
    if a.header is not None and not Path(a.header).is_file():
        ap.error(f"{a.header}: no such file")
    try:
        source = load_enums(Path(a.header) if a.header else None)
    except ValueError as e:
        ap.error(f"{a.header or 'cublasLt.h'}: {e}")
    if not Path(a.db).is_file():
        ap.error(f"{a.db}: no store (gemmrl store unpacks the committed one)")
    db = sqlite3.connect(a.db)
    from gemmrl.store.db import device_by_part

    names = [r[0] for r in db.execute("SELECT DISTINCT device FROM tuning")]
    try:
        device = device_by_part(a.device, names, "GPUs")
    except ValueError as e:
        ap.error(str(e))
    shapes = losing_shapes(Path(a.csv), a.below, a.column)
    rows = table(db, device, a.acc, shapes)
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["over_mn"], r["splitk"])].append(r)
    print(f"{device}, {a.acc} accumulation: {len(shapes)} shapes below {a.below:g} ({a.column}); "
          f"{len(rows)} (shape, layout) autotuned choices; {source}")
    print("| output tile (M x N) | split-K | choices | swapped twin in pool | plain in pool | clusters (m x n) | examples |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    yes = {True: "yes", False: "no", None: "?"}
    for (tile, splitk), rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        clusters = sorted({"x".join(map(str, r["cluster"])) if r["cluster"] else "?" for r in rs})
        ex = ", ".join(f"{r['shape']} {r['layout']} {r['ratio']:.3f}" for r in rs[:3])
        print(f"| {tile} | {splitk} | {len(rs)} | {yes[rs[0]['swapped']]} | {yes[rs[0]['plain']]} "
              f"| {' '.join(clusters)} | {ex} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device, "acc": a.acc, "below": a.below, "column": a.column,
                                            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
