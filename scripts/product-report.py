#!/usr/bin/env python3
"""The product against torch.matmul in one bench run (or one call's lanes): gemmrl.matmul-nn against torch.matmul and
gemmrl.matmul-tn against torch.matmul-tn (`bench --impl pack:DIR`), split by whether the pack
serves the (shape, layout) with a kernel of its own, with a neighbour's kernel (an unseen shape;
known from the run's verification records, which name the entry that served), or it falls back,
per mode. Ratios are taken
within each session by the reports' rule: the paired within-round ratio where a record has it
(kernel protocol v3, server v5), else medians (means in server mode); the repeat of torch.matmul
in the same sessions gives the noise. No GPU needed:

    python3 scripts/product-report.py --run 124 --pack packs/h100-fp16-F32F16F16F32 [--json OUT]
    python3 scripts/product-report.py --run 190,191,192,193 --pack ...   (one call's four lanes)

Pass the pack as it was when the run measured it (for an older run: `git show COMMIT:PATH`)."""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = (("NN", "gemmrl.matmul-nn", "torch.matmul"), ("TN", "gemmrl.matmul-tn", "torch.matmul-tn"))
MODES = ("kernel", "offline", "server")


def served_keys(manifest: dict) -> set:
    return {(e["M"], e["N"], e["K"], e["layout"]) for e in manifest.get("entries", [])}


def _in(runs) -> str:
    return ", ".join("?" * len(runs))


def _pack_records(db: sqlite3.Connection, runs: tuple):
    """(run, (M, N, K, layout), gemmrl.matmul's `impl` details) of each verification in `runs`."""
    for run, M, N, K, impl, details in db.execute(
            f"SELECT run_id, M, N, K, impl, details FROM verifications WHERE run_id IN ({_in(runs)}) "
            "AND impl IN (?, ?)", (*runs, PAIRS[0][1], PAIRS[1][1])):
        yield run, (M, N, K, "TN" if impl == PAIRS[1][1] else "NN"), (json.loads(details or "{}") or {}).get("impl") or {}


def run_served(db: sqlite3.Connection, runs: tuple) -> tuple[dict, set]:
    """(neighbours, failed): the (M, N, K, layout)s gemmrl.matmul served in `runs` with another
    shape's kernel (each mapped to what served it: {'shape', 'spec_name', ...}), and those whose
    pack kernel failed to build or load there (the call fell back), from its verification
    records (runtime.pack_impl's `served`, `exact` and `failures`)."""
    from gemmrl.runtime.pack_impl import served_kernel

    neighbours, failed = {}, set()
    for _run, key, d in _pack_records(db, runs):
        got = served_kernel(d)
        if got is not None:
            if got.get("exact") is False:
                neighbours[key] = got
        elif isinstance(d.get("served"), dict) and d["served"].get("source_sha256"):
            failed.add(key)  # it named a kernel, and served_kernel refused it: that kernel failed
    return neighbours, failed


def run_serving(db: sqlite3.Connection, runs: tuple) -> dict:
    """(run, M, N, K, layout) -> what served gemmrl.matmul in that run, from its verification
    record: ('kernel', sha256) for the pack's own kernel of the shape, ('lt', hex) for the pack's
    cuBLASLt algorithm, ('library', None) for the library's own choice; left out where the record
    cannot say (it predates `served` or `served_lt`, a neighbour's kernel served, or the kernel
    failed there)."""
    from gemmrl.runtime.pack_impl import served_kernel, served_lt

    out = {}
    for run, pair, d in _pack_records(db, runs):
        if "served" not in d:
            continue
        key = (run, *pair)
        got = served_kernel(d)
        if got is not None:
            if got.get("exact") is not False:
                out[key] = ("kernel", got["source_sha256"])
        elif isinstance(d.get("served"), dict) and d["served"].get("source_sha256"):
            continue  # its kernel failed in the run (run_served's `failed`)
        elif "served_lt" in d:
            lt = served_lt(d)
            out[key] = ("lt", lt.lower()) if lt else ("library", None)
    return out


def pack_serving(manifest: dict) -> dict:
    """(M, N, K, layout) -> what the pack serves there: ('kernel', sha256 or None where the entry
    names none) or ('lt', hex); a shape absent from both is the library's ('library', None)."""
    out = {(a["M"], a["N"], a["K"], a["layout"]): ("lt", str(a["algo"]).lower())
           for a in manifest.get("lt_algos") or [] if a.get("algo")}
    out.update({(e["M"], e["N"], e["K"], e["layout"]): ("kernel", e.get("source_sha256"))
                for e in manifest.get("entries", [])})
    return out


def differs(timed: tuple, pack: tuple) -> bool:
    """Whether a session that ran `timed` measured something other than what the pack serves
    (`pack`): a kernel against no kernel, two kernels' sources (where both are known), or two
    cuBLASLt choices. Pure."""
    if (timed[0] == "kernel") != (pack[0] == "kernel"):
        return True
    if timed[0] == "kernel":
        return timed[1] is not None and pack[1] is not None and timed[1] != pack[1]
    return timed != pack


def _timed_and_served(times: dict, timed_by: dict, serving: dict):
    """(session key, (mode, M, N, K, layout), what the session's gemmrl.matmul call ran (None where
    its record cannot say), what the pack serves now, the run) for each such call in `times`."""
    for key, t in times.items():
        mode, _, M, N, K = key
        for layout, ours, _torch in PAIRS:
            if ours in t and len(t[ours]) >= 3:
                run = t[ours][2]
                yield (key, (mode, M, N, K, layout), timed_by.get((run, M, N, K, layout)),
                       serving.get((M, N, K, layout), ("library", None)), run)


def stale_pairs(times: dict, timed_by: dict, serving: dict) -> dict:
    """(mode, M, N, K, layout) -> (what the session timed, what the pack serves) for each pair whose
    session timed gemmrl.matmul serving otherwise than the pack does now (exported again after
    it ran). `times` as sessions() gives it (each impl's run third); `timed_by` run_serving's."""
    return {pair: (got, now) for _, pair, got, now, _ in _timed_and_served(times, timed_by, serving)
            if got is not None and differs(got, now)}


def latest_as_served(times: dict, timed_by: dict, serving: dict) -> tuple[dict, dict]:
    """--latest: for each (mode, shape, layout), the last session that timed gemmrl.matmul as the
    pack serves it now (a record that cannot say counts as such), else the last session of all,
    then stale. Returns (times as sessions() gives them, each session keeping the gemmrl.matmul
    call of the layouts it was picked for, and the libraries' calls; stale as stale_pairs gives
    it). A pair timed in its present serving by an earlier call, then in another serving by a
    later one (a pack exported between two calls), is judged by the earlier. Pure."""
    best: dict = {}
    for key, pair, got, now, run in _timed_and_served(times, timed_by, serving):
        rank = (got is None or not differs(got, now), run)
        if pair not in best or rank >= best[pair][0]:
            best[pair] = (rank, key, (got, now))
    out: dict = {}
    stale = {}
    for pair, ((as_served, _), key, what) in best.items():
        ours = next(o for layout, o, _ in PAIRS if layout == pair[-1])
        kept = out.setdefault(key, {i: v for i, v in times[key].items() if not i.startswith("gemmrl.matmul")})
        kept[ours] = times[key][ours]
        if not as_served:
            stale[pair] = what
    return out, stale


def sessions(db: sqlite3.Connection, runs: tuple, modes: tuple = MODES) -> dict:
    """(mode, session, M, N, K) -> {impl: (time, paired, run)}: medians, means in server mode, the
    record's paired ratios {other: t_other / t_self} where it has them (the reports' rule), and the
    run that timed it (--latest picks among runs: latest_as_served). modes: only these modes'
    sessions."""
    out: dict = defaultdict(dict)
    q = ("SELECT run_id, mode, session, M, N, K, impl, median_us, mean_us, details FROM measurements "
         f"WHERE run_id IN ({_in(runs)}) AND mode IN ({_in(modes)}) AND status='ok' ORDER BY run_id, id")
    for run, mode, session, M, N, K, impl, med, mean, details in db.execute(q, (*runs, *modes)):
        t = mean if mode == "server" else med
        if t and t > 0:
            paired = (json.loads(details or "{}") or {}).get("paired") or {}
            out[(mode, session, M, N, K)][impl] = (t, paired, run)
    return dict(out)


def over(t: dict, a: str, b: str) -> float:
    """b's time over a's in one session: a's paired ratio to b where recorded, else the times'."""
    from gemmrl.bench.stats import paired_over

    return paired_over(t[a][1], b, t[a][0], t[b][0])


def kind_of(key: tuple, served: set, neighbours: set) -> str:
    return "neighbour" if key in neighbours else "served" if key in served else "fallback"


def _what(served: tuple) -> str:
    kind, ident = served
    return {"kernel": f"kernel {str(ident)[:12]}", "lt": f"cuBLASLt algorithm {str(ident)[:16]}"}.get(kind, "the library")


def summarize(times: dict, served: set, neighbours: set = frozenset(), stale: dict | None = None) -> dict:
    """{mode: {'<layout> served'|'<layout> neighbour'|'<layout> fallback': stats, 'noise': stats of
    torch.matmul / its repeat, 'beyond_noise': the (shape, layout) where gemmrl.matmul was slower
    than torch.matmul beyond that session's noise (gemmrl.runtime.pack.slower_beyond_noise),
    'stale': the pairs whose session timed another serving than the pack's (stale_pairs): their
    ratios stay in the stats, as measured, but judge nothing of the pack, so they are listed
    apart, not in beyond_noise}}."""
    from gemmrl.runtime.pack import slower_beyond_noise

    stale = stale or {}
    res: dict = {}
    for mode in MODES:
        per: dict = {}
        beyond, old = [], []
        for (md, _, M, N, K), t in sorted(times.items(), key=lambda kv: kv[0][2:]):
            if md != mode:
                continue
            noise = (abs(1 - over(t, "torch.matmul@repeat", "torch.matmul"))
                     if "torch.matmul" in t and "torch.matmul@repeat" in t else 0.0)
            for layout, ours, torch_impl in PAIRS:
                if ours in t and torch_impl in t:
                    r = over(t, ours, torch_impl)
                    if (mode, M, N, K, layout) in stale:
                        got, now = stale[(mode, M, N, K, layout)]
                        old.append({"shape": f"{M}x{N}x{K}", "layout": layout, "ratio": round(r, 4),
                                    "timed": _what(got), "pack": _what(now)})
                    elif slower_beyond_noise(r, noise, mode):
                        beyond.append({"shape": f"{M}x{N}x{K}", "layout": layout,
                                       "call": kind_of((M, N, K, layout), served, neighbours),
                                       "ratio": round(r, 4), "noise": round(noise, 4)})
        for layout, ours, torch_impl in PAIRS:
            for kind in ("served", "neighbour", "fallback"):
                ratios, diffs, worst = [], [], None
                for (md, _, M, N, K), t in times.items():
                    if md != mode or ours not in t or torch_impl not in t:
                        continue
                    if kind_of((M, N, K, layout), served, neighbours) != kind:
                        continue
                    r = over(t, ours, torch_impl)
                    ratios.append(r)
                    diffs.append(t[ours][0] - t[torch_impl][0])
                    if worst is None or r < worst[0]:
                        worst = (r, f"{M}x{N}x{K}")
                if ratios:
                    per[f"{layout} {kind}"] = {
                        "versus": torch_impl, "shapes": len(ratios),
                        "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                        "min": worst[0], "min_shape": worst[1], "slower_than_0.99": sum(r < 0.99 for r in ratios),
                        "median_diff_us": statistics.median(diffs)}
        rep = [over(t, "torch.matmul@repeat", "torch.matmul") for (md, *_), t in times.items()
               if md == mode and "torch.matmul" in t and "torch.matmul@repeat" in t]
        if per:
            if rep:
                per["noise"] = {"torch.matmul / its repeat, median |1 - r|": statistics.median(abs(1 - r) for r in rep),
                                "max |1 - r|": max(abs(1 - r) for r in rep)}
            per["beyond_noise"] = beyond
            per["stale"] = old
            res[mode] = per
    return res


def neighbour_rows(times: dict, neighbours: dict) -> list[dict]:
    """One row per (mode, shape, layout) a neighbour's kernel served: that shape, its distance
    (runtime.dispatch.distance), the kernel, and torch.matmul's time over gemmrl.matmul's on the
    same layout in the session; by mode, then shape."""
    from gemmrl.runtime.dispatch import distance

    rows = []
    for (mode, _, M, N, K), t in times.items():
        for layout, ours, torch_impl in PAIRS:
            got = neighbours.get((M, N, K, layout))
            if got is None or ours not in t or torch_impl not in t:
                continue
            try:
                near = tuple(int(x) for x in str(got.get("shape")).lower().split("x"))
                dist = round(distance((M, N, K), near), 3) if len(near) == 3 else None
            except ValueError:
                dist = None
            rows.append({"mode": mode, "shape": f"{M}x{N}x{K}", "layout": layout, "neighbour": got.get("shape"),
                         "distance": dist, "kernel": got.get("spec_name"), "us": t[ours][0],
                         "torch_us": t[torch_impl][0], "vs_torch": over(t, ours, torch_impl)})
    order = {m: i for i, m in enumerate(MODES)}
    rows.sort(key=lambda r: (order.get(r["mode"], 99), tuple(int(x) for x in r["shape"].split("x")), r["layout"]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True,
                    help="the store's run id (a bench with --impl pack:DIR), or several, comma-separated: "
                         "one call's lanes (scripts/device-steps.sh), each a share of the shapes, on one GPU model")
    ap.add_argument("--pack", required=True, help="the pack directory (or its manifest.json) that run used; "
                    "DIR@nearest=D as given to bench --impl pack: (recorded, the split is the run's own)")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--latest", action="store_true",
                    help="where several of the runs timed gemmrl.matmul on one shape in one mode, count only the "
                         "last run's session that served each layout as the given pack does (else the last "
                         "session, listed as stale): the grid as the product last ran it (runs of several "
                         "calls, e.g. after a pack was exported again; the served/fallback split is the given "
                         "pack's and each run's verification records')")
    ap.add_argument("--mode", default=",".join(MODES),
                    help="only these modes, comma-separated (default: all three): a grid report of one mode, "
                         "whose runs also timed a few shapes in another")
    ap.add_argument("--stale-shapes", metavar="FILE",
                    help="also write the shapes of the stale pairs here, one a line (timed last with another serving "
                         "than the pack's): what product-settle.py --shapes times again")
    a = ap.parse_args(argv)
    from gemmrl.bench.select import _pack_spec
    from gemmrl.runtime.pack import serving_digest

    modes = tuple(dict.fromkeys(m.strip() for m in a.mode.split(",") if m.strip()))
    if not modes or set(modes) - set(MODES):
        ap.error(f"--mode takes {', '.join(MODES)}, comma-separated: got {a.mode!r}")

    try:
        path, nearest = _pack_spec(f"pack:{a.pack}")  # DIR[@nearest=D], as bench --impl takes it
    except ValueError as e:
        ap.error(str(e))
    mf = Path(path)
    mf = mf / "manifest.json" if mf.is_dir() else mf
    if not mf.is_file():
        ap.error(f"{a.pack}: no manifest.json")
    if not Path(a.db).is_file():
        ap.error(f"{a.db}: no store")
    try:
        runs = tuple(dict.fromkeys(int(x) for x in a.run.split(",") if x.strip()))
    except ValueError:
        ap.error(f"--run takes run ids, comma-separated: got {a.run!r}")
    if not runs:
        ap.error("--run: no run id given")
    db = sqlite3.connect(a.db)
    rows = {}
    for r in runs:
        row = db.execute("SELECT device, provenance FROM runs WHERE id=?", (r,)).fetchone()
        if row is None:
            ap.error(f"run {r} is not in {a.db}")
        rows[r] = row
    devices = {row[0] for row in rows.values()}
    if len(devices) > 1:
        ap.error(f"runs {a.run} timed different GPUs ({', '.join(sorted(devices))}): one report a GPU model")
    # the newest run's provenance (its date is what `gemmrl targets` ranks reports by); the first's date beside it
    row = rows[max(runs)]
    first_date = json.loads(rows[min(runs)][1] or "{}").get("date")
    label = f"run {runs[0]}" if len(runs) == 1 else "runs " + ",".join(map(str, runs))
    # a pack kernel that failed in the run (not built, not loaded) left the call to the fallback
    neighbours, failed = run_served(db, runs)
    manifest = json.loads(mf.read_text())
    timed_by, serving = run_serving(db, runs), pack_serving(manifest)
    timed = sessions(db, runs, modes)
    if a.latest:
        timed, stale = latest_as_served(timed, timed_by, serving)
    else:
        stale = stale_pairs(timed, timed_by, serving)
    res = summarize(timed, served_keys(manifest) - failed, neighbours, stale)
    if not res:
        print(f"{label} timed no gemmrl.matmul beside torch.matmul", file=sys.stderr)
        return 1
    # a slower pair whose kernel or algorithm the export still keeps, with fewer than three sessions
    # of it in that mode: product-settle times it again (gemmrl.runtime.pack.disputed, whole store)
    from gemmrl.runtime.pack import disputed
    from gemmrl.store.db import Store

    store = Store(a.db, readonly=True)
    try:
        disp = set(disputed(store, manifest, rows[max(runs)][0]))
    finally:
        store.close()
    for mode, per in res.items():
        for b in per.get("beyond_noise", []):
            M, N, K = (int(x) for x in b["shape"].split("x"))
            b["disputed"] = (M, N, K, b["layout"], mode) in disp
    prov = json.loads(row[1] or "{}")
    print(f"{label} on {row[0]} (driver {prov.get('driver')}, CUDA {prov.get('cuda')}, torch {prov.get('torch')}, "
          f"commit {prov.get('commit')}, {prov.get('date')}); pack {mf.parent}"
          + (f", neighbours within {nearest:g}" if nearest is not None else ""))
    print("| mode | call | against | shapes | geomean | min (shape) | below 0.99 | median diff us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, per in res.items():
        for k, s in per.items():
            if k not in ("noise", "beyond_noise", "stale"):
                print(f"| {mode} | {k} | {s['versus']} | {s['shapes']} | {s['geomean']:.3f} | {s['min']:.3f} "
                      f"({s['min_shape']}) | {s['slower_than_0.99']} | {s['median_diff_us']:+.2f} |")
        if "noise" in per:
            n = per["noise"]
            print(f"| {mode} | noise | torch.matmul@repeat | | median {list(n.values())[0]:.4f} | max {n['max |1 - r|']:.4f} | | |")
    for mode, per in res.items():
        for b in per.get("beyond_noise", []):
            print(f"{mode}: {b['shape']} {b['layout']} ({b['call']}) at {b['ratio']:.4f} of torch.matmul, "
                  f"slower beyond the noise (torch.matmul within {b['noise']:.2%} of its repeat there)"
                  + ("; disputed: the pack keeps it on fewer than three sessions of it, product-settle.py times "
                     "it again" if b["disputed"] else ""))
    for mode, per in res.items():
        for b in per.get("stale", []):
            print(f"{mode}: {b['shape']} {b['layout']} timed with {b['timed']} (at {b['ratio']:.4f} of torch.matmul); "
                  f"the pack now serves {b['pack']}: not timed as the pack serves it")
    if a.stale_shapes:
        shapes = sorted({(M, N, K) for (_, M, N, K, _) in stale})
        Path(a.stale_shapes).write_text(
            f"# {mf.parent}: shapes timed last ({label}) with another serving than the pack's\n"
            + "".join(f"{M}x{N}x{K}\n" for M, N, K in shapes))
        print(f"{len(shapes)} stale shapes in {a.stale_shapes}")
    nrows = neighbour_rows(timed, neighbours)
    if nrows:
        print("\n| mode | shape | call | neighbour (distance) | its kernel | gemmrl.matmul us | torch.matmul us | ratio |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in nrows:
            print(f"| {r['mode']} | {r['shape']} | {r['layout']} | {r['neighbour']} ({r['distance']}) | `{r['kernel']}` "
                  f"| {r['us']:.2f} | {r['torch_us']:.2f} | {r['vs_torch']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"run": runs[0] if len(runs) == 1 else list(runs), "device": row[0],
                                            "provenance": prov, "first_run_date": first_date,
                                            "pack": str(mf.parent), "pack_digest": serving_digest(manifest),
                                            "nearest": nearest,
                                            "latest": a.latest, "modes": res, "neighbours": nrows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
