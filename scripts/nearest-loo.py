#!/usr/bin/env python3
"""How well does a neighbour's kernel serve a shape the pack was not tuned for? A leave-one-out
estimate from a store, without a GPU.

gemmrl.matmul serves an unseen shape with the nearest generic (CUTLASS) pack kernel that serves it
within a distance (the sum of |log2| size ratios; `use_pack(..., nearest=)`), unless the shape is
nearer to a tuned shape where the libraries won (the pack's `library`). For every grid shape this
drops the shape's own entries and library rows from the pack, asks the dispatch table which
kernel would then serve each layout, and looks that kernel up among the search's trials on the
shape (the search times neighbours' winners there: transfer). A trial's reward is the kernel's
speedup over the best baseline timed in the same rounds; divided by torch.matmul's speedup over
the best baseline in the shape's latest kernel-mode session, it estimates the speedup over
torch.matmul. Summarised by distance:

    python3 scripts/nearest-loo.py --pack packs/h200-fp16-F32F16F16F32 --device H200 \\
        --json results/h200/nearest-loo-h200.json [--no-library] [--edges 0,0.5,1,1.5,2]

The estimate mixes two sessions (the trial's and the kernel-mode record's), so one shape's value
carries both sessions' noise; the medians and shares over many shapes are what it is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(rows: list[dict], edges: list[float], field: str) -> list[dict]:
    """Per distance bucket [lo, hi) (the last closed): count, median of `field`, and how many
    are below 0.99 and below 0.95 of it. Rows without the field are left out. Pure."""
    out = []
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = i == len(edges) - 2
        v = [r[field] for r in rows if r.get(field) is not None
             and lo <= r["distance"] and (r["distance"] <= hi if last else r["distance"] < hi)]
        out.append({"distance": [lo, hi], "count": len(v),
                    "median": round(statistics.median(v), 4) if v else None,
                    "below_0.99": sum(x < 0.99 for x in v), "below_0.95": sum(x < 0.95 for x in v)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--pack", required=True)
    ap.add_argument("--device", default=None, help="device name in the store, or a unique part of it")
    ap.add_argument("--json", default=None, help="also write every row and the summary here")
    ap.add_argument("--no-library", action="store_true",
                    help="ignore the pack's library rows (as a pack tuned on few shapes would have)")
    ap.add_argument("--edges", default="0,0.5,1,1.5,2", help="distance bucket edges")
    a = ap.parse_args()
    edges = [float(x) for x in a.edges.split(",")]
    if len(edges) < 2 or edges != sorted(edges):
        print("--edges: at least two, increasing", file=sys.stderr)
        return 2

    from gemmrl.core.shapes import grid
    from gemmrl.report.export import is_baseline
    from gemmrl.runtime.dispatch import DispatchTable, distance
    from gemmrl.runtime.pack import load_pack
    from gemmrl.store.db import Store, unpack_if_missing

    pack = load_pack(a.pack)
    unpack_if_missing(a.db)
    store = Store(a.db, readonly=True)
    device = pack.stamp["device"]
    if a.device:
        named = [d for d in store.devices() if a.device.lower() in d.lower()]
        if len(named) != 1:
            print(f"--device {a.device!r} names {len(named)} devices of {store.devices()}", file=sys.stderr)
            return 2
        device = named[0]
    trials = defaultdict(list)
    for M, N, K, cand, reward, rec in store.db.execute(
            "SELECT M, N, K, candidate, reward, record FROM trials WHERE device=? AND dtype=? AND acc=? "
            "AND status='ok'", (device, pack.dtype, pack.acc)):
        layout = (json.loads(rec).get("spec") or {}).get("layout")
        trials[(M, N, K, layout, cand)].append(float(reward))
    latest: dict = {}
    for r in store.measurements(device=device, mode="kernel", dtype=pack.dtype, acc=pack.acc):
        latest.setdefault((r["M"], r["N"], r["K"]), {})[r["impl"]] = r

    def torch_over_best(M, N, K, layout):
        recs = latest.get((M, N, K), {})
        t = recs.get("torch.matmul-tn" if layout == "TN" else "torch.matmul") or recs.get("torch.matmul")
        if not t or not t.get("median_us"):
            return None
        base = [r["median_us"] for i, r in recs.items()
                if is_baseline(i) and r["session"] == t["session"] and r.get("median_us")]
        return min(base) / t["median_us"] if base else None

    entries = list(pack.entries)
    rows = []
    for p in grid(pack.dtype, pack.acc):
        shape = (p.M, p.N, p.K)
        others = [e for e in entries if (e.problem.M, e.problem.N, e.problem.K) != shape]
        library = [] if a.no_library else [(*x, pack.dtype) for x in pack.library if tuple(x[:3]) != shape]
        table = DispatchTable(others, pack.acc, max_distance=edges[-1], library=library)
        for layout in ("NN", "TN"):
            e = table.lookup(p.M, p.N, p.K, layout, pack.dtype)
            if e is None:
                continue
            got = trials.get((p.M, p.N, p.K, layout, e.spec_name))
            reward = statistics.median(got) if got else None
            tob = torch_over_best(p.M, p.N, p.K, layout)
            rows.append({"shape": p.shape, "layout": layout, "neighbour": e.problem.shape, "kernel": e.spec_name,
                         "distance": round(distance(shape, (e.problem.M, e.problem.N, e.problem.K)), 4),
                         "trials": len(got or []),
                         "over_best_baseline": None if reward is None else round(reward, 4),
                         "over_torch_matmul": None if reward is None or not tob else round(reward / tob, 4)})
    store.close()
    import datetime as _dt

    from gemmrl.bench.env import git_commit

    # what it read: the pack's stamp (the GPU, driver, CUDA and torch its timings come from, and
    # their runs) and this analysis's own commit and date (no GPU here)
    out = {"device": device, "pack": str(a.pack), "pack_stamp": pack.stamp, "commit": git_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python3 scripts/nearest-loo.py " + " ".join(sys.argv[1:]),
           "library": not a.no_library, "edges": edges,
           "served_by_a_neighbour": len(rows), "with_a_trial": sum(r["trials"] > 0 for r in rows),
           "over_best_baseline": summarize(rows, edges, "over_best_baseline"),
           "over_torch_matmul": summarize(rows, edges, "over_torch_matmul"), "rows": rows}
    print(f"{device}: {out['served_by_a_neighbour']} (shape, layout)s of the grid would go to a neighbour's "
          f"kernel with their own left out ({'with' if out['library'] else 'without'} the library rows); "
          f"{out['with_a_trial']} have a trial of that kernel")
    for what in ("over_best_baseline", "over_torch_matmul"):
        print(f"  {what}:")
        for b in out[what]:
            print(f"    distance {b['distance'][0]}-{b['distance'][1]}: {b['count']} shapes, median {b['median']}, "
                  f"below 0.99: {b['below_0.99']}, below 0.95: {b['below_0.95']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
