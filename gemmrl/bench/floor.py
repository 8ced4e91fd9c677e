"""The memory floor: how fast any kernel could run a GEMM whose time is its memory traffic.

#3 asks skinny memory-bound shapes (M or N at most 256, K at least 4096) for 80% of the bandwidth
roofline: the GEMM's compulsory bytes (A and B read once, C written once) over the measured
bandwidth. For a small problem that ceiling is out of reach for reasons that have nothing to do
with the GEMM: a kernel launch, its first loads' latency and its tail cost microseconds, and
64x64x4096 moves 0.5 MB, about 0.15 us at 3.3 TB/s.

So the floor is measured, not assumed: `SOURCE` is a kernel with the gemmrl ABI that does only
the compulsory traffic (reads every byte of A and B once, 16-byte vector loads, four in flight per
thread, and writes every element of C once), no arithmetic to speak of. Timed with the judge's own
kernel-mode protocol (CUDA graphs, inputs rotated through more than the L2), its time is what a
perfect memory-bound GEMM of that shape could approach on this GPU, launch included; the
roofline over that time is the most of the roofline any GEMM could reach there.

Its output is not a product (C gets bits of the inputs): it never passes verification and is
never an implementation of the harness; `scripts/memory-floor.py` times it beside the libraries
(timing.time_kernel's `unchecked` names skip the output re-check for it alone).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from gemmrl.bench.stats import roofline_floor_us
from gemmrl.core.problem import Problem

THREADS = 256
VEC_HALVES = 8      # 16-byte loads and stores
UNROLL = 4          # independent loads in flight per thread
MAX_BLOCKS_PER_SM = 8

# One kernel for every shape: the sizes are arguments (the floor is for the traffic, not for a
# compiled-in shape). A and B are read as flat arrays (both layouts hold the same bytes), C is
# written as a flat array.
SOURCE = r"""
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stddef.h>

static __device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

static __device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Every byte of a[0, na) and b[0, nb) read once (16-byte vectors, UNROLL in flight per thread),
// then every vector of c[0, nc) written once with bits of what was read, so that no load can be
// dropped by the compiler.
__global__ void __launch_bounds__(THREADS) memory_floor(const uint4* __restrict__ a, size_t na,
                                                        const uint4* __restrict__ b, size_t nb,
                                                        uint4* __restrict__ c, size_t nc) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  const uint4* src = a;
  size_t n = na;
  #pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    size_t j = i;
    for (; j + (UNROLL - 1) * stride < n; j += UNROLL * stride) {
      uint4 v[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) v[u] = ld_stream(src + j + u * stride);
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
    }
    for (; j < n; j += stride) acc ^= fold(ld_stream(src + j));
    src = b;
    n = nb;
  }
  // finite halves only (exponent's top bit clear): the timer's capture check poisons C with NaN
  const uint32_t w = acc & 0x3FFF3FFFu;
  for (size_t j = i; j < nc; j += stride) c[j] = make_uint4(w, w ^ ((uint32_t)j & 0x3FFF3FFFu), w, w);
}

extern "C" const char* gemmrl_meta(void) {
  return "{\"layout\": \"NN\", \"dtype\": \"fp16\", \"acc\": \"fp32\", \"name\": \"memory-floor\"}";
}

extern "C" size_t gemmrl_workspace_bytes(int, int, int) { return 0; }

extern "C" int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K,
                          int lda, int ldb, int ldc, void*, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || lda != K || ldb != N || ldc != N) return 1;
  const size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
  if (na % VEC_HALVES || nb % VEC_HALVES || nc % VEC_HALVES) return 2;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 3;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 3;
  const size_t vecs = (na + nb + nc) / VEC_HALVES;
  size_t want = (vecs + (size_t)THREADS * UNROLL - 1) / ((size_t)THREADS * UNROLL);
  size_t blocks = want < (size_t)sms * MAX_BLOCKS_PER_SM ? want : (size_t)sms * MAX_BLOCKS_PER_SM;
  if (blocks < 1) blocks = 1;
  memory_floor<<<(unsigned)blocks, THREADS, 0, stream>>>(
      (const uint4*)A, na / VEC_HALVES, (const uint4*)B, nb / VEC_HALVES, (uint4*)C, nc / VEC_HALVES);
  return cudaPeekAtLastError() == cudaSuccess ? 0 : 4;
}
"""


def source() -> str:
    """The floor kernel's CUDA source with its constants in (pure)."""
    defs = (f"#define THREADS {THREADS}\n#define VEC_HALVES {VEC_HALVES}\n#define UNROLL {UNROLL}\n"
            f"#define MAX_BLOCKS_PER_SM {MAX_BLOCKS_PER_SM}\n")
    return defs + SOURCE


def supports(problem: Problem) -> bool:
    """The floor kernel's 16-byte vectors need every operand's element count a multiple of 8."""
    return problem.dtype in ("fp16", "bf16") and all(
        x % VEC_HALVES == 0 for x in (problem.M * problem.K, problem.K * problem.N, problem.M * problem.N))


def skinny(problem: Problem) -> bool:
    """#3's skinny class: M or N at most 256, K at least 4096."""
    return min(problem.M, problem.N) <= 256 and problem.K >= 4096


def roofline_us(problem: Problem, bandwidth_gbs: float, matrix_tflops: float) -> tuple[float, str]:
    """(the roofline floor time in us, 'memory' | 'compute'): the larger of the compulsory bytes
    over the bandwidth and the FLOPs over the matrix rate (report.export.roofline's floor)."""
    if not (bandwidth_gbs > 0 and matrix_tflops > 0):
        raise ValueError("peaks must be positive")
    t = roofline_floor_us(problem.flops, problem.min_bytes, matrix_tflops, bandwidth_gbs)
    compute = problem.flops / (matrix_tflops * 1e12) >= problem.min_bytes / (bandwidth_gbs * 1e9)
    return t, ("compute" if compute else "memory")


@dataclass(frozen=True)
class FloorRow:
    shape: str
    roofline_us: float
    floor_us: float
    times_us: dict  # implementation -> kernel-mode time (same session)

    @property
    def floor_fraction(self) -> float:
        """The most of the bandwidth roofline a kernel doing only the compulsory traffic reached."""
        return self.roofline_us / self.floor_us

    def fraction(self, impl: str) -> float | None:
        t = self.times_us.get(impl)
        return None if t is None else self.roofline_us / t

    def of_floor(self, impl: str) -> float | None:
        """The implementation's time as a fraction of the floor's speed (floor / time)."""
        t = self.times_us.get(impl)
        return None if t is None else self.floor_us / t


def summarize(rows: list[FloorRow], impls: list[str], target: float = 0.8) -> dict:
    """Per class of shapes (all; those where the floor itself reaches `target` of the roofline,
    i.e. where #3's target is reachable at all; the rest): how many shapes, the floor's median
    fraction, and per implementation the median roofline fraction, how many reach `target`, and
    the median fraction of the floor's speed. Pure: tested on the CPU."""
    def block(sel: list[FloorRow]) -> dict:
        out = {"shapes": len(sel)}
        if not sel:
            return out
        out["floor_median_fraction"] = statistics.median(r.floor_fraction for r in sel)
        for impl in impls:
            fr = [f for r in sel if (f := r.fraction(impl)) is not None]
            of = [f for r in sel if (f := r.of_floor(impl)) is not None]
            if fr:
                out[impl] = {"timed": len(fr), "median_fraction": statistics.median(fr),
                             f"at_least_{target:g}": sum(f >= target for f in fr),
                             "median_of_floor": statistics.median(of)}
        return out

    reachable = [r for r in rows if r.floor_fraction >= target]
    return {"target": target, "all": block(rows), "floor_reaches_target": block(reachable),
            "floor_below_target": block([r for r in rows if r.floor_fraction < target]),
            "launch_bound_us": _launch_bound(rows)}


def _launch_bound(rows: list[FloorRow]) -> float | None:
    """The floor's fixed cost: its time minus the roofline time, median over the shapes whose
    roofline time is under 2 us (where launch and latency are nearly all of it); None if none."""
    small = [r.floor_us - r.roofline_us for r in rows if r.roofline_us < 2.0]
    return statistics.median(small) if small else None


def fraction_reachable(roofline_time_us: float, fixed_us: float) -> float:
    """The most of the roofline a kernel with a fixed cost `fixed_us` can reach on a problem
    whose roofline time is `roofline_time_us`: t / (t + fixed)."""
    if roofline_time_us <= 0 or fixed_us < 0 or math.isnan(fixed_us):
        raise ValueError("need a positive roofline time and a non-negative fixed cost")
    return roofline_time_us / (roofline_time_us + fixed_us)
