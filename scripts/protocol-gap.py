#!/usr/bin/env python3
"""Why the search's quick kernel timing and the judge's kernel mode disagree on some shapes.

On 258 of the 1,000 fp32 shapes (most of 2^33-2^39 FLOPs) the final kernel-mode time of the
tuned winner is more than 10% above the search's quick timing of the same kernel, while the
baselines it is compared with are timed with the judge's protocol only. This times the winner
and cuBLASLt autotuned (both layouts) on given shapes under several protocols, alternating them
and twice each, and samples the SM clock and power between timings:

    python3 scripts/protocol-gap.py --db results/gemmrl.sqlite --out OUT/protocol-gap.json \
        12288x256x12288:fp32 16384x16384x256:fp16 8192x8192x8192:fp32

Protocols: the search's QUICK (10 rounds at most, 500 us per graph replay), the judge's
KernelSettings() (40 rounds, 2000 us per replay), and the two crossed (QUICK's rounds with 2000
us replays; the judge's rounds with 500 us replays), each once with the winner timed alone and
once beside the baselines. Prints a table; writes every record as JSON.

Kernels that time one way in a race and another beside the baselines (H100 4096x8192xK,
2026-11-27: the 128x144 kernel won its race by 1-2% and then ran 5-11% slower beside the
baselines): name them with --kernel (CUTLASS spec names; repeat), pick the protocols (--protocols,
among them `bench`'s v3: the precision target on paired ratios) and the company they keep
(--companies: alone, with-lt (cuBLASLt autotuned NN and TN), with-all (every baseline `bench
--impl baselines` times)):

    python3 scripts/protocol-gap.py --out OUT/company.json --protocols full,v3 \
        --companies alone,with-lt,with-all --kernel sm90_pp_128x144x64_c2x1_persist_s0_rh_sw1_tn_f16_f32 \
        --kernel sm90_pp_128x160x64_c1x1_persist_s0_rh_sw2_tn_f16_f32 4096x8192x16384:fp32

The host modes as `bench --quick` times them are protocols too (`offline`, `server`: host
clock, fresh inputs, server mode's idle gaps at 1000 QPS), and every record carries the SM clock
and power read every 20 ms while it was timed (`gpu_during`): whether a lead measured in kernel
time shrinks in server mode because the idle gaps let the clock rise (`scripts/mode-transfer.py`,
2026-11-27: 2-4% on the largest shapes, ours and cuBLASLt's autotuned choice alike):

    python3 scripts/protocol-gap.py --out OUT/modes.json --protocols v3,offline,server \
        --companies with-all 8192x8192x8192:fp32 4096x16384x8192:fp32

The same output as a table of clocks and speeds, without a GPU (the SM clock and power median
while each protocol ran; every implementation's speed relative to torch.matmul):

    python3 scripts/protocol-gap.py --report OUT/modes.json --ref torch.matmul --clocks

Each kernel-mode record then also carries its per-round trace: every replay's per-call time with the name of
the replay that ran just before it in the round, to tell an effect of a kernel's neighbour.
Without a GPU, the traces as a table: per timing, each kernel's median within-round time ratio to
a reference kernel and the share of rounds in which it ran more than 5% over it:

    python3 scripts/protocol-gap.py --report OUT/company.json[.gz] --ref 128x160x64_c1x1_persist_s0_rh_sw2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _gpu_state():
    import torch

    out = {}
    for key, fn in (("sm_mhz", "clock_rate"), ("power_mw", "power_draw"), ("temp_c", "temperature")):
        try:
            out[key] = getattr(torch.cuda, fn)()
        except Exception as e:  # pynvml missing: say so once per record
            out[key] = f"n/a ({type(e).__name__})"
    return out


PROTOCOLS = ("quick", "full", "quick-rounds/2000us", "full-rounds/500us", "v3", "offline", "server")
HOST_PROTOCOLS = ("offline", "server")  # bench --quick's host modes (time_host), not kernel timings


def clock_summary(samples: list) -> dict:
    """[(sm_mhz, power_mw)] read while a timing ran -> their count, the SM clock's median, lowest
    and highest, and the median power in watts; samples a reader could not give (not numbers)
    are left out. Pure."""
    import statistics

    mhz = [m for m, _ in samples if isinstance(m, (int, float))]
    mw = [w for _, w in samples if isinstance(w, (int, float))]
    out: dict = {"samples": len(samples)}
    if mhz:
        out |= {"sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz)}
    if mw:
        out["power_w_median"] = round(statistics.median(mw) / 1000, 1)
    return out


class ClockSampler:
    """Reads the SM clock and power every `period_s` on a thread while a timing runs (with ...:),
    so a record says at what clock it ran, not only what the clock was before and after (the
    GPU runs at its power limit in sustained GEMMs, and server mode's idle gaps let its clock
    rise). `read` gives (sm_mhz, power_mw); by default torch.cuda's NVML readings."""

    def __init__(self, period_s: float = 0.02, read=None):
        import threading

        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self._read = read or self._nvml
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _nvml():
        import torch

        return torch.cuda.clock_rate(), torch.cuda.power_draw()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # pynvml missing or the reading failed: no sample
                pass
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def summary(self) -> dict:
        return clock_summary(self.samples)


COMPANIES = ("alone", "with-lt", "with-all")
LT = ("cuBLASLt-auto-tuning-nn", "cuBLASLt-auto-tuning-tn")


def kernel_spec(name: str):
    """The CUTLASS spec a kernel name spells (ValueError if it spells none)."""
    from gemmrl.space.cutlass_sm90 import CutlassSpec

    try:
        spec = CutlassSpec.from_name(name)
    except Exception as e:
        raise ValueError(f"not a CUTLASS kernel name: {name!r} ({e})") from None
    if spec.name != name:
        raise ValueError(f"{name!r} reads as {spec.name!r}: give the kernel's full name")
    return spec


def company_calls(fns: dict, ours: list, company: str) -> dict:
    """The calls one timing gets: our kernels alone, beside cuBLASLt autotuned (both layouts), or
    beside every baseline prepared."""
    if company == "alone":
        keep = set(ours)
    elif company == "with-lt":
        keep = set(ours) | set(LT)
    else:
        keep = set(fns)
    return {nm: fn for nm, fn in fns.items() if nm in keep}


def neighbours(trace: list) -> list:
    """(round, name, per-call us, the name replayed just before it in its round or None) for a
    time_kernel trace, which lists each round's replays in the order they ran."""
    out, last = [], {}
    for rnd, name, us in trace:
        out.append((rnd, name, round(us, 3), last.get(rnd)))
        last[rnd] = name
    return out


def ratio_rows(records: list, ref: str, slow: float = 1.05) -> list[dict]:
    """Per timing (shape, repeat, protocol, company) and implementation: the median of its
    within-round time ratios to the implementation whose name contains `ref`, and the share of
    rounds where that ratio exceeds `slow`; from the records' traces."""
    import statistics

    groups: dict = {}
    for r in records:
        groups.setdefault((r["shape"], r.get("acc", "fp32"), r["repeat"], r["protocol"], r["company"]), []).append(r)
    out = []
    for key, recs in groups.items():
        refs = [r for r in recs if ref in r["impl"]]
        if len(refs) != 1:
            raise ValueError(f"{key}: {len(refs)} implementations match --ref {ref!r}")
        base = {row[0]: row[2] for row in refs[0].get("trace") or []}
        for r in recs:
            if r is refs[0]:
                continue
            ratios = [row[2] / base[row[0]] for row in r.get("trace") or [] if base.get(row[0])]
            if not ratios:
                continue
            out.append({"shape": key[0], "acc": key[1], "repeat": key[2], "protocol": key[3], "company": key[4],
                        "impl": r["impl"], "rounds": len(ratios), "median_ratio": statistics.median(ratios),
                        "share_slow": sum(x > slow for x in ratios) / len(ratios)})
    return out


def clock_rows(records: list, ref: str) -> list[dict]:
    """Per (shape, accumulator, protocol, company): the SM clock and power while its timings ran
    (medians over the repeats of each timing's `gpu_during` medians) and each implementation's
    speed relative to the one whose name contains `ref` (the reference's time over its own; the
    median over the repeats, each repeat's ratio taken within that repeat: medians, means in
    server mode, as the reports take them). Whether a lead measured in kernel time (at the power
    limit's clock) holds where the host modes' gaps let the clock rise. Pure."""
    import statistics

    groups: dict = {}
    for r in records:
        key = (r["shape"], r.get("acc", "fp32"), r["protocol"], r["company"])
        groups.setdefault(key, {}).setdefault(r["repeat"], []).append(r)
    def t(r):  # as the reports take them: the mean in server mode, else the median
        return r.get("mean_us") if r["protocol"] == "server" and r.get("mean_us") else r["median_us"]

    out = []
    for key, repeats in groups.items():
        ratios: dict = {}
        clocks, power = [], []
        for recs in repeats.values():
            refs = [r for r in recs if ref in r["impl"]]
            if len(refs) != 1:
                raise ValueError(f"{key}: {len(refs)} implementations match --ref {ref!r}")
            during = refs[0].get("gpu_during") or {}
            if during.get("sm_mhz_median") is not None:
                clocks.append(during["sm_mhz_median"])
            if during.get("power_w_median") is not None:
                power.append(during["power_w_median"])
            for r in recs:
                if r is not refs[0] and t(r) and t(refs[0]):
                    ratios.setdefault(r["impl"], []).append(t(refs[0]) / t(r))
        out.append({"shape": key[0], "acc": key[1], "protocol": key[2], "company": key[3],
                    "sm_mhz": statistics.median(clocks) if clocks else None,
                    "power_w": statistics.median(power) if power else None, "repeats": len(repeats),
                    "speed": {impl: statistics.median(v) for impl, v in sorted(ratios.items())}})
    return out


def print_clocks(records: list, ref: str) -> None:
    rows = clock_rows(records, ref)
    impls = sorted({i for r in rows for i in r["speed"]})
    print(f"speed relative to {ref} (its time over each one's; median over the repeats) and the SM clock and "
          f"power while timed")
    print("| shape | protocol | company | SM MHz | power W | " + " | ".join(impls) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in impls) + " |")
    for r in rows:
        mhz = "-" if r["sm_mhz"] is None else f"{r['sm_mhz']:.0f}"
        watts = "-" if r["power_w"] is None else f"{r['power_w']:.0f}"
        cells = [f"{r['speed'][i]:.3f}" if i in r["speed"] else "-" for i in impls]
        print(f"| {r['shape']}:{r['acc']} | {r['protocol']} | {r['company']} | {mhz} | {watts} | " + " | ".join(cells) + " |")


def print_report(path: str, ref: str, clocks: bool = False) -> None:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = json.load(f)["records"]
    if clocks:
        print_clocks(records, ref)
        return
    print(f"time over {ref} (median of the within-round ratios); share of rounds more than 5% over it")
    print("| shape | repeat | protocol | company | implementation | rounds | ratio | rounds > 1.05 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ratio_rows(records, ref):
        print(f"| {r['shape']} | {r['repeat']} | {r['protocol']} | {r['company']} | {r['impl']} | {r['rounds']} | "
              f"{r['median_ratio']:.3f} | {r['share_slow']:.0%} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", help="MxNxK:acc (acc fp32 or fp16)")
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    ap.add_argument("--out")
    ap.add_argument("--report", metavar="JSON", help="print the ratio table of an output (no GPU) and exit")
    ap.add_argument("--ref", help="--report: the reference implementation (a part of its name)")
    ap.add_argument("--clocks", action="store_true",
                    help="--report: per shape and protocol, the SM clock and power while timed and each "
                         "implementation's speed relative to --ref (every protocol, the host modes included)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME",
                    help="time this CUTLASS kernel (spec name) instead of the tuned winner; repeat")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS), help=f"comma-separated, of {', '.join(PROTOCOLS)}")
    ap.add_argument("--companies", default="alone,with-lt", help=f"comma-separated, of {', '.join(COMPANIES)}")
    args = ap.parse_args(argv)
    if args.report:
        if not args.ref:
            ap.error("--report needs --ref")
        try:
            print_report(args.report, args.ref, args.clocks)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"{args.report}: {e}")
        return 0
    if not args.out or not args.shapes:
        ap.error("--out and at least one shape are required (or --report JSON --ref NAME)")
    pnames = [x for x in args.protocols.split(",") if x]
    companies = [x for x in args.companies.split(",") if x]
    if bad := [x for x in pnames if x not in PROTOCOLS] + [x for x in companies if x not in COMPANIES]:
        ap.error(f"unknown protocol or company: {', '.join(bad)}")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    try:
        kernels = [kernel_spec(name) for name in args.kernel]
    except ValueError as e:
        ap.error(str(e))

    import torch

    from gemmrl.bench import timing
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.bench.stats import kernel_precision
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    from gemmrl.bench import env

    store = Store(args.db)
    device = torch.cuda.get_device_name()
    prov = env.provenance()  # device, driver, CUDA, torch, commit, date
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    full = timing.KernelSettings()
    protocols = {
        "quick": timing.QUICK,
        "full": full,
        "quick-rounds/2000us": replace(timing.QUICK, target_replay_us=full.target_replay_us),
        "full-rounds/500us": replace(full, target_replay_us=timing.QUICK.target_replay_us),
        "v3": timing.KernelSettings(**kernel_precision(False, None, None)),  # bench's default
    }
    from gemmrl.cli import host_precision  # bench --quick's host modes, as its grid runs time them

    protocols["offline"] = timing.HostSettings(mode="offline", **host_precision("offline", True, None, None))
    protocols["server"] = timing.HostSettings(mode="server", min_rounds=40, qps=1000.0, gaps="round",
                                              **host_precision("server", True, None, None))
    protocols = {k: protocols[k] for k in pnames}
    names = list(LT) + (["baselines"] if "with-all" in companies else [])
    records = []
    for text in args.shapes:
        dims, _, acc = text.partition(":")
        m, n, k = (int(x) for x in dims.lower().split("x"))
        problem = Problem(m, n, k, dtype="fp16", acc=acc or "fp32")
        if kernels:
            from gemmrl.runtime.spec_impl import SpecImpl

            ours = [SpecImpl(spec) for spec in kernels]
        else:
            ours = impls_from_specs(["tuned"], store=store, device=device)
        fns = {}
        for impl in ours + impls_from_specs([",".join(names)], store=store, device=device):
            if impl.name not in fns and impl.supports(problem):
                fns[impl.name] = impl.prepare(problem)
        tuned = [i.name for i in ours if i.name in fns]
        for rep in range(args.repeats):
            for pname, settings in protocols.items():
                for company in companies:
                    calls = company_calls(fns, tuned, company)
                    before = _gpu_state()
                    t0 = time.perf_counter()
                    trace = []
                    with ClockSampler() as clock:
                        if pname in HOST_PROTOCOLS:
                            res = timing.time_host(problem, calls, settings=settings, seed=rep)
                        else:
                            res = timing.time_kernel(problem, calls, l2_bytes=l2, settings=settings, seed=rep,
                                                     trace=trace)
                    rows = neighbours(trace)
                    wall = time.perf_counter() - t0
                    after = _gpu_state()
                    during = clock.summary()
                    for nm, r in res.items():
                        rec = {"shape": dims, "acc": problem.acc, "repeat": rep, "protocol": pname,
                               "company": company, "impl": nm, "median_us": r.get("median_us"),
                               "min_us": r.get("min_us"), "mean_us": r.get("mean_us"), "n": r.get("n"),
                               "calls_per_replay": r.get("details", {}).get("calls_per_replay"),
                               "sets": r.get("details", {}).get("sets"), "wall_s": round(wall, 3),
                               "paired": r.get("details", {}).get("paired"),
                               "gpu_before": before, "gpu_after": after, "gpu_during": during,
                               "trace": [row for row in rows if row[1] == nm]}
                        records.append(rec)
                        print(f"{dims}:{problem.acc} r{rep} {pname:22s} {company:15s} {nm:26s} "
                              f"median {rec['median_us'] or float('nan'):9.2f} us  calls/replay {rec['calls_per_replay']}"
                              f"  clock {during.get('sm_mhz_median', 'n/a')} MHz (median while timed)  "
                              f"power {during.get('power_w_median', 'n/a')} W", flush=True)
        _write(args.out, device, prov, records)  # after every shape: a cut call keeps the rest
    return 0


def _write(out: str, device: str, provenance: dict, records: list) -> None:
    from gemmrl.report.export import write_json  # atomic: a cut call leaves the last whole file

    write_json(out, {"device": device, "torch": provenance.get("torch"), "provenance": provenance,
                     "script": "scripts/protocol-gap.py", "records": records})


if __name__ == "__main__":
    raise SystemExit(main())
