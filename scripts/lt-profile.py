#!/usr/bin/env python3
"""Where the time goes in gemmrl's stored winner and in cuBLASLt's autotuned algorithm, shape by
shape: every kernel each one launches for one C = A B, profiled by Nsight Compute (`ncu`), with its
name, grid, cluster, registers, shared memory, duration, DRAM and L2 traffic and tensor-pipe
activity. Made for the split-K shapes where the CUTLASS rendering of cuBLASLt's own tile, split and
cluster still runs slower than cuBLASLt (results/README.md, forty-fourth session): whether cuBLASLt
reduces the splits inside the GEMM kernel or in a second one, and how many bytes each moves.

    python3 scripts/lt-profile.py --db results/gemmrl.sqlite --acc fp32 --out OUT \\
        --shapes results/shapes/h200-fp32-sr-below-2026-11-29c.txt --first 6

writes OUT/lt-profile.json (every kernel's metrics, per shape and implementation) and prints a table.
One `ncu` process per shape and implementation; each profiles one call after three unprofiled ones,
with --clock-control none (the clocks as the timing harness sees them) and ncu's default cache
control (L2 flushed before each kernel, so durations are cold-cache ones, longer than the replayed
medians the reports hold; compare kernels with each other, not with the reports); --cache-control
none leaves L2 as the previous kernel left it. The child process
(--child) builds implementations with gemmrl's own spec names: 'tuned' is the stored winner
(compiled on the spot unless GEMMRL_CACHE holds it), 'cuBLASLt-auto-tuning-nn'/'-tn' the stored
autotuned algorithm (picked again, outside the profiled call, where none is stored). Needs a GPU
and ncu that can read the counters (the device's KINDS.md: Firecracker machines)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# metric -> column title; a metric this ncu does not know is dropped and the profile retried
METRICS = {
    "gpu__time_duration.sum": "us",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__cluster_dim_x": "cx",
    "launch__cluster_dim_y": "cy",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_dynamic": "smem",
    "dram__bytes_read.sum": "dram_rd",
    "dram__bytes_write.sum": "dram_wr",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "gmma%",
    "sm__cycles_active.avg": "sm_cycles",
}
MARK = "LT-PROFILE-DESCRIBE "


def parse_rows(text: str) -> list[dict]:
    """Every profiled kernel of `ncu --csv --page raw` output, in launch order: {'name': kernel
    name, metric: number or text}. Pure; lines before the CSV header (the target's own output,
    ncu's '==PROF==' lines) are skipped, and so is the units row."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, out = rows[0], []
    for r in rows[1:]:
        if not r or not r[0].strip() or not r[0].strip().isdigit():  # the units row has no ID
            continue
        d = dict(zip(header, r))
        row = {"id": int(d["ID"]), "name": d.get("Kernel Name", "")}
        for m in METRICS:
            if m in d:
                v = d[m].replace(",", "").strip()
                try:
                    row[m] = float(v)
                except ValueError:
                    row[m] = v
        out.append(row)
    return sorted(out, key=lambda x: x["id"])


def described(text: str) -> dict:
    for ln in text.splitlines():
        if ln.startswith(MARK):
            return json.loads(ln[len(MARK):])
    return {}


def child(a) -> int:
    import torch

    from gemmrl.bench.select import impls_from_specs
    from gemmrl.core.shapes import parse_shape
    from gemmrl.store.db import Store

    problem = parse_shape(a.child[1], dtype=a.dtype, acc=a.acc)
    device = torch.cuda.get_device_name()
    store = Store(a.db)
    impl = impls_from_specs([a.child[0]], store, device)[0]
    call = impl.prepare(problem)
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(problem.M, problem.K, device="cuda", dtype=dt, generator=g)
    B = torch.randn(problem.K, problem.N, device="cuda", dtype=dt, generator=g)
    Bt = B.t().contiguous()
    C = torch.empty(problem.M, problem.N, device="cuda", dtype=dt)
    for _ in range(3):
        call(A, B, Bt, C)
    torch.cuda.synchronize()
    ref = (A.float() @ B.float())
    err = ((C.float() - ref).abs().max() / ref.abs().max()).item()
    torch.cuda.profiler.start()
    call(A, B, Bt, C)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    info = impl.describe() if hasattr(impl, "describe") else {}
    from gemmrl.bench.env import provenance

    print(MARK + json.dumps({"impl": impl.name, "device": device, "describe": info, "max_rel_err": err,
                             "provenance": provenance()}, default=str), flush=True)
    store.close()
    return 0


def profile(ncu: str, a, spec: str, shape: str, run=subprocess.run) -> dict:
    from gemmrl.llm.ncu import command, run_dropping_unknown

    target = [str(Path(__file__).resolve()), "--db", a.db, "--acc", a.acc, "--dtype", a.dtype, "--child", spec, shape]
    t0 = time.time()
    rows, wanted, p = run_dropping_unknown(
        lambda w: command(ncu, w, target, "--cache-control", a.cache_control), METRICS,
        lambda out, _w: parse_rows(out), timeout_s=a.timeout, tries=len(METRICS), run=run)
    if rows:
        return {"kernels": rows, "child": described(p.stdout), "wall_s": round(time.time() - t0, 1),
                "dropped_metrics": [m for m in METRICS if m not in wanted]}
    if p is None:
        return {"error": f"ncu ran past {a.timeout} s or could not start"}
    return {"error": f"ncu exit {p.returncode}: " + (p.stderr or p.stdout)[-1500:]}


def _num(k: dict, metric: str, scale: float = 1.0, digits: int = 0) -> str:
    v = k.get(metric)
    return f"{v / scale:.{digits}f}" if isinstance(v, float) else "-"


def table(results: dict) -> str:
    """A markdown table: one row per kernel of each shape's implementations."""
    lines = ["| shape | impl | kernel | grid | cluster | regs | smem KB | us (cold) | DRAM rd/wr MB | L2 MB | gmma % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, per in results.items():
        for spec, got in per.items():
            if "error" in got:
                lines.append(f"| {shape} | {spec} | error: {got['error'][:80]} | | | | | | | | |")
                continue
            for k in got["kernels"]:
                lines.append(
                    f"| {shape} | {spec} | `{k['name'][:60]}` | {_num(k, 'launch__grid_size')} | "
                    f"{_num(k, 'launch__cluster_dim_x')}x{_num(k, 'launch__cluster_dim_y')} | "
                    f"{_num(k, 'launch__registers_per_thread')} | "
                    f"{_num(k, 'launch__shared_mem_per_block_dynamic', 1024)} | "
                    f"{_num(k, 'gpu__time_duration.sum', 1e3, 2)} | "
                    f"{_num(k, 'dram__bytes_read.sum', 1e6, 1)}/{_num(k, 'dram__bytes_write.sum', 1e6, 1)} | "
                    f"{_num(k, 'lts__t_bytes.sum', 1e6, 1)} | "
                    f"{_num(k, 'sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active', 1, 1)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=str(ROOT / "results" / "gemmrl.sqlite"))
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--shapes", help="a shape file (MxNxK per line)")
    ap.add_argument("--shape", action="append", default=[], help="MxNxK; repeatable")
    ap.add_argument("--first", type=int, default=0, help="only the first N shapes of --shapes")
    ap.add_argument("--impl", action="append", default=[],
                    help="implementation spec (default: tuned, cuBLASLt-auto-tuning-nn, cuBLASLt-auto-tuning-tn)")
    ap.add_argument("--out", help="folder for lt-profile.json (default: $OUT, else the current one)")
    ap.add_argument("--cache-control", default="all", choices=("all", "none"),
                    help="ncu's: 'all' flushes the caches before each kernel (cold, the default), 'none' leaves "
                         "them (the GEMM's partials still in L2 when the reduction reads them, as in a replay)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per ncu process")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "SHAPE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)

    from gemmrl.core.shapes import parse_shape, parse_shape_file
    from gemmrl.llm.ncu import ncu_path

    shapes = [f"{p.M}x{p.N}x{p.K}" for p in (parse_shape_file(a.shapes) if a.shapes else [])]
    if a.first:
        shapes = shapes[:a.first]
    for s in a.shape:
        p = parse_shape(s)
        shapes.append(f"{p.M}x{p.N}x{p.K}")
    if not shapes:
        ap.error("no shapes: give --shapes FILE or --shape MxNxK")
    if not Path(a.db).exists():
        ap.error(f"no store at {a.db}")
    ncu = ncu_path()
    if ncu is None:
        print("lt-profile: no ncu on this machine (GEMMRL_NCU_PATH, PATH or /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    specs = a.impl or ["tuned", "cuBLASLt-auto-tuning-nn", "cuBLASLt-auto-tuning-tn"]
    out = Path(a.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    prov = None
    for i, shape in enumerate(shapes, 1):
        results[shape] = {}
        for spec in specs:
            got = profile(ncu, a, spec, shape)
            results[shape][spec] = got
            n = len(got.get("kernels", []))
            print(f"[{i}/{len(shapes)}] {shape} {spec}: " + (f"{n} kernel(s), {got['wall_s']} s" if n else got["error"][:300]),
                  flush=True)
            # the first profile's provenance (device, driver, CUDA, torch, commit, date) for the file
            prov = prov or got.get("child", {}).get("provenance")
            # written after each profile, so a cut call keeps what it measured
            (out / "lt-profile.json").write_text(json.dumps(
                {"command": ["scripts/lt-profile.py", *sys.argv[1:]], "ncu": ncu, "cache_control": a.cache_control,
                 "acc": a.acc, "dtype": a.dtype, "provenance": prov, "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
