#!/usr/bin/env python3
"""Did some runs measure the tuned winners differently from the others? From the store alone (no
GPU): for every (shape, kernel) timed both in `--runs` and outside them (the kernel a session timed
is the one its run's passed verification of gemmrl-tuned names), the ratio over the baseline
(`--baseline`, the faster of its NN and TN rows, divided by gemmrl-tuned's median, as in the
reports) in the runs' last session over the median of its sessions outside them.
Prints the factor's median, p10 and p90 by kernel class (split-K with a separate reduction, split-K,
stream-K, other CUTLASS, raw), and how many shapes' latest session in the mode (what the report
reads) comes from the runs, by class. `--out FILE --kind CLASS` writes those shapes of the classes
named, smallest first: a retime list.

    python3 scripts/session-bias.py --device H200 --acc fp32 --runs 288-291 \\
        --out results/shapes/h200-fp32-sr-runs288-291.txt --kind splitk-sr

`--slow-runs SHARE` instead of `--runs` takes the runs whose small-shape library sessions ran slow in
SHARE or more of them (scripts/library-state.py --min-slow SHARE, with its --min-sessions): the report
rows that rest on a slow-library run, as a retime list with --out (2026-11-30, sixtieth session: 222
fp32 and 253 fp16 rows at 0.05).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gemmrl.report.bias import (CLASSES, SUBJECT, bias, format_runs, latest_from, parse_runs, quantile,  # noqa: E402
                                ratios, slow_runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="a GPU of the store, or part of its name (H200)")
    ap.add_argument("--acc", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--mode", choices=("kernel", "offline", "server"), default="kernel")
    ap.add_argument("--baseline", default="cuBLASLt-auto-tuning", help="a baseline with -nn and -tn rows")
    pick = ap.add_mutually_exclusive_group(required=True)
    pick.add_argument("--runs", help="run ids and ranges: 288-291,300")
    pick.add_argument("--slow-runs", type=float, metavar="SHARE",
                      help="the runs whose small-shape library sessions ran slow in this share or more of them "
                           "(scripts/library-state.py --min-slow)")
    ap.add_argument("--min-sessions", type=int, default=10,
                    help="with --slow-runs: runs with at least this many small-shape library sessions (default 10)")
    ap.add_argument("--out", type=Path, help="write the shapes whose latest session is the runs'")
    ap.add_argument("--kind", action="append", choices=CLASSES, help="with --out: only these classes")
    a = ap.parse_args(argv)
    if a.slow_runs is not None and not 0 < a.slow_runs <= 1:
        ap.error("--slow-runs is a share of a run's library sessions: more than 0, at most 1 (0.05: 5%)")
    try:
        runs = parse_runs(a.runs) if a.runs else set()
    except ValueError as e:
        ap.error(str(e))
    if a.kind and not a.out:
        ap.error("--kind goes with --out")

    from gemmrl.store.db import Store, device_by_part

    if not Path(a.db).exists() and not Path(str(a.db) + ".xz").exists():
        ap.error(f"no store at {a.db}")
    store = Store(a.db)
    try:
        device = device_by_part(a.device, store.devices(), "GPUs")
    except ValueError as e:
        ap.error(str(e))
    if device not in store.devices():
        ap.error(f"no measurements on {a.device!r} in {a.db}")
    if a.slow_runs is not None:
        runs = slow_runs(store.db, device, a.slow_runs, a.min_sessions)
        if not runs:
            ap.error(f"no run on {device} with {a.min_sessions} or more small-shape library sessions had "
                     f"{a.slow_runs:.0%} or more of them slow (scripts/library-state.py)")
        a.runs = format_runs(runs)
        print(f"runs with {a.slow_runs:.0%} or more slow library sessions: {a.runs}")
    rows = ratios(store.db, device, a.acc, a.dtype, a.mode, a.baseline)
    if not any(r[0] in runs for r in rows):
        ap.error(f"runs {a.runs} timed no verified {SUBJECT} winner on {device}, {a.dtype} acc {a.acc}, {a.mode} mode")
    found = bias(rows, runs)
    late = latest_from(rows, runs)
    print(f"{device} {a.dtype} acc {a.acc}, {a.mode} mode: ratio over {a.baseline} in runs {a.runs} / the "
          f"median of the same kernel's sessions outside them")
    print("| kernels | pairs | median | p10 | p90 | shapes whose latest session is the runs' |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in CLASSES:
        f = found.get(k, [])
        if f or late.get(k):
            cells = (f"{math.exp(quantile([math.log(x) for x in f], q)):.3f}" for q in (0.5, 0.1, 0.9)) if f else \
                iter(("-", "-", "-"))
            print(f"| {k} | {len(f)} | {' | '.join(cells)} | {len(late.get(k, []))} |")
    if a.out:
        kinds = a.kind or list(CLASSES)
        shapes = sorted((s for k in kinds for s in late.get(k, [])), key=lambda s: (s[0] * s[1] * s[2], s))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(f"# {device} {a.dtype} acc {a.acc}: the {len(shapes)} shapes whose latest {a.mode}-mode "
                         f"session of {SUBJECT} is one of runs {a.runs}, winners of {', '.join(kinds)} "
                         "(scripts/session-bias.py)\n" + "".join(f"{M}x{N}x{K}\n" for M, N, K in shapes))
        print(f"{len(shapes)} shapes -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
