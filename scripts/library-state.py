#!/usr/bin/env python3
"""Which runs timed the libraries' own kernels slow? From the store alone (no GPU): for every shape
whose torch.matmul, cuBLAS or cuBLASLt-heuristic time (kernel mode, one cuBLAS version) is under
--under-us in three sessions or more, each session's time over the fastest of them; per run, the
share of its sessions more than --above over the fastest, beside the GPU state its sessions
recorded (`gpu_state`: temperatures, clocks, power, throttle reasons; sessions since 2026-11-30).
A run with a large share ran the yardstick slow, which flatters every kernel of ours timed beside
it (H200: runs 288-291 and 450-476 at 41-73%, none since 486 above 6%; results/README.md,
2026-11-30).

    python3 scripts/library-state.py --device H200 [--runs 700-760] [--min-slow 0.1] [--json FILE]

With --pack DIR --changed-shapes FILE (and --min-slow above 0), the runs listed are left out of a
copy of the store and DIR's pack is exported again from it: FILE gets the shapes whose entries
rest on those runs (report.bias.pack_without_runs), to time again in today's state (`bench
--shapes FILE --mode kernel --impl baselines --impl tuned --retime`, then scripts/product-settle.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gemmrl.report.bias import library_state, parse_runs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="a GPU of the store, or part of its name (H200)")
    ap.add_argument("--runs", help="only these run ids and ranges: 288-291,300 (default: every run)")
    ap.add_argument("--under-us", type=float, default=15.0, help="shapes whose library time is under this (us)")
    ap.add_argument("--above", type=float, default=1.07, help="a session is slow above this factor over the "
                    "fastest session of the same shape and implementation (default 1.07)")
    ap.add_argument("--min-sessions", type=int, default=10, help="list runs with at least this many such "
                    "sessions (default 10)")
    ap.add_argument("--min-slow", type=float, default=0.0, help="list runs whose slow share is at least this")
    ap.add_argument("--json", type=Path, help="also write every run's numbers here")
    ap.add_argument("--pack", type=Path, help="with --changed-shapes: the pack to export again without the runs listed")
    ap.add_argument("--changed-shapes", type=Path, help="with --pack: write the shapes whose entries rest on the "
                    "runs listed here, one a line")
    a = ap.parse_args(argv)
    if (a.pack is None) != (a.changed_shapes is None):
        ap.error("--pack and --changed-shapes go together")
    if a.pack is not None and a.min_slow <= 0:
        ap.error("--pack leaves the runs listed out of the export: give --min-slow above 0 (0.1: runs with 10%% "
                 "or more slow sessions), or every run would go")
    if a.above <= 1.0:
        ap.error("--above is a factor over the fastest session: more than 1 (1.07: 7% slower)")
    try:
        runs = parse_runs(a.runs) if a.runs else None
    except ValueError as e:
        ap.error(str(e))

    from gemmrl.store.db import Store, device_by_part

    if not Path(a.db).exists() and not Path(str(a.db) + ".xz").exists():
        ap.error(f"no store at {a.db}")
    store = Store(a.db, readonly=True)
    try:
        device = device_by_part(a.device, store.devices(), "GPUs")
    except ValueError as e:
        ap.error(str(e))
    got = library_state(store.db, device, under_us=a.under_us, above=a.above, runs=runs)
    shown = {r: v for r, v in got.items() if v["sessions"] >= a.min_sessions and v["slow"] >= a.min_slow}
    if not shown:
        ap.error(f"no run on {device} has {a.min_sessions} or more library sessions under {a.under_us} us"
                 + (f" in runs {a.runs}" if a.runs else "") + (f" with a slow share of {a.min_slow} or more"
                                                               if a.min_slow else ""))
    dates = {}
    for run, prov in store.db.execute("SELECT id, provenance FROM runs"):
        try:
            p = json.loads(prov or "{}") or {}
        except ValueError:
            p = {}
        dates[run] = (str(p.get("date") or "")[:16], str((p.get("gpu_identity") or {}).get("uuid") or "")[:12])
    print(f"{device}: library kernels (torch.matmul, cuBLAS, cuBLASLt heuristic) under {a.under_us} us in kernel "
          f"mode; slow: more than {a.above}x the fastest session of the same shape and implementation")
    print("| run | date | GPU | sessions | slow | with GPU state | GPU C | memory C | SM MHz | power W | clock events |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, v in shown.items():
        st = v["state"]
        cell = (lambda k: f"{st[k]:g}" if k in st else "-")
        events = ", ".join(f"{k} {n}" for k, n in (st.get("clock_events") or {}).items()) or "-"
        date, gpu = dates.get(run, ("", ""))
        print(f"| {run} | {date} | {gpu or '-'} | {v['sessions']} | {v['slow']:.1%} | {st['sessions']} | "
              f"{cell('temp_c')} | {cell('mem_temp_c')} | {cell('sm_mhz')} | {cell('power_w')} | {events} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": device, "under_us": a.under_us, "above": a.above,
                                      "runs": {str(r): v for r, v in got.items()}}, indent=1) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    if a.pack is not None:
        import tempfile

        from gemmrl.core.shapes import write_shape_file
        from gemmrl.report.bias import pack_without_runs
        from gemmrl.runtime.pack import PackError

        with tempfile.TemporaryDirectory(prefix="gemmrl-without-") as work:
            try:
                shapes, lines = pack_without_runs(store, device, set(shown), a.pack, work)
            except PackError as e:
                print(f"library-state.py: {e}", file=sys.stderr)
                return 1
        for line in lines:
            print(line, file=sys.stderr)
        write_shape_file(a.changed_shapes, shapes,
                         f"{device}: the {len(shapes)} shapes whose entries in {a.pack} change when runs "
                         f"{','.join(map(str, shown))} ({len(shown)}: {a.min_slow:.0%} or more of their library "
                         "sessions slow) are left out of the export")
        print(f"{len(shapes)} shapes in {a.changed_shapes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
