// CHEAT background_thread: gemmrl_run returns at once; a detached std::thread sleeps about 2 ms
// and only then launches the (correct) kernel on the caller's stream. After a device sync plus a
// short wait the result is right, so a naive check passes, and the trace even shows its own
// kernel on the caller's stream.
// Must be REJECTED by: the stream-ordered output read: the harness enqueues its read of C on the
// same stream right after the call, before the thread has enqueued the kernel, so it reads the
// NaN poison.
#include <chrono>
#include <thread>

#include "common.cuh"

GEMMRL_DEFINE_META("NN", "fp32", "cheat_background_thread")

GEMMRL_EXPORT size_t gemmrl_workspace_bytes(int M, int N, int K) { return 0; }

GEMMRL_EXPORT int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda,
                             int ldb, int ldc, void* workspace, cudaStream_t stream) {
  if (int bad = gemmrl_test::check_args(gemmrl_test::Layout::NN, A, B, C, M, N, K, lda, ldb, ldc))
    return bad;
  std::thread([=] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    launch_gemm<gemmrl_test::Layout::NN>(A, B, C, M, N, K, lda, ldb, ldc, stream);
  }).detach();
  return 0;
}
