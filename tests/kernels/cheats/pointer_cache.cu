// CHEAT pointer_cache: computes C on the first call for a given (A, B, C) pointer triple and does
// nothing at all on later calls with the same pointers, trusting that C still holds the answer.
// Timed calls that reuse the same buffers then cost nothing, and the result a naive check reads
// after them is the (correct) first one.
// Must be REJECTED by: fresh inputs in the same buffers between calls: the second call's C still
// holds the first inputs' product (or the NaN poison, when the harness re-poisons C).
#include <mutex>
#include <set>
#include <tuple>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_pointer_cache")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

static std::mutex g_mu;
static std::set<std::tuple<const void*, const void*, void*>> g_seen;

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_seen.count(std::make_tuple(A, B, C))) return 0;  // "already computed"
  }
  int rc = launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (rc == 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_seen.insert(std::make_tuple(A, B, C));
  }
  return rc;
}
