// CHEAT partial_write: computes every row of C except the last one, which it never writes. If C
// held a correct answer before (a naive check that reuses C, or zeros where the answer is small)
// the result looks right.
// Must be REJECTED by: the NaN-poisoned output: the last row of C is still NaN after the call.
#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_partial_write")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  using namespace gemmrl_test;
  if (int bad = check_args(Layout::NN, A, B, C, M, N, K, lda, ldb, ldc)) return bad;
  if (M == 1) return 0;  // the only row is the last one: write nothing
  return launch_gemm<Layout::NN>(A, B, C, M - 1, N, K, lda, ldb, ldc, stream);
}
