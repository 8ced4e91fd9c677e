#!/usr/bin/env python3
"""Fit the price of the TMA epilogue's wider subtile (spec field epi_n) that the CUTLASS cost
prior (`gemmrl.space.cutlass_sm90.estimate_us`, via `subtile_us`) charges, from the epi races'
logs (no GPU): `gemmrl bench --impl race:1:built:epi` prints, for every shape, each contender's
median time in one session, the winner on the automatic subtile beside its wider twins.

For every (twin, automatic) pair on one shape, the time the twin saves is fitted, by least
squares, as
    EPI_STORE_US * waves * stores saved - EPI_STAGE_US * waves * stages lost - EPI_FIXED_US
(waves of tiles on the GPU, TMA stores a tile, mainloop stages the wider staging buffers take).
Reports the fit on all logs and on the older logs alone tried on the newer, and how much of the
best twins' saving the prior's pick (the twin it rates fastest, where it rates it faster than
the automatic subtile) would have kept, with the constants fitted and with those in the module.

    python3 scripts/epi-price-fit.py results/logs/epi-race-h200-run166-2026-11-26c.log ... \\
        [--holdout-from results/logs/epi-race3-h200-run174-2026-11-26d.log ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

import numpy as np

from gemmrl.core.problem import Problem
from gemmrl.space import cutlass_sm90 as cs

LINE = re.compile(r"^(\d+)x(\d+)x(\d+) candidates \(median us\): (.*)$")


def read_races(paths) -> list:
    """[(path, Problem, [(CutlassSpec, median us)])] for every raced shape with an automatic-
    subtile contender and at least one wider twin of it (other lines and families skipped)."""
    out = []
    for path in paths:
        for line in open(path):
            m = LINE.match(line.strip())
            if not m:
                continue
            M, N, K = map(int, m.groups()[:3])
            cands = []
            for item in m.group(4).split(", "):
                name, _, t = item.rpartition("=")
                try:
                    cands.append((cs.CutlassSpec.from_name(name), float(t)))
                except (ValueError, KeyError):
                    continue  # another family's contender
            if any(s.epi_n == 0 for s, _ in cands) and any(s.epi_n for s, _ in cands):
                out.append((path, Problem(M, N, K), cands))
    return out


def waves(spec, problem) -> int:
    tiles = -(-problem.M // spec.tile_m) * -(-problem.N // spec.tile_n)
    usable = cs.SMS - cs.SMS % (spec.cluster_m * spec.cluster_n)
    return -(-tiles // usable)


def pairs(races) -> list:
    """One row a (wider twin, its automatic-subtile twin) pair: features and the us it saved."""
    rows = []
    for path, problem, cands in races:
        auto = {cs.replace(s, epi_n=0): t for s, t in cands if s.epi_n == 0}
        for s, t in cands:
            base = cs.replace(s, epi_n=0)
            if not s.epi_n or base not in auto:
                continue
            w = waves(s, problem)
            rows.append({"path": path, "shape": problem.shape, "spec": s.name,
                         "stores": w * (cs.epilogue_stores(base) - cs.epilogue_stores(s)),
                         "stages": w * (cs.pipeline_stages(base) - cs.pipeline_stages(s)),
                         "waves": w, "saved_us": auto[base] - t,
                         "module_us": -cs.subtile_us(s, w)})
    return rows


def fit(rows) -> np.ndarray:
    """(store, stage, fixed) prices in us."""
    X = np.array([[r["stores"], -r["stages"], -1.0] for r in rows])
    y = np.array([r["saved_us"] for r in rows])
    return np.linalg.lstsq(X, y, rcond=None)[0]


def predicted(rows, coef) -> list:
    return [coef[0] * r["stores"] - coef[1] * r["stages"] - coef[2] for r in rows]


def picked(rows, pred) -> dict:
    """Per shape: the twin the prices rate fastest, taken only where rated faster than automatic."""
    by = defaultdict(list)
    for r, p in zip(rows, pred):
        by[r["shape"]].append((r["saved_us"], p))
    kept = best = 0.0
    taken = 0
    for v in by.values():
        saved, p = max(v, key=lambda x: x[1])
        if p > 0:
            kept += saved
            taken += 1
        best += max(0.0, max(s for s, _ in v))
    return {"shapes": len(by), "twin_taken": taken, "saved_us": round(kept, 1), "best_us": round(best, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="race logs (gemmrl bench --impl race:1:built:epi)")
    ap.add_argument("--holdout-from", nargs="*", default=[],
                    help="further race logs: fitted with the others, and also used to test a fit of those alone")
    ap.add_argument("--json", help="write the fits and picks here")
    a = ap.parse_args(argv)
    train = pairs(read_races(a.logs))
    test = pairs(read_races(a.holdout_from))
    if not train:
        print("no epi race lines in the logs given", file=sys.stderr)
        return 1
    every = train + test
    coef = fit(every)
    report = {"pairs": len(every), "shapes": len({r["shape"] for r in every}),
              "fit": dict(zip(("store_us", "stage_us", "fixed_us"), map(float, np.round(coef, 4)))),
              "pick_fit": picked(every, predicted(every, coef)),
              "module": {"store_us": cs.EPI_STORE_US, "stage_us": cs.EPI_STAGE_US, "fixed_us": cs.EPI_FIXED_US},
              "pick_module": picked(every, [r["module_us"] for r in every])}
    if test:
        c = fit(train)
        report["holdout"] = {"fit_on_first": dict(zip(("store_us", "stage_us", "fixed_us"), map(float, np.round(c, 4)))),
                             "pick_first": picked(train, predicted(train, c)),
                             "pick_holdout": picked(test, predicted(test, c))}
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
