// CHEAT side_stream: launches the correct kernel on a non-blocking stream of its own (created
// once) and returns at once, so a host timer around the call measures only the launch. The
// result is right once the device is synchronised, so a naive sync-then-compare check passes.
// Must be REJECTED by: the stream-ordered output read (C read on the caller's stream right after
// the call, without a device sync, sees the NaN poison or a partial result, since nothing orders
// the side stream after the caller's), and by the profiler trace (the kernel ran on a stream that
// is not the caller's).
#include <mutex>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_side_stream")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

static cudaStream_t g_side = nullptr;
static std::once_flag g_once;

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  std::call_once(g_once, [] { cudaStreamCreateWithFlags(&g_side, cudaStreamNonBlocking); });
  if (!g_side) return 20;
  return launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, g_side);
}
