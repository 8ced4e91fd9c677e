#!/usr/bin/env python3
"""Which shapes a host-mode (or kernel-mode) retime of the tuned winners should take next, from
the store alone (no GPU): for every shape with a winner on a device and accumulator, the latest
session of the winner in `--mode` is stale when
- it timed another kernel than today's winner (a race or tune changed the winner since), known
  from that run's passed verification of gemmrl-tuned; where the run verified nothing of it
  (older benches), when the winner was stored after that session;
- or it ran under an older protocol than `--protocol` names (e.g. offline:v3: the sessions of
  offline:v2 measure another yardstick: the summary's 'protocols' counts them);
- or no session of the winner in that mode exists;
- with `--builds`, also where that run verified another build of today's winner than the one
  its source makes now (the build key its verification recorded against the key computed here:
  a host-only change of the renderer, such as the CUTLASS entry-point cache made the default on
  2026-11-29, or other flags or headers). The keys name nvcc's and CUTLASS's versions, so this
  machine's must be the GPU machine's (as for a carried build cache); a verification that
  recorded no key (older runs) is not called stale by it.
Writes the stale shapes smallest first, one a line (a bench --shapes FILE, or the build step
that compiles their winners), and with `--lanes N` also N files of every Nth by FLOPs (for
scripts/device-steps.sh's lanes); says what the retime will cost from that mode's recent bench
runs (a start and seconds a shape, run_cost). With `--top-kernels K`, OUT (and its lanes) keeps
only the shapes whose winner's build is one of the K builds that serve the most stale shapes (one
wave of a build on K cores buys the most timed shapes), and OUT's stem + '-rest' lists the others
(their kernels compiled elsewhere, for a later call). With `--built-in CACHE`, OUT (and its lanes) keeps only the
shapes whose winner's build is finished in CACHE (a build cache, $GEMMRL_CACHE's layout, or a
tarball of one from scripts/pack-build-cache.sh or a device call's CACHE_BACK), and OUT's stem +
'-unbuilt' lists the others: what a call carrying a partial cache can time without compiling
(the fifty-third session's device calls filtered their lists so, by hand, after a build cut short).

    python3 scripts/stale-shapes.py --device H200 --acc fp32 --mode offline --protocol offline:v3 \\
        --out results/shapes/retime-h200-fp32.txt --lanes 4
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from pathlib import Path

from gemmrl.store.db import protocol_version

SUBJECT = "gemmrl-tuned"


def winner_jobs(store, device: str, acc: str, dtype: str = "fp16", want=None) -> dict:
    """(M, N, K) -> the BuildJob `gemmrl build --tuned-in` (and bench --impl tuned) makes of the
    shape's winner today, or None where its winner has no build plan (an unknown family); of the
    shapes in `want` alone where given."""
    from gemmrl.build.ahead import plan_tuned

    jobs = {}
    for choice in store.tuned_choices(SUBJECT, device):
        problem = choice[1]
        shape = (problem.M, problem.N, problem.K)
        if problem.acc == acc and problem.dtype == dtype and (want is None or shape in want):
            planned, _ = plan_tuned([choice])
            jobs[shape] = planned[0] if planned else None
    return jobs


def winner_entries(jobs: dict) -> dict:
    """(M, N, K) -> the build-cache directory ("builds/<name>-<key>", gemmrl.build.ahead.entries)
    of the build of the shape's winner today, from winner_jobs; shapes whose winner has no build
    plan are left out. The key ends the name: what --builds compares, and --built-in looks for."""
    from gemmrl.build.ahead import entries

    return {shape: entries([job])[0] for shape, job in jobs.items() if job is not None}


def stale_shapes(db: sqlite3.Connection, device: str, acc: str, mode: str, protocol: str | None = None,
                 dtype: str = "fp16", build_keys: dict | None = None) -> list[tuple[tuple[int, int, int], str]]:
    """[((M, N, K), why)] for the stale shapes, smallest FLOPs first. `build_keys` ((M, N, K) -> the
    key of the winner's build today, winner_entries' last field): also stale where the session's run
    verified another build of the winner."""
    want = protocol_version(protocol)[1] if protocol else 0
    winners = {}
    for M, N, K, info, created in db.execute(
            "SELECT M, N, K, info, created FROM tuning WHERE device=? AND acc=? AND dtype=? AND impl=?",
            (device, acc, dtype, SUBJECT)):
        winners[(M, N, K)] = (info.split(" ")[0], created)
    latest = {}
    for M, N, K, run, proto, created in db.execute(
            "SELECT M, N, K, run_id, protocol, created FROM measurements WHERE device=? AND acc=? AND dtype=? "
            "AND impl=? AND mode=? AND status='ok' ORDER BY id", (device, acc, dtype, SUBJECT, mode)):
        latest[(M, N, K)] = (run, proto, created)
    out = []
    for shape, (name, won) in winners.items():
        if shape not in latest:
            out.append((shape, "never timed in this mode"))
            continue
        run, proto, at = latest[shape]
        if protocol_version(proto)[1] < want:
            out.append((shape, f"protocol {proto}"))
            continue
        row = db.execute("SELECT details FROM verifications WHERE device=? AND acc=? AND dtype=? AND impl=? "
                         "AND run_id=? AND M=? AND N=? AND K=? AND passed=1 ORDER BY id DESC LIMIT 1",
                         (device, acc, dtype, SUBJECT, run, *shape)).fetchone()
        if row is not None:
            chosen = (json.loads(row[0] or "{}").get("impl") or {}).get("chosen") or {}
            timed = chosen.get("name")
            got, want_key = (chosen.get("build") or {}).get("key"), (build_keys or {}).get(shape)
            if timed != name:
                out.append((shape, f"timed {timed}, winner now {name}"))
            elif got and want_key and got != want_key:
                out.append((shape, f"another build: timed {got}, the winner's build now {want_key}"))
        elif won > at:
            out.append((shape, "winner stored after the session"))
    out.sort(key=lambda x: (x[0][0] * x[0][1] * x[0][2], x[0]))
    return out


def split_by_kernels(jobs: dict, shapes: list, top: int) -> tuple[list, list, int]:
    """(covered, rest, builds): `shapes` ((M, N, K) tuples, order kept) split into those whose
    winner's build (the source `gemmrl build --tuned-in` compiles for it) is one of the `top`
    builds that serve the most of them (ties: the first served), and the rest; `builds`: how many
    distinct builds they all need. `jobs`: winner_jobs of (at least) these shapes."""
    build = {shape: jobs[shape].source if jobs.get(shape) is not None else f"unbuildable {shape}"  # its own
             for shape in shapes}
    count: dict[str, int] = {}
    for s in shapes:
        count[build[s]] = count.get(build[s], 0) + 1
    order = {k: i for i, k in enumerate(count)}
    keep = set(sorted(count, key=lambda k: (-count[k], order[k]))[:top])
    covered = [s for s in shapes if build[s] in keep]
    return covered, [s for s in shapes if build[s] not in keep], len(count)


def built_entries(path: Path) -> set[str]:
    """The build-cache directories ("builds/<name>-<key>", as gemmrl.build.ahead.entries names
    them) that hold a finished build (kernel.so, or kernel.o for an object-only build) in a build
    cache (the directory $GEMMRL_CACHE names, holding builds/) or in a tarball of one (.txz, .tgz,
    .tar: scripts/pack-build-cache.sh's); ValueError where PATH is neither."""
    import tarfile

    finished = ("kernel.so", "kernel.o")
    if path.is_dir():
        root = path / "builds"
        if not root.is_dir():
            raise ValueError(f"{path}: no builds/ in it (give the build cache's root, what GEMMRL_CACHE names)")
        return {f"builds/{d.name}" for d in root.iterdir()
                if d.is_dir() and not d.name.startswith(".") and any((d / f).is_file() for f in finished)}
    if not path.is_file():
        raise ValueError(f"{path}: no such build cache or tarball")
    try:
        with tarfile.open(path, "r:*") as t:
            members = [m for m in t.getmembers() if m.isfile()]
    except (tarfile.TarError, OSError) as e:
        raise ValueError(f"{path}: not a build cache tarball ({e})") from None
    out = set()
    for m in members:
        parts = [x for x in m.name.split("/") if x not in ("", ".")]
        if len(parts) == 3 and parts[0] == "builds" and parts[2] in finished:
            out.add(f"builds/{parts[1]}")
    return out


def split_by_built(entry: dict, shapes: list, built: set[str]) -> tuple[list, list]:
    """(built, unbuilt): `shapes` ((M, N, K) tuples, order kept) split by whether the build of
    their winner today (winner_entries: the one bench --impl tuned loads) is in `built`
    (built_entries); a winner with no build plan (an unknown family) is unbuilt."""
    ready = {s for s in shapes if entry.get(s) in built}
    return [s for s in shapes if s in ready], [s for s in shapes if s not in ready]


def write_others(out: Path, suffix: str, head: str, shapes: list) -> None:
    """The shapes a split left out of OUT ((M, N, K) tuples), in OUT's stem + '-' + suffix; an
    earlier split's file there is removed, stale now, where none are left out."""
    path = out.with_name(f"{out.stem}-{suffix}{out.suffix}")
    path.unlink(missing_ok=True)
    if shapes:
        path.write_text(f"{head}: {len(shapes)}\n" + "\n".join(f"{M}x{N}x{K}" for M, N, K in shapes) + "\n")
        print(path)


def write_lanes(out: Path, head: str, shapes: list[str], lanes: int) -> None:
    out.write_text(head + "\n" + "\n".join(shapes) + "\n")  # all of them: what a build step compiles
    print(out)
    if lanes > 1:
        for i in range(lanes):
            p = out.with_name(f"{out.stem}-l{i}{out.suffix}")
            p.write_text(f"{head}, lane {i} of {lanes}\n" + "\n".join(shapes[i::lanes]) + "\n")
            print(p)


def run_cost(db: sqlite3.Connection, device: str, mode: str, acc: str | None = None,
             protocol: str | None = None, last: int = 8) -> tuple[float, float] | None:
    """(start seconds, seconds a shape) of a bench that times the subject in this mode, from the
    `last` finished runs that timed it in only this mode, or None. Only runs that timed it with
    accumulator `acc` under `protocol` (a prefix: server:v2 takes server:v2:qps=1000:gaps=round)
    count where there are any, else those of `acc`, else any: fp16 offline took 6.0 s a shape on
    the H200 while fp32 took 4.2, and the server mode's old precision-target runs 13 s against
    --quick's 1.1-1.5 (the estimate of 2026-11-30 said 66 GPU-minutes for the fp16 offline
    list, from the fp32 runs: about 94).

    Bench runs only: a tune run's wall time holds its search. A run's wall time is a start (the
    process, the peaks, the first compile) plus its shapes: the least-squares line through
    (shapes, seconds) gives both where the runs' sizes differ and the line has a positive slope
    and start, else the runs' seconds over their shapes, summed (no start). A median of each run's seconds a shape reads the small runs' start as per-shape
    time: on 2026-11-30 it said 14.8 s a shape (97 GPU-minutes) for 392 fp16 kernel-mode
    shapes, from settle runs of 3-6 shapes at 15-17 s, where run 894 had just timed 253 shapes
    in 322 s."""
    def sizes(where: str, args: tuple) -> list[tuple[int, float]]:
        rows = db.execute(
            "SELECT r.id, r.started, r.finished, COUNT(DISTINCT m.M || 'x' || m.N || 'x' || m.K || m.acc), "
            "COUNT(DISTINCT m.mode) FROM runs r JOIN measurements m ON m.run_id = r.id WHERE r.device=? "
            "AND r.finished IS NOT NULL AND r.command LIKE 'gemmrl bench%' AND r.id IN (SELECT run_id FROM "
            f"measurements WHERE impl=? AND mode=?{where}) GROUP BY r.id ORDER BY r.id DESC",
            (device, SUBJECT, mode, *args)).fetchall()
        return [(n, f - s) for _, s, f, n, modes in rows if modes == 1 and n and f > s][:last]
    runs: list = []
    for a, p in dict.fromkeys(((acc, protocol), (acc, None), (None, None))):  # the closest runs there are
        where = (" AND acc=?" if a else "") + (" AND protocol LIKE ? || '%'" if p else "")
        runs = sizes(where, tuple(x for x in (a, p) if x))
        if runs:
            break
    if not runs:
        return None
    ns = [n for n, _ in runs]
    if len(set(ns)) > 1:
        mn, mt = statistics.fmean(ns), statistics.fmean(t for _, t in runs)
        slope = sum((n - mn) * (t - mt) for n, t in runs) / sum((n - mn) ** 2 for n in ns)
        start = mt - slope * mn
        if slope > 0 and start >= 0:
            return start, slope
    return 0.0, sum(t for _, t in runs) / sum(ns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part of it (H200)")
    ap.add_argument("--acc", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--mode", choices=("kernel", "offline", "server"), required=True)
    ap.add_argument("--protocol", help="the oldest protocol that counts as current, e.g. offline:v3")
    ap.add_argument("--out", help="write the shapes here (with --lanes N, also a share each in OUT's stem -l0 .. -l<N-1>)")
    ap.add_argument("--lanes", type=int, default=1, help="split into this many files, every Nth by FLOPs")
    ap.add_argument("--builds", action="store_true",
                    help="also stale where the session timed another build of the winner than its source makes "
                         "now (needs this machine's nvcc and CUTLASS headers to be the GPU machine's)")
    ap.add_argument("--top-kernels", type=int, default=0,
                    help="OUT keeps the shapes of the K builds serving the most stale shapes; the rest go to OUT's stem-rest")
    ap.add_argument("--built-in", metavar="CACHE",
                    help="OUT keeps the shapes whose winner's build is finished in this build cache (its root) or "
                         "tarball of one; the rest go to OUT's stem-unbuilt")
    a = ap.parse_args(argv)
    if a.lanes < 1:
        ap.error("--lanes must be at least 1")
    if a.top_kernels < 0 or (a.top_kernels and not a.out):
        ap.error("--top-kernels takes a positive count, and --out")
    if a.built_in and not a.out:
        ap.error("--built-in takes --out")
    if a.built_in and a.top_kernels:
        ap.error("--built-in and --top-kernels split OUT two ways: give one")
    built = None
    if a.built_in:
        try:
            built = built_entries(Path(a.built_in))
        except ValueError as e:
            ap.error(str(e))
    if a.protocol and protocol_version(a.protocol)[0] != a.mode:
        ap.error(f"--protocol {a.protocol} is not a {a.mode} protocol")
    if not Path(a.db).is_file():
        ap.error(f"{a.db}: no store (gemmrl store unpacks a committed one)")
    from gemmrl.store.db import device_by_part

    db = sqlite3.connect(a.db)
    devices = [d for (d,) in db.execute("SELECT DISTINCT device FROM tuning")]
    try:
        device = device_by_part(a.device, devices)
    except ValueError as e:
        ap.error(str(e))

    def plan(want=None):  # each winner's build (of the shapes in `want`), planned once
        from gemmrl.store.db import Store

        store = Store(a.db, readonly=True)
        try:
            return winner_jobs(store, device, a.acc, a.dtype, want)
        finally:
            store.close()

    jobs = entry = keys = None
    if a.builds:  # every winner's: the stale shapes are not known yet
        jobs = plan()
        entry = winner_entries(jobs)
        keys = {shape: e.rsplit("-", 1)[1] for shape, e in entry.items()}
    stale = stale_shapes(db, device, a.acc, a.mode, a.protocol, a.dtype, keys)
    why: dict[str, int] = {}
    for _, w in stale:
        key = "winner changed" if w.startswith("timed") else "another build" if w.startswith("another build") else w
        why[key] = why.get(key, 0) + 1
    rc = run_cost(db, device, a.mode, a.acc, a.protocol)
    if rc is None:
        cost = f" (no finished run timed {a.mode} mode alone: no cost estimate)"
    else:
        start, sps = rc
        secs = (start + sps * len(stale)) if stale else 0.0
        minutes = f"{secs / 60:.0f}" if secs >= 600 else f"{secs / 60:.1f}"
        cost = (f", about {minutes} GPU-minutes at the {sps:.1f} s a shape"
                + (f" and {start:.0f} s to start" if start >= 0.5 else "") + f" of recent {a.mode} runs")
    print(f"{device}, acc {a.acc}, {a.mode}: {len(stale)} stale shapes{cost}; "
          + ", ".join(f"{n} {k}" for k, n in sorted(why.items(), key=lambda x: -x[1])))
    if a.out and not stale:  # an earlier list there must not be what a following bench times
        out = Path(a.out)
        made = [out] + [out.with_name(f"{out.stem}-{x}{out.suffix}") for x in ("rest", "unbuilt")]
        gone = [p for p in made + sorted(out.parent.glob(f"{out.stem}-l[0-9]*{out.suffix}")) if p.is_file()]
        for p in gone:
            p.unlink()
        print(f"nothing to write to {out}" + (f"; removed the earlier list{'s' * (len(gone) > 1)} there: "
                                               + ", ".join(str(p) for p in gone) if gone else ""))
    if a.out and stale:
        shapes = [shape for shape, _ in stale]
        head = f"# {device} acc {a.acc}: shapes whose {a.mode}-mode session of {SUBJECT} is stale " \
               f"(scripts/stale-shapes.py{' --protocol ' + a.protocol if a.protocol else ''}{' --builds' * a.builds})"
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)  # OUT's lanes and its -rest/-unbuilt beside it
        if jobs is None and (a.top_kernels or built is not None):
            jobs = plan(set(shapes))
        if entry is None and built is not None:
            entry = winner_entries(jobs)
        if a.top_kernels:
            shapes, rest, n_kernels = split_by_kernels(jobs, shapes, a.top_kernels)
            print(f"the {min(a.top_kernels, n_kernels)} builds serving the most of them (of {n_kernels}) "
                  f"serve {len(shapes)}; {len(rest)} left for later")
            write_others(out, "rest", f"{head}, the builds outside the top {a.top_kernels}", rest)
            head += f", the top {a.top_kernels} builds'"
        if built is not None:
            shapes, rest = split_by_built(entry, shapes, built)
            print(f"{len(shapes)} of them have their winner's build in {a.built_in} ({len(built)} builds); "
                  f"{len(rest)} do not")
            write_others(out, "unbuilt", f"{head}, whose winner's build is not in {a.built_in}", rest)
            head += f", those whose winner's build is in {a.built_in}"
        write_lanes(out, f"{head}: {len(shapes)}", [f"{M}x{N}x{K}" for M, N, K in shapes], a.lanes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
