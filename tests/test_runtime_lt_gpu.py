"""The cuBLASLt fallback of gemmrl.matmul on a GPU (fastpath.cpp, GEMMRL_FASTPATH_LT): with no
pack active every call is a fallback, so these calls are all cuBLASLt's or torch.matmul's.
Results against an fp32 reference (held to torch.matmul's own error), out=, batched inputs,
bf16, residues, side streams, a captured CUDA graph, and the calls it must leave to torch."""

import pytest

torch = pytest.importorskip("torch")

import gemmrl  # noqa: E402
from gemmrl.runtime import fastpath, ops  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fast():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    ops.use_pack(None)
    f = ops._fast()
    assert f is not None, f"the C++ fast path did not build here: {fastpath._failed}"
    assert f.stats()["lt"]["compiled"], "built without cuBLASLt under a CUDA torch"
    ops.set_fallback("cublaslt")
    yield f
    ops.set_fallback("cublaslt")


def _calls(f):
    return f.stats()["lt"]["calls"]


def _err(c, ref):
    return ((c.float() - ref).norm() / ref.norm()).item()


SHAPES = [(1, 4096, 4096), (64, 64, 64), (17, 1024, 4100), (1000, 1000, 1000), (5, 3, 7),
          (128, 12288, 256), (4096, 64, 8192)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["NN", "TN"])
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_results_as_accurate_as_torch_matmul(fast, M, N, K, layout, dtype):
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(*((N, K) if layout == "TN" else (K, N)), device="cuda", dtype=dtype, generator=g)
    bt = b.t() if layout == "TN" else b
    ref = a.float() @ bt.float()
    n = _calls(fast)
    with torch.inference_mode():
        c = gemmrl.matmul(a, b, b_layout=layout)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        assert gemmrl.matmul(a, b, b_layout=layout, out=out) is out
        t = torch.matmul(a, bt)
    torch.cuda.synchronize()
    assert _calls(fast) == n + 2, fast.stats()
    assert c.dtype == dtype and c.shape == (M, N)
    assert torch.isfinite(out).all(), "every element of out= was written"
    bound = 2 * _err(t, ref) + (1e-4 if dtype == torch.float16 else 1e-3)
    assert _err(c, ref) <= bound and _err(out, ref) <= bound


def test_batched_exact_and_graphs_and_streams(fast):
    # {0,1} inputs: every partial sum is an exact integer, whatever the algorithm
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randint(0, 2, (2, 96, 512), device="cuda", generator=g).half()
    w = torch.randint(0, 2, (384, 512), device="cuda", generator=g).half()
    ref = (a.float() @ w.float().t()).half()
    with torch.inference_mode():
        assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), ref)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            c_side = gemmrl.matmul(a, w, b_layout="TN")
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(c_side, ref)
        # a graph: warmed up eagerly, captured, replayed on new inputs
        for _ in range(2):
            gemmrl.matmul(a, w, b_layout="TN")
        n = _calls(fast)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c_g = gemmrl.matmul(a, w, b_layout="TN")
        assert _calls(fast) == n + 1, "the captured call is cuBLASLt's"
        a.copy_(torch.randint(0, 2, a.shape, device="cuda", generator=g).half())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c_g, (a.float() @ w.float().t()).half())


def test_calls_it_must_leave_to_torch(fast):
    a = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    n = _calls(fast)
    r = gemmrl.matmul(a.requires_grad_(True), b)  # autograd records the call
    assert r.grad_fn is not None
    a = a.detach()
    with torch.inference_mode():
        gemmrl.matmul(a.float(), b.float())  # fp32
        gemmrl.matmul(a, b.t().contiguous().t())  # b not row-major
        gemmrl.matmul(a.view(-1)[4:].view(-1)[: 63 * 256].view(63, 256), b)  # 8-byte aligned a
        big = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)  # 2^40 FLOPs: over max_flops
        assert ops.explain(big, big).startswith("torch.matmul")
        gemmrl.matmul(big, big)
    assert _calls(fast) == n
    ops.set_fallback("torch")
    try:
        with torch.inference_mode():
            c = gemmrl.matmul(a, b)
        assert torch.equal(c, torch.matmul(a, b)) and _calls(fast) == n
    finally:
        ops.set_fallback("cublaslt")


def _aligned(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)
    assert t.data_ptr() % 256 == 0  # the caching allocator's blocks
    return t


def test_an_installed_algorithm_serves_its_shape_even_above_max_flops(fast):
    """What a pack's lt_algos do: the baselines' cuBLASLt gives its suggestions for a shape; the
    last one (not the heuristic's first) is installed and serves every 256-byte aligned call."""
    from gemmrl.baselines.impls import cublas_lib

    lib = cublas_lib()
    M = N = K = 8192  # 2^40 FLOPs: over max_flops, torch.matmul's without an installed plan
    algos = lib.heuristic("TN", "fp16", "fp32", M, N, K, requested=8)
    assert algos
    dev = torch.cuda.current_device()
    assert fast.lt_install(M, N, K, True, "fp16", dev, b"\0" * 64) is False, "cuBLASLt checks it"
    assert fast.lt_install(M, N, K, True, "fp16", dev, algos[-1]) is True
    try:
        assert fast.stats()["lt"]["installed"] == 1
        a, w = _aligned(M, K), _aligned(N, K, seed=1) / K ** 0.5
        n = _calls(fast)
        with torch.inference_mode():
            c = gemmrl.matmul(a, w, b_layout="TN")
            t = torch.matmul(a, w.t())
        assert _calls(fast) == n + 1
        ref = a.float() @ w.float().t()
        assert _err(c, ref) <= 2 * _err(t, ref) + 1e-4
    finally:
        fast.clear()
    assert fast.stats()["lt"]["installed"] == 0


def test_a_shipped_pack_installs_its_algorithms_on_its_gpu(fast):
    from pathlib import Path

    from gemmrl.bench.env import gpu_slug
    from gemmrl.runtime.pack import load_pack

    packs = Path(__file__).resolve().parents[1] / "packs"
    mine = [p for p in sorted(packs.glob(f"{gpu_slug(torch.cuda.get_device_name())}-fp16-F32*"))
            if (p / "manifest.json").is_file()]
    if not mine:
        pytest.skip(f"no shipped pack for {torch.cuda.get_device_name()}")
    pack = load_pack(mine[0])
    if not pack.lt_algos:
        pytest.skip(f"{mine[0]} has no lt_algos")
    try:
        ops.use_pack(pack)
        st = ops.lt_status()
        if fast.lt_version() != pack.lt_version:
            assert st["installed"] == 0 and "heuristic plans" in st["note"]
            return
        assert st["installed"] == len(pack.lt_algos) and st["refused"] == 0, st
        (M, N, K, layout), _ = next(iter(pack.lt_algos.items()))
        a = _aligned(M, K)
        b = _aligned(*((N, K) if layout == "TN" else (K, N)), seed=2)
        with torch.inference_mode():
            assert ops.explain(a, b, layout).startswith("cuBLASLt (the pack autotuned algorithm)")
            n = _calls(fast)
            c = gemmrl.matmul(a, b, b_layout=layout)
            assert _calls(fast) == n + 1
        ref = a.float() @ (b.float().t() if layout == "TN" else b.float())
        assert _err(c, ref) < 1e-2
        # the product as the harness times it names the algorithm in its verification record
        # (the pack's lt_algos rule counts the product's sessions by it)
        from gemmrl.core.problem import Problem
        from gemmrl.runtime.pack_impl import PackMatmul

        impl = PackMatmul(mine[0], layout)
        impl.prepare(Problem(M, N, K))
        assert impl.describe()["served"] is None and impl.describe()["served_lt"] == pack.lt_algos[(M, N, K, layout)].hex()
    finally:
        ops.use_pack(None)
    assert fast.stats()["lt"]["installed"] == 0


def test_a_packs_algorithms_serve_every_gpu_of_its_model(fast):
    """On a machine with several GPUs of the pack's model, the pack's cuBLASLt algorithms are
    installed on each, and a call on the second GPU runs its shape's installed algorithm there
    with a right result."""
    from pathlib import Path

    from gemmrl.bench.env import gpu_slug
    from gemmrl.runtime.pack import load_pack

    name = torch.cuda.get_device_name(0)
    same = [d for d in range(torch.cuda.device_count()) if torch.cuda.get_device_name(d) == name]
    if len(same) < 2:
        pytest.skip("needs two GPUs of one model")
    packs = Path(__file__).resolve().parents[1] / "packs"
    mine = [p for p in sorted(packs.glob(f"{gpu_slug(name)}-fp16-F32*")) if (p / "manifest.json").is_file()]
    if not mine or not load_pack(mine[0]).lt_algos:
        pytest.skip(f"no shipped pack with lt_algos for {name}")
    pack = load_pack(mine[0])
    if fast.lt_version() != pack.lt_version:
        pytest.skip("another cuBLASLt version than the pack's")
    try:
        with torch.cuda.device(same[0]):
            ops.use_pack(pack)
            st = ops.lt_status()
        assert set(same) <= set(st["devices"]) and st["refused"] == 0, st
        assert all(st["devices"][d] == len(pack.lt_algos) for d in same), st
        (M, N, K, layout), _ = next(iter(pack.lt_algos.items()))
        with torch.cuda.device(same[1]):
            a = _aligned(M, K)
            b = _aligned(*((N, K) if layout == "TN" else (K, N)), seed=2)
            assert a.device.index == same[1]
            with torch.inference_mode():
                assert ops.explain(a, b, layout).startswith("cuBLASLt (the pack autotuned algorithm)")
                n = _calls(fast)
                c = gemmrl.matmul(a, b, b_layout=layout)
                assert _calls(fast) == n + 1 and c.device == a.device
            ref = a.float() @ (b.float().t() if layout == "TN" else b.float())
            assert _err(c, ref) < 1e-2
    finally:
        ops.use_pack(None)
