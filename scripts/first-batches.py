#!/usr/bin/env python3
"""The kernels a `gemmrl tune --more K` run will propose first, before any GPU: the tune's own
policy (search.run.run_tune, with the store's history, --transfer-from and --seed-from-lt as tune
takes them) run on a copy of the store, each proposal evaluated as a slow trial, so that every
shape gets exactly its first batch of K. With --build the kernels not in the build cache
($GEMMRL_CACHE) are compiled, shapes in list order; --entries writes their cache directories for
scripts/pack-build-cache.sh, to carry to the GPU machine. `gemmrl build --transfer-from` compiles
the first --top suggestions of a transfer whether tried or not (151 kernels on the 203 fp32 shapes
of results/shapes/h200-fp32-from-fp16-2026-12-01d.txt); the tune proposes other ones where those
were tried, and mutations and neighbours' winners beside them.

    python3 scripts/first-batches.py --device H200 --acc fp32 --more 2 --family cutlass_sm90 --family raw \\
        --transfer-from h200:fp16 --shapes results/shapes/h200-fp32-from-fp16-2026-12-01d.txt \\
        --max-shapes 100 --build --jobs 2 --entries /tmp/entries.txt

Later trials of a shape depend on what the first ones measure: only the first batch is known here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_batches(db: str, device: str, problems, more: int, families=None, transfer=(), seed_from_lt=False,
                  layouts=("NN", "TN")) -> dict:
    """{problem: [Candidate]}: what tune's policy proposes first on each problem, simulated on a
    copy of the store at `db` (the copy takes the simulated trials; `db` is left as it was).
    `transfer`: [(GPU as the store names it, accumulator or None, input type or None)], as tune
    passes them to run_tune."""
    from gemmrl.search.policy import Trial
    from gemmrl.search.run import run_tune
    from gemmrl.store.db import Store

    seen: dict = {}

    def evaluate(problem, candidates):
        seen.setdefault(problem, []).extend(candidates)
        return [Trial(problem, c, "ok", 1e9, 1e-9) for c in candidates]

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "store.sqlite"
        shutil.copyfile(db, copy)
        store = Store(copy)
        try:
            lt = None
            if seed_from_lt:
                from gemmrl.cli import _lt_prior_for

                lt = _lt_prior_for(store, device, problems, layouts)
            run_tune(problems, store, device, evaluate, more=more, batch=max(8, more), layouts=layouts,
                     families=tuple(families) if families else None, transfer_from=list(transfer) or None,
                     lt_prior=lt)
        finally:
            store.close()
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part of it (H200)")
    ap.add_argument("--shapes", required=True, help="as tune takes them: MxNxK[,...] | subset:N | FILE")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--family", action="append", help="as tune's --family (repeatable; default: tune's)")
    ap.add_argument("--transfer-from", action="append", default=[], metavar="GPU[:[IN/]ACC]")
    ap.add_argument("--seed-from-lt", action="store_true")
    ap.add_argument("--more", type=int, default=2, help="tune --more: the first batch's size (default 2)")
    ap.add_argument("--max-shapes", type=int, help="only the first N shapes of the list")
    ap.add_argument("--build", action="store_true", help="compile those not in the build cache, in list order")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: the CPUs)")
    ap.add_argument("--entries", help="write the build-cache directory of each kernel here, one a line")
    a = ap.parse_args(argv)
    if a.more < 1 or (a.max_shapes is not None and a.max_shapes < 1):
        ap.error("--more and --max-shapes must be 1 or more")
    if not Path(a.db).is_file():
        ap.error(f"no store at {a.db} (gemmrl store unpacks the committed one)")

    import click

    from gemmrl.cli import _problems, split_transfer_source
    from gemmrl.space import registry
    from gemmrl.store.db import Store, device_by_part

    try:
        problems = _problems(a.shapes, a.dtype, a.acc)
        unknown = [f for f in a.family or () if f not in registry.FAMILIES]
        if unknown:
            raise click.BadParameter(f"unknown kernel family {unknown[0]!r}; known: {', '.join(registry.FAMILIES)}")
        store = Store(a.db, readonly=True)
        try:
            known = sorted(set(store.devices()) | set(store.tuned_devices("gemmrl-tuned")))
            device = device_by_part(a.device, known, "GPUs")
            transfer = []
            for text in a.transfer_from:
                gpu, acc, dtype = split_transfer_source(text)
                source = device_by_part(gpu, known, "GPUs")
                if source not in known:
                    raise ValueError(f"--transfer-from {text}: no {gpu!r} in {a.db}; it has {', '.join(known)}")
                transfer.append((source, acc, dtype))
        finally:
            store.close()
    except (click.ClickException, ValueError) as e:
        ap.error(e.format_message() if isinstance(e, click.ClickException) else str(e))
    if device not in known:
        ap.error(f"no {a.device!r} in {a.db}" + (f"; it has {', '.join(known)}" if known else ""))
    problems = problems[:a.max_shapes] if a.max_shapes else problems
    t0 = time.monotonic()
    got = first_batches(a.db, device, problems, a.more, a.family, transfer, a.seed_from_lt)
    origins = Counter(c.origin for cs in got.values() for c in cs)
    for p in problems:
        print(f"{p.shape} " + " ".join(f"{c.name}({c.origin})" for c in got.get(p, ())))
    print(f"{len(got)} of {len(problems)} shapes, {sum(map(len, got.values()))} candidates "
          f"({', '.join(f'{o} {n}' for o, n in origins.most_common())}), simulated in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    if not (a.build or a.entries):
        return 0
    from gemmrl.build import ahead
    from gemmrl.build.pool import build_many

    jobs = ahead.unique([ahead.job_for(c.spec, p) for p in problems for c in got.get(p, ())
                         if registry.get(c.family).valid(c.spec, p) is None])
    if a.entries:
        Path(a.entries).write_text("".join(f"{e}\n" for e in ahead.entries(jobs)))
    todo = ahead.pending(jobs)
    print(f"{len(jobs)} kernels to build for them; {len(jobs) - len(todo)} in the cache already, "
          f"{len(todo)} to compile" + ("" if a.build else " (--build compiles them)"), file=sys.stderr)
    if not a.build or not todo:
        return 0
    t1, failed = time.monotonic(), []

    def progress(done, total, name, r):
        print(f"[{done}/{total}] {'ok  ' if r.ok else 'FAIL'} {name} ({r.seconds:.0f} s)  "
              f"elapsed {time.monotonic() - t1:.0f}s", file=sys.stderr, flush=True)
        if not r.ok:
            failed.append(name)
    build_many([j.as_tuple() for j in todo], workers=a.jobs, progress=progress, threads=True)
    if failed:
        print(f"{len(failed)} of {len(todo)} builds failed: {', '.join(failed[:5])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
