"""The raw family on a GPU: rendered kernels pass every harness check (exact, random, NaN poison,
guard bands, trace), residue shapes included, and the split-K counters reset themselves: calls
in a row, on a workspace full of garbage, and replays of a captured CUDA graph all stay right."""

from __future__ import annotations

import pytest

from gemmrl.core.problem import Problem
from gemmrl.space.raw import RawSpec, heuristic_specs, kernel_name, render, valid, workspace_bytes

pytestmark = pytest.mark.gpu

# (spec, problem): the three golden cases, then residues in M, N and K, swap_ab, fp16 accumulate, bf16
CASES = [
    (RawSpec(64, 64, 64, 2, 2, 4, 8, False, "NN", "fp32"), Problem(64, 64, 12288)),
    (RawSpec(64, 64, 64, 2, 2, 4, 16, False, "TN", "fp32"), Problem(512, 64, 12288)),
    (RawSpec(128, 128, 32, 2, 4, 3, 1, False, "NN", "fp32"), Problem(256, 4096, 512)),
    (RawSpec(64, 32, 64, 2, 2, 3, 4, False, "NN", "fp32"), Problem(65, 72, 4096)),
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "NN", "fp32"), Problem(65, 72, 4096)),
    (RawSpec(32, 32, 64, 2, 2, 2, 3, False, "TN", "fp32"), Problem(65, 72, 4104)),   # K tail
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "TN", "fp32"), Problem(33, 71, 4096)),    # odd N
    (RawSpec(32, 64, 32, 1, 2, 4, 1, False, "TN", "fp32"), Problem(33, 71, 4096)),   # odd N
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "NN", "fp16"), Problem(65, 72, 4096, "fp16", "fp16")),
    (RawSpec(64, 64, 64, 2, 2, 3, 1, False, "TN", "fp16"), Problem(128, 64, 64, "fp16", "fp16")),
    # the fetch-add arrival (arrive='add', 2026-11-30): a deep split, a swapped NN split with residues
    (RawSpec(64, 64, 64, 2, 2, 4, 16, False, "TN", "fp32", "add"), Problem(512, 64, 12288)),
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "NN", "fp32", "add"), Problem(65, 72, 4096)),
    # the shared-memory epilogue (epi='smem', 2026-11-30): residues, swapped, split-K, fp16, a short K
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "NN", "fp32", "add", "smem"), Problem(65, 72, 4096)),
    (RawSpec(32, 64, 32, 1, 2, 4, 1, False, "TN", "fp32", "cas", "smem"), Problem(33, 136, 4096)),
    (RawSpec(16, 32, 128, 1, 2, 4, 1, False, "TN", "fp16", "cas", "smem"), Problem(1024, 128, 64, "fp16", "fp16")),
    (RawSpec(128, 128, 32, 2, 4, 3, 1, False, "NN", "fp32", "cas", "smem"), Problem(256, 4096, 512)),
    # bf16 (2026-12-01): a swapped NN fetch-add split with residues, a staged TN tile, a deep TN split
    (RawSpec(64, 32, 64, 2, 2, 3, 4, True, "NN", "fp32", "add", dtype="bf16"), Problem(65, 72, 4096, "bf16", "fp32")),
    (RawSpec(32, 64, 32, 1, 2, 4, 1, False, "TN", "fp32", "cas", "smem", "bf16"), Problem(33, 136, 4096, "bf16", "fp32")),
    (RawSpec(64, 64, 64, 2, 2, 4, 16, False, "TN", "fp32", "add", dtype="bf16"), Problem(512, 64, 12288, "bf16", "fp32")),
]


def _ids():
    return [kernel_name(s, p) for s, p in CASES]


def _build(spec, problem, tmp_path):
    from gemmrl.runtime.abi import AbiImpl

    assert valid(spec, problem) is None
    path = tmp_path / f"{kernel_name(spec, problem)}.cu"
    path.write_text(render(spec, problem))
    return AbiImpl(str(path))


@pytest.mark.parametrize("spec,problem", CASES, ids=_ids())
def test_raw_kernel_passes_verify(spec, problem, tmp_path):
    from gemmrl.verify.checks import verify

    impl = _build(spec, problem, tmp_path)
    assert impl.kernel.workspace_bytes(problem.M, problem.N, problem.K) == workspace_bytes(spec, problem)
    res = verify(impl, problem)
    assert res.passed, (res.reason, res.details)


@pytest.mark.parametrize("problem", [Problem(64, 64, 12288), Problem(512, 64, 12288, "fp16", "fp32"),
                                     Problem(8, 4096, 4096), Problem(64, 64, 12288, "bf16", "fp32")],
                         ids=lambda p: f"{p.shape}-{p.dtype}")
def test_heuristic_first_choice_passes_verify(problem, tmp_path):
    from gemmrl.verify.checks import verify

    spec = heuristic_specs(problem, "TN")[0]
    res = verify(_build(spec, problem, tmp_path), problem)
    assert res.passed, (spec.name, res.reason)


def _reference(a, b, tn):
    return (a.float() @ (b.float().t() if tn else b.float())).to(a.dtype)


@pytest.mark.parametrize("spec,problem", [c for c in CASES if c[0].split_k > 1],
                         ids=[kernel_name(s, p) for s, p in CASES if s.split_k > 1])
def test_split_k_counters_reset_across_calls_and_graph_replays(spec, problem, tmp_path):
    import torch

    impl = _build(spec, problem, tmp_path)
    k = impl.kernel
    M, N, K = problem.M, problem.N, problem.K
    tn = spec.layout == "TN"
    dt = torch.bfloat16 if problem.dtype == "bf16" else torch.half
    # a workspace full of garbage: the counters must not need a memset, ever
    ws = torch.randint(0, 256, (workspace_bytes(spec, problem),), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()

    def call(a, b, c):
        rc = k.run(a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, K, K if tn else N, N,
                   ws.data_ptr(), stream.cuda_stream)
        assert rc == 0

    # exact {0,1} inputs: every call must be bit-exact; several calls in a row
    for i in range(3):
        g = torch.Generator(device="cuda").manual_seed(i)
        a = (torch.rand(M, K, generator=g, device="cuda") < 0.1).to(dt)
        b = (torch.rand(*((N, K) if tn else (K, N)), generator=g, device="cuda") < 0.1).to(dt)
        c = torch.full((M, N), float("nan"), dtype=dt, device="cuda")
        call(a, b, c)
        torch.cuda.synchronize()
        assert torch.equal(c, _reference(a, b, tn)), f"call {i}"

    # a captured graph, replayed with new inputs in the same buffers
    a = torch.zeros(M, K, dtype=dt, device="cuda")
    b = torch.zeros(*((N, K) if tn else (K, N)), dtype=dt, device="cuda")
    c = torch.zeros(M, N, dtype=dt, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            rc = k.run(a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, K, K if tn else N, N,
                       ws.data_ptr(), side.cuda_stream)
    stream.wait_stream(side)
    assert rc == 0
    for i in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        a.copy_((torch.rand(a.shape, generator=g, device="cuda") < 0.1).to(dt))
        b.copy_((torch.rand(b.shape, generator=g, device="cuda") < 0.1).to(dt))
        c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c, _reference(a, b, tn)), f"replay {i}"


def test_wrong_shape_or_stride_launches_nothing(tmp_path):
    import torch

    spec, problem = CASES[0]
    k = _build(spec, problem, tmp_path).kernel
    M, N, K = problem.M, problem.N, problem.K
    a = torch.zeros(M, K + 8, dtype=torch.half, device="cuda")
    b = torch.zeros(K + 8, N + 8, dtype=torch.half, device="cuda")
    c = torch.zeros(M, N + 8, dtype=torch.half, device="cuda")
    ws = torch.zeros(workspace_bytes(spec, problem), dtype=torch.uint8, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    args = (a.data_ptr(), b.data_ptr(), c.data_ptr())
    assert k.run(*args, M + 1, N, K, K, N, N, ws.data_ptr(), s) == 1
    assert k.run(*args, M, N, K, K + 8, N, N, ws.data_ptr(), s) == 2
    assert k.run(*args, M, N, K, K, N, N, 0, s) == 5
    assert k.run(a.data_ptr() + 2, b.data_ptr(), c.data_ptr(), M, N, K, K, N, N, ws.data_ptr(), s) == 4
    torch.cuda.synchronize()
    assert not c.any()


def test_kernel_times_against_torch_matmul(tmp_path):
    """Not a pass/fail on speed: prints kernel-mode times (graph replays, inputs rotated past L2)
    of the golden kernels and the heuristic's first choice next to torch.matmul, run with -s."""
    import torch

    from gemmrl.bench.timing import KernelSettings, time_kernel

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for problem, layout in ((Problem(64, 64, 12288), "NN"), (Problem(512, 64, 12288), "TN"),
                            (Problem(256, 4096, 512), "NN"), (Problem(64, 64, 128), "NN"),
                            (Problem(128, 64, 64), "NN")):
        specs = [s for s, p in CASES[:3] if p == problem] + heuristic_specs(problem, layout)[:2]
        calls = {"torch.matmul": lambda a, b, bt, c: torch.matmul(a, b, out=c)}
        for spec in specs:
            calls[spec.name] = _build(spec, problem, tmp_path).prepare(problem)
        res = time_kernel(problem, calls, l2_bytes=l2, settings=KernelSettings(max_rounds=20))
        floor = problem.min_bytes / 4.8e6
        for name, r in res.items():
            assert r["status"] == "ok", (name, r)
            print(f"{problem.shape} {name:45s} {r['median_us']:8.2f} us  (HBM floor {floor:.2f} us)")
