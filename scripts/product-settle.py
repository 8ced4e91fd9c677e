#!/usr/bin/env python3
"""Settle a pack against its own product sessions in one device call: export the pack from the
store, time the shapes whose serving changed through gemmrl.matmul in every mode, and export
again, until an export changes nothing or the rounds or the deadline run out.

Each export reads the sessions the last round added: a kernel or a cuBLASLt algorithm that
gemmrl.matmul ran slower than torch.matmul beyond the noise leaves the pack, and the shapes it
served must then be timed again under the new serving (the thirty-third session, 2026-11-27, took
three device calls for it: 142, then 24, then 3 shapes). An export that changes nothing settles the
pack only where nothing it serves is disputed: a kernel or algorithm whose newest product session
ran slower than torch.matmul beyond the noise, kept by the median of its sessions, is timed again
in that mode until it has --min-sessions (3) there, sessions of the very source or algorithm the
pack ships, as the grid report reads them (gemmrl.runtime.pack.disputed). Run on the
device, beside the store the call sends back:

    python3 scripts/product-settle.py --device H200 --acc fp16 --pack packs/h200-fp16-F16F16F16F16 \\
        --gpus 4 --deadline-s 480 --json $OUT/settle.json [--shapes FILE]

--shapes: time these shapes first, before any export (a pack exported elsewhere, with its
`pack --changed-shapes` file). An export compares with the pack as the call found it (the committed
one): of the shapes it changed, those the store's product sessions have timed already, in every
mode and both layouts, as the exported pack serves them (an earlier call's settle, its delta
carried) are left out of the round (timed_as_served; the JSON's 'timed_before' lists the runs
that timed them, for product-report.py's --run; --time-all-changed times them all). The pack it
leaves on the device is not sent back: merge the call's store delta here and export again (`gemmrl pack --out DIR`), which gives the same entries from
the same sessions. Every step is a `python3 -m gemmrl.cli` command (pack, build --pack,
bench --impl torch.matmul --impl pack:DIR --subject gemmrl.matmul-nn --retime, --quick in the
host modes), its output in --logs. The JSON names each round's shapes and the store's runs of
each mode: `scripts/product-report.py --run ... --latest --mode M` takes them. Exit 0 when the
pack settled, 3 when rounds or time ran out first (the last export's changed shapes untimed) or a
SIGTERM stopped it (the running step stops cleanly, keeping what it measured; the JSON is still
written), 1 when a step failed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("kernel", "offline", "server")
SUBJECT = "gemmrl.matmul-nn"


def bench_argv(shapes: str, mode: str, acc: str, pack: str, db: str, out: str, gpus: int = 1,
               quick_host: bool = True, budget_s: float | None = None, dtype: str = "fp16") -> list[str]:
    """The gemmrl bench arguments of one product timing: torch.matmul beside gemmrl.matmul as
    the pack serves it, both layouts, timed afresh (--retime); the host modes --quick unless
    told otherwise; `dtype` the inputs' type (--dtype, named where not fp16). Pure."""
    argv = ["bench", "--shapes", shapes, "--mode", mode, "--acc", acc, "--impl", "torch.matmul",
            "--impl", f"pack:{pack}", "--subject", SUBJECT, "--retime", "--no-report", "--db", db, "--out", out]
    if dtype != "fp16":
        argv += ["--dtype", dtype]
    if gpus > 1:
        argv += ["--gpus", str(gpus)]
    if quick_host and mode != "kernel":
        argv.append("--quick")
    if budget_s is not None:
        argv += ["--budget-s", f"{max(1.0, budget_s):.0f}"]
    return argv


def read_shapes(path: str) -> list[str]:
    """The MxNxK lines of a `pack --changed-shapes` file (comments skipped); [] for none."""
    from gemmrl.core.problem import ProblemError
    from gemmrl.core.shapes import parse_shape_file

    try:
        return [f"{p.M}x{p.N}x{p.K}" for p in parse_shape_file(path)]
    except ProblemError as e:
        if "holds no shapes" in str(e):
            return []
        raise


def settle(run, *, device: str, acc: str, pack: str, db: str, work: str, shapes: str | None = None,
           rounds: int = 5, modes=MODES, gpus: int = 1, quick_host: bool = True, deadline_s: float | None = None,
           bench_s: float = 120.0, clock=time.monotonic, log=print, disputes=None, dtype: str = "fp16",
           already=None) -> dict:
    """The settling loop. `run(argv, label)` runs one gemmrl command (argv after `gemmrl`) and
    returns its exit status; `work` is a directory for the changed-shapes files. Each round:
    export (`pack --changed-shapes`; round 1 skips it where `shapes` is given), stop if nothing
    changed, else `build --pack --shapes` (the kernels serving those shapes alone) and one bench a
    mode on the changed shapes. A step is not started past `deadline_s`; each bench gets at most
    `bench_s` seconds of budget, and no more than what is left. `disputes()`, where given, is
    asked when an export changed nothing: the (M, N, K, layout, mode) the pack serves whose newest
    product session ran slower than torch.matmul beyond the noise though the export kept them
    (gemmrl.runtime.pack.disputed); those shapes are timed again in those modes as a round of
    their own (its entry says 'disputed'), so that a third session decides, before the pack counts
    as settled. `dtype`: the pack's input type (a bf16 pack: its export and benches say --dtype bf16).
    `already(shapes, modes)`, where given, is asked after an export that changed shapes: those of
    them that product sessions in the store have timed already, in every one of `modes` and both
    layouts, serving as the exported pack now does (timed_as_served: a carried delta's settle, whose
    pack export was not committed); they are left out of the round, and a round left with none goes
    on to the next export. Returns {'settled', 'stopped', 'rounds':
    [{'shapes', 'file', 'benches': {mode: rc}}]}."""
    t0 = clock()

    def left() -> float:
        return float("inf") if deadline_s is None else deadline_s - (clock() - t0)

    out: dict = {"settled": False, "stopped": None, "rounds": []}
    for i in range(rounds + 1):  # the last pass only exports, to learn whether the pack settled
        round_modes, disputed = list(modes), False
        if i == 0 and shapes:
            todo_file, todo = shapes, read_shapes(shapes)
        else:
            if left() <= 0:
                out["stopped"] = "deadline before an export"
                break
            todo_file = str(Path(work) / f"changed-{i}.txt")
            rc = run(["pack", "--device", device, "--acc", acc, "--out", pack, "--db", db,
                      "--changed-shapes", todo_file] + (["--dtype", dtype] if dtype != "fp16" else []), f"export {i}")
            if rc != 0:
                out["stopped"] = f"export {i} failed (exit {rc})"
                break
            todo = read_shapes(todo_file)
            if todo:
                log(f"export {i}: {len(todo)} shapes changed")
                done = set(already(todo, round_modes)) if already is not None else set()
                if done:
                    todo = [t for t in todo if t not in done]
                    log(f"export {i}: {len(done)} of them timed through gemmrl.matmul already, as the pack now "
                        f"serves them (every mode, both layouts): {len(todo)} left to time")
                    if not todo:
                        if i == rounds:
                            out["stopped"] = f"{rounds} rounds timed; the last export's changes were timed already"
                        continue
                    todo_file = str(Path(work) / f"changed-{i}-untimed.txt")
                    Path(todo_file).write_text("".join(f"{t}\n" for t in todo))
            elif disputes is not None and (got := disputes()):
                disputed = True
                todo = [f"{M}x{N}x{K}" for M, N, K in sorted({k[:3] for k in got}, key=lambda s: (s[0] * s[1] * s[2], s))]
                todo_file = str(Path(work) / f"disputed-{i}.txt")
                Path(todo_file).write_text("".join(f"{t}\n" for t in todo))
                round_modes = [m for m in modes if any(k[4] == m for k in got)]
                log(f"export {i}: nothing changed, but {len(got)} served (shape, layout, mode) ran slower than "
                    f"torch.matmul in their newest session: {len(todo)} shapes timed again ({', '.join(round_modes)})")
            else:
                out["settled"] = True
                log(f"export {i}: nothing changed; the pack is settled")
                break
        if i == rounds:
            what = "left disputed" if disputed else "changed"
            out["stopped"] = f"{rounds} rounds timed; the last export {what} {len(todo)} shapes"
            out["rounds"].append({"shapes": todo, "file": todo_file, "benches": {}, **({"disputed": True} if disputed else {})})
            break
        entry = {"shapes": todo, "file": todo_file, "benches": {}, **({"disputed": True} if disputed else {})}
        out["rounds"].append(entry)
        rc = run(["build", "--pack", pack, "--shapes", todo_file], f"build {i}")
        if rc != 0:
            out["stopped"] = f"build {i} failed (exit {rc})"
            break
        for mode in round_modes:
            if left() <= 10:
                out["stopped"] = f"deadline in round {i}, before {mode} mode"
                break
            entry["benches"][mode] = run(
                bench_argv(todo_file, mode, acc, pack, db, str(Path(work) / f"bench-{i}-{mode}"), gpus, quick_host,
                           min(bench_s, left() - 10), dtype), f"bench {i} {mode}")
        if out["stopped"]:
            break
        if any(rc != 0 for rc in entry["benches"].values()):
            out["stopped"] = f"a bench of round {i} failed: {entry['benches']}"
            break
    return out


def pack_disputes(db: str, pack: str, device: str, min_sessions: int) -> list[tuple]:
    """gemmrl.runtime.pack.disputed for the pack at `pack` as last exported, from the store at
    `db`; `device` as the store names it or a unique part of it."""
    from gemmrl.runtime.pack import disputed
    from gemmrl.store.db import Store, device_by_part

    store = Store(db, readonly=True)
    try:
        name = device_by_part(device, store.devices())
        return disputed(store, json.loads((Path(pack) / "manifest.json").read_text()), name, min_sessions)
    finally:
        store.close()


def _product_report():
    """scripts/product-report.py as a module: its rule for what served a product session."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("product_report", Path(__file__).with_name("product-report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed_as_served(db: str, pack: str, device: str, acc: str, dtype: str, shapes, modes, used=None) -> set:
    """The shapes of `shapes` (MxNxK) that product sessions in the store at `db` on `device` (as the
    store names it, or a unique part of it) have timed in each of `modes`, both layouts, with
    gemmrl.matmul serving them as the pack at `pack` serves them now: its kernel's source, its
    cuBLASLt algorithm, or the library's own choice, by product-report.py's rule (`differs`; a
    verification record that cannot say what served does not count). `used`, where given, gets the
    newest such run of each (mode, shape, layout) of the shapes returned. The sixty-seventh session's
    call 5 (2026-12-01) timed 29 such shapes again: its export compared with the committed pack,
    while call 4's settle, a delta it carried, had timed 28 of them as served, and earlier runs the
    29th's cuBLASLt algorithm."""
    from gemmrl.store.db import Store, device_by_part

    rep = _product_report()
    serving = rep.pack_serving(json.loads((Path(pack) / "manifest.json").read_text()))
    want = {}
    for s in shapes:
        M, N, K = (int(x) for x in s.split("x"))
        want[(M, N, K)] = s
    store = Store(db, readonly=True)
    try:
        name = device_by_part(device, store.devices())
    finally:
        store.close()
    impls = {rep.PAIRS[0][1]: "NN", rep.PAIRS[1][1]: "TN"}
    con = sqlite3.connect(db)
    try:
        rows = [r for r in con.execute(
            "SELECT DISTINCT m.run_id, m.mode, m.M, m.N, m.K, m.impl FROM measurements m JOIN runs r "
            "ON r.id = m.run_id WHERE r.device = ? AND m.acc = ? AND m.dtype = ? AND m.status = 'ok' "
            "AND m.impl IN (?, ?)", (name, acc, dtype, *impls)) if (r[2], r[3], r[4]) in want]
        runs = sorted({r[0] for r in rows})
        timed_by: dict = {}
        for i in range(0, len(runs), 500):  # SQLite's bound on the variables of one statement
            timed_by.update(rep.run_serving(con, tuple(runs[i:i + 500])))
    finally:
        con.close()
    covered: dict = {}
    for run, mode, M, N, K, impl in rows:
        layout = impls[impl]
        got = timed_by.get((run, M, N, K, layout))
        if got is not None and not rep.differs(got, serving.get((M, N, K, layout), ("library", None))):
            key = (mode, M, N, K, layout)
            covered[key] = max(run, covered.get(key, run))
    keys = {mnk: [(m, *mnk, lay) for m in modes for lay in ("NN", "TN")] for mnk in want}
    done = {mnk for mnk, ks in keys.items() if all(k in covered for k in ks)}
    if used is not None:
        used.update(covered[k] for mnk in done for k in keys[mnk])
    return {want[mnk] for mnk in done}


def runs_by_mode(db: str, after: int, acc: str, dtype: str = "fp16") -> dict:
    """{mode: [run ids]} of the product benches after run `after` (their sessions' modes) with
    these inputs and accumulator."""
    con = sqlite3.connect(db)
    got: dict = {}
    for run_id, mode in con.execute(
            "SELECT DISTINCT run_id, mode FROM measurements WHERE run_id > ? AND acc = ? AND dtype = ? "
            "AND impl IN (?, ?) ORDER BY run_id", (after, acc, dtype, SUBJECT, "gemmrl.matmul-tn")):
        got.setdefault(mode, []).append(run_id)
    return got


class Runner:
    """Runs `python3 -m gemmrl.cli ARGV` with its output in a log file; a SIGTERM to this script
    goes on to the running step (which stops cleanly, keeping what it measured), and no further
    step starts."""

    def __init__(self, logs: Path):
        self.logs, self.proc, self.stopped, self.n = logs, None, False, 0
        logs.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, self._term)

    def _term(self, *_):
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def __call__(self, argv: list[str], label: str) -> int:
        if self.stopped:
            return 143
        self.n += 1
        log = self.logs / f"{self.n:02d}-{label.replace(' ', '-')}.log"
        t = time.monotonic()
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "gemmrl.cli", *argv], stdout=f, stderr=subprocess.STDOUT)
            rc = self.proc.wait()
        self.proc = None
        print(f"{label}: exit {rc} after {time.monotonic() - t:.0f} s ({log})", flush=True)
        return rc


def logs_dir(pack: str, out: str | None = None) -> Path:
    """Where a settle of `pack` keeps its logs and changed-shapes files unless --logs says: a directory
    named after the pack, so that two settles side by side (one per lane, one per accumulator) never
    share a changed-shapes file, under OUT/logs where a device call gives OUT (its logs then come
    back with the call), else under settle-logs. Pure.

    One shared settle-logs/ made the sixtieth session's fp16 settle (2026-11-30) time the fp32
    settle's changed shapes in the host modes: the fp32 export, a second later, wrote over the
    fp16 round's changed-0.txt between its kernel bench and its offline bench."""
    base = Path(out) / "logs" if out else Path("settle-logs")
    return base / f"settle-{Path(pack).resolve().name or 'pack'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", required=True, help="the GPU as the store names it, or a unique part of it (H200)")
    ap.add_argument("--acc", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="the pack's input type (default fp16)")
    ap.add_argument("--pack", required=True, help="the pack directory, exported again in place")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--shapes", help="time these shapes first, before any export")
    ap.add_argument("--rounds", type=int, default=5,
                    help="timing rounds at most (default 5; --deadline-s bounds the time): a disputed kernel "
                         "that the export then drops takes three (its first session, its third, the fallback "
                         "timed as served), four where an export also changed another shape (2026-11-30)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--full-host", action="store_true", help="the host modes to the precision target (no --quick)")
    ap.add_argument("--deadline-s", type=float, help="start no step after this many seconds")
    ap.add_argument("--bench-s", type=float, default=120.0, help="budget of one bench (default 120)")
    ap.add_argument("--logs", help="directory for the steps' logs and shape files (default: logs_dir(), one per "
                                   "pack, under $OUT/logs where a device call sets OUT)")
    ap.add_argument("--json", help="write the rounds, their shapes and the store's runs per mode here")
    ap.add_argument("--min-sessions", type=int, default=3,
                    help="when an export changes nothing, time again what the pack serves whose newest product "
                         "session ran slower than torch.matmul beyond the noise, until it has this many sessions "
                         "in that mode (default 3; 0: never)")
    ap.add_argument("--time-all-changed", action="store_true",
                    help="time every shape an export changed, also those the store's product sessions have timed "
                         "already as the pack now serves them (by default left out: timed_as_served)")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode: {', '.join(bad)} (of {', '.join(MODES)})")
    if a.rounds < 1 or a.gpus < 1:
        ap.error("--rounds and --gpus must be at least 1")
    if not Path(a.db).exists():
        ap.error(f"no store at {a.db} (gemmrl store unpacks the committed one)")
    if not (Path(a.pack) / "manifest.json").exists():
        ap.error(f"{a.pack} is not a pack (no manifest.json)")
    held = json.loads((Path(a.pack) / "manifest.json").read_text())
    if (held.get("dtype") or "fp16", held.get("acc") or a.acc) != (a.dtype, a.acc):
        ap.error(f"{a.pack} is a pack of {held.get('dtype') or 'fp16'} inputs with an {held.get('acc')} accumulator, "
                 f"not --dtype {a.dtype} --acc {a.acc}")
    if a.shapes:
        try:
            read_shapes(a.shapes)
        except Exception as e:  # a bad file is an argument error, before any GPU work
            ap.error(str(e))
    a.logs = a.logs or str(logs_dir(a.pack, os.environ.get("OUT")))
    after = sqlite3.connect(a.db).execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0]
    runner = Runner(Path(a.logs))
    before: set = set()
    got = settle(runner, device=a.device, acc=a.acc, pack=a.pack, db=a.db, work=a.logs, shapes=a.shapes,
                 rounds=a.rounds, modes=modes, gpus=a.gpus, quick_host=not a.full_host, deadline_s=a.deadline_s,
                 bench_s=a.bench_s, disputes=(lambda: pack_disputes(a.db, a.pack, a.device, a.min_sessions))
                 if a.min_sessions > 0 else None, dtype=a.dtype,
                 already=None if a.time_all_changed else
                 (lambda shapes, ms: timed_as_served(a.db, a.pack, a.device, a.acc, a.dtype, shapes, ms, before)))
    if runner.stopped:
        got["stopped"] = "SIGTERM" + (f" ({got['stopped']})" if got["stopped"] else "")
    got["runs"] = runs_by_mode(a.db, after, a.acc, a.dtype)
    got["timed_before"] = sorted(before)  # the runs whose sessions stood for the shapes left out
    got.update(device=a.device, dtype=a.dtype, acc=a.acc, pack=a.pack, after_run=after)
    print(json.dumps({k: got[k] for k in ("settled", "stopped", "runs", "timed_before")}))
    if a.json:
        Path(a.json).write_text(json.dumps(got, indent=1) + "\n")
    if got["settled"]:
        return 0
    cut = ("SIGTERM", "rounds timed", "deadline")
    return 3 if any(w in (got["stopped"] or "") for w in cut) else 1


if __name__ == "__main__":
    sys.exit(main())
