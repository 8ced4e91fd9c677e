// The C++ fast path of gemmrl.matmul / gemmrl::mm (issue #4): a hash table from
// (M, N, K, layout, dtype, device, stream) to a resolved kernel call, looked up and launched
// without going back to Python. Built on first use by gemmrl/runtime/fastpath.py.
//
// run(a, b, tn[, out]) does what ops._plan does in Python (the same checks, in the same spirit) and:
//   returns a new Tensor       a kernel of the table served the call (or `out`, written, when given)
//   returns torch.matmul's     not eligible, or a known fallback shape: computed here (fallback())
//   returns (M, N, K, dev, stream)          a miss: Python resolves the key and registers it
//   returns (M, N, K, dev, stream, status)  the kernel refused (nonzero status, nothing was
//                                           launched): Python disables the shape and falls back
//   returns None               not for this path (a tensor subclass, a __torch_function__ mode,
//                              sizes beyond int): Python's own path decides
// The stream is the caller's current stream: c10::cuda::getCurrentCUDAStream(device), the call
// behind torch._C._cuda_getCurrentRawStream, so a capture stream is seen as such. That needs
// libc10_cuda, which a CPU-only torch does not have: the loader defines GEMMRL_FASTPATH_CUDA
// and links c10_cuda only when torch has CUDA. Without it no tensor can be a CUDA tensor, and
// only the test-only host mode (CPU tensors, stream 0) reaches the table.
//
// A fallback on a CUDA tensor that cuBLASLt can take (fp16/bf16, contiguous, 16-byte aligned, no
// autograd, no dispatch mode, at most 2^39 FLOPs) is computed with cuBLASLt and a plan made once per (shape, layout,
// dtype, device, alignment): the heuristic's first algorithm for a 32 MiB workspace, as the
// harness's cuBLASLt-heuristic baseline chooses it (GEMMRL_FASTPATH_LT: built where cuBLASLt's
// headers and library are found). torch.matmul's cuBLAS call costs 7 to 12 us more host time per
// call in the harness's offline mode for the same kernel time (results/README.md). set_lt(False),
// or GEMMRL_FALLBACK=torch, makes every fallback torch.matmul's again.
//
// Every function runs with the GIL held, which is what guards the table. An entry is copied out
// before anything that could run Python (allocation under a dispatch mode), and keeps its own
// reference to the workspace tensor, so a workspace outlives every call that uses it.

#include <torch/csrc/python_headers.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/impl/TorchDispatchModeTLS.h>

#ifdef GEMMRL_FASTPATH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif
#ifdef GEMMRL_FASTPATH_LT
#include <cublasLt.h>
#endif

#include <climits>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace {

// the kernel ABI (gemmrl/runtime/abi.py): 0 on success, nonzero = nothing was launched
using RunFn = int (*)(const void*, const void*, void*, int, int, int, int, int, int, void*, void*);

struct Key {
  int64_t M, N, K;
  uintptr_t stream;
  int8_t dtype;   // c10::ScalarType
  int8_t device;  // c10::DeviceIndex; -1 for host-mode (CPU) tensors
  bool tn;
  bool operator==(const Key& o) const noexcept {
    return M == o.M && N == o.N && K == o.K && stream == o.stream && dtype == o.dtype &&
           device == o.device && tn == o.tn;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    auto mix = [&h](uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(static_cast<uint64_t>(k.M));
    mix(static_cast<uint64_t>(k.N));
    mix(static_cast<uint64_t>(k.K));
    mix(static_cast<uint64_t>(k.stream));
    mix((static_cast<uint64_t>(static_cast<uint8_t>(k.dtype)) << 16) |
        (static_cast<uint64_t>(static_cast<uint8_t>(k.device)) << 8) | (k.tn ? 1u : 0u));
    return static_cast<size_t>(h);
  }
};

struct Entry {
  RunFn fn = nullptr;  // nullptr: a known fallback (negative entry)
  void* ws = nullptr;
  int ldb = 0;
  at::Tensor ws_tensor;  // keeps the workspace alive as long as the entry
};

std::unordered_map<Key, Entry, KeyHash> g_table;
// shapes the active pack has no kernel for at all, whatever the device or stream: torch.matmul
// serves them, decided before reading the current device and stream (register_unserved)
std::unordered_set<Key, KeyHash> g_unserved;  // keyed with stream 0, device 0
size_t g_limit = 1 << 16;  // a full table is cleared (entries come back from Python's caches)
PyObject* g_str_nn = nullptr;  // "NN", "TN": interned at module init
PyObject* g_str_tn = nullptr;
bool g_host_mode = false;  // test only: CPU tensors accepted (stream 0, or the current one with CUDA)
uint64_t g_hits = 0, g_misses = 0, g_fallbacks = 0, g_refusals = 0;
uint64_t g_to_python = 0;  // matmul() calls handed to Python whole (not misses: those are g_misses)

PyObject* key_tuple(const Key& k, int extra, bool with_extra) {
  if (with_extra) {
    return Py_BuildValue("(LLLiKi)", (long long)k.M, (long long)k.N, (long long)k.K,
                         (int)k.device, (unsigned long long)k.stream, extra);
  }
  return Py_BuildValue("(LLLiK)", (long long)k.M, (long long)k.N, (long long)k.K, (int)k.device,
                       (unsigned long long)k.stream);
}

bool overlaps(const at::Tensor& x, const at::Tensor& y);  // below, beside run_plain

// ------------------------------------------------------------------ the cuBLASLt fallback
bool g_lt_on = true;  // set_lt(); compiled in only with GEMMRL_FASTPATH_LT
// Above this many FLOPs (2MNK) a call is torch.matmul's even where cuBLASLt could take it: its
// kernel runs for 0.7 ms or more on a Hopper, so the host time saved is under 1% of the call,
// while cuBLASLt's heuristic and torch's cuBLAS may choose different kernels (on the H100 subset,
// 2026-11-25, three such shapes ran 1-2% slower through cuBLASLt, one of them beyond torch's own
// repeat). set_lt(on, max_flops) changes it.
double g_lt_max_flops = 549755813888.0;  // 2^39
uint64_t g_lt_calls = 0, g_lt_plans = 0, g_lt_no_algo = 0, g_lt_failed = 0;

#ifdef GEMMRL_FASTPATH_LT
constexpr size_t kLtWorkspace = size_t(32) << 20;  // the harness's cuBLASLt baselines' workspace
constexpr size_t kLtMaxStreams = 8;  // workspaces kept; one more stream clears them (stream-ordered frees)

// One (shape, layout, dtype, device, alignment)'s cuBLASLt call. Row-major C[M,N] = A[M,K] B is
// computed as its column-major transpose: C^T[N,M] = op(B)[N,K] A^T[K,M], so cuBLASLt's "A" is
// our B ([N,K] col-major with ld N for NN, [K,N] col-major with ld K and op T for TN) and its
// "B" is our A ([K,M] col-major, ld K).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t ws = 0;
  bool ok = false;  // false: cuBLASLt offers no algorithm, or one failed: torch.matmul serves the key
  bool pinned = false;  // an algorithm given by the pack (lt_install), not the heuristic's: used at
                        // any size, dropped by clear()
  ~LtPlan() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// keyed by Key with `stream` holding the alignment (bytes) the plan was made for
std::unordered_map<Key, std::unique_ptr<LtPlan>, KeyHash> g_lt_plan;
// per (device, stream): a workspace used only on that stream, so calls on it never overlap
std::unordered_map<Key, at::Tensor, KeyHash> g_lt_ws;
cublasLtHandle_t g_lt_handle[130] = {};  // per device; [0] is host mode's (device -1)

// the descriptor and layouts of a plan
bool lt_describe(LtPlan* p, int64_t M, int64_t N, int64_t K, bool tn, at::ScalarType st) {
  const cudaDataType dt = st == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  if (cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  const cublasOperation_t ta = tn ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  if (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  const cublasStatus_t s1 = tn ? cublasLtMatrixLayoutCreate(&p->la, dt, uint64_t(K), uint64_t(N), K)
                               : cublasLtMatrixLayoutCreate(&p->la, dt, uint64_t(N), uint64_t(K), N);
  if (s1 != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&p->lb, dt, uint64_t(K), uint64_t(M), K) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&p->lc, dt, uint64_t(N), uint64_t(M), N) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  return true;
}

// a plan with the heuristic's first algorithm for data aligned to `align` bytes
bool lt_make(LtPlan* p, int64_t M, int64_t N, int64_t K, bool tn, at::ScalarType st, cublasLtHandle_t h,
             uint32_t align) {
  if (!lt_describe(p, M, N, K, tn, st)) return false;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return false;
  const uint64_t ws = kLtWorkspace;
  bool ok = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) ==
            CUBLAS_STATUS_SUCCESS;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS;
  }
  cublasLtMatmulHeuristicResult_t res{};
  int n = 0;
  ok = ok && cublasLtMatmulAlgoGetHeuristic(h, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &n) ==
                 CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreferenceDestroy(pref);
  if (!ok || n < 1 || res.state != CUBLAS_STATUS_SUCCESS) return false;
  p->algo = res.algo;
  p->ws = res.workspaceSize;
  return true;
}

// the largest power of two up to 256 that divides every address
uint32_t alignment(uintptr_t x) {
  uint32_t al = 256;
  while (al > 1 && (x & (al - 1))) al >>= 1;
  return al;
}

// the cuBLASLt handle of a device (slot: device + 1), made on first use
cublasLtHandle_t lt_handle(int slot) {
  if (slot < 0 || slot >= 130) return nullptr;
  if (!g_lt_handle[slot] && cublasLtCreate(&g_lt_handle[slot]) != CUBLAS_STATUS_SUCCESS) g_lt_handle[slot] = nullptr;
  return g_lt_handle[slot];
}

// The fallback through cuBLASLt, or nullptr (no Python error set) where it declines: torch.matmul
// then serves the call. Declines before anything is enqueued or allocated but the plan.
PyObject* lt_fallback(const at::Tensor& a, const at::Tensor& b, bool tn, PyObject* pout) {
  if (!a.is_cuda() && !g_host_mode) return nullptr;
  const at::ScalarType st = a.scalar_type();
  if ((st != at::kHalf && st != at::kBFloat16) || b.scalar_type() != st) return nullptr;
  if (a.dim() < 2 || b.dim() != 2 || b.device() != a.device()) return nullptr;
  if (!a.is_contiguous() || !b.is_contiguous()) return nullptr;
  if (at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad())) return nullptr;  // autograd
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return nullptr;  // a mode sees torch's ops
  const int64_t K = a.size(-1);
  const int64_t N = tn ? b.size(0) : b.size(1);
  if ((tn ? b.size(1) : b.size(0)) != K || K == 0 || N == 0) return nullptr;
  const int64_t M = a.numel() / K;
  if (M == 0 || M > INT_MAX || N > INT_MAX || K > INT_MAX) return nullptr;
  const c10::DeviceIndex dev = a.is_cuda() ? a.device().index() : -1;
#ifdef GEMMRL_FASTPATH_CUDA
  if (a.is_cuda() && dev != c10::cuda::current_device()) return nullptr;
#endif
  c10::SmallVector<int64_t, 6> sizes(a.sizes().begin(), a.sizes().end());
  sizes.back() = N;
  uintptr_t addr = reinterpret_cast<uintptr_t>(a.data_ptr()) | reinterpret_cast<uintptr_t>(b.data_ptr());
  at::Tensor c;
  if (pout) {  // exactly the result (torch.matmul's out= rules otherwise)
    c = THPVariable_Unpack(pout);
    if (c.requires_grad() || c.scalar_type() != st || c.device() != a.device() || !c.is_contiguous() ||
        c.sizes() != c10::IntArrayRef(sizes) || overlaps(c, a) || overlaps(c, b)) {
      return nullptr;
    }
    addr |= reinterpret_cast<uintptr_t>(c.data_ptr());
  }
  const uint32_t align = alignment(addr);
  if (align < 16) return nullptr;
  const cublasLtHandle_t h = lt_handle(dev + 1);
  if (!h) return nullptr;
  const Key pk{M, N, K, align, static_cast<int8_t>(st), static_cast<int8_t>(dev), tn};
  auto it = g_lt_plan.find(pk);
  if ((it == g_lt_plan.end() || !it->second->pinned) &&
      2.0 * double(M) * double(N) * double(K) > g_lt_max_flops) {
    return nullptr;  // torch's own call, unless the pack gave an algorithm for the shape
  }
  if (it == g_lt_plan.end()) {
    if (g_lt_plan.size() >= g_limit) g_lt_plan.clear();
    auto p = std::make_unique<LtPlan>();
    p->ok = lt_make(p.get(), M, N, K, tn, st, h, align);
    ++g_lt_plans;
    if (!p->ok) ++g_lt_no_algo;
    it = g_lt_plan.emplace(pk, std::move(p)).first;
  }
  LtPlan* p = it->second.get();
  if (!p->ok) return nullptr;
  uintptr_t stream = 0;
#ifdef GEMMRL_FASTPATH_CUDA
  stream = reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(a.is_cuda() ? dev : -1).stream());
#endif
  void* ws = nullptr;
  if (p->ws > 0) {
    const Key wk{0, 0, 0, stream, 0, static_cast<int8_t>(dev), false};
    auto w = g_lt_ws.find(wk);
    if (w == g_lt_ws.end()) {
      if (g_lt_ws.size() >= kLtMaxStreams) g_lt_ws.clear();
      at::Tensor t = at::empty({static_cast<int64_t>(kLtWorkspace)}, a.options().dtype(at::kByte));
      w = g_lt_ws.emplace(wk, std::move(t)).first;
    }
    ws = w->second.data_ptr();
  }
  if (!pout) c = at::empty(sizes, a.options());
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t s = cublasLtMatmul(h, p->op, &one, b.data_ptr(), p->la, a.data_ptr(), p->lb, &zero,
                                          c.data_ptr(), p->lc, c.data_ptr(), p->lc, &p->algo, ws, p->ws,
                                          reinterpret_cast<cudaStream_t>(stream));
  if (s != CUBLAS_STATUS_SUCCESS) {  // refused before launching: never again for this key
    p->ok = false;
    ++g_lt_failed;
    return nullptr;
  }
  ++g_lt_calls;
  if (pout) {
    Py_INCREF(pout);
    return pout;
  }
  return THPVariable_Wrap(std::move(c));
}
#endif  // GEMMRL_FASTPATH_LT

// The fallback, torch.matmul(a, b) (b.t() for TN, as ops._fallback), computed here: the same ATen
// function torch.matmul's Python binding calls (at::matmul / at::matmul_out into `out`, with its
// checks, errors and out= rules), without the Python argument parser and the round trip through
// Python, so that a shape with no kernel costs no more host time than torch.matmul itself (the
// offline timing of 2026-11-22 measured 5 to 11 us more when Python did it). The GIL is released
// around the call, as torch's bindings do. Where cuBLASLt takes the call (lt_fallback), it
// computes it instead.
PyObject* fallback(const at::Tensor& a, const at::Tensor& b, bool tn, PyObject* pout) {
  ++g_fallbacks;
#ifdef GEMMRL_FASTPATH_LT
  if (g_lt_on) {
    PyObject* r = lt_fallback(a, b, tn, pout);
    if (r) return r;
  }
#endif
  at::Tensor r;
  at::Tensor out;
  if (pout) out = THPVariable_Unpack(pout);
  PyThreadState* save = PyEval_SaveThread();
  try {
    const at::Tensor bb = !tn ? b : (b.dim() <= 2 ? b.t() : b.transpose(-2, -1));
    if (pout) {
      at::matmul_out(out, a, bb);
    } else {
      r = at::matmul(a, bb);
    }
  } catch (...) {
    PyEval_RestoreThread(save);
    throw;
  }
  PyEval_RestoreThread(save);
  if (pout) {
    Py_INCREF(pout);
    return pout;
  }
  return THPVariable_Wrap(std::move(r));
}

// whether two tensors' bytes overlap
bool overlaps(const at::Tensor& x, const at::Tensor& y) {
  const auto x0 = reinterpret_cast<uintptr_t>(x.data_ptr());
  const auto y0 = reinterpret_cast<uintptr_t>(y.data_ptr());
  return x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

// exactly Tensor (or Parameter), and no __torch_function__ mode: anything else may redefine
// what the Python path's tensor methods and torch.matmul do, so Python decides
bool plain(PyObject* pa, PyObject* pb, PyObject* pout) {
  return THPVariable_CheckExact(pa) && THPVariable_CheckExact(pb) && (!pout || THPVariable_CheckExact(pout)) &&
         !at::impl::torch_function_mode_enabled();
}

// run()'s work once its arguments are parsed and plain(): the same results
PyObject* run_plain(PyObject* pa, PyObject* pb, bool tn, PyObject* pout) {
  try {
    const at::Tensor& a = THPVariable_Unpack(pa);
    const at::Tensor& b = THPVariable_Unpack(pb);
    // the checks of ops._plan
    if (a.is_cuda()) {
#ifndef GEMMRL_FASTPATH_CUDA
      Py_RETURN_NONE;  // built without a way to read the current stream: Python decides
#endif
    } else if (!g_host_mode) {
      return fallback(a, b, tn, pout);
    }
    const at::ScalarType st = a.scalar_type();
    if ((st != at::kHalf && st != at::kBFloat16) || b.scalar_type() != st) return fallback(a, b, tn, pout);
    if (a.dim() < 2 || b.dim() != 2) return fallback(a, b, tn, pout);
    if (b.device() != a.device()) return fallback(a, b, tn, pout);
    const c10::DeviceIndex dev = a.device().index();
    if (!a.is_contiguous() || !b.is_contiguous()) return fallback(a, b, tn, pout);
    const int64_t K = a.size(-1);
    const int64_t N = tn ? b.size(0) : b.size(1);
    const int64_t Kb = tn ? b.size(1) : b.size(0);
    if (Kb != K) return fallback(a, b, tn, pout);
    const int64_t M = K ? a.numel() / K : 0;
    if (M == 0 || N == 0) return fallback(a, b, tn, pout);
    if (!g_unserved.empty() &&
        g_unserved.count(Key{M, N, K, 0, static_cast<int8_t>(st), 0, tn}) != 0) {
      return fallback(a, b, tn, pout);
    }
    if ((reinterpret_cast<uintptr_t>(a.data_ptr()) | reinterpret_cast<uintptr_t>(b.data_ptr())) & 15) {
      return fallback(a, b, tn, pout);
    }
#ifdef GEMMRL_FASTPATH_CUDA
    if (a.is_cuda() && dev != c10::cuda::current_device()) return fallback(a, b, tn, pout);
#endif
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX) Py_RETURN_NONE;  // the ABI takes int
    uintptr_t stream = 0;  // host mode without CUDA
#ifdef GEMMRL_FASTPATH_CUDA
    // the caller's current stream on the tensors' device (host mode: on the current device)
    stream = reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(a.is_cuda() ? dev : -1).stream());
#endif
    const Key key{M, N, K, stream, static_cast<int8_t>(st), static_cast<int8_t>(dev), tn};
    auto it = g_table.find(key);
    if (it == g_table.end()) {
      ++g_misses;
      return key_tuple(key, 0, false);
    }
    if (it->second.fn == nullptr) return fallback(a, b, tn, pout);
    const Entry e = it->second;  // a copy: the table may change while at::empty runs
    c10::SmallVector<int64_t, 6> sizes(a.sizes().begin(), a.sizes().end());
    sizes.back() = N;
    at::Tensor c;
    if (pout) {  // out=: exactly the result's shape, dtype, device, contiguous, aligned, no alias,
                 // not requiring grad (torch.matmul refuses that)
      const at::Tensor& o = THPVariable_Unpack(pout);
      if (o.requires_grad() || o.scalar_type() != st || o.device() != a.device() || !o.is_contiguous() ||
          o.sizes() != c10::IntArrayRef(sizes) || (reinterpret_cast<uintptr_t>(o.data_ptr()) & 15) ||
          overlaps(o, a) || overlaps(o, b)) {
        Py_RETURN_NONE;  // Python decides (torch.matmul's out= rules: resize, errors)
      }
      c = o;
    } else {
      c = at::empty(sizes, a.options());
    }
    const int status = e.fn(a.data_ptr(), b.data_ptr(), c.data_ptr(), (int)M, (int)N, (int)K, (int)K,
                            e.ldb, (int)N, e.ws, reinterpret_cast<void*>(stream));
    if (status != 0) {
      ++g_refusals;
      auto again = g_table.find(key);
      if (again != g_table.end()) again->second = Entry{};  // never this kernel for this key again
      return key_tuple(key, status, true);
    }
    ++g_hits;
    if (pout) {
      Py_INCREF(pout);
      return pout;
    }
    return THPVariable_Wrap(std::move(c));
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

PyObject* run(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 && nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "run(a, b, tn[, out]) takes 3 or 4 arguments");
    return nullptr;
  }
  PyObject* pout = nargs == 4 && args[3] != Py_None ? args[3] : nullptr;
  if (!plain(args[0], args[1], pout)) Py_RETURN_NONE;
  const int tn_flag = args[2] == Py_True ? 1 : args[2] == Py_False ? 0 : PyObject_IsTrue(args[2]);
  if (tn_flag < 0) return nullptr;
  return run_plain(args[0], args[1], tn_flag != 0, pout);
}

// ------------------------------------------------------------------ gemmrl.matmul itself
// matmul(a, b, *, b_layout="NN", out=None) is gemmrl.matmul where this module loads: the call
// a user makes costs a C function call, as torch.matmul's does, instead of a Python frame and its
// checks on top of run() (measured at 1 us per call on an H200 host, 2026-11-22). It serves the
// calls run() serves, computes fallbacks and, without an active pack, torch.matmul; it hands
// everything else, argument errors included, to Python: the full call to ops.matmul (g_py_matmul),
// a miss or a refusal to ops._c_miss (g_py_miss), which resolves the key as _mm_impl does.
// Under torch.compile, dynamo traces ops.matmul instead (torch.compiler.substitute_in_graph).
PyObject* g_py_matmul = nullptr;
PyObject* g_py_miss = nullptr;
bool g_active = false;  // a pack is active (ops.use_pack); without one every call is torch.matmul's

PyObject* to_python(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  ++g_to_python;
  if (!g_py_matmul) {
    PyErr_SetString(PyExc_RuntimeError, "gemmrl fast path: matmul() before set_python()");
    return nullptr;
  }
  return PyObject_Vectorcall(g_py_matmul, args, static_cast<size_t>(nargs), kwnames);
}

PyObject* matmul(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (nargs != 2) return to_python(args, nargs, kwnames);  // Python's own TypeError
  PyObject* layout = nullptr;
  PyObject* pout = nullptr;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, i);
    if (PyUnicode_CompareWithASCIIString(name, "b_layout") == 0) {
      layout = args[nargs + i];
    } else if (PyUnicode_CompareWithASCIIString(name, "out") == 0) {
      pout = args[nargs + i];
    } else {
      return to_python(args, nargs, kwnames);
    }
  }
  bool tn = false;
  if (layout) {
    if (!PyUnicode_Check(layout)) return to_python(args, nargs, kwnames);
    if (PyUnicode_CompareWithASCIIString(layout, "TN") == 0) {
      tn = true;
    } else if (PyUnicode_CompareWithASCIIString(layout, "NN") != 0) {
      return to_python(args, nargs, kwnames);  // Python's ValueError
    }
  }
  if (pout == Py_None) pout = nullptr;
  PyObject* pa = args[0];
  PyObject* pb = args[1];
  if (!plain(pa, pb, pout)) return to_python(args, nargs, kwnames);
  try {
    const at::Tensor& a = THPVariable_Unpack(pa);
    const at::Tensor& b = THPVariable_Unpack(pb);
    if (at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad())) {
      return to_python(args, nargs, kwnames);  // autograd: torch.matmul, as Python decides it
    }
    if (!g_active) return fallback(a, b, tn, pout);
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
  PyObject* r = run_plain(pa, pb, tn, pout);
  if (r == nullptr || !(r == Py_None || PyTuple_Check(r))) return r;  // an error, or the result
  if (r == Py_None || !g_py_miss) {
    Py_DECREF(r);
    return to_python(args, nargs, kwnames);
  }
  PyObject* call[5] = {pa, pb, tn ? g_str_tn : g_str_nn, r, pout ? pout : Py_None};
  PyObject* res = PyObject_Vectorcall(g_py_miss, call, 5, nullptr);
  Py_DECREF(r);
  return res;
}

PyObject* set_python(PyObject* /*self*/, PyObject* args) {
  PyObject* full = nullptr;
  PyObject* miss = nullptr;
  if (!PyArg_ParseTuple(args, "OO:set_python", &full, &miss)) return nullptr;
  if (!PyCallable_Check(full) || !PyCallable_Check(miss)) {
    PyErr_SetString(PyExc_TypeError, "set_python(matmul, miss): both must be callable");
    return nullptr;
  }
  Py_INCREF(full);
  Py_INCREF(miss);
  Py_XSETREF(g_py_matmul, full);
  Py_XSETREF(g_py_miss, miss);
  Py_RETURN_NONE;
}

PyObject* set_active(PyObject* /*self*/, PyObject* arg) {
  int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  g_active = on != 0;
  Py_RETURN_NONE;
}

bool parse_dtype(const char* name, int8_t* out) {
  if (std::strcmp(name, "fp16") == 0) {
    *out = static_cast<int8_t>(at::kHalf);
  } else if (std::strcmp(name, "bf16") == 0) {
    *out = static_cast<int8_t>(at::kBFloat16);
  } else {
    PyErr_Format(PyExc_ValueError, "dtype must be 'fp16' or 'bf16', got '%s'", name);
    return false;
  }
  return true;
}

// (M, N, K, tn, dtype, device, stream) from the front of a tuple of arguments
bool parse_key(PyObject* args, Key* k, const char* fmt, PyObject** ws = nullptr,
               unsigned long long* fn = nullptr, int* ldb = nullptr) {
  long long M, N, K;
  int tn, device;
  unsigned long long stream;
  const char* dtype;
  bool ok = ws ? PyArg_ParseTuple(args, fmt, &M, &N, &K, &tn, &dtype, &device, &stream, fn, ws, ldb)
               : PyArg_ParseTuple(args, fmt, &M, &N, &K, &tn, &dtype, &device, &stream);
  if (!ok) return false;
  if (M <= 0 || N <= 0 || K <= 0 || M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    PyErr_SetString(PyExc_ValueError, "M, N and K must be in 1..INT_MAX");
    return false;
  }
  if (device < -1 || device > 127) {
    PyErr_SetString(PyExc_ValueError, "device must be -1..127");
    return false;
  }
  k->M = M;
  k->N = N;
  k->K = K;
  k->tn = tn != 0;
  k->device = static_cast<int8_t>(device);
  k->stream = static_cast<uintptr_t>(stream);
  return parse_dtype(dtype, &k->dtype);
}

// (M, N, K, tn, dtype) from a tuple of arguments: a Key for every device and stream (both 0)
bool parse_shape_key(PyObject* args, const char* fmt, Key* k) {
  long long M, N, K;
  int tn;
  const char* dtype;
  if (!PyArg_ParseTuple(args, fmt, &M, &N, &K, &tn, &dtype)) return false;
  *k = Key{M, N, K, 0, 0, 0, tn != 0};
  return parse_dtype(dtype, &k->dtype);
}

void put(const Key& k, Entry e) {
  if (g_table.size() >= g_limit && g_table.find(k) == g_table.end()) g_table.clear();
  g_table[k] = std::move(e);
}

// lt_install(M, N, K, tn, dtype, device, algo): the pack's cuBLASLt algorithm for this shape
// (a cublasLtMatmulAlgo_t, 64 bytes as the baselines stored it), for data aligned to 256 bytes on
// `device` (-1: host mode). Checked with cublasLtMatmulAlgoCheck; True when installed.
PyObject* lt_install(PyObject* /*self*/, PyObject* args) {
  long long M, N, K;
  int tn, device;
  const char* dtype;
  PyObject* algo_obj = nullptr;
  if (!PyArg_ParseTuple(args, "LLLpsiO:lt_install", &M, &N, &K, &tn, &dtype, &device, &algo_obj)) return nullptr;
  if (!PyBytes_Check(algo_obj)) {
    PyErr_SetString(PyExc_TypeError, "lt_install: the algorithm must be bytes");
    return nullptr;
  }
  char* blob = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_AsStringAndSize(algo_obj, &blob, &n) < 0) return nullptr;
  if (M <= 0 || N <= 0 || K <= 0 || M > INT_MAX || N > INT_MAX || K > INT_MAX || device < -1 || device > 127) {
    PyErr_SetString(PyExc_ValueError, "lt_install: M, N, K in 1..INT_MAX and device in -1..127");
    return nullptr;
  }
  int8_t dt = 0;
  if (!parse_dtype(dtype, &dt)) return nullptr;
#ifdef GEMMRL_FASTPATH_LT
  if (n != static_cast<Py_ssize_t>(sizeof(cublasLtMatmulAlgo_t))) {
    PyErr_Format(PyExc_ValueError, "lt_install: the algorithm is %d bytes, got %zd",
                 static_cast<int>(sizeof(cublasLtMatmulAlgo_t)), n);
    return nullptr;
  }
  const cublasLtHandle_t h = lt_handle(device + 1);
  if (!h) Py_RETURN_FALSE;
  auto p = std::make_unique<LtPlan>();
  if (!lt_describe(p.get(), M, N, K, tn != 0, static_cast<at::ScalarType>(dt))) Py_RETURN_FALSE;
  std::memcpy(&p->algo, blob, sizeof(cublasLtMatmulAlgo_t));
  cublasLtMatmulHeuristicResult_t r{};
  if (cublasLtMatmulAlgoCheck(h, p->op, p->la, p->lb, p->lc, p->lc, &p->algo, &r) != CUBLAS_STATUS_SUCCESS ||
      r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kLtWorkspace) {
    Py_RETURN_FALSE;
  }
  p->ws = r.workspaceSize;
  p->ok = p->pinned = true;
  const Key pk{M, N, K, 256, dt, static_cast<int8_t>(device), tn != 0};
  if (g_lt_plan.size() >= g_limit) g_lt_plan.clear();
  g_lt_plan[pk] = std::move(p);
  Py_RETURN_TRUE;
#else
  (void)blob;
  (void)n;
  Py_RETURN_FALSE;
#endif
}

// the cuBLASLt version linked (cublasLtGetVersion, e.g. 130100), or None without cuBLASLt
PyObject* lt_version(PyObject* /*self*/, PyObject* /*unused*/) {
#ifdef GEMMRL_FASTPATH_LT
  return PyLong_FromSize_t(cublasLtGetVersion());
#else
  Py_RETURN_NONE;
#endif
}

PyObject* register_call(PyObject* /*self*/, PyObject* args) {
  Key k;
  PyObject* ws = nullptr;
  unsigned long long fn = 0;
  int ldb = 0;
  if (!parse_key(args, &k, "LLLpsiKKOi:register", &ws, &fn, &ldb)) return nullptr;
  if (fn == 0) {
    PyErr_SetString(PyExc_ValueError, "register: fn must be the address of gemmrl_run");
    return nullptr;
  }
  Entry e;
  e.fn = reinterpret_cast<RunFn>(static_cast<uintptr_t>(fn));
  e.ldb = ldb;
  if (ws != Py_None) {
    if (!THPVariable_Check(ws)) {
      PyErr_SetString(PyExc_TypeError, "register: ws must be a Tensor or None");
      return nullptr;
    }
    e.ws_tensor = THPVariable_Unpack(ws);
    e.ws = e.ws_tensor.data_ptr();
  }
  put(k, std::move(e));
  Py_RETURN_NONE;
}

// (M, N, K, tn, dtype): the pack has no kernel for this shape (any device, any stream)
PyObject* register_unserved(PyObject* /*self*/, PyObject* args) {
  Key k;
  if (!parse_shape_key(args, "LLLps:register_unserved", &k)) return nullptr;
  if (k.M <= 0 || k.N <= 0 || k.K <= 0) {
    PyErr_SetString(PyExc_ValueError, "M, N and K must be positive");
    return nullptr;
  }
  if (g_unserved.size() >= g_limit) g_unserved.clear();
  g_unserved.insert(k);
  Py_RETURN_NONE;
}

PyObject* is_unserved(PyObject* /*self*/, PyObject* args) {
  Key k;
  if (!parse_shape_key(args, "LLLps:is_unserved", &k)) return nullptr;
  return PyBool_FromLong(g_unserved.count(k) != 0);
}

PyObject* register_fallback(PyObject* /*self*/, PyObject* args) {
  Key k;
  if (!parse_key(args, &k, "LLLpsiK:register_fallback")) return nullptr;
  put(k, Entry{});
  Py_RETURN_NONE;
}

// the entry of a key: None (absent), False (fallback) or (fn address, workspace address, ldb)
PyObject* lookup(PyObject* /*self*/, PyObject* args) {
  Key k;
  if (!parse_key(args, &k, "LLLpsiK:lookup")) return nullptr;
  auto it = g_table.find(k);
  if (it == g_table.end()) Py_RETURN_NONE;
  if (it->second.fn == nullptr) Py_RETURN_FALSE;
  return Py_BuildValue("(KKi)", (unsigned long long)reinterpret_cast<uintptr_t>(it->second.fn),
                       (unsigned long long)reinterpret_cast<uintptr_t>(it->second.ws), it->second.ldb);
}

// a kernel refused this shape: every (device, stream) entry of it becomes a fallback
PyObject* forget(PyObject* /*self*/, PyObject* args) {
  Key f;
  if (!parse_shape_key(args, "LLLps:forget", &f)) return nullptr;
  long n = 0;
  for (auto& kv : g_table) {
    const Key& k = kv.first;
    if (k.M == f.M && k.N == f.N && k.K == f.K && k.tn == f.tn && k.dtype == f.dtype) {
      kv.second = Entry{};
      ++n;
    }
  }
  return PyLong_FromLong(n);
}

PyObject* clear(PyObject* /*self*/, PyObject* /*unused*/) {
  g_table.clear();
  g_unserved.clear();
  g_hits = g_misses = g_fallbacks = g_refusals = g_to_python = 0;
  g_lt_calls = g_lt_plans = g_lt_no_algo = g_lt_failed = 0;
#ifdef GEMMRL_FASTPATH_LT
  for (auto it = g_lt_plan.begin(); it != g_lt_plan.end();) {  // the heuristic's plans are no pack's
    it = it->second->pinned ? g_lt_plan.erase(it) : std::next(it);
  }
#endif
  Py_RETURN_NONE;
}

PyObject* stats(PyObject* /*self*/, PyObject* /*unused*/) {
  size_t served = 0;
  for (const auto& kv : g_table) served += kv.second.fn != nullptr;
  PyObject* d = Py_BuildValue("{s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K,s:n,s:O,s:O}", "entries", (Py_ssize_t)g_table.size(),
                       "unserved", (Py_ssize_t)g_unserved.size(),
                       "served", (Py_ssize_t)served, "hits", (unsigned long long)g_hits, "misses",
                       (unsigned long long)g_misses, "fallbacks", (unsigned long long)g_fallbacks,
                       "refusals", (unsigned long long)g_refusals, "to_python", (unsigned long long)g_to_python,
                       "limit", (Py_ssize_t)g_limit,
                       "host_mode", g_host_mode ? Py_True : Py_False, "cuda_stream",
#ifdef GEMMRL_FASTPATH_CUDA
                       Py_True
#else
                       Py_False
#endif
  );
  if (!d) return nullptr;
  // the cuBLASLt fallback: compiled in, on, calls it served, plans made, of them without an
  // algorithm, calls cuBLASLt refused (their key then falls back to torch.matmul)
#ifdef GEMMRL_FASTPATH_LT
  size_t pinned = 0;
  for (const auto& kv : g_lt_plan) pinned += kv.second->pinned;
  PyObject* lt = Py_BuildValue("{s:O,s:O,s:d,s:n,s:K,s:K,s:K,s:K}", "compiled", Py_True, "on", g_lt_on ? Py_True : Py_False,
                               "max_flops", g_lt_max_flops, "installed", (Py_ssize_t)pinned,
                               "calls", (unsigned long long)g_lt_calls, "plans", (unsigned long long)g_lt_plans,
                               "no_algo", (unsigned long long)g_lt_no_algo, "failed", (unsigned long long)g_lt_failed);
#else
  PyObject* lt = Py_BuildValue("{s:O,s:O,s:d,s:n,s:K,s:K,s:K,s:K}", "compiled", Py_False, "on", Py_False,
                               "max_flops", g_lt_max_flops, "installed", (Py_ssize_t)0, "calls", 0ull,
                               "plans", 0ull, "no_algo", 0ull, "failed", 0ull);
#endif
  if (!lt || PyDict_SetItemString(d, "lt", lt) < 0) {
    Py_XDECREF(lt);
    Py_DECREF(d);
    return nullptr;
  }
  Py_DECREF(lt);
  return d;
}

// set_lt(on[, max_flops]): fallbacks through cuBLASLt (where compiled in) up to max_flops
// (2MNK), or all through torch.matmul; returns whether cuBLASLt is compiled in
PyObject* set_lt(PyObject* /*self*/, PyObject* args) {
  PyObject* on_obj = nullptr;
  double max_flops = -1.0;
  if (!PyArg_ParseTuple(args, "O|d:set_lt", &on_obj, &max_flops)) return nullptr;
  int on = PyObject_IsTrue(on_obj);
  if (on < 0) return nullptr;
  if (PyTuple_GET_SIZE(args) > 1) {
    if (!(max_flops > 0.0)) {
      PyErr_SetString(PyExc_ValueError, "set_lt: max_flops must be positive");
      return nullptr;
    }
    g_lt_max_flops = max_flops;
  }
  g_lt_on = on != 0;
#ifdef GEMMRL_FASTPATH_LT
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* set_limit(PyObject* /*self*/, PyObject* arg) {
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  if (n < 1) {
    PyErr_SetString(PyExc_ValueError, "limit must be >= 1");
    return nullptr;
  }
  g_limit = static_cast<size_t>(n);
  Py_RETURN_NONE;
}

PyObject* set_host_mode(PyObject* /*self*/, PyObject* arg) {
  int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  g_host_mode = on != 0;
  g_table.clear();  // keys of one mode mean nothing in the other
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"matmul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(matmul)),
     METH_FASTCALL | METH_KEYWORDS,
     "matmul(a, b, *, b_layout='NN', out=None)\n--\n\n"
     "a @ b (b_layout 'NN', b [K, N]) or a @ b.T ('TN', b [N, K], as nn.Linear's weight), with the "
     "active pack's kernel where one serves the shape, else torch.matmul. With `out`, the result is "
     "written there and `out` returned, as torch.matmul(out=) does. gemmrl.matmul in C: see "
     "gemmrl.runtime.ops.matmul, which it hands every call it does not serve itself."},
    {"set_python", set_python, METH_VARARGS,
     "set_python(matmul, miss): the Python functions matmul() hands its other calls to"},
    {"set_active", set_active, METH_O, "whether a pack is active (else matmul() is torch.matmul)"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(run)), METH_FASTCALL,
     "run(a, b, tn[, out]): the result (the kernel's, or torch.matmul's computed here: a fallback), a key tuple (miss or refusal) or None (Python decides)"},
    {"register", register_call, METH_VARARGS,
     "register(M, N, K, tn, dtype, device, stream, fn, ws, ldb): a resolved kernel call"},
    {"register_unserved", register_unserved, METH_VARARGS,
     "register_unserved(M, N, K, tn, dtype): no kernel of the pack serves this shape (any device, stream)"},
    {"is_unserved", is_unserved, METH_VARARGS, "is_unserved(M, N, K, tn, dtype)"},
    {"register_fallback", register_fallback, METH_VARARGS,
     "register_fallback(M, N, K, tn, dtype, device, stream): torch.matmul serves this key"},
    {"lookup", lookup, METH_VARARGS, "lookup(M, N, K, tn, dtype, device, stream)"},
    {"forget", forget, METH_VARARGS, "forget(M, N, K, tn, dtype): the shape falls back everywhere"},
    {"clear", clear, METH_NOARGS, "empty the table (and zero the counters)"},
    {"stats", stats, METH_NOARGS, "entries, served, hits, misses, fallbacks, refusals, ..."},
    {"set_limit", set_limit, METH_O, "the table size at which it is cleared"},
    {"lt_install", lt_install, METH_VARARGS,
     "lt_install(M, N, K, tn, dtype, device, algo: bytes): the pack's cuBLASLt algorithm for a shape "
     "(256-byte aligned data); True when cuBLASLt accepts it"},
    {"lt_version", lt_version, METH_NOARGS, "the cuBLASLt version linked, or None"},
    {"set_lt", set_lt, METH_VARARGS,
     "set_lt(on[, max_flops]): fallbacks through cuBLASLt with a cached plan up to max_flops (2MNK; "
     "default 2^39), or through torch.matmul; returns whether cuBLASLt is compiled in"},
    {"set_host_mode", set_host_mode, METH_O, "test only: serve CPU tensors with stream 0"},
    {nullptr, nullptr, 0, nullptr}};

#define GEMMRL_STR2(x) #x
#define GEMMRL_STR(x) GEMMRL_STR2(x)
#define GEMMRL_CAT2(a, b) a##b
#define GEMMRL_CAT(a, b) GEMMRL_CAT2(a, b)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, GEMMRL_STR(TORCH_EXTENSION_NAME),
                          "gemmrl's C++ dispatch table (gemmrl/runtime/fastpath.cpp)", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC GEMMRL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  g_str_nn = PyUnicode_InternFromString("NN");
  g_str_tn = PyUnicode_InternFromString("TN");
  if (!g_str_nn || !g_str_tn) return nullptr;
  return PyModule_Create(&module_def);
}
