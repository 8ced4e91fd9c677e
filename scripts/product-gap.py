"""Why gemmrl.matmul's fallback costs more against torch.matmul inside `bench` than alone (#4).

`bench --impl baselines --impl pack:DIR --mode offline` measured the NN fallback 2 us slower
than torch.matmul, while scripts/fallback-gap.py, timing the very same call with the same timer
(time_host) beside a few other gemmrl calls, measured 0.45 us. This runs, in one process and on
the same shapes, the three ways in between:

  A  the bench's own loop (runner.run: prepare, verify, time), baselines and the pack together
  B  time_host on the prepared calls of A without verifying: all 11 implementations
  C  time_host on torch.matmul (twice), torch.matmul-tn and the pack's NN and TN calls only

and reports for each the pack's NN and TN time over torch.matmul's and torch.matmul-tn's, with
the C++ fast path's counters over the timing (a call handed to Python shows there):

    python scripts/product-gap.py PACK_DIR OUT_DIR [--shapes 128x256x64,...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from gemmrl.bench import env, runner, timing
from gemmrl.core.shapes import parse_shape

DEFAULT_SHAPES = "128x256x64,512x64x512,256x2048x512,1024x512x2048"
SMALL = ("torch.matmul", "torch.matmul@repeat", "torch.matmul-tn", "gemmrl.matmul-nn", "gemmrl.matmul-tn")


def gaps(t: dict) -> dict:
    out = {}
    if "gemmrl.matmul-nn" in t and "torch.matmul" in t:
        out["nn_us_over_torch"] = t["gemmrl.matmul-nn"] - t["torch.matmul"]
    if "gemmrl.matmul-tn" in t and "torch.matmul-tn" in t:
        out["tn_us_over_torch_tn"] = t["gemmrl.matmul-tn"] - t["torch.matmul-tn"]
    if "torch.matmul@repeat" in t:
        out["repeat_us"] = t["torch.matmul@repeat"] - t["torch.matmul"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("out")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env.use_harness_settings()
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.runtime import ops
    from gemmrl.store.db import Store

    device = torch.cuda.get_device_name()
    tmp = Path(tempfile.mkdtemp(prefix="gemmrl-gap-"))
    store = Store(tmp / "gap.sqlite")
    impls = impls_from_specs(["baselines", f"pack:{args.pack}"], store, device)
    host = timing.HostSettings(mode="offline", target_ci=0.005, max_rounds=2000)
    cfg = runner.RunConfig(modes=("offline",), offline=host, retime=True)
    run_id = store.start_run("product-gap", device, env.provenance("n/a"), {})
    results = {}
    for spec in args.shapes.split(","):
        p = parse_shape(spec)
        res = {}
        fast = ops._fast()
        s0 = fast.stats() if fast is not None else {}
        t0 = time.perf_counter()
        runner.run([p], impls, store, cfg, device=device, run_id=run_id, log=lambda m: print(m, flush=True))
        s1 = fast.stats() if fast is not None else {}
        recs = {r["impl"]: r["median_us"] for r in store.measurements(device=device, mode="offline")
                if (r["M"], r["N"], r["K"]) == (p.M, p.N, p.K)}
        res["A bench loop"] = {"medians": recs, **gaps(recs), "seconds": time.perf_counter() - t0,
                               "fast_path_delta": {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], int)}}
        calls = {}
        for impl in impls:
            try:
                calls[impl.name] = impl.prepare(p)
            except Exception as e:  # noqa: BLE001 - an impl that does not serve this shape
                print(f"{spec} {impl.name}: {type(e).__name__}: {e}", flush=True)
        calls["torch.matmul@repeat"] = calls["torch.matmul"]
        for label, names in (("B all, no verify", list(calls)), ("C five, no verify", SMALL)):
            s0 = fast.stats() if fast is not None else {}
            r = timing.time_host(p, {n: calls[n] for n in names if n in calls}, settings=host)
            s1 = fast.stats() if fast is not None else {}
            med = {n: v["median_us"] for n, v in r.items() if v.get("status") == "ok"}
            res[label] = {"medians": med, **gaps(med),
                          "fast_path_delta": {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], int)}}
        for label, r in res.items():
            print(f"{spec} {label}: " + ", ".join(f"{k} {v:+.2f}" for k, v in r.items() if k.endswith("_us")
                                                    or k.endswith("torch") or k.endswith("tn")), flush=True)
        results[spec] = res
    (out / "product-gap.json").write_text(json.dumps(
        {"pack": args.pack, "results": results, "public_matmul": repr(ops.public_matmul()),
         "provenance": env.provenance("n/a")}, indent=1, default=str))


if __name__ == "__main__":
    main()
