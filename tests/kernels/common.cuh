// common.cuh: a plain, correct HGEMM for the gemmrl test kernels (not a candidate, a fixture).
//
// C[M,N] = A[M,K] @ B, row-major, fp16 in, fp32 accumulate, fp16 out (round to nearest).
//   Layout::NN: B is [K,N] (element (k,n) at B[k*ldb + n]);
//   Layout::TN: B is [N,K] (element (k,n) at B[n*ldb + k]).
// One 256-thread block (32x8) computes one 32x32 tile of C; each thread computes 4 outputs
// (rows ty, ty+8, ty+16, ty+24 of the tile, column tx). K advances 32 at a time through shared
// memory. Every load and store is bounds-checked, so any M, N, K >= 1 works, with any leading
// dimensions lda >= K, ldb >= (N for NN, K for TN), ldc >= N.
//
// The arithmetic (`Math`) and the store (`Epilogue`) are template parameters so that the cheat
// kernels can change one thing each while sharing the rest; the defaults are the honest ones.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#define GEMMRL_EXPORT extern "C" __attribute__((visibility("default")))

// The JSON that gemmrl_meta() returns, as one string literal:
//   GEMMRL_META_JSON("NN", "fp32", "honest_nn")
#define GEMMRL_META_JSON(layout, acc, name) \
  "{\"layout\": \"" layout "\", \"dtype\": \"fp16\", \"acc\": \"" acc "\", \"name\": \"" name "\"}"

// Defines gemmrl_meta() with that JSON.
#define GEMMRL_DEFINE_META(layout, acc, name) \
  GEMMRL_EXPORT const char* gemmrl_meta(void) { return GEMMRL_META_JSON(layout, acc, name); }

namespace gemmrl_test {

enum class Layout : int { NN = 0, TN = 1 };

constexpr int kTile = 32;     // output tile is kTile x kTile, K step is kTile
constexpr int kThreadsX = 32;
constexpr int kThreadsY = 8;
constexpr int kRowsPerThread = kTile / kThreadsY;  // 4
constexpr int kPad = 2;       // 34 halves = 17 words per row: transposed stores hit 32 banks

// fp16 products summed in fp32 (fma), the honest arithmetic.
struct Fp32Math {
  using acc_t = float;
  static __device__ __forceinline__ acc_t zero() { return 0.0f; }
  static __device__ __forceinline__ acc_t fma(__half a, __half b, acc_t c) {
    return fmaf(__half2float(a), __half2float(b), c);
  }
  static __device__ __forceinline__ float to_float(acc_t c) { return c; }
};

// Writes the accumulator to C, rounded to nearest fp16.
struct StoreC {
  __half* C;
  int ldc;
  __device__ __forceinline__ void operator()(int row, int col, float v) const {
    C[static_cast<size_t>(row) * ldc + col] = __float2half_rn(v);
  }
};

// Shape and leading-dimension checks shared by every launcher: 0 when the call is valid.
inline int check_args(Layout layout, const void* A, const void* B, const void* C, int M, int N,
                      int K, int lda, int ldb, int ldc) {
  if (!A || !B || !C) return 1;
  if (M <= 0 || N <= 0 || K <= 0) return 2;
  if (lda < K || ldc < N) return 3;
  if (ldb < (layout == Layout::NN ? N : K)) return 3;
  if ((M + kTile - 1) / kTile > 65535) return 4;  // gridDim.y limit
  return 0;
}

}  // namespace gemmrl_test

// At global scope so that profiler traces show a plain, recognisable name:
//   gemmrl_test_gemm_kernel<(gemmrl_test::Layout)0, gemmrl_test::Fp32Math, gemmrl_test::StoreC>
template <gemmrl_test::Layout L, class Math, class Epilogue>
__global__ void __launch_bounds__(gemmrl_test::kThreadsX * gemmrl_test::kThreadsY)
gemmrl_test_gemm_kernel(const __half* __restrict__ A, const __half* __restrict__ B, int M, int N,
                        int K, int lda, int ldb, Epilogue epi) {
  using namespace gemmrl_test;
  __shared__ __half As[kTile][kTile + kPad];  // As[m][k]
  __shared__ __half Bs[kTile][kTile + kPad];  // Bs[k][n]

  const int tx = threadIdx.x, ty = threadIdx.y;
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const __half zero = __float2half(0.0f);

  typename Math::acc_t acc[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) acc[i] = Math::zero();

  for (int k0 = 0; k0 < K; k0 += kTile) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = ty + kThreadsY * i;
      // A tile: row m0+r, column k0+tx (consecutive tx read consecutive addresses).
      const int am = m0 + r, ak = k0 + tx;
      As[r][tx] = (am < M && ak < K) ? A[static_cast<size_t>(am) * lda + ak] : zero;
      if (L == Layout::NN) {
        // B tile: row k0+r, column n0+tx.
        const int bk = k0 + r, bn = n0 + tx;
        Bs[r][tx] = (bk < K && bn < N) ? B[static_cast<size_t>(bk) * ldb + bn] : zero;
      } else {
        // B is [N,K]: read row n0+r, column k0+tx (coalesced), store transposed.
        const int bn = n0 + r, bk = k0 + tx;
        Bs[tx][r] = (bk < K && bn < N) ? B[static_cast<size_t>(bn) * ldb + bk] : zero;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kTile; ++k) {
      const __half b = Bs[k][tx];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) acc[i] = Math::fma(As[ty + kThreadsY * i][k], b, acc[i]);
    }
    __syncthreads();
  }

  const int col = n0 + tx;
  if (col >= N) return;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = m0 + ty + kThreadsY * i;
    if (row < M) epi(row, col, Math::to_float(acc[i]));
  }
}

namespace gemmrl_test {

// Launch with a chosen arithmetic and store; returns a cudaError_t value (0 on success), or
// the nonzero code of check_args for an unsupported call (nothing launched then).
template <Layout L, class Math = Fp32Math, class Epilogue = StoreC>
int launch_gemm_with(const void* A, const void* B, int M, int N, int K, int lda, int ldb,
                     Epilogue epi, cudaStream_t stream) {
  // Epilogues other than StoreC carry their own output pointer; check it via a stand-in.
  if (int bad = check_args(L, A, B, /*C=*/A, M, N, K, lda, ldb, /*ldc=*/N)) return bad;
  const dim3 block(kThreadsX, kThreadsY);
  const dim3 grid((N + kTile - 1) / kTile, (M + kTile - 1) / kTile);
  gemmrl_test_gemm_kernel<L, Math, Epilogue><<<grid, block, 0, stream>>>(
      static_cast<const __half*>(A), static_cast<const __half*>(B), M, N, K, lda, ldb, epi);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gemmrl_test

// The honest launcher: C = A @ B (or A @ B^T for TN) on `stream`; 0 on success.
template <gemmrl_test::Layout L>
int launch_gemm(const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb,
                int ldc, cudaStream_t stream) {
  using namespace gemmrl_test;
  if (int bad = check_args(L, A, B, C, M, N, K, lda, ldb, ldc)) return bad;
  return launch_gemm_with<L>(A, B, M, N, K, lda, ldb, StoreC{static_cast<__half*>(C), ldc},
                             stream);
}
