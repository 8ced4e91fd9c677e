"""CUTLASS sm90 family on a GPU: rendered specs build, pass every harness check (exact, random,
guards, stream and own-kernel trace) on shapes with residues, refuse unaligned shapes without
launching, and replay inside a CUDA graph. Skipped without CUDA or without CUTLASS headers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("sm_90a kernels need a Hopper (compute capability 9.0) GPU", allow_module_level=True)

from gemmrl.build.nvcc import build_shared  # noqa: E402
from gemmrl.core.problem import Problem  # noqa: E402
from gemmrl.runtime.abi import AbiImpl  # noqa: E402
from gemmrl.space import cutlass_sm90 as cs  # noqa: E402
from gemmrl.space.cutlass_sm90 import CutlassSpec, render, valid  # noqa: E402
from gemmrl.verify.checks import residue_problems, verify_many  # noqa: E402

SPECS = [
    # cooperative, persistent, NN, 2x1 cluster (B multicast), fp32 accumulate
    CutlassSpec(128, 256, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32"),
    # ping-pong, TN, fp16 accumulate
    CutlassSpec(64, 128, 64, 1, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp16"),
    # stream-K, TN, bf16
    CutlassSpec(128, 128, 64, 1, 1, "cooperative", "streamk", 1, 0, "heuristic", 1, "TN", "bf16", "fp32"),
    # split-K 4, NN, 1x2 cluster (A multicast), explicit stages, raster along N with swizzle
    CutlassSpec(128, 128, 64, 1, 2, "cooperative", "splitk", 4, 3, "along_n", 4, "NN", "fp16", "fp32"),
    # split-K 8 with the separate reduction kernel, NN, cooperative
    CutlassSpec(128, 128, 64, 1, 1, "cooperative", "splitk", 8, 0, "heuristic", 1, "NN", "fp16", "fp32",
                "separate"),
    # split-K 16 with the separate reduction kernel, TN, ping-pong, bf16
    CutlassSpec(64, 128, 64, 1, 1, "pingpong", "splitk", 16, 0, "heuristic", 1, "TN", "bf16", "fp32",
                "separate"),
    # the register-to-global epilogue on an odd-width narrow tile, NN, 1x2 cluster; and TN fp16
    CutlassSpec(64, 80, 128, 1, 2, "pingpong", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                epilogue="nosmem"),
    CutlassSpec(64, 16, 128, 1, 2, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp16",
                epilogue="nosmem"),
    # launched as programmatic dependents: a narrow ping-pong tile (few CTAs, free SMs for the
    # next launch to start on) and a cooperative 2x1-cluster one, TN
    CutlassSpec(64, 32, 128, 1, 2, "pingpong", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                pdl=True),
    CutlassSpec(128, 128, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32",
                pdl=True),
    # the lean one-tile-per-CTA kernels: producer + one consumer warpgroup (ws), NN, 1x2 cluster;
    # ws with the register-to-global epilogue, TN, fp16 accumulate; ws bf16 with a 128-row tile
    # (two wgmma rows per warpgroup); one warpgroup doing loads and MMAs (tma), TN, 2x1 cluster
    CutlassSpec(64, 64, 64, 1, 2, "ws", "tile", 1, 0, "heuristic", 1, "NN", "fp16", "fp32"),
    CutlassSpec(64, 16, 128, 1, 1, "ws", "tile", 1, 0, "heuristic", 1, "TN", "fp16", "fp16", epilogue="nosmem"),
    CutlassSpec(128, 128, 64, 1, 1, "ws", "tile", 1, 0, "heuristic", 1, "NN", "bf16", "fp32"),
    CutlassSpec(128, 64, 64, 2, 1, "tma", "tile", 1, 0, "heuristic", 1, "TN", "fp16", "fp32", epilogue="nosmem"),
    # wider TMA epilogue subtiles (epi_n): ping-pong 128x192 with 64x96 subtiles, TN; cooperative
    # 256x128 with 128x128 ones, NN, 2x1 cluster
    CutlassSpec(128, 192, 64, 2, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32", epi_n=96),
    CutlassSpec(256, 128, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32", epi_n=128),
    # swapped (swap_ab: C^T = B^T A^T, D column-major): the 128x192 tile over N x M with a 2x1
    # cluster (the problem's A multicast), NN; the same tile without a cluster, TN
    CutlassSpec(128, 192, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                swap_ab=True),
    CutlassSpec(128, 192, 64, 1, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32",
                swap_ab=True),
    # cuBLASLt's big-output tile, 128x160: cooperative swapped with a 2x1 cluster, NN (its own
    # pick's form); ping-pong unswapped, TN (160 accumulator registers a thread)
    CutlassSpec(128, 160, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                swap_ab=True),
    CutlassSpec(128, 160, 64, 1, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32"),
    # wide clusters (TMA multicast to 4 and 8 CTAs) with split-K: 2x2 with the in-kernel
    # reduction, NN; 2x4 with the separate reduction, TN; 4x2 ping-pong with it, NN
    CutlassSpec(128, 128, 64, 2, 2, "cooperative", "splitk", 8, 0, "heuristic", 1, "NN", "fp16", "fp32"),
    CutlassSpec(128, 64, 64, 2, 4, "cooperative", "splitk", 16, 0, "heuristic", 1, "TN", "fp16", "fp32",
                "separate"),
    CutlassSpec(64, 128, 64, 4, 2, "pingpong", "splitk", 8, 0, "heuristic", 1, "NN", "fp16", "fp32", "separate"),
    # the separate reduction of an fp16 accumulator (fp16 partials summed in fp32): ping-pong
    # 64x64 split 16, NN; cooperative 128x128 split 32, TN
    CutlassSpec(64, 64, 64, 1, 1, "pingpong", "splitk", 16, 0, "heuristic", 1, "NN", "fp16", "fp16", "separate"),
    CutlassSpec(128, 128, 64, 1, 1, "cooperative", "splitk", 32, 0, "heuristic", 1, "TN", "fp16", "fp16",
                "separate"),
    # swapped with the separate reduction (cuBLASLt's short-M split-K tiles: 64 along N, a 1x2
    # cluster; the column-major D packs each [M,N] partial): NN fp32 split 2; TN fp16 split 4
    CutlassSpec(64, 32, 64, 1, 2, "pingpong", "splitk", 2, 0, "heuristic", 1, "NN", "fp16", "fp32", "separate",
                swap_ab=True),
    CutlassSpec(64, 32, 64, 1, 2, "pingpong", "splitk", 4, 0, "heuristic", 1, "TN", "fp16", "fp16", "separate",
                swap_ab=True),
    # the lean kernels with few stages, two blocks to an SM (cutlass_sm90.resident_twins): 64x128
    # with 2 stages and a 2x1 cluster, TN; 128x96 swapped with 3, NN (K of many k-blocks through
    # a short ring)
    CutlassSpec(64, 128, 64, 2, 1, "ws", "tile", 1, 2, "heuristic", 1, "TN", "fp16", "fp32"),
    CutlassSpec(128, 96, 64, 2, 1, "ws", "tile", 1, 3, "heuristic", 1, "NN", "fp16", "fp32", swap_ab=True),
]
PDL_SPECS = [s for s in SPECS if s.pdl]


@pytest.fixture(scope="module")
def built(request):
    """The specs this session's selected tests use, built in parallel (all of them when the whole
    file runs; `-k` picks fewer builds)."""
    try:
        dirs = cs.include_dirs()
    except FileNotFoundError as e:
        pytest.skip(f"CUTLASS headers not found ({e})")
    wanted = {item.callspec.params["spec"].name for item in request.session.items
              if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
              and "spec" in item.callspec.params}
    specs = [s for s in SPECS if s.name in wanted] or SPECS

    from gemmrl.build.ahead import job_for

    def one(spec):  # the build the product makes (and a carried build cache holds)
        assert dirs
        job = job_for(spec, Problem(1664, 1408, 2048, spec.dtype, spec.acc))
        return build_shared(job.source, name=job.name, **job.kwargs)

    with ThreadPoolExecutor(len(specs)) as ex:
        return dict(zip((s.name for s in specs), ex.map(one, specs)))


def _problems(spec: CutlassSpec) -> list[Problem]:
    """residue_problems() of a base shape, kept where valid() accepts them (K and N multiples of
    8), plus residues in every dimension that TMA must clip, a tiny problem, and one with wave
    quantization on 132 SMs (143 128x128 tiles: stream-K splits the last wave). The separate
    reduction serves K in multiples of 8 x splits: its K values are rounded up to those."""
    d, a = spec.dtype, spec.acc
    cands = residue_problems(Problem(512, 768, 1024, d, a)) + [
        Problem(513, 776, 1032, d, a), Problem(127, 136, 72, d, a), Problem(1, 8, 8, d, a),
        Problem(1664, 1408, 2048, d, a)]
    if spec.swap_ab:  # the narrow outputs over many rows it is for, with residues
        cands += [Problem(12288, 256, 1024, d, a), Problem(3001, 264, 520, d, a)]
    if cs.separate(spec):
        step = 8 * spec.splits
        cands = [Problem(p.M, p.N, -(-p.K // step) * step, d, a) for p in cands]
        cands = list(dict.fromkeys(cands)) + [Problem(256, 256, 16384, d, a), Problem(72, 1000, 8 * step, d, a)]
    if spec.cluster_m * spec.cluster_n >= 4:  # a cluster overhanging the tile grid on both sides
        step = 8 * spec.splits
        cands += [Problem(200, 328, 16 * step, d, a), Problem(520, 136, 24 * step, d, a)]
    keep = [p for p in cands if valid(spec, p) is None]
    assert len(keep) >= 6
    return keep


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_verifies_on_residue_shapes(built, spec):
    r = built[spec.name]
    assert r.ok, r.log[-4000:]
    assert "C7510" not in r.log and r.spills == 0
    impl = AbiImpl(r.path, name=spec.name)
    res = verify_many(impl, _problems(spec))
    assert res.passed, res.reason


@pytest.mark.parametrize("spec", [s for s in SPECS if s.swap_ab], ids=lambda s: s.name)
def test_swapped_kernel_writes_c_row_major_within_its_leading_dimension(built, spec):
    """Same inputs through a swapped kernel and torch: C row-major [M, N] either way, with a
    leading dimension wider than N (the column-major D's stride is ldc) whose padding stays."""
    impl = AbiImpl(built[spec.name].path, name=spec.name)
    M, N, K, ldc = 1000, 264, 512, 272
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(M, K, device="cuda", generator=g).half()
    b = torch.randn(K, N, device="cuda", generator=g).half()
    b_arg = b if spec.layout == "NN" else b.t().contiguous()
    ldb = N if spec.layout == "NN" else K
    c = torch.full((M, ldc), 7.0, dtype=torch.float16, device="cuda")
    ws = torch.empty(max(impl.kernel.workspace_bytes(M, N, K), 1), dtype=torch.uint8, device="cuda")
    status = impl.kernel.run(a.data_ptr(), b_arg.data_ptr(), c.data_ptr(), M, N, K, K, ldb, ldc,
                             ws.data_ptr() if impl.kernel.workspace_bytes(M, N, K) else 0,
                             torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert status == 0
    assert torch.allclose(c[:, :N].float(), a.float() @ b.float(), rtol=1e-2, atol=5e-2)
    assert bool((c[:, N:] == 7).all()), "wrote past N into the padding"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_unaligned_shapes_are_refused_without_launching(built, spec):
    r = built[spec.name]
    assert r.ok, r.log[-2000:]
    impl = AbiImpl(r.path, name=spec.name)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    M, N, K = 64, 64, 60  # K not a multiple of 8: valid() refuses, so must the kernel
    assert valid(spec, Problem(M, N, K, spec.dtype, spec.acc)) is not None
    a = torch.zeros(M, K, dtype=dt, device="cuda")
    b = torch.zeros(K * N, dtype=dt, device="cuda")
    c = torch.full((M, N), 7.0, dtype=dt, device="cuda")
    ldb = N if spec.layout == "NN" else K
    status = impl.kernel.run(a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, K, ldb, N, 0,
                             torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert status == 3
    assert bool((c == 7).all()), "C changed although the call was refused"


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[4], SPECS[5], SPECS[10], SPECS[13], SPECS[14], SPECS[-3]],
                         ids=lambda s: s.name)
def test_cuda_graph_capture_and_replay(built, spec):
    """The call is capturable (stream-K's workspace clear is a memset node; the separate
    reduction's second kernel a programmatic dependent launch) and replays with the inputs'
    current values."""
    r = built[spec.name]
    assert r.ok, r.log[-2000:]
    impl = AbiImpl(r.path, name=spec.name)
    p = Problem(1664, 1408, 2048, spec.dtype, spec.acc)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    a = torch.randn(p.M, p.K, device="cuda").to(dt)
    b_nn = torch.randn(p.K, p.N, device="cuda").to(dt)
    b_tn = b_nn.t().contiguous()
    c = torch.empty(p.M, p.N, dtype=dt, device="cuda")
    call = impl.prepare(p)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(a, b_nn, b_tn, c)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(a, b_nn, b_tn, c)
    for _ in range(2):
        a.copy_(torch.randn_like(a, dtype=torch.float32).to(dt))
        c.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = a.float() @ b_nn.float()
        err = ((c.float() - ref).norm() / ref.norm()).item()
        assert err < (1e-3 if (spec.dtype, spec.acc) == ("fp16", "fp32") else 8e-3), err


@pytest.mark.parametrize("spec", PDL_SPECS, ids=lambda s: s.name)
def test_programmatic_dependent_launches_wait_for_the_kernel_before_them(built, spec):
    """A chain of GEMMs on one stream, each reading the output of the one before (X[i+1] =
    X[i] @ W[i]), launched back to back as programmatic dependents, eagerly and replayed from a
    CUDA graph: every link must equal its reference computed from the previous link's output.
    A kernel that read its input before the previous grid's writes were visible would read the
    NaN poison or a partial tile."""
    r = built[spec.name]
    assert r.ok, r.log[-2000:]
    impl = AbiImpl(r.path, name=spec.name)
    M, K, links = 256, 1024, 8  # square links: each output is the next input
    p = Problem(M, K, K, spec.dtype, spec.acc)
    assert valid(spec, p) is None
    call = impl.prepare(p)
    dt = torch.float16
    w = [(torch.randn(K, K, device="cuda") / K ** 0.5).to(dt) for _ in range(links)]
    w_tn = [x.t().contiguous() for x in w]
    xs = [torch.randn(M, K, device="cuda").to(dt)] + [torch.empty(M, K, dtype=dt, device="cuda") for _ in range(links)]

    def chain():
        for i in range(links):
            call(xs[i], w[i], w_tn[i], xs[i + 1])

    def check(how):
        torch.cuda.synchronize()
        for i in range(links):
            ref = xs[i].float() @ w[i].float()
            err = ((xs[i + 1].float() - ref).norm() / ref.norm()).item()
            assert err < 1e-3, f"{how}: link {i}: error {err:.2e}"

    def poison():
        for x in xs[1:]:
            x.fill_(float("nan"))

    chain()  # warm: the kernel's attributes set, outside the capture
    for _ in range(3):
        poison()
        chain()
        check("eager")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        chain()
    for _ in range(3):
        xs[0].copy_(torch.randn(M, K, device="cuda").to(dt))
        poison()
        g.replay()
        check("graph")


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[4]], ids=lambda s: s.name)
def test_the_entry_cache_build_passes_the_harness_and_writes_the_same_c(spec):
    """The default source (the driver's TMA encoder looked up once per process: ENTRY_CACHE_PREFIX)
    passes the harness checks on residue shapes and writes bit-identical C to CUTLASS's own host
    path (render(entry_cache=False)) on one shape, calls after the first included (the ones that
    use the kept entry point)."""
    from gemmrl.build.ahead import job_for

    job = job_for(spec, Problem(1664, 1408, 2048, spec.dtype, spec.acc))  # the product's flags
    r = build_shared(render(spec), name=spec.name, **job.kwargs)
    assert r.ok, r.log[-4000:]
    r0 = build_shared(render(spec, entry_cache=False), name=spec.name, **job.kwargs)
    assert r0.ok, r0.log[-4000:]
    assert r.path != r0.path  # two builds, not one cached twice
    cached, plain = AbiImpl(r.path, name=spec.name + "+entry"), AbiImpl(r0.path, name=spec.name)
    res = verify_many(cached, _problems(spec))
    assert res.passed, res.reason
    p = Problem(1664, 1408, 2048, spec.dtype, spec.acc)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    a = torch.randn(p.M, p.K, device="cuda").to(dt)
    b_nn = torch.randn(p.K, p.N, device="cuda").to(dt)
    b_tn = b_nn.t().contiguous()
    outs = []
    for impl in (plain, cached):
        call = impl.prepare(p)
        for _ in range(3):
            c = torch.full((p.M, p.N), float("nan"), dtype=dt, device="cuda")
            call(a, b_nn, b_tn, c)
        outs.append(c)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
