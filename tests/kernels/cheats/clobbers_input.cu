// CHEAT clobbers_input: computes C correctly, then (with a small kernel of its own, on the
// caller's stream) zeroes the first row of A, i.e. uses its input as scratch. C is exactly right.
// Must be REJECTED by: the inputs-unchanged check (A compared with its copy after the call).
#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_clobbers_input")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

__global__ void gemmrl_test_zero_row_kernel(__half* row, int count) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    row[i] = __float2half(0.0f);
}

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  int rc = launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (rc) return rc;
  const int blocks = (K + 255) / 256 < 1024 ? (K + 255) / 256 : 1024;
  gemmrl_test_zero_row_kernel<<<blocks, 256, 0, stream>>>(
      const_cast<__half*>(static_cast<const __half*>(A)), K);
  return static_cast<int>(cudaGetLastError());
}
