"""The C++ fast path's cuBLASLt fallback (fastpath.cpp, GEMMRL_FASTPATH_LT), compiled for real
against cuBLASLt's own header and run on the CPU.

The extension is linked to a stand-in libcublasLt (written here, compiled with c++ against the
real cublasLt.h, so every signature is the header's) that computes what cuBLASLt would: the
column-major product its layouts and operations describe, on host memory. So a mistake in how the
fast path maps row-major C = A @ B (NN) or A @ W.T (TN) onto cuBLASLt's column-major call (which
matrix is "A", transposes, rows, columns, leading dimensions) gives a wrong result here. The
stand-in also records the workspace, alignment preference and stream it was given, offers no
algorithm for M == 7 and refuses the call for K == 9, so the declines are tested too.
The extension runs in its test-only host mode (CPU tensors, stream 0)."""

import ctypes
import shutil
import subprocess

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmrl.baselines.cublas import CublasPaths
from gemmrl.runtime import fastpath, ops
from test_cublas_baselines import _cublas_include

STAND_IN_LT = r"""
#include <cublasLt.h>
#include <cstring>
#include <cstdint>

namespace {
struct Desc { int ta = 0, tb = 0, compute = -1, scale = -1; };
struct Layout { int type; uint64_t rows, cols; int64_t ld; };
struct Pref { uint64_t ws = 0; uint32_t align[4] = {256, 256, 256, 256}; };
int g_heuristics = 0, g_calls = 0, g_handles = 0;
uint64_t g_last_ws_size = 0;
void* g_last_ws = nullptr;
void* g_last_stream = nullptr;
uint32_t g_last_align = 0;
uint64_t g_last_pref_ws = 0;
unsigned long long g_last_algo = 0;
int g_last_m = 0, g_last_n = 0, g_last_k = 0, g_last_ta = 0, g_last_lda = 0, g_last_ldb = 0, g_last_ldc = 0;

float ld_elem(const void* p, int type, int64_t i) {
  if (type == CUDA_R_16F) return (float)((const _Float16*)p)[i];
  uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;  // bf16
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
void st_elem(void* p, int type, int64_t i, float v) {
  if (type == CUDA_R_16F) { ((_Float16*)p)[i] = (_Float16)v; return; }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  ((uint16_t*)p)[i] = (uint16_t)(bits >> 16);  // exact for the small integers of the tests
}
}  // namespace

extern "C" {
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { *h = (cublasLtHandle_t)(uintptr_t)(0x100 + ++g_handles); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t c, cudaDataType s) {
  Desc* x = new Desc; x->compute = c; x->scale = s; *d = (cublasLtMatmulDesc_t)x; return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete (Desc*)d; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void* buf, size_t n) {
  Desc* x = (Desc*)d;
  if (n != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  if (a == CUBLASLT_MATMUL_DESC_TRANSA) x->ta = *(const int32_t*)buf;
  else if (a == CUBLASLT_MATMUL_DESC_TRANSB) x->tb = *(const int32_t*)buf;
  else return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType t, uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < (int64_t)rows) return CUBLAS_STATUS_INVALID_VALUE;  // column-major: ld >= rows
  *l = (cublasLtMatrixLayout_t) new Layout{(int)t, rows, cols, ld}; return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete (Layout*)l; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) { *p = (cublasLtMatmulPreference_t) new Pref; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { delete (Pref*)p; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, const void* buf, size_t n) {
  Pref* x = (Pref*)p;
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && n == 8) x->ws = *(const uint64_t*)buf;
  else if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES && n == 4)
    x->align[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = *(const uint32_t*)buf;
  else return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t p,
    int requested, cublasLtMatmulHeuristicResult_t* out, int* n) {
  ++g_heuristics;
  Pref* x = (Pref*)p;
  g_last_pref_ws = x->ws;
  g_last_align = x->align[0];
  for (int i = 1; i < 4; ++i) if (x->align[i] != x->align[0]) g_last_align = 0;
  *n = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (((Layout*)b)->cols == 7) return CUBLAS_STATUS_SUCCESS;  // M == 7: no algorithm
  std::memset(out, 0, sizeof(*out));
  out->algo.data[0] = 0xA160;
  out->workspaceSize = 4096;
  out->state = CUBLAS_STATUS_SUCCESS;
  *n = 1;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
    cublasLtMatrixLayout_t la, const void* B, cublasLtMatrixLayout_t lb, const void* beta, const void* C,
    cublasLtMatrixLayout_t lc, void* D, cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t* algo,
    void* ws, size_t ws_size, cudaStream_t stream) {
  const Desc* d = (const Desc*)desc;
  const Layout *a = (const Layout*)la, *b = (const Layout*)lb, *c = (const Layout*)lc, *o = (const Layout*)ld;
  if (!algo || (algo->data[0] != 0xA160 && algo->data[0] != 0xB0B) || d->compute != CUBLAS_COMPUTE_32F ||
      d->scale != CUDA_R_32F)
    return CUBLAS_STATUS_INVALID_VALUE;
  g_last_algo = algo->data[0];
  const uint64_t m = d->ta ? a->cols : a->rows, k = d->ta ? a->rows : a->cols;
  const uint64_t kb = d->tb ? b->cols : b->rows, n = d->tb ? b->rows : b->cols;
  if (k != kb || o->rows != m || o->cols != n || c->rows != m || c->cols != n || C != D) return CUBLAS_STATUS_INVALID_VALUE;
  if (k == 9) return CUBLAS_STATUS_NOT_SUPPORTED;  // K == 9: refused
  if (ws_size > 0 && ws == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const float al = *(const float*)alpha, be = *(const float*)beta;
  for (uint64_t j = 0; j < n; ++j)
    for (uint64_t i = 0; i < m; ++i) {
      float s = 0.0f;
      for (uint64_t q = 0; q < k; ++q) {
        float x = ld_elem(A, a->type, d->ta ? q + i * a->ld : i + q * a->ld);
        float y = ld_elem(B, b->type, d->tb ? j + q * b->ld : q + j * b->ld);
        s += x * y;
      }
      float prev = be != 0.0f ? be * ld_elem(C, c->type, i + j * c->ld) : 0.0f;
      st_elem(D, o->type, i + j * o->ld, al * s + prev);
    }
  ++g_calls;
  g_last_ws = ws; g_last_ws_size = ws_size; g_last_stream = (void*)stream;
  g_last_m = (int)m; g_last_n = (int)n; g_last_k = (int)k; g_last_ta = d->ta;
  g_last_lda = (int)a->ld; g_last_ldb = (int)b->ld; g_last_ldc = (int)o->ld;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
    cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t* algo,
    cublasLtMatmulHeuristicResult_t* r) {
  std::memset(r, 0, sizeof(*r));
  if (algo->data[0] != 0xB0B) return CUBLAS_STATUS_INVALID_VALUE;  // only the "pack's" algorithm
  r->algo = *algo;
  r->workspaceSize = 8192;
  r->state = CUBLAS_STATUS_SUCCESS;
  return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion(void) { return 130100; }
int fake_calls(void) { return g_calls; }
unsigned long long fake_last_algo(void) { return g_last_algo; }
int fake_heuristics(void) { return g_heuristics; }
void* fake_last_ws(void) { return g_last_ws; }
unsigned long long fake_last_ws_size(void) { return g_last_ws_size; }
unsigned long long fake_last_pref_ws(void) { return g_last_pref_ws; }
unsigned fake_last_align(void) { return g_last_align; }
void fake_last_mnk(int* out) {
  out[0] = g_last_m; out[1] = g_last_n; out[2] = g_last_k; out[3] = g_last_ta;
  out[4] = g_last_lda; out[5] = g_last_ldb; out[6] = g_last_ldc;
}
}
"""


class StandIn:
    def __init__(self, so):
        self.lib = lib = ctypes.CDLL(str(so))
        lib.fake_last_ws.restype = ctypes.c_void_p
        lib.fake_last_ws_size.restype = lib.fake_last_pref_ws.restype = ctypes.c_ulonglong
        lib.fake_last_align.restype = ctypes.c_uint
        lib.fake_last_algo.restype = ctypes.c_ulonglong

    calls = property(lambda self: self.lib.fake_calls())
    heuristics = property(lambda self: self.lib.fake_heuristics())
    last_ws = property(lambda self: self.lib.fake_last_ws() or 0)
    last_ws_size = property(lambda self: self.lib.fake_last_ws_size())
    last_pref_ws = property(lambda self: self.lib.fake_last_pref_ws())
    last_align = property(lambda self: self.lib.fake_last_align())
    last_algo = property(lambda self: self.lib.fake_last_algo())

    def last(self):
        out = (ctypes.c_int * 7)()
        self.lib.fake_last_mnk(out)
        return dict(zip(("m", "n", "k", "transa", "lda", "ldb", "ldc"), out))


@pytest.fixture(scope="module")
def lt(tmp_path_factory):
    """(module, stand-in): the extension with the cuBLASLt fallback compiled in, in host mode."""
    include, cuda_inc = _cublas_include(), fastpath.cuda_include_dir()
    if include is None or cuda_inc is None:
        pytest.skip("no cuBLAS headers (cublasLt.h) or no CUDA headers (cuda_runtime_api.h) here")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("stand-in-cublaslt")
    (d / "lt.cpp").write_text(STAND_IN_LT)
    so = d / "libcublasLt.so"
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{include}", f"-I{cuda_inc}",
                    str(d / "lt.cpp"), "-o", str(so), "-Wl,-soname,libcublasLt.so"], check=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("GEMMRL_CACHE", str(d / "cache"))
    try:
        m = fastpath.load(cuda=False, lt=CublasPaths(include, d, "stand-in"), name="gemmrl_fastpath_lt_stand_in")
    finally:
        mp.undo()
    yield m, StandIn(so)


@pytest.fixture
def fast(lt):
    m, fake = lt
    m.set_host_mode(True)
    m.set_lt(True)
    m.clear()
    yield m, fake
    m.set_host_mode(False)
    m.set_lt(True)
    m.clear()


def _ints(*shape, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)  # small integers: every product is exact
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def _at(t, offset):
    """A copy of `t` whose data starts `offset` bytes past a 256-byte boundary."""
    n = t.numel() * t.element_size()
    buf = torch.empty(n + 512, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 256 + offset
    v = buf[start:start + n].view(t.dtype).view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 256 == offset
    return v


def _unserved(m, M, N, K, tn, dtype="fp16"):
    """The shape has no kernel: the table's fallback, which is where cuBLASLt comes in."""
    m.register_unserved(M, N, K, tn, dtype)


def test_lt_is_compiled_in_and_the_default_module_says_whether_it_is(lt):
    m, _ = lt
    s = m.stats()["lt"]
    assert s["compiled"] is True and s["on"] is True
    assert set(s) == {"compiled", "on", "max_flops", "installed", "calls", "plans", "no_algo", "failed"}
    assert m.lt_version() == 130100
    assert s["max_flops"] == 2.0 ** 39
    assert fastpath.build_flags(False, None)["extra_ldflags"] == []
    flags = fastpath.build_flags(False, CublasPaths("/x/include", "/x/lib", "t"))
    assert "-DGEMMRL_FASTPATH_LT" in flags["extra_cflags"] and "-Wl,-rpath,/x/lib" in flags["extra_ldflags"]


@pytest.mark.parametrize("tn", [False, True])
def test_nn_and_tn_map_onto_cublaslt_column_major_exactly(fast, tn):
    m, fake = fast
    M, N, K = 12, 20, 24
    a = _ints(M, K)
    b = _ints(N, K, seed=1) if tn else _ints(K, N, seed=1)
    _unserved(m, M, N, K, tn)
    before = fake.calls
    c = m.run(a, b, tn)
    assert fake.calls == before + 1, "cuBLASLt computed the fallback"
    ref = a.float() @ (b.float().t() if tn else b.float())
    assert c.dtype == torch.float16 and c.shape == (M, N) and torch.equal(c.float(), ref)
    # C^T[N,M] = op(B)[N,K] A^T[K,M]: cuBLASLt's m, n, k are N, M, K; our B is its A
    assert fake.last() == {"m": N, "n": M, "k": K, "transa": int(tn), "lda": K if tn else N, "ldb": K, "ldc": N}
    assert fake.last_pref_ws == 32 << 20 and fake.last_ws_size == 4096 and fake.last_ws != 0
    assert m.stats()["lt"]["calls"] == 1 and m.stats()["fallbacks"] == 1


def test_one_plan_per_shape_one_workspace_per_stream(fast):
    m, fake = fast
    # 64-byte aligned data throughout (a plan is per alignment too; the CPU allocator's varies)
    a, b = _at(_ints(16, 32), 64), _at(_ints(32, 8, seed=2), 64)
    out = _at(torch.empty(16, 8, dtype=torch.float16), 64)
    _unserved(m, 16, 8, 32, False)
    h0 = fake.heuristics
    m.run(a, b, False, out)
    ws = fake.last_ws
    for i in range(3):
        a_i = _at(_ints(16, 32, seed=5 + i), 64)
        assert torch.equal(m.run(a_i, b, False, out).float(), a_i.float() @ b.float())
    assert fake.heuristics == h0 + 1, "the heuristic runs once per shape"
    assert fake.last_ws == ws, "the stream's workspace is reused"
    a2, b2 = _at(_ints(4, 32), 64), _at(_ints(32, 8, seed=3), 64)
    _unserved(m, 4, 8, 32, False)
    out2 = _at(torch.empty(4, 8, dtype=torch.float16), 64)
    assert torch.equal(m.run(a2, b2, False, out2).float(), a2.float() @ b2.float())
    s = m.stats()["lt"]
    assert s["plans"] == 2 and s["calls"] == 5 and fake.last_ws == ws and fake.heuristics == h0 + 2


def test_batched_a_out_and_bf16(fast):
    m, fake = fast
    a = _ints(2, 3, 16)  # [.., K]: M = 6
    w = _ints(10, 16, seed=4)
    _unserved(m, 6, 10, 16, True)
    c = m.run(a, w, True)
    assert c.shape == (2, 3, 10) and torch.equal(c.float(), a.float() @ w.float().t())
    out = torch.empty(2, 3, 10, dtype=torch.float16)
    assert m.run(a, w, True, out) is out and torch.equal(out, c)
    ab, wb = _ints(8, 16, dtype=torch.bfloat16), _ints(16, 24, seed=6, dtype=torch.bfloat16)
    _unserved(m, 8, 24, 16, False, "bf16")
    n = fake.calls
    cb = m.run(ab, wb, False)
    assert fake.calls == n + 1 and cb.dtype == torch.bfloat16
    assert torch.equal(cb.float(), ab.float() @ wb.float())


def _align(*ptrs):
    x, al = 0, 256
    for p in ptrs:
        x |= p
    while x % al:
        al //= 2
    return al


def test_the_alignment_of_the_data_is_the_plans_preference(fast):
    m, fake = fast
    K = 8
    big = _ints(9, K)  # rows of 16 bytes: row 1 starts 16 bytes in
    b = _ints(K, 8, seed=7)
    out = torch.empty(8, 8, dtype=torch.float16)
    assert _align(big.data_ptr(), b.data_ptr(), out.data_ptr()) >= 64  # the CPU allocator's
    _unserved(m, 8, 8, K, False)
    assert m.run(big[1:], b, False, out) is out
    assert torch.equal(out.float(), big[1:].float() @ b.float())
    assert fake.last_align == 16, "the plan asks for the alignment the pointers have"
    m.run(big[:8], b, False, out)  # the allocation's own alignment: another plan, made for it
    assert m.stats()["lt"]["plans"] == 2
    assert fake.last_align == _align(big.data_ptr(), b.data_ptr(), out.data_ptr())
    assert torch.equal(out.float(), big[:8].float() @ b.float())


def test_what_cublaslt_declines_torch_matmul_computes(fast):
    m, fake = fast
    n0 = fake.calls
    # M == 7: the stand-in offers no algorithm (once: the plan remembers)
    a, b = _at(_ints(7, 16), 0), _at(_ints(16, 8, seed=8), 0)
    out = _at(torch.empty(7, 8, dtype=torch.float16), 0)  # one alignment: one plan
    _unserved(m, 7, 8, 16, False)
    for _ in range(2):
        assert torch.equal(m.run(a, b, False, out).float(), a.float() @ b.float())
    assert m.stats()["lt"]["no_algo"] == 1 and m.stats()["lt"]["plans"] == 1
    # K == 9: cuBLASLt refuses the call; never tried again for that shape
    a, b = _at(_ints(8, 9), 0), _at(_ints(9, 8, seed=9), 0)
    out = _at(torch.empty(8, 8, dtype=torch.float16), 0)
    _unserved(m, 8, 8, 9, False)
    for _ in range(2):
        assert torch.equal(m.run(a, b, False, out).float(), a.float() @ b.float())
    assert m.stats()["lt"]["failed"] == 1
    # 8-byte aligned data, non-contiguous b, autograd, an fp32 call: cuBLASLt never sees them
    big = _ints(9 * 16 + 4)
    a = big[4:].view(9, 16)
    b = _ints(16, 8, seed=10)
    _unserved(m, 9, 8, 16, False)
    assert torch.equal(m.run(a, b, False).float(), a.float() @ b.float())
    bt = _ints(8, 16, seed=11).t()
    assert torch.equal(m.run(_ints(9, 16), bt, False).float(), _ints(9, 16).float() @ bt.float())
    g = _ints(9, 16).requires_grad_(True)
    with torch.enable_grad():
        r = m.run(g, b, False)
    assert r.requires_grad and r.grad_fn is not None, "autograd recorded the call (torch.matmul)"
    assert fake.calls == n0, "cuBLASLt ran none of these"


def test_a_dispatch_mode_sees_torch_ops_not_cublaslt(fast):
    m, fake = fast
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b = _ints(8, 16), _ints(16, 8, seed=12)
    _unserved(m, 8, 8, 16, False)
    n0 = fake.calls
    with Spy():
        c = m.run(a, b, False)
    assert torch.equal(c.float(), a.float() @ b.float())
    assert fake.calls == n0 and any("mm" in f for f in seen)


def test_calls_above_max_flops_are_torch_matmuls(fast):
    m, fake = fast
    a, b = _ints(8, 16), _ints(16, 8, seed=14)
    _unserved(m, 8, 8, 16, False)
    with pytest.raises(ValueError, match="max_flops must be positive"):
        m.set_lt(True, 0.0)
    try:
        m.set_lt(True, 2.0 * 8 * 8 * 16 - 1)  # one FLOP under this call's
        n0 = fake.calls
        assert torch.equal(m.run(a, b, False).float(), a.float() @ b.float())
        assert fake.calls == n0 and m.stats()["lt"]["max_flops"] == 2047.0
        m.set_lt(True, 2.0 * 8 * 8 * 16)
        m.run(a, b, False)
        assert fake.calls == n0 + 1
    finally:
        m.set_lt(True, 2.0 ** 39)


def _algo(tag):
    return tag.to_bytes(8, "little") + bytes(56)


def test_an_installed_algorithm_serves_its_shape_at_any_size_until_clear(fast):
    m, fake = fast
    a, b = _ints(8, 16), _ints(8, 16, seed=15)  # TN
    _unserved(m, 8, 8, 16, True)
    with pytest.raises(ValueError, match="64 bytes"):
        m.lt_install(8, 8, 16, True, "fp16", -1, b"short")
    assert m.lt_install(8, 8, 16, True, "fp16", -1, _algo(0xBAD)) is False  # AlgoCheck refuses it
    assert m.lt_install(8, 8, 16, True, "fp16", -1, _algo(0xB0B)) is True
    assert m.stats()["lt"]["installed"] == 1
    h0, n0 = fake.heuristics, fake.calls
    a2, b2, out = _at(a, 0), _at(b, 0), _at(torch.empty(8, 8, dtype=torch.float16), 0)
    try:
        m.set_lt(True, 1.0)  # every call is over max_flops: only the installed plan is used
        assert m.run(a2, b2, True, out) is out
        assert fake.calls == n0 + 1 and fake.last_algo == 0xB0B and fake.last_ws_size == 8192
        assert torch.equal(out.float(), a.float() @ b.float().t())
        a3 = _at(a, 16)  # 16-byte aligned: not the installed plan's data
        assert torch.equal(m.run(a3, b2, True, out).float(), a.float() @ b.float().t())
        assert fake.calls == n0 + 1, "over max_flops and no installed plan for this alignment: torch"
        assert fake.heuristics == h0, "an installed plan needs no heuristic"
    finally:
        m.set_lt(True, 2.0 ** 39)
    m.clear()
    assert m.stats()["lt"]["installed"] == 0


def test_set_lt_off_is_torch_matmul_again(fast):
    m, fake = fast
    a, b = _ints(8, 16), _ints(16, 8, seed=13)
    _unserved(m, 8, 8, 16, False)
    assert m.set_lt(False) is True  # compiled in
    n0 = fake.calls
    assert torch.equal(m.run(a, b, False).float(), a.float() @ b.float())
    assert fake.calls == n0 and m.stats()["lt"]["on"] is False and m.stats()["fallbacks"] == 1


def test_set_fallback_and_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="fallback must be one of"):
        ops.set_fallback("cublas")
    monkeypatch.setenv("GEMMRL_FALLBACK", "nonsense")
    with pytest.raises(ValueError, match="GEMMRL_FALLBACK must be one of"):
        ops._fallback_kind()
    monkeypatch.setenv("GEMMRL_FALLBACK", "TORCH")
    assert ops._fallback_kind() == "torch"
    monkeypatch.delenv("GEMMRL_FALLBACK")
    assert ops._fallback_kind() == "cublaslt"


def test_a_packs_algorithms_go_to_every_gpu_of_its_model(monkeypatch):
    """use_pack installs the pack's cuBLASLt algorithms on the current device and every other
    visible GPU of the model the pack was made on (each while that device is current), not on a
    GPU of another model; lt_status counts the current device's and lists each device's."""
    import contextlib
    import types

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA  H100 80GB HBM3"}
    current, calls = {"dev": 0}, []

    @contextlib.contextmanager
    def device(d):
        before, current["dev"] = current["dev"], d
        try:
            yield
        finally:
            current["dev"] = before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: names[current["dev"] if d is None else d])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["dev"])
    monkeypatch.setattr(torch.cuda, "device", device)

    class Fast:
        def lt_version(self):
            return 130100

        def lt_install(self, M, N, K, tn, dtype, dev, algo):
            calls.append((M, tn, dev, current["dev"]))
            return algo != b"\1" * 64 or dev != 2  # device 2 refuses one

    algos = {(64, 128, 256, "NN"): b"\0" * 64, (512, 128, 256, "TN"): b"\1" * 64}
    pack = types.SimpleNamespace(lt_algos=algos, lt_version=130100, dtype="fp16",
                                 stamp={"device": "NVIDIA H100 80GB HBM3"})
    try:
        ops._install_lt(Fast(), types.SimpleNamespace(pack=pack))
        assert sorted(calls) == [(64, False, 0, 0), (64, False, 2, 2), (512, True, 0, 0), (512, True, 2, 2)]
        st = ops.lt_status()
        assert st == {"installed": 2, "devices": {0: 2, 2: 1}, "refused": 1, "note": "device 0, 2"}
        current["dev"] = 2  # a process working on device 2 sees that device's count
        assert ops.lt_status()["installed"] == 1
        calls.clear()
        ops._install_lt(Fast(), types.SimpleNamespace(pack=pack))  # device 2 current: it goes first
        assert [c[2] for c in calls] == [2, 2, 0, 0] and all(c[2] == c[3] for c in calls)
        current["dev"] = 1  # a forced pack on another model: the current device, and the pack's model
        calls.clear()
        ops._install_lt(Fast(), types.SimpleNamespace(pack=pack))
        assert sorted({c[2] for c in calls}) == [0, 1, 2] and ops.lt_status()["installed"] == 2
    finally:
        ops._install_lt(None, None)
    assert ops.lt_status()["installed"] == 0 and ops.lt_status()["note"] == "no pack"


def test_the_first_shape_a_process_prepares_names_its_installed_algorithm(monkeypatch):
    """PackMatmul records which cuBLASLt algorithm of the pack serves a shape. The fast path (and
    with it the pack's algorithms) loads on a process's first call, so a shape prepared before
    any call read an empty table and was recorded as served by the heuristic (H200, runs
    539-555): _installed_lt loads the fast path first."""
    import types

    from gemmrl.runtime import fastpath
    from gemmrl.runtime.pack_impl import _installed_lt

    class Fast:
        def set_python(self, *a):
            pass

        def set_active(self, on):
            pass

        def set_lt(self, on):
            pass

        def lt_version(self):
            return 130100

        def lt_install(self, M, N, K, tn, dtype, dev, algo):
            return True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(fastpath, "get", lambda: Fast())
    monkeypatch.delenv("GEMMRL_FALLBACK", raising=False)
    algo = bytes(range(64))
    pack = types.SimpleNamespace(lt_algos={(4096, 256, 16384, "NN"): algo}, lt_version=130100, dtype="fp16",
                                 stamp={"device": "NVIDIA H200"})
    monkeypatch.setattr(ops, "_ACTIVE", types.SimpleNamespace(pack=pack))
    monkeypatch.setattr(ops, "_FAST", ops._UNSET)  # a fresh process: no call made yet
    try:
        assert _installed_lt(pack, 4096, 256, 16384, "NN") == algo.hex()
        assert _installed_lt(pack, 4096, 256, 16384, "TN") is None  # the pack has none for it
        assert _installed_lt(pack, 64, 256, 16384, "NN") is None
    finally:
        ops._install_lt(None, None)
