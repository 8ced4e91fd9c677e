#!/usr/bin/env python3
"""Host cost per call of a pack's cuBLASLt algorithm (its `lt_algos` entry) against cuBLASLt's
heuristic first choice for the same shape, both called through the baselines' plan-and-run path,
with the product's call (gemmrl.matmul with the pack active, which runs that very algorithm from
its C++ fast path) and torch.matmul on the same layout beside them. GPU only.

Why: in offline and server modes the autotuned baseline ran up to 6% slower than the heuristic
baseline on shapes where its stored algorithm is faster in kernel time (H100, 128x8192x512 NN:
24.07 us against 22.74 offline, 6.6 us of kernel), while gemmrl.matmul calling that algorithm ran
22.72. One explanation: the algorithm's launch (a thread-block cluster, say) costs more host
time, which the product's shorter call path hides. This measures it:

    python3 scripts/lt-host-cost.py --pack packs/h100-fp16-F32F16F16F32 --out OUT/lt-host-cost.json \\
        [--shapes 128x8192x512:NN,256x8192x64:TN] [--bursts 25] [--rounds 600]

Without --shapes, the pack's `lt_algos` entries whose algorithm launches clusters of more than one
block (cuBLASLt's cluster-shape enum above CUBLASLT_CLUSTER_SHAPE_1x1x1 = 2; 0 is 'auto'), up to --max.
Two numbers per implementation, enqueue and latency (gemmrl.bench.hostcost, as
scripts/cutlass-host-cost.py takes them).
The heuristic plan runs twice (under two names) to show the noise. Results go to --out after
every shape.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLUSTER = re.compile(r"\bcluster=(\d+)")


def select(manifest: dict, shapes: list[tuple[int, int, int, str]] | None = None, limit: int = 12) -> list[dict]:
    """The `lt_algos` entries to measure: those of `shapes` ((M, N, K, layout)), in that order,
    else every entry whose info names a cluster shape of more than one block (cublasLtClusterShape_t
    above 2, CUBLASLT_CLUSTER_SHAPE_1x1x1; 0 is 'auto'), by that enum value, largest first, then by
    shape, at most `limit`. Pure: tested on the CPU."""
    lt = {(int(e["M"]), int(e["N"]), int(e["K"]), e["layout"]): e for e in manifest.get("lt_algos") or []}
    if shapes:
        missing = [s for s in shapes if s not in lt]
        if missing:
            raise ValueError("no lt_algos entry in the pack for "
                             + ", ".join(f"{M}x{N}x{K}:{lay}" for M, N, K, lay in missing))
        return [lt[s] for s in shapes]

    def cluster(e) -> int:
        m = CLUSTER.search(e.get("info") or "")
        return int(m.group(1)) if m else 0

    clustered = [e for e in lt.values() if cluster(e) > 2]
    clustered.sort(key=lambda e: (-cluster(e), e["M"], e["N"], e["K"], e["layout"]))
    return clustered[:limit]


def parse_shapes(text: str) -> list[tuple[int, int, int, str]]:
    """'MxNxK:LAYOUT[,...]' -> [(M, N, K, LAYOUT)]. Pure."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+):(NN|TN)", part)
        if not m:
            raise ValueError(f"expected MxNxK:NN or MxNxK:TN, got {part!r}")
        out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", required=True, help="the pack directory whose lt_algos are measured")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--shapes", default=None, help="MxNxK:LAYOUT[,...] (default: the clustered entries)")
    ap.add_argument("--max", type=int, default=12, help="at most this many entries without --shapes")
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=600)
    a = ap.parse_args()

    manifest = json.loads((Path(a.pack) / "manifest.json").read_text())
    try:
        chosen = select(manifest, parse_shapes(a.shapes) if a.shapes else None, a.max)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2

    import torch

    from gemmrl.baselines import impls as bl
    from gemmrl.baselines.cublas import load as cublas_load
    from gemmrl.bench import env
    from gemmrl.bench.hostcost import enqueue_and_latency
    from gemmrl.core.problem import Problem
    from gemmrl.runtime.pack_impl import PackMatmul

    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    lib = cublas_load()
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    out = {"device": torch.cuda.get_device_name(), "provenance": env.provenance(),
           "script": "scripts/lt-host-cost.py", "argv": sys.argv[1:], "pack": str(a.pack),
           "bursts": a.bursts, "burst_calls": 200, "rounds": a.rounds, "shapes": []}
    for e in chosen:
        p = Problem(int(e["M"]), int(e["N"]), int(e["K"]), "fp16", manifest.get("acc", "fp32"))
        layout, tn = e["layout"], e["layout"] == "TN"
        heur_algo = lib.heuristic(layout, p.dtype, p.acc, p.M, p.N, p.K, requested=1)[0]
        plans = {"heuristic": lib.plan(layout, p.dtype, p.acc, p.M, p.N, p.K, None),
                 "heuristic@repeat": lib.plan(layout, p.dtype, p.acc, p.M, p.N, p.K, None),
                 "lt_algo": lib.plan(layout, p.dtype, p.acc, p.M, p.N, p.K, bytes.fromhex(e["algo"]))}
        fns = {}
        for name, plan in plans.items():
            def call(A, B, Bt, C, plan=plan):
                lib.run(plan, A.data_ptr(), (Bt if tn else B).data_ptr(), C.data_ptr(), stream())
            fns[name] = call
        fns["gemmrl.matmul"] = PackMatmul(a.pack, layout).prepare(p)
        fns["torch.matmul"] = (bl.TorchMatmulTN() if tn else bl.TorchMatmul()).prepare(p)  # on the same layout
        g = torch.Generator(device="cuda").manual_seed(p.M * 7 + p.N * 3 + p.K)
        A = torch.randn(p.M, p.K, device="cuda", dtype=torch.float16, generator=g)
        B = torch.randn(p.K, p.N, device="cuda", dtype=torch.float16, generator=g)
        Bt = B.t().contiguous()
        outs = {n: torch.full((p.M, p.N), float("nan"), device="cuda", dtype=torch.float16) for n in fns}
        for name, fn in fns.items():
            fn(A, B, Bt, outs[name])
        torch.cuda.synchronize()
        ref = A.float() @ B.float()
        err = {n: float(((o.float() - ref).abs().max() / ref.abs().max()).item()) for n, o in outs.items()}
        med_e, med_l = enqueue_and_latency(fns, (A, B, Bt), outs, bursts=a.bursts, rounds=a.rounds,
                                           seed=p.M + p.N + p.K)
        for plan in plans.values():
            lib.destroy(plan)
        row = {"shape": p.shape, "layout": layout, "lt_info": e.get("info"),
               "heuristic_info": lib.describe(heur_algo), "rel_err": err,
               "enqueue_us": med_e, "latency_us": med_l,
               "lt_minus_heuristic_enqueue_us": med_e["lt_algo"] - med_e["heuristic"],
               "lt_minus_heuristic_latency_us": med_l["lt_algo"] - med_l["heuristic"],
               "repeat_noise_latency_us": med_l["heuristic@repeat"] - med_l["heuristic"]}
        out["shapes"].append(row)
        print(f"{p.shape:>16} {layout} lt [{(e.get('info') or '').split(' (')[0]}] "
              f"heuristic [{row['heuristic_info']}]: enqueue us "
              + ", ".join(f"{n} {v:.2f}" for n, v in med_e.items())
              + "; latency us " + ", ".join(f"{n} {v:.2f}" for n, v in med_l.items()), flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))  # after every shape: nothing lost if cut
    return 0 if out["shapes"] else 1


if __name__ == "__main__":
    sys.exit(main())
