#!/usr/bin/env python3
"""Where the last half microsecond goes: kernel durations and the gaps between back-to-back calls.

On the fp32 shapes of 2^27-2^33 FLOPs the tuned winner's kernel-mode time (CUDA-graph replay of
many calls, time per call) is a near-constant 0.4-0.5 us above cuBLASLt autotuned's, from 5 us
kernels to 30 us ones. A constant points at what happens between kernels (launch, prologue,
tail) rather than in the mainloop. This replays each implementation's graph under the profiler
(CUPTI) and splits the per-call time into the kernel's own duration and the gap to the next
call's start; a negative gap is an overlap (a programmatic dependent launch: the next kernel
started before this one ended):

    python3 scripts/launch-gap.py --db results/gemmrl.sqlite --out OUT/launch-gap.json \\
        256x128x2048 1024x512x1024:fp32

Implementations: the stored winner ('tuned') and cuBLASLt autotuned NN and TN; with --pdl the
winner's programmatic-dependent-launch twin ('tuned-pdl'); with --variants FIELDS the winner's
neighbours in those fields (gemmrl.build.ahead.variants: e.g. cluster,stages,epilogue), and
with --kernels NAMES further CUTLASS kernels by name, each where it serves the shape; a kernel
not in the build cache is built here (about a minute each). Each is timed twice in the judge's
kernel protocol (two rounds of the whole set, in turn) and profiled once. Prints a table;
writes every record as JSON. To find what a kernel's fixed cost is made of, compare the
per-kernel durations of a winner and its variants (not the graph's per-call times):

    python3 scripts/launch-gap.py --variants cluster,stages,epilogue --out OUT/fixed-cost.json \
        512x256x2048 4096x256x256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split_trace(events: list[tuple[str, float, float]]) -> dict:
    """Kernel events (name, start us, duration us), in start order, of back-to-back calls of one
    implementation: the median duration, start-to-start interval and gap (next start minus this
    end; negative: they overlapped), and how many of the gaps were overlaps. Pure: tested on the
    CPU."""
    ev = sorted(events, key=lambda e: e[1])
    if len(ev) < 2:
        raise ValueError(f"need at least two kernel events, got {len(ev)}")
    durs = [d for _, _, d in ev]
    starts = [t for _, t, _ in ev]
    intervals = [b - a for a, b in zip(starts, starts[1:])]
    gaps = [ev[i + 1][1] - (ev[i][1] + ev[i][2]) for i in range(len(ev) - 1)]
    return {"kernels": len(ev), "names": sorted({n for n, _, _ in ev}),
            "median_duration_us": statistics.median(durs), "median_interval_us": statistics.median(intervals),
            "median_gap_us": statistics.median(gaps), "overlaps": sum(g < 0 for g in gaps),
            "gaps": len(gaps)}


def profile_graph(fn, sets, calls_per_graph: int, replays: int = 3) -> list[tuple[str, float, float]]:
    """The kernel events of `replays` replays of a graph of `calls_per_graph` calls over `sets`
    (the last replay's only: one graph's worth of back-to-back calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*sets[0])
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(calls_per_graph):
            fn(*sets[i % len(sets)])
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or "memset" in e.name.lower() or "memcpy" in e.name.lower():
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end - e.time_range.start)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="MxNxK[:acc] (acc fp32, the default, or fp16)")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=64, help="calls per profiled graph")
    ap.add_argument("--pdl", action="store_true", help="also the winner's programmatic-dependent-launch twin")
    ap.add_argument("--variants", default="", metavar="FIELDS",
                    help="also the winner's neighbours in these comma-separated fields (CUTLASS winners)")
    ap.add_argument("--kernels", default="", metavar="NAMES",
                    help="also these comma-separated CUTLASS kernel names, where they serve the shape")
    args = ap.parse_args(argv)
    from gemmrl.build.ahead import VARIANT_FIELDS, variants

    fields = tuple(f.strip() for f in args.variants.split(",") if f.strip())
    if set(fields) - set(VARIANT_FIELDS):
        ap.error(f"--variants: fields are {', '.join(VARIANT_FIELDS)}; got {args.variants!r}")
    from gemmrl.space import cutlass_sm90 as cs

    try:
        extra = [cs.CutlassSpec.from_name(n.strip()) for n in args.kernels.split(",") if n.strip()]
    except ValueError as e:
        ap.error(f"--kernels: {e}")

    import torch

    from gemmrl.bench import timing
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.core.problem import Problem
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.search.best_of import BestOf
    from gemmrl.store.db import Store

    store = Store(args.db, readonly=True)
    device = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    base = impls_from_specs(["cuBLASLt-auto-tuning-nn,cuBLASLt-auto-tuning-tn"], store=store, device=device)
    tuned = impls_from_specs(["tuned"], store=store, device=device)[0]
    assert isinstance(tuned, BestOf)
    records = []
    for text in args.shapes:
        dims, _, acc = text.partition(":")
        m, n, k = (int(x) for x in dims.lower().split("x"))
        problem = Problem(m, n, k, dtype="fp16", acc=acc or "fp32")
        fns = {}
        spec = tuned._stored(problem)
        if spec is None:
            print(f"{dims}: nothing tuned, skipped", flush=True)
            continue
        fns["tuned"] = SpecImpl(spec).prepare(problem)
        kernel_of = {"tuned": spec.name}
        others = []
        if isinstance(spec, cs.CutlassSpec):
            if args.pdl:
                others.append(("tuned-pdl" if not spec.pdl else "tuned-nopdl", replace(spec, pdl=not spec.pdl)))
            if fields:
                others += [(v.name, v) for v in variants(spec, problem, fields)]
        others += [(x.name, replace(x, dtype=problem.dtype, acc=problem.acc)) for x in extra]
        for label, other in others:
            if label in fns or other == spec or cs.valid(other, problem) is not None:
                continue
            try:
                fns[label] = SpecImpl(other).prepare(problem)
                kernel_of[label] = other.name
            except Exception as e:  # a variant that does not build: say so, go on
                print(f"{dims}: {other.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for impl in base:
            if impl.supports(problem):
                fns[impl.name] = impl.prepare(problem)
        sets = timing.make_sets(problem, timing.n_input_sets(problem, l2, timing.KernelSettings()),
                                torch.Generator(device="cuda").manual_seed(0))
        timed = {nm: [] for nm in fns}
        for rep in range(2):
            res = timing.time_kernel(problem, fns, l2_bytes=l2, seed=rep)
            for nm, r in res.items():
                timed[nm].append(r.get("median_us"))
        for nm, fn in fns.items():
            try:
                trace = split_trace(profile_graph(fn, sets, args.calls))
            except Exception as e:  # no events (profiler unavailable): say so, keep the timings
                trace = {"error": f"{type(e).__name__}: {e}"[:300]}
            rec = {"shape": dims, "acc": problem.acc, "impl": nm, "kernel": kernel_of.get(nm, nm),
                   "kernel_mode_us": timed[nm], **trace}
            records.append(rec)
            print(f"{dims}:{problem.acc} {nm:26s} graph {', '.join(f'{t:.2f}' for t in timed[nm] if t)} us/call"
                  f"  duration {trace.get('median_duration_us', float('nan')):.2f}"
                  f"  interval {trace.get('median_interval_us', float('nan')):.2f}"
                  f"  gap {trace.get('median_gap_us', float('nan')):+.2f}"
                  f"  overlaps {trace.get('overlaps', '?')}/{trace.get('gaps', '?')}  {rec['kernel'][:60]}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                          "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
