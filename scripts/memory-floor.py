#!/usr/bin/env python3
"""How much of the bandwidth roofline #3's skinny shapes can reach at all (gemmrl.bench.floor).

Times, in the judge's kernel-mode protocol and in one session per shape, the memory-floor kernel
(only the GEMM's compulsory traffic: A and B read once, C written once; timed twice, for the
noise) beside the libraries, on the skinny memory-bound shapes (M or N at most 256, K at least
4096; memory-bound by the peaks measured at the start), and writes every row, the peaks, the
provenance and the summary (floor.summarize) as JSON, after every shape (a cut run keeps what it
measured):

    python3 scripts/memory-floor.py --out results/h100/memory-floor-h100.json            # the grid's skinny shapes
    python3 scripts/memory-floor.py --shapes subset --impl baselines --impl pack:packs/h100-fp16-F32F16F16F32 \\
        --out OUT.json        # the subset's, with gemmrl.matmul (the pack's verified winners) beside them

`--report FILE.json` prints the summary of a file written earlier (no GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_IMPLS = "torch.matmul,cuBLASLt-heuristic-nn,cuBLASLt-heuristic-tn"
FLOOR, REPEAT = "memory-floor", "memory-floor@repeat"


def rows_of(doc: dict):
    from gemmrl.bench.floor import FloorRow

    return [FloorRow(r["shape"], r["roofline_us"], r["times_us"][FLOOR], r["times_us"]) for r in doc["rows"]
            if FLOOR in r["times_us"]]


def report(doc: dict) -> dict:
    from gemmrl.bench.floor import summarize

    rows = rows_of(doc)
    impls = sorted({i for r in rows for i in r.times_us} - {FLOOR})
    return summarize(rows, impls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="grid", help="grid | subset | FILE | MxNxK[,...]: their skinny "
                                                     "memory-bound shapes are timed")
    ap.add_argument("--impl", action="append", default=None,
                    help=f"implementations beside the floor (select.impls_from_specs; default {DEFAULT_IMPLS})")
    ap.add_argument("--db", default="results/gemmrl.sqlite", help="the store (stored cuBLASLt choices, packs)")
    ap.add_argument("--out", help="JSON written after every shape")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new shape after this many seconds")
    ap.add_argument("--report", metavar="FILE", help="print the summary of an earlier --out file and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(json.dumps(report(json.loads(Path(args.report).read_text())), indent=1))
        return 0
    if not args.out:
        ap.error("--out is required (or --report FILE)")

    import torch

    from gemmrl.bench import env, floor, timing
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.build.nvcc import build_shared
    from gemmrl.core.shapes import resolve
    from gemmrl.runtime.abi import AbiKernel, abi_call
    from gemmrl.store.db import Store

    if not torch.cuda.is_available():
        print("memory-floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    device = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    peaks = env.measure_peaks()
    bw, tf = peaks["bandwidth_gbs"], peaks["matrix_tflops"]
    problems = [p for p in resolve(args.shapes) if floor.skinny(p) and floor.supports(p)
                and floor.roofline_us(p, bw, tf)[1] == "memory"]
    print(f"{len(problems)} skinny memory-bound shapes; peaks {tf:.0f} TFLOP/s, {bw:.0f} GB/s", flush=True)
    build = build_shared(floor.source(), name="memory-floor")
    if not build.ok:
        print(build.log[-3000:], file=sys.stderr)
        return 1
    kernel = AbiKernel(build.path)
    store = Store(args.db, readonly=True) if Path(args.db).exists() or Path(args.db + ".xz").exists() else None
    impls = impls_from_specs(args.impl or [DEFAULT_IMPLS], store=store, device=device)
    doc = {"what": "memory floor: kernel-mode time of a kernel doing only the compulsory traffic",
           "command": " ".join(["scripts/memory-floor.py"] + (argv if argv is not None else sys.argv[1:])),
           "provenance": env.provenance(), "peaks": peaks, "impls": [i.name for i in impls],
           "settings": timing.settings_dict(timing.KernelSettings()), "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    for idx, p in enumerate(problems):
        if args.budget_s is not None and time.monotonic() - t_start > args.budget_s:
            print(f"budget reached after {idx} of {len(problems)} shapes", flush=True)
            doc["stopped_early"] = True
            break
        fn = abi_call(kernel, p, FLOOR)
        fns = {FLOOR: fn, REPEAT: fn}
        errors = {}
        for impl in impls:
            if impl.supports(p):
                try:
                    fns[impl.name] = impl.prepare(p)
                except Exception as e:  # one that cannot run this shape: say so, time the rest
                    errors[impl.name] = f"{type(e).__name__}: {e}"[:300]
        res = timing.time_kernel(p, fns, l2_bytes=l2, unchecked=frozenset({FLOOR, REPEAT}))
        times = {n: r["median_us"] for n, r in res.items() if r.get("status") == "ok"}
        errors.update({n: r.get("details", {}).get("reason", r.get("status"))
                       for n, r in res.items() if r.get("status") != "ok"})
        roof, _ = floor.roofline_us(p, bw, tf)
        row = {"shape": p.shape, "M": p.M, "N": p.N, "K": p.K, "bytes": p.min_bytes, "roofline_us": roof,
               "times_us": times, **({"errors": errors} if errors else {})}
        doc["rows"].append(row)
        ff = roof / times[FLOOR] if FLOOR in times else float("nan")
        best = min((t for n, t in times.items() if not n.startswith(FLOOR)), default=float("nan"))
        print(f"[{idx + 1}/{len(problems)}] {p.shape:>18s} roofline {roof:8.2f} us  floor "
              f"{times.get(FLOOR, float('nan')):8.2f} us ({ff:.2f} of the roofline)  best other "
              f"{best:8.2f} us ({roof / best:.2f})", flush=True)
        doc["summary"] = report(doc)
        out.write_text(json.dumps(doc, indent=1))
    doc["summary"] = report(doc)
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
