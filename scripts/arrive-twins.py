#!/usr/bin/env python3
"""Time raw split-K kernels beside their twins that arrive on the tile's counter with one
fetch-add (raw arrive='add') instead of the CAS loop every stored raw kernel uses (arrive='cas').

The CAS loop retries once for every CTA that arrived between its read and its swap, so the last
of S arrivals waits about S round trips; the store's raw trials put that at about 0.3 us a split
(128x64x8192, H200: 9.5 us at split 8, 12.2 at split 16; space/raw.py, estimate_us). Until such
twins have been timed side by side the search neither proposes nor mutates towards 'add'.

For each shape: the split-K raw spec of its fastest stored trial on the device (else the
heuristic's best split-K spec), at each of --splits that valid() accepts, rendered twice (CAS,
fetch-add) into --work; their builds compiled in parallel; then one `gemmrl bench --mode kernel`
a shape timing every twin of it and torch.matmul in the same session (kernel:FILE per twin: a raw
kernel has its shape compiled in). Then the fetch-add twin's speedup over its CAS twin, from the
session's paired ratios. On the GPU machine, as a device-steps.sh step:

    scripts/arrive-twins.py --device H200 --acc fp32 --shapes results/shapes/h200-arrive-twins.txt --json F

--plan writes the files and lists the benches without compiling or timing (no GPU needed);
--report-runs R1,R2 reads runs already in the store instead of timing.

--twin epi times the other raw field a twin can differ in: each shape's fastest stored raw spec (any
split; else the heuristic's first) with the direct epilogue beside its twin that stages the tile of C
in shared memory and stores 16-byte vectors (raw epi='smem'). Timed on 23 fp32 shapes (runs 864-889,
H200, 2026-11-30), the staged twin won on all 8 at M*N = 256K; the raw pool and heuristic now take
it from there up (raw.staged_epilogue):

    scripts/arrive-twins.py --twin epi --device H200 --acc fp32 --shapes F --json F2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from gemmrl.core.problem import Problem  # noqa: E402
from gemmrl.space import raw  # noqa: E402


# the two values of the field a twin differs in, and their names in the report's table
TWINS = {"arrive": ("cas", "add"), "epi": ("direct", "smem")}
LABELS = {"cas": "CAS", "add": "fetch-add", "direct": "direct", "smem": "smem-epilogue"}


def base_spec(db, device: str, problem: Problem, layout: str | None = None, split: bool = True):
    """The split-K raw spec of `problem`'s fastest stored ok trial on `device` (its accumulator),
    else the heuristic's best split-K spec for the layout (TN unless given), else None; with
    split=False the fastest raw spec of any split (else the heuristic's first)."""
    if db is not None:
        rows = db.execute(
            "SELECT record FROM trials WHERE device=? AND M=? AND N=? AND K=? AND dtype=? AND acc=? AND status='ok' "
            "AND candidate LIKE 'raw_%' AND time_us > 0 ORDER BY time_us",
            (device, problem.M, problem.N, problem.K, problem.dtype, problem.acc))
        for (record,) in rows:
            try:
                d = json.loads(record)
                spec = raw.RawSpec(**d["spec"])
            except (ValueError, TypeError, KeyError):
                continue
            if (spec.split_k > 1 or not split) and (layout is None or spec.layout == layout):
                return spec
    for spec in raw.heuristic_specs(problem, layout or "TN", limit=24):
        if spec.split_k > 1 or not split:
            return spec
    return None


def twins(spec, problem: Problem, splits, field: str = "arrive") -> list[tuple]:
    """[(cas spec, add spec)] of `spec` at each split of `splits` (its own if none) that valid() accepts;
    field='epi': [(direct-epilogue spec, smem-epilogue spec)], both valid, each keeping the spec's
    arrival where it splits K."""
    out = []
    for s in splits or (spec.split_k,):
        if field == "epi":
            a = replace(spec, split_k=int(s), arrive=spec.arrive if int(s) > 1 else "cas", epi="direct")
            b = replace(a, epi="smem")
            if raw.valid(a, problem) is None and raw.valid(b, problem) is None:
                out.append((a, b))
            continue
        cas = replace(spec, split_k=int(s), arrive="cas")
        if raw.valid(cas, problem) is None:
            out.append((cas, replace(cas, arrive="add")))
    return out


def plan(problems, db, device: str, splits, work: Path, field: str = "arrive") -> list[dict]:
    """Per shape: {'shape', 'pairs': [(cas file, add file, split)]} (field='epi': direct, smem);
    writes the rendered twins."""
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for p in problems:
        spec = base_spec(db, device, p, split=field == "arrive")
        if spec is None:
            print(f"{p.shape}: no {'split-K ' if field == 'arrive' else ''}raw spec serves it; skipped", file=sys.stderr)
            continue
        pairs = []
        for cas, add in twins(spec, p, splits, field):
            files = []
            for s in (cas, add):
                f = work / f"{raw.kernel_name(s, p)}.cu"
                f.write_text(raw.render(s, p))
                files.append(str(f))
            pairs.append((files[0], files[1], cas.split_k))
        if pairs:
            out.append({"shape": f"{p.M}x{p.N}x{p.K}", "acc": p.acc, "pairs": pairs})
    return out


def bench_argv(entry: dict, db: str) -> list[str]:
    argv = [sys.executable, "-m", "gemmrl.cli", "bench", "--shapes", entry["shape"], "--acc", entry["acc"],
            "--mode", "kernel", "--impl", "torch.matmul", "--retime", "--no-report", "--db", db]
    for cas, add, _ in entry["pairs"]:
        argv += ["--impl", f"kernel:{cas}", "--impl", f"kernel:{add}"]
    return argv


def compile_all(entries: list[dict], jobs: int) -> list[str]:
    """Build every twin into the build cache, `jobs` nvcc processes at once; the failures' files."""
    from gemmrl.build.pool import build_many

    files = [f for e in entries for pair in e["pairs"] for f in pair[:2]]
    results = build_many([(Path(f).stem, Path(f).read_text(), {"include_dirs": (str(Path(f).parent),)})
                          for f in files], workers=jobs)
    return [f for f, r in zip(files, results) if not r.ok]


def ratios(db, runs, entries: list[dict], names: tuple = TWINS["arrive"]) -> list[dict]:
    """Per (shape, split): the CAS and fetch-add twins' kernel times in the newest session of
    `runs` that timed both, and the fetch-add twin's speedup over its CAS twin (the session's paired
    ratio where the record has one, else the medians'). `names`: the twins' values, which name the
    row's keys (TWINS['epi']: direct, direct_us, smem_us, smem_speedup)."""
    x, y = names
    from gemmrl.bench.stats import paired_over

    marks = ", ".join("?" * len(runs))
    sessions: dict = {}
    for run, session, M, N, K, impl, med, details in db.execute(
            f"SELECT run_id, session, M, N, K, impl, median_us, details FROM measurements WHERE run_id IN ({marks}) "
            "AND mode='kernel' AND status='ok' AND median_us > 0 ORDER BY id", tuple(runs)):
        paired = (json.loads(details or "{}") or {}).get("paired") or {}
        sessions.setdefault((run, session, f"{M}x{N}x{K}"), {})[impl] = (med, paired)
    out = []
    for e in entries:
        for cas, add, split in e["pairs"]:
            a, b = f"kernel:{Path(cas).stem}", f"kernel:{Path(add).stem}"
            got = [t for (_, _, shape), t in sessions.items() if shape == e["shape"] and a in t and b in t]
            if not got:
                out.append({"shape": e["shape"], "split": split, x: Path(cas).stem, "timed": False})
                continue
            t = got[-1]
            row = {"shape": e["shape"], "split": split, x: Path(cas).stem, "timed": True,
                   f"{x}_us": t[a][0], f"{y}_us": t[b][0], f"{y}_speedup": paired_over(t[b][1], a, t[b][0], t[a][0])}
            if "torch.matmul" in t:
                row["torch_us"] = t["torch.matmul"][0]
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part of it (H200)")
    ap.add_argument("--acc", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--shapes", required=True, help="a shape file or MxNxK[,MxNxK...]")
    ap.add_argument("--splits", default="", help="split_k values to time each shape's spec at (default: its own)")
    ap.add_argument("--twin", choices=tuple(TWINS), default="arrive",
                    help="the field the twins differ in: arrive (CAS loop / fetch-add, split-K specs) or epi "
                         "(direct / shared-memory epilogue, any split)")
    ap.add_argument("--work", type=Path, help="where the rendered twins go (default: $OUT/<twin>-twins, else a "
                    "temporary directory)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    ap.add_argument("--plan", action="store_true", help="render the twins and list the benches; no nvcc, no GPU")
    ap.add_argument("--report-runs", help="read these runs of the store (ids and ranges: 790-795,801) instead of timing")
    ap.add_argument("--json", type=Path, help="also write the rows here (default in a device call: "
                    "$OUT/logs/<twin>-twins.json, which comes back in its logs.tgz)")
    a = ap.parse_args(argv)
    from gemmrl.core.shapes import resolve
    from gemmrl.report.bias import parse_runs
    from gemmrl.store.db import Store, device_by_part

    try:
        splits = tuple(int(s) for s in a.splits.split(",") if s.strip())
    except ValueError:
        ap.error(f"--splits takes integers, comma-separated, got {a.splits!r}")
    low = 2 if a.twin == "arrive" else 1  # an arrival needs a split; an epilogue does not
    if any(s < low or s > raw.MAX_SPLIT_K for s in splits):
        ap.error(f"--splits: each split_k must be {low}..{raw.MAX_SPLIT_K}")
    try:
        problems = resolve(a.shapes, "fp16", a.acc)
    except Exception as e:  # noqa: BLE001 - a bad shape list is the user's to fix
        ap.error(f"--shapes: {e}")
    store = Store(a.db, readonly=True) if (Path(a.db).exists() or Path(a.db + ".xz").exists()) else None
    device = a.device
    if store is not None:
        try:
            device = device_by_part(a.device, store.devices(), "GPUs")
        except ValueError as e:
            if not a.plan:
                ap.error(str(e))
    work = a.work or (Path(os.environ["OUT"]) / f"{a.twin}-twins" if os.environ.get("OUT") else None)
    if a.json is None and os.environ.get("OUT") and not a.plan:
        a.json = Path(os.environ["OUT"]) / "logs" / f"{a.twin}-twins.json"
    if work is None:
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="gemmrl-arrive-"))
    entries = plan(problems, store.db if store else None, device, splits, work, a.twin)
    if not entries:
        print(f"no shape has a {'split-K ' if a.twin == 'arrive' else ''}raw spec to time", file=sys.stderr)
        return 1
    for e in entries:
        print(f"{e['shape']}: {len(e['pairs'])} pairs ({', '.join(Path(c).stem for c, _, _ in e['pairs'])})")
    if a.plan:
        for e in entries:
            print(" ".join(bench_argv(e, a.db)))
        return 0
    if a.report_runs:
        try:
            runs = sorted(parse_runs(a.report_runs))
        except ValueError as e:
            ap.error(str(e))
    else:
        if store is not None:
            store.close()
        t0 = time.monotonic()
        failed = compile_all(entries, a.jobs)
        print(f"compiled {sum(2 * len(e['pairs']) for e in entries)} twins in {time.monotonic() - t0:.0f} s"
              + (f"; {len(failed)} failed: {', '.join(Path(f).stem for f in failed)}" if failed else ""),
              file=sys.stderr)
        entries = [{**e, "pairs": [p for p in e["pairs"] if p[0] not in failed and p[1] not in failed]}
                   for e in entries]
        last = _max_run(a.db)
        for e in entries:
            if e["pairs"]:
                rc = subprocess.run(bench_argv(e, a.db)).returncode
                print(f"{e['shape']}: bench exit {rc}", file=sys.stderr)
        store = Store(a.db, readonly=True)
        runs = [r for (r,) in store.db.execute("SELECT id FROM runs WHERE id > ?", (last,))]
    x, y = TWINS[a.twin]
    rows = ratios(store.db, runs, entries, (x, y))
    X, Y = LABELS[x], LABELS[y]
    print(f"| shape | split | {X} twin | {X} us | {Y} us | {Y} speedup | torch.matmul us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["timed"]:
            print(f"| {r['shape']} | {r['split']} | {r[x]} | {r[f'{x}_us']:.2f} | {r[f'{y}_us']:.2f} | "
                  f"{r[f'{y}_speedup']:.3f} | {r.get('torch_us', float('nan')):.2f} |")
        else:
            print(f"| {r['shape']} | {r['split']} | {r[x]} | not timed | | | |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": device, "acc": a.acc, "twin": a.twin, "runs": runs,
                                      "provenance": run_provenance(store.db, runs), "rows": rows}, indent=1) + "\n")
    return 0 if any(r["timed"] for r in rows) else 1


def run_provenance(db, runs) -> dict:
    """What the result file must name of where its numbers came from: the device, driver, CUDA,
    torch, cuBLAS and commit of the runs (each field's value, or its values sorted where the runs
    differ) and the runs' first and last dates (a run's start where its provenance has none)."""
    import datetime

    provs = []
    for r in runs:
        row = db.execute("SELECT provenance, started FROM runs WHERE id=?", (r,)).fetchone()
        if row:
            p = json.loads(row[0] or "{}")
            if not p.get("date") and row[1]:
                start = datetime.datetime.fromtimestamp(row[1], datetime.timezone.utc)
                p["date"] = start.isoformat(timespec="seconds")
            provs.append(p)
    if not provs:
        return {}
    out = {}
    for k in ("device", "driver", "cuda", "torch", "commit", "cublas"):
        vals = sorted({str(p.get(k)) for p in provs if p.get(k) is not None})
        if vals:
            out[k] = vals[0] if len(vals) == 1 else vals
    dates = sorted(p["date"] for p in provs if p.get("date"))
    if dates:
        out["first_date"], out["last_date"] = dates[0], dates[-1]
    return out


def _max_run(db: str) -> int:
    import sqlite3

    if not Path(db).exists():
        return 0
    return sqlite3.connect(db).execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0]


if __name__ == "__main__":
    sys.exit(main())
