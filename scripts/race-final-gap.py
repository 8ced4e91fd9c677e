#!/usr/bin/env python3
"""How far a race's time of its winner is from the final timing of the same kernel, from the
race's log and the store alone (no GPU), grouped by how slow the race's slowest contender was.

A race (`bench --impl race:K...`, `tune --race K`) logs one line a shape,

    1024x1024x16384 candidates (median us, beside 7 baselines, by paired ratios): A=52.90, B=54.30, ...

and the same run then times the winner as gemmrl-tuned beside the baselines (kernel mode). Per
shape: the winner's race time, the final median, their ratio (final / race) and the slowest
contender over the fastest. Then the median ratio and the count more than --off apart, for races
whose contenders all ran within 1.3x, 1.3-2x, and 2x or slower.

    python3 scripts/race-final-gap.py --db results/gemmrl.sqlite --device H200 \\
        logs/call1/step-0-bench.log ...

A bench log names its run on its first 'run N:' line; a tune log does not, so name it as
LOG:RUN. A contender logged without a time (failed, or pruned by the race's pre-pass) is left out
of the spread.
"""

from __future__ import annotations

import argparse
import csv
import re
import sqlite3
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINE = re.compile(r"^(\d+)x(\d+)x(\d+) candidates \(median us, beside [^)]*\): (.*)$")
RUN = re.compile(r"^run (\d+):")
BANDS = ((1.0, 1.3, "within 1.3x"), (1.3, 2.0, "1.3-2x"), (2.0, float("inf"), "2x or slower"))


def parse_log(text: str) -> tuple[int | None, list[dict]]:
    """(the log's run, one row a race line: M, N, K, the fastest contender's name and time, the
    slowest timed contender over the fastest, the number timed)."""
    run, rows = None, []
    for line in text.splitlines():
        m = RUN.match(line)
        if m and run is None:
            run = int(m.group(1))
            continue
        m = LINE.match(line.strip())
        if not m:
            continue
        timed = []
        for item in m.group(4).split(", "):
            name, _, value = item.partition("=")
            try:
                timed.append((name, float(value)))
            except ValueError:  # a failed or pruned contender: no time
                continue
        if not timed:
            continue
        name, fastest = min(timed, key=lambda t: t[1])
        rows.append({"M": int(m.group(1)), "N": int(m.group(2)), "K": int(m.group(3)), "winner": name,
                     "race_us": fastest, "spread": max(t[1] for t in timed) / fastest, "timed": len(timed)})
    return run, rows


def with_final(rows: list[dict], run: int, db, device: str) -> list[dict]:
    """The rows whose shape the run also timed as gemmrl-tuned (kernel mode), with final_us and gap."""
    out = []
    for r in rows:
        got = db.execute("SELECT median_us FROM measurements WHERE run_id=? AND device=? AND M=? AND N=? AND K=? "
                         "AND impl='gemmrl-tuned' AND mode='kernel' AND status='ok' ORDER BY id DESC LIMIT 1",
                         (run, device, r["M"], r["N"], r["K"])).fetchone()
        if got and got[0]:
            out.append({**r, "run": run, "final_us": got[0], "gap": got[0] / r["race_us"]})
    return out


def bands(rows: list[dict], off: float) -> list[dict]:
    out = []
    for lo, hi, label in BANDS:
        sel = [r["gap"] for r in rows if lo <= r["spread"] < hi]
        out.append({"slowest contender": label, "races": len(sel),
                    "median final/race": statistics.median(sel) if sel else None,
                    f"more than {off:.0%} apart": sum(abs(g - 1.0) > off for g in sel)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="bench or tune logs holding race lines (LOG:RUN names the run)")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--device", required=True, help="the GPU, or a unique part of its name")
    ap.add_argument("--off", type=float, default=0.03, help="a gap counted as off beyond this (0.03: 3%%)")
    ap.add_argument("--csv", type=Path, help="write every shape's row here")
    a = ap.parse_args(argv)
    from gemmrl.store.db import device_by_part, unpack_if_missing

    unpack_if_missing(a.db)
    db = sqlite3.connect(f"file:{a.db}?mode=ro", uri=True)
    known = [d for (d,) in db.execute("SELECT DISTINCT device FROM runs")]
    try:
        device = device_by_part(a.device, known, "GPUs")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if device not in known:
        raise SystemExit(f"--device {a.device!r} names none of the store's GPUs ({', '.join(known)})")
    rows = []
    for arg in a.logs:
        path, given = Path(arg), None
        m = re.match(r"^(.*):(\d+)$", arg)
        if m and not path.exists():
            path, given = Path(m.group(1)), int(m.group(2))
        if not path.is_file():
            raise SystemExit(f"{path}: no such log")
        run, races = parse_log(path.read_text(errors="replace"))
        run = given if given is not None else run
        if run is None:
            print(f"{path}: no 'run N:' line (name it as {path}:RUN); left out", file=sys.stderr)
            continue
        rows += with_final(races, run, db, device)
    if not rows:
        raise SystemExit("no race line with a final timing in its run")
    print(f"{len(rows)} races with a final timing ({device})")
    print("| slowest contender | races | median final/race | more than {:.0%} apart |".format(a.off))
    print("| --- | --- | --- | --- |")
    for b in bands(rows, a.off):
        med = "" if b["median final/race"] is None else f"{b['median final/race']:.3f}"
        print(f"| {b['slowest contender']} | {b['races']} | {med} | {b[f'more than {a.off:.0%} apart']} |")
    if a.csv:
        a.csv.parent.mkdir(parents=True, exist_ok=True)
        with a.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
