#!/usr/bin/env python3
"""Sample efficiency of the search (issue #4): the reward each policy reached against the number of
candidates it timed, per shape, as a fraction of the best reward of an exhaustive sweep of the
same shapes. No GPU needed: it reads the stores of a study made on one. The whole pool is too
large to sweep (per shape and layout about 790 CUTLASS specs and 900 raw ones), so a study sweeps
a fixed built set: the CUTLASS kernels compiled ahead (--built-only; the cost model's top 2 on the
100-shape subset are 122 kernels, its top 1 are 58), for example:

    gemmrl build --shapes subset --top 2 --family cutlass_sm90                # ahead, no GPU
    gemmrl bench --shapes subset --impl baselines --db base.sqlite          # the yardstick, once
    cp base.sqlite sweep.sqlite; cp base.sqlite mf.sqlite                    # one store per policy
    F="--shapes subset --family cutlass_sm90 --built-only --search-only"
    gemmrl tune $F --db sweep.sqlite --policy exhaustive --candidates 10000
    gemmrl tune $F --db mf.sqlite --policy model-free --candidates 16
    python3 scripts/sample-efficiency.py --sweep sweep.sqlite --policy model-free=mf.sqlite --device H200 \\
        --json h200/sample-efficiency.json --csv h200/sample-efficiency.csv --png h200/sample-efficiency.png

(With 122 built kernels the sweep is about 12,000 trials, some 70 GPU-minutes at the search's
0.35 s a candidate; with the 58 of the top 1, about half that.)

Each policy's store must hold its own trials only (a copy of the baseline store before its run),
so every reward is taken over the same baselines. --built-only reads the machine's build cache:
run every policy where the sweep ran, with only the study's kernels built (a machine that holds
more lets a policy time kernels the sweep never did; the script counts those trials and gives the
policy's curve over the sweep's kernels beside its own, and the two sessions' noise from the
kernels both timed). A random order is not run: its expected best
after n candidates follows exactly from the sweep's rewards (drawn without replacement), so the
report shows it beside the policies at no device cost. A policy may time kernels the sweep did not
(the model-free policy's mutations), so its fraction can exceed 1."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from datetime import datetime, timezone
from math import comb
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


PROVENANCE = ("driver", "cuda", "torch", "cublas", "commit", "date")  # of each store's runs, into the JSON


def trials_by_shape(store, device: str) -> dict[tuple, list[tuple[str, float]]]:
    """(M, N, K, dtype, acc) -> (kernel, reward) of the store's trials on `device`, in the order
    they were timed (a failed check counts as 0: it cost a candidate and found nothing)."""
    out: dict[tuple, list[tuple[str, float]]] = {}
    for row in store.trials(device):
        key = (row["M"], row["N"], row["K"], row["dtype"], row["acc"])
        ok = row["status"] == "ok" and row["reward"] is not None and math.isfinite(row["reward"])
        out.setdefault(key, []).append((row["candidate"], max(0.0, float(row["reward"])) if ok else 0.0))
    return out


def rewards_of(trials: dict[tuple, list[tuple[str, float]]]) -> dict[tuple, list[float]]:
    """trials_by_shape's rewards alone, in timing order. Pure."""
    return {k: [r for _, r in v] for k, v in trials.items()}


def within_sweep(sweep: dict[tuple, list[tuple[str, float]]], policy: dict[tuple, list[tuple[str, float]]]
                 ) -> tuple[dict[tuple, list[float]], int]:
    """A policy's rewards on the kernels the sweep timed on the same shape only, in the policy's
    order, and how many of its trials were of other kernels: where the machine that ran the policy
    had more kernels built than the sweep's (a --built-only search reads the build cache), those
    trials stretch the policy past the sweep's set, and its fraction past 1 says little about order.
    Pure."""
    kept, outside = {}, 0
    for key, rows in policy.items():
        names = {n for n, _ in sweep.get(key, [])}
        kept[key] = [r for n, r in rows if n in names]
        outside += sum(n not in names for n, _ in rows)
    return kept, outside


def session_noise(sweep: dict[tuple, list[tuple[str, float]]], policy: dict[tuple, list[tuple[str, float]]]
                  ) -> dict | None:
    """The policy's reward over the sweep's for the same kernel on the same shape (both above 0):
    how far the two sessions' quick timings differ, the noise under every fraction. Pure."""
    ratios = []
    for key, rows in policy.items():
        swept = {n: r for n, r in sweep.get(key, []) if r > 0}
        ratios += [r / swept[n] for n, r in rows if r > 0 and n in swept]
    if not ratios:
        return None
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [ratios[0]] * 9
    return {"pairs": len(ratios), "median": round(statistics.median(ratios), 4),
            "p10": round(q[0], 4), "p90": round(q[-1], 4)}


def best_so_far(rewards: list[float], n_max: int) -> list[float]:
    """The best of the first n rewards for n = 1 .. n_max (after the last, it stays). Pure."""
    out, best = [], 0.0
    for i in range(n_max):
        if i < len(rewards):
            best = max(best, rewards[i])
        out.append(best)
    return out


def random_expected_best(rewards: list[float], n_max: int) -> list[float]:
    """The expected best of n rewards drawn at random without replacement from `rewards` (the
    sweep of a shape: a random order of its pool), for n = 1 .. n_max; exact: the i-th smallest of
    m is the best of n with probability C(i-1, n-1) / C(m, n). Pure."""
    v = sorted(rewards)
    m = len(v)
    out = []
    for n in range(1, n_max + 1):
        if m == 0:
            out.append(0.0)
            continue
        k = min(n, m)
        total = comb(m, k)
        out.append(sum(v[i] * comb(i, k - 1) for i in range(k - 1, m)) / total)
    return out


def to_reach(curve: list[float], target: float) -> int | None:
    """The first n (1-based) at which `curve` reaches `target`; None where it never does. Pure."""
    for i, x in enumerate(curve, 1):
        if x >= target:
            return i
    return None


def study(sweep: dict[tuple, list[float]], policies: dict[str, dict[tuple, list[float]]],
          n_max: int | None = None) -> dict:
    """The sample-efficiency table. `sweep`: each shape's sweep rewards; `policies`: name -> each
    shape's rewards in the order the policy timed them. Shapes: those the sweep found any reward
    above 0 on and every policy tried. Per n: the mean over shapes of best-so-far / sweep best,
    the share of shapes within 1% and 5% of the sweep's best; per policy, the candidates each
    shape took to reach 95% and 99% of it (median; shapes that never did are counted apart).
    Pure."""
    shapes = sorted(k for k, r in sweep.items() if r and max(r) > 0 and all(k in p for p in policies.values()))
    if not shapes:
        raise ValueError("no shape both swept (with a reward above 0) and tried by every policy")
    longest = max(len(p[k]) for p in policies.values() for k in shapes)
    n_max = n_max or longest
    curves: dict[str, dict[tuple, list[float]]] = {
        name: {k: [b / max(sweep[k]) for b in best_so_far(p[k], n_max)] for k in shapes}
        for name, p in policies.items()}
    curves["random (expected)"] = {k: [b / max(sweep[k]) for b in random_expected_best(sweep[k], n_max)]
                                   for k in shapes}
    rows = []
    for name, per in curves.items():
        for n in range(1, n_max + 1):
            fr = [per[k][n - 1] for k in shapes]
            rows.append({"policy": name, "candidates": n, "mean_fraction": round(statistics.fmean(fr), 4),
                         "within_1pct": round(sum(f >= 0.99 for f in fr) / len(fr), 4),
                         "within_5pct": round(sum(f >= 0.95 for f in fr) / len(fr), 4)})
    reach = {}
    for name, per in curves.items():
        got = {}
        for target in (0.95, 0.99):
            ns = [to_reach(per[k], target) for k in shapes]
            hit = [x for x in ns if x is not None]
            got[f"to_{round(target * 100)}pct"] = {"median": statistics.median(hit) if hit else None,
                                                   "shapes_reached": len(hit), "shapes": len(ns)}
        reach[name] = got
    sweep_sizes = [len(sweep[k]) for k in shapes]
    return {"shapes": len(shapes), "n_max": n_max,
            "sweep": {"candidates_mean": round(statistics.fmean(sweep_sizes), 2), "candidates_total": sum(sweep_sizes),
                      "best_reward_geomean": round(math.exp(statistics.fmean(math.log(max(sweep[k])) for k in shapes)), 4)},
            "policies": {name: {"candidates_total": sum(len(p[k]) for k in shapes),
                                "beyond_sweep": sum(max(p[k]) > max(sweep[k]) * 1.0 for k in shapes)}
                         for name, p in policies.items()},
            "reach": reach, "rows": rows}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["policy"] for r in result["rows"]):
        pts = [(r["candidates"], r["mean_fraction"]) for r in result["rows"] if r["policy"] == name]
        ax.plot(*zip(*pts), marker="." if len(pts) < 40 else None, label=name,
                linestyle="--" if name.startswith("random") else "-")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("candidates timed per shape")
    ax.set_ylabel("best so far / the sweep's best (mean of shapes)")
    ax.set_title(f"sample efficiency over {result['shapes']} shapes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", required=True, help="the store of the exhaustive sweep (tune --policy exhaustive)")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=DB",
                    help="a policy's store (its own trials only); repeat for several")
    ap.add_argument("--device", required=True, help="the GPU as the stores name it, or a unique part of it")
    ap.add_argument("--n-max", type=int, help="candidates per shape to report (default: the longest run)")
    ap.add_argument("--csv")
    ap.add_argument("--json")
    ap.add_argument("--png")
    a = ap.parse_args(argv)
    from gemmrl.store.db import Store, device_by_part

    named = {}
    for text in a.policy:
        name, sep, db = text.partition("=")
        if not sep or not name or not db:
            ap.error(f"--policy {text!r}: give NAME=DB")
        named[name] = db
    if not named:
        ap.error("name at least one --policy NAME=DB")
    for db in (a.sweep, *named.values()):
        if not Path(db).exists():
            ap.error(f"no store at {db}")

    def read(db: str):
        store = Store(db, readonly=True)
        try:
            runs = store.runs()
            device = device_by_part(a.device, store.devices() or [r["device"] for r in runs])
            prov = [{k: r["provenance"].get(k) for k in PROVENANCE} | {"run": r["id"], "device": r["device"]}
                    for r in runs if r["device"] == device]
            return device, trials_by_shape(store, device), prov
        finally:
            store.close()

    device, sweep_trials, sweep_prov = read(a.sweep)
    sweep = rewards_of(sweep_trials)
    policies, extra, provenance = {}, {}, {"sweep": sweep_prov}
    for name, db in named.items():
        _, got, provenance[name] = read(db)
        policies[name] = rewards_of(got)
        kept, outside = within_sweep(sweep_trials, got)
        extra[name] = {"outside_sweep_trials": outside, "same_kernel_vs_sweep": session_noise(sweep_trials, got)}
        if outside:  # its order over the sweep's own kernels, beside its curve over the wider set
            policies[f"{name} (sweep's kernels only)"] = kept
    try:
        result = study(sweep, policies, a.n_max)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, more in extra.items():
        result["policies"][name].update(more)
        if more["outside_sweep_trials"]:
            print(f"{name}: {more['outside_sweep_trials']} of {result['policies'][name]['candidates_total']} "
                  f"trials timed kernels the sweep did not (more were built where it ran); its curve over the "
                  f"sweep's kernels only is reported beside it")
        if more["same_kernel_vs_sweep"]:
            n = more["same_kernel_vs_sweep"]
            print(f"{name}: the same kernel on the same shape, its reward over the sweep's: median {n['median']} "
                  f"(p10 {n['p10']}, p90 {n['p90']}; {n['pairs']} pairs): the noise between the two sessions")
    result = {"device": device, "sweep_store": a.sweep, "policy_stores": named,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "provenance": provenance, **result}
    for name, r in result["reach"].items():
        print(f"{name}: 95% of the sweep's best after {r['to_95pct']['median']} candidates (median; "
              f"{r['to_95pct']['shapes_reached']} of {r['to_95pct']['shapes']} shapes reached it), 99% after "
              f"{r['to_99pct']['median']} ({r['to_99pct']['shapes_reached']})")
    print(f"the sweep: {result['sweep']['candidates_mean']} candidates a shape on {result['shapes']} shapes")
    if a.csv:
        Path(a.csv).write_text("policy,candidates,mean_fraction,within_1pct,within_5pct\n" + "".join(
            f"{r['policy']},{r['candidates']},{r['mean_fraction']},{r['within_1pct']},{r['within_5pct']}\n"
            for r in result["rows"]))
    if a.json:
        Path(a.json).write_text(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1) + "\n")
    if a.png:
        _plot(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
