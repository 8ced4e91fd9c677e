// CHEAT precision_downgrade: rounds every A and B element to bf16 precision (round to nearest
// even, 8 significant bits, then back to fp32) before multiplying; accumulates in fp32 and claims
// acc=fp32. A tensor-core kernel in bf16 would be this fast-path. The {0,1} exact test passes
// (0 and 1 are exact in bf16) and the relative error, about 3e-3, is far under an absolute 1e-2
// bound, so a loose check passes.
// Must be REJECTED by: the random N(0,1) test's relative Frobenius bound (~1e-3, and within a
// small factor of cuBLAS's ~2e-4).
#include <cuda_bf16.h>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_precision_downgrade")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

struct Bf16InputsMath {
  using acc_t = float;
  static __device__ __forceinline__ float to_bf16_precision(__half x) {
    return __bfloat162float(__float2bfloat16_rn(__half2float(x)));
  }
  static __device__ __forceinline__ acc_t zero() { return 0.0f; }
  static __device__ __forceinline__ acc_t fma(__half a, __half b, acc_t c) {
    return fmaf(to_bf16_precision(a), to_bf16_precision(b), c);
  }
  static __device__ __forceinline__ float to_float(acc_t c) { return c; }
};

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  using namespace gemmrl_test;
  if (int bad = check_args(Layout::NN, A, B, C, M, N, K, lda, ldb, ldc)) return bad;
  return launch_gemm_with<Layout::NN, Bf16InputsMath>(A, B, M, N, K, lda, ldb,
                                                      StoreC{static_cast<__half*>(C), ldc}, stream);
}
