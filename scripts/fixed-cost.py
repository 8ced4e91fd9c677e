#!/usr/bin/env python3
"""Is the last half microsecond a fixed cost per kernel or a cost per K step? One config, many Ks.

On the fp32 shapes of 2^27-2^33 FLOPs our CUTLASS winners run ~0.4-0.5 us longer per call than
cuBLASLt's autotuned nvjet kernels (results/README.md, "Where the last half microsecond goes";
scripts/launch-gap.py measured the kernels' own durations). A kernel's duration is about
intercept + slope * K: the intercept is what it pays once (launch, prologue, epilogue, tail),
the slope what each step of the mainloop costs. To tell which of the two holds the gap, this
holds each side's kernel configuration fixed and varies only K: for each anchor shape MxNxK it
takes our stored tuned winner for the anchor (a CUTLASS spec serves every K it is valid for;
a raw-family winner is built for one exact shape and is skipped) and cuBLASLt autotuned's
stored algorithm for the anchor (the same 64-byte algo blob, planned again for each K; a K it
refuses is recorded as unsupported), and for each K of the sweep (the anchor's K included)
measures the kernel's median duration under the profiler (CUPTI) over one CUDA-graph replay of
--calls back-to-back calls, and the judge's kernel-mode time per call (two rounds). Then it
fits duration against K per side by least squares and reports the intercepts and slopes and
ours minus cuBLASLt of each:

    python3 scripts/fixed-cost.py --db results/gemmrl.sqlite --out OUT/fixed-cost.json \\
        --layout TN 256x128x2048 1024x512x1024

A difference in intercept with equal slopes says the gap is fixed per kernel (prologue,
epilogue); a difference in slope says it grows with K (the mainloop). The winner must be of
--layout (the store keeps one winner per shape, of either layout; one of the other layout is
skipped with a line saying so). Prints a table; writes every record and the fits as JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_KS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
SIDES = ("ours", "cublaslt")


def fit_line(points: list[tuple[float, float]]) -> dict:
    """Least squares of y (duration, us) on x (K): intercept_us, slope_us_per_k (per element of
    K), slope_us_per_1024k, r2 and n. Needs at least two points with distinct x (ValueError
    otherwise). Pure: tested on the CPU."""
    pts = [(float(x), float(y)) for x, y in points]
    n = len(pts)
    if n < 2:
        raise ValueError(f"a line needs at least two points, got {n}")
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        raise ValueError("a line needs at least two distinct K")
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in pts)
    ss_tot = sum((y - my) ** 2 for _, y in pts)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0  # all y equal: the flat line fits exactly
    return {"intercept_us": intercept, "slope_us_per_k": slope, "slope_us_per_1024k": slope * 1024,
            "r2": r2, "n": n}


def summarize(records: list[dict], metric: str = "duration_us") -> list[dict]:
    """Per (M, N, anchor K, side) the fit of `metric` against K over the records that have it (a
    number): two anchors of one M x N hold different configurations and are fitted apart. A
    side with fewer than two usable points (or one K only) gets an entry with 'skipped' and
    no fit. Per anchor with both sides fitted, one more entry (side 'ours-cublaslt') with ours
    minus cuBLASLt's intercept and slope. Entries are in the order the shapes first appear.
    Pure: tested on the CPU."""
    points: dict[tuple[int, int, int | None], dict[str, list]] = {}
    for r in records:
        if r.get("side") not in SIDES:
            continue
        key = (int(r["M"]), int(r["N"]), None if r.get("anchor_k") is None else int(r["anchor_k"]))
        per = points.setdefault(key, {s: [] for s in SIDES})
        y = r.get(metric)
        if isinstance(y, (int, float)) and not isinstance(y, bool) and not math.isnan(y):
            per[r["side"]].append((r["K"], y))
    out = []
    for (m, n, ak), per in points.items():
        fits = {}
        for side in SIDES:
            base = {"M": m, "N": n, "anchor_k": ak, "metric": metric, "side": side,
                    "ks": sorted(int(k) for k, _ in per[side])}
            try:
                fits[side] = fit_line(per[side])
            except ValueError as e:
                out.append({**base, "n": len(per[side]), "skipped": str(e)})
                continue
            out.append({**base, **fits[side]})
        if all(s in fits for s in SIDES):
            o, c = fits["ours"], fits["cublaslt"]
            out.append({"M": m, "N": n, "anchor_k": ak, "metric": metric, "side": "ours-cublaslt",
                        "d_intercept_us": o["intercept_us"] - c["intercept_us"],
                        "d_slope_us_per_k": o["slope_us_per_k"] - c["slope_us_per_k"],
                        "d_slope_us_per_1024k": o["slope_us_per_1024k"] - c["slope_us_per_1024k"]})
    return out


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    try:
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxNxK with positive whole numbers, got {text!r}") from None
    if min(m, n, k) <= 0:
        raise argparse.ArgumentTypeError(f"a shape is MxNxK with positive whole numbers, got {text!r}")
    return m, n, k


def _ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ks is comma-separated positive whole numbers, got {text!r}") from None
    if not ks or min(ks) <= 0:
        raise argparse.ArgumentTypeError(f"--ks is comma-separated positive whole numbers, got {text!r}")
    return ks


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", type=_shape, metavar="MxNxK",
                    help="anchor shapes (fp16, fp32 accumulate): each side's kernel is the one chosen for this K")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", default="TN", type=str.upper, choices=("NN", "TN"),
                    help="cuBLASLt autotuned's layout; our winner must be of it too (default TN)")
    ap.add_argument("--ks", type=_ks, default=list(DEFAULT_KS),
                    help="comma-separated K sweep (the anchor's K is added; default %(default)s)")
    ap.add_argument("--calls", type=int, default=64, help="calls per profiled graph")
    args = ap.parse_args(argv)
    if args.calls < 2:
        ap.error("--calls needs at least 2 (the profiler's medians are over back-to-back calls)")
    return args


def _launch_gap():
    """scripts/launch-gap.py as a module (scripts/ is not a package): profile_graph, split_trace."""
    spec = importlib.util.spec_from_file_location("launch_gap", Path(__file__).resolve().parent / "launch-gap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(lg, fn, sets, calls: int) -> dict:
    """The profiled replay: split_trace's medians, the kernels per call and, where a call is more
    than one kernel (a split-K reduction), the summed kernel time per call as duration_us."""
    events = lg.profile_graph(fn, sets, calls)
    t = lg.split_trace(events)
    per_call = len(events) / calls
    t["kernels_per_call"] = per_call
    t["summed_duration_per_call_us"] = sum(d for _, _, d in events) / calls
    t["duration_us"] = t["median_duration_us"] if per_call == 1 else t["summed_duration_per_call_us"]
    return t


def _fmt(x, spec=".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fixed-cost.py: no CUDA device (torch.cuda.is_available() is false): it times kernels on a GPU",
              file=sys.stderr)
        return 2

    from gemmrl.baselines.impls import _stream, cublas_lib
    from gemmrl.bench import timing
    from gemmrl.bench.env import git_commit
    from gemmrl.bench.env import provenance as env_provenance
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.core.problem import Problem
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.search.best_of import BestOf
    from gemmrl.space import cutlass_sm90 as cs
    from gemmrl.store.db import Store

    lg = _launch_gap()
    store = Store(args.db, readonly=True)
    device = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    tuned = impls_from_specs(["tuned"], store=store, device=device)[0]
    assert isinstance(tuned, BestOf)
    lt = impls_from_specs([f"cuBLASLt-auto-tuning-{args.layout.lower()}"], store=store, device=device)[0]
    lib = cublas_lib()
    records = []
    provenance = env_provenance()  # device, driver, CUDA, torch, commit, date: once, for the JSON

    def dump():  # after every anchor shape: a step cut by its time limit keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "device": device, "torch": torch.__version__, "commit": git_commit(), "provenance": provenance,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": sys.argv, "records": records,
            "fits": summarize(records) + summarize(records, "kernel_mode_us")}, indent=1))

    for m, n, k_anchor in args.shapes:
        tag = f"{m}x{n}x{k_anchor}"
        anchor = Problem(m, n, k_anchor, dtype="fp16", acc="fp32")
        spec = tuned._stored(anchor)
        if spec is None:
            print(f"{tag}: nothing tuned, skipped", flush=True)
            continue
        if not isinstance(spec, cs.CutlassSpec):
            print(f"{tag}: the winner {spec.name} is not a CUTLASS spec (a raw-family kernel is built for "
                  f"one exact shape, so it cannot serve other Ks): skipped", flush=True)
            continue
        if spec.layout != args.layout:
            print(f"{tag}: the winner {spec.name} is {spec.layout}, not --layout {args.layout}: skipped", flush=True)
            continue
        # cuBLASLt autotuned's stored choice for the anchor; if there is none (or one made by an
        # earlier rule), choose it now without storing it (the store is opened read-only)
        got = store.get_tuning(device, anchor, lt.name)
        lt_source = "stored"
        if got is None or timing.BASELINE_PICK_TAG not in got["info"]:
            print(f"{tag}: no current stored {lt.name} choice; autotuning it now (not stored)", flush=True)
            lt.store, lt_source = None, "chosen now"
        try:
            blob = bytes(lt.choose(anchor))
        finally:
            lt.store = store
        lt_desc = lib.describe(blob)
        print(f"{tag}: ours {spec.name}; {lt.name} {lt_desc} ({lt_source})", flush=True)
        for k in sorted(set(args.ks) | {k_anchor}):
            problem = Problem(m, n, k, dtype="fp16", acc="fp32")
            common = {"shape": tag, "M": m, "N": n, "anchor_k": k_anchor, "K": k, "anchor": k == k_anchor,
                      "layout": args.layout}
            kernels = {"ours": {"kernel": spec.name}, "cublaslt": {"kernel": lt_desc, "choice": lt_source}}
            fns, recs, plans = {}, {}, []
            why = cs.valid(spec, problem)
            if why is not None:
                recs["ours"] = {"unsupported": why}
            else:
                try:
                    fns["ours"] = SpecImpl(spec).prepare(problem)
                except Exception as e:  # noqa: BLE001 - does not build or load here: say so, go on
                    recs["ours"] = {"unsupported": f"{type(e).__name__}: {e}"[:300]}
            try:
                plan = lib.plan(args.layout, problem.dtype, problem.acc, m, n, k, blob)
            except Exception as e:  # noqa: BLE001 - the anchor's algorithm refused at this K
                recs["cublaslt"] = {"unsupported": f"{type(e).__name__}: {e}"[:300]}
            else:
                plans.append(plan)
                tn = args.layout == "TN"

                def lt_call(a, b_nn, b_tn, c, plan=plan, tn=tn):
                    lib.run(plan, a.data_ptr(), (b_tn if tn else b_nn).data_ptr(), c.data_ptr(), _stream())
                fns["cublaslt"] = lt_call
            if fns:
                sets = timing.make_sets(problem, timing.n_input_sets(problem, l2, timing.KernelSettings()),
                                        torch.Generator(device="cuda").manual_seed(0))
                reps = {s: [] for s in fns}
                status = {s: [] for s in fns}
                for rep in range(2):
                    res = timing.time_kernel(problem, fns, l2_bytes=l2, seed=rep)
                    for s, r in res.items():
                        reps[s].append(r.get("median_us"))
                        status[s].append(r.get("status"))
                for s, fn in fns.items():
                    try:
                        trace = _trace(lg, fn, sets, args.calls)
                    except Exception as e:  # noqa: BLE001 - no events (profiler unavailable): say so, keep the timings
                        trace = {"error": f"{type(e).__name__}: {e}"[:300]}
                    ok = [t for t in reps[s] if isinstance(t, (int, float))]
                    recs[s] = {"kernel_mode_us_reps": reps[s], "kernel_mode_status": status[s],
                               "kernel_mode_us": statistics.mean(ok) if ok else None, **trace}
                del sets
            for plan in plans:
                lib.destroy(plan)
            for s in SIDES:
                rec = {**common, "side": s, **kernels[s], **recs[s]}
                records.append(rec)
                if "unsupported" in rec:
                    print(f"{tag} K={k:<6d} {s:9s} unsupported: {rec['unsupported'][:120]}", flush=True)
                    continue
                print(f"{tag} K={k:<6d} {s:9s} duration {_fmt(rec.get('duration_us'))} us"
                      f"  kernel-mode {', '.join(_fmt(t) for t in rec['kernel_mode_us_reps'])} us/call"
                      f"  kernels/call {_fmt(rec.get('kernels_per_call'), '.1f')}"
                      f"  {', '.join(rec.get('names', []))[:70]}", flush=True)
        dump()
    fits = summarize(records) + summarize(records, "kernel_mode_us")
    print(f"\n{'M':>6s} {'N':>6s} {'metric':15s} {'side':14s} {'intercept us':>12s} {'us/1024 K':>10s}"
          f" {'r2':>7s} {'n':>3s}")
    for f in fits:
        if f["side"] == "ours-cublaslt":
            print(f"{f['M']:6d} {f['N']:6d} {f['metric']:15s} {f['side']:14s} {f['d_intercept_us']:+12.3f}"
                  f" {f['d_slope_us_per_1024k']:+10.4f}")
        elif "skipped" in f:
            print(f"{f['M']:6d} {f['N']:6d} {f['metric']:15s} {f['side']:14s} skipped: {f['skipped']}")
        else:
            print(f"{f['M']:6d} {f['N']:6d} {f['metric']:15s} {f['side']:14s} {f['intercept_us']:12.3f}"
                  f" {f['slope_us_per_1024k']:10.4f} {f['r2']:7.4f} {f['n']:3d}")
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
