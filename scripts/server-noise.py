"""Where server mode's noise comes from, and how many rounds a 2% agreement needs (issue #2).

Times four copies of torch.matmul (the same call under four names) in server mode, both ways of
drawing the idle gaps (`each`: a gap before every call; `round`: one gap per round that every
call waits), with a fixed number of rounds and every sample kept:

    python scripts/server-noise.py OUT_DIR [--rounds 1500] [--shapes 128x256x64,...]

Writes OUT_DIR/server-noise-trace.csv (shape, gaps, round, name, gap_us, time_us) and
OUT_DIR/server-noise.json (environment). scripts/server-noise-report.py reads the CSV (no GPU).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

from gemmrl.bench import env, timing
from gemmrl.core.shapes import parse_shape

COPIES = ("torch.matmul", "torch.matmul#2", "torch.matmul#3", "torch.matmul#4")
DEFAULT_SHAPES = "128x256x64,256x256x128,2048x4096x64,512x1024x8192,2048x4096x1024,8192x512x8192"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--qps", type=float, default=1000.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    def call(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    t_start = time.time()
    with open(out / "server-noise-trace.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "gaps", "round", "name", "gap_us", "time_us"])
        for spec in args.shapes.split(","):
            p = parse_shape(spec)
            for gaps in ("each", "round"):
                s = timing.HostSettings(mode="server", qps=args.qps, gaps=gaps, min_rounds=args.rounds,
                                        max_rounds=args.rounds, budget_s=float("inf"))
                trace: list = []
                t0 = time.perf_counter()
                res = timing.time_host(p, {n: call for n in COPIES}, settings=s, trace=trace)
                meds = {n: round(r["median_us"], 2) for n, r in res.items()}
                print(f"{spec} gaps={gaps}: {time.perf_counter() - t0:.1f} s, medians {meds}", flush=True)
                for r, name, gap, t_us in trace:
                    w.writerow([spec, gaps, r, name, f"{gap * 1e6:.1f}", f"{t_us:.3f}"])
    prov = env.provenance("n/a")
    (out / "server-noise.json").write_text(json.dumps(
        {"rounds": args.rounds, "qps": args.qps, "shapes": args.shapes.split(","), "copies": COPIES,
         "warmup_rounds": timing.HostSettings().warmup_rounds, "wall_s": time.time() - t_start,
         "provenance": prov}, indent=1))


if __name__ == "__main__":
    main()
