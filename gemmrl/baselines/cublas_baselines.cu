// cuBLAS / cuBLASLt baselines for gemmrl, as a plain shared library with a C ABI (loaded from
// Python through ctypes; no torch headers, no pybind).
//
// Conventions (all matrices row-major, C has the input dtype, alpha = 1, beta = 0):
//   A is [M,K] (lda = K).
//   layout 0 "NN": B is [K,N] (ldb = N), C = A @ B.
//   layout 1 "TN": B is [N,K] (ldb = K), C = A @ B^T.
//   C is [M,N] (ldc = N).
//   dtype 0 = fp16, 1 = bf16.  acc 0 = fp32 accumulate (float alpha/beta),
//   acc 1 = fp16 accumulate (half alpha/beta; fp16 inputs only).
// Row-major trick: the column-major view of row-major C is C^T (N x M), and
// C^T = op(B) * op(A) in cuBLAS's column-major terms, so cuBLAS's "A" is our B and its "B" is
// our A: NN -> transa = N on B (ld N), transb = N on A (ld K); TN -> transa = T on B (ld K).
//
// Status codes returned by every int function: 0 ok; 1..999 a cublasStatus_t;
// GBL_CUDA_ERROR_BASE + e for a cudaError_t e; negative for this library's own errors (see
// gbl_status_string). gbl_cublas_gemm and gbl_lt_plan_run never allocate and never synchronize,
// so they may be captured into a CUDA graph. They share one workspace (set up by gbl_init), so
// calls must not run concurrently on different streams.

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#ifndef CUBLAS_VER_MAJOR
#error "cublas_api.h without CUBLAS_VER_MAJOR: cuBLAS 11.0 or newer is required"
#endif

// CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID and CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID (and the
// cublasLtClusterShape_t enum) exist from CUDA 11.8 / cuBLAS 11.11 on. cuBLASLt 13.1 has no
// ALGO_CAP attribute listing the supported cluster shapes (and an enum can't be tested with
// #ifdef), so they are probed with cublasLtMatmulAlgoCheck (see cluster_shapes_for).
#if CUBLAS_VER_MAJOR > 11 || (CUBLAS_VER_MAJOR == 11 && CUBLAS_VER_MINOR >= 11)
#define GBL_HAVE_CLUSTER_SHAPE 1
#else
#define GBL_HAVE_CLUSTER_SHAPE 0
#endif

static_assert(sizeof(cublasLtMatmulAlgo_t) == 64, "cublasLtMatmulAlgo_t is expected to be 64 bytes");

enum {
  GBL_OK = 0,
  GBL_ERR_ARG = -1,             // bad argument (layout, dtype, acc, sizes, null pointer, ...)
  GBL_ERR_NOT_INIT = -2,        // gbl_init was not called (or failed)
  GBL_ERR_PLAN = -3,            // unknown or destroyed plan id
  GBL_ERR_NO_ALGO = -4,         // the heuristic returned no usable algorithm
  GBL_ERR_WORKSPACE = -5,       // the algorithm needs more workspace than gbl_init allocated
  GBL_ERR_MISALIGNED = -6,      // a pointer is less aligned than the plan's algorithm needs
  GBL_ERR_ALGO_REJECTED = -7,   // cublasLtMatmulAlgoCheck refused the given algorithm
  GBL_CUDA_ERROR_BASE = 10000,  // status = GBL_CUDA_ERROR_BASE + cudaError_t
};

namespace {

constexpr size_t kDefaultWorkspace = size_t(32) << 20;
constexpr int kMaxHeuristic = 100;
// Bounds on the exhaustive search: at most this many cublasLtMatmulAlgoCheck calls in all (each
// is a host-only call of a few microseconds), shared fairly among the algorithm ids.
constexpr long kMaxChecks = 200000;
constexpr int kMaxAlgoIds = 256;
constexpr int kMaxCustomOptions = 16;  // custom options 0..15 at most (one sm90 id offers 153)
constexpr int kSeedsPerAlgo = 32;

std::mutex g_mu;  // guards everything below
bool g_ready = false;
cublasHandle_t g_blas = nullptr;
cublasLtHandle_t g_lt = nullptr;
void* g_ws = nullptr;
size_t g_ws_bytes = 0;

int cuda_status(cudaError_t e) { return e == cudaSuccess ? GBL_OK : GBL_CUDA_ERROR_BASE + int(e); }

#define GBL_CHECK_BLAS(expr)                      \
  do {                                            \
    cublasStatus_t st_ = (expr);                  \
    if (st_ != CUBLAS_STATUS_SUCCESS) return int(st_); \
  } while (0)

struct Types {
  cudaDataType_t data;
  cublasComputeType_t compute;
  cudaDataType_t scale;
};

int map_types(int dtype, int acc, Types* t) {
  if (dtype != 0 && dtype != 1) return GBL_ERR_ARG;
  if (acc != 0 && acc != 1) return GBL_ERR_ARG;
  if (acc == 1 && dtype != 0) return GBL_ERR_ARG;  // fp16 accumulate only for fp16 inputs
  t->data = dtype == 0 ? CUDA_R_16F : CUDA_R_16BF;
  t->compute = acc == 0 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_16F;
  t->scale = acc == 0 ? CUDA_R_32F : CUDA_R_16F;
  return GBL_OK;
}

int check_problem(int layout, int M, int N, int K) {
  if (layout != 0 && layout != 1) return GBL_ERR_ARG;
  if (M <= 0 || N <= 0 || K <= 0) return GBL_ERR_ARG;
  return GBL_OK;
}

// alpha = 1, beta = 0 in both scale types; host pointer mode (the values are read when the call
// is made or captured).
const float kOneF = 1.0f, kZeroF = 0.0f;
const __half kOneH = __float2half(1.0f), kZeroH = __float2half(0.0f);

const void* alpha_for(int acc) { return acc == 0 ? static_cast<const void*>(&kOneF) : &kOneH; }
const void* beta_for(int acc) { return acc == 0 ? static_cast<const void*>(&kZeroF) : &kZeroH; }

// The cuBLASLt description of one problem: matmul descriptor and the layouts of cuBLAS's A (our
// B), cuBLAS's B (our A) and C (= D).
struct LtProblem {
  int layout = 0, dtype = 0, acc = 0, M = 0, N = 0, K = 0;
  Types types{};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;

  LtProblem() = default;
  LtProblem(const LtProblem&) = delete;
  LtProblem& operator=(const LtProblem&) = delete;
  ~LtProblem() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }

  int init(int layout_, int dtype_, int acc_, int M_, int N_, int K_) {
    int s = check_problem(layout_, M_, N_, K_);
    if (s != GBL_OK) return s;
    s = map_types(dtype_, acc_, &types);
    if (s != GBL_OK) return s;
    layout = layout_, dtype = dtype_, acc = acc_, M = M_, N = N_, K = K_;
    GBL_CHECK_BLAS(cublasLtMatmulDescCreate(&op, types.compute, types.scale));
    cublasOperation_t ta = layout == 0 ? CUBLAS_OP_N : CUBLAS_OP_T, tb = CUBLAS_OP_N;
    GBL_CHECK_BLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    GBL_CHECK_BLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (layout == 0) {  // our B [K,N] row-major = column-major N x K, ld N
      GBL_CHECK_BLAS(cublasLtMatrixLayoutCreate(&a, types.data, uint64_t(N), uint64_t(K), int64_t(N)));
    } else {  // our B [N,K] row-major = column-major K x N, ld K, used transposed
      GBL_CHECK_BLAS(cublasLtMatrixLayoutCreate(&a, types.data, uint64_t(K), uint64_t(N), int64_t(K)));
    }
    // our A [M,K] row-major = column-major K x M, ld K
    GBL_CHECK_BLAS(cublasLtMatrixLayoutCreate(&b, types.data, uint64_t(K), uint64_t(M), int64_t(K)));
    // our C [M,N] row-major = column-major N x M, ld N
    GBL_CHECK_BLAS(cublasLtMatrixLayoutCreate(&c, types.data, uint64_t(N), uint64_t(M), int64_t(N)));
    return GBL_OK;
  }

  // cublasLtMatmulAlgoCheck, folded into one status; *ws gets the workspace the algo needs.
  cublasStatus_t check(const cublasLtMatmulAlgo_t& algo, size_t* ws) const {
    cublasLtMatmulHeuristicResult_t r;
    std::memset(&r, 0, sizeof(r));
    cublasStatus_t s = cublasLtMatmulAlgoCheck(g_lt, op, a, b, c, c, &algo, &r);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    if (r.state != CUBLAS_STATUS_SUCCESS) return r.state;
    *ws = r.workspaceSize;
    return CUBLAS_STATUS_SUCCESS;
  }

  bool accepts(const cublasLtMatmulAlgo_t& algo) const {
    size_t ws = 0;
    return check(algo, &ws) == CUBLAS_STATUS_SUCCESS && ws <= g_ws_bytes;
  }
};

int heuristic_locked(const LtProblem& p, int requested, std::vector<cublasLtMatmulHeuristicResult_t>* out) {
  cublasLtMatmulPreference_t pref = nullptr;
  GBL_CHECK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = g_ws_bytes;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(requested));
  int n = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(g_lt, p.op, p.a, p.b, p.c, p.c, pref, requested, res.data(), &n);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return int(s);
  out->clear();
  for (int i = 0; i < n; ++i)
    if (res[size_t(i)].state == CUBLAS_STATUS_SUCCESS && res[size_t(i)].workspaceSize <= g_ws_bytes)
      out->push_back(res[size_t(i)]);
  return GBL_OK;
}

template <typename T>
std::vector<T> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  std::vector<T> v;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS) return v;
  if (bytes == 0 || bytes % sizeof(T) != 0) return v;
  v.resize(bytes / sizeof(T));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &written) != CUBLAS_STATUS_SUCCESS) v.clear();
  else v.resize(written / sizeof(T));
  return v;
}

template <typename T>
T cap_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, T fallback) {
  T v{};
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS ||
      written != sizeof(v))
    return fallback;
  return v;
}

template <typename T>
bool set_cfg(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr, T v) {
  return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &v, sizeof(v)) == CUBLAS_STATUS_SUCCESS;
}

template <typename T>
T get_cfg(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T fallback) {
  T v{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS)
    return fallback;
  return v;
}

// One point of an algorithm id's configuration space beyond (tile, stages).
struct Variant {
  int32_t splitk;
  uint32_t reduction;
  uint32_t swizzle;
  uint32_t custom;
  uint16_t cluster;
};

// False when cuBLASLt refuses to store one of the values (the configuration is then skipped).
bool apply(cublasLtMatmulAlgo_t* algo, uint32_t tile, uint32_t stages, const Variant& v) {
  bool ok = set_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
  ok = set_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, stages) && ok;
  ok = set_cfg<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, v.splitk) && ok;
  ok = set_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, v.reduction) && ok;
  ok = set_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, v.swizzle) && ok;
  ok = set_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, v.custom) && ok;
#if GBL_HAVE_CLUSTER_SHAPE
  ok = set_cfg<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, v.cluster) && ok;
#endif
  return ok;
}

// The configuration of an algo as a comparable key (the opaque bytes of two equal configurations
// can differ), for de-duplication.
using ConfigKey = std::array<int64_t, 9>;

ConfigKey config_key(const cublasLtMatmulAlgo_t& a) {
  return {get_cfg<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID, -1),
          get_cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID, 0),
          get_cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0),
          get_cfg<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1),
          get_cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 0),
          get_cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 0),
          get_cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 0),
#if GBL_HAVE_CLUSTER_SHAPE
          get_cfg<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 0),
          get_cfg<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0)};
#else
          0, 0};
#endif
}

// Accepted configurations, in discovery order, without duplicates, with a count of
// cublasLtMatmulAlgoCheck calls against the budget.
struct Found {
  std::vector<cublasLtMatmulAlgo_t> algos;
  std::set<ConfigKey> keys;
  long checks = 0;

  bool add(const cublasLtMatmulAlgo_t& a) {
    if (!keys.insert(config_key(a)).second) return false;
    algos.push_back(a);
    return true;
  }
  // Check and keep; true when accepted (also when it was already kept).
  bool try_add(const LtProblem& p, const cublasLtMatmulAlgo_t& a) {
    ++checks;
    if (!p.accepts(a)) return false;
    add(a);
    return true;
  }
};

// cuBLASLt's own suggestions restricted to one algorithm id (CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID):
// valid configurations that also show which cluster shapes and custom options the id wants.
std::vector<cublasLtMatmulAlgo_t> seeds_for(const LtProblem& p, const cublasLtMatmulAlgo_t& base, int count) {
  std::vector<cublasLtMatmulAlgo_t> out;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return out;
  uint64_t ws = g_ws_bytes;
  uint32_t mode = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(count));
  for (auto& r : res) r.algo = base;
  int n = 0;
  if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode)) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(g_lt, p.op, p.a, p.b, p.c, p.c, pref, count, res.data(), &n) ==
          CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < n; ++i)
      if (res[size_t(i)].state == CUBLAS_STATUS_SUCCESS && res[size_t(i)].workspaceSize <= g_ws_bytes)
        out.push_back(res[size_t(i)].algo);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return out;
}

// Cluster shapes to try, AUTO (0) first. cuBLASLt 13.1 lists none as a capability, so they are
// probed on one accepted configuration `ref`. Algorithms that ignore the
// attribute (they accept an id that is no cluster shape at all) get AUTO only; algorithms that
// need an explicit shape (sm90 kernels refuse AUTO) get the shapes they accept.
std::vector<uint16_t> cluster_shapes_for(const LtProblem& p, const cublasLtMatmulAlgo_t* ref, long* checks) {
  std::vector<uint16_t> out{0};
#if GBL_HAVE_CLUSTER_SHAPE
  const uint16_t probe[] = {
      uint16_t(CUBLASLT_CLUSTER_SHAPE_1x1x1), uint16_t(CUBLASLT_CLUSTER_SHAPE_2x1x1),
      uint16_t(CUBLASLT_CLUSTER_SHAPE_1x2x1), uint16_t(CUBLASLT_CLUSTER_SHAPE_2x2x1),
      uint16_t(CUBLASLT_CLUSTER_SHAPE_4x1x1), uint16_t(CUBLASLT_CLUSTER_SHAPE_1x4x1),
      uint16_t(CUBLASLT_CLUSTER_SHAPE_4x2x1), uint16_t(CUBLASLT_CLUSTER_SHAPE_2x4x1),
      uint16_t(CUBLASLT_CLUSTER_SHAPE_4x4x1),
  };
  if (!ref) {  // nothing accepted yet: AUTO and the two smallest explicit shapes
    out.push_back(probe[0]);
    out.push_back(probe[1]);
    return out;
  }
  cublasLtMatmulAlgo_t a = *ref;
  ++*checks;
  if (set_cfg<uint16_t>(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t(CUBLASLT_CLUSTER_SHAPE_END)) &&
      p.accepts(a))
    return out;  // the attribute is not validated: AUTO only
  out.clear();
  for (uint16_t cs : {uint16_t(0), probe[0], probe[1], probe[2], probe[3], probe[4], probe[5], probe[6], probe[7],
                      probe[8]}) {
    a = *ref;
    ++*checks;
    if (set_cfg<uint16_t>(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cs) && p.accepts(a)) out.push_back(cs);
  }
  if (out.empty()) out.push_back(get_cfg<uint16_t>(*ref, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0));
#else
  (void)p, (void)ref, (void)checks;
#endif
  return out;
}

// Bounded enumeration of one algorithm id's configurations; appends the accepted ones to *found.
//  0. seeds: cuBLASLt's suggestions for this id (valid by construction);
//  1. bases: every (tile, stages) from the capabilities, each tried with a few (cluster, custom)
//     pairs (AUTO/0 and those the seeds use) until one is accepted;
//  2. variants of each base: split-K in {1,2,4,8,16} (each supported reduction scheme for > 1),
//     CTA swizzle 0/1, custom option 0..max, cluster shapes; evenly strided when over budget.
void enumerate_algo(const LtProblem& p, int algo_id, long budget, Found* found) {
  cublasLtMatmulAlgo_t base;
  if (cublasLtMatmulAlgoInit(g_lt, p.types.compute, p.types.scale, p.types.data, p.types.data, p.types.data,
                             p.types.data, algo_id, &base) != CUBLAS_STATUS_SUCCESS)
    return;
  const long start = found->checks;
  auto spent = [&] { return found->checks - start; };
  std::vector<uint32_t> tiles = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
  std::vector<uint32_t> stages = cap_list<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
  if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
  if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
  const int32_t splitk_support = cap_value<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, 0);
  const uint32_t red_mask = cap_value<uint32_t>(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, 0);
  const uint32_t swz_support = cap_value<uint32_t>(base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, 0);
  const uint32_t custom_max = uint32_t(
      std::min(std::max(cap_value<int32_t>(base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, 0), 0), kMaxCustomOptions - 1));

  // 0. Seeds.
  const std::vector<cublasLtMatmulAlgo_t> seeds = seeds_for(p, base, kSeedsPerAlgo);
  for (const auto& s : seeds) found->add(s);

  // 1. Bases.
  std::vector<std::pair<uint16_t, uint32_t>> pairs;  // (cluster, custom) to try on each (tile, stages)
  auto add_pair = [&](uint16_t cl, uint32_t cu) {
    if (std::find(pairs.begin(), pairs.end(), std::make_pair(cl, cu)) == pairs.end()) pairs.emplace_back(cl, cu);
  };
  std::vector<uint16_t> clusters = cluster_shapes_for(p, seeds.empty() ? nullptr : &seeds[0], &found->checks);
  add_pair(clusters[0], 0);
  for (const auto& s : seeds) {
    const uint16_t cl = uint16_t(config_key(s)[8]);
    const uint32_t cu = uint32_t(config_key(s)[6]);
    if (std::find(clusters.begin(), clusters.end(), cl) != clusters.end() && cu <= custom_max) add_pair(cl, cu);
  }
  if (seeds.empty())
    for (size_t i = 1; i < clusters.size(); ++i) add_pair(clusters[i], 0);

  struct Base {
    uint32_t tile, stages;
    uint16_t cluster;
    uint32_t custom;
  };
  std::vector<Base> bases;
  for (uint32_t t : tiles) {
    for (uint32_t s : stages) {
      for (const auto& pc : pairs) {
        if (spent() >= budget) break;
        cublasLtMatmulAlgo_t a = base;
        const Variant v{1, CUBLASLT_REDUCTION_SCHEME_NONE, 0, pc.second, pc.first};
        if (!apply(&a, t, s, v)) continue;
        if (found->try_add(p, a)) {
          bases.push_back({t, s, pc.first, pc.second});
          break;
        }
      }
    }
  }
  if (bases.empty()) return;
  if (seeds.empty()) {  // now that something is accepted, learn the cluster shapes properly
    cublasLtMatmulAlgo_t ref = base;
    apply(&ref, bases[0].tile, bases[0].stages,
          Variant{1, CUBLASLT_REDUCTION_SCHEME_NONE, 0, bases[0].custom, bases[0].cluster});
    clusters = cluster_shapes_for(p, &ref, &found->checks);
  }

  // 2. Variants.
  std::vector<Variant> variants;
  const int32_t splits[] = {1, 2, 4, 8, 16};
  const uint32_t schemes[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                              CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE};
  for (int32_t sk : splits) {
    if (sk > 1 && (!splitk_support || sk > p.K)) continue;
    std::vector<uint32_t> reds;
    if (sk == 1) {
      reds.push_back(CUBLASLT_REDUCTION_SCHEME_NONE);
    } else {
      for (uint32_t r : schemes)
        if (red_mask & r) reds.push_back(r);
    }
    for (uint32_t r : reds)
      for (uint32_t swz = 0; swz <= (swz_support ? 1u : 0u); ++swz)
        for (uint32_t cu = 0; cu <= custom_max; ++cu)
          for (uint16_t cl : clusters) variants.push_back({sk, r, swz, cu, cl});
  }
  const long per_base = long(variants.size());
  const long total = per_base * long(bases.size());
  const long take = std::min(total, std::max(0L, budget - spent()));
  for (long j = 0; j < take; ++j) {
    // Evenly strided over base-major, variant-minor order; all of it when it fits the budget.
    const long idx = take == total ? j : long((static_cast<unsigned long long>(j) * total) / take);
    const Base& b = bases[size_t(idx / per_base)];
    const Variant& v = variants[size_t(idx % per_base)];
    if (v.splitk == 1 && v.swizzle == 0 && v.custom == b.custom && v.cluster == b.cluster) continue;  // the base
    cublasLtMatmulAlgo_t a = base;
    if (!apply(&a, b.tile, b.stages, v)) continue;
    found->try_add(p, a);
  }
}

struct Plan {
  LtProblem prob;
  cublasLtMatmulAlgo_t algo;
  uint32_t align_a = 1, align_b = 1, align_c = 1;  // our A, our B, our C (bytes)
};

std::vector<std::unique_ptr<Plan>> g_plans;

bool aligned(const void* p, uint32_t bytes) {
  return bytes <= 1 || (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace

extern "C" {

int gbl_init(size_t workspace_bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_ready) return GBL_OK;
  if (workspace_bytes == 0) workspace_bytes = kDefaultWorkspace;
  int s = GBL_OK;
  if (!g_blas) {
    cublasStatus_t st = cublasCreate(&g_blas);
    if (st != CUBLAS_STATUS_SUCCESS) {
      g_blas = nullptr;
      return int(st);
    }
  }
  if (!g_lt) {
    cublasStatus_t st = cublasLtCreate(&g_lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
      g_lt = nullptr;
      return int(st);
    }
  }
  if (!g_ws) {
    s = cuda_status(cudaMalloc(&g_ws, workspace_bytes));
    if (s != GBL_OK) {
      g_ws = nullptr;
      return s;
    }
    g_ws_bytes = workspace_bytes;
  }
  GBL_CHECK_BLAS(cublasSetWorkspace(g_blas, g_ws, g_ws_bytes));
  // Tensor ops allowed; split-K partial sums reduced in the compute type, not the output type:
  // the same setting gemmrl gives torch (allow_fp16_reduced_precision_reduction = False).
  GBL_CHECK_BLAS(cublasSetMathMode(
      g_blas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  g_ready = true;
  return GBL_OK;
}

int gbl_cublas_gemm(int layout, int dtype, int acc, const void* A, const void* B, void* C, int M, int N, int K,
                    void* stream) {
  Types t;
  int s = check_problem(layout, M, N, K);
  if (s == GBL_OK) s = map_types(dtype, acc, &t);
  if (s != GBL_OK) return s;
  if (!A || !B || !C) return GBL_ERR_ARG;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) return GBL_ERR_NOT_INIT;
  GBL_CHECK_BLAS(cublasSetStream(g_blas, static_cast<cudaStream_t>(stream)));
  // cublasSetStream resets the workspace to cuBLAS's own pool: point it back at ours, so the
  // call neither allocates nor breaks graph capture.
  GBL_CHECK_BLAS(cublasSetWorkspace(g_blas, g_ws, g_ws_bytes));
  const cublasOperation_t ta = layout == 0 ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int lda = layout == 0 ? N : K;
  GBL_CHECK_BLAS(cublasGemmEx(g_blas, ta, CUBLAS_OP_N, N, M, K, alpha_for(acc), B, t.data, lda, A, t.data, K,
                              beta_for(acc), C, t.data, N, t.compute, CUBLAS_GEMM_DEFAULT));
  return GBL_OK;
}

int gbl_lt_heuristic(int layout, int dtype, int acc, int M, int N, int K, int requested, void* out_algos,
                     int* n_out) {
  if (!out_algos || !n_out || requested <= 0 || requested > kMaxHeuristic) return GBL_ERR_ARG;
  *n_out = 0;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) return GBL_ERR_NOT_INIT;
  LtProblem p;
  int s = p.init(layout, dtype, acc, M, N, K);
  if (s != GBL_OK) return s;
  std::vector<cublasLtMatmulHeuristicResult_t> res;
  s = heuristic_locked(p, requested, &res);
  if (s != GBL_OK) return s;
  auto* dst = static_cast<unsigned char*>(out_algos);
  for (size_t i = 0; i < res.size(); ++i) std::memcpy(dst + i * sizeof(cublasLtMatmulAlgo_t), &res[i].algo, sizeof(cublasLtMatmulAlgo_t));
  *n_out = int(res.size());
  return GBL_OK;
}

int gbl_lt_enumerate(int layout, int dtype, int acc, int M, int N, int K, int max_out, void* out_algos,
                     int* n_out) {
  if (!out_algos || !n_out || max_out <= 0) return GBL_ERR_ARG;
  *n_out = 0;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) return GBL_ERR_NOT_INIT;
  LtProblem p;
  int s = p.init(layout, dtype, acc, M, N, K);
  if (s != GBL_OK) return s;
  std::vector<int> ids(kMaxAlgoIds);
  int n_ids = 0;
  GBL_CHECK_BLAS(cublasLtMatmulAlgoGetIds(g_lt, p.types.compute, p.types.scale, p.types.data, p.types.data,
                                          p.types.data, p.types.data, kMaxAlgoIds, ids.data(), &n_ids));
  ids.resize(size_t(std::max(n_ids, 0)));

  // cuBLASLt's own top suggestions come first, so the enumerated space contains the heuristic's.
  Found found;
  std::vector<cublasLtMatmulHeuristicResult_t> top;
  if (heuristic_locked(p, kMaxHeuristic, &top) == GBL_OK)
    for (const auto& r : top) found.add(r.algo);
  std::vector<size_t> required;  // kept by the sampling below, in this order
  for (size_t i = 0; i < found.algos.size(); ++i) required.push_back(i);
  for (size_t i = 0; i < ids.size(); ++i) {
    const long left = kMaxChecks - found.checks;
    if (left <= 0) break;
    const long budget = std::max(left / long(ids.size() - i), 1L);
    const size_t before = found.algos.size();
    enumerate_algo(p, ids[i], budget, &found);
    if (found.algos.size() > before) required.push_back(before);  // this algo id's first config
  }
  const std::vector<cublasLtMatmulAlgo_t>& valid = found.algos;

  // Deterministic sample of max_out: the heuristic's suggestions and each algo id's first config,
  // then an even stride over the rest.
  std::vector<char> keep(valid.size(), 0);
  if (valid.size() <= size_t(max_out)) {
    std::fill(keep.begin(), keep.end(), 1);
  } else {
    size_t kept = 0;
    for (size_t f : required) {
      if (kept == size_t(max_out)) break;
      if (!keep[f]) keep[f] = 1, ++kept;
    }
    std::vector<size_t> rest;
    for (size_t i = 0; i < valid.size(); ++i)
      if (!keep[i]) rest.push_back(i);
    const size_t want = size_t(max_out) - kept;
    for (size_t j = 0; j < want; ++j) keep[rest[j * rest.size() / want]] = 1;
  }
  auto* dst = static_cast<unsigned char*>(out_algos);
  int n = 0;
  for (size_t i = 0; i < valid.size(); ++i)
    if (keep[i]) std::memcpy(dst + size_t(n++) * sizeof(cublasLtMatmulAlgo_t), &valid[i], sizeof(cublasLtMatmulAlgo_t));
  *n_out = n;
  return GBL_OK;
}

int gbl_lt_plan_create(int layout, int dtype, int acc, int M, int N, int K, const void* algo_or_null,
                       int* plan_id) {
  if (!plan_id) return GBL_ERR_ARG;
  *plan_id = -1;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) return GBL_ERR_NOT_INIT;
  std::unique_ptr<Plan> plan(new Plan());
  int s = plan->prob.init(layout, dtype, acc, M, N, K);
  if (s != GBL_OK) return s;
  if (algo_or_null) {
    std::memcpy(&plan->algo, algo_or_null, sizeof(cublasLtMatmulAlgo_t));
    size_t ws = 0;
    if (plan->prob.check(plan->algo, &ws) != CUBLAS_STATUS_SUCCESS) return GBL_ERR_ALGO_REJECTED;
    if (ws > g_ws_bytes) return GBL_ERR_WORKSPACE;
  } else {
    std::vector<cublasLtMatmulHeuristicResult_t> res;
    s = heuristic_locked(plan->prob, 1, &res);
    if (s != GBL_OK) return s;
    if (res.empty()) return GBL_ERR_NO_ALGO;
    plan->algo = res[0].algo;
  }
  // cuBLAS's A is our B, its B our A.
  plan->align_b = cap_value<uint32_t>(plan->algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, 1);
  plan->align_a = cap_value<uint32_t>(plan->algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES, 1);
  plan->align_c = std::max(cap_value<uint32_t>(plan->algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, 1),
                           cap_value<uint32_t>(plan->algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES, 1));
  for (size_t i = 0; i < g_plans.size(); ++i) {
    if (!g_plans[i]) {
      g_plans[i] = std::move(plan);
      *plan_id = int(i);
      return GBL_OK;
    }
  }
  g_plans.push_back(std::move(plan));
  *plan_id = int(g_plans.size() - 1);
  return GBL_OK;
}

int gbl_lt_plan_run(int plan_id, const void* A, const void* B, void* C, void* stream) {
  if (!A || !B || !C) return GBL_ERR_ARG;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) return GBL_ERR_NOT_INIT;
  if (plan_id < 0 || size_t(plan_id) >= g_plans.size() || !g_plans[size_t(plan_id)]) return GBL_ERR_PLAN;
  const Plan& pl = *g_plans[size_t(plan_id)];
  if (!aligned(A, pl.align_a) || !aligned(B, pl.align_b) || !aligned(C, pl.align_c)) return GBL_ERR_MISALIGNED;
  const LtProblem& p = pl.prob;
  GBL_CHECK_BLAS(cublasLtMatmul(g_lt, p.op, alpha_for(p.acc), B, p.a, A, p.b, beta_for(p.acc), C, p.c, C, p.c,
                                &pl.algo, g_ws, g_ws_bytes, static_cast<cudaStream_t>(stream)));
  return GBL_OK;
}

int gbl_lt_plan_destroy(int plan_id) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (plan_id < 0 || size_t(plan_id) >= g_plans.size() || !g_plans[size_t(plan_id)]) return GBL_ERR_PLAN;
  g_plans[size_t(plan_id)].reset();
  return GBL_OK;
}

int gbl_algo_describe(const void* algo_bytes, char* buf, int buflen) {
  if (!algo_bytes || !buf || buflen <= 0) return GBL_ERR_ARG;
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, algo_bytes, sizeof(algo));
  const int id = get_cfg<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID, -1);
  const unsigned tile = get_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0);
  const unsigned stages = get_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0);
  const int splitk = get_cfg<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1);
  const unsigned red = get_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 0);
  const unsigned swz = get_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 0);
  const unsigned custom = get_cfg<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 0);
#if GBL_HAVE_CLUSTER_SHAPE
  const unsigned inner = get_cfg<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 0);
  const unsigned cluster = get_cfg<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0);
#else
  const unsigned inner = 0, cluster = 0;
#endif
  const int n = std::snprintf(buf, size_t(buflen),
                              "algo=%d tile=%u stages=%u splitk=%d reduction=%u swizzle=%u custom=%u inner=%u cluster=%u",
                              id, tile, stages, splitk, red, swz, custom, inner, cluster);
  return n < 0 ? GBL_ERR_ARG : GBL_OK;
}

const char* gbl_version(void) {
  static char text[256];
  static std::once_flag once;
  std::call_once(once, [] {
    int major = -1, minor = -1, patch = -1;
    cublasGetProperty(MAJOR_VERSION, &major);
    cublasGetProperty(MINOR_VERSION, &minor);
    cublasGetProperty(PATCH_LEVEL, &patch);
    int cudart = 0;
    cudaRuntimeGetVersion(&cudart);
    std::snprintf(text, sizeof(text), "cublas=%d.%d.%d cublasLt=%zu headers=%d.%d.%d.%d cudart=%d lt_cudart=%zu",
                  major, minor, patch, cublasLtGetVersion(), CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR, CUBLAS_VER_PATCH,
                  CUBLAS_VER_BUILD, cudart, cublasLtGetCudartVersion());
  });
  return text;
}

const char* gbl_status_string(int status) {
  switch (status) {
    case GBL_OK: return "ok";
    case GBL_ERR_ARG: return "GBL_ERR_ARG: bad argument";
    case GBL_ERR_NOT_INIT: return "GBL_ERR_NOT_INIT: gbl_init has not succeeded";
    case GBL_ERR_PLAN: return "GBL_ERR_PLAN: unknown or destroyed plan id";
    case GBL_ERR_NO_ALGO: return "GBL_ERR_NO_ALGO: the heuristic returned no usable algorithm";
    case GBL_ERR_WORKSPACE: return "GBL_ERR_WORKSPACE: the algorithm needs more workspace than was allocated";
    case GBL_ERR_MISALIGNED: return "GBL_ERR_MISALIGNED: a pointer is less aligned than the algorithm needs";
    case GBL_ERR_ALGO_REJECTED: return "GBL_ERR_ALGO_REJECTED: cublasLtMatmulAlgoCheck refused the algorithm";
    default: break;
  }
  if (status >= GBL_CUDA_ERROR_BASE) return cudaGetErrorName(static_cast<cudaError_t>(status - GBL_CUDA_ERROR_BASE));
  if (status > 0) return cublasGetStatusName(static_cast<cublasStatus_t>(status));
  return "unknown status";
}

size_t gbl_workspace_bytes(void) { return g_ws_bytes; }

}  // extern "C"
