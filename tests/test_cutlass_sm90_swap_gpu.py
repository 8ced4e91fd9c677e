"""Swapped CUTLASS kernels (swap_ab: C^T = B^T A^T, D written column-major) on a GPU: they pass
every harness check on shapes with residues in M, N and K, in both ABI layouts, and on the
narrow-N shapes they are for. A module of its own so that its few builds are all it needs.
Skipped without CUDA, a Hopper GPU or the CUTLASS headers."""

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
from gemmrl.space.cutlass_sm90 import CutlassSpec, valid  # noqa: E402
from gemmrl.verify.checks import residue_problems, verify_many  # noqa: E402

SPECS = [
    # the 128x192 tile over N x M with a 2x1 cluster (the problem's A multicast), NN
    CutlassSpec(128, 192, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                swap_ab=True),
    # the same tile, no cluster, TN
    CutlassSpec(128, 192, 64, 1, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32",
                swap_ab=True),
]


@pytest.fixture(scope="module")
def built():
    try:
        cs.include_dirs()
    except FileNotFoundError as e:
        pytest.skip(f"CUTLASS headers not found ({e})")

    from gemmrl.build.ahead import job_for

    def one(spec):  # the build the product makes (and a carried build cache holds)
        job = job_for(spec, Problem(12288, 256, 4096, spec.dtype, spec.acc))
        return build_shared(job.source, name=job.name, **job.kwargs)

    with ThreadPoolExecutor(len(SPECS)) as ex:
        return dict(zip((s.name for s in SPECS), ex.map(one, SPECS)))


def _problems(spec: CutlassSpec) -> list[Problem]:
    d, a = spec.dtype, spec.acc
    cands = residue_problems(Problem(512, 768, 1024, d, a)) + [
        Problem(513, 776, 1032, d, a), Problem(127, 136, 72, d, a), Problem(1, 8, 8, d, a),
        Problem(12288, 256, 1024, d, a), Problem(3001, 264, 520, d, a)]
    keep = [p for p in cands if valid(spec, p) is None]
    assert len(keep) >= 6
    return keep


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_swapped_kernel_verifies_on_residue_shapes(built, spec):
    r = built[spec.name]
    assert r.ok, r.log[-4000:]
    assert "C7510" not in r.log and r.spills == 0
    res = verify_many(AbiImpl(r.path, name=spec.name), _problems(spec))
    assert res.passed, res.reason


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_swapped_kernel_matches_the_unswapped_product(built, spec):
    """Same inputs through the swapped kernel and torch: C row-major [M, N] either way, with a
    leading dimension wider than N (the column-major D's stride is ldc)."""
    r = built[spec.name]
    impl = AbiImpl(r.path, name=spec.name)
    M, N, K, ldc = 1000, 264, 512, 272
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(M, K, device="cuda", generator=g).half()
    b = torch.randn(K, N, device="cuda", generator=g).half()
    b_arg = b if spec.layout == "NN" else b.t().contiguous()
    ldb = N if spec.layout == "NN" else K
    c = torch.full((M, ldc), 7.0, dtype=torch.float16, device="cuda")
    status = impl.kernel.run(a.data_ptr(), b_arg.data_ptr(), c.data_ptr(), M, N, K, K, ldb, ldc, 0,
                             torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert status == 0
    ref = (a.float() @ b.float())
    assert torch.allclose(c[:, :N].float(), ref, rtol=1e-2, atol=5e-2)
    assert bool((c[:, N:] == 7).all()), "wrote past N into the padding"
