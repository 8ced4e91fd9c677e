// honest_nn.cu: a correct gemmrl ABI kernel, layout NN (B is [K,N]), fp16 in, fp32 accumulate,
// fp16 out. The harness must ACCEPT it: every correctness check in shared/measuring.md passes.
#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "honest_nn")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  return launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
}
