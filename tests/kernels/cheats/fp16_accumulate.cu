// CHEAT fp16_accumulate: accumulates the dot products in fp16 (__hfma) while gemmrl_meta() claims
// acc=fp32 (fp16-accumulate tensor-core instructions are twice as fast on many GPUs). The {0,1}
// exact test passes (every partial sum stays below 2048, exact in fp16), and small K looks fine.
// Must be REJECTED by: the random N(0,1) test's relative Frobenius bound for an fp32
// accumulator, on K >= 1024 (the error grows with K, to several times 1e-3).
#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_fp16_accumulate")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

struct Fp16AccMath {
  using acc_t = __half;
  static __device__ __forceinline__ acc_t zero() { return __float2half(0.0f); }
  static __device__ __forceinline__ acc_t fma(__half a, __half b, acc_t c) { return __hfma(a, b, c); }
  static __device__ __forceinline__ float to_float(acc_t c) { return __half2float(c); }
};

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  using namespace gemmrl_test;
  if (int bad = check_args(Layout::NN, A, B, C, M, N, K, lda, ldb, ldc)) return bad;
  return launch_gemm_with<Layout::NN, Fp16AccMath>(A, B, M, N, K, lda, ldb,
                                                   StoreC{static_cast<__half*>(C), ldc}, stream);
}
