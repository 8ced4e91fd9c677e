#!/usr/bin/env python3
"""The shapes `tune --seed-from-lt` still has something to offer, from the store and a kernel
report alone (no GPU): every shape whose ratio over cuBLASLt autotuned in the report lies in
[--low, --high) and whose cuBLASLt-tile seeds (search/lt_seed.py: the CUTLASS kernels of the
autotuned cuBLASLt choice stored on --device) are not all tried there yet. Lowest ratio first,
one shape a line, a '#' header saying how they were chosen; with `--parts N` also N files of
consecutive slices (OUT's stem + '-a', '-b', ...), one device call each. Says how many shapes and
how many distinct seeds the next `tune --more K` would take (the first K untried of each shape).

    python3 scripts/lt-untried.py --device H200 --acc fp32 --high 0.98 \\
        --report results/h200/gemmrl-tuned_h200_F32F16F16F32_speedup_kernel.csv \\
        --out results/shapes/h200-fp32-lt-third.txt

With --transfer-from GPU[:[IN/]ACC] (as tune takes it) the seeds are instead the first --top
suggestions of that tuning (search.run.store_prior: its winner, then its runners-up, each as
this run's twin): the shapes `tune --transfer-from` still has something to offer, e.g. the fp16
tuning's winners as fp32 twins (--acc fp32 --transfer-from h200:fp16).
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

COLUMN = "cuBLASLt-auto-tuning-max"


def read_report(path: Path, column: str = COLUMN) -> dict[tuple[int, int, int], float]:
    """(M, N, K) -> the report's ratio in `column` (rows where it is empty are left out)."""
    from gemmrl.report.targets import read_speedups

    out = {tuple(int(x) for x in mnk.split("_")): row[column] for mnk, row in read_speedups(path).items()
           if column in row}
    if not out:
        raise SystemExit(f"{path}: no ratio in column {column!r}: not a kernel report's speedup CSV")
    return out


def untried(store, device: str, problems, tiles: dict, clusters: dict, layouts=("NN", "TN")) -> dict:
    """problem -> the names of its cuBLASLt-tile seeds with no trial on `device`, in the seed's order."""
    from gemmrl.search.lt_seed import lt_prior, untried as not_tried

    left = not_tried(lt_prior(store, device, problems, tiles, clusters, layouts), store, device)
    return {p: list(dict.fromkeys(s.name for _f, s in sugg)) for p, sugg in left.items()}


def untried_transfer(store, device: str, problems, source: str, source_acc, source_dtype, top: int) -> dict:
    """problem -> the names of the first `top` suggestions of `source`'s tuning (store_prior: with
    `source_acc`/`source_dtype`, each kernel as the problem's twin) with no trial on `device`, in
    the suggestions' order."""
    from gemmrl.search.lt_seed import untried as not_tried
    from gemmrl.search.run import store_prior

    accs = {p.acc for p in problems}
    dtypes = {p.dtype for p in problems}
    prior = store_prior(store, source, problems, source_acc=source_acc,
                        target_acc=next(iter(accs)) if source_acc and len(accs) == 1 else None,
                        source_dtype=source_dtype,
                        target_dtype=next(iter(dtypes)) if source_dtype and len(dtypes) == 1 else None)
    left = not_tried({p: sugg[:top] for p, sugg in prior.items()}, store, device)
    return {p: list(dict.fromkeys(s.name for _f, s in sugg)) for p, sugg in left.items()}


def split(items: list, parts: int) -> list[list]:
    """`items` in `parts` consecutive slices, the larger ones first (59, 59, 59, 57 of 234)."""
    size = -(-len(items) // parts) if items else 0
    return [items[i * size:(i + 1) * size] for i in range(parts)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="a GPU of the store, or part of its name (H200)")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--acc", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--report", required=True, type=Path, help="the kernel report's speedup CSV")
    ap.add_argument("--low", type=float, default=0.0, help="lowest ratio taken (inclusive)")
    ap.add_argument("--high", type=float, default=1.0, help="ratio taken below this (exclusive)")
    ap.add_argument("--more", type=int, default=3, help="the untried seeds per shape the next tune takes")
    ap.add_argument("--min-flops-log2", type=float, default=None, metavar="E",
                    help="only shapes of 2^E FLOPs (2*M*N*K) or more, e.g. 36: the large-shapes target's")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", type=int, default=1, help="also OUT-a, OUT-b, ...: consecutive slices")
    ap.add_argument("--transfer-from", metavar="GPU[:[IN/]ACC]",
                    help="seeds from that tuning instead of cuBLASLt's tiles (as tune --transfer-from)")
    ap.add_argument("--top", type=int, default=2,
                    help="with --transfer-from: its first N suggestions per shape (default 2: a first batch's)")
    a = ap.parse_args(argv)
    if not a.low < a.high:
        ap.error(f"--low {a.low} must be below --high {a.high}")
    if not 1 <= a.parts <= 26:
        ap.error("--parts must be 1-26")
    if a.more < 1:
        ap.error("--more must be 1 or more")
    if a.min_flops_log2 is not None and not 0 <= a.min_flops_log2 <= 64:
        ap.error(f"--min-flops-log2 {a.min_flops_log2:g}: expected 0-64")
    if a.top < 1:
        ap.error("--top must be 1 or more")

    from gemmrl.baselines.cublas import lt_enum_tables
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store, device_by_part

    if not Path(a.db).exists() and not Path(str(a.db) + ".xz").exists():
        ap.error(f"no store at {a.db}")
    store = Store(a.db)
    from gemmrl.search.lt_seed import lt_devices

    from gemmrl.search.run import TUNED

    tuned = store.tuned_devices(TUNED)
    known = sorted(set(store.devices()) | set(tuned)) if a.transfer_from else lt_devices(store)
    try:
        device = device_by_part(a.device, known, "GPUs")
    except ValueError as e:
        ap.error(str(e))
    if device not in known:
        ap.error((f"no {a.device!r} in {a.db}" if a.transfer_from else
                  f"no cuBLASLt autotuned choice stored on {a.device!r} in {a.db}")
                 + (f"; it has them on {', '.join(known)}" if known else ""))
    if a.transfer_from:
        from click import BadParameter

        from gemmrl.cli import split_transfer_source

        try:
            gpu, source_acc, source_dtype = split_transfer_source(a.transfer_from)
            source = device_by_part(gpu, tuned, "GPUs")
            if source not in tuned:
                raise ValueError(f"no tuning stored on {gpu!r}" + (f"; there is on {', '.join(tuned)}" if tuned else ""))
        except (BadParameter, ValueError) as e:
            ap.error(f"--transfer-from {a.transfer_from}: {e}")
    ratio = read_report(a.report)
    floor = 0.0 if a.min_flops_log2 is None else 2.0 ** a.min_flops_log2
    chosen = {mnk: r for mnk, r in ratio.items() if a.low <= r < a.high and 2.0 * mnk[0] * mnk[1] * mnk[2] >= floor}
    band = f"{a.low:g}-{a.high:g}" + ("" if a.min_flops_log2 is None else f" of 2^{a.min_flops_log2:g} FLOPs or more")
    problems = [Problem(*mnk, dtype=a.dtype, acc=a.acc) for mnk in chosen]
    if a.transfer_from:
        left = untried_transfer(store, device, problems, source, source_acc, source_dtype, a.top)
        seeds = (f"the first {a.top} suggestions of the {source} {source_dtype or a.dtype} acc "
                 f"{source_acc or a.acc} tuning not all tried (scripts/lt-untried.py --transfer-from "
                 f"{a.transfer_from})")
        how = f"tune --transfer-from {a.transfer_from} --more {a.more}"
    else:
        tiles, clusters, where = lt_enum_tables(extra_roots=tuple(sorted(Path.cwd().glob(".ext/*/nvidia/cu13"))))
        left = untried(store, device, problems, tiles, clusters)
        seeds = f"cuBLASLt-tile seeds not yet tried (scripts/lt-untried.py; {where})"
        how = f"tune --seed-from-lt --more {a.more}"
    rows = sorted(left, key=lambda p: (chosen[(p.M, p.N, p.K)], p.M * p.N * p.K, p.key()))
    kernels = {n for p in rows for n in left[p][:a.more]}
    head = (f"# {device} {a.dtype} acc {a.acc}: the {len(rows)} shapes at {band} of cuBLASLt "
            f"autotuned ({a.report.name}) with {seeds}; lowest first. {how}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(head + "\n" + "".join(p.shape + "\n" for p in rows))
    print(f"{len(chosen)} shapes at {band}; {len(rows)} with untried seeds; the first {a.more} "
          f"untried of each: {len(kernels)} distinct kernels -> {a.out}", file=sys.stderr)
    if a.parts > 1:
        for letter, part in zip(string.ascii_lowercase, split(rows, a.parts)):
            path = a.out.with_name(f"{a.out.stem}-{letter}{a.out.suffix}")
            path.write_text(f"# part {letter} ({len(part)} shapes) of {a.out.name}\n"
                            + "".join(p.shape + "\n" for p in part))
            print(f"  {path}: {len(part)} shapes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
