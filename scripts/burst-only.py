#!/usr/bin/env python3
"""Which shapes a `bench --impl race:K:built:burstN` should race, from the store and the kernel
report alone (no GPU): the shapes whose report ratio over cuBLASLt autotuned is below `--below`
and that hold a burst-only kernel (search/race.py's burst_only: every trial of it was timed in
the early 0.5 ms bursts, none beside the baseline) whose burst reward reads more than `--margin`
above the shape's final ratio over its best baseline. Such a kernel counts as tried, so the
search never proposes it again, and it never races unless a race names it.

Writes the shapes, largest burst-over-final gap first, one a line (a bench --shapes FILE, or
`gemmrl build --tuned-in DB --race 1 --burst 2 --shapes FILE`), with a comment line saying how
they were chosen.

    python3 scripts/burst-only.py --device H200 --acc fp32 --out results/shapes/h200-fp32-burst.txt
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRECISIONS = {"fp32": "F32F16F16F32", "fp16": "F16F16F16F16"}


def pick(rows, burst_reward, below: float, margin: float) -> list:
    """(shape, ratio over autotuned, ratio over the best baseline, best burst reward) for each
    report row (mnk, autotuned, best-baseline) below `below` whose burst_reward(shape) (None: no
    burst-only kernel) exceeds its best-baseline ratio by more than `margin`; largest gap first."""
    out = []
    for mnk, auto, best in rows:
        if auto is None or best is None or auto >= below:
            continue
        r = burst_reward(mnk)
        if r is not None and r > best + margin:
            out.append((mnk, auto, best, r))
    return sorted(out, key=lambda x: (-(x[3] - x[2]), x[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part (H200)")
    ap.add_argument("--acc", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("--csv", default=None, help="the kernel report's speedup CSV (default: RESULTS/<gpu>/"
                                                "gemmrl-tuned_<gpu>_<PREC>_speedup_kernel.csv)")
    ap.add_argument("--results", default=str(ROOT / "results"), help="where the reports are (without --csv)")
    ap.add_argument("--below", type=float, default=1.0, help="report ratios over cuBLASLt autotuned below this")
    ap.add_argument("--margin", type=float, default=0.03, help="burst reward over the final ratio by more than this")
    ap.add_argument("--out", default=None, help="write the shapes here (default: print only the largest gaps)")
    args = ap.parse_args(argv)

    from gemmrl.core.problem import Problem
    from gemmrl.search.race import burst_only
    from gemmrl.search.run import stored_history
    from gemmrl.store.db import Store, device_by_part, unpack_if_missing

    unpack_if_missing(args.db)
    if not Path(args.db).exists():
        print(f"no store at {args.db}", file=sys.stderr)
        return 1
    store = Store(args.db, readonly=True)
    tuned = store.tuned_devices("gemmrl-tuned")
    try:
        device = device_by_part(args.device, tuned, "GPUs")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if device not in tuned:
        print(f"{args.db} holds no tuned shapes on {args.device!r} (it has: {', '.join(sorted(tuned)) or 'none'})",
              file=sys.stderr)
        return 1
    from gemmrl.bench.env import gpu_slug

    gpu = gpu_slug(device)  # 'NVIDIA H100 80GB HBM3' -> h100
    path = Path(args.csv or Path(args.results) / gpu / f"gemmrl-tuned_{gpu}_{PRECISIONS[args.acc]}_speedup_kernel.csv")
    if not path.exists():
        print(f"no kernel report at {path} (gemmrl report --device {args.device})", file=sys.stderr)
        return 1

    def num(x):
        return float(x) if x not in (None, "") else None

    rows = [(r["mnk"], num(r.get("cuBLASLt-auto-tuning-max")), num(r.get("best-baseline")))
            for r in csv.DictReader(path.open())]

    def problem(mnk):
        M, N, K = map(int, mnk.split("_"))
        return Problem(M, N, K, acc=args.acc)

    by_problem: dict = {}  # every trial read once (the store's trials are read per device)
    for t in stored_history(store, device, [problem(m) for m, auto, _ in rows if auto is not None and auto < args.below]):
        by_problem.setdefault(t.problem, []).append(t)

    def burst_reward(mnk):
        trials = by_problem.get(problem(mnk), [])
        names = {s.name for s in burst_only(trials, len(trials))}
        rewards = [t.reward for t in trials if t.candidate.spec.name in names]
        return max(rewards) if rewards else None

    got = pick(rows, burst_reward, args.below, args.margin)
    store.close()
    lines = [f"# {device} {args.acc}: {len(got)} shapes below {args.below} of cuBLASLt autotuned in {path.name} "
             f"with a burst-only kernel reading more than {args.margin} above the final ratio "
             f"(scripts/burst-only.py); largest gap first"]
    lines += [mnk.replace("_", "x") for mnk, *_ in got]
    for mnk, auto, best, r in got[:10]:
        print(f"{mnk.replace('_', 'x'):>18}  autotuned {auto:.3f}  best baseline {best:.3f}  burst {r:.3f}")
    print(f"{len(got)} shapes")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
