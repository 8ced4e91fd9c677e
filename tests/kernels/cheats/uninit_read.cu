// CHEAT uninit_read: accumulates into a persistent fp32 scratch buffer (cudaMalloc'ed once, grown
// when a larger problem comes, never initialised and never cleared) and writes scratch to C:
//   scratch[m,n] += (A @ B)[m,n];  C[m,n] = scratch[m,n]
// Freshly mapped device memory usually reads as zero, so the first call in a process is
// typically right; every later call adds the previous results in.
// Must be REJECTED by: fresh inputs between calls / the exact test run more than once (the
// second call's C is the sum of both products).
#include <mutex>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_uninit_read")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

struct AccumulateIntoScratch {
  __half* C;
  int ldc;
  float* scratch;  // compact [M,N]
  int N;
  __device__ __forceinline__ void operator()(int row, int col, float v) const {
    float* s = scratch + static_cast<size_t>(row) * N + col;
    const float total = *s + v;  // reads whatever the buffer held
    *s = total;
    C[static_cast<size_t>(row) * ldc + col] = __float2half_rn(total);
  }
};

static std::mutex g_mu;
static float* g_scratch = nullptr;
static size_t g_capacity = 0;  // in floats

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  using namespace gemmrl_test;
  if (int bad = check_args(Layout::NN, A, B, C, M, N, K, lda, ldb, ldc)) return bad;
  const size_t need = static_cast<size_t>(M) * N;
  std::lock_guard<std::mutex> lock(g_mu);
  if (need > g_capacity) {
    if (g_scratch) cudaFree(g_scratch);
    g_scratch = nullptr;
    g_capacity = 0;
    if (cudaMalloc(&g_scratch, need * sizeof(float)) != cudaSuccess) return 30;
    g_capacity = need;
  }
  return launch_gemm_with<Layout::NN>(
      A, B, M, N, K, lda, ldb,
      AccumulateIntoScratch{static_cast<__half*>(C), ldc, g_scratch, N}, stream);
}
