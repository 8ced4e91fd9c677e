// raw_tn_fp32_16x64x64_w1x4_s4_k1_bf16_1024x128x64: gemmrl raw family (gemmrl/space/raw.py); generated, regenerate rather than edit.
// C[1024,128] bf16 = A[1024,64] @ B[N,K]^T, fp32 accumulate, row-major, packed.
// block_m=16, block_n=64, block_k=64, warps_m=1, warps_n=4, stages=4, split_k=1, swap_ab=False, layout=TN, acc=fp32, dtype=bf16
// Logical GEMM D[GM,GN] = P[GM,K] . Q[GN,K]^T, P = A, Q = B, D = C
// P is stored K-contiguous, Q K-contiguous; mma.sync m16n8k16, ldmatrix, cp.async.cg
// ring of STAGES, padded shared rows. K tail zero-filled; M/N residues bounds-checked.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define GEMMRL_EXPORT extern "C" __attribute__((visibility("default")))

namespace raw {
constexpr int M = 1024, N = 128, K = 64;
constexpr int LDA = K, LDB = 64, LDC = N;          // packed: the only strides served
constexpr int GM = 1024, GN = 128;                   // logical D = C
constexpr int LD_P = 64, LD_Q = 64;              // global row pitch of P, Q
constexpr int BM = 16, BN = 64, BK = 64;
constexpr int WM = 1, WN = 4;
constexpr int STAGES = 4, SPLIT_K = 1;
constexpr int THREADS = WM * WN * 32;
constexpr int WTM = BM / WM, WTN = BN / WN;             // warp tile
constexpr int MI = WTM / 16, NI = WTN / 8;              // m16n8 blocks per warp
constexpr int TILES_M = (GM + BM - 1) / BM, TILES_N = (GN + BN - 1) / BN;
constexpr int TILES = TILES_M * TILES_N;
constexpr int KT = (K + BK - 1) / BK;                   // K tiles, the last maybe a zero-filled tail
constexpr int KT_PER = (KT + SPLIT_K - 1) / SPLIT_K;    // K tiles per split
constexpr bool FULL_M = GM % BM == 0, FULL_N = GN % BN == 0, FULL_K = K % BK == 0;
constexpr int P_LD = 72, P_STAGE = 1152;          // shared: [BM][BK+8] halves per stage
constexpr int Q_LD = 72, Q_STAGE = 4608;          // shared: [BN][BK+8] halves per stage
constexpr int SMEM_BYTES = STAGES * (P_STAGE + Q_STAGE) * 2;
constexpr size_t COUNTER_OFFSET = 0ull;      // bytes: fp32 partials first, then counters
constexpr size_t WORKSPACE_BYTES = 0ull;
static_assert(BM % (16 * WM) == 0 && BN % (16 * WN) == 0 && BK % 16 == 0, "tile shape");
static_assert((SPLIT_K - 1) * KT_PER < KT, "every split has K tiles");
static_assert(SMEM_BYTES == 46080, "shared memory layout");
static_assert(COUNTER_OFFSET % 256 == 0 && WORKSPACE_BYTES % 8 == 0, "workspace layout");

// ---- PTX wrappers: the only inline assembly ----
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int bytes = pred ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// D += A(16x16, row) . B(16x8, col), bf16 in, fp32 accumulate
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ---- end of PTX wrappers ----

__device__ __forceinline__ void load_p(uint32_t s, const __nv_bfloat16* __restrict__ g, int r0, int k0, int tid) {
  constexpr int CPR = BK / 8;            // 16-byte chunks per row
  constexpr int TOTAL = BM * CPR;      // tile [BM][BK] of a K-contiguous operand
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (TOTAL % THREADS == 0 || c < TOTAL) {
      const int r = c / CPR, k8 = (c % CPR) * 8;
      const int gr = r0 + r, gk = k0 + k8;
      const bool ok = (FULL_M || gr < GM) && (FULL_K || gk < K);
      const __nv_bfloat16* src = ok ? g + (size_t)gr * LD_P + gk : g;
      cp_async16(s + (uint32_t)(r * P_LD + k8) * 2u, src, ok);
    }
  }
}

__device__ __forceinline__ void load_q(uint32_t s, const __nv_bfloat16* __restrict__ g, int r0, int k0, int tid) {
  constexpr int CPR = BK / 8;            // 16-byte chunks per row
  constexpr int TOTAL = BN * CPR;      // tile [BN][BK] of a K-contiguous operand
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (TOTAL % THREADS == 0 || c < TOTAL) {
      const int r = c / CPR, k8 = (c % CPR) * 8;
      const int gr = r0 + r, gk = k0 + k8;
      const bool ok = (FULL_N || gr < GN) && (FULL_K || gk < K);
      const __nv_bfloat16* src = ok ? g + (size_t)gr * LD_Q + gk : g;
      cp_async16(s + (uint32_t)(r * Q_LD + k8) * 2u, src, ok);
    }
  }
}

}  // namespace raw

__global__ void __launch_bounds__(raw::THREADS)
gemmrl_raw_gemm(const __nv_bfloat16* __restrict__ Pg, const __nv_bfloat16* __restrict__ Qg, __nv_bfloat16* __restrict__ C,
                float* __restrict__ ws) {
  using namespace raw;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sp0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t sq0 = sp0 + STAGES * P_STAGE * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int split = blockIdx.x % SPLIT_K, tile = blockIdx.x / SPLIT_K;
  const int m0 = (tile / TILES_N) * BM, n0 = (tile % TILES_N) * BN;
  const int kt0 = split * KT_PER;
  const int nkt = min(KT, kt0 + KT_PER) - kt0;  // >= 1 (static_assert above)

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;

  // prologue: STAGES-1 tiles in flight (one commit group per tile, empty groups past the end)
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkt) {
      load_p(sp0 + s * P_STAGE * 2, Pg, m0, (kt0 + s) * BK, tid);
      load_q(sq0 + s * Q_STAGE * 2, Qg, n0, (kt0 + s) * BK, tid);
    }
    cp_async_commit();
  }

  for (int it = 0; it < nkt; ++it) {
    cp_async_wait<STAGES - 2>();  // tile `it` has landed (this thread's copies) ...
    __syncthreads();              // ... everyone's, and everyone is done with tile it-1's slot
    const int pre = it + STAGES - 1;
    if (pre < nkt) {
      const int slot = pre % STAGES;
      load_p(sp0 + slot * P_STAGE * 2, Pg, m0, (kt0 + pre) * BK, tid);
      load_q(sq0 + slot * Q_STAGE * 2, Qg, n0, (kt0 + pre) * BK, tid);
    }
    cp_async_commit();
    const int slot = it % STAGES;
    const uint32_t sp = sp0 + slot * P_STAGE * 2, sq = sq0 + slot * Q_STAGE * 2;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[MI][4], b[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        ldsm_x4(a[mi], sp + (uint32_t)((wm * WTM + mi * 16 + (lane & 15)) * P_LD + kk * 16 + ((lane >> 4) * 8)) * 2u);
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t t[4];
        ldsm_x4(t, sq + (uint32_t)((wn * WTN + nj * 16 + ((lane & 7) + (lane >> 4) * 8)) * Q_LD + kk * 16 + (((lane >> 3) & 1) * 8)) * 2u);
        b[2 * nj][0] = t[0]; b[2 * nj][1] = t[1]; b[2 * nj + 1][0] = t[2]; b[2 * nj + 1][1] = t[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();


  // ---- epilogue: accumulator r of block (mi, ni) is D[gm + (r >> 1) * 8][gn + (r & 1)]
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int gm = m0 + wm * WTM + mi * 16 + (lane >> 2) + h * 8;
        const int gn = n0 + wn * WTN + ni * 8 + (lane & 3) * 2;
        const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
        // D = C: lane (g, q) holds C[gm][gn], C[gm][gn+1] (N even: one aligned half2 store)
        if ((FULL_M || gm < GM) && (FULL_N || gn < GN))
          *reinterpret_cast<__nv_bfloat162*>(C + (size_t)gm * LDC + gn) = __floats2bfloat162_rn(v0, v1);
      }
}

GEMMRL_EXPORT const char* gemmrl_meta(void) { return "{\"layout\": \"TN\", \"dtype\": \"bf16\", \"acc\": \"fp32\", \"name\": \"raw_tn_fp32_16x64x64_w1x4_s4_k1_bf16_1024x128x64\"}"; }

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int m, int n, int k) {
  return (m == raw::M && n == raw::N && k == raw::K) ? raw::WORKSPACE_BYTES : 0;
}

// 0: launched. Nonzero, nothing launched: 1 other sizes, 2 other strides, 3 null pointer,
// 4 misaligned pointer, 5 workspace missing, 6 shared-memory opt-in failed, 7 launch error.
GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int m, int n, int k, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  using namespace raw;
  if (m != M || n != N || k != K) return 1;
  if (lda != LDA || ldb != LDB || ldc != LDC) return 2;
  if (!A || !B || !C) return 3;
  if ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B)) % 16 != 0) return 4;
  if (reinterpret_cast<uintptr_t>(C) % 4 != 0) return 4;
  if (WORKSPACE_BYTES > 0 && (!workspace || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)) return 5;
  if (SMEM_BYTES > 48 * 1024) {  // opt in once per device (no sync; legal under stream capture)
    static volatile int opted[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 6;
    if (dev < 0 || dev >= 64 || !opted[dev]) {
      if (cudaFuncSetAttribute(gemmrl_raw_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               SMEM_BYTES) != cudaSuccess)
        return 6;
      if (dev >= 0 && dev < 64) opted[dev] = 1;
    }
  }
  gemmrl_raw_gemm<<<TILES * SPLIT_K, THREADS, SMEM_BYTES, stream>>>(
      static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(B),
      static_cast<__nv_bfloat16*>(C), static_cast<float*>(workspace));
  return cudaGetLastError() == cudaSuccess ? 0 : 7;
}
