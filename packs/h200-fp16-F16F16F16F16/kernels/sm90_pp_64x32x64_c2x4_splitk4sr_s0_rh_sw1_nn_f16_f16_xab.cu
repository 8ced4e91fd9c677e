// sm90_pp_64x32x64_c2x4_splitk4sr_s0_rh_sw1_nn_f16_f16_xab: a CUTLASS 3.x sm90 GEMM behind the gemmrl kernel ABI (gemmrl/runtime/abi.py).
// Rendered by gemmrl.space.cutlass_sm90 (render version 1) from the spec
//   {"acc":"fp16","cluster_m":2,"cluster_n":4,"dtype":"fp16","layout":"NN","raster":"heuristic","reduction":"separate","schedule":"pingpong","scheduler":"splitk","splits":4,"stages":0,"swap_ab":true,"swizzle":1,"tile_k":64,"tile_m":64,"tile_n":32}
// Do not edit: change the spec or the renderer. Generic over M, N, K; residues are handled by
// TMA (out-of-bounds loads read zeros, stores are clipped). C = A @ B, C is not read.
// host: the driver's cuTensorMapEncodeTiled looked up once per process, not once per descriptor
#include <atomic>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
namespace gemmrl_driver {
template <typename... Args>
CUresult encode_tiled(Args... args) {
  using Fn = PFN_cuTensorMapEncodeTiled_v12000;
  static std::atomic<Fn> cached{nullptr};
  Fn fn = cached.load(std::memory_order_acquire);
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if __CUDACC_VER_MAJOR__ > 12
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !p) return CUDA_ERROR_UNKNOWN;
    fn = reinterpret_cast<Fn>(p);
    cached.store(fn, std::memory_order_release);
  }
  return fn(args...);
}
}  // namespace gemmrl_driver
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#define cuTensorMapEncodeTiled ::gemmrl_driver::encode_tiled
// split-K with a separate reduction kernel: the GEMM signals its dependent launch early
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/numeric_types.h>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "this kernel uses wgmma and TMA: compile it for sm_90a"
#endif


// No `using namespace cute` here: a using-directive in an anonymous namespace reaches the global
// scope, where nvcc's host stub for the kernel (whose address is taken below) names this
// namespace, and cute's own anonymous namespace would make that name ambiguous.
namespace {

using ElementA = cutlass::half_t;
using ElementB = cutlass::half_t;
using ElementD = cutlass::half_t;  // the GEMM's output: fp16 partials, an [M,N] slice per K chunk
using ElementOut = cutlass::half_t;  // the ABI's C, written by the reduction
constexpr int kSplits = 4;  // K chunks: the GEMM's batch, summed by splitk_reduce
using ElementAccumulator = cutlass::half_t;
using ElementCompute = cutlass::half_t;
using LayoutA = cutlass::layout::ColumnMajor;  // swapped: the kernel's A is B^T [N,K], N-contiguous (B [K,N] row-major)
using LayoutB = cutlass::layout::ColumnMajor;  // swapped: the kernel's B is A^T, K-contiguous (A [M,K] row-major)
using LayoutD = cutlass::layout::ColumnMajor;  // swapped: the kernel's D is C^T [N,M] column-major, that is C [M,N] row-major
constexpr int kAlignment = 8;  // elements: 16 bytes, TMA's minimum

using TileShape = cute::Shape<cute::_64, cute::_32, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_4, cute::_1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
using TileSchedulerTag = cutlass::gemm::PersistentScheduler;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute,
    void, LayoutD, kAlignment,  // no C operand: beta is 0 and C is never read
    ElementD, LayoutD, kAlignment, EpilogueSchedule>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignment, ElementB,
    LayoutB, kAlignment, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, TileSchedulerTag>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

static_assert(GemmKernel::SharedStorageSize <= 232448,
              "shared memory over the sm90 limit: fewer stages or a smaller tile");
static_assert(CollectiveMainloop::DispatchPolicy::Stages >= 2, "the mainloop needs at least 2 stages");

// gemmrl_run's return codes (0: launched; anything else: no kernel was launched)
enum Status : int {
  kOk = 0,
  kBadSize = 1,           // M, N or K not positive
  kBadLeadingDim = 2,     // lda < K, ldb < N, or ldc < N
  kMisalignedExtent = 3,  // K, N, lda, ldb or ldc not a multiple of 8 elements (16 bytes)
  kBadPointer = 4,        // A, B or C null or not 16-byte aligned
  kNoDevice = 5,          // the current device or its SM count could not be queried
  kCannotImplement = 6,   // CUTLASS's can_implement refused the arguments
  kBadWorkspace = 7,      // a workspace is needed and is null or not 16-byte aligned
  kInitFailed = 8,        // the shared memory limit, the workspace clear or the TMA descriptors failed
  kLaunchFailed = 9,      // the launch failed
};

constexpr int kMaxDevices = 64;

// SM count of a device: a host query (no synchronisation), made once per device.
int sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices];
  bool cached = device >= 0 && device < kMaxDevices;
  int count = cached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (count > 0) return count;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (cached && count > 0) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

// Per-device launch state, made once: the kernel's dynamic shared memory limit raised. CUTLASS's
// Gemm::initialize() makes that driver call on every call, and its cluster launcher another
// (cudaFuncAttributeNonPortableClusterSizeAllowed, needed only past 8 CTAs a cluster); both are
// per function and device and stay set, so a call here pays neither.
bool kernel_ready(int device) {
  static std::atomic<bool> ready[kMaxDevices];
  bool cached = device >= 0 && device < kMaxDevices;
  if (cached && ready[device].load(std::memory_order_acquire)) return true;
  constexpr int smem = int(GemmKernel::SharedStorageSize);
  if (smem >= (48 << 10) &&
      cudaFuncSetAttribute(reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the caller
    return false;
  }
  if (cached) ready[device].store(true, std::memory_order_release);
  return true;
}

// The GEMM kernel's one launch for these Params, as Gemm::run(params, stream) makes it (the grid
// from the tile scheduler, the cluster shape as a launch attribute) without its per-call
// attribute calls: one cudaLaunchKernelExC.
bool launch_gemm(typename GemmKernel::Params& params, cudaStream_t stream) {
  constexpr unsigned cx = cute::size<0>(ClusterShape{}), cy = cute::size<1>(ClusterShape{});
  dim3 grid = Gemm::get_grid_shape(params);
  if (grid.x % cx || grid.y % cy) return false;  // CUTLASS's schedulers round the grid to clusters
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = GemmKernel::get_block_shape();
  config.dynamicSmemBytes = size_t(GemmKernel::SharedStorageSize);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cx;
  attribute[0].val.clusterDim.y = cy;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = cx * cy > 1 ? 1 : 0;
  void* kernel_args[] = {&params};
  return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>),
                             kernel_args) == cudaSuccess;
}

typename Gemm::Arguments make_arguments(const void* A, const void* B, void* C, int M, int N, int K,
                                        int lda, int ldb, int ldc, int device, int sms) {
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  const int64_t chunk = int64_t(K / kSplits);  // K per split: the batch stride of A and of B
  // swapped: the kernel's (M, N) are the problem's (N, M)
  StrideA stride_a = cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * chunk);  // B
  StrideB stride_b = cute::make_stride(int64_t(lda), cute::Int<1>{}, chunk);  // A [M,K]
  StrideD stride_d = cute::make_stride(cute::Int<1>{}, int64_t(N), int64_t(N) * M);  // packed [M,N] partials

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = cute::make_shape(N, M, K / kSplits, kSplits);
  args.mainloop.ptr_A = static_cast<ElementA const*>(B);
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = static_cast<ElementB const*>(A);
  args.mainloop.dB = stride_b;
  args.epilogue.thread.alpha = ElementCompute(1);
  args.epilogue.thread.beta = ElementCompute(0);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<ElementD*>(C);
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::Heuristic;
  args.scheduler.max_swizzle_size = 1;
  return args;
}

}  // namespace

// (a kernel in a named namespace: nvcc's host stubs cannot name one in an anonymous namespace)
namespace gemmrl_separate {

// The separate reduction of an fp16 accumulator: C[m][n] = the sum over K chunks s = 0..Splits-1,
// in that order, of the fp16 partials P[s][m][n] (each chunk's accumulator as it was: storing it
// loses nothing), added in fp32 and rounded once to C's type. Deterministic: no atomics, one
// order. Eight consecutive n per thread (N % 8 == 0): 16-byte loads, one 16-byte store.
constexpr int kReduceThreads = 128;

template <typename Out, int Splits>
__global__ void __launch_bounds__(kReduceThreads)
splitk_reduce_half(const cutlass::half_t* __restrict__ partials, Out* __restrict__ C, int M, int N, int ldc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the GEMM has finished and its writes are visible
#endif
  const int64_t octs_per_row = N / 8, octs = int64_t(M) * octs_per_row;
  const int64_t slice = octs;  // 16-byte vectors per [M,N] partial
  const uint4* p16 = reinterpret_cast<const uint4*>(partials);
  for (int64_t i = int64_t(blockIdx.x) * kReduceThreads + threadIdx.x; i < octs;
       i += int64_t(gridDim.x) * kReduceThreads) {
    const int64_t m = i / octs_per_row, n = (i - m * octs_per_row) * 8;
    float acc[8];
    uint4 v = __ldcs(p16 + i);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      acc[2 * j] = f.x;
      acc[2 * j + 1] = f.y;
    }
#pragma unroll 8
    for (int s = 1; s < Splits; ++s) {
      v = __ldcs(p16 + i + s * slice);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(h[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
      }
    }
    alignas(16) Out out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = Out(acc[j]);
    *reinterpret_cast<uint4*>(C + m * ldc + n) = *reinterpret_cast<const uint4*>(out);
  }
}

}  // namespace gemmrl_separate

namespace {

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* gemmrl_meta(void) {
  return "{\"layout\": \"NN\", \"dtype\": \"fp16\", \"acc\": \"fp16\", \"name\": \"sm90_pp_64x32x64_c2x4_splitk4sr_s0_rh_sw1_nn_f16_f16_xab\", \"family\": \"cutlass_sm90\", \"key\": \"24c636ba94aac2eb\"}";
}

// Resources CUTLASS chose, for people and tests: {"smem_bytes", "stages", "threads"}.
extern "C" __attribute__((visibility("default"))) const char* gemmrl_cutlass_info(void) {
  static char text[128];
  static bool once = [] {
    std::snprintf(text, sizeof(text), "{\"smem_bytes\": %d, \"stages\": %d, \"threads\": %d}",
                  int(GemmKernel::SharedStorageSize), int(CollectiveMainloop::DispatchPolicy::Stages),
                  int(GemmKernel::MaxThreadsPerBlock));
    return true;
  }();
  (void)once;
  return text;
}

// The workspace: CUTLASS's own bytes (if any), then the fp16 partials [kSplits][M][N] from a
// 256-byte boundary.
static size_t partials_offset(size_t cutlass_bytes) { return (cutlass_bytes + 255) / 256 * 256; }

extern "C" __attribute__((visibility("default"))) size_t gemmrl_workspace_bytes(int M, int N, int K) {
  if (M <= 0 || N <= 0 || K <= 0 || K % (kSplits * kAlignment)) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int sms = sm_count(device);
  if (sms <= 0) return 0;
  size_t own = Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, M, N, K, K, N, N,
                                                       device, sms));
  return partials_offset(own) + size_t(kSplits) * size_t(M) * size_t(N) * sizeof(cutlass::half_t);
}

// Two launches on `stream`: the GEMM, then the reduction gemmrl_separate::splitk_reduce_half (programmatic dependent launch: it may be
// scheduled early and waits in griddepcontrol.wait until the GEMM's writes are visible). A
// return of kLaunchFailed after the GEMM launched means the reduction did not: C is not written.
extern "C" __attribute__((visibility("default"))) int gemmrl_run(
    const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb, int ldc,
    void* workspace, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0) return kBadSize;
  if (lda < K || ldb < N || ldc < N) return kBadLeadingDim;
  if (K % kAlignment || N % kAlignment || lda % kAlignment || ldb % kAlignment || ldc % kAlignment)
    return kMisalignedExtent;
  if (K % (kSplits * kAlignment)) return kCannotImplement;  // equal K chunks on 16-byte boundaries
  if (!A || !B || !C || (reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) |
                         reinterpret_cast<uintptr_t>(C)) % 16)
    return kBadPointer;
  if (!workspace || reinterpret_cast<uintptr_t>(workspace) % 16) return kBadWorkspace;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kNoDevice;
  int sms = sm_count(device);
  if (sms <= 0) return kNoDevice;
  typename Gemm::Arguments args = make_arguments(A, B, nullptr, M, N, K, lda, ldb, ldc, device, sms);
  size_t own = Gemm::get_workspace_size(args);
  cutlass::half_t* partials = reinterpret_cast<cutlass::half_t*>(static_cast<char*>(workspace) + partials_offset(own));
  args.epilogue.ptr_D = partials;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  if (!kernel_ready(device)) return kInitFailed;
  if (GemmKernel::initialize_workspace(args, own > 0 ? workspace : nullptr, stream) != cutlass::Status::kSuccess)
    return kInitFailed;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, own > 0 ? workspace : nullptr);
  if (!launch_gemm(params, stream)) return kLaunchFailed;
  const int64_t quads = int64_t(M) * (N / 8);
  cudaLaunchConfig_t config = {};
  constexpr int threads = gemmrl_separate::kReduceThreads;
  config.gridDim = dim3(unsigned(std::min<int64_t>((quads + threads - 1) / threads, int64_t(sms) * 16)));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  // the element type spelled out: nvcc's host stub cannot name an alias from an anonymous namespace
  if (cudaLaunchKernelEx(&config, gemmrl_separate::splitk_reduce_half<cutlass::half_t, 4>,
                         static_cast<const cutlass::half_t*>(partials), static_cast<cutlass::half_t*>(C), M, N, ldc) != cudaSuccess)
    return kLaunchFailed;
  return kOk;
}
