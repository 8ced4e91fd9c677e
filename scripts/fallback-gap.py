"""Where gemmrl.matmul's extra host time on fallback shapes goes, in offline mode (issue #4).

`bench --impl pack:DIR` measured gemmrl.matmul(out=C) 2 to 3 us slower than torch.matmul(out=C)
on shapes the pack does not serve, while a GPU test that times the same calls in
torch.inference_mode() measured 0.2 to 0.6 us. This times, with the harness's own offline timer
(time_host: fresh inputs, shuffled order, synchronize-call-synchronize), the layers of the call
one by one: torch.matmul, fast.run (the C++ path alone), ops._mm_impl (plus Python dispatch),
ops.matmul (plus its argument checks: gemmrl.matmul until 2026-11-22's fourth session),
gemmrl.matmul (the C++ module's matmul() since) and the bench's PackMatmul call, under grad mode
(as bench runs), torch.no_grad() and torch.inference_mode():

    python scripts/fallback-gap.py PACK_DIR OUT_DIR [--shapes 128x256x64,...]

Writes OUT_DIR/fallback-gap.json (medians and p10 per shape, grad mode and call; what the pack
serves for each shape; the fast path's counters).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from gemmrl.bench import env, timing
from gemmrl.core.shapes import parse_shape

DEFAULT_SHAPES = "128x256x64,512x64x512,256x2048x512,1024x512x2048,16384x128x512,2048x4096x1024"
MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("out")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--ci", type=float, default=0.003)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    import gemmrl
    from gemmrl.runtime import fastpath, ops
    from gemmrl.runtime.pack_impl import PackMatmul

    ops.use_pack(args.pack)
    fast = fastpath.get()
    if fast is None:
        raise SystemExit("the C++ fast path did not build here")
    mm_impl, run = ops._mm_impl, fast.run
    results = {}
    for spec in args.shapes.split(","):
        p = parse_shape(spec)
        pack_nn = PackMatmul(args.pack, "NN").prepare(p)
        pack_tn = PackMatmul(args.pack, "TN").prepare(p)
        calls = {
            "torch.matmul out= NN": lambda a, b, bt, c: torch.matmul(a, b, out=c),
            "fast.run out= NN": lambda a, b, bt, c: run(a, b, False, c),
            "ops._mm_impl out= NN": lambda a, b, bt, c: mm_impl(a, b, "NN", c),
            "gemmrl.matmul out= NN": lambda a, b, bt, c: gemmrl.matmul(a, b, out=c),
            "ops.matmul out= NN (Python frame)": lambda a, b, bt, c: ops.matmul(a, b, out=c),
            "bench pack call NN": pack_nn,
            "torch.matmul out= TN": lambda a, b, bt, c: torch.matmul(a, bt.t(), out=c),
            "fast.run out= TN": lambda a, b, bt, c: run(a, bt, True, c),
            "gemmrl.matmul out= TN": lambda a, b, bt, c: gemmrl.matmul(a, bt, b_layout="TN", out=c),
            "bench pack call TN": pack_tn,
        }
        d = ops.active()  # each PackMatmul.prepare activates the pack anew (as in bench)
        serves = {lay: repr(d.lookup(p.M, p.N, p.K, lay, "fp16"))[:160] for lay in ("NN", "TN")}
        per_mode = {}
        for mode, ctx in MODES.items():
            s = timing.HostSettings(mode="offline", target_ci=args.ci, max_rounds=3000, max_s=8.0)
            t0 = time.perf_counter()
            with ctx():
                res = timing.time_host(p, calls, settings=s)
            per_mode[mode] = {n: {k: r.get(k) for k in ("median_us", "p10_us", "mean_us", "n", "status")}
                              | ({} if r.get("status") == "ok" else {"details": r.get("details")})
                              for n, r in res.items()}
            line = ", ".join(f"{n} {r['median_us']:.2f}" for n, r in res.items() if r.get("status") == "ok")
            print(f"{spec} [{mode}] {time.perf_counter() - t0:.1f} s: {line}", flush=True)
        results[spec] = {"serves": serves, "medians": per_mode}
    (out / "fallback-gap.json").write_text(json.dumps(
        {"method": "timing.time_host offline, target_ci %g, max 3000 rounds / 8 s per shape and grad mode" % args.ci,
         "pack": args.pack, "results": results, "fast_path": fast.stats(),
         "provenance": env.provenance("n/a")}, indent=1))


if __name__ == "__main__":
    main()
