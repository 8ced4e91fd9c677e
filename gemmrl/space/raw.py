"""The raw family: hand-written mma.sync HGEMM, specialized to one problem's sizes.

For latency-bound and memory-bound shapes (tiny M or N, huge K). One .cu per (spec, problem): the
problem's M, N, K and packed leading dimensions are compile-time constants; `gemmrl_run` serves
exactly that shape and returns nonzero for any other. The source is small and flat on purpose:
the search and the LLM policy rewrite it.

The kernel computes a *logical* GEMM  D[GM, GN] = P[GM, K] . Q[GN, K]^T  with
mma.sync.aligned.m16n8k16 (P is the MMA's row operand, Q its column operand):
  swap_ab=False: P = A, Q = B, D = C                  (GM = M, GN = N)
  swap_ab=True:  P = B^T-side, Q = A, D = C^T          (GM = N, GN = M): a tiny M lands on the
                 MMA's n8 side, the large N fills its m16 rows; the epilogue writes C row-major.
Each operand is stored either K-contiguous ('K': A; B for TN) or M/N-contiguous ('MN': B for
NN); 'K' tiles are read with ldmatrix, 'MN' tiles with ldmatrix.trans, both from a [rows][cols+8]
padded shared layout (row pitch = an odd number of 16-byte units: the 8 row addresses of every
ldmatrix phase fall in 8 different 16-byte bank groups, no conflicts).

Residues: M and N are bounds-checked in-kernel (zero-filled loads, guarded stores). K needs only
K % 8 == 0 (16-byte cp.async rows); a K that is not a multiple of block_k is a zero-filled tail
tile (both operands read as zeros past K, which adds nothing). NN also needs N % 8 == 0.

Split-K (split_k > 1): CTA (tile, s) sums K tiles [s*KT_PER, (s+1)*KT_PER) and writes its fp32
partial tile into the workspace in *fragment order* (each thread's accumulators as float4, slot
[j][thread], so stores and loads are coalesced and need no index math); then it arrives on the
tile's counter. The CTA that arrives last reads the S partials in split order 0..S-1 (the
result is bit-reproducible whatever the arrival order), and runs the normal epilogue. The
counter is a 64-bit word: a 48-bit tag and a 16-bit count. Arrival is a CAS loop that treats
any word without the tag as count 0, and the last arrival writes (tag, 0) back: the counters
reset themselves, so the kernel is re-launchable and graph-replayable with no memset, and it
also tolerates a never-initialised workspace (torch.empty) unless its garbage happens to equal
the 48-bit tag with a count in 1..S-1. With arrive='add' (`_fa`) a CTA arrives with one fetch-add
instead of the CAS loop (which retries once per CTA that arrived between its read and its swap),
after tagging an untagged word by a CAS from the value it read at its start; the same word, the
same reset, the same tolerance.

Element type (dtype): fp16 (fp32 or fp16 accumulation) or bf16 (fp32 accumulation: mma.sync has
no bf16 accumulator). A bf16 kernel is the fp16 kernel's text with the element type, its
conversions and the MMA's operand types retyped (_retype): cp.async, ldmatrix and the fragment
layouts move 16-bit elements the same way whatever they hold. fp16 sources are not touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from string import Template

from gemmrl.core.problem import Problem

SM_COUNT = 132                 # H100 / H200
SMEM_PER_BLOCK = 232448        # 227 KiB: the most dynamic shared memory one block may opt into
SMEM_PER_SM = 233472           # 228 KiB
STATIC_SMEM = 256              # bytes kept for the kernel's static __shared__ (split-K flag)
OPT_IN_ABOVE = 48 * 1024       # dynamic shared memory gemmrl_run opts in above (the rendered check)
MAX_ACC_PER_THREAD = 128       # fp32 accumulators per thread above which ptxas spills
MAX_SPLIT_K = 256              # the counter keeps 16 bits of count
MAX_REDUCE_BYTES = 1 << 20     # heuristic: fp32 partials the reducing CTA may read per tile (_splits)
TENSOR_WARPS = 8               # estimate_us: resident warps per SM that keep mma.sync busy
ARRIVALS = ("cas", "add")      # split-K arrival: a CAS loop (retries per earlier arrival) or one fetch-add
EPILOGUES = ("direct", "smem")  # C stores: from the accumulators (4 bytes a lane), or through shared memory (16)
SPLIT_US = {"cas": 0.4, "add": 0.1}  # estimate_us: reduction latency per split, by arrival (runs 810-817)
STAGED_EPI_MIN_MN = 256 * 1024  # M*N from which the pool and heuristic take epi='smem' (runs 864-889)
STAGED_EPI_MAX_K = 1024         # ... up to this K: the longest the twins were timed at
DEEP_CTAS_PER_SM = 3           # heuristic: a grid this many CTAs per SM deep is a 'deep split'
DEEP_MIN_KT = 4                # heuristic: K tiles per split below which no deep split is offered
COUNTER_TAG = 0x67656D6D726C   # 'gemmrl': the 48-bit tag of a live counter word
PAD = 8                        # halves of padding per shared row (16 bytes)
DTYPES = ("fp16", "bf16")      # element types; bf16 accumulates in fp32 only

# ldmatrix.x4 row addresses for a 16x16 operand block: (row, col) in the stored [rows][cols]
# tile relative to the block's origin, as expressions of `lane` valid in both C and Python.
# 'K' storage is [mn][k] (ldmatrix), 'MN' storage is [k][mn] (ldmatrix.trans). The four 8x8
# matrices are (mn0-7,k0-7),(mn8-15,k0-7),(mn0-7,k8-15),(mn8-15,k8-15) for P = the A fragment
# a0..a7, and (n0-7,k0-7),(n0-7,k8-15),(n8-15,k0-7),(n8-15,k8-15) for Q = the B fragments of
# two n8 blocks.
LDSM_ROW_COL = {
    ("P", "K"): ("(lane & 15)", "((lane >> 4) * 8)"),
    ("P", "MN"): ("((lane & 7) + ((lane >> 4) & 1) * 8)", "(((lane >> 3) & 1) * 8)"),
    ("Q", "K"): ("((lane & 7) + (lane >> 4) * 8)", "(((lane >> 3) & 1) * 8)"),
    ("Q", "MN"): ("((lane & 7) + ((lane >> 3) & 1) * 8)", "((lane >> 4) * 8)"),
}
# accumulator r (0..3) of an m16n8 block: its (row, col) within the block
ACC_ROW = "((lane >> 2) + (r >> 1) * 8)"
ACC_COL = "((lane & 3) * 2 + (r & 1))"


@dataclass(frozen=True)
class RawSpec:
    block_m: int = 64     # CTA tile of the logical GEMM (rows of D; = N's side when swap_ab)
    block_n: int = 64
    block_k: int = 64
    warps_m: int = 2      # warp grid; each warp owns (block_m/warps_m) x (block_n/warps_n)
    warps_n: int = 2
    stages: int = 3       # cp.async ring depth
    split_k: int = 1      # CTAs along K per output tile; >1: workspace partials + last CTA reduces
    swap_ab: bool = False
    layout: str = "NN"
    acc: str = "fp32"
    arrive: str = "cas"   # split-K arrival on the tile's counter: 'cas' (a CAS loop) or 'add' (one fetch-add)
    epi: str = "direct"   # C stores: 'direct' (each lane its half2s) or 'smem' (the tile staged, 16-byte rows)
    dtype: str = "fp16"   # element type of A, B and C: fp16 or bf16 (last, so positional specs keep their meaning)

    @property
    def name(self) -> str:
        return (f"raw_{self.layout.lower()}_{self.acc}_{self.block_m}x{self.block_n}x{self.block_k}"
                f"_w{self.warps_m}x{self.warps_n}_s{self.stages}_k{self.split_k}"
                f"{'_swap' if self.swap_ab else ''}{'_fa' if self.arrive == 'add' else ''}"
                f"{'_se' if self.epi == 'smem' else ''}{'' if self.dtype == 'fp16' else '_' + self.dtype}")

    def key(self) -> tuple:
        return ("raw", self.layout, self.acc, self.block_m, self.block_n, self.block_k,
                self.warps_m, self.warps_n, self.stages, self.split_k, bool(self.swap_ab)) + (
            (self.arrive,) if self.arrive != "cas" else ()) + ((self.epi,) if self.epi != "direct" else ()) + (
            (self.dtype,) if self.dtype != "fp16" else ())

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


@dataclass(frozen=True)
class Geometry:
    """Everything the kernel derives from (spec, problem); the renderer, valid() and the
    CPU simulation in the tests all read it from here."""
    GM: int
    GN: int
    K: int
    p_store: str          # 'K' or 'MN'
    q_store: str
    p_ld: int             # shared row pitch (halves)
    q_ld: int
    p_stage: int          # halves per stage
    q_stage: int
    tiles_m: int
    tiles_n: int
    kt: int               # K tiles (the last may be a zero-filled tail)
    kt_per: int           # K tiles per split
    smem_bytes: int
    part_floats: int      # fp32 partials in the workspace
    counter_offset: int   # bytes
    workspace_bytes: int

    @property
    def tiles(self) -> int:
        return self.tiles_m * self.tiles_n


def geometry(spec: RawSpec, problem: Problem) -> Geometry:
    M, N, K = problem.M, problem.N, problem.K
    GM, GN = (N, M) if spec.swap_ab else (M, N)
    b_store = "K" if spec.layout == "TN" else "MN"
    p_store, q_store = (b_store, "K") if spec.swap_ab else ("K", b_store)
    bm, bn, bk = spec.block_m, spec.block_n, spec.block_k
    p_ld = bk + PAD if p_store == "K" else bm + PAD
    q_ld = bk + PAD if q_store == "K" else bn + PAD
    p_stage = bm * p_ld if p_store == "K" else bk * p_ld
    q_stage = bn * q_ld if q_store == "K" else bk * q_ld
    tiles_m, tiles_n = -(-GM // bm), -(-GN // bn)
    kt = -(-K // bk)
    split = max(1, spec.split_k)
    kt_per = -(-kt // split)
    part = tiles_m * tiles_n * split * bm * bn if split > 1 else 0
    counter_offset = -(-part * 4 // 256) * 256
    ws = counter_offset + 8 * tiles_m * tiles_n if split > 1 else 0
    smem = spec.stages * (p_stage + q_stage) * 2
    if spec.epi == "smem":  # the tile of C staged in the pipeline's shared memory, or more
        rows, cols = c_tile(spec)
        smem = max(smem, rows * (cols + PAD) * 2)
    return Geometry(GM, GN, K, p_store, q_store, p_ld, q_ld, p_stage, q_stage, tiles_m, tiles_n,
                    kt, kt_per, smem, part, counter_offset, ws)


def c_tile(spec: RawSpec) -> tuple[int, int]:
    """(rows, columns) of C that one CTA's tile covers: block_m x block_n, or block_n x block_m
    where swap_ab makes the tile's rows C's columns."""
    return (spec.block_n, spec.block_m) if spec.swap_ab else (spec.block_m, spec.block_n)


def workspace_bytes(spec: RawSpec, problem: Problem) -> int:
    return geometry(spec, problem).workspace_bytes


def kernel_name(spec: RawSpec, problem: Problem) -> str:
    return f"{spec.name}_{problem.M}x{problem.N}x{problem.K}"


def valid(spec: RawSpec, problem: Problem) -> str | None:
    """THE legality statement of the family: None when `spec` can serve `problem`, else why not."""
    s = spec
    if s.layout not in ("NN", "TN"):
        return f"layout must be NN or TN, got {s.layout!r}"
    if s.acc not in ("fp32", "fp16"):
        return f"acc must be fp32 or fp16, got {s.acc!r}"
    if s.dtype not in DTYPES:
        return f"dtype must be one of {', '.join(DTYPES)}, got {s.dtype!r}"
    if problem.dtype != s.dtype:
        return f"spec multiplies {s.dtype} but the problem is {problem.dtype}"
    if s.dtype == "bf16" and s.acc != "fp32":
        return "bf16 accumulates in fp32 only (mma.sync has no bf16 accumulator)"
    if problem.acc != s.acc:
        return f"spec accumulates in {s.acc} but the problem asks for {problem.acc}"
    ints = (s.block_m, s.block_n, s.block_k, s.warps_m, s.warps_n, s.stages, s.split_k)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or not isinstance(s.swap_ab, bool):
        return "tile, warp, stage and split fields must be ints and swap_ab a bool"
    if not (1 <= s.warps_m and 1 <= s.warps_n and s.warps_m * s.warps_n <= 8):
        return f"warps_m*warps_n must be 1..8, got {s.warps_m}x{s.warps_n}"
    if s.block_m <= 0 or s.block_m % (16 * s.warps_m):
        return f"block_m={s.block_m} must be a positive multiple of 16*warps_m={16 * s.warps_m} (m16 MMA rows per warp)"
    if s.block_n <= 0 or s.block_n % (16 * s.warps_n):
        return f"block_n={s.block_n} must be a positive multiple of 16*warps_n={16 * s.warps_n} (two n8 MMA columns per ldmatrix.x4)"
    if s.block_k not in (16, 32, 64, 128):
        return f"block_k must be 16, 32, 64 or 128, got {s.block_k}"
    if max(s.block_m, s.block_n) > 256:
        return f"block_m and block_n must be at most 256, got {s.block_m}x{s.block_n}"
    if not 2 <= s.stages <= 4:
        return f"stages must be 2..4, got {s.stages}"
    acc_regs = (s.block_m // s.warps_m) * (s.block_n // s.warps_n) // 32
    if acc_regs > MAX_ACC_PER_THREAD:
        return f"{acc_regs} accumulators per thread (> {MAX_ACC_PER_THREAD}): would spill; use more warps or a smaller tile"
    if problem.K % 8:
        return f"K={problem.K} must be a multiple of 8 (16-byte cp.async rows of A{' and B' if s.layout == 'TN' else ''})"
    if s.layout == "NN" and problem.N % 8:
        return f"NN needs N % 8 == 0 (16-byte cp.async rows of B [K,N]), got N={problem.N}"
    g = geometry(s, problem)
    if g.smem_bytes + STATIC_SMEM > SMEM_PER_BLOCK:
        return (f"shared memory {g.smem_bytes} B (+{STATIC_SMEM} B static) over the "
                f"{SMEM_PER_BLOCK} B a block may use")
    if not 1 <= s.split_k <= MAX_SPLIT_K:
        return f"split_k must be 1..{MAX_SPLIT_K}, got {s.split_k}"
    if s.split_k > g.kt:
        return f"split_k={s.split_k} is more than the {g.kt} K tiles of {s.block_k}"
    if s.split_k > 1 and g.smem_bytes <= OPT_IN_ABOVE < g.smem_bytes + STATIC_SMEM:
        # gemmrl_run opts in above 48 KB of dynamic shared memory; split-K's static flag on top
        # of exactly 48 KB fails the launch (gemmrl_run returned 7: raw_nn_fp32_64x16x64_w4x1_s4_k2
        # on 8192x128x8192, H100, 2026-11-26)
        return (f"shared memory {g.smem_bytes} B is at the {OPT_IN_ABOVE} B a block gets without opting "
                f"in, and split-K's static flag goes over it")
    if (s.split_k - 1) * g.kt_per >= g.kt:
        return (f"split_k={s.split_k} over {g.kt} K tiles ({g.kt_per} per split) leaves the last "
                f"split empty")
    if g.tiles * s.split_k > 2**31 - 1:
        return "grid too large"
    if s.arrive not in ARRIVALS:
        return f"arrive must be one of {ARRIVALS}, got {s.arrive!r}"
    if s.arrive != "cas" and s.split_k == 1:
        return f"arrive={s.arrive!r} is how split-K CTAs arrive on a tile's counter: split_k must be more than 1"
    if s.epi not in EPILOGUES:
        return f"epi must be one of {EPILOGUES}, got {s.epi!r}"
    if s.epi == "smem" and problem.N % 8:
        return f"epi='smem' stores 16-byte vectors along C's rows: N % 8 == 0, got N={problem.N}"
    return None


# --------------------------------------------------------------------------------------------
# rendering

def _loader(op: str, store: str, bmn: str, full_mn: str) -> str:
    """cp.async code filling one stage of operand `op` ('P' or 'Q') from global memory."""
    if store == "K":
        body = f"""\
  constexpr int CPR = BK / 8;            // 16-byte chunks per row
  constexpr int TOTAL = {bmn} * CPR;      // tile [{bmn}][BK] of a K-contiguous operand
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {{
    const int c = tid + i * THREADS;
    if (TOTAL % THREADS == 0 || c < TOTAL) {{
      const int r = c / CPR, k8 = (c % CPR) * 8;
      const int gr = r0 + r, gk = k0 + k8;
      const bool ok = ({full_mn} || gr < G{bmn[1]}) && (FULL_K || gk < K);
      const __half* src = ok ? g + (size_t)gr * LD_{op} + gk : g;
      cp_async16(s + (uint32_t)(r * {op}_LD + k8) * 2u, src, ok);
    }}
  }}"""
    else:
        body = f"""\
  constexpr int CPR = {bmn} / 8;          // 16-byte chunks per row
  constexpr int TOTAL = BK * CPR;         // tile [BK][{bmn}] of an M/N-contiguous operand
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {{
    const int c = tid + i * THREADS;
    if (TOTAL % THREADS == 0 || c < TOTAL) {{
      const int r = c / CPR, c8 = (c % CPR) * 8;
      const int gk = k0 + r, gc = r0 + c8;  // G{bmn[1]} % 8 == 0: a chunk is all in or all out
      const bool ok = (FULL_K || gk < K) && ({full_mn} || gc < G{bmn[1]});
      const __half* src = ok ? g + (size_t)gk * LD_{op} + gc : g;
      cp_async16(s + (uint32_t)(r * {op}_LD + c8) * 2u, src, ok);
    }}
  }}"""
    return (f"__device__ __forceinline__ void load_{op.lower()}(uint32_t s, const __half* __restrict__ g, "
            f"int r0, int k0, int tid) {{\n{body}\n}}\n")


def _frag_p(store: str) -> str:
    row, col = LDSM_ROW_COL[("P", store)]
    if store == "K":
        return (f"        ldsm_x4(a[mi], sp + (uint32_t)((wm * WTM + mi * 16 + {row}) * P_LD"
                f" + kk * 16 + {col}) * 2u);")
    return (f"        ldsm_x4_trans(a[mi], sp + (uint32_t)((kk * 16 + {row}) * P_LD"
            f" + wm * WTM + mi * 16 + {col}) * 2u);")


def _frag_q(store: str) -> str:
    row, col = LDSM_ROW_COL[("Q", store)]
    if store == "K":
        return (f"        ldsm_x4(t, sq + (uint32_t)((wn * WTN + nj * 16 + {row}) * Q_LD"
                f" + kk * 16 + {col}) * 2u);")
    return (f"        ldsm_x4_trans(t, sq + (uint32_t)((kk * 16 + {row}) * Q_LD"
            f" + wn * WTN + nj * 16 + {col}) * 2u);")


_MMA_F32 = """\
// D += A(16x16, row) . B(16x8, col), fp16 in, fp32 accumulate
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

_MMA_F16 = """\
// D += A(16x16, row) . B(16x8, col), fp16 in, fp16 accumulate (d[0] = rows g, d[1] = rows g+8)
__device__ __forceinline__ void mma(uint32_t (&d)[2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, "
      "{%0,%1};\\n"
      : "+r"(d[0]), "+r"(d[1])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float2 h2_to_f2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return __half22float2(h);
}
"""

_SPLITK_DEVICE = """\
// Arrive on a tile's counter; true for the last of the SPLIT_K arrivals. The word is
// (TAG << 16) | count; a word without the tag (never-initialised memory) counts as 0; the last
// arrival writes (TAG << 16) | 0 back, so the counter is ready for the next launch.
__device__ __forceinline__ bool arrive_is_last(unsigned long long* ctr) {
  constexpr unsigned long long TAG = ${tag}ull;
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(ctr);
  while (true) {
    unsigned long long count = (old >> 16) == TAG ? (old & 0xFFFFull) : 0ull;
    if (count >= (unsigned long long)SPLIT_K) count = 0;  // impossible state: start afresh
    const bool last = count + 1 == (unsigned long long)SPLIT_K;
    const unsigned long long want = (TAG << 16) | (last ? 0ull : count + 1);
    const unsigned long long seen = atomicCAS(ctr, old, want);
    if (seen == old) return last;
    old = seen;
  }
}
"""

_SPLITK_DEVICE_ADD = """\
// arrive='add': one fetch-add per CTA, where the CAS loop above retries once for every CTA that
// arrived between its read and its swap (the arrivals of one tile come close together, so the
// last of S waits about S round trips). `seen` is the word this CTA read at its start: a word
// without the tag (never-initialised memory) is first set to (TAG << 16) | 0 by a CAS from exactly
// that value; a CAS that fails means another CTA did it first, since the word only ever changes
// from untagged to tagged. So no CTA adds to an untagged word, and the last arrival writes
// (TAG << 16) | 0 back, as above.
__device__ __forceinline__ bool arrive_is_last_add(unsigned long long* ctr, unsigned long long seen) {
  constexpr unsigned long long TAG = ${tag}ull;
  if ((seen >> 16) != TAG) atomicCAS(ctr, seen, TAG << 16);
  const unsigned long long old = atomicAdd(ctr, 1ull);
  const bool last = (old & 0xFFFFull) + 1 == (unsigned long long)SPLIT_K;
  if (last) atomicExch(ctr, TAG << 16);
  return last;
}
"""

_SPLITK_START = """\
  // split-K, arrive='add': this tile's counter word, read now and used at the arrival (the load's
  // latency hides behind the main loop)
  unsigned long long ctr_seen = 0ull;
  if (tid == 0)
    ctr_seen = *reinterpret_cast<volatile unsigned long long*>(
        reinterpret_cast<char*>(ws) + COUNTER_OFFSET + (size_t)tile * sizeof(unsigned long long));
"""

_SPLITK_BLOCK = """\
  // ---- split-K: partial to the workspace in fragment order, the last CTA to arrive reduces
  {
    __shared__ int s_last;
    constexpr int TILE_F4 = BM * BN / 4;  // float4 per partial tile (= MI * NI * THREADS)
    float4* mine = reinterpret_cast<float4*>(ws) + ((size_t)tile * SPLIT_K + split) * TILE_F4;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
        __stcg(mine + (mi * NI + ni) * THREADS + tid,
               make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2], acc[mi][ni][3]));
    __threadfence();  // this thread's partial is visible device-wide before the arrival
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      unsigned long long* counters =
          reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(ws) + COUNTER_OFFSET);
      s_last = ${arrive_call} ? 1 : 0;
      __threadfence();
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // the sum runs over splits 0..SPLIT_K-1 in order, whoever arrived last: bit-reproducible
    const float4* parts = reinterpret_cast<const float4*>(ws) + (size_t)tile * SPLIT_K * TILE_F4;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const float4 v = __ldcg(parts + (mi * NI + ni) * THREADS + tid);
        acc[mi][ni][0] = v.x; acc[mi][ni][1] = v.y; acc[mi][ni][2] = v.z; acc[mi][ni][3] = v.w;
      }
#pragma unroll 4
    for (int s = 1; s < SPLIT_K; ++s) {
      const float4* p = parts + (size_t)s * TILE_F4;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const float4 v = __ldcg(p + (mi * NI + ni) * THREADS + tid);
          acc[mi][ni][0] += v.x; acc[mi][ni][1] += v.y; acc[mi][ni][2] += v.z; acc[mi][ni][3] += v.w;
        }
    }
  }
"""

_EPI_ROWMAJOR_VEC = """\
        // D = C: lane (g, q) holds C[gm][gn], C[gm][gn+1] (N even: one aligned half2 store)
        if ((FULL_M || gm < GM) && (FULL_N || gn < GN))
          *reinterpret_cast<__half2*>(C + (size_t)gm * LDC + gn) = __floats2half2_rn(v0, v1);"""

_EPI_ROWMAJOR_SCALAR = """\
        // D = C, N odd: half2 stores would be misaligned on odd rows
        if (FULL_M || gm < GM) {
          __half* c = C + (size_t)gm * LDC + gn;
          if (FULL_N || gn < GN) c[0] = __float2half_rn(v0);
          if (FULL_N || gn + 1 < GN) c[1] = __float2half_rn(v1);
        }"""

_EPI_SWAP_VEC = """\
        // D = C^T: D[gm][gn] is C[gn][gm]. Lanes g and g^1 (lane ^ 4) trade values so each stores
        // one half2 along a row of C: even g -> C[gn][gm..gm+1], odd g -> C[gn+1][gm-1..gm].
        const bool odd = (lane >> 2) & 1;
        const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const int row = odd ? gn + 1 : gn, col = odd ? gm - 1 : gm;
        const __half2 v = odd ? __floats2half2_rn(other, v1) : __floats2half2_rn(v0, other);
        if ((FULL_N || row < GN) && (FULL_M || col < GM))
          *reinterpret_cast<__half2*>(C + (size_t)row * LDC + col) = v;"""

_EPI_SWAP_SCALAR = """\
        // D = C^T, N odd: scalar stores C[gn][gm], C[gn+1][gm]
        if (FULL_M || gm < GM) {
          if (FULL_N || gn < GN) C[(size_t)gn * LDC + gm] = __float2half_rn(v0);
          if (FULL_N || gn + 1 < GN) C[(size_t)(gn + 1) * LDC + gm] = __float2half_rn(v1);
        }"""

# the direct epilogue: each lane stores its accumulators (the ${epilogue} store of its layout)
_EPI_DIRECT = Template("""\
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
${epilogue}
      }
""")

# epi='smem': the CTA's tile of C as halves in the (drained) pipeline's shared memory, rows padded
# by 8 halves, then copied out 16 bytes a thread along C's rows (N % 8 == 0: a vector is all in
# or all out). A warp's stores cover whole 512-byte row spans where the direct epilogue writes 16
# bytes of each of 8 rows a store.
_EPI_SMEM = Template("""\
  // ---- epilogue through shared memory: accumulator r of block (mi, ni) is D[lm + (r >> 1) * 8][ln + (r & 1)]
  // of the tile, staged as C's rows (C_ROWS x C_COLS, padded), then copied out 16 bytes a thread
  __syncthreads();  // every warp is done with the pipeline's shared memory
  __half* cs = reinterpret_cast<__half*>(smem);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int lm = wm * WTM + mi * 16 + (lane >> 2) + h * 8;
        const int ln = wn * WTN + ni * 8 + (lane & 3) * 2;
        const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
${stage}
      }
  __syncthreads();
  constexpr int VPR = C_COLS / 8, VECS = C_ROWS * VPR;  // 16-byte vectors per row, per tile
  const int r0 = ${row0}, c0 = ${col0};                  // the tile's first row and column of C
#pragma unroll
  for (int j = 0; j < (VECS + THREADS - 1) / THREADS; ++j) {
    const int i = tid + j * THREADS;
    if (VECS % THREADS == 0 || i < VECS) {
      const int r = i / VPR, c = (i % VPR) * 8;
      if ((${full_rows} || r0 + r < M) && (${full_cols} || c0 + c < N))
        copy16_to_global(C + (size_t)(r0 + r) * LDC + c0 + c, cs + r * C_LD + c);
    }
  }
""")

_STAGE_ROWMAJOR = """\
        *reinterpret_cast<__half2*>(cs + lm * C_LD + ln) = __floats2half2_rn(v0, v1);"""

_STAGE_SWAP = """\
        // D = C^T: D[lm][ln] is C's row ln, column lm
        cs[ln * C_LD + lm] = __float2half_rn(v0);
        cs[(ln + 1) * C_LD + lm] = __float2half_rn(v1);"""

_COPY16 = """\
// epi='smem': 16 bytes from shared to global memory (LDS.128 then STG.128)
__device__ __forceinline__ void copy16_to_global(__half* dst, const __half* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""

_SMEM_DECL_DIRECT = "constexpr int SMEM_BYTES = STAGES * (P_STAGE + Q_STAGE) * 2;"
_SMEM_DECL_SMEM = """\
constexpr int C_ROWS = ${rows}, C_COLS = ${cols}, C_LD = C_COLS + 8;  // epi='smem': the tile of C, staged
constexpr int PIPE_BYTES = STAGES * (P_STAGE + Q_STAGE) * 2, C_BYTES = C_ROWS * C_LD * 2;
constexpr int SMEM_BYTES = PIPE_BYTES > C_BYTES ? PIPE_BYTES : C_BYTES;"""


_SOURCE = Template("""\
// ${kname}: gemmrl raw family (gemmrl/space/raw.py); generated, regenerate rather than edit.
// C[${M},${N}] fp16 = A[${M},${K}] @ ${bdesc}, ${acc} accumulate, row-major, packed.
// ${fields}
// Logical GEMM D[GM,GN] = P[GM,K] . Q[GN,K]^T, ${swapdesc}
// P is stored ${p_store}-contiguous, Q ${q_store}-contiguous; mma.sync m16n8k16, ldmatrix, cp.async.cg
// ring of STAGES, padded shared rows. K tail zero-filled; M/N residues bounds-checked.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define GEMMRL_EXPORT extern "C" __attribute__((visibility("default")))

namespace raw {
constexpr int M = ${M}, N = ${N}, K = ${K};
constexpr int LDA = K, LDB = ${ldb}, LDC = N;          // packed: the only strides served
constexpr int GM = ${GM}, GN = ${GN};                   // logical D = ${dname}
constexpr int LD_P = ${ld_p}, LD_Q = ${ld_q};              // global row pitch of P, Q
constexpr int BM = ${bm}, BN = ${bn}, BK = ${bk};
constexpr int WM = ${wm}, WN = ${wn};
constexpr int STAGES = ${stages}, SPLIT_K = ${split};
constexpr int THREADS = WM * WN * 32;
constexpr int WTM = BM / WM, WTN = BN / WN;             // warp tile
constexpr int MI = WTM / 16, NI = WTN / 8;              // m16n8 blocks per warp
constexpr int TILES_M = (GM + BM - 1) / BM, TILES_N = (GN + BN - 1) / BN;
constexpr int TILES = TILES_M * TILES_N;
constexpr int KT = (K + BK - 1) / BK;                   // K tiles, the last maybe a zero-filled tail
constexpr int KT_PER = (KT + SPLIT_K - 1) / SPLIT_K;    // K tiles per split
constexpr bool FULL_M = GM % BM == 0, FULL_N = GN % BN == 0, FULL_K = K % BK == 0;
constexpr int P_LD = ${p_ld}, P_STAGE = ${p_stage};          // shared: ${p_shape} halves per stage
constexpr int Q_LD = ${q_ld}, Q_STAGE = ${q_stage};          // shared: ${q_shape} halves per stage
${smem_decl}
constexpr size_t COUNTER_OFFSET = ${counter_offset};      // bytes: fp32 partials first, then counters
constexpr size_t WORKSPACE_BYTES = ${ws_bytes};
static_assert(BM % (16 * WM) == 0 && BN % (16 * WN) == 0 && BK % 16 == 0, "tile shape");
static_assert((SPLIT_K - 1) * KT_PER < KT, "every split has K tiles");
static_assert(SMEM_BYTES == ${smem}, "shared memory layout");
static_assert(COUNTER_OFFSET % 256 == 0 && WORKSPACE_BYTES % 8 == 0, "workspace layout");

// ---- PTX wrappers: the only inline assembly ----
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int bytes = pred ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\\n" ::"n"(PENDING) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
${mma}// ---- end of PTX wrappers ----

${load_p}
${load_q}
${splitk_device}}  // namespace raw

__global__ void __launch_bounds__(raw::THREADS)
gemmrl_raw_gemm(const __half* __restrict__ Pg, const __half* __restrict__ Qg, __half* __restrict__ C,
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
${splitk_start}
${acc_decl}

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
${frag_p}
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t t[4];
${frag_q}
        b[2 * nj][0] = t[0]; b[2 * nj][1] = t[1]; b[2 * nj + 1][0] = t[2]; b[2 * nj + 1][1] = t[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma(${acc_name}[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();
${acc_convert}
${splitk_block}
${epilogue_block}}

GEMMRL_EXPORT const char* gemmrl_meta(void) { return ${meta}; }

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
  if (reinterpret_cast<uintptr_t>(C) % ${c_align} != 0) return 4;
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
      static_cast<const __half*>(${p_arg}), static_cast<const __half*>(${q_arg}),
      static_cast<__half*>(C), static_cast<float*>(workspace));
  return cudaGetLastError() == cudaSuccess ? 0 : 7;
}
""")


def render(spec: RawSpec, problem: Problem) -> str:
    """The .cu source for `spec` specialized to `problem` (pure, deterministic). Raises
    ValueError when valid() rejects the pair."""
    why = valid(spec, problem)
    if why:
        raise ValueError(f"{spec.name} cannot serve {problem.shape}: {why}")
    g = geometry(spec, problem)
    M, N, K = problem.M, problem.N, problem.K
    nn = spec.layout == "NN"
    name = kernel_name(spec, problem)
    ld_a, ld_b = K, (N if nn else K)
    ld_p, ld_q = (ld_b, ld_a) if spec.swap_ab else (ld_a, ld_b)
    shape = {"K": "[{}][BK+8]", "MN": "[BK][{}+8]"}
    if spec.acc == "fp32":
        acc_decl = "  float acc[MI][NI][4];\n" + _zero("acc", 4)
        acc_name, acc_convert = "acc", ""
    else:
        acc_decl = "  uint32_t acch[MI][NI][2];  // fp16 accumulators, half2 pairs\n" + _zero("acch", 2)
        acc_name = "acch"
        acc_convert = """\
  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const float2 lo = h2_to_f2(acch[mi][ni][0]), hi = h2_to_f2(acch[mi][ni][1]);
      acc[mi][ni][0] = lo.x; acc[mi][ni][1] = lo.y; acc[mi][ni][2] = hi.x; acc[mi][ni][3] = hi.y;
    }
"""
    if spec.swap_ab:
        epi = _EPI_SWAP_VEC if N % 2 == 0 else _EPI_SWAP_SCALAR
    else:
        epi = _EPI_ROWMAJOR_VEC if N % 2 == 0 else _EPI_ROWMAJOR_SCALAR
    if spec.epi == "smem":
        rows, cols = c_tile(spec)
        epilogue_block = _EPI_SMEM.substitute(
            stage=_STAGE_SWAP if spec.swap_ab else _STAGE_ROWMAJOR,
            row0="n0" if spec.swap_ab else "m0", col0="m0" if spec.swap_ab else "n0",
            full_rows="FULL_N" if spec.swap_ab else "FULL_M", full_cols="FULL_M" if spec.swap_ab else "FULL_N")
        smem_decl = Template(_SMEM_DECL_SMEM).substitute(rows=rows, cols=cols)
    else:
        epilogue_block = _EPI_DIRECT.substitute(epilogue=epi)
        smem_decl = _SMEM_DECL_DIRECT
    split = spec.split_k > 1
    meta = json.dumps({"layout": spec.layout, "dtype": spec.dtype, "acc": spec.acc, "name": name})
    fields = ", ".join(f"{k}={getattr(spec, k)}" for k in
                       ("block_m", "block_n", "block_k", "warps_m", "warps_n", "stages", "split_k",
                        "swap_ab", "layout", "acc") + (("arrive",) if spec.arrive != "cas" else ())
                       + (("epi",) if spec.epi != "direct" else ()) + (("dtype",) if spec.dtype != "fp16" else ()))
    return _retype(spec.dtype, _SOURCE.substitute(
        kname=name, M=M, N=N, K=K, acc=spec.acc, fields=fields,
        bdesc="B[K,N]" if nn else "B[N,K]^T",
        swapdesc=("swap_ab: GM = N, GN = M, P = B-side, Q = A, D = C^T" if spec.swap_ab
                  else "P = A, Q = B, D = C"),
        dname="C^T" if spec.swap_ab else "C",
        p_store=g.p_store, q_store=g.q_store, ldb=ld_b, GM=g.GM, GN=g.GN, ld_p=ld_p, ld_q=ld_q,
        bm=spec.block_m, bn=spec.block_n, bk=spec.block_k, wm=spec.warps_m, wn=spec.warps_n,
        stages=spec.stages, split=spec.split_k, p_ld=g.p_ld, p_stage=g.p_stage, q_ld=g.q_ld,
        q_stage=g.q_stage, p_shape=shape[g.p_store].format("BM"),
        q_shape=shape[g.q_store].format("BN"), smem=g.smem_bytes,
        counter_offset=f"{g.counter_offset}ull", ws_bytes=f"{g.workspace_bytes}ull",
        mma=(_MMA_F32 if spec.acc == "fp32" else _MMA_F16) + (_COPY16 if spec.epi == "smem" else ""),
        load_p=_loader("P", g.p_store, "BM", "FULL_M"),
        load_q=_loader("Q", g.q_store, "BN", "FULL_N"),
        splitk_device=Template(_SPLITK_DEVICE + (_SPLITK_DEVICE_ADD if spec.arrive == "add" else "")).substitute(
            tag=f"0x{COUNTER_TAG:X}") if split else "",
        acc_decl=acc_decl, frag_p=_frag_p(g.p_store), frag_q=_frag_q(g.q_store),
        acc_name=acc_name, acc_convert=acc_convert,
        splitk_block=Template(_SPLITK_BLOCK).substitute(arrive_call=(
            "arrive_is_last_add(counters + tile, ctr_seen)" if spec.arrive == "add"
            else "arrive_is_last(counters + tile)")) if split else "",
        splitk_start=_SPLITK_START if split and spec.arrive == "add" else "",
        epilogue_block=epilogue_block, smem_decl=smem_decl, c_align=16 if spec.epi == "smem" else 4,
        meta=json.dumps(meta),
        p_arg="B" if spec.swap_ab else "A", q_arg="A" if spec.swap_ab else "B"))


# _retype: what changes in a bf16 kernel's text, in this order (longer names first). Every other
# line is the same: the loads, ldmatrix fragments, split-K partials (fp32) and index math move or
# hold 16-bit elements and fp32 sums whatever the element type.
_BF16_TEXT = (
    ("#include <cuda_fp16.h>\n", "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"),
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
    ("fp16 in, fp32 accumulate", "bf16 in, fp32 accumulate"),
    ("__floats2half2_rn", "__floats2bfloat162_rn"),
    ("__float2half_rn", "__float2bfloat16_rn"),
    ("__half2", "__nv_bfloat162"),
    ("__half", "__nv_bfloat16"),
)


def _retype(dtype: str, source: str) -> str:
    """`source` (an fp16 kernel's text) for element type `dtype`: itself for fp16; for bf16 each
    of _BF16_TEXT's replacements, and the header's 'fp16 =' (C's type). Raises ValueError where the
    include or the MMA it retypes is missing, or where fp16 conversions, types or MMA operands are
    left (a renderer change _BF16_TEXT does not know). Pure."""
    if dtype == "fp16":
        return source
    if dtype != "bf16":
        raise ValueError(f"no element type {dtype!r}: one of {', '.join(DTYPES)}")
    out = source.replace("] fp16 = A[", "] bf16 = A[", 1)
    for old, new in _BF16_TEXT:
        if old.startswith(("#include", "mma.sync")) and old not in out:
            raise ValueError(f"bf16 retype: {old.strip()!r} not in the fp16 source")
        out = out.replace(old, new)
    left = [w for w in ("__half", "2half", ".f16.f16") if w in out]  # (comments may still say 'half2')
    if left:
        raise ValueError(f"bf16 retype left fp16 text in the source: {', '.join(left)}")
    return out


def _zero(name: str, n: int) -> str:
    return (f"#pragma unroll\n  for (int mi = 0; mi < MI; ++mi)\n#pragma unroll\n"
            f"    for (int ni = 0; ni < NI; ++ni)\n#pragma unroll\n"
            f"      for (int r = 0; r < {n}; ++r) {name}[mi][ni][r] = 0{'.0f' if n == 4 else 'u'};")


# --------------------------------------------------------------------------------------------
# heuristics

_WARPS = {  # (block_m, block_n) -> (warps_m, warps_n): 4 warps unless the tile is tiny or big
    (16, 16): (1, 1), (16, 32): (1, 2), (16, 64): (1, 4), (16, 128): (1, 4),
    (32, 16): (2, 1), (32, 32): (2, 2), (32, 64): (2, 2), (32, 128): (2, 4),
    (64, 16): (4, 1), (64, 32): (2, 2), (64, 64): (2, 2), (64, 128): (2, 4),
    (128, 16): (4, 1), (128, 32): (4, 1), (128, 64): (2, 2), (128, 128): (2, 4),
}


def estimate_us(spec: RawSpec, problem: Problem) -> float:
    """A crude time model for ranking before anything is timed: launch, plus the slowest of HBM,
    L2->SM and tensor time at the parallelism and bytes-in-flight the grid gives, plus a pipeline
    fill per wave, plus the split-K reduction (one CTA per tile reads SPLIT_K partials after a
    fence and an atomic). Constants calibrated on an H200 (results/logs/probe-2026-11-22.log):
    mma.sync reaches about 290 TFLOP/s here, and one CTA streams its operands at about a
    quarter of its bytes in flight per microsecond, so skinny shapes need split-K to fill HBM.

    Recalibrated against the store's 306 timed raw trials on the H200 (2026-11-22, issue #3):
    - the tensor rate needs about TENSOR_WARPS resident warps per SM: one 4-warp 64x64 CTA per
      SM runs its mma.sync chain at about half the rate (1024x512x2048 on 128 CTAs, split 1:
      18.9 us measured, 13.2 us modelled before, 17.0 us now); this is what rewards grids of
      several CTAs per SM, i.e. deeper splits on long-K small-MN shapes;
    - each split adds SPLIT_US[arrive] of latency to the reduction (the arrivals' fences, and the
      CAS loop's retries on one counter): 128x64x8192 16x32x128 went from 9.5 us at split 8 to
      12.2 us at split 16, where the partial bytes alone account for 0.3 us.
    Rank correlation with the measured times within a shape (22 shapes with 4+ trials): 0.45
    before, 0.58 after; the split-16 trials were the worst modelled before (7 of them, all
    slower than modelled) and still are. Deep splits (split_k 32+) have no timings yet; the
    per-tile partial bandwidth (5e4 B/us) is a guess the data does not constrain.

    The arrivals, timed side by side (scripts/arrive-twins.py, runs 810-817, H200, 2026-11-30: 24
    CAS/fetch-add twins, 8 shapes, splits 4/8/16): the fetch-add twin was faster in all 24, by
    0.32 us a split (median; 1.02x-1.96x), which is the CAS loop's retries. Fitted on those times,
    the CAS twins' per-split term is 0.4 us (log error sd 0.140 at 0.4, 0.208 at the old 0.2; over
    the store's CAS trials, 249 shapes with 4 or more specs timed, the within-shape rank
    correlation is 0.375-0.391 anywhere in 0.1-0.5) and the fetch-add twins' 0.1 us (mean log
    error -0.003, sd 0.152): SPLIT_US."""
    g = geometry(spec, problem)
    S, bm, bn, bk = spec.split_k, spec.block_m, spec.block_n, spec.block_k
    ctas = g.tiles * S
    regs = (bm // spec.warps_m) * (bn // spec.warps_n) // 32 + 48
    per_sm = max(1, min((SMEM_PER_SM - 1024) // (g.smem_bytes + 1024), 2048 // spec.threads, 32,
                        65536 // (spec.threads * regs)))
    resident = min(ctas, SM_COUNT * per_sm)
    busy = min(1.0, ctas / SM_COUNT)                                  # SMs with work
    inflight = resident * (spec.stages - 1) * (bm + bn) * bk * 2      # bytes requested at once
    bw = min(3.6e6, inflight / 4.0)                                   # bytes/us
    hbm = problem.min_bytes / bw
    l2 = g.tiles * (bm + bn) * g.kt * bk * 2 / (0.6e7 * busy)
    warps_per_sm = min(-(-ctas // SM_COUNT), per_sm) * spec.threads // 32
    tensor = 2 * g.tiles * bm * bn * g.kt * bk / (2.9e8 * busy * min(1.0, warps_per_sm / TENSOR_WARPS))
    waves = -(-ctas // (SM_COUNT * per_sm))
    fill = 0.7 * waves
    reduce = (1.0 + SPLIT_US[spec.arrive] * S + S * bm * bn * 4 / 5.0e4) if S > 1 else 0.0
    return 1.0 + max(hbm, l2, tensor) + fill + reduce


def heuristic_specs(problem: Problem, layout: str, acc: str | None = None, limit: int = 6) -> list[RawSpec]:
    """A small ranked list of valid specs for `problem`: tiles near the problem's size (swap_ab
    when M is tiny and N is not), split_k from _splits() (~2 CTAs per SM when the tiles alone
    do not fill the GPU, and deeper on long K loops), ranked by estimate_us().

    When the list's `limit` places hold no deep split (a grid of DEEP_CTAS_PER_SM or more CTAs
    per SM) but one is valid, the best-ranked deep one takes the last place: the model has no
    timings of such grids to rank them by, so a search should time one (issue #3).

    Split-K specs arrive with the fetch-add (arrive='add'): it beat its CAS twin in all 24 pairs
    timed side by side (runs 810-817; estimate_us). Unsplit specs store C through shared memory
    where staged_epilogue() says so (runs 864-889)."""
    acc = acc or problem.acc
    M, N, K = problem.M, problem.N, problem.K
    swaps = [False] + ([True] if M < N and M <= 64 else [])
    cands = []
    for swap in swaps:
        GM, GN = (N, M) if swap else (M, N)
        for bm in (16, 32, 64, 128):
            if bm > 16 and bm >= 2 * GM:
                continue
            for bn in (16, 32, 64, 128):
                if bn > 16 and bn >= 2 * GN:
                    continue
                wm, wn = _WARPS[(bm, bn)]
                tiles = -(-GM // bm) * -(-GN // bn)
                for bk in (32, 64, 128):
                    kt = -(-K // bk)
                    for stages in (3, 4):
                        for split in _splits(tiles, kt, bm * bn):
                            cands.append(with_epilogue(RawSpec(bm, bn, bk, wm, wn, stages, split, swap, layout,
                                                               acc, "add" if split > 1 else "cas",
                                                               dtype=problem.dtype), problem))
    ok = [s for s in cands if valid(s, problem) is None]
    ok.sort(key=lambda s: (round(estimate_us(s, problem), 2), geometry(s, problem).smem_bytes, s.key()))
    out, seen = [], {}
    for s in ok:  # at most two specs per (tile, split, swap): a varied list for a search to start from
        group = (s.block_m, s.block_n, s.split_k, s.swap_ab)
        if seen.get(group, 0) < 2:
            seen[group] = seen.get(group, 0) + 1
            out.append(s)
    out = out[:limit]
    if out and not any(is_deep_split(s, problem) for s in out):
        deep = next((s for s in ok if is_deep_split(s, problem)), None)
        if deep is not None:
            out[-1] = deep  # ranked after every spec it follows (else it would be in the list)
    return out


def staged_epilogue(problem: Problem) -> str:
    """The epilogue the pool and the heuristic give an unsplit raw spec: 'smem' (the tile of C staged
    in shared memory, 16-byte stores) where M*N >= STAGED_EPI_MIN_MN, K <= STAGED_EPI_MAX_K and
    N % 8 == 0, else 'direct'. The other one stays a mutation away (the search's raw ladder).

    From the twins timed side by side (scripts/arrive-twins.py --twin epi, runs 864-889, H200,
    2026-11-30, fp32 accumulation, 23 shapes at K=64-1024, each the shape's fastest stored raw
    spec, split 1): at M*N = 256K the staged twin was faster in 8 of 8 (1.004x-1.059x; 512x512x64
    2.75 -> 2.59 us, 2048x128x64 3.14 -> 3.03); at M*N of 128K, 1 of 6 by more than 1% (0.990x-1.017x);
    at 64K and under, 1 of 9 (0.979x-1.013x; the smallest tiles lose 0.02-0.04 us to the extra
    barrier and round trip through shared memory). No twin above 256K was timed: the rule extends
    there on the reasoning that more of C to store favours the wide stores."""
    big = problem.M * problem.N >= STAGED_EPI_MIN_MN and problem.K <= STAGED_EPI_MAX_K
    return "smem" if big and problem.N % 8 == 0 else "direct"


def with_epilogue(spec: RawSpec, problem: Problem) -> RawSpec:
    """`spec` with the epilogue staged_epilogue() gives `problem` where it is unsplit and the staged
    tile is valid for it (the twins timed were unsplit), else `spec` as it is."""
    if spec.split_k == 1 and staged_epilogue(problem) != spec.epi:
        staged = replace(spec, epi=staged_epilogue(problem))
        if valid(staged, problem) is None:
            return staged
    return spec


def is_deep_split(spec: RawSpec, problem: Problem) -> bool:
    """Split-K whose grid puts DEEP_CTAS_PER_SM or more CTAs on each SM."""
    return spec.split_k > 1 and geometry(spec, problem).tiles * spec.split_k >= DEEP_CTAS_PER_SM * SM_COUNT


def _splits(tiles: int, kt: int, tile_elems: int) -> list[int]:
    """split_k = 1; the split that brings the grid to ~2 CTAs per SM (at least 2 K tiles per
    split, reduction reads at most 512 KiB per tile); and for long K loops two deeper ones: the
    split that reaches ~4 CTAs per SM and twice the first (at least DEEP_MIN_KT K tiles per
    split, reduction at most MAX_REDUCE_BYTES per tile). Each made even on the K tiles.

    Why deeper: one 64x64 CTA per SM streams its operands at only ~28 GB/s (1024x512x2048 on
    128 CTAs: 18.9 us on the H200); its mma.sync chain is latency bound, so long-K small-MN
    shapes need several CTAs per SM (cuBLAS and torch.compile's decompose_k split K 16-32 ways
    there). Why bounded: the last CTA to arrive reads the S partials alone, in order, at about
    50 GB/s (estimate_us), so 1 MiB is ~20 us of reduction, already more than any such shape
    should take; a deeper split than that can only lose."""
    out = [1]
    want = -(-2 * SM_COUNT // tiles)
    s = min(want, kt // 2, MAX_SPLIT_K, max(1, (512 << 10) // (4 * tile_elems)))
    if s > 1:
        s = _even(s, kt)
        out.append(s)
    deep_hi = min(kt // DEEP_MIN_KT, MAX_SPLIT_K, MAX_REDUCE_BYTES // (4 * tile_elems))
    for d in (-(-4 * SM_COUNT // tiles), 2 * s):
        d = min(d, deep_hi)
        if d > s:
            d = _even(d, kt)
            if d not in out:
                out.append(d)
    return out


def _even(s: int, kt: int) -> int:
    """The fewest splits with the same K tiles per split as `s`: no split left short or empty."""
    return -(-kt // -(-kt // s))
