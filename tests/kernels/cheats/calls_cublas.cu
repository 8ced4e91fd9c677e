// CHEAT calls_cublas: gemmrl_run hands the GEMM to cuBLAS (cublasGemmEx, fp32 compute, on a
// static handle created on first use and pointed at the caller's stream) instead of running a
// kernel of its own. The numbers are right (they are cuBLAS's), it stays on the caller's stream,
// and the .so even contains a kernel of its own (a fallback when no handle can be made), so a
// naive check of results, streams or symbols passes.
// Must be REJECTED by: the profiler-trace check: the kernels that ran (cuBLAS's, e.g. sm90_xmma_*
// or cutlass_*) are not this library's own kernels.
// Build: needs cublas_v2.h and -lcublas.
#include <cublas_v2.h>

#include <mutex>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_calls_cublas")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

static cublasHandle_t g_handle = nullptr;
static std::once_flag g_once;

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  std::call_once(g_once, [] {
    if (cublasCreate(&g_handle) != CUBLAS_STATUS_SUCCESS) g_handle = nullptr;
  });
  if (!g_handle) return launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  if (int bad = gemmrl_test::check_args(gemmrl_test::Layout::NN, A, B, C, M, N, K, lda, ldb, ldc))
    return bad;
  if (cublasSetStream(g_handle, stream) != CUBLAS_STATUS_SUCCESS) return 10;
  // Row-major C = A @ B is column-major C^T = B^T @ A^T: swap the operands, no transposes.
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t st = cublasGemmEx(g_handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, B,
                                   CUDA_R_16F, ldb, A, CUDA_R_16F, lda, &beta, C, CUDA_R_16F, ldc,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return st == CUBLAS_STATUS_SUCCESS ? 0 : 11;
}
