"""The speed targets of the kernel-families issue (#3) and the whole-grid issue (#4), checked
against the report files that `gemmrl report` wrote (no store, no GPU):

    gemmrl targets --device H100            # results/h100/..._F32F16F16F32 reports

Each target is read as the issue words it, against the column it names:
- #3, kernel time against the best cuBLASLt autotuned layout ('cuBLASLt-auto-tuning-max'):
  every shape of 2^36 FLOPs or more at 0.98 or better; 700 TFLOP/s or more on every shape with
  M, N and K all 8192 or more; a median speedup of 1.2 or more on shapes of at most 2^27 FLOPs;
  80% or more of the bandwidth roofline on each skinny memory-bound shape (M or N at most 256,
  K at least 4096, memory-bound by the report's roofline).
- #4: kernel-time geomean 1.10 or more over cuBLASLt autotuned and no size bucket (FLOPs by
  powers of 8) below 1.00; offline mean 1.30 or more and server mean 1.40 or more over cuBLASLt
  autotuned; gemmrl.matmul, fallback included, never slower than torch.matmul beyond the noise
  (scripts/product-report.py's JSONs, the newest for each mode: the (shape, layout) pairs it lists
  as slower beyond their session's noise, gemmrl.runtime.pack.slower_beyond_noise; in an older
  JSON without that list, each group's minimum against 1 less the largest disagreement of
  torch.matmul with its repeat); CUDA-L2's kernels beaten on most shapes in each mode
  where they build; the fp16-accumulator variant reported like the fp32 one (all three modes,
  the whole grid).

The speedup CSVs print ratios to 3 decimals, so a ratio within 0.0005 of a threshold is judged
as printed. Where a report is missing the target is 'no data', never met.
"""

from __future__ import annotations

import csv
import gzip
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from gemmrl.core.problem import bucket_label, size_bucket
from gemmrl.report.export import geomean

LT_AUTO = "cuBLASLt-auto-tuning-max"  # the best of NN and TN, each autotuned
MODES = ("kernel", "offline", "server")
GRID_SHAPES = 1000


@dataclass(frozen=True)
class Target:
    issue: int
    key: str
    text: str  # what the issue asks
    threshold: float
    value: float | None  # the measured statistic the threshold applies to (None: no data)
    met: bool | None  # None: no data
    detail: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "no data" if self.met is None else ("met" if self.met else "not met")


def _mnk(key: str) -> tuple[int, int, int]:
    parts = key.split("_")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not an M_N_K shape key: {key!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def flops(key: str) -> int:
    m, n, k = _mnk(key)
    return 2 * m * n * k


def read_speedups(path: str | Path) -> dict[str, dict[str, float]]:
    """{'M_N_K': {column: ratio}} from a report's speedup CSV (empty cells left out)."""
    out: dict[str, dict[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = row.pop("mnk")
            _mnk(key)
            out[key] = {c: float(v) for c, v in row.items() if v not in ("", None)}
    return out


def read_times(path: str | Path, impl: str) -> dict[str, dict]:
    """{'M_N_K': row} of one implementation from a report's times CSV (.csv or .csv.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out = {}
    with opener(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            if row["impl"] == impl:
                out[row["mnk"]] = row
    return out


def _column(speedups: Mapping[str, Mapping[str, float]], column: str) -> dict[str, float]:
    return {k: v[column] for k, v in speedups.items() if column in v}


def _fmt_shape(key: str) -> str:
    return key.replace("_", "x")


def _worst(values: Mapping[str, float], n: int = 3) -> str:
    return ", ".join(f"{_fmt_shape(k)} {v:.3f}" for k, v in sorted(values.items(), key=lambda kv: kv[1])[:n])


def _no_data(issue: int, key: str, text: str, threshold: float, why: str) -> Target:
    return Target(issue, key, text, threshold, None, None, why)


def kernel_family_targets(kernel: Mapping[str, Mapping[str, float]] | None,
                          subject_times: Mapping[str, Mapping] | None,
                          floor_reaches: Mapping[str, bool] | None = None) -> list[Target]:
    """#3's four speed targets from the kernel-mode speedups and the subject's kernel times.
    floor_reaches: {'M_N_K': whether a kernel doing only the compulsory traffic reaches 80% of the
    roofline there} (scripts/memory-floor.py), for the skinny target's detail: on shapes where even
    that kernel falls short (launch and first-byte latency), 80% is out of any kernel's reach."""
    out = []
    t = "every shape of 2^36 FLOPs or more at 0.98 or more of cuBLASLt autotuned (kernel time)"
    big = {k: r for k, r in _column(kernel or {}, LT_AUTO).items() if flops(k) >= 2 ** 36}
    if not big:
        out.append(_no_data(3, "big-shapes-vs-lt", t, 0.98, "no kernel-mode speedups of such shapes"))
    else:
        below = {k: r for k, r in big.items() if r < 0.98}
        out.append(Target(3, "big-shapes-vs-lt", t, 0.98, min(big.values()), not below,
                          f"{len(big) - len(below)} of {len(big)} at 0.98 or more; lowest: {_worst(big)}",
                          {"shapes": len(big), "below": len(below)}))
    t = "700 TFLOP/s or more at 8192x8192x8192 and above (kernel time)"
    huge = {k: float(r["tflops"]) for k, r in (subject_times or {}).items()
            if min(_mnk(k)) >= 8192 and r.get("tflops")}
    if not huge:
        out.append(_no_data(3, "tflops-8192", t, 700.0, "no kernel times of such shapes"))
    else:
        low = {k: v for k, v in huge.items() if v < 700.0}
        out.append(Target(3, "tflops-8192", t, 700.0, min(huge.values()), not low,
                          f"{len(huge) - len(low)} of {len(huge)} shapes at 700 or more; lowest: "
                          + ", ".join(f"{_fmt_shape(k)} {v:.0f}" for k, v in sorted(huge.items(), key=lambda kv: kv[1])[:3]),
                          {"shapes": len(huge), "below": len(low)}))
    t = "median speedup of 1.2 or more over cuBLASLt autotuned on shapes of at most 2^27 FLOPs (kernel time)"
    small = [r for k, r in _column(kernel or {}, LT_AUTO).items() if flops(k) <= 2 ** 27]
    if not small:
        out.append(_no_data(3, "small-shapes-median", t, 1.2, "no kernel-mode speedups of such shapes"))
    else:
        med = statistics.median(small)
        out.append(Target(3, "small-shapes-median", t, 1.2, med, med >= 1.2,
                          f"{len(small)} shapes; median {med:.3f}", {"shapes": len(small)}))
    t = "80% or more of the bandwidth roofline on skinny memory-bound shapes (M or N <= 256, K >= 4096)"
    skinny = {}
    for k, r in (subject_times or {}).items():
        m, n, kk = _mnk(k)
        if min(m, n) <= 256 and kk >= 4096 and r.get("bound") == "memory" and r.get("roofline_fraction"):
            skinny[k] = float(r["roofline_fraction"])
    if not skinny:
        out.append(_no_data(3, "skinny-roofline", t, 0.8, "no kernel times of skinny memory-bound shapes"))
    else:
        low = {k: v for k, v in skinny.items() if v < 0.8}
        detail = (f"{len(skinny) - len(low)} of {len(skinny)} at 0.8 or more; median "
                  f"{statistics.median(skinny.values()):.3f}; lowest: {_worst(skinny)}")
        extra = {"shapes": len(skinny), "below": len(low)}
        reachable = [k for k in skinny if (floor_reaches or {}).get(k)]
        if floor_reaches:
            ok = sum(skinny[k] >= 0.8 for k in reachable)
            detail += (f"; where a traffic-only kernel reaches 0.8 ({len(reachable)} of those timed by the "
                       f"memory-floor study): {ok} at 0.8 or more")
            extra.update(floor_reachable=len(reachable), floor_reachable_at_target=ok)
        out.append(Target(3, "skinny-roofline", t, 0.8, min(skinny.values()), not low, detail, extra))
    return out


def bucket_geomeans(values: Mapping[str, float]) -> dict[str, tuple[int, float]]:
    """{bucket label: (shapes, geomean)} by FLOPs in powers of 8, smallest first."""
    per: dict[int, list[float]] = {}
    for k, r in values.items():
        per.setdefault(size_bucket(flops(k)), []).append(r)
    return {bucket_label(b): (len(v), geomean(v)) for b, v in sorted(per.items())}


def grid_targets(speedups: Mapping[str, Mapping[str, Mapping[str, float]] | None],
                 product: Mapping | None, cuda_l2: Mapping | None,
                 fp16_modes: Mapping[str, int] | None, fp16_target: bool = True,
                 cuda_l2_written_for: Mapping[str, int] | None = None, gpu: str | None = None,
                 cuda_l2_padded: list | None = None) -> list[Target]:
    """#4's speed targets. speedups: {mode: read_speedups(...) or None}; product: the JSON of
    scripts/product-report.py over the grid (or None); cuda_l2: the 'modes' of the cuda-l2
    versus-gemmrl-tuned summary (or None); fp16_modes: {mode: shapes} the fp16-accumulator
    report covers (or None); fp16_target: False where the reports judged are the
    fp16-accumulator variant's own (the target is about it, not of it); cuda_l2_written_for: the
    versus summary's count of CUDA-L2 kernels per GPU they were written for, said in the detail
    where it is another GPU than `gpu` (their fp16-accumulator kernels exist for the A100 only);
    cuda_l2_padded: the shapes whose CUDA-L2 call padded its inputs inside the timed call."""
    out = []
    kernel = _column(speedups.get("kernel") or {}, LT_AUTO)
    t = "kernel-time geomean speedup of 1.10 or more over cuBLASLt autotuned, over the whole grid"
    buckets_text = "no size bucket (FLOPs by powers of 8) below 1.00 in kernel time"
    if not kernel:
        out.append(_no_data(4, "kernel-geomean", t, 1.10, "no kernel-mode speedups"))
        out.append(_no_data(4, "kernel-buckets", buckets_text, 1.0, "no kernel-mode speedups"))
    else:
        g = geomean(kernel.values())
        out.append(Target(4, "kernel-geomean", t, 1.10, g, g >= 1.10 and len(kernel) >= GRID_SHAPES,
                          f"{len(kernel)} shapes; geomean {g:.3f}", {"shapes": len(kernel)}))
        buckets = bucket_geomeans(kernel)
        low = {b: gm for b, (n, gm) in buckets.items() if gm < 1.0}
        out.append(Target(4, "kernel-buckets", buckets_text, 1.0, min(gm for _, gm in buckets.values()), not low,
                          "; ".join(f"{b}: {gm:.3f} ({n})" for b, (n, gm) in buckets.items()),
                          {"buckets": {b: {"shapes": n, "geomean": gm} for b, (n, gm) in buckets.items()}}))
    for mode, want in (("offline", 1.30), ("server", 1.40)):
        t = f"{mode} mode: mean speedup of {want:.2f} or more over cuBLASLt autotuned"
        vals = _column(speedups.get(mode) or {}, LT_AUTO)
        if not vals:
            out.append(_no_data(4, f"{mode}-mean", t, want, f"no {mode}-mode speedups"))
            continue
        mean = sum(vals.values()) / len(vals)
        torch_vals = list(_column(speedups.get(mode) or {}, "torch.matmul").values())
        extra = f"; over torch.matmul: mean {sum(torch_vals) / len(torch_vals):.3f}" if torch_vals else ""
        out.append(Target(4, f"{mode}-mean", t, want, mean, mean >= want and len(vals) >= GRID_SHAPES,
                          f"{len(vals)} shapes; mean {mean:.3f}{extra}", {"shapes": len(vals)}))
    t = "gemmrl.matmul, fallback included, never slower than torch.matmul beyond the measured noise"
    groups, beyond, judged, stale = {}, {}, {}, {}
    for mode, per in ((product or {}).get("modes") or {}).items():
        if per.get("stale"):  # timed serving otherwise than the pack does now: no verdict on it
            stale[mode] = per["stale"]
        noise = (per.get("noise") or {}).get("max |1 - r|")
        for name, s in per.items():
            if isinstance(s, dict) and "min" in s:
                groups[f"{mode} {name}"] = (s, noise)
        if isinstance(per.get("beyond_noise"), list):  # each session against its own noise
            beyond[mode] = per["beyond_noise"]
            judged[mode] = "each session's noise"
        elif noise is not None:  # an older report: each group's lowest against the largest disagreement
            beyond[mode] = [{"shape": s.get("min_shape"), "layout": name.split()[-2], "ratio": s["min"]}
                            for name, (s, nz) in groups.items() if name.startswith(mode + " ")
                            and s["min"] < 1 - nz]
            judged[mode] = f"the run's largest noise ({noise:.2%})"
    if not groups:
        out.append(_no_data(4, "product-vs-torch", t, 1.0, "no product-vs-torch report"))
    elif set(judged) != {m for m in ((product or {}).get("modes") or {})}:
        out.append(_no_data(4, "product-vs-torch", t, 1.0, "the product report has no torch.matmul repeat (noise)"))
    else:
        shapes = {m: sum(s["shapes"] for g, (s, _) in groups.items() if g.startswith(m + " ")) for m in judged}
        lowest = min(s["min"] for s, _ in groups.values())
        n_beyond = sum(len(v) for v in beyond.values())
        detail = "; ".join(
            f"{m}: {len(beyond[m])} of {shapes[m]} (shape, layout) pairs slower beyond {judged[m]}"
            + ("" if not beyond[m] else " (" + ", ".join(
                f"{b['shape']} {b['layout']} {b['ratio']:.3f}" for b in sorted(beyond[m], key=lambda b: b["ratio"])[:3])
               + ")")
            + ("" if not any(b.get("disputed") for b in beyond[m]) else
               f", {sum(bool(b.get('disputed')) for b in beyond[m])} of them disputed (fewer than three sessions "
               "of what the pack serves there: product-settle.py times them again)") for m in judged)
        changed = [m for m in (product or {}).get("pack_changed") or [] if m in judged]
        if changed:  # the reports judge the pack they measured; the one here serves some pairs otherwise
            detail += (f"; the pack was exported again after the {', '.join(changed)} report"
                       f"{'s' * (len(changed) > 1)}: its changed pairs are not timed yet (pack --against "
                       f"the measured manifest --changed-shapes, then bench --impl pack:DIR)")
        n_stale = sum(len(v) for m, v in stale.items() if m in judged)
        if n_stale:
            first = next(b for m in judged for b in stale.get(m, []))
            detail += (f"; {n_stale} (shape, layout, mode) timed last with another serving than the pack's, "
                       f"not yet timed as it serves them (e.g. {first['shape']} {first['layout']}: timed "
                       f"{first['timed']}, served {first['pack']})")
        out.append(Target(4, "product-vs-torch", t, 1.0, lowest, n_beyond == 0 and not changed and not n_stale,
                          detail, {"modes": {m: {"pairs": shapes[m], "beyond_noise": beyond[m],
                                                 "stale": stale.get(m, [])} for m in judged},
                                   "pack_changed": changed}))
    t = "CUDA-L2's published kernels beaten on most shapes in each mode where they build"
    shares = {m: (s.get("share_slower"), s.get("count", 0)) for m, s in (cuda_l2 or {}).items()
              if s.get("count")}
    if not shares:
        out.append(_no_data(4, "cuda-l2", t, 0.5, "no cuda-l2 versus gemmrl-tuned summary"))
    else:
        worst = min(v for v, _ in shares.values())
        detail = "; ".join(f"{m}: CUDA-L2 slower on {v:.0%} of {n}" for m, (v, n) in shares.items())
        origin = dict(cuda_l2_written_for or {})
        foreign = {g: n for g, n in origin.items() if g != "unknown" and (gpu is None or g != gpu.lower())}
        if foreign:
            detail += ("; their kernels compared here were written for "
                       + ", ".join(f"the {g.upper()} ({n} shapes)" for g, n in sorted(foreign.items()))
                       + (f", not the {gpu.upper()}" if gpu else "")
                       + (f" ({origin['unknown']} more whose records do not say)" if origin.get("unknown") else ""))
        padded = list(cuda_l2_padded or [])
        if padded:  # their harness pads outside the clock; here the copies are timed, as a user pays them
            detail += f"; {len(padded)} of their calls padded the inputs inside the timed call"
        out.append(Target(4, "cuda-l2", t, 0.5, worst, all(v > 0.5 for v, _ in shares.values())
                          and set(shares) >= set(MODES), detail,
                          {"modes": {m: {"share_cuda_l2_slower": v, "shapes": n} for m, (v, n) in shares.items()},
                           "written_for": origin, "padded": padded}))
    t = "the fp16-accumulator variant tuned and reported the same way (the whole grid, all three modes)"
    if not fp16_target:
        pass
    elif not fp16_modes:
        out.append(_no_data(4, "fp16-acc", t, GRID_SHAPES, "no fp16-accumulator report"))
    else:
        least = min(fp16_modes.get(m, 0) for m in MODES)
        out.append(Target(4, "fp16-acc", t, GRID_SHAPES, least, least >= GRID_SHAPES,
                          "; ".join(f"{m}: {fp16_modes.get(m, 0)} shapes" for m in MODES)))
    return out


def _load_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _newest_per_mode(products) -> tuple[dict, dict]:
    """[(path, product-report JSON)] -> ({'modes': {mode: the newest report's}}, {mode: its path}):
    for each mode, the report with the latest provenance date that covers it (of equal dates, the
    later in the list)."""
    best: dict = {}
    for path, doc in products:
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: not a product-vs-torch report")
        date = str((doc.get("provenance") or {}).get("date") or "")
        for mode, per in (doc.get("modes") or {}).items():
            if mode not in best or date >= best[mode][0]:  # a tie: the later file (runs added since)
                best[mode] = (date, path, per)
    return {"modes": {m: v[2] for m, v in best.items()}}, {m: v[1] for m, v in best.items()}


def _pack_drift(doc: Mapping, results_dir: Path) -> bool:
    """Whether the pack a product report measured now serves some (shape, layout) otherwise:
    its manifest (the report's `pack`, from the folder above results_dir, else from the working
    directory) has another serving digest than the report recorded. False where the report
    predates the digest or the pack is not here."""
    want, where = doc.get("pack_digest"), doc.get("pack")
    if not want or not where:
        return False
    from gemmrl.runtime.pack import serving_digest

    for base in (results_dir.resolve().parent, Path(".")):
        mf = base / where / "manifest.json"
        if mf.is_file():
            return serving_digest(json.loads(mf.read_text())) != want
    return False


def evaluate(results_dir: str | Path, gpu: str, subject: str = "gemmrl-tuned",
             precision: str = "F32F16F16F32", product=None) -> dict:
    """Every target of #3 and #4 from the reports under results_dir/gpu; product: the
    product-vs-torch JSONs over the grid (scripts/product-report.py; default: every
    product-vs-torch-grid-*.json there), the newest for each mode."""
    d = Path(results_dir) / gpu
    if not d.is_dir():
        raise FileNotFoundError(f"no reports at {d}")
    stem = f"{subject.replace('.', '_').replace(':', '_')}_{gpu}_{precision}"
    speedups = {m: (read_speedups(d / f"{stem}_speedup_{m}.csv") if (d / f"{stem}_speedup_{m}.csv").is_file()
                    else None) for m in MODES}
    times_path = d / f"{stem}_times_kernel.csv.gz"
    times = read_times(times_path, subject) if times_path.is_file() else None
    summary = _load_json(d / f"{stem}_summary.json")
    if product:
        docs = [(Path(p), _load_json(Path(p))) for p in product]
        missing = [str(p) for p, doc in docs if doc is None]
        if missing:
            raise FileNotFoundError(f"no product report at {', '.join(missing)}")
    else:  # the reports of this precision's pack (the JSON names the pack, whose name holds it)
        docs = [(p, _load_json(p)) for p in sorted(d.glob("product-vs-torch-grid-*.json"))]
        docs = [(p, doc) for p, doc in docs if not isinstance(doc, dict) or precision in str(doc.get("pack", ""))]
    prod, used = _newest_per_mode(docs)
    by_path = {Path(p): doc for p, doc in docs}
    drift = {m: _pack_drift(by_path[Path(p)], Path(results_dir)) for m, p in used.items()}
    prod["pack_changed"] = sorted(m for m, v in drift.items() if v)
    l2 = _load_json(d / f"cuda-l2_{gpu}_{precision}_vs_{subject.replace('.', '_')}_summary.json")
    fp16_prec = "F16F16F16F16" if precision == "F32F16F16F32" else None
    fp16 = _load_json(d / f"{subject.replace('.', '_')}_{gpu}_{fp16_prec}_summary.json") if fp16_prec else None
    fp16_modes = {m: s.get("shapes", 0) for m, s in (fp16 or {}).get("modes", {}).items()} if fp16 else None
    floor = _load_json(d / f"memory-floor-{gpu}-grid.json")
    floor_reaches = None
    if floor:
        floor_reaches = {f"{r['M']}_{r['N']}_{r['K']}": r["roofline_us"] / r["times_us"]["memory-floor"] >= 0.8
                         for r in floor.get("rows", []) if (r.get("times_us") or {}).get("memory-floor")}
    targets = kernel_family_targets(speedups["kernel"], times, floor_reaches) + grid_targets(
        speedups, prod, (l2 or {}).get("modes"), fp16_modes, fp16_target=precision == "F32F16F16F32",
        cuda_l2_written_for=((l2 or {}).get("provenance") or {}).get("cuda_l2_written_for"), gpu=gpu,
        cuda_l2_padded=((l2 or {}).get("provenance") or {}).get("cuda_l2_padded"))
    return {
        "gpu": gpu, "subject": subject, "precision": precision,
        "reports": str(d), "product_reports": {m: str(p) for m, p in used.items()},
        "provenance": {k: (summary or {}).get("provenance", {}).get(k)
                       for k in ("device", "driver", "cuda", "torch", "commit", "date")},
        "protocols": (summary or {}).get("protocols"),
        "run_bias": [b for b in ((summary or {}).get("provenance", {}).get("run_bias") or []) if b.get("report_rows")],
        "slow_library_rows": (summary or {}).get("provenance", {}).get("slow_library_rows"),
        "met": sum(t.met is True for t in targets), "targets": [asdict(t) | {"status": t.status} for t in targets],
    }


def markdown(result: Mapping) -> str:
    """The targets as a markdown table, one row per target."""
    lines = [f"Targets on {result['provenance'].get('device') or result['gpu']} ({result['subject']}, "
             f"{result['precision']}): {result['met']} of {len(result['targets'])} met",
             "", "| issue | target | value | threshold | status | detail |", "| --- | --- | --- | --- | --- | --- |"]
    for t in result["targets"]:
        v = "" if t["value"] is None else (f"{t['value']:.4g}")
        lines.append(f"| #{t['issue']} | {t['text']} | {v} | {t['threshold']:g} | {t['status']} | {t['detail']} |")
    prot = result.get("protocols") or {}
    mixed = {m: p for m, p in prot.items() if isinstance(p, dict) and len(p) > 1}
    if mixed:
        from gemmrl.store.db import protocol_version

        acc = "fp16" if result["precision"].startswith("F16") else "fp32"
        dev = result["gpu"].upper()
        lines += ["", "Mixed measuring protocols: " + "; ".join(
            f"{m}: " + ", ".join(f"{n} {k}" for k, n in p.items()) for m, p in mixed.items())
            + " (the older ones to retime: " + "; ".join(
                f"scripts/stale-shapes.py --device {dev} --acc {acc} --mode {m} --protocol {m}:v{max(protocol_version(k)[1] for k in p)}"
                for m, p in mixed.items()) + ")"]
    shifted = result.get("run_bias") or []
    if shifted:
        rows = sum(b["report_rows"] for b in shifted)
        lines += ["", f"Kernel-mode rows from runs whose ratios read apart from the same kernels' other sessions "
                  f"({rows} rows; scripts/session-bias.py; retime their shapes): " + "; ".join(
                      f"run {b['run']} {b['class']} x{b['median']:.3f} over {b['pairs']} pairs, "
                      f"{b['report_rows']} rows" for b in shifted)]
    slow = result.get("slow_library_rows") or {}
    if slow.get("rows"):
        lines += ["", f"Kernel-mode rows whose latest session ran beside slow library sessions ("
                  f"{sum(slow['rows'].values())} rows: " + ", ".join(f"{k} {n}" for k, n in slow["rows"].items())
                  + f"; runs {slow['runs']}, each with {slow['share']:.0%} or more of its small-shape library sessions"
                  f" slow; scripts/session-bias.py --slow-runs {slow['share']:g} lists them to retime)"]
    return "\n".join(lines) + "\n"

