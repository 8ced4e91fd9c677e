#!/usr/bin/env python3
"""How many kernel-mode rounds two timings of one implementation need to agree within 2%, and
whether a within-round paired ratio agrees better than the medians (issue #2).

Times, in the judge's kernel-mode protocol (timing.time_kernel: CUDA graphs over rotating inputs,
implementations shuffled every round), three copies of torch.matmul (the same call under three
names) beside cuBLAS and cuBLASLt heuristic in both layouts, so that a round holds the load a
bench session holds, with a fixed number of rounds and every replay's per-call time kept:

    python3 scripts/kernel-noise.py OUT_DIR [--rounds 160] [--shapes results/shapes/subset-every3rd.txt]

Writes OUT_DIR/kernel-noise-trace.csv (shape, gaps, round, name, gap_us, time_us; gaps is
'kernel', gap_us 0: the layout of scripts/server-noise.py's trace) after every shape, and
OUT_DIR/kernel-noise.json (provenance, settings, per-shape graph sizes). The agreement of the
copies, by chunks of n rounds and by statistic (report.noise.agreement_table), without a GPU:

    python3 scripts/kernel-noise.py --report OUT_DIR/kernel-noise-trace.csv[.gz] [--sizes 10,20,40,80,160]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPIES = ("torch.matmul", "torch.matmul#2", "torch.matmul#3")
OTHERS = "cuBLAS-nn,cuBLAS-tn,cuBLASLt-heuristic-nn,cuBLASLt-heuristic-tn"


def report_rows(rows: list[dict], sizes: list[int], copies=COPIES) -> list[dict]:
    """The agreement table of the copies' rows only (the other implementations load the rounds
    but are not the same call), per shape set: rows whose name is one of `copies`."""
    from gemmrl.report.noise import agreement_table

    mine = [r for r in rows if r["name"] in copies]
    if not mine:
        raise ValueError(f"no rows for {', '.join(copies)} in the trace")
    return agreement_table(mine, sizes)


def print_report(path: str, sizes: list[int]) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    shapes = len({r["shape"] for r in rows})
    print(f"{shapes} shapes; pairs of the copies {', '.join(COPIES)} per chunk of n rounds")
    print("| rounds | statistic | pairs | within 2% | median | p90 | max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in report_rows(rows, sizes):
        print(f"| {r['rounds']} | {r['stat']} | {r['pairs']} | {r['within']:.0%} | "
              f"{r['median']:.2%} | {r['p90']:.2%} | {r['max']:.2%} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--rounds", type=int, default=160)
    ap.add_argument("--shapes", default="results/shapes/subset-every3rd.txt")
    ap.add_argument("--others", default=OTHERS, help="implementations timed beside the copies")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new shape after this many seconds")
    ap.add_argument("--report", metavar="CSV", help="print the agreement table of a trace and exit (no GPU)")
    ap.add_argument("--sizes", default="10,20,40,80,160", help="--report: chunk sizes in rounds")
    args = ap.parse_args(argv)
    if args.report:
        print_report(args.report, [int(x) for x in args.sizes.split(",")])
        return 0
    if not args.out:
        ap.error("OUT_DIR is required (or --report CSV)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import torch

    from gemmrl.bench import env, timing
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.core.shapes import resolve

    if not torch.cuda.is_available():
        print("kernel-noise.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    settings = timing.KernelSettings(min_rounds=args.rounds, max_rounds=args.rounds, budget_s=1e9)
    others = impls_from_specs([args.others])

    def torch_call(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    doc = {"what": "kernel-mode noise: copies of torch.matmul timed with every replay kept",
           "command": " ".join(["scripts/kernel-noise.py"] + (argv if argv is not None else sys.argv[1:])),
           "provenance": env.provenance(), "settings": timing.settings_dict(settings), "copies": COPIES,
           "others": [i.name for i in others], "shapes": []}
    t_start = time.monotonic()
    problems = resolve(args.shapes)
    with open(out / "kernel-noise-trace.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "gaps", "round", "name", "gap_us", "time_us"])
        for idx, p in enumerate(problems):
            if args.budget_s is not None and time.monotonic() - t_start > args.budget_s:
                print(f"budget reached after {idx} of {len(problems)} shapes", flush=True)
                doc["stopped_early"] = True
                break
            calls = {n: torch_call for n in COPIES}
            calls.update({i.name: i.prepare(p) for i in others if i.supports(p)})
            trace: list = []
            t0 = time.perf_counter()
            res = timing.time_kernel(p, calls, l2_bytes=l2, settings=settings, trace=trace)
            bad = {n: r.get("details", {}).get("reason", r.get("status")) for n, r in res.items()
                   if r.get("status") != "ok"}
            for rnd, name, t_us in trace:
                w.writerow([p.shape, "kernel", rnd, name, "0", f"{t_us:.4f}"])
            f.flush()
            meds = [res[n]["median_us"] for n in COPIES if res[n].get("status") == "ok"]
            spread = max(meds) / min(meds) - 1 if meds else float("nan")
            doc["shapes"].append({"shape": p.shape, "wall_s": round(time.perf_counter() - t0, 2),
                                  "calls_per_replay": {n: r["details"]["calls_per_replay"] for n, r in res.items()
                                                       if r.get("status") == "ok"},
                                  **({"failed": bad} if bad else {})})
            print(f"[{idx + 1}/{len(problems)}] {p.shape:>18s} {time.perf_counter() - t0:5.1f} s  "
                  f"torch.matmul {min(meds):9.2f} us  copies' medians spread {spread:.2%}", flush=True)
            doc["wall_s"] = round(time.monotonic() - t_start, 1)
            (out / "kernel-noise.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
