#!/usr/bin/env python3
"""Why the search's quick kernel timing and the judge's kernel mode disagree on some shapes.

On 258 of the 1,000 fp32 shapes (most of 2^33-2^39 FLOPs) the final kernel-mode time of the
tuned winner is more than 10% above the search's quick timing of the same kernel, while the
baselines it is compared with are timed with the judge's protocol only. This times the winner
and cuBLASLt autotuned (both layouts) on given shapes under several protocols, alternating them
and twice each, and samples the SM clock and power between timings:

    python3 scripts/protocol-gap.py --db results/gemmrl.sqlite --out OUT/protocol-gap.json \
        12288x256x12288:fp32 16384x16384x256:fp16 8192x8192x8192:fp32

Protocols: the search's QUICK (10 rounds at most, 500 us per graph replay), the judge's
KernelSettings() (40 rounds, 2000 us per replay), and the two crossed (QUICK's rounds with 2000
us replays; the judge's rounds with 500 us replays), each once with the winner timed alone and
once beside the baselines. Prints a table; writes every record as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _gpu_state():
    import torch

    out = {}
    for key, fn in (("sm_mhz", "clock_rate"), ("power_mw", "power_draw"), ("temp_c", "temperature")):
        try:
            out[key] = getattr(torch.cuda, fn)()
        except Exception as e:  # pynvml missing: say so once per record
            out[key] = f"n/a ({type(e).__name__})"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="MxNxK:acc (acc fp32 or fp16)")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from gemmrl.bench import timing
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    store = Store(args.db)
    device = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    full = timing.KernelSettings()
    protocols = {
        "quick": timing.QUICK,
        "full": full,
        "quick-rounds/2000us": replace(timing.QUICK, target_replay_us=full.target_replay_us),
        "full-rounds/500us": replace(full, target_replay_us=timing.QUICK.target_replay_us),
    }
    names = ["tuned", "cuBLASLt-auto-tuning-nn", "cuBLASLt-auto-tuning-tn"]
    records = []
    for text in args.shapes:
        dims, _, acc = text.partition(":")
        m, n, k = (int(x) for x in dims.lower().split("x"))
        problem = Problem(m, n, k, dtype="fp16", acc=acc or "fp32")
        impls = impls_from_specs([",".join(names)], store=store, device=device)
        fns = {}
        for impl in impls:
            if impl.supports(problem):
                fns[impl.name] = impl.prepare(problem)
        tuned = [nm for nm in fns if nm not in names[1:]]
        for rep in range(args.repeats):
            for pname, settings in protocols.items():
                for company in ("alone", "with-baselines"):
                    calls = {nm: fns[nm] for nm in tuned} if company == "alone" else fns
                    before = _gpu_state()
                    t0 = time.perf_counter()
                    res = timing.time_kernel(problem, calls, l2_bytes=l2, settings=settings, seed=rep)
                    wall = time.perf_counter() - t0
                    after = _gpu_state()
                    for nm, r in res.items():
                        rec = {"shape": dims, "acc": problem.acc, "repeat": rep, "protocol": pname,
                               "company": company, "impl": nm, "median_us": r.get("median_us"),
                               "min_us": r.get("min_us"), "n": r.get("n"),
                               "calls_per_replay": r.get("details", {}).get("calls_per_replay"),
                               "sets": r.get("details", {}).get("sets"), "wall_s": round(wall, 3),
                               "gpu_before": before, "gpu_after": after}
                        records.append(rec)
                        print(f"{dims}:{problem.acc} r{rep} {pname:22s} {company:15s} {nm:26s} "
                              f"median {rec['median_us']:9.2f} us  calls/replay {rec['calls_per_replay']}"
                              f"  clock {after['sm_mhz']}  power {after['power_mw']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                          "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
