// CRASH illegal_address: computes C correctly, then a kernel of its own stores one fp16 zero
// 2 TiB past the start of C, an address nothing maps. The store faults ("an illegal memory
// access was encountered"), a sticky error: every later CUDA call in the process fails too.
// The harness must reject it, quarantine it, and measure the other implementations of the same
// problem in a fresh process, none of them blamed (tests/test_context_lost_gpu.py).
#include "../common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "crash_illegal_address")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

__global__ void gemmrl_test_wild_store_kernel(__half* far) { *far = __float2half(0.0f); }

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  int rc = launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (rc) return rc;
  __half* far = static_cast<__half*>(C) + (static_cast<size_t>(1) << 40);
  gemmrl_test_wild_store_kernel<<<1, 1, 0, stream>>>(far);
  return static_cast<int>(cudaGetLastError());
}
