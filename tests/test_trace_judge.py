"""The trace verdict on recorded-style GPU event lists (what torch.profiler's chrome trace holds)."""

from gemmrl.verify.trace import base_name, judge

OWN = {"void gemmrl_test_gemm_kernel<(gemmrl_test::Layout)0>(__half const*, __half const*, __half*, int, int, int)"}


def ev(name, stream=7, cat="kernel"):
    return {"cat": cat, "name": name, "args": {"stream": stream}}


def marker(stream=7):
    return ev("spin_kernel(long)", stream)


def test_own_kernel_on_callers_stream_passes():
    own = next(iter(OWN))
    s = judge([marker(), ev(own), marker(), {"cat": "cpu_op", "name": "aten::mm"}], OWN)
    assert s["problem"] == "" and s["kernels"] == [own]


def test_same_kernel_other_template_args_still_own():
    s = judge([marker(), ev("void gemmrl_test_gemm_kernel<(gemmrl_test::Layout)1>(int)"), marker()], OWN)
    assert s["problem"] == ""


def test_side_stream_is_rejected():
    s = judge([marker(7), ev(next(iter(OWN)), 13), marker(7)], OWN)
    assert "stream(s) 13" in s["problem"]


def test_cublas_kernels_are_not_own():
    s = judge([marker(), ev("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNN"), marker()], OWN)
    assert "not the implementation's own" in s["problem"] and "nvjet" in s["problem"]
    s = judge([marker(), ev("void at::native::vectorized_elementwise_kernel<4>(int)"), marker()], OWN)
    assert "not the implementation's own" in s["problem"]


def test_copy_only_is_a_cached_result():
    s = judge([marker(), ev("Memcpy DtoD (Device -> Device)", cat="gpu_memcpy"), marker()], OWN)
    assert "no kernel of its own ran" in s["problem"] and "cached" in s["problem"]


def test_nothing_ran():
    assert "no kernel" in judge([marker(), marker()], OWN)["problem"]


def test_missing_markers_is_not_a_pass():
    assert "marker" in judge([ev(next(iter(OWN)))], OWN)["problem"]


def test_trusted_baseline_skips_the_own_list_but_not_the_stream():
    assert judge([marker(), ev("nvjet_x"), marker()], None)["problem"] == ""
    assert "stream" in judge([marker(), ev("nvjet_x", 9), marker()], None)["problem"]


def test_base_name():
    assert base_name("void cutlass::device_kernel<cutlass::gemm::X<1, 2>>(cutlass::P)") == "cutlass::device_kernel"
    assert base_name("plain_c_kernel") == "plain_c_kernel"
