"""scripts/fixed-cost.py on the CPU: the line fit, the per-side summary and the argument parsing
(which happens before any GPU work)."""

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("fixed_cost", ROOT / "scripts" / "fixed-cost.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


KS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def test_fit_line_recovers_an_exact_line(mod):
    r = mod.fit_line([(k, 3.5 + 0.002 * k) for k in KS])
    assert r["intercept_us"] == pytest.approx(3.5)
    assert r["slope_us_per_k"] == pytest.approx(0.002)
    assert r["slope_us_per_1024k"] == pytest.approx(0.002 * 1024)
    assert r["r2"] == pytest.approx(1.0) and r["n"] == len(KS)
    flat = mod.fit_line([(64, 5.0), (128, 5.0), (256, 5.0)])  # no K dependence at all
    assert flat["slope_us_per_k"] == 0 and flat["intercept_us"] == 5.0 and flat["r2"] == 1.0


def test_fit_line_on_noisy_points(mod):
    rng = random.Random(0)
    pts = [(k, 4.0 + 0.001 * k + rng.gauss(0, 0.02)) for k in KS for _ in range(4)]
    r = mod.fit_line(pts)
    assert r["intercept_us"] == pytest.approx(4.0, abs=0.03)
    assert r["slope_us_per_k"] == pytest.approx(0.001, rel=0.02)
    assert 0.99 < r["r2"] < 1.0 and r["n"] == len(pts)


def test_fit_line_needs_two_distinct_ks(mod):
    for pts in ([], [(64, 1.0)], [(64, 1.0), (64, 2.0)]):
        with pytest.raises(ValueError):
            mod.fit_line(pts)


def _rec(side, k, y, m=256, n=128, **kw):
    return {"shape": f"{m}x{n}x1024", "M": m, "N": n, "K": k, "side": side, "duration_us": y, **kw}


def test_summarize_fits_each_side_and_takes_the_difference(mod):
    recs = [_rec("ours", k, 3.9 + 0.002 * k) for k in (64, 256, 1024, 4096)]
    recs += [_rec("cublaslt", k, 3.5 + 0.0015 * k) for k in (64, 256, 1024, 4096)]
    recs.append(_rec("cublaslt", 8192, None, unsupported="GBL_ERR_ALGO_REJECTED"))  # not a point
    # another shape where cuBLASLt has one usable point only: flagged, and no difference
    recs += [_rec("ours", k, 10.0 + 0.001 * k, m=1024, n=512) for k in (512, 1024)]
    recs += [_rec("cublaslt", 512, 9.0, m=1024, n=512), _rec("cublaslt", 1024, float("nan"), m=1024, n=512)]
    out = mod.summarize(recs)
    by = {(f["M"], f["N"], f["side"]): f for f in out}
    assert by[(256, 128, "ours")]["intercept_us"] == pytest.approx(3.9)
    assert by[(256, 128, "cublaslt")]["slope_us_per_k"] == pytest.approx(0.0015)
    assert by[(256, 128, "cublaslt")]["n"] == 4 and by[(256, 128, "cublaslt")]["ks"] == [64, 256, 1024, 4096]
    d = by[(256, 128, "ours-cublaslt")]
    assert d["d_intercept_us"] == pytest.approx(0.4)
    assert d["d_slope_us_per_k"] == pytest.approx(0.0005)
    assert d["d_slope_us_per_1024k"] == pytest.approx(0.0005 * 1024)
    assert by[(1024, 512, "ours")]["slope_us_per_k"] == pytest.approx(0.001)
    assert "skipped" in by[(1024, 512, "cublaslt")] and by[(1024, 512, "cublaslt")]["n"] == 1
    assert (1024, 512, "ours-cublaslt") not in by
    assert [f["M"] for f in out] == [256, 256, 256, 1024, 1024]  # shapes in order of appearance
    assert all(f["metric"] == "duration_us" for f in out)


def test_two_anchors_of_one_mxn_are_fitted_apart(mod):
    """512x1024x1024 and 512x1024x4096 hold different winners and algorithms: one fit each (the
    H100 run of 2026-11-26 had merged them into one line of ten points)."""
    recs = [_rec(s, k, c + 0.001 * k, m=512, n=1024, anchor_k=1024) for s, c in (("ours", 3.0), ("cublaslt", 2.8))
            for k in (128, 512, 2048)]
    recs += [_rec(s, k, c + 0.002 * k, m=512, n=1024, anchor_k=4096) for s, c in (("ours", 3.5), ("cublaslt", 3.4))
             for k in (128, 512, 2048)]
    d = {f["anchor_k"]: f for f in mod.summarize(recs) if f["side"] == "ours-cublaslt"}
    assert d[1024]["d_intercept_us"] == pytest.approx(0.2) and d[4096]["d_intercept_us"] == pytest.approx(0.1)
    assert all(f["n"] == 3 for f in mod.summarize(recs) if f["side"] != "ours-cublaslt")


def test_summarize_another_metric(mod):
    recs = [_rec(s, k, None, kernel_mode_us=c + 0.001 * k) for s, c in (("ours", 5.0), ("cublaslt", 4.5))
            for k in (128, 1024)]
    out = mod.summarize(recs, "kernel_mode_us")
    d = next(f for f in out if f["side"] == "ours-cublaslt")
    assert d["metric"] == "kernel_mode_us" and d["d_intercept_us"] == pytest.approx(0.5)
    assert d["d_slope_us_per_k"] == pytest.approx(0.0)
    assert all("skipped" in f for f in mod.summarize(recs) if f["side"] != "ours-cublaslt")


def test_help_exits_zero(mod, capsys):
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--ks" in out and "--layout" in out


@pytest.mark.parametrize("shape", ["256x128", "256x128x", "axbxc", "256x128x0", "256x128x1024x2"])
def test_a_malformed_shape_is_refused(mod, shape, capsys):
    with pytest.raises(SystemExit) as e:
        mod.parse_args(["--out", "x.json", shape])
    assert e.value.code not in (0, None)
    assert "MxNxK" in capsys.readouterr().err


def test_arguments_parse(mod):
    a = mod.parse_args(["--out", "x.json", "--layout", "nn", "--ks", "128,256", "256x128x2048", "64X64X64"])
    assert a.shapes == [(256, 128, 2048), (64, 64, 64)] and a.layout == "NN" and a.ks == [128, 256]
    assert a.calls == 64 and a.db == "results/gemmrl.sqlite"
    assert mod.parse_args(["--out", "x.json", "64x64x64"]).ks == list(mod.DEFAULT_KS)
    for bad in (["--ks", "128,abc"], ["--ks", "0"], ["--layout", "TT"], ["--calls", "1"]):
        with pytest.raises(SystemExit) as e:
            mod.parse_args(["--out", "x.json", *bad, "64x64x64"])
        assert e.value.code == 2


def test_without_cuda_it_says_so_and_exits_2(mod, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main(["--out", "x.json", "64x64x64"]) == 2
    assert "no CUDA" in capsys.readouterr().err
