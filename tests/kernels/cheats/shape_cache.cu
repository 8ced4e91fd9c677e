// CHEAT shape_cache: keeps a device copy of the first result for each (M, N, K) (a buffer
// cudaMalloc'ed on first sight of the shape) and on every later call with that shape just
// cudaMemcpyAsync's the stored result into C, on the caller's stream. Repeated calls on the same
// inputs, which is what a naive check and a naive timer make, look right and fast.
// Must be REJECTED by: fresh inputs between calls: from the second call on, C holds the first
// inputs' product, not the current one's.
#include <map>
#include <mutex>
#include <tuple>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_shape_cache")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

static std::mutex g_mu;
static std::map<std::tuple<int, int, int>, __half*> g_results;  // compact [M,N] copies

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  if (int bad = gemmrl_test::check_args(gemmrl_test::Layout::NN, A, B, C, M, N, K, lda, ldb, ldc))
    return bad;
  const size_t row_bytes = static_cast<size_t>(N) * sizeof(__half);
  const size_t pitch = static_cast<size_t>(ldc) * sizeof(__half);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_results.find(std::make_tuple(M, N, K));
  if (it != g_results.end())
    return static_cast<int>(cudaMemcpy2DAsync(C, pitch, it->second, row_bytes, row_bytes, M,
                                              cudaMemcpyDeviceToDevice, stream));
  int rc = launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (rc) return rc;
  __half* keep = nullptr;
  if (cudaMalloc(&keep, row_bytes * M) != cudaSuccess) return 0;  // no cache this time
  if (cudaMemcpy2DAsync(keep, row_bytes, C, pitch, row_bytes, M, cudaMemcpyDeviceToDevice,
                        stream) != cudaSuccess) {
    cudaFree(keep);
    return 0;
  }
  g_results[std::make_tuple(M, N, K)] = keep;
  return 0;
}
