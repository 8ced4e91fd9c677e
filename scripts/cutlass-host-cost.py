#!/usr/bin/env python3
"""Host cost per call of a CUTLASS kernel built from the current template against the same spec
built from an earlier one (found in the build cache under the same kernel name, another hash),
with torch.matmul and cuBLASLt autotuned beside them. GPU only.

    GEMMRL_CACHE=NEW python scripts/cutlass-host-cost.py --db results/gemmrl.sqlite --old-cache OLD \
        --shapes 128x2048x256,64x64x2048 --out host-cost.json [--jobs 16]

For each shape the stored winner (gemmrl-tuned, fp32 accumulate, any GPU) is the spec. Two numbers
per implementation, enqueue and latency (gemmrl.bench.hostcost: host time per call in bursts of 200
unsynchronised calls, the median of 25 bursts; and synchronise-call-synchronise, the median of 600
shuffled rounds: what `bench --mode offline` sees).
The new build runs twice (under two names) to show the noise; old and new must write identical C.

The driver entry-point cache (cutlass_sm90.ENTRY_CACHE_PREFIX, the default since 2026-11-29k)
against CUTLASS's own host path: render the new builds with it; the old ones are plain builds a
carried cache holds (in the same cache: another hash under the same name), compiled with
GEMMRL_CUTLASS_ENTRY_CACHE=0 or before the default changed (.ext/carry/gcache-h200f32-hostcost.txz
held both for results/h200/host-cost-entry-cache-2026-11-29k.json):

    python scripts/cutlass-host-cost.py --entry-cache --shapes 64x64x4096,... --out F

(--entry-cache sets GEMMRL_CUTLASS_ENTRY_CACHE=1 for this process alone, so a device-steps.sh step
can take it whatever the environment of the call says.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--shapes", required=True, help="MxNxK[,MxNxK...]: shapes whose stored winner is CUTLASS")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc for the new builds")
    ap.add_argument("--old-cache", default=None,
                    help="build cache holding the earlier builds (default: $GEMMRL_CACHE, beside the new ones)")
    ap.add_argument("--entry-cache", action="store_true",
                    help="render the new builds with the driver entry-point cache (cutlass_sm90.ENTRY_CACHE_PREFIX) "
                         "whatever GEMMRL_CUTLASS_ENTRY_CACHE says")
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=600)
    a = ap.parse_args()
    if a.entry_cache:
        import os

        from gemmrl.space.cutlass_sm90 import ENTRY_CACHE_ENV

        os.environ[ENTRY_CACHE_ENV] = "1"  # read by render() when the new builds' sources are made

    import torch

    from gemmrl.baselines import impls as bl
    from gemmrl.bench import env
    from gemmrl.bench.hostcost import enqueue_and_latency
    from gemmrl.build.ahead import job_for
    from gemmrl.build.nvcc import cache_root
    from gemmrl.build.pool import build_many
    from gemmrl.core.shapes import resolve
    from gemmrl.runtime.abi import AbiImpl
    from gemmrl.search.run import TUNED
    from gemmrl.space import registry
    from gemmrl.store.db import Store, unpack_if_missing

    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    unpack_if_missing(a.db)
    store = Store(a.db)
    wins = {(p.M, p.N, p.K): (fam, fields) for _d, p, fam, fields in store.tuned_choices(TUNED)
            if p.acc == "fp32" and p.dtype == "fp16"}
    plan = []
    for p in resolve(a.shapes, "fp16", "fp32"):
        fam_name, fields = wins.get((p.M, p.N, p.K), (None, None))
        if fam_name != "cutlass_sm90":
            print(f"{p.shape}: the stored winner is {fam_name or 'missing'}, not CUTLASS: left out", file=sys.stderr)
            continue
        spec = registry.get(fam_name).spec_type()(**fields)
        plan.append((p, spec, job_for(spec, p)))
    # the new builds, in parallel
    results = build_many([j.as_tuple() for _p, _s, j in plan], workers=a.jobs)
    rows = []
    for (p, spec, job), r in zip(plan, results):
        if not r.ok:
            print(f"{p.shape} {spec.name}: the new build failed:\n{r.log[-2000:]}", file=sys.stderr)
            continue
        new_dir = Path(r.path).parent
        old_builds = Path(a.old_cache or cache_root()) / "builds"
        old = sorted(d / "kernel.so" for d in old_builds.glob(f"{spec.name}-*")
                     if d != new_dir and (d / "kernel.so").exists())
        if not old:
            print(f"{p.shape} {spec.name}: no earlier build in {old_builds}: left out", file=sys.stderr)
            continue
        rows.append((p, spec, str(old[0]), r.path))
    out = {"device": device, "provenance": env.provenance(), "script": "scripts/cutlass-host-cost.py",
           "argv": sys.argv[1:], "bursts": a.bursts, "burst_calls": 200, "rounds": a.rounds, "shapes": []}
    baselines = {i.name: i for i in bl.baseline_impls(store, device)}
    for p, spec, old_so, new_so in rows:
        layout = spec.layout.lower()
        impls = {"old": AbiImpl(old_so, name="old"), "new": AbiImpl(new_so, name="new"),
                 "new@repeat": AbiImpl(new_so, name="new@repeat"),
                 "torch.matmul": baselines["torch.matmul"],
                 f"cuBLASLt-auto-tuning-{layout}": baselines[f"cuBLASLt-auto-tuning-{layout}"]}
        g = torch.Generator(device="cuda").manual_seed(p.M * 7 + p.N * 3 + p.K)
        A = torch.randn(p.M, p.K, device="cuda", dtype=torch.float16, generator=g)
        B = torch.randn(p.K, p.N, device="cuda", dtype=torch.float16, generator=g)
        Bt = B.t().contiguous()
        fns, outs = {}, {}
        for name, impl in impls.items():
            fns[name] = impl.prepare(p)
            outs[name] = torch.full((p.M, p.N), float("nan"), device="cuda", dtype=torch.float16)
            fns[name](A, B, Bt, outs[name])
        torch.cuda.synchronize()
        same = bool(torch.equal(outs["old"], outs["new"]))
        ref = A.float() @ B.float()
        err = {n: float(((o.float() - ref).abs().max() / ref.abs().max()).item()) for n, o in outs.items()}
        med_e, med_l = enqueue_and_latency(fns, (A, B, Bt), outs, bursts=a.bursts, rounds=a.rounds,
                                           seed=p.M + p.N + p.K)
        row = {"shape": p.shape, "spec": spec.name, "old_so": old_so, "new_so": new_so,
               "old_equals_new": same, "rel_err": err,
               "enqueue_us": med_e, "latency_us": med_l,
               "new_minus_old_enqueue_us": med_e["new"] - med_e["old"],
               "new_minus_old_latency_us": med_l["new"] - med_l["old"],
               "repeat_noise_latency_us": med_l["new@repeat"] - med_l["new"]}
        out["shapes"].append(row)
        print(f"{p.shape:>16} {spec.name}: enqueue us " + ", ".join(f"{n} {v:.2f}" for n, v in med_e.items())
              + "; latency us " + ", ".join(f"{n} {v:.2f}" for n, v in med_l.items())
              + f"; old == new: {same}", flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))  # after every shape: nothing lost if cut
    store.close()
    bad = [r["shape"] for r in out["shapes"] if not r["old_equals_new"]]
    if bad:
        print(f"old and new builds wrote different C on {bad}", file=sys.stderr)
        return 1
    return 0 if out["shapes"] else 1


if __name__ == "__main__":
    sys.exit(main())
