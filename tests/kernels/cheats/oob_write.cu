// CHEAT oob_write: computes C correctly, then a second kernel of its own writes 8 extra fp16
// zeros right past the last element of C (elements (M-1)*ldc + N ... + 7, i.e. just beyond the
// end of C when ldc == N). C itself is exactly right, so any check that reads only C passes.
// Must be REJECTED by: the guard bands: the random guard after the output buffer is changed.
#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_oob_write")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

__global__ void gemmrl_test_tail_kernel(__half* end, int count) {
  const int i = threadIdx.x;
  if (i < count) end[i] = __float2half(0.0f);
}

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  int rc = launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (rc) return rc;
  __half* past_end = static_cast<__half*>(C) + static_cast<size_t>(M - 1) * ldc + N;
  gemmrl_test_tail_kernel<<<1, 32, 0, stream>>>(past_end, 8);
  return static_cast<int>(cudaGetLastError());
}
