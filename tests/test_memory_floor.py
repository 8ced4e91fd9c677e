"""The memory floor (gemmrl.bench.floor): its kernel compiled with nvcc for real, the pure analysis,
the script's report; on a GPU, that it moves every byte and that the timer leaves it unchecked only
where asked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemmrl.bench import floor
from gemmrl.bench.floor import FloorRow, fraction_reachable, roofline_us, summarize
from gemmrl.build.nvcc import build_shared
from gemmrl.core.problem import Problem
from gemmrl.runtime.abi import kernel_names

ROOT = Path(__file__).resolve().parent.parent


def test_the_floor_kernel_compiles_without_spills_and_exports_the_abi(tmp_path):
    r = build_shared(floor.source(), name="memory-floor", cache_dir=tmp_path)
    assert r.ok, r.log
    assert r.resources and all(x.spill_stores == 0 and x.spill_loads == 0 for x in r.resources)
    assert any("memory_floor" in n for n in kernel_names(r.path))
    out = subprocess.run(["nm", "-D", "--defined-only", r.path], capture_output=True, text=True).stdout
    for sym in ("gemmrl_meta", "gemmrl_workspace_bytes", "gemmrl_run"):
        assert sym in out
    # the constants are compiled in from the module's values
    src = floor.source()
    assert f"#define UNROLL {floor.UNROLL}" in src and "ld.global.nc.L1::no_allocate.v4" in src


def test_skinny_supports_and_the_roofline_bound():
    assert floor.skinny(Problem(64, 16384, 4096)) and floor.skinny(Problem(8192, 256, 8192))
    assert not floor.skinny(Problem(512, 512, 8192)) and not floor.skinny(Problem(64, 64, 2048))
    assert floor.supports(Problem(64, 64, 4096)) and not floor.supports(Problem(1, 3, 5))
    p = Problem(64, 8192, 8192)  # 2*(64*8192 + 8192^2 + 64*8192) bytes = 136.3 MB
    t, bound = roofline_us(p, bandwidth_gbs=3000.0, matrix_tflops=800.0)
    assert bound == "memory" and t == pytest.approx(p.min_bytes / 3000e9 * 1e6)
    t, bound = roofline_us(Problem(8192, 8192, 8192), 3000.0, 800.0)
    assert bound == "compute" and t == pytest.approx(2 * 8192 ** 3 / 800e12 * 1e6)
    with pytest.raises(ValueError):
        roofline_us(p, 0.0, 800.0)


def test_summarize_splits_the_shapes_where_the_target_is_reachable_at_all():
    rows = [FloorRow("a", 100.0, 110.0, {"memory-floor": 110.0, "lib": 120.0, "ours": 115.0}),  # floor 0.91
            FloorRow("b", 40.0, 48.0, {"memory-floor": 48.0, "lib": 60.0}),                   # floor 0.83
            FloorRow("c", 1.0, 4.0, {"memory-floor": 4.0, "lib": 6.0, "ours": 5.0})]          # floor 0.25
    s = summarize(rows, ["lib", "ours"])
    assert s["all"]["shapes"] == 3 and s["floor_reaches_target"]["shapes"] == 2
    assert s["floor_below_target"]["shapes"] == 1
    assert s["all"]["floor_median_fraction"] == pytest.approx(40 / 48)
    lib = s["floor_reaches_target"]["lib"]
    assert lib["timed"] == 2 and lib["at_least_0.8"] == 1  # 100/120 = 0.83 yes, 40/60 = 0.67 no
    assert lib["median_fraction"] == pytest.approx((100 / 120 + 40 / 60) / 2)
    assert lib["median_of_floor"] == pytest.approx((110 / 120 + 48 / 60) / 2)
    assert s["floor_reaches_target"]["ours"]["timed"] == 1  # 'b' has no 'ours': not counted
    assert s["launch_bound_us"] == pytest.approx(3.0)  # only 'c' is under 2 us of roofline time
    assert summarize([], ["lib"])["all"] == {"shapes": 0}


def test_fraction_reachable_with_a_fixed_cost():
    assert fraction_reachable(12.0, 3.0) == pytest.approx(0.8)
    assert fraction_reachable(0.15, 2.0) < 0.07  # 64x64x4096 at 3.3 TB/s behind a 2 us launch
    with pytest.raises(ValueError):
        fraction_reachable(0.0, 1.0)


def test_script_reports_a_stored_file(tmp_path):
    doc = {"rows": [{"shape": "64x8192x8192", "roofline_us": 40.0,
                     "times_us": {"memory-floor": 44.0, "memory-floor@repeat": 44.2, "torch.matmul": 50.0}},
                    {"shape": "64x64x4096", "roofline_us": 0.2,
                     "times_us": {"memory-floor": 2.2, "torch.matmul": 4.0}},
                    {"shape": "64x128x4096", "roofline_us": 0.3, "times_us": {"torch.matmul": 4.1}}]}
    f = tmp_path / "floor.json"
    f.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "memory-floor.py"), "--report", str(f)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["all"]["shapes"] == 2  # the row without a floor time is left out
    assert s["floor_reaches_target"]["torch.matmul"]["at_least_0.8"] == 1
    assert s["floor_below_target"]["shapes"] == 1
    assert "memory-floor@repeat" in s["all"]  # the repeat is reported like any other timing
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "memory-floor.py")], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "--out" in r.stderr


@pytest.mark.gpu
def test_the_floor_moves_every_byte_and_is_timed_unchecked_only_when_asked(tmp_path):
    import torch

    from gemmrl.bench import timing
    from gemmrl.runtime.abi import AbiKernel, abi_call

    r = build_shared(floor.source(), name="memory-floor", cache_dir=tmp_path)
    assert r.ok, r.log
    k = AbiKernel(r.path)
    p = Problem(64, 8192, 8192)  # memory-bound on any Hopper: 64 FLOPs a byte
    fn = abi_call(k, p, "memory-floor")
    a = torch.randn(p.M, p.K, device="cuda").half()
    b = torch.randn(p.K, p.N, device="cuda").half()
    c = torch.full((p.M, p.N), float("nan"), device="cuda", dtype=torch.float16)
    fn(a, b, b.t().contiguous(), c)
    torch.cuda.synchronize()
    assert not torch.isnan(c).any()  # every element of C written, all finite
    with pytest.raises(Exception, match="returned"):
        abi_call(k, Problem(3, 5, 7), "memory-floor")(a, b, b, c)  # element counts not multiples of 8
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = timing.time_kernel(p, {"floor": fn, "again": fn}, l2_bytes=l2, unchecked=frozenset({"floor"}))
    assert res["floor"]["status"] == "ok" and res["floor"]["details"]["unchecked"] is True
    assert res["again"]["status"] == "wrong"  # not a GEMM: the re-check rejects it where not exempted
    from gemmrl.bench.env import measure_peaks

    peaks = measure_peaks(matrix_n=4096, copy_bytes=1 << 30)
    t_roof, bound = roofline_us(p, peaks["bandwidth_gbs"], peaks["matrix_tflops"])
    assert bound == "memory"
    # 1 MB + 134 MB + 1 MB: a real streaming kernel, between 30% and 110% of the roofline
    assert 0.3 < t_roof / res["floor"]["median_us"] < 1.1
