"""The issue targets checker (gemmrl.report.targets, `gemmrl targets`): each target judged as the
issue words it, on small hand-made reports."""

import csv
import gzip
import json

import pytest
from click.testing import CliRunner

from gemmrl.cli import main
from gemmrl.report.targets import (LT_AUTO, bucket_geomeans, evaluate, grid_targets, kernel_family_targets,
                                   markdown, read_speedups, read_times)


def _by_key(targets):
    return {t.key: t for t in targets}


def _sp(**ratios):
    return {k: {LT_AUTO: v, "torch.matmul": v * 1.2} for k, v in ratios.items()}


def test_big_shapes_need_every_one_at_098():
    # 4096^3 is 2^37 FLOPs, 1024x1024x512 is 2^30 (not counted however low)
    ok = _by_key(kernel_family_targets(_sp(**{"4096_4096_4096": 0.98, "1024_1024_512": 0.5}), None))
    assert ok["big-shapes-vs-lt"].met is True and ok["big-shapes-vs-lt"].extra == {"shapes": 1, "below": 0}
    bad = _by_key(kernel_family_targets(_sp(**{"4096_4096_4096": 0.979, "8192_8192_8192": 1.2}), None))
    t = bad["big-shapes-vs-lt"]
    assert t.met is False and t.value == pytest.approx(0.979) and t.extra["below"] == 1
    assert "4096x4096x4096 0.979" in t.detail


def test_small_shape_median_and_no_data():
    # 2^27 FLOPs exactly counts (64x1024x1024 = 2^27); 2^28 does not
    t = _by_key(kernel_family_targets(_sp(**{"64_1024_1024": 1.3, "64_64_64": 1.1, "128_64_64": 1.25,
                                             "128_1024_1024": 0.1}), None))
    assert t["small-shapes-median"].value == pytest.approx(1.25) and t["small-shapes-median"].met
    assert t["small-shapes-median"].extra["shapes"] == 3
    none = _by_key(kernel_family_targets(None, None))
    assert all(x.met is None and x.status == "no data" for x in none.values())


def _times(rows):
    return {k: {"tflops": str(tf), "bound": bound, "roofline_fraction": str(rf)} for k, tf, bound, rf in rows}


def test_tflops_and_skinny_roofline():
    times = _times([("8192_8192_8192", 710, "compute", 0.95), ("16384_8192_8192", 690, "compute", 0.92),
                    ("8192_4096_8192", 100, "compute", 0.1),  # N < 8192: not in the 700 target
                    ("64_4096_8192", 5, "memory", 0.85), ("256_64_4096", 1, "memory", 0.5),
                    ("512_64_4096", 1, "memory", 0.1),  # M and N both above 256? no: N=64 counts
                    ("64_4096_2048", 1, "memory", 0.1),  # K < 4096: not skinny by the issue
                    ("128_4096_4096", 1, "compute", 0.1)])  # compute-bound: not counted
    t = _by_key(kernel_family_targets({}, times, {"64_4096_8192": True, "256_64_4096": True}))
    tf = t["tflops-8192"]
    assert tf.met is False and tf.value == 690 and tf.extra == {"shapes": 2, "below": 1}
    sk = t["skinny-roofline"]
    assert sk.met is False and sk.extra["shapes"] == 3 and sk.extra["below"] == 2
    assert sk.extra["floor_reachable"] == 2 and sk.extra["floor_reachable_at_target"] == 1


def test_buckets_are_powers_of_8_of_flops():
    b = bucket_geomeans({"64_64_64": 1.0, "64_64_128": 4.0, "4096_4096_4096": 0.5})
    assert b == {"2^18-2^21": (2, pytest.approx(2.0)), "2^36-2^39": (1, 0.5)}


def _grid(ratio, n=1000):
    # n distinct shapes, every one at `ratio`
    return {f"64_64_{64 * (i + 1)}": {LT_AUTO: ratio, "torch.matmul": ratio * 1.25} for i in range(n)}


def test_grid_targets_need_the_whole_grid():
    sp = {"kernel": _grid(1.2), "offline": _grid(1.31), "server": _grid(1.41)}
    t = _by_key(grid_targets(sp, None, None, None))
    assert t["kernel-geomean"].met and t["kernel-buckets"].met
    assert t["offline-mean"].met and t["server-mean"].met
    assert "over torch.matmul: mean 1.638" in t["offline-mean"].detail
    part = _by_key(grid_targets({"kernel": _grid(1.2, 999), "offline": _grid(1.31, 10)}, None, None, None))
    assert part["kernel-geomean"].met is False and part["offline-mean"].met is False
    assert part["server-mean"].met is None
    low = dict(_grid(1.2))
    low["4096_4096_4096"] = {LT_AUTO: 0.99}
    assert _by_key(grid_targets({"kernel": low}, None, None, None))["kernel-buckets"].met is False


def _product(min_ratio, noise, date="2026-01-01", mode="kernel", beyond=None, pack="packs/h100-fp16-F32F16F16F32"):
    per = {"NN served": {"shapes": 3, "min": 1.01, "min_shape": "a"},
           "TN fallback": {"shapes": 5, "min": min_ratio, "min_shape": "64x64x64"},
           "noise": {"max |1 - r|": noise}}
    if beyond is not None:
        per["beyond_noise"] = beyond
    return {"provenance": {"date": date}, "pack": pack, "modes": {mode: per}}


def test_product_never_slower_beyond_noise():
    # an older report without per-session verdicts: each group's lowest against the largest noise
    ok = _by_key(grid_targets({}, _product(0.992, 0.01), None, None))["product-vs-torch"]
    assert ok.met is True and ok.value == 0.992 and "kernel: 0 of 8 (shape, layout) pairs" in ok.detail
    bad = _by_key(grid_targets({}, _product(0.985, 0.01), None, None))["product-vs-torch"]
    assert bad.met is False and "64x64x64 TN 0.985" in bad.detail
    no_noise = _product(0.999, 0.01)
    del no_noise["modes"]["kernel"]["noise"]
    assert _by_key(grid_targets({}, no_noise, None, None))["product-vs-torch"].met is None
    # a report with its per-session verdicts: those decide, not the largest noise
    slow = [{"shape": "64x64x64", "layout": "TN", "ratio": 0.95}]
    t = _by_key(grid_targets({}, _product(0.95, 0.2, beyond=slow), None, None))["product-vs-torch"]
    assert t.met is False and "1 of 8" in t.detail and "each session's noise" in t.detail
    t = _by_key(grid_targets({}, _product(0.985, 0.0, beyond=[]), None, None))["product-vs-torch"]
    assert t.met is True
    # disputed pairs (the settle times them again) are counted in the detail and still fail the target
    two = slow + [{"shape": "128x512x4096", "layout": "TN", "ratio": 0.974, "disputed": True}]
    t = _by_key(grid_targets({}, _product(0.95, 0.2, beyond=two), None, None))["product-vs-torch"]
    assert t.met is False and "2 of 8" in t.detail and ", 1 of them disputed (fewer than three sessions" in t.detail
    assert "disputed" not in _by_key(grid_targets({}, _product(0.95, 0.2, beyond=slow), None, None))["product-vs-torch"].detail


def test_pairs_timed_with_another_serving_than_the_packs_are_not_judged_met():
    """A pair whose latest session timed another serving (the pack exported again since) says
    nothing of the pack: not slower beyond the noise, but not met either until it is timed."""
    rep = _product(0.95, 0.0, beyond=[])
    rep["modes"]["kernel"]["stale"] = [{"shape": "512x512x4096", "layout": "TN", "ratio": 0.953,
                                        "timed": "kernel 24319687ec79", "pack": "cuBLASLt algorithm 420000000c000000"}]
    t = _by_key(grid_targets({}, rep, None, None))["product-vs-torch"]
    assert t.met is False and "0 of 8 (shape, layout) pairs slower" in t.detail
    assert "1 (shape, layout, mode) timed last with another serving" in t.detail
    assert "512x512x4096 TN: timed kernel 24319687ec79, served cuBLASLt algorithm 420000000c000000" in t.detail
    assert t.extra["modes"]["kernel"]["stale"][0]["ratio"] == 0.953
    rep["modes"]["kernel"]["stale"] = []
    assert _by_key(grid_targets({}, rep, None, None))["product-vs-torch"].met is True


def test_newest_product_report_per_mode():
    from gemmrl.report.targets import _newest_per_mode

    a, b = _product(0.9, 0.01, "2026-01-02"), _product(0.99, 0.01, "2026-01-01")
    c = _product(0.97, 0.01, "2026-01-01", mode="offline", beyond=[])
    merged, used = _newest_per_mode([("a", a), ("b", b), ("c", c)])
    assert used == {"kernel": "a", "offline": "c"} and merged["modes"]["kernel"]["TN fallback"]["min"] == 0.9
    assert _newest_per_mode([("b", b), ("b2", _product(0.98, 0.01, "2026-01-01"))])[1] == {"kernel": "b2"}
    with pytest.raises(ValueError, match="not a product"):
        _newest_per_mode([("x", ["junk"])])


def test_cuda_l2_most_shapes_in_each_mode_and_fp16():
    l2 = {m: {"count": 10, "share_slower": 0.9} for m in ("kernel", "offline", "server")}
    assert _by_key(grid_targets({}, None, l2, None))["cuda-l2"].met is True
    l2["server"]["share_slower"] = 0.5  # half is not most
    assert _by_key(grid_targets({}, None, l2, None))["cuda-l2"].met is False
    del l2["server"]
    l2["offline"]["share_slower"] = 0.9
    assert _by_key(grid_targets({}, None, l2, None))["cuda-l2"].met is False  # a mode not measured
    fp16 = _by_key(grid_targets({}, None, None, {"kernel": 1000, "offline": 1000}))["fp16-acc"]
    assert fp16.met is False and fp16.value == 0


def test_cuda_l2_kernels_written_for_another_gpu_are_named_in_the_detail():
    l2 = {m: {"count": 25, "share_slower": 1.0} for m in ("kernel", "offline", "server")}
    t = _by_key(grid_targets({}, None, l2, None, cuda_l2_written_for={"a100": 25}, gpu="h200"))["cuda-l2"]
    assert t.met and t.detail.endswith("written for the A100 (25 shapes), not the H200")
    assert t.extra["written_for"] == {"a100": 25}
    own = _by_key(grid_targets({}, None, l2, None, cuda_l2_written_for={"h100": 8, "unknown": 9}, gpu="h100"))
    assert "written for" not in own["cuda-l2"].detail  # their own GPU's kernels: nothing to say
    mixed = _by_key(grid_targets({}, None, l2, None, cuda_l2_written_for={"h100": 8, "unknown": 9}, gpu="h200"))
    assert mixed["cuda-l2"].detail.endswith("the H100 (8 shapes), not the H200 (9 more whose records do not say)")
    padded = _by_key(grid_targets({}, None, l2, None, cuda_l2_written_for={"a100": 25}, gpu="h200",
                                  cuda_l2_padded=["256x8192x64", "8192x512x8192"]))["cuda-l2"]
    assert padded.detail.endswith("; 2 of their calls padded the inputs inside the timed call")
    assert padded.extra["padded"] == ["256x8192x64", "8192x512x8192"]


def _write_csv(path, columns, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def _report_dir(tmp_path):
    d = tmp_path / "results" / "h100"
    d.mkdir(parents=True)
    stem = "gemmrl-tuned_h100_F32F16F16F32"
    cols = ["mnk", "torch.matmul", LT_AUTO, "best-baseline"]
    _write_csv(d / f"{stem}_speedup_kernel.csv", cols,
               [["8192_8192_8192", "1.050", "0.990", "0.990"], ["64_64_64", "1.400", "1.300", ""]])
    _write_csv(d / f"{stem}_times_kernel.csv.gz",
               ["mnk", "M", "N", "K", "impl", "median_us", "tflops", "roofline_fraction", "bound"],
               [["8192_8192_8192", 8192, 8192, 8192, "gemmrl-tuned", 1500, 733.0, 0.98, "compute"],
                ["8192_8192_8192", 8192, 8192, 8192, "torch.matmul", 1600, 690.0, 0.92, "compute"]], gz=True)
    (d / f"{stem}_summary.json").write_text(json.dumps(
        {"provenance": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc",
                        "run_bias": [{"run": 288, "class": "splitk-sr", "pairs": 29, "median": 1.0752, "report_rows": 17},
                                     {"run": 35, "class": "splitk-sr", "pairs": 9, "median": 0.969, "report_rows": 0}],
                        "slow_library_rows": {"share": 0.05, "runs": "161-162,450", "rows": {"cutlass": 3, "raw": 1}}},
         "protocols": {"kernel": {"kernel:v1": 1, "kernel:v3": 1}}}))
    (d / "product-vs-torch-grid-latest-2026-01-01.json").write_text(json.dumps(_product(0.5, 0.01)))
    (d / "product-vs-torch-grid-latest-2026-02-01.json").write_text(json.dumps(_product(0.995, 0.01, "2026-02-01")))
    return tmp_path / "results"


def test_evaluate_reads_the_report_files(tmp_path):
    res = evaluate(_report_dir(tmp_path), "h100")
    t = {x["key"]: x for x in res["targets"]}
    assert res["provenance"]["device"] == "NVIDIA H100 80GB HBM3"
    assert t["big-shapes-vs-lt"]["status"] == "met" and t["tflops-8192"]["value"] == 733.0
    assert t["small-shapes-median"]["value"] == 1.3
    assert t["product-vs-torch"]["met"] is True  # the newest product report, not the older one
    assert res["product_reports"]["kernel"].endswith("2026-02-01.json")
    assert t["cuda-l2"]["status"] == "no data" and t["fp16-acc"]["status"] == "no data"
    assert res["met"] == sum(x["met"] is True for x in res["targets"])
    md = markdown(res)
    assert ("Mixed measuring protocols: kernel: 1 kernel:v1, 1 kernel:v3 (the older ones to retime: "
            "scripts/stale-shapes.py --device H100 --acc fp32 --mode kernel --protocol kernel:v3)") in md
    # a run whose ratios read apart is named where report rows still come from it (run 35's none)
    assert [b["run"] for b in res["run_bias"]] == [288]
    assert ("Kernel-mode rows from runs whose ratios read apart from the same kernels' other sessions (17 rows; "
            "scripts/session-bias.py; retime their shapes): run 288 splitk-sr x1.075 over 29 pairs, 17 rows") in md
    # rows whose latest session sat beside slow library sessions: named, with the runs and the command
    assert ("Kernel-mode rows whose latest session ran beside slow library sessions (4 rows: cutlass 3, raw 1; "
            "runs 161-162,450, each with 5% or more of its small-shape library sessions slow; "
            "scripts/session-bias.py --slow-runs 0.05 lists them to retime)") in md
    assert md.count("\n| #") == len(res["targets"])
    with pytest.raises(FileNotFoundError):
        evaluate(tmp_path / "results", "h200")
    # the fp16-accumulator reports: no fp32 product report judges them, and the target about the
    # fp16 variant is not one of its own
    d = tmp_path / "results" / "h100"
    (d / "product-vs-torch-grid-fp16.json").write_text(json.dumps(
        _product(0.9, 0.0, "2026-03-01", beyond=[], pack="packs/h100-fp16-F16F16F16F16")))
    res16 = evaluate(tmp_path / "results", "h100", precision="F16F16F16F16")
    t16 = {x["key"]: x for x in res16["targets"]}
    assert "fp16-acc" not in t16 and len(res16["targets"]) == len(res["targets"]) - 1
    assert res16["product_reports"] == {"kernel": str(d / "product-vs-torch-grid-fp16.json")}
    assert t16["product-vs-torch"]["value"] == 0.9 and t16["product-vs-torch"]["met"] is True
    assert evaluate(tmp_path / "results", "h100")["product_reports"]["kernel"].endswith("2026-02-01.json")
    with pytest.raises(FileNotFoundError, match="no product report at"):
        evaluate(tmp_path / "results", "h100", product=[tmp_path / "none.json"])


def test_readers_reject_malformed_shapes(tmp_path):
    p = tmp_path / "s.csv"
    _write_csv(p, ["mnk", LT_AUTO], [["64x64x64", "1.0"]])
    with pytest.raises(ValueError, match="M_N_K"):
        read_speedups(p)
    q = tmp_path / "t.csv"
    _write_csv(q, ["mnk", "impl", "tflops"], [["64_64_64", "a", "1"], ["64_64_128", "b", "2"]])
    assert list(read_times(q, "b")) == ["64_64_128"]


def test_cli_prints_the_table_and_writes_json(tmp_path):
    root = _report_dir(tmp_path)
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["targets", "--results", str(root), "--device", "NVIDIA H100 80GB HBM3",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "| #3 | every shape of 2^36 FLOPs" in r.output
    assert json.loads(out.read_text())["gpu"] == "h100"
    r = CliRunner().invoke(main, ["targets", "--results", str(root), "--device", "H200"])
    assert r.exit_code != 0 and "no reports at" in r.output
    # --dtype bf16 judges the bf16 reports (gemmrl report --dtype bf16), not the fp16 ones beside them
    d = root / "h100"
    for f in d.glob("gemmrl-tuned_h100_F32F16F16F32_*"):
        (d / f.name.replace("F32F16F16F32", "F32BF16BF16F32")).write_bytes(f.read_bytes())
    _write_csv(d / "gemmrl-tuned_h100_F32BF16BF16F32_speedup_kernel.csv", ["mnk", "torch.matmul", LT_AUTO, "best-baseline"],
               [["8192_8192_8192", "1.050", "0.950", "0.950"], ["64_64_64", "1.400", "1.300", ""]])
    r = CliRunner().invoke(main, ["targets", "--results", str(root), "--device", "h100", "--dtype", "bf16",
                                  "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["precision"] == "F32BF16BF16F32" and "(gemmrl-tuned, F32BF16BF16F32)" in r.output
    big = next(x for x in doc["targets"] if x["key"] == "big-shapes-vs-lt")
    assert big["value"] == 0.95 and big["met"] is False  # the bf16 row, where the fp16 one reads 0.990
    assert "fp16-acc" not in {x["key"] for x in doc["targets"]}


def test_a_pack_exported_again_after_its_product_report_is_not_judged_met(tmp_path):
    """A product report records its pack's serving digest: where the pack here (its path from the
    folder above results) now serves some (shape, layout) otherwise, the product target is not
    met and says why; the same serving under a new stamp and new notes, a report without the
    digest, and a pack not here leave the verdict to the report."""
    from gemmrl.runtime.pack import serving_digest

    res_dir = _report_dir(tmp_path)
    d = res_dir / "h100"
    pack = tmp_path / "packs" / "h100-fp16-F32F16F16F32"
    pack.mkdir(parents=True)
    manifest = {"stamp": {"date": "2026-02-01"}, "skipped": ["a note"],
                "entries": [{"M": 64, "N": 64, "K": 64, "layout": "NN", "source_sha256": "ab" * 32}],
                "lt_algos": [{"M": 128, "N": 64, "K": 64, "layout": "TN", "algo": "01" * 64}]}
    (pack / "manifest.json").write_text(json.dumps(manifest))
    report = _product(0.995, 0.01, "2026-02-01", beyond=[])
    report["pack_digest"] = serving_digest(manifest)
    (d / "product-vs-torch-grid-latest-2026-02-01.json").write_text(json.dumps(report))

    def product_target():
        return {x["key"]: x for x in evaluate(res_dir, "h100")["targets"]}["product-vs-torch"]

    assert product_target()["met"] is True
    (pack / "manifest.json").write_text(json.dumps({**manifest, "stamp": {"date": "2026-03-01"}, "skipped": []}))
    assert product_target()["met"] is True  # the same serving
    manifest["lt_algos"] = []  # 128x64x64 TN now falls back to the heuristic's plan
    (pack / "manifest.json").write_text(json.dumps(manifest))
    t = product_target()
    assert t["met"] is False and t["extra"]["pack_changed"] == ["kernel"]
    assert "exported again after the kernel report" in t["detail"]
    del report["pack_digest"]
    (d / "product-vs-torch-grid-latest-2026-02-01.json").write_text(json.dumps(report))
    assert product_target()["met"] is True
    report["pack_digest"] = "0" * 16
    report["pack"] = "packs/gone-F32F16F16F32"
    (d / "product-vs-torch-grid-latest-2026-02-01.json").write_text(json.dumps(report))
    assert product_target()["met"] is True


def test_serving_digest_follows_what_serves_each_pair():
    from gemmrl.runtime.pack import serving, serving_digest

    m = {"entries": [{"M": 64, "N": 64, "K": 64, "layout": "NN", "source_sha256": "ab"}],
         "lt_algos": [{"M": 64, "N": 64, "K": 64, "layout": "TN", "algo": "01"}], "stamp": {"x": 1}}
    assert serving(m) == {"64x64x64:NN": "kernel:ab", "64x64x64:TN": "lt:01"}
    assert serving_digest(m) == serving_digest({**m, "stamp": {"x": 2}, "skipped": ["n"]})
    other = {**m, "entries": [{**m["entries"][0], "source_sha256": "cd"}]}
    assert serving_digest(other) != serving_digest(m)
    swapped = {"entries": [{"M": 64, "N": 64, "K": 64, "layout": "TN", "source_sha256": "ab"}],
               "lt_algos": [{"M": 64, "N": 64, "K": 64, "layout": "NN", "algo": "01"}]}
    assert serving_digest(swapped) != serving_digest(m) and len(serving_digest(m)) == 16
