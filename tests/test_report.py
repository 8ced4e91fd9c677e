"""Report stage: speedup tables, times and roofline, summary statistics, files written."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
from PIL import Image

from gemmrl.report.export import (
    ReportError,
    atomic_write,
    geomean,
    speedup_rows,
    split_records,
    summarize,
    table_csv,
    times_rows,
    versus_rows,
    write_results,
)

DEVICE = "NVIDIA H100 80GB HBM3"
PEAKS = {"matrix_tflops": 800.0, "bandwidth_gbs": 3000.0}
PROVENANCE = {"device": DEVICE, "driver": "570.86", "cuda": "12.8", "torch": "2.9.0",
              "commit": "abc123", "date": "2026-11-21"}
PREFIX = "gemmrl_h100_F32F16F16F32"
CUDA_L2_HEADER = ("mnk,torch.matmul,cuBLAS-tn,cuBLAS-nn,cuBLAS-max,cuBLASLt-heuristic-tn,"
                  "cuBLASLt-heuristic-nn,cuBLASLt-heuristic-max,cuBLASLt-auto-tuning-tn,"
                  "cuBLASLt-auto-tuning-nn,cuBLASLt-auto-tuning-max")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rec(M, N, K, impl, mode, median, **kw):
    r = {"M": M, "N": N, "K": K, "dtype": "fp16", "acc": "fp32", "impl": impl, "mode": mode,
         "median_us": median, "mean_us": median * 1.02, "min_us": median * 0.97,
         "p90_us": median * 1.05, "n": 100, "device": DEVICE}
    r.update(kw)
    return r


def offline_records():
    """Four shapes. 64_64_64 reproduces CUDA-L2's first H100 offline row. 1024^3 has no subject
    time; 4096^3 lacks cuBLAS-nn."""
    out = []
    A = (64, 64, 64)
    for impl, t in [("gemmrl", 10.0), ("torch.matmul", 18.37), ("cuBLAS-tn", 18.59),
                    ("cuBLAS-nn", 18.87), ("cuBLASLt-heuristic-tn", 17.55),
                    ("cuBLASLt-heuristic-nn", 16.81), ("cuBLASLt-auto-tuning-tn", 12.90),
                    ("cuBLASLt-auto-tuning-nn", 12.83), ("gemmrl@repeat", 10.1)]:
        out.append(rec(*A, impl, "offline", t))
    B = (128, 256, 512)
    for impl, t in [("gemmrl", 20.0), ("torch.matmul", 20.0), ("cuBLAS-tn", 40.0),
                    ("cuBLAS-nn", 30.0), ("cuBLASLt-heuristic-tn", 25.0),
                    ("cuBLASLt-heuristic-nn", 26.0), ("cuBLASLt-auto-tuning-tn", 10.0),
                    ("cuBLASLt-auto-tuning-nn", 12.0), ("gemmrl@repeat", 19.0)]:
        out.append(rec(*B, impl, "offline", t))
    C = (1024, 1024, 1024)
    for impl, t in [("torch.matmul", 30.0), ("cuBLAS-tn", 31.0), ("cuBLAS-nn", 32.0),
                    ("cuBLASLt-heuristic-tn", 33.0), ("cuBLASLt-heuristic-nn", 34.0),
                    ("cuBLASLt-auto-tuning-tn", 29.0), ("cuBLASLt-auto-tuning-nn", 28.0)]:
        out.append(rec(*C, impl, "offline", t))
    D = (4096, 4096, 4096)
    for impl, t in [("gemmrl", 250.0), ("torch.matmul", 1000.0), ("cuBLAS-tn", 1000.0),
                    ("cuBLASLt-heuristic-tn", 500.0), ("cuBLASLt-heuristic-nn", 500.0),
                    ("cuBLASLt-auto-tuning-tn", 250.0), ("cuBLASLt-auto-tuning-nn", 275.0)]:
        out.append(rec(*D, impl, "offline", t))
    return out


def server_records():
    """Two shapes, torch.matmul and cuBLAS only: torch.matmul speedups are exactly 1 and 4."""
    return [
        rec(64, 64, 64, "gemmrl", "server", 10.0),
        rec(64, 64, 64, "torch.matmul", "server", 10.0),
        rec(64, 64, 64, "cuBLAS-tn", "server", 5.0),
        rec(64, 64, 64, "cuBLAS-nn", "server", 6.0),
        rec(4096, 4096, 4096, "gemmrl", "server", 250.0),
        rec(4096, 4096, 4096, "torch.matmul", "server", 1000.0),
        rec(4096, 4096, 4096, "cuBLAS-tn", "server", 750.0),
        rec(4096, 4096, 4096, "cuBLAS-nn", "server", 500.0),
    ]


def all_records(seed=0):
    records = offline_records() + server_records()
    random.Random(seed).shuffle(records)  # the store's order must not matter
    return records


def by_mnk(columns, rows):
    return {row[0]: dict(zip(columns, row)) for row in rows}


# ----------------------------------------------------------------------------- speedup rows


def test_header_matches_cuda_l2_order_then_best_baseline():
    columns, _ = speedup_rows(all_records(), "gemmrl", "offline")
    assert ",".join(columns) == CUDA_L2_HEADER + ",best-baseline"


def test_columns_follow_the_baselines_present_in_the_mode():
    columns, _ = speedup_rows(all_records(), "gemmrl", "server")
    assert columns == ["mnk", "torch.matmul", "cuBLAS-tn", "cuBLAS-nn", "cuBLAS-max",
                       "best-baseline"]


def test_exhaustive_and_torch_compile_columns_when_present():
    records = offline_records() + [
        rec(64, 64, 64, "cuBLASLt-exhaustive-tn", "offline", 12.0),
        rec(64, 64, 64, "cuBLASLt-exhaustive-nn", "offline", 11.0),
        rec(64, 64, 64, "torch.compile", "offline", 40.0),
    ]
    columns, rows = speedup_rows(records, "gemmrl", "offline")
    assert columns[-6:] == ["cuBLASLt-exhaustive-tn", "cuBLASLt-exhaustive-nn",
                            "cuBLASLt-exhaustive-max", "torch.compile", "best-baseline",
                            "best-baseline-all"]
    a = by_mnk(columns, rows)["64_64_64"]
    assert a["cuBLASLt-exhaustive-max"] == pytest.approx(1.1)
    assert a["torch.compile"] == pytest.approx(4.0)
    assert a["best-baseline"] == pytest.approx(1.283)  # the core baselines: auto-tuning-nn
    assert a["best-baseline-all"] == pytest.approx(1.1)  # exhaustive-nn is the fastest of all
    # shapes without the optional timings keep best-baseline and get no best-baseline-all
    b = by_mnk(columns, rows)["128_256_512"]
    assert b["cuBLASLt-exhaustive-max"] is None and b["best-baseline-all"] is None
    assert b["best-baseline"] == pytest.approx(0.5)


def test_exact_speedups_and_max_picks_the_faster_layout():
    columns, rows = speedup_rows(all_records(), "gemmrl", "offline")
    a = by_mnk(columns, rows)["64_64_64"]
    expected = {"torch.matmul": 1.837, "cuBLAS-tn": 1.859, "cuBLAS-nn": 1.887, "cuBLAS-max": 1.859,
                "cuBLASLt-heuristic-tn": 1.755, "cuBLASLt-heuristic-nn": 1.681,
                "cuBLASLt-heuristic-max": 1.681, "cuBLASLt-auto-tuning-tn": 1.290,
                "cuBLASLt-auto-tuning-nn": 1.283, "cuBLASLt-auto-tuning-max": 1.283,
                "best-baseline": 1.283}
    for col, value in expected.items():
        assert a[col] == pytest.approx(value, abs=1e-9), col
    b = by_mnk(columns, rows)["128_256_512"]
    # cuBLAS-nn (30us) is faster than -tn (40us): -max is 30/20 = 1.5, not 40/20 = 2.0
    assert b["cuBLAS-tn"] == pytest.approx(2.0)
    assert b["cuBLAS-max"] == pytest.approx(1.5)
    assert b["cuBLASLt-heuristic-max"] == pytest.approx(1.25)
    assert b["cuBLASLt-auto-tuning-max"] == pytest.approx(0.5)
    assert b["best-baseline"] == pytest.approx(0.5)


def test_rows_in_m_major_numeric_order():
    _, rows = speedup_rows(all_records(seed=3), "gemmrl", "offline")
    assert [r[0] for r in rows] == ["64_64_64", "128_256_512", "1024_1024_1024", "4096_4096_4096"]


def test_missing_subject_or_baseline_gives_empty_cells():
    columns, rows = speedup_rows(all_records(), "gemmrl", "offline")
    table = by_mnk(columns, rows)
    # no subject time for 1024^3: every cell empty
    assert all(v is None for k, v in table["1024_1024_1024"].items() if k != "mnk")
    d = table["4096_4096_4096"]
    assert d["cuBLAS-tn"] == pytest.approx(4.0)
    assert d["cuBLAS-nn"] is None
    assert d["cuBLAS-max"] is None      # one layout missing: no "max" over a partial family
    assert d["best-baseline"] is None   # a missing baseline must not inflate the speedup
    assert d["cuBLASLt-auto-tuning-max"] == pytest.approx(1.0)
    text = table_csv(columns, rows).splitlines()
    assert text[3] == "1024_1024_1024" + "," * (len(columns) - 1)
    assert text[4] == "4096_4096_4096,4.000,4.000,,,2.000,2.000,2.000,1.000,1.100,1.000,"


def test_repeat_timings_are_not_baselines_or_columns():
    records = offline_records() + [rec(64, 64, 64, "cuBLAS-tn@repeat", "offline", 5.0)]
    columns, rows = speedup_rows(records, "gemmrl", "offline")
    assert not any("@repeat" in c for c in columns)
    assert by_mnk(columns, rows)["64_64_64"]["best-baseline"] == pytest.approx(1.283)


def test_csv_writes_three_decimals_like_cuda_l2():
    columns, rows = speedup_rows(all_records(), "gemmrl", "offline")
    lines = table_csv(columns, rows).splitlines()
    assert lines[0] == CUDA_L2_HEADER + ",best-baseline"
    assert lines[1] == "64_64_64,1.837,1.859,1.887,1.859,1.755,1.681,1.681,1.290,1.283,1.283,1.283"


def test_bad_input_is_rejected():
    dup = offline_records() + [rec(64, 64, 64, "gemmrl", "offline", 9.0)]
    with pytest.raises(ReportError, match="both time gemmrl"):
        speedup_rows(dup, "gemmrl", "offline")
    mixed = offline_records() + [rec(64, 64, 64, "gemmrl", "offline", 9.0, dtype="bf16")]
    with pytest.raises(ReportError, match="mix precisions"):
        speedup_rows(mixed, "gemmrl", "offline")
    with pytest.raises(ReportError, match="median_us"):
        speedup_rows([rec(64, 64, 64, "gemmrl", "offline", 0.0)], "gemmrl", "offline")
    groups = split_records(mixed)
    assert sorted(k[1] for k in groups) == ["F32BF16BF16F32", "F32F16F16F32"]


# ----------------------------------------------------------------------------- times


def test_times_rows_tflops_and_roofline():
    columns, rows = times_rows(all_records(), "offline", PEAKS)
    assert columns == ["mnk", "M", "N", "K", "impl", "median_us", "mean_us", "p90_us", "n",
                       "tflops", "roofline_fraction", "bound"]
    table = {(r[0], r[4]): dict(zip(columns, r)) for r in rows}
    assert len(rows) == 9 + 9 + 7 + 7
    d = table[("4096_4096_4096", "gemmrl")]
    flops = 2 * 4096 ** 3
    assert d["tflops"] == pytest.approx(flops / 250e-6 / 1e12)            # 549.76
    assert d["tflops"] == pytest.approx(549.755813888)
    # compute floor 2*4096^3 / 800e12 = 171.80 us vs memory floor 6*4096^2 / 3e12 = 33.55 us
    assert d["roofline_fraction"] == pytest.approx(171.798691840 / 250.0)
    assert d["bound"] == "compute"
    a = table[("64_64_64", "gemmrl")]
    # memory floor 6*64^2 bytes / 3e12 = 8.192 ns beats compute 2*64^3 / 800e12 = 0.655 ns
    assert a["roofline_fraction"] == pytest.approx(8.192e-9 / 10e-6)
    assert a["bound"] == "memory"
    assert a["tflops"] == pytest.approx(0.0524288)
    assert a["n"] == 100 and a["median_us"] == 10.0
    # baselines first in CUDA-L2 order, candidates after, the repeat right after its impl
    assert [r[4] for r in rows if r[0] == "64_64_64"][-2:] == ["gemmrl", "gemmrl@repeat"]
    assert [r[4] for r in rows if r[0] == "64_64_64"][0] == "torch.matmul"


def test_times_rows_without_peaks_leave_roofline_empty():
    columns, rows = times_rows(all_records(), "server", None)
    assert len(rows) == 8
    assert all(r[columns.index("roofline_fraction")] is None for r in rows)
    assert all(r[columns.index("bound")] is None for r in rows)
    assert all(r[columns.index("tflops")] > 0 for r in rows)
    assert table_csv(columns, rows).splitlines()[1].endswith(",,")


def test_server_reports_compare_paired_ratios_where_recorded_else_means():
    def srv(impl, median, mean, paired=None):
        details = {"qps": 1000.0, "gaps": "round"} | ({"paired": paired} if paired is not None else {})
        return rec(64, 64, 64, impl, "server", median, mean_us=mean, details=details)

    # the paired ratio says torch.matmul takes 1.5x gemmrl's time in the same rounds; the means
    # would say 1.0, the medians 2.0
    records = [srv("gemmrl", 5.0, 10.0, {"torch.matmul": 1.5, "gemmrl@repeat": 1.01}),
               srv("torch.matmul", 10.0, 10.0, {"gemmrl": 1 / 1.5}),
               srv("gemmrl@repeat", 5.0, 12.0, {"gemmrl": 1 / 1.01})]
    columns, rows = speedup_rows(records, "gemmrl", "server")
    assert rows[0][columns.index("torch.matmul")] == pytest.approx(1.5)
    assert versus_rows(records, "gemmrl", "torch.matmul")[1][0][1] == pytest.approx(1.5)
    # the noise check of a repeat uses the pair too (the means differ by 20%)
    noise = summarize(records, "gemmrl", PEAKS)["noise"]["server"]["gemmrl"]
    assert noise["median"] == pytest.approx(0.01)
    # the times shown stay the means
    columns, rows = times_rows(records, "server", None)
    assert sorted(r[columns.index("mean_us")] for r in rows) == [10.0, 10.0, 12.0]
    # without a pair (records before protocol v5, or a baseline not timed beside it) the means
    records = [srv("gemmrl", 5.0, 10.0, {"cuBLAS-tn": 0.5}), srv("torch.matmul", 10.0, 15.0)]
    columns, rows = speedup_rows(records, "gemmrl", "server")
    assert rows[0][columns.index("torch.matmul")] == pytest.approx(1.5)
    # a bad ratio is not used
    records = [srv("gemmrl", 5.0, 10.0, {"torch.matmul": float("nan")}), srv("torch.matmul", 10.0, 15.0)]
    columns, rows = speedup_rows(records, "gemmrl", "server")
    assert rows[0][columns.index("torch.matmul")] == pytest.approx(1.5)
    # offline mode compares medians whatever the details hold
    records = [rec(64, 64, 64, "gemmrl", "offline", 5.0, details={"paired": {"torch.matmul": 9.0}}),
               rec(64, 64, 64, "torch.matmul", "offline", 10.0)]
    columns, rows = speedup_rows(records, "gemmrl", "offline")
    assert rows[0][columns.index("torch.matmul")] == pytest.approx(2.0)


def test_kernel_reports_compare_paired_ratios_where_recorded_else_medians():
    # kernel protocol v3: the clock a round's replays share divides out of the paired ratio
    records = [rec(64, 64, 64, "gemmrl", "kernel", 5.0, details={"paired": {"torch.matmul": 1.8,
                                                                             "torch.matmul@repeat": 1.79}}),
               rec(64, 64, 64, "torch.matmul", "kernel", 10.0, details={"paired": {"gemmrl": 1 / 1.8,
                                                                                   "torch.matmul@repeat": 1.004}}),
               rec(64, 64, 64, "torch.matmul@repeat", "kernel", 10.5, details={"paired": {"torch.matmul": 1 / 1.004}}),
               rec(64, 64, 64, "cuBLAS-nn", "kernel", 8.0)]  # timed without pairs (v1): the medians
    columns, rows = speedup_rows(records, "gemmrl", "kernel")
    assert rows[0][columns.index("torch.matmul")] == pytest.approx(1.8)
    assert rows[0][columns.index("cuBLAS-nn")] == pytest.approx(8.0 / 5.0)
    # the repeat's noise by its pair (0.4%), not by the medians (5%)
    noise = summarize(records, "gemmrl", PEAKS)["noise"]["kernel"]["torch.matmul"]
    assert noise["median"] == pytest.approx(0.004)


# ----------------------------------------------------------------------------- summary


def test_geomean_of_one_and_four_is_two():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ReportError):
        geomean([])


def test_summary_stats_share_slower_and_buckets():
    s = summarize(all_records(), "gemmrl", PEAKS)
    tm = s["modes"]["server"]["columns"]["torch.matmul"]
    assert tm["count"] == 2
    assert tm["geomean"] == pytest.approx(2.0)
    assert tm["mean"] == pytest.approx(2.5)
    assert tm["median"] == pytest.approx(2.5)
    assert (tm["min"], tm["max"]) == (pytest.approx(1.0), pytest.approx(4.0))
    assert tm["share_slower"] == 0.0
    cm = s["modes"]["server"]["columns"]["cuBLAS-max"]
    assert [cm["min"], cm["max"]] == [pytest.approx(0.5), pytest.approx(2.0)]
    assert cm["share_slower"] == 0.5
    # buckets by powers of 8: 2*64^3 = 2^19, 2*128*256*512 = 2^25, 2*4096^3 = 2^37
    assert list(tm["buckets"]) == ["2^18-2^21", "2^36-2^39"]
    assert tm["buckets"]["2^36-2^39"]["bucket"] == 12
    assert tm["buckets"]["2^36-2^39"]["geomean"] == pytest.approx(4.0)
    best = s["modes"]["offline"]["columns"]["best-baseline"]
    assert best["count"] == 2  # 1024^3 has no subject, 4096^3 lacks cuBLAS-nn
    assert best["share_slower"] == 0.5
    assert best["geomean"] == pytest.approx(math.sqrt(1.283 * 0.5))
    assert list(best["buckets"]) == ["2^18-2^21", "2^24-2^27"]
    assert best["buckets"]["2^24-2^27"]["min"] == pytest.approx(0.5)
    assert s["modes"]["offline"]["shapes"] == 3
    assert list(s["modes"]) == ["offline", "server"]


def test_summary_noise_from_repeats():
    s = summarize(all_records(), "gemmrl")
    noise = s["noise"]["offline"]["gemmrl"]
    # |10.1/10 - 1| = 0.01 and |19/20 - 1| = 0.05
    assert noise["count"] == 2
    assert noise["median"] == pytest.approx(0.03)
    assert noise["p90"] == pytest.approx(0.046)
    assert noise["max"] == pytest.approx(0.05)
    assert noise["share_within_2pct"] == 0.5
    assert "server" not in s["noise"]
    assert "roofline" not in s


def test_summary_counts_host_sessions_that_stopped_before_their_precision_target():
    def with_ci(r, reached):
        return {**r, "details": {"target_ci": 0.005, "ci_reached": reached}}

    records = [with_ci(rec(64, 64, 64, "gemmrl", "offline", 10.0), True),
               with_ci(rec(64, 64, 64, "torch.matmul", "offline", 11.0), True),
               with_ci(rec(128, 64, 64, "gemmrl", "offline", 10.0), True),
               with_ci(rec(128, 64, 64, "torch.matmul", "offline", 11.0), False),
               rec(256, 64, 64, "gemmrl", "offline", 10.0),  # --quick: no target, not counted
               with_ci(rec(64, 64, 64, "gemmrl", "server", 30.0), False)]
    s = summarize(records, "gemmrl")
    assert s["precision"] == {
        "offline": {"shapes_with_target": 2, "target_not_reached": 1, "not_reached": ["128_64_64"]},
        "server": {"shapes_with_target": 1, "target_not_reached": 1, "not_reached": ["64_64_64"]}}
    assert "precision" not in summarize(all_records(), "gemmrl")


def test_summary_counts_the_subjects_shapes_per_measuring_protocol():
    """A mode whose shapes come from sessions of different protocols mixes yardsticks: the
    summary says how many of the subject's shapes each protocol timed (baselines not counted)."""
    records = [rec(64, 64, 64, "gemmrl", "offline", 10.0, protocol="offline:v2"),
               rec(128, 64, 64, "gemmrl", "offline", 10.0, protocol="offline:v3:ci=0.005"),
               rec(256, 64, 64, "gemmrl", "offline", 10.0, protocol="offline:v3:ci=0.005"),
               rec(256, 64, 64, "torch.matmul", "offline", 11.0, protocol="offline:v1"),
               rec(64, 64, 64, "gemmrl", "kernel", 3.0, protocol="kernel:v3:ci=0.005"),
               rec(128, 64, 64, "gemmrl", "kernel", 3.0)]  # no protocol named: not counted
    s = summarize(records, "gemmrl")
    assert s["protocols"] == {"kernel": {"kernel:v3:ci=0.005": 1},
                              "offline": {"offline:v2": 1, "offline:v3:ci=0.005": 2}}
    assert "protocols" not in summarize(all_records(), "gemmrl")  # records without one
    assert "protocols" not in summarize(records, None)


def test_summary_roofline_flags_times_beyond_the_floor():
    records = offline_records() + [rec(2048, 2048, 2048, "gemmrl", "offline", 1.0)]
    s = summarize(records, "gemmrl", PEAKS)
    r = s["roofline"]["offline"]["gemmrl"]
    assert r["beyond_floor"] == ["2048_2048_2048"]
    assert r["max_fraction"] > 1.0
    assert s["roofline"]["offline"]["torch.matmul"]["beyond_floor"] == []


def test_summary_is_strict_json_without_nan():
    records = all_records() + [rec(256, 256, 256, "gemmrl", "kernel", 5.0, mean_us=float("nan"))]
    s = summarize(records, "gemmrl", PEAKS)
    text = json.dumps(s, allow_nan=False)  # raises on NaN or inf
    assert s["modes"]["kernel"]["columns"] == {}  # no baselines in kernel mode: no columns
    assert json.loads(text)["subject"] == "gemmrl"


# ----------------------------------------------------------------------------- files


def _tmp_leftovers(folder):
    return [n for n in os.listdir(folder) if n.startswith(".") or n.endswith(".tmp")]


def test_write_results_files_csvs_json_and_pngs(tmp_path):
    paths = write_results(all_records(), tmp_path, "gemmrl", PEAKS, PROVENANCE, PREFIX)
    names = sorted(p.name for p in paths)
    assert names == sorted([
        f"{PREFIX}_speedup_offline.csv", f"{PREFIX}_speedup_server.csv",
        f"{PREFIX}_times_offline.csv.gz", f"{PREFIX}_times_server.csv.gz", f"{PREFIX}_summary.json",
        f"{PREFIX}_speedup_vs_flops.png", f"{PREFIX}_speedup_distribution.png",
        f"{PREFIX}_tflops.png"])
    assert sorted(os.listdir(tmp_path)) == names
    assert _tmp_leftovers(tmp_path) == []
    for p in paths:
        assert p.parent == tmp_path and p.stat().st_size > 0
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data[:8] == PNG_SIGNATURE
            assert len(data) > 2000
            with Image.open(p) as im:  # palette-coded (the committed reports' size), and not blank
                assert im.mode == "P" and len(im.convert("RGB").getcolors(1 << 16) or ()) > 3
    head = (tmp_path / f"{PREFIX}_speedup_offline.csv").read_text().splitlines()[0]
    assert head == CUDA_L2_HEADER + ",best-baseline"

    def no_nan(token):
        raise AssertionError(f"non-JSON constant {token}")

    summary = json.loads((tmp_path / f"{PREFIX}_summary.json").read_text(), parse_constant=no_nan)
    assert summary["provenance"]["commit"] == "abc123"
    assert summary["peaks"] == PEAKS
    assert summary["modes"]["server"]["columns"]["torch.matmul"]["geomean"] == pytest.approx(2.0)
    assert summary["noise"]["offline"]["gemmrl"]["count"] == 2

    # the times tables are gzip'd CSV, the same bytes for the same table, and the same text as the
    # uncompressed table writer's
    import gzip

    from gemmrl.report.export import table_csv, times_rows

    gz = (tmp_path / f"{PREFIX}_times_offline.csv.gz").read_bytes()
    assert gzip.decompress(gz).decode() == table_csv(*times_rows(all_records(), "offline", PEAKS))
    assert gzip.decompress(gz).decode().splitlines()[0].startswith("mnk,")

    # writing again replaces the files in place, removes an uncompressed times CSV of an earlier
    # report and still leaves no temp files
    (tmp_path / f"{PREFIX}_times_server.csv").write_text("old")
    write_results(all_records(seed=1), tmp_path, "gemmrl", PEAKS, PROVENANCE, PREFIX)
    assert sorted(os.listdir(tmp_path)) == names
    write_results(all_records(), tmp_path, "gemmrl", PEAKS, PROVENANCE, PREFIX)
    assert (tmp_path / f"{PREFIX}_times_offline.csv.gz").read_bytes() == gz  # deterministic


def test_write_results_without_subject_writes_times_and_noise_only(tmp_path):
    paths = write_results(all_records(), tmp_path, None, None, PROVENANCE, PREFIX)
    assert sorted(p.name for p in paths) == sorted([
        f"{PREFIX}_times_offline.csv.gz", f"{PREFIX}_times_server.csv.gz", f"{PREFIX}_summary.json"])
    summary = json.loads((tmp_path / f"{PREFIX}_summary.json").read_text())
    assert summary["modes"] == {}
    assert summary["noise"]["offline"]["gemmrl"]["max"] == pytest.approx(0.05)
    assert _tmp_leftovers(tmp_path) == []


def test_atomic_write_keeps_old_file_and_no_temp_on_failure(tmp_path):
    target = tmp_path / "table.csv"
    target.write_text("old\n")

    def broken(f):
        f.write("half a new fi")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["table.csv"]
    atomic_write(target, lambda f: f.write("new\n"))
    assert target.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["table.csv"]


def test_plots_accept_empty_modes(tmp_path):
    from gemmrl.report import plots

    columns, rows = speedup_rows(all_records(), "gemmrl", "server")
    empty = (columns, [["64_64_64"] + [None] * (len(columns) - 1)])
    out = plots.plot_distribution({"server": (columns, rows), "offline": empty},
                                  tmp_path / "d.png", subject="gemmrl", device=DEVICE)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    out = plots.plot_speedup_vs_flops({}, tmp_path / "s.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert _tmp_leftovers(tmp_path) == []


def test_palette_png_keeps_every_pixel_of_a_few_colour_image():
    """The reports' PNGs are re-encoded with a palette: an image of a few colours (a plot's markers,
    one half transparent) comes back pixel for pixel, alpha included, as a palette PNG."""
    import io

    import numpy as np

    from gemmrl.report.plots import palette_png

    colours = np.array([[255, 255, 255, 255], [31, 119, 180, 255], [255, 127, 14, 128], [0, 0, 0, 255],
                        [214, 39, 40, 255]], dtype=np.uint8)
    pixels = colours[np.random.default_rng(0).integers(0, len(colours), (60, 80))]
    src = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(src, format="png")
    out = palette_png(src.getvalue())
    with Image.open(io.BytesIO(out)) as im:
        assert im.mode == "P" and im.size == (80, 60)
        assert np.array_equal(np.asarray(im.convert("RGBA")), pixels)


# ----------------------------------------------------------------------------- head to head


def versus_records():
    """gemmrl and a seed system: 64^3 in two modes, 4096^3 kernel only, 1024^3 seed only."""
    return [
        rec(64, 64, 64, "gemmrl", "kernel", 4.0), rec(64, 64, 64, "cuda-l2", "kernel", 6.0),
        rec(64, 64, 64, "gemmrl", "offline", 10.0), rec(64, 64, 64, "cuda-l2", "offline", 8.0),
        rec(4096, 4096, 4096, "gemmrl", "kernel", 200.0), rec(4096, 4096, 4096, "cuda-l2", "kernel", 300.0),
        rec(1024, 1024, 1024, "cuda-l2", "kernel", 30.0),
        rec(64, 64, 64, "torch.matmul", "kernel", 5.0),  # neither side: ignored
    ]


def test_versus_rows_ratio_per_mode_and_missing_cells():
    from gemmrl.report.export import versus_rows

    columns, rows = versus_rows(versus_records(), "gemmrl", "cuda-l2")
    assert columns == ["mnk", "kernel", "offline"]
    t = by_mnk(columns, rows)
    assert t["64_64_64"]["kernel"] == pytest.approx(1.5)
    assert t["64_64_64"]["offline"] == pytest.approx(0.8)  # the seed is faster there
    assert t["4096_4096_4096"]["kernel"] == pytest.approx(1.5)
    assert t["4096_4096_4096"]["offline"] is None
    assert t["1024_1024_1024"]["kernel"] is None  # gemmrl has no time: no ratio invented
    assert [r[0] for r in rows] == ["64_64_64", "1024_1024_1024", "4096_4096_4096"]
    with pytest.raises(ReportError):
        versus_rows(versus_records(), "gemmrl", "gemmrl")


def test_write_versus_summary_counts_and_files(tmp_path):
    from gemmrl.report.export import write_versus

    paths = write_versus(versus_records(), tmp_path, "gemmrl", "cuda-l2", "gemmrl_h100_F32F16F16F32")
    assert [p.name for p in paths] == ["gemmrl_h100_F32F16F16F32_vs_cuda-l2.csv",
                                       "gemmrl_h100_F32F16F16F32_vs_cuda-l2_summary.json"]
    s = json.loads(paths[1].read_text())
    k = s["modes"]["kernel"]
    assert k["count"] == 2 and k["geomean"] == pytest.approx(1.5) and k["share_slower"] == 0.0
    assert k["only_cuda-l2"] == 1 and k["only_gemmrl"] == 0
    o = s["modes"]["offline"]
    assert o["count"] == 1 and o["share_slower"] == 1.0
    assert paths[0].read_text().splitlines()[0] == "mnk,kernel,offline"


def test_family_breakdown_groups_the_subjects_speedups_by_winner_family_and_bucket():
    from gemmrl.report.export import family_breakdown

    recs = offline_records()
    fams = {"64_64_64": "raw", "128_256_512": "raw", "4096_4096_4096": "cutlass_sm90"}
    out = family_breakdown(recs, "gemmrl", fams, mode="offline")
    assert set(out) == {"raw", "cutlass_sm90"}
    assert out["raw"]["all"]["count"] == 2
    assert out["raw"]["all"]["geomean"] == pytest.approx((1.283 * 0.5) ** 0.5)
    assert out["cutlass_sm90"]["all"]["geomean"] == pytest.approx(1.0)  # 250 vs auto-tuning-tn 250
    assert sum(b["count"] for b in out["raw"]["buckets"].values()) == 2
    assert family_breakdown(recs, "gemmrl", {}, mode="offline") == {}
    assert family_breakdown(recs, "gemmrl", fams, mode="offline", column="nope") == {}


def test_server_mode_compares_means_and_the_other_modes_medians():
    """Server-mode times are bimodal (cold and warm calls): the reports compare means there, as
    CUDA-L2 does, and medians in kernel and offline modes; the noise uses the same statistic."""
    recs = []
    for mode in ("offline", "server"):
        # the subject's median is faster, its mean slower (a heavier slow mode)
        recs += [rec(64, 64, 64, "ours", mode, 10.0, mean_us=30.0),
                 rec(64, 64, 64, "torch.matmul", mode, 20.0, mean_us=20.0),
                 rec(64, 64, 64, "torch.matmul@repeat", mode, 20.0, mean_us=26.0)]
    for mode, want in (("offline", 2.0), ("server", 20.0 / 30.0)):
        cols, rows = speedup_rows(recs, "ours", mode)
        assert rows[0][cols.index("torch.matmul")] == pytest.approx(want)
    s = summarize(recs, "ours", PEAKS)
    assert s["noise"]["offline"]["torch.matmul"]["max"] == pytest.approx(0.0)
    assert s["noise"]["server"]["torch.matmul"]["max"] == pytest.approx(0.3)
    cols, rows = times_rows(recs, "server", PEAKS)
    ours = next(r for r in rows if r[cols.index("impl")] == "ours")
    assert ours[cols.index("tflops")] == pytest.approx(2 * 64 ** 3 / 30e-6 / 1e12)
