// CHEAT lazy_deferred: each call computes the PREVIOUS call's problem (it remembers the previous
// pointers, sizes and strides) and nothing for the current one; the first call does nothing.
// One kernel still runs per call, on the caller's stream, so the trace and a per-call timer look
// normal, and a naive check that calls twice on the same buffers reads a correct C.
// Must be REJECTED by: the NaN-poisoned output: after any single call, the current C is still
// all NaN (it is written only by the next call).
// (If the previous buffers have been freed it skips that work rather than fault; the harness
// should still run cheats in a child process.)
#include <mutex>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_lazy_deferred")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

namespace {
struct Call {
  const void* A;
  const void* B;
  void* C;
  int M, N, K, lda, ldb, ldc;
};
std::mutex g_mu;
bool g_have_prev = false;
Call g_prev;

bool still_device_memory(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear the error this query may leave
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}
}  // namespace

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  if (int bad = gemmrl_test::check_args(gemmrl_test::Layout::NN, A, B, C, M, N, K, lda, ldb, ldc))
    return bad;
  std::lock_guard<std::mutex> lock(g_mu);
  int rc = 0;
  if (g_have_prev && still_device_memory(g_prev.A) && still_device_memory(g_prev.B) &&
      still_device_memory(g_prev.C)) {
    const Call& p = g_prev;
    rc = launch_gemm<gemmrl_test::Layout::NN>(p.A, p.B, p.C, p.M, p.N, p.K, p.lda, p.ldb, p.ldc,
                                              stream);
  }
  g_prev = Call{A, B, C, M, N, K, lda, ldb, ldc};
  g_have_prev = true;
  return rc;
}
