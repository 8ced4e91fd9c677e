"""GPU tests of the cuBLAS baselines library: cublasGemmEx, the cuBLASLt heuristic plan and
enumerated plans against torch's fp32 reference, plus CUDA-graph capture. Skipped without torch
or CUDA."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gemmrl.baselines import cublas as cb  # noqa: E402

SHAPES = [(256, 384, 512), (64, 4096, 1024)]
LAYOUTS = ["NN", "TN"]
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Relative Frobenius error bounds against the fp32 reference. fp16 output rounding alone is about
# 2.8e-4; bf16 output rounding about 2.3e-3; fp16 accumulation adds error growing with K.
BOUNDS = {("fp16", "fp32"): 1e-3, ("bf16", "fp32"): 8e-3, ("fp16", "fp16"): 2e-2}
CASES = [("fp16", "fp32"), ("bf16", "fp32"), ("fp16", "fp16")]


@pytest.fixture(scope="module")
def lib():
    try:
        return cb.load()
    except RuntimeError as e:  # no nvcc or no cuBLAS on this machine
        pytest.skip(f"cannot build the baselines library: {e}")


def _inputs(layout, dtype, M, N, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    a = torch.randn(M, K, device="cuda", generator=g).to(dt)
    b = torch.randn(*((K, N) if layout == "NN" else (N, K)), device="cuda", generator=g).to(dt)
    ref = a.float() @ (b.float() if layout == "NN" else b.float().t())
    c = torch.full((M, N), float("nan"), device="cuda", dtype=dt)  # poisoned: every element must be written
    return a, b, c, ref


def _relerr(c, ref):
    assert torch.isfinite(c).all(), "non-finite output"
    return ((c.float() - ref).norm() / ref.norm()).item()


def _stream():
    return torch.cuda.current_stream().cuda_stream


def test_version(lib):
    v = lib.version()
    assert "cublas=" in v and "cublasLt=" in v


@pytest.mark.parametrize("dtype,acc", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_cublas_gemm(lib, layout, dtype, acc, M, N, K):
    a, b, c, ref = _inputs(layout, dtype, M, N, K)
    lib.gemm(layout, dtype, acc, a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, _stream())
    torch.cuda.synchronize()
    assert _relerr(c, ref) < BOUNDS[dtype, acc]


@pytest.mark.parametrize("dtype,acc", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_lt_heuristic_plan(lib, layout, dtype, acc, M, N, K):
    algos = lib.heuristic(layout, dtype, acc, M, N, K)
    assert len(algos) >= 1 and all(len(x) == cb.ALGO_BYTES for x in algos)
    assert cb.parse_description(lib.describe(algos[0]))["algo"] >= 0
    a, b, c, ref = _inputs(layout, dtype, M, N, K)
    pid = lib.plan(layout, dtype, acc, M, N, K, None)
    try:
        lib.run(pid, a.data_ptr(), b.data_ptr(), c.data_ptr(), _stream())
        torch.cuda.synchronize()
        assert _relerr(c, ref) < BOUNDS[dtype, acc]
    finally:
        lib.destroy(pid)


@pytest.mark.parametrize("dtype,acc", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_lt_enumerated_plans(lib, layout, dtype, acc, M, N, K):
    t0 = time.monotonic()
    algos = lib.enumerate(layout, dtype, acc, M, N, K, max_out=256)
    assert time.monotonic() - t0 < 30
    assert 1 <= len(algos) <= 256
    descs = [lib.describe(x) for x in algos]
    assert len(set(descs)) == len(descs), "duplicate configurations"
    # the heuristic's suggestions are part of the enumerated space
    assert {lib.describe(x) for x in lib.heuristic(layout, dtype, acc, M, N, K)} <= set(descs)
    # Every algo id's first config plus an even sample of the rest (all of them would be slow).
    seen, picked = set(), []
    for i, (x, d) in enumerate(zip(algos, descs)):
        aid = cb.parse_description(d)["algo"]
        if aid not in seen or i % max(1, len(algos) // 12) == 0:
            seen.add(aid)
            picked.append(x)
    a, b, _, ref = _inputs(layout, dtype, M, N, K)
    bad = []
    for x in picked:
        c = torch.full((M, N), float("nan"), device="cuda", dtype=a.dtype)
        pid = lib.plan(layout, dtype, acc, M, N, K, x)
        try:
            lib.run(pid, a.data_ptr(), b.data_ptr(), c.data_ptr(), _stream())
            torch.cuda.synchronize()
        finally:
            lib.destroy(pid)
        ok = bool(torch.isfinite(c).all()) and _relerr(c, ref) < BOUNDS[dtype, acc]
        if not ok:
            bad.append(lib.describe(x))
    assert not bad, f"{len(bad)} of {len(picked)} enumerated configs wrong: {bad[:5]}"


def test_heuristic_count_and_errors(lib):
    assert 1 <= len(lib.heuristic("NN", "fp16", "fp32", 256, 384, 512, requested=5)) <= 5
    with pytest.raises(cb.CublasError) as e:
        lib.run(10**6, 1, 1, 1, 0)
    assert e.value.func == "gbl_lt_plan_run" and e.value.status == cb.ERR_PLAN
    with pytest.raises(cb.CublasError):
        lib.plan("NN", "fp16", "fp32", 64, 64, 64, bytes(cb.ALGO_BYTES))  # an all-zero algo


@pytest.mark.parametrize("layout", LAYOUTS)
def test_graph_capture(lib, layout):
    M, N, K = 256, 384, 512
    a, b, c1, ref = _inputs(layout, "fp16", M, N, K)
    c2 = torch.full_like(c1, float("nan"))
    pid = lib.plan(layout, "fp16", "fp32", M, N, K, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(s):
            with torch.cuda.graph(graph, stream=s):
                lib.gemm(layout, "fp16", "fp32", a.data_ptr(), b.data_ptr(), c1.data_ptr(), M, N, K, s.cuda_stream)
                lib.run(pid, a.data_ptr(), b.data_ptr(), c2.data_ptr(), s.cuda_stream)
        torch.cuda.synchronize()
        assert torch.isnan(c1).all() and torch.isnan(c2).all()  # capture ran nothing
        graph.replay()
        torch.cuda.synchronize()
        assert _relerr(c1, ref) < 1e-3 and _relerr(c2, ref) < 1e-3
    finally:
        lib.destroy(pid)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_misaligned_pointers_are_refused_or_correct(lib, layout):
    """Inputs at a 2-byte offset (as inside guard-banded buffers): a plan whose algorithm needs more
    alignment must refuse (ERR_MISALIGNED), never compute garbage; cublasGemmEx copes."""
    M, N, K = 64, 128, 256
    a, b, _, ref = _inputs(layout, "fp16", M, N, K)
    a_buf = torch.empty(a.numel() + 1, device="cuda", dtype=a.dtype)
    a_buf[1:].copy_(a.flatten())
    c_buf = torch.full((M * N + 1,), float("nan"), device="cuda", dtype=a.dtype)
    a_ptr, c_ptr = a_buf.data_ptr() + 2, c_buf.data_ptr() + 2
    lib.gemm(layout, "fp16", "fp32", a_ptr, b.data_ptr(), c_ptr, M, N, K, _stream())
    torch.cuda.synchronize()
    assert _relerr(c_buf[1:].view(M, N), ref) < 1e-3
    c_buf.fill_(float("nan"))
    pid = lib.plan(layout, "fp16", "fp32", M, N, K, None)
    try:
        lib.run(pid, a_ptr, b.data_ptr(), c_ptr, _stream())
        torch.cuda.synchronize()
        assert _relerr(c_buf[1:].view(M, N), ref) < 1e-3
    except cb.CublasError as e:
        assert e.status == cb.ERR_MISALIGNED
    finally:
        lib.destroy(pid)
