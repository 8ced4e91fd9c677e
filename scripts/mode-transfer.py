#!/usr/bin/env python3
"""How much of a kernel-time advantage survives the host modes, by size: from one GPU's grid
reports (gemmrl report's speedup CSVs, gemmrl-tuned over each baseline in each mode), the median
per FLOPs bucket (powers of 8) of
  - gemmrl-tuned over cuBLASLt autotuned (the faster layout's; the reports' yardstick),
  - cuBLASLt autotuned over cuBLASLt's heuristic first choice, NN and TN (the library's own
    search, a kernel-time choice too: it is what the pack's fallback runs),
in kernel, offline and server mode, and the median over shapes of each host-mode speedup over
the same shape's kernel-mode one (1.0: the kernel-time advantage carried over whole). No GPU:

    python3 scripts/mode-transfer.py --device H200 [--acc fp32] [--json OUT]

Medians of ratios taken within each mode's own sessions; shapes a mode lacks are left out of
that mode's column."""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemmrl.core.problem import bucket_label, size_bucket  # noqa: E402

MODES = ("kernel", "offline", "server")
PROVENANCE = ("device", "driver", "cuda", "torch", "commit", "date")
PRECISION = {"fp32": "F32F16F16F32", "fp16": "F16F16F16F16"}
# name -> (numerator, denominator) of gemmrl-tuned's speedup columns: A over B = sp[B] / sp[A];
# None as the numerator: gemmrl-tuned itself (its speedup column over B)
PAIRS = {"gemmrl-tuned / cuBLASLt-auto-tuning-max": (None, "cuBLASLt-auto-tuning-max"),
         "cuBLASLt-auto-tuning-nn / cuBLASLt-heuristic-nn": ("cuBLASLt-auto-tuning-nn", "cuBLASLt-heuristic-nn"),
         "cuBLASLt-auto-tuning-tn / cuBLASLt-heuristic-tn": ("cuBLASLt-auto-tuning-tn", "cuBLASLt-heuristic-tn")}


def read(path: Path) -> dict:
    with open(path, newline="") as f:
        return {r["mnk"]: r for r in csv.DictReader(f)}


def ratio(row: dict, pair) -> float | None:
    a, b = pair
    try:
        sb = float(row[b])
        return sb if a is None else sb / float(row[a])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def transfer(reports: dict) -> dict:
    """{mode: {mnk: row}} -> {pair: {bucket label: {mode: median, 'offline/kernel': ..., ...}}}."""
    kernel = reports.get("kernel") or {}
    out: dict = {}
    for name, pair in PAIRS.items():
        per: dict = {}
        for mnk in kernel:
            M, N, K = (int(x) for x in mnk.split("_"))
            b = per.setdefault(size_bucket(2 * M * N * K),
                               {m: [] for m in MODES} | {f"{m}/kernel": [] for m in MODES[1:]})
            rk = ratio(kernel[mnk], pair)
            for mode in MODES:
                r = ratio((reports.get(mode) or {}).get(mnk, {}), pair)
                if r is None:
                    continue
                b[mode].append(r)
                if mode != "kernel" and rk is not None:
                    b[f"{mode}/kernel"].append(r / rk)
        out[name] = {bucket_label(b): {k: (round(statistics.median(v), 4) if v else None) for k, v in cols.items()}
                     | {"shapes": len(cols["kernel"])} for b, cols in sorted(per.items())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", required=True, help="the reports' folder name under --results (H100, H200)")
    ap.add_argument("--acc", default="fp32", choices=sorted(PRECISION))
    ap.add_argument("--results", default="results")
    ap.add_argument("--subject", default="gemmrl-tuned")
    ap.add_argument("--json", help="also write the table here")
    a = ap.parse_args(argv)
    d = Path(a.results) / a.device.lower()
    stem = f"{a.subject}_{a.device.lower()}_{PRECISION[a.acc]}_speedup"
    paths = {m: d / f"{stem}_{m}.csv" for m in MODES}
    if not paths["kernel"].is_file():
        raise SystemExit(f"no kernel-mode report at {paths['kernel']} (gemmrl report --device {a.device})")
    res = transfer({m: read(p) for m, p in paths.items() if p.is_file()})
    for name, rows in res.items():
        print(f"\n{name} (medians; offline/kernel and server/kernel: the same shape's host-mode ratio over its kernel-mode one)")
        print("| FLOPs | shapes | kernel | offline | server | offline/kernel | server/kernel |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label, r in rows.items():
            cells = [r[k] for k in ("kernel", "offline", "server", "offline/kernel", "server/kernel")]
            print(f"| {label} | {r['shapes']} | " + " | ".join("" if c is None else f"{c:.3f}" for c in cells) + " |")
    if a.json:  # the reports' provenance (device, driver, CUDA, torch, commit, date) and this command
        summary = d / f"{a.subject}_{a.device.lower()}_{PRECISION[a.acc]}_summary.json"
        prov = json.loads(summary.read_text()).get("provenance", {}) if summary.is_file() else {}
        Path(a.json).write_text(json.dumps({"device": a.device, "acc": a.acc, "subject": a.subject,
                                            "provenance": {k: prov.get(k) for k in PROVENANCE},
                                            "command": "python3 scripts/mode-transfer.py " + " ".join(
                                                sys.argv[1:] if argv is None else argv),
                                            "reports": {m: str(p) for m, p in paths.items() if p.is_file()},
                                            "pairs": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
