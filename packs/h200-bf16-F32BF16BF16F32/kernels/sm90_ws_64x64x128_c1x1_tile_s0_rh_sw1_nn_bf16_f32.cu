// sm90_ws_64x64x128_c1x1_tile_s0_rh_sw1_nn_bf16_f32: a CUTLASS 3.x sm90 GEMM behind the gemmrl kernel ABI (gemmrl/runtime/abi.py).
// Rendered by gemmrl.space.cutlass_sm90 (render version 1) from the spec
//   {"acc":"fp32","cluster_m":1,"cluster_n":1,"dtype":"bf16","layout":"NN","raster":"heuristic","schedule":"ws","scheduler":"tile","splits":1,"stages":0,"swizzle":1,"tile_k":128,"tile_m":64,"tile_n":64}
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

using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using ElementD = cutlass::bfloat16_t;  // the ABI's C
using ElementAccumulator = float;
using ElementCompute = float;
using LayoutA = cutlass::layout::RowMajor;  // A [M,K] row-major: K-contiguous
using LayoutB = cutlass::layout::RowMajor;  // NN: B [K,N] row-major, N-contiguous
using LayoutD = cutlass::layout::RowMajor;  // C [M,N] row-major
constexpr int kAlignment = 8;  // elements: 16 bytes, TMA's minimum

using TileShape = cute::Shape<cute::_64, cute::_64, cute::_128>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
using TileSchedulerTag = void;

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
  StrideA stride_a = cute::make_stride(int64_t(lda), cute::Int<1>{}, int64_t(lda) * M);
  StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * K);
  StrideD stride_d = cute::make_stride(int64_t(ldc), cute::Int<1>{}, int64_t(ldc) * M);

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = cute::make_shape(M, N, K, 1);
  args.mainloop.ptr_A = static_cast<ElementA const*>(A);
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = static_cast<ElementB const*>(B);
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

extern "C" __attribute__((visibility("default"))) const char* gemmrl_meta(void) {
  return "{\"layout\": \"NN\", \"dtype\": \"bf16\", \"acc\": \"fp32\", \"name\": \"sm90_ws_64x64x128_c1x1_tile_s0_rh_sw1_nn_bf16_f32\", \"family\": \"cutlass_sm90\", \"key\": \"63ee4076421e719e\"}";
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

extern "C" __attribute__((visibility("default"))) size_t gemmrl_workspace_bytes(int M, int N, int K) {
  if (M <= 0 || N <= 0 || K <= 0) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int sms = sm_count(device);
  if (sms <= 0) return 0;
  return Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, M, N, K, K, N, N,
                                                 device, sms));
}

extern "C" __attribute__((visibility("default"))) int gemmrl_run(
    const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb, int ldc,
    void* workspace, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0) return kBadSize;
  if (lda < K || ldb < N || ldc < N) return kBadLeadingDim;
  if (K % kAlignment || N % kAlignment || lda % kAlignment || ldb % kAlignment || ldc % kAlignment)
    return kMisalignedExtent;
  if (!A || !B || !C || (reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) |
                         reinterpret_cast<uintptr_t>(C)) % 16)
    return kBadPointer;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kNoDevice;
  int sms = sm_count(device);
  if (sms <= 0) return kNoDevice;
  typename Gemm::Arguments args = make_arguments(A, B, C, M, N, K, lda, ldb, ldc, device, sms);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  size_t need = Gemm::get_workspace_size(args);
  if (need > 0 && (!workspace || reinterpret_cast<uintptr_t>(workspace) % 16)) return kBadWorkspace;
  if (!kernel_ready(device)) return kInitFailed;
  // what Gemm::initialize() and run() do, less their per-call attribute calls: clear the
  // stream-K/split-K workspace (cudaMemsetAsync on `stream`: stream ordered, capturable), encode
  // the TMA descriptors on the host, launch
  if (GemmKernel::initialize_workspace(args, need > 0 ? workspace : nullptr, stream) != cutlass::Status::kSuccess)
    return kInitFailed;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, need > 0 ? workspace : nullptr);
  if (!launch_gemm(params, stream)) return kLaunchFailed;
  return kOk;
}
