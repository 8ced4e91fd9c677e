"""The runtime on a GPU: a tiny pack of two real specs (a CUTLASS kernel, generic, and a raw
kernel for one shape) served through gemmrl.matmul, a captured CUDA graph, torch.compile and a
patched model; the C++ fast path against the Python dispatch; the host overhead per call of
both beside torch.matmul's is printed (and written to GEMMRL_TEST_OUT)."""

import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gemmrl  # noqa: E402
from gemmrl.core.problem import Problem  # noqa: E402
from gemmrl.runtime import fastpath, ops  # noqa: E402
from gemmrl.runtime.dispatch import Dispatcher  # noqa: E402
from gemmrl.runtime.pack import export_pack, load_pack  # noqa: E402
from gemmrl.space import cutlass_sm90, raw  # noqa: E402
from gemmrl.store.db import Store  # noqa: E402

pytestmark = pytest.mark.gpu

P_CUT = Problem(256, 1024, 512)   # served by a CUTLASS kernel (and every shape near it it accepts)
P_RAW = Problem(16, 1024, 4096)   # served by a raw kernel built for this shape only


def _rel_err(c, ref):
    return ((c.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the pack's kernels are sm_90a (Hopper)")
    try:
        from gemmrl.build.cutlass import cutlass_include_dirs
        from gemmrl.build.nvcc import nvcc_path

        nvcc_path()
        cutlass_include_dirs()
    except Exception as e:
        pytest.skip(f"cannot build kernels here: {e}")
    cache = os.environ.get("GEMMRL_CACHE") or str(tmp_path_factory.getbasetemp() / "gemmrl-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("GEMMRL_CACHE", cache)  # the same cache conftest gives each test
    from gemmrl.bench.env import provenance

    root = tmp_path_factory.mktemp("runtime")
    dev = torch.cuda.get_device_name()
    store = Store(root / "s.sqlite")
    run = store.start_run("test_runtime_gpu", dev, provenance(), {})
    for p, fam, spec in ((P_CUT, "cutlass_sm90", cutlass_sm90.heuristic_specs(P_CUT, "TN")[0]),
                         (P_RAW, "raw", raw.heuristic_specs(P_RAW, "TN")[0])):
        store.put_tuning(dev, p, "gemmrl-ours", json.dumps({"family": fam, "spec": dict(spec.__dict__)}).encode(),
                         spec.name, 1.0)
        store.record_verification(run, dev, p, "gemmrl-ours", True, "ok", {})
    path = export_pack(store, dev, root / "pack", "fp16", "fp32")
    store.close()
    d = ops.use_pack(path, nearest=math.inf)  # serving far shapes is what some tests check
    t0 = time.monotonic()
    failed = gemmrl.warmup()
    print(f"\nbuilt and loaded {len(d.pack.entries)} kernels in {time.monotonic() - t0:.0f} s")
    assert not failed, failed
    yield load_pack(path)
    ops.use_pack(None)
    mp.undo()


def _inputs(M, N, K, seed=0, batch=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (*batch, K) if batch else (M, K)
    a = torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16, generator=g) / K ** 0.5
    return a, w


@pytest.mark.parametrize("M, N, K, batch, how", [
    (256, 1024, 512, None, "exact"),
    (300, 1024, 512, None, "nearest 256x1024x512"),
    (2000, 2048, 1024, None, "nearest 256x1024x512"),
    (256, 1024, 512, (2, 128), "exact"),
    (16, 1024, 4096, None, "exact"),
])
def test_served_shapes_match_torch(pack, M, N, K, batch, how):
    a, w = _inputs(M, N, K, batch=batch)
    with torch.inference_mode():
        assert ops.explain(a, w, "TN").endswith(f"({how})"), ops.explain(a, w, "TN")
        c = gemmrl.matmul(a, w, b_layout="TN")
        ref = torch.matmul(a, w.t())
        c_nn = gemmrl.matmul(a, w.t().contiguous())  # NN: no NN kernel in the pack: fallback
    torch.cuda.synchronize()
    assert c.shape == ref.shape and c.dtype == ref.dtype
    assert _rel_err(c, ref) < 1e-3
    assert _rel_err(c_nn, ref) < 1e-3  # the fallback: cuBLASLt (test_fallbacks_* check it closer)


def test_a_tuned_shape_the_libraries_won_goes_to_the_library(pack):
    """The pack's winners are TN: the NN layout of each tuned shape is listed under `library`,
    and an NN call there is the fallback's (cuBLASLt, or torch.matmul), saying why."""
    assert {(256, 1024, 512, "NN"), (16, 1024, 4096, "NN")} <= pack.library
    a, w = _inputs(256, 1024, 512)
    b = w.t().contiguous()
    with torch.inference_mode():
        why = ops.explain(a, b, "NN")
        c = gemmrl.matmul(a, b)
    torch.cuda.synchronize()
    assert why == ("cuBLASLt: tuned on this GPU, where the libraries beat every kernel of ours "
                   "in this layout"), why
    assert _rel_err(c, torch.matmul(a, b)) < 1e-3
    ops.set_fallback("torch")
    try:
        with torch.inference_mode():
            assert ops.explain(a, b, "NN").startswith("torch.matmul: tuned on this GPU")
            assert torch.equal(gemmrl.matmul(a, b), torch.matmul(a, b))
    finally:
        ops.set_fallback("cublaslt")


def test_unserved_shapes_are_cublaslt_or_exactly_torch_matmul(pack):
    fast = _fast_or_fail()
    assert fast.stats()["lt"]["compiled"], "the fast path was built without cuBLASLt under a CUDA torch"
    # raw kernels serve their own shape only; CUTLASS ones need K % 8 == 0 (TMA), so no
    # kernel of the pack serves these (17x1024x4096 is served: by the CUTLASS kernel)
    for M, N, K in ((17, 1024, 4100), (256, 1024, 516)):
        a, w = _inputs(M, N, K)
        ref = a.float() @ w.float().t()
        with torch.inference_mode():
            assert ops.explain(a, w, "TN").startswith("cuBLASLt: no tuned kernel")
            n = fast.stats()["lt"]["calls"]
            c = gemmrl.matmul(a, w, b_layout="TN")
            assert fast.stats()["lt"]["calls"] == n + 1
            assert _rel_err(c, ref) <= 2 * _rel_err(torch.matmul(a, w.t()), ref) + 1e-4
            ops.set_fallback("torch")
            try:
                assert ops.explain(a, w, "TN").startswith("torch.matmul: no tuned kernel")
                assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))
                assert fast.stats()["lt"]["calls"] == n + 1
            finally:
                ops.set_fallback("cublaslt")


def test_inside_a_captured_cuda_graph(pack):
    d = ops.active()
    cases = [_inputs(256, 1024, 512), _inputs(16, 1024, 4096)]
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (builds, loads) before capture, as for any graph
            for a, w in cases:
                gemmrl.matmul(a, w, b_layout="TN")
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [gemmrl.matmul(a, w, b_layout="TN") for a, w in cases]
            capture_stream = torch.cuda.current_stream().cuda_stream
        for i, (a, w) in enumerate(cases):
            a.copy_(torch.randn_like(a) * (i + 2))
        g.replay()
        torch.cuda.synchronize()
        for (a, w), c in zip(cases, outs):
            assert _rel_err(c, torch.matmul(a, w.t())) < 1e-3
    captured = [k for k, v in d._calls.items() if k[6] == capture_stream and v is not None]
    assert len(captured) == 2, "the graph holds gemmrl's kernels, not the fallback"


def test_under_torch_compile_and_patched_model(pack):
    torch._dynamo.reset()
    fn = torch.compile(lambda a, w: gemmrl.matmul(a, w, b_layout="TN").relu(), fullgraph=True)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU()).cuda().half()
    x = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        a, w = _inputs(256, 1024, 512)
        assert _rel_err(fn(a, w), torch.matmul(a, w.t()).relu()) < 1e-3
        ref = model(x)
        gemmrl.patch(model)
        assert _rel_err(model(x), ref) < 1e-3
        assert _rel_err(torch.compile(model)(x), ref) < 1e-3
        gemmrl.unpatch(model)
    torch._dynamo.reset()


def test_never_compile_finds_the_warmed_up_kernels(pack):
    d = Dispatcher(pack, never_compile=True)
    for e in pack.entries:
        assert d.kernel(e).meta.layout == "TN"


def _fast_or_fail():
    fast = ops._fast()
    assert fast is not None, f"the C++ fast path did not build here: {fastpath._failed}"
    assert fast.stats()["cuda_stream"], "built without the CUDA branch under a CUDA torch"
    return fast


@pytest.mark.parametrize("M, N, K", [(256, 1024, 512), (300, 1024, 512), (16, 1024, 4096)])
def test_cpp_path_matches_the_python_path(pack, M, N, K, monkeypatch):
    fast = _fast_or_fail()
    assert gemmrl.matmul is fast.matmul  # with CUDA, gemmrl.matmul is the C++ module's own
    a, w = _inputs(M, N, K, seed=3)
    dev = torch.cuda.current_device()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(s):  # a side stream: the key must be its
        hits = fast.stats()["hits"]
        for _ in range(2):  # a miss resolved in Python, then a hit
            c_cpp = gemmrl.matmul(a, w, b_layout="TN")
        assert fast.stats()["hits"] == hits + 2, fast.stats()
        entry = fast.lookup(M, N, K, True, "fp16", dev, s.cuda_stream)
        call = ops.active()._calls[(M, N, K, "TN", "fp16", dev, s.cuda_stream)]
        assert entry == (call.fn_ptr, call.ws_ptr, call.ldb)  # C++ read the stream Python sees
        o_cpp = torch.full_like(c_cpp, float("nan"))
        assert gemmrl.matmul(a, w, b_layout="TN", out=o_cpp) is o_cpp  # out=: written by the kernel
        with monkeypatch.context() as m:
            m.setattr(ops, "_FAST", None)  # the Python dispatch (ops.matmul), same kernel
            c_py = ops.matmul(a, w, b_layout="TN")
            o_py = torch.full_like(c_py, float("nan"))
            assert ops.matmul(a, w, b_layout="TN", out=o_py) is o_py
    torch.cuda.synchronize()
    assert torch.equal(o_cpp, c_cpp) and torch.equal(o_py, c_py)
    assert c_cpp.shape == c_py.shape and c_cpp.dtype == c_py.dtype
    assert _rel_err(c_cpp, c_py) < 1e-6 or torch.equal(c_cpp, c_py)
    assert _rel_err(c_cpp, torch.matmul(a, w.t())) < 1e-3
    # an unserved shape is a C++ fallback entry, computed by cuBLASLt
    a2, w2 = _inputs(17, 1024, 4100)
    with torch.inference_mode():
        for _ in range(2):
            assert _rel_err(gemmrl.matmul(a2, w2, b_layout="TN"), torch.matmul(a2, w2.t())) < 1e-3
    # a fallback entry for this (device, stream), or, with no kernel for the shape at all, per shape
    assert (fast.lookup(17, 1024, 4100, True, "fp16", dev, torch.cuda.current_stream().cuda_stream) is False
            or fast.is_unserved(17, 1024, 4100, True, "fp16"))


def test_host_overhead_per_call(pack, monkeypatch):
    fast = _fast_or_fail()
    a, w = _inputs(16, 1024, 4096)
    b_nn, c = w.t().contiguous(), torch.empty(16, 1024, device="cuda", dtype=torch.float16)
    calls = {"torch.matmul": lambda: torch.matmul(a, w.t()),
             "gemmrl.matmul": lambda: gemmrl.matmul(a, w, b_layout="TN"),
             "torch.ops.gemmrl.mm": lambda: torch.ops.gemmrl.mm(a, w, "TN"),
             "ops.matmul (Python frame, C++ table)": lambda: ops.matmul(a, w, b_layout="TN"),
             "gemmrl.matmul (Python dispatch)": lambda: ops.matmul(a, w, b_layout="TN"),
             "torch.ops.gemmrl.mm (Python dispatch)": lambda: torch.ops.gemmrl.mm(a, w, "TN"),
             # out=, as the harness calls both (bench --impl pack:DIR); NN has no kernel in this
             # pack: the fallback, computed in C++, against torch.matmul called from Python
             "torch.matmul out= TN": lambda: torch.matmul(a, w.t(), out=c),
             "gemmrl.matmul out= TN": lambda: gemmrl.matmul(a, w, b_layout="TN", out=c),
             "torch.matmul out= NN": lambda: torch.matmul(a, b_nn, out=c),
             "gemmrl.matmul out= NN (fallback)": lambda: gemmrl.matmul(a, b_nn, out=c),
             "gemmrl.matmul NN (fallback)": lambda: gemmrl.matmul(a, b_nn)}
    # host (enqueue) time: bursts of 200 calls, well under the launch queue's depth (~1000), so
    # the host never waits for the GPU; the median over 25 bursts, the implementations interleaved
    n, reps, res = 200, 25, {}
    per: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for name, fn in calls.items():
            monkeypatch.setattr(ops, "_FAST", None if "Python dispatch" in name else fast)
            for _ in range(50):
                fn()
        torch.cuda.synchronize()
        for _ in range(reps):
            for name, fn in calls.items():
                monkeypatch.setattr(ops, "_FAST", None if "Python dispatch" in name else fast)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                per[name].append((time.perf_counter() - t0) / n * 1e6)
                torch.cuda.synchronize()
    res = {name: statistics.median(v) for name, v in per.items()}
    over = {k: res[k] - res["torch.matmul"] for k in res if k != "torch.matmul"}
    print("\nhost us per call, 16x1024x4096 TN fp16: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items())
          + "; over torch.matmul: " + ", ".join(f"{k} {v:+.2f}" for k, v in over.items()))
    if os.environ.get("GEMMRL_TEST_OUT"):  # xdist swallows prints: keep the numbers in a file
        Path(os.environ["GEMMRL_TEST_OUT"], "host-overhead.json").write_text(json.dumps(
            {"shape": "16x1024x4096", "layout": "TN", "dtype": "fp16", "host_us_per_call": res,
             "host_us_over_torch_matmul": over, "dispatch": "gemmrl.matmul and torch.ops.gemmrl.mm: "
             "the C++ fast path; '(Python dispatch)': with it turned off", "fast_path": fast.stats(),
             "device": torch.cuda.get_device_name()}, indent=1))
    assert all(v > 0 for v in res.values())


def test_latency_per_call_as_offline_mode_times_it(pack):
    """What `bench --mode offline` sees: synchronize, call, synchronize, one call at a time, the
    calls interleaved in shuffled order; medians of 600. Served TN and fallback NN at
    16x1024x4096, fallback TN at 17x1024x4100 (K % 8: no kernel), each beside torch.matmul on the
    same layout, and fast.run called directly (the C++ path without gemmrl.matmul's Python)."""
    fast = _fast_or_fail()
    a, w = _inputs(16, 1024, 4096)
    b_nn, c = w.t().contiguous(), torch.empty(16, 1024, device="cuda", dtype=torch.float16)
    a2, w2 = _inputs(17, 1024, 4100)
    b2_nn, c2 = w2.t().contiguous(), torch.empty(17, 1024, device="cuda", dtype=torch.float16)
    calls = {
        "torch.matmul out= TN": lambda: torch.matmul(a, w.t(), out=c),
        "gemmrl.matmul out= TN (kernel)": lambda: gemmrl.matmul(a, w, b_layout="TN", out=c),
        "fast.run TN (kernel)": lambda: fast.run(a, w, True, c),
        "torch.matmul out= NN": lambda: torch.matmul(a, b_nn, out=c),
        "gemmrl.matmul out= NN (fallback)": lambda: gemmrl.matmul(a, b_nn, out=c),
        "ops.matmul out= NN (fallback, Python frame)": lambda: ops.matmul(a, b_nn, out=c),
        "fast.run NN (fallback)": lambda: fast.run(a, b_nn, False, c),
        "torch.matmul out= TN, K=4100": lambda: torch.matmul(a2, w2.t(), out=c2),
        "gemmrl.matmul out= TN, K=4100 (fallback)": lambda: gemmrl.matmul(a2, w2, b_layout="TN", out=c2),
        "torch.matmul out= NN, K=4100": lambda: torch.matmul(a2, b2_nn, out=c2),
        "gemmrl.matmul out= NN, K=4100 (fallback)": lambda: gemmrl.matmul(a2, b2_nn, out=c2),
    }
    rng = random.Random(0)
    per: dict[str, list[float]] = {name: [] for name in calls}
    sync = torch.cuda.synchronize
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(20):
                fn()
        for _ in range(600):
            order = list(calls)
            rng.shuffle(order)
            for name in order:
                sync()
                t0 = time.perf_counter()
                calls[name]()
                sync()
                per[name].append((time.perf_counter() - t0) * 1e6)
    res = {name: statistics.median(v) for name, v in per.items()}
    print("\nlatency us per call (offline style): " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()))
    if os.environ.get("GEMMRL_TEST_OUT"):
        Path(os.environ["GEMMRL_TEST_OUT"], "latency-offline-style.json").write_text(json.dumps(
            {"method": "synchronize; call; synchronize; median of 600, calls interleaved and shuffled",
             "latency_us": res, "p10_us": {k: sorted(v)[len(v) // 10] for k, v in per.items()},
             "fast_path": fast.stats(), "device": torch.cuda.get_device_name()}, indent=1))
    assert all(v > 0 for v in res.values())
