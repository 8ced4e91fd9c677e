"""CUTLASS 3.x sm90 family: TMA warp-specialized GEMMs built from the nvidia-cutlass wheel's headers.

A `CutlassSpec` is data. `valid(spec, problem)` is the one statement of which specs are legal and
which problems a spec serves; the enumerator, the policies and the dispatcher all call it.
`render(spec)` is a pure function from a spec to one .cu that follows the kernel ABI
(gemmrl/runtime/abi.py) and is generic over M, N and K: one build serves every problem that
valid(spec, problem) accepts. Residues in M, N and K are handled in the kernel by TMA's
out-of-bounds fill and clipped stores; nothing is padded or copied.

Operands in CUTLASS's terms (D[M,N] = A[M,K] B[K,N]): A row-major is K-major
(cutlass::layout::RowMajor); B in NN is [K,N] row-major, N-contiguous (RowMajor); B in TN is
given as [N,K] row-major, K-contiguous (ColumnMajor); D is row-major. C is not read (ElementC
void, beta 0), so the kernel never touches memory it does not write.

Shared-memory and stage-count arithmetic below mirrors CUTLASS 4.2's sm90 collective builders
(sm90_gmma_builder.inl, epilogue sm90_builder.inl); the rendered source also static_asserts the
real numbers, so a wrong estimate is a compile error with a reason, never a failed launch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from string import Template

FAMILY = "cutlass_sm90"
RENDER_VERSION = "1"  # bump when render() output changes for an unchanged spec

# cooperative and ping-pong: CUTLASS's persistent warp-specialized kernels (a producer warpgroup,
# two consumer warpgroups). 'ws' and 'tma' are its lean one-tile-per-CTA kernels, for outputs
# with about one wave of tiles, where the persistent kernels' fixed cost per call is what we lose
# to cuBLASLt (eleventh session): 'ws' (KernelTmaWarpSpecialized) is a producer warpgroup and one
# consumer warpgroup, 256 threads, no tile loop and no register reallocation; 'tma' (KernelTma)
# is one warpgroup that both issues the TMA loads and runs the MMAs, 128 threads, with the
# register-to-global epilogue only. Both run with the 'tile' scheduler alone.
SCHEDULES = ("cooperative", "pingpong", "ws", "tma")
LEAN_SCHEDULES = ("ws", "tma")
# 'tile': one CTA per output tile (cluster-rounded grid), the lean kernels' only launch; raster
# order and swizzle do not apply to it
SCHEDULERS = ("persistent", "streamk", "splitk", "tile")
# how split-K / stream-K CTAs sum their partial tiles: CUTLASS's ReductionMode, in turn, in K
# order (deterministic: each waits for the one before), or atomically in any order after the
# first (nondeterministic: bit-for-bit results may differ between runs; no turnstile); or
# 'separate' (split-K only, ours): the GEMM runs as a batch of `splits` K chunks writing fp32
# partials to the workspace, and a second kernel sums them in chunk order (deterministic, no
# CTA ever waits for another; costs a second launch and the partials' round trip through L2)
REDUCTIONS = ("deterministic", "nondeterministic", "separate")
RASTERS = ("heuristic", "along_m", "along_n")
# how the epilogue writes D: staged through shared memory and stored by TMA (CUTLASS's default
# for these kernels), or from registers straight to global memory (NoSmemWarpSpecialized: no
# staging, no TMA store, and the epilogue's shared memory goes to the mainloop's stages)
EPILOGUES = ("tma", "nosmem")
SWIZZLES = (1, 2, 4, 8)
# the split-K counts the search steps along (search.policy's ladder) and a race's 'splits'
# variants (build.ahead.variants) take the neighbours of
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LAYOUTS = ("NN", "TN")
DTYPES = ("fp16", "bf16")
ACCS = ("fp32", "fp16")
CLUSTERS = ((1, 1), (2, 1), (1, 2))
# Clusters of 4 and 8 CTAs (portable sizes: no opt-in past 8), valid with split-K only (both
# reductions in the kernel, and the separate one). The hypothesis (2026-11-27): a long K over a
# few output tiles is bound by the operand bytes each SM pulls out of L2, not by HBM (H100,
# 256x512x12288: cuBLASLt autotuned 13.2 us, ours 13.8, a kernel moving only the compulsory
# bytes 7.6), and TMA multicast to 4 or 8 CTAs cuts those bytes. Runs 329-330 (H100, 48 such
# shapes, NN, 5 candidates each) said no: the best wide-cluster trial ran at a median 1.106 of
# the shape's winner (best 0.991); the in-kernel-reduction 2x2 kernels at 1.61. They won 5
# shapes, within the noise. So they are not in the search's pool (enumerate_specs): they stay
# valid, for the winners stored, named kernels and the LLM policy.
WIDE_CLUSTERS = ((2, 2), (1, 4), (4, 1), (2, 4), (4, 2))
TILE_KS = (32, 64, 128)
MAX_SPLITS = 16
MAX_SEPARATE_SPLITS = 64  # the separate reduction has no turnstile: deeper splits are worth offering

SMEM_CAPACITY = 232448  # bytes of shared memory one sm90 block may use (227 KiB; CUTLASS's figure)
ELEMENT_BYTES = 2  # fp16 and bf16
TMA_ALIGN_ELEMS = 8  # TMA: global rows start and end on 16-byte boundaries = 8 16-bit elements
# Accumulator registers per MMA thread above which a build spills: the MMA warpgroups get at most
# 232-240 registers from setmaxnreg. Measured with CUTLASS 4.2 / nvcc 13.0, fp16 fp32-accumulate:
# 192 (ping-pong 128x192, cooperative 256x192) no spills; 224 (ping-pong 128x224) 704 bytes of
# spills; 256 (ping-pong 128x256) 4724 bytes.
ACC_REGISTER_LIMIT = 192
# wgmma N sizes cute selects without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED; other tile_n would be
# covered by several narrow atoms (tile_n 80: five 64x16 wgmmas), so the extended set is enabled.
BASE_MMA_N = (8, 16, 32, 64, 96, 128, 192, 256)
MAINLOOP_BARRIER_BYTES = 16  # full + empty mbarrier per stage
KERNEL_MISC_BYTES = 128  # order barriers, scheduler storage, alignment of the pipeline block

_ABBREV = {"cooperative": "coop", "pingpong": "pp", "ws": "ws", "tma": "tma", "persistent": "persist",
           "streamk": "streamk", "tile": "tile",
           "heuristic": "rh", "along_m": "rm", "along_n": "rn", "fp16": "f16", "bf16": "bf16",
           "fp32": "f32"}
_REDUCTION_SUFFIX = {"deterministic": "", "nondeterministic": "nd", "separate": "sr"}


@dataclass(frozen=True)
class CutlassSpec:
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    schedule: str = "cooperative"  # cooperative | pingpong
    scheduler: str = "persistent"  # persistent | streamk | splitk
    splits: int = 1  # split-K factor (scheduler 'splitk' only)
    stages: int = 0  # 0: as many as fit beside the epilogue; else an explicit count
    raster: str = "heuristic"  # heuristic | along_m | along_n
    swizzle: int = 1  # max swizzle size: 1, 2, 4, 8
    layout: str = "TN"  # NN | TN
    dtype: str = "fp16"  # fp16 | bf16
    acc: str = "fp32"  # fp32 | fp16
    reduction: str = "deterministic"  # split-K / stream-K only: REDUCTIONS
    epilogue: str = "tma"  # EPILOGUES; 'nosmem' with the persistent scheduler only
    pdl: bool = False  # programmatic dependent launch (see PDL below)
    epi_n: int = 0  # TMA epilogue's subtile width (columns a store): 0 = CUTLASS's EpilogueTileAuto (32)
    # the kernel computes C^T = B^T A^T: its M is the problem's N and its N the problem's M, its
    # D is C written column-major; the tile (tile_m x tile_n) then covers N x M. A small N over
    # a large M fills the GPU with tiles the unswapped kernel cannot make (12288x256xK on an
    # H100: 128x192 tiles over 256 x 12288 are 128 CTAs for 132 SMs)
    swap_ab: bool = False

    @property
    def name(self) -> str:
        """Procedural name encoding every field, e.g.
        sm90_coop_128x256x64_c2x1_persist_s0_rh_sw1_tn_f16_f32 (split-K 8, nondeterministic
        reduction: ..._splitk8nd_...; separate reduction kernel: ..._splitk32sr_...; the
        register-to-global epilogue: ..._f32_nosmem; launched as a programmatic dependent:
        ..._f32_pdl; an explicit epilogue subtile 64 wide: ..._f32_e64)."""
        sched = f"splitk{self.splits}" if self.scheduler == "splitk" else _ABBREV.get(self.scheduler, self.scheduler)
        sched += _REDUCTION_SUFFIX.get(self.reduction, "")
        return (f"sm90_{_ABBREV.get(self.schedule, self.schedule)}_{self.tile_m}x{self.tile_n}x{self.tile_k}"
                f"_c{self.cluster_m}x{self.cluster_n}_{sched}_s{self.stages}"
                f"_{_ABBREV.get(self.raster, self.raster)}_sw{self.swizzle}_{str(self.layout).lower()}"
                f"_{_ABBREV.get(self.dtype, self.dtype)}_{_ABBREV.get(self.acc, self.acc)}"
                + (f"_e{self.epi_n}" if self.epi_n else "")
                + ("" if self.epilogue == "tma" else f"_{self.epilogue}") + ("_pdl" if self.pdl else "")
                + ("_xab" if self.swap_ab else ""))

    def key(self) -> str:
        """Stable content hash of the fields (and the family): the machine's name for a spec."""
        blob = json.dumps({"family": FAMILY, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        """The fields; `reduction`, `epilogue`, `pdl`, `epi_n` and `swap_ab` only when they are not the default, so
        that every spec made before those fields existed keeps its key, its rendered source and
        its builds."""
        d = asdict(self)
        if d["reduction"] == "deterministic":
            del d["reduction"]
        if d["epilogue"] == "tma":
            del d["epilogue"]
        if d["pdl"] is False:
            del d["pdl"]
        if d["epi_n"] == 0:
            del d["epi_n"]
        if d["swap_ab"] is False:
            del d["swap_ab"]
        return d

    @staticmethod
    def from_dict(d: dict) -> "CutlassSpec":
        known = {f.name for f in fields(CutlassSpec)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown CutlassSpec fields: {', '.join(sorted(unknown))}")
        return CutlassSpec(**d)

    @staticmethod
    def from_name(name: str) -> "CutlassSpec":
        """Inverse of `name` (for people typing names; machines keep the spec itself)."""
        m = _NAME_RE.fullmatch(name)
        if not m:
            raise ValueError(f"not a {FAMILY} kernel name: {name!r}")
        g = m.groupdict()
        inv = {v: k for k, v in _ABBREV.items()}
        sched = g["sched"]
        reduction = "deterministic"
        for mode, suffix in _REDUCTION_SUFFIX.items():
            if suffix and sched.endswith(suffix):
                sched, reduction = sched[:-len(suffix)], mode
        return CutlassSpec(
            tile_m=int(g["tm"]), tile_n=int(g["tn"]), tile_k=int(g["tk"]),
            cluster_m=int(g["cm"]), cluster_n=int(g["cn"]), schedule=inv[g["schedule"]],
            scheduler="splitk" if sched.startswith("splitk") else inv[sched],
            splits=int(sched[6:]) if sched.startswith("splitk") else 1, stages=int(g["stages"]),
            raster=inv[g["raster"]], swizzle=int(g["sw"]), layout=g["layout"].upper(),
            dtype=inv[g["dtype"]], acc=inv[g["acc"]], reduction=reduction, epilogue=g["epi"] or "tma",
            pdl=bool(g["pdl"]), epi_n=int(g["epin"] or 0), swap_ab=bool(g["xab"]))


_NAME_RE = re.compile(r"sm90_(?P<schedule>coop|pp|ws|tma)_(?P<tm>\d+)x(?P<tn>\d+)x(?P<tk>\d+)_c(?P<cm>\d+)x(?P<cn>\d+)"
                      r"_(?P<sched>persist|tile|streamk(?:nd)?|splitk\d+(?:nd|sr)?)_s(?P<stages>\d+)_(?P<raster>rh|rm|rn)_sw(?P<sw>\d+)"
                      r"_(?P<layout>nn|tn)_(?P<dtype>f16|bf16)_(?P<acc>f32|f16)(?:_e(?P<epin>\d+))?(?:_(?P<epi>nosmem))?"
                      r"(?P<pdl>_pdl)?(?P<xab>_xab)?")


# ---------------------------------------------------------------------------------------------
# Resource arithmetic (what CUTLASS's builders will choose for a spec)

def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def mma_threads(spec: CutlassSpec) -> int:
    """Threads that hold accumulators: two consumer warpgroups share a tile in the cooperative
    kernel; in ping-pong each warpgroup owns a whole tile, as the one MMA warpgroup of the lean
    kernels ('ws', 'tma') does."""
    return 256 if spec.schedule == "cooperative" else 128


def accumulator_registers(spec: CutlassSpec) -> int:
    """32-bit registers of accumulator per MMA thread."""
    acc_bytes = 4 if spec.acc == "fp32" else 2
    return spec.tile_m * spec.tile_n * acc_bytes // 4 // mma_threads(spec)


def epilogue_tile(spec: CutlassSpec) -> tuple[int, int]:
    """The TMA epilogue's subtile (rows, columns): EpilogueTileAuto is 128 x gcd(32, N) for
    cooperative, 64 x gcd(32, N) for the one-warpgroup-a-tile kernels; with `epi_n`, the builder's
    override (cute::Shape<rows, epi_n>, rows 128 or 64 as CUTLASS requires)."""
    rows = min(128 if spec.schedule == "cooperative" else 64, spec.tile_m)
    if spec.epi_n:
        return rows, spec.epi_n
    return rows, math.gcd(min(32, spec.tile_n), spec.tile_n)


def separate(spec: CutlassSpec) -> bool:
    """Split-K with the separate reduction kernel: the GEMM writes partials (a batch over K
    chunks, persistent scheduler) and a second kernel sums them."""
    return spec.scheduler == "splitk" and spec.reduction == "separate"


def partial_bytes(spec: CutlassSpec) -> int:
    """Bytes of one element of the separate reduction's partials: the accumulator's own type
    (fp32, or fp16 for an fp16 accumulator: each K chunk's sum stored as it was accumulated,
    nothing rounded away); the reduction adds them in fp32 either way."""
    return 4 if spec.acc == "fp32" else 2


def epilogue_smem_bytes(spec: CutlassSpec) -> int:
    """sizeof(CollectiveEpilogue::SharedStorage) with a void C: up to two D staging buffers
    (aligned to the 1 KiB swizzle atom) plus the unused C-load pipeline's barriers. D is the
    fp32 partial under the separate reduction. The register-to-global epilogue stages nothing;
    its kernels measured 80-112 bytes over their stages' (alignment), so 128 is counted."""
    if spec.epilogue == "nosmem":
        return NOSMEM_EPILOGUE_BYTES
    em, en = epilogue_tile(spec)
    epi_tiles = (spec.tile_m // em) * (spec.tile_n // en)
    stages_d, stages_c = min(epi_tiles, 2), min(epi_tiles, 4)
    d_bytes = partial_bytes(spec) if separate(spec) else ELEMENT_BYTES
    return _round_up(stages_d * em * en * d_bytes + stages_c * 16, 1024)


def stage_bytes(spec: CutlassSpec) -> int:
    """Shared memory of one mainloop stage (A and B tiles plus its barriers)."""
    ab = (spec.tile_m + spec.tile_n) * spec.tile_k * ELEMENT_BYTES
    return _round_up(ab, 128) + MAINLOOP_BARRIER_BYTES


def auto_stages(spec: CutlassSpec) -> int:
    """StageCountAutoCarveout<sizeof(epilogue SharedStorage)>: as many stages as fit beside it."""
    carve = _round_up(epilogue_smem_bytes(spec), 128)
    return (SMEM_CAPACITY // 128 * 128 - carve) // stage_bytes(spec)


def pipeline_stages(spec: CutlassSpec) -> int:
    return spec.stages if spec.stages else auto_stages(spec)


NOSMEM_EPILOGUE_BYTES = 128  # sm90_pp_64x32x128 nosmem: 221,568 bytes, 9 stages of 24,592 and 240 more
SEPARATE_EXTRA_BYTES = 1024  # the fp32-D epilogue's storage is larger than its staging estimate:
# measured 231,424 bytes for cooperative 128x128x64 split 8 (6 stages), 800 over the estimate


def smem_bytes(spec: CutlassSpec) -> int:
    """Estimated dynamic shared memory of the kernel (GemmKernel::SharedStorageSize)."""
    extra = SEPARATE_EXTRA_BYTES if separate(spec) else 0
    return pipeline_stages(spec) * stage_bytes(spec) + epilogue_smem_bytes(spec) + KERNEL_MISC_BYTES + extra


# ---------------------------------------------------------------------------------------------
# THE legality statement

def valid(spec: CutlassSpec, problem=None) -> str | None:
    """None when `spec` is a legal kernel (and serves `problem`, when one is given), else the
    reason it is not. Every rule CUTLASS or the hardware imposes that we know of is here."""
    s = spec
    for fname, allowed in (("schedule", SCHEDULES), ("scheduler", SCHEDULERS), ("raster", RASTERS),
                           ("layout", LAYOUTS), ("dtype", DTYPES), ("acc", ACCS), ("reduction", REDUCTIONS),
                           ("epilogue", EPILOGUES)):
        if getattr(s, fname) not in allowed:
            return f"{fname} must be one of {', '.join(allowed)}, got {getattr(s, fname)!r}"
    for fname in ("tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "splits", "stages", "swizzle", "epi_n"):
        v = getattr(s, fname)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{fname} must be an integer, got {v!r}"
    if s.acc == "fp16" and s.dtype != "fp16":
        return f"an fp16 accumulator needs fp16 inputs (wgmma has no {s.dtype} x {s.dtype} -> fp16 form)"
    if s.tile_m % 64 or not 64 <= s.tile_m <= 256:
        return f"tile_m must be 64, 128, 192 or 256 (wgmma is 64 rows per warpgroup), got {s.tile_m}"
    if s.schedule == "cooperative" and s.tile_m % 128:
        return (f"the cooperative schedule splits tile_m over two 64-row warpgroups: tile_m must be "
                f"128 or 256, got {s.tile_m}")
    lean = s.schedule in LEAN_SCHEDULES
    if lean and s.tile_m > 128:
        return (f"the {s.schedule!r} kernel has one MMA warpgroup (64 rows a wgmma): tile_m must be 64 "
                f"or 128, got {s.tile_m}")
    if s.tile_n % 16 or not 16 <= s.tile_n <= 256:
        return f"tile_n must be a multiple of 16 in 16..256 (wgmma N and the epilogue tile), got {s.tile_n}"
    if s.tile_k not in TILE_KS:
        return (f"tile_k must be one of {', '.join(map(str, TILE_KS))} (16-bit wgmma takes K=16 steps "
                f"and the swizzled smem atom is 32 or 64 elements), got {s.tile_k}")
    if (s.cluster_m, s.cluster_n) not in CLUSTERS + WIDE_CLUSTERS:
        return (f"cluster must be 1x1, 2x1 or 1x2 (or, with split-K, 2x2, 1x4, 4x1, 2x4 or 4x2), "
                f"got {s.cluster_m}x{s.cluster_n}")
    if (s.cluster_m, s.cluster_n) in WIDE_CLUSTERS and s.scheduler != "splitk":
        return (f"a {s.cluster_m}x{s.cluster_n} cluster is offered with split-K only (for few-tile, long-K "
                f"shapes; see WIDE_CLUSTERS), not with the {s.scheduler!r} scheduler")
    if lean != (s.scheduler == "tile"):
        return (f"the {s.schedule!r} kernel runs one CTA per tile: scheduler 'tile', not {s.scheduler!r}" if lean
                else f"scheduler 'tile' is the lean kernels' ({', '.join(LEAN_SCHEDULES)}), not {s.schedule!r}'s")
    if lean and (s.raster, s.swizzle) != ("heuristic", 1):
        return (f"the {s.schedule!r} kernel maps CTAs to tiles by block index: raster 'heuristic' and "
                f"swizzle 1 only, got {s.raster!r} and {s.swizzle}")
    if s.schedule == "tma" and s.epilogue != "nosmem":
        return "the 'tma' kernel (no warp specialization) takes the register-to-global epilogue (nosmem) only"
    if lean and s.pdl:
        return f"programmatic dependent launch is offered for the persistent kernels, not {s.schedule!r}"
    if s.schedule == "pingpong" and s.scheduler != "persistent" and not separate(s):
        return (f"the ping-pong kernel supports only the persistent scheduler, not {s.scheduler!r} "
                f"(or split-K with the separate reduction)")
    if s.scheduler == "splitk":
        top = MAX_SEPARATE_SPLITS if separate(s) else MAX_SPLITS
        if not 2 <= s.splits <= top:
            return f"scheduler 'splitk' needs splits in 2..{top}{' (separate reduction)' if separate(s) else ''}, got {s.splits}"
    elif s.splits != 1:
        return f"splits={s.splits} needs scheduler 'splitk' (it is {s.scheduler!r}); use splits=1"
    if s.reduction != "deterministic" and s.scheduler in ("persistent", "tile"):
        return f"a reduction mode needs split-K or stream-K (the {s.scheduler} scheduler has no partial tiles)"
    if s.reduction == "separate" and s.scheduler != "splitk":
        return "the separate reduction is a split-K mode (scheduler 'splitk'), not stream-K"
    if s.epilogue == "nosmem" and s.scheduler not in ("persistent", "tile"):
        return ("the register-to-global epilogue (nosmem) is offered with the persistent scheduler only "
                f"(the small outputs it is for; not tried with partial tiles), not {s.scheduler!r}")
    if not isinstance(s.pdl, bool):
        return f"pdl must be true or false, got {s.pdl!r}"
    if not isinstance(s.swap_ab, bool):
        return f"swap_ab must be true or false, got {s.swap_ab!r}"
    if s.swap_ab and s.epi_n:
        return "swap_ab writes a column-major D: an explicit epilogue subtile (epi_n) is not offered with it"
    if s.epi_n:
        if s.epilogue != "tma":
            return f"epi_n sets the TMA epilogue's subtile; the {s.epilogue!r} epilogue has none (epi_n 0)"
        if s.epi_n < 0 or s.epi_n % 16 or s.tile_n % s.epi_n:
            return (f"epi_n must be 0 (auto) or a multiple of 16 that divides tile_n={s.tile_n} "
                    f"(CUTLASS's epilogue tile override), got {s.epi_n}")
    if s.swizzle not in SWIZZLES:
        return f"swizzle must be one of {', '.join(map(str, SWIZZLES))}, got {s.swizzle}"
    regs = accumulator_registers(s)
    if regs > ACC_REGISTER_LIMIT:
        return (f"{s.tile_m}x{s.tile_n} {s.acc} accumulators need {regs} registers per MMA thread "
                f"({s.schedule}: {mma_threads(s)} threads); over {ACC_REGISTER_LIMIT} the build spills")
    if s.stages < 0 or s.stages == 1:
        return f"stages must be 0 (auto) or at least 2, got {s.stages}"
    if s.stages == 0 and auto_stages(s) < 2:
        return (f"{s.tile_m}x{s.tile_n}x{s.tile_k} leaves room for {auto_stages(s)} stage(s) of "
                f"{stage_bytes(s)} bytes beside the epilogue: a pipeline needs at least 2")
    if smem_bytes(s) > SMEM_CAPACITY:
        return (f"shared memory: {pipeline_stages(s)} stages x {stage_bytes(s)} bytes + epilogue "
                f"{epilogue_smem_bytes(s)} = {smem_bytes(s)} bytes, over {SMEM_CAPACITY} (227 KiB)")
    if problem is not None:
        return _serves(s, problem)
    return None


def _serves(s: CutlassSpec, problem) -> str | None:
    if (problem.dtype, problem.acc) != (s.dtype, s.acc):
        return (f"the kernel is {s.dtype} with an {s.acc} accumulator; the problem is "
                f"{problem.dtype} with {problem.acc}")
    M, N, K = problem.M, problem.N, problem.K
    # TMA: every operand's contiguous extent a multiple of 16 bytes
    if K % TMA_ALIGN_ELEMS:
        whose = "A [M,K] and B [N,K] rows" if s.layout == "TN" else "A [M,K] rows"
        return f"K={K} is not a multiple of {TMA_ALIGN_ELEMS}: TMA needs 16-byte {whose}"
    if N % TMA_ALIGN_ELEMS:
        whose = "B [K,N] and C [M,N] rows" if s.layout == "NN" else "C [M,N] rows"
        return f"N={N} is not a multiple of {TMA_ALIGN_ELEMS}: TMA needs 16-byte {whose}"
    if separate(s) and K % (s.splits * TMA_ALIGN_ELEMS):
        return (f"K={K} is not a multiple of {s.splits} splits x {TMA_ALIGN_ELEMS}: the separate "
                f"reduction cuts K into equal chunks, each starting on a 16-byte boundary")
    return None


# ---------------------------------------------------------------------------------------------
# The space

# The tile orders the main tiles come in (persistent and stream-K; split-K: swizzle 1 only).
# Swizzle 2 joined 1 and 4 after the swizzle races of runs 259, 261 and 263 (the winner of each
# in 126 races of big shapes, H100 and H200, against its swizzle 1, 2, 4 and 8 twins): swizzle
# 2 ran within 5% of the fastest order in every race, swizzle 1 up to 46% behind
# (12288x16384x8192, 256x128 cooperative), 4 up to 13% and 8 up to 2.6x. Fastest: swizzle 1 in
# 50, 2 in 32, 8 in 23, 4 in 21; on the H100, 2 won the largest outputs (16384x16384x8192 +6.8%
# over swizzle 1). The cost model cannot tell the orders apart (its swizzle feature learns from
# trials), so the heuristic ranking still takes swizzle 1.
MAIN_ORDERS = (("heuristic", 1), ("heuristic", 2), ("heuristic", 4))
_TILE_M = (64, 128, 256)
_TILE_N = (64, 128, 192, 256)
DEEP_SPLIT_TILE = 128 * 128  # tile_m * tile_n up to which enumerate_specs offers split-K 16


def enumerate_specs(layout: str = "TN", dtype: str = "fp16", acc: str = "fp32") -> list[CutlassSpec]:
    """A sensible space for one (layout, dtype, acc): tiles Hopper runs well (K=64 everywhere,
    K=128 where stages stay deep), every cluster shape, persistent for both schedules, stream-K
    and split-K (2, 4, 8) for cooperative, two tile orders; auto stage counts. All pass valid().
    Split-K 16 only for tiles of at most 128x128 (DEEP_SPLIT_TILE): the long-K small-MN shapes
    it is for (256x256x16384: 8 tiles of 128x64) fill the GPU only that way, while a bigger tile
    would reduce 16 partials of 128 KiB+ each (issue #3). The same split-K tiles come again with
    the nondeterministic reduction (no turnstile: CTAs add their partials in any order), and
    split-K 4-64 with the separate reduction kernel for a few tiles of both schedules (its
    partials in the accumulator's type). Narrow tiles (64x16, 64x32, 128x32) and 64-row ping-pong tiles of the
    widths between (48 .. 176), persistent only, for small outputs; every persistent 64-row
    ping-pong tile up to 128 wide again with the register-to-global epilogue (nosmem); and the
    lean one-tile-per-CTA 'ws' kernel (TMA epilogue) over _LEAN_TILES. Its other forms (the
    nosmem epilogue, 'tma') lost every race (run 158): not here. The persistent ping-pong tiles
    of EPI_TWINS come again with that wider epilogue subtile (epi_n)."""
    out = []
    for schedule in ("cooperative", "pingpong"):
        for tm in _TILE_M:
            for tn in _TILE_N:
                for tk in (64, 128):
                    if tk == 128 and tm + tn > 256:
                        continue
                    for cm, cn in CLUSTERS:
                        if schedule == "cooperative":
                            scheds = [("persistent", 1), ("streamk", 1), ("splitk", 2), ("splitk", 4),
                                      ("splitk", 8)]
                            if tm * tn <= DEEP_SPLIT_TILE:
                                scheds.append(("splitk", 16))
                        else:
                            scheds = [("persistent", 1)]
                        for scheduler, splits in scheds:
                            for raster, swizzle in MAIN_ORDERS:
                                if scheduler == "splitk" and swizzle != 1:
                                    continue
                                spec = CutlassSpec(tm, tn, tk, cm, cn, schedule, scheduler, splits, 0,
                                                   raster, swizzle, layout, dtype, acc)
                                if valid(spec) is None:
                                    out.append(spec)
                                    if scheduler == "splitk" and tm * tn <= DEEP_SPLIT_TILE:
                                        out.append(replace(spec, reduction="nondeterministic"))
    # split-K with the separate reduction kernel: for long K over a handful of tiles, where the
    # in-kernel reductions serialise (issue #3); 1x1 clusters (WIDE_CLUSTERS: measured, not
    # pooled)
    for schedule, tm, tn in _SEPARATE_TILES:
        for tk in (64, 128):
            if tk == 128 and tm + tn > 256:
                continue
            for splits in SEPARATE_SPLITS:
                spec = CutlassSpec(tm, tn, tk, 1, 1, schedule, "splitk", splits, 0, "heuristic", 1,
                                   layout, dtype, acc, "separate")
                if valid(spec) is None:
                    out.append(spec)
    # narrow tiles, persistent: two to four times the CTAs of 64x64 on a small output; then the
    # wgmma widths between the powers of two for 64-row ping-pong tiles
    for schedule, tm, tn in _NARROW_TILES + tuple(("pingpong", 64, n) for n in _ODD_TILE_N):
        for tk in (64, 128):
            for cm, cn in CLUSTERS:
                spec = CutlassSpec(tm, tn, tk, cm, cn, schedule, "persistent", 1, 0, "heuristic", 1,
                                   layout, dtype, acc)
                if valid(spec) is None:
                    out.append(spec)
    # cuBLASLt's tiles on the outputs where it beat us most often (_WIDE_ODD_TILES, in both
    # orientations; _WIDE_PLAIN_TILES, plain and with B K-major (TN) only), persistent, swizzles 1
    # and 2
    for schedule, tm, tn in _WIDE_ODD_TILES + (_WIDE_PLAIN_TILES if layout == "TN" else ()):
        for cm, cn in CLUSTERS:
            for swap in (False, True) if (schedule, tm, tn) in _WIDE_ODD_TILES else (False,):
                for swizzle in (1, 2):
                    spec = CutlassSpec(tm, tn, 64, cm, cn, schedule, "persistent", 1, 0, "heuristic", swizzle,
                                       layout, dtype, acc, swap_ab=swap)
                    if valid(spec) is None:
                        out.append(spec)
    # a wider TMA epilogue subtile for the persistent ping-pong tiles whose winners it beat most
    # often when raced (runs 166-177): estimate_us prices it (subtile_us), so it outranks its
    # automatic twin only over many waves of output-heavy tiles
    for spec in [s for s in out if s.schedule == "pingpong" and s.scheduler == "persistent"
                 and (s.tile_m, s.tile_n) in EPI_TWINS]:
        twin = replace(spec, epi_n=EPI_TWINS[(spec.tile_m, spec.tile_n)])
        if valid(twin) is None:
            out.append(twin)
    # the register-to-global epilogue for the persistent 64-row ping-pong tiles up to 128 wide
    for spec in [s for s in out if s.schedule == "pingpong" and s.tile_m == 64 and s.tile_n <= 128
                 and s.scheduler == "persistent"]:
        twin = replace(spec, epilogue="nosmem")
        if valid(twin) is None:
            out.append(twin)
    # the lean one-tile-per-CTA kernel ('ws', TMA epilogue) over the small tiles: about half a
    # microsecond less fixed cost than the persistent kernels where the output is one wave of
    # tiles or less (run 158, eighteenth session)
    for tm, tn in _LEAN_TILES:
        for tk in (64, 128):
            if tk == 128 and tm + tn > 256:
                continue
            for cm, cn in CLUSTERS:
                spec = CutlassSpec(tm, tn, tk, cm, cn, "ws", "tile", 1, 0, "heuristic", 1, layout, dtype, acc)
                if valid(spec) is None:
                    out.append(spec)
    return out


# (tile_m, tile_n) -> the subtile width the pool also carries for that persistent ping-pong
# tile: where a wider twin beat the winner by 1% or more in races 166-177 it was 96 on 34 of 70
# 128x192 winners, 64 on 10 of 27 64x256 ones and 128 on 4 of 25 128x128 ones (other tiles and
# widths: 3 wins or fewer; scripts/epi-price-fit.py reads the same logs)
EPI_TWINS = {(128, 192): 96, (64, 256): 64, (128, 128): 128}

# the lean kernel's tiles in the pool: those of the persistent winners its twins beat in run 158
_LEAN_TILES = ((64, 16), (64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128))
LEAN_FORMS = (("ws", "tma"), ("ws", "nosmem"), ("tma", "nosmem"))  # (schedule, epilogue)


def lean_twins(spec: CutlassSpec, problem=None, forms=None) -> list[CutlassSpec]:
    """The lean one-tile-per-CTA kernel with a persistent spec's tile, cluster, stages and
    precision: 'ws' with the TMA epilogue; with forms=LEAN_FORMS also 'ws' with the
    register-to-global epilogue and 'tma' (which takes only that one); those valid() accepts (for
    `problem`, if given). Raced against a winner (build.ahead.variants field 'lean'). On the
    H100, run 158 (37 shapes whose persistent winner ran below cuBLASLt), the 'ws' twin won 22
    races and the other two forms none: 1-8 us slower than it wherever the output has more than a
    few tiles (results/README.md, eighteenth session), so only 'ws' is raced by default."""
    out = []
    for schedule, epilogue in (forms if forms is not None else (("ws", "tma"),)):
        twin = replace(spec, schedule=schedule, scheduler="tile", splits=1, raster="heuristic", swizzle=1,
                       reduction="deterministic", epilogue=epilogue, pdl=False)
        if twin != spec and valid(twin, problem) is None:
            out.append(twin)
    return out


SM_SMEM_BYTES = 233472  # shared memory of one sm90 SM (228 KiB), of which each resident block reserves 1 KiB
SM_SMEM_RESERVED = 1024
RESIDENT_MAX_STAGES = 4
SM_REGISTERS = 65536  # 32-bit registers of one sm90 SM
SM_MAX_THREADS = 2048
LEAN_THREADS = {"ws": 256, "tma": 128}  # a lean block: producer and MMA warpgroups ('ws'), or one doing both
# Registers a lean ('ws', 'tma') kernel's thread takes beyond its accumulators: ptxas gave
# accumulator_registers + 26 for all 23 lean 'ws' (tile, precision) builds in the local cache, 34
# to 218 registers (64x32 fp16 to 128x192 fp32), + 27 for the one 'tma' build (128x64 fp32); the
# persistent kernels take 168 (setmaxnreg), one block an SM
LEAN_EXTRA_REGISTERS = 26


def smem_blocks(spec: CutlassSpec) -> int:
    """Blocks of `spec` an SM's shared memory holds (smem_bytes and the 1 KiB each block reserves)."""
    return SM_SMEM_BYTES // (smem_bytes(spec) + SM_SMEM_RESERVED)


def resident_blocks(spec: CutlassSpec) -> int:
    """Blocks of `spec` one SM holds at once: the persistent, stream-K and split-K kernels (168
    registers a thread, a grid of one block an SM) 1; a lean one-tile-per-CTA kernel as many as
    its shared memory (smem_bytes and the 1 KiB each block reserves) and its registers
    (accumulator_registers + LEAN_EXTRA_REGISTERS a thread, allocated in 8s) leave room for, 1 at
    least. Two blocks of the lean 64x128 fp32 kernel with 2-4 stages (90 registers) share an SM;
    the 128x128 one (154) runs alone whatever its stages (ptxas, tests/test_cutlass_sm90.py)."""
    if spec.scheduler != "tile":
        return 1
    by_smem = smem_blocks(spec)
    regs = _round_up(accumulator_registers(spec) + LEAN_EXTRA_REGISTERS, 8)
    threads = LEAN_THREADS.get(spec.schedule, 256)
    by_regs = SM_REGISTERS // (regs * threads)
    return max(1, min(by_smem, by_regs, SM_MAX_THREADS // threads))


def resident_twins(spec: CutlassSpec, problem) -> list[CutlassSpec]:
    """The lean one-tile-per-CTA 'ws' kernels (TMA epilogue) of a spec's tile, and of its halves
    where the tile is 128x128 or larger (half the rows, then half the columns), each with the
    most mainloop stages up to the problem's k-blocks (RESIDENT_MAX_STAGES at most) that leave
    room for two blocks on an SM, 2 at least; those valid() accepts for `problem`.
    The lean kernels raced so far (lean_twins) took as many stages as fit, 206-231 KiB of shared
    memory, so one block ran on an SM at a time: on the H200's fp32 shapes with K <= 256 the lean
    kernel won where the output has about one wave of 128x128 tiles (4.2 MB: 0.98-1.05 of
    cuBLASLt autotuned) and was never tried on two (8.4 MB), where the persistent winners ran
    at 0.89-0.95. With two or more blocks on an SM, one block's epilogue overlaps the next one's
    loads. Registers decide the rest: the lean 128x64 and 64x64 kernels took 90 and 58 per thread
    (two blocks fit), the lean 128x128 one 154 (one). Raced against a winner (build.ahead.variants
    field 'resident')."""
    tiles = [(spec.tile_m, spec.tile_n)]
    if spec.tile_m * spec.tile_n >= 128 * 128:
        tiles += [(spec.tile_m // 2, spec.tile_n), (spec.tile_m, spec.tile_n // 2)]
    most = max(2, min(RESIDENT_MAX_STAGES, -(-problem.K // spec.tile_k)))
    out = []
    for tm, tn in tiles:
        for stages in range(most, 1, -1):  # the most stages that still leave room for two blocks
            try:
                twin = replace(spec, tile_m=tm, tile_n=tn, schedule="ws", scheduler="tile", splits=1,
                               raster="heuristic", swizzle=1, reduction="deterministic", epilogue="tma",
                               pdl=False, stages=stages, epi_n=0)
            except (TypeError, ValueError):
                break
            if smem_blocks(twin) >= 2:
                if twin != spec and twin not in out and valid(twin, problem) is None:
                    out.append(twin)
                break
    return out


# The K up to which the search's pool holds the resident twins (resident_pool): run 656 raced
# them on the H200's fp32 shapes with K <= 512 only, and they won there on 25 of 108. On a
# skinny output (M or N <= RESIDENT_POOL_SKINNY) up to RESIDENT_POOL_SKINNY_MAX_K: runs 671, 673
# and 679 raced them on 79 shapes below 0.98 with K > 512; they won 3 of the 8 skinny ones with
# K = 1024 (64x16384x1024 0.952 -> 1.018, 64x12288x1024 0.927 -> 0.960, 16384x128x1024 0.942 ->
# 0.967) and none with K >= 2048 or on a wider output
RESIDENT_POOL_MAX_K = 512
RESIDENT_POOL_SKINNY = 256
RESIDENT_POOL_SKINNY_MAX_K = 1024


def resident_pool_k(problem) -> int:
    """The K up to which resident_pool offers twins for `problem`: RESIDENT_POOL_SKINNY_MAX_K
    where M or N is at most RESIDENT_POOL_SKINNY, else RESIDENT_POOL_MAX_K."""
    if min(problem.M, problem.N) <= RESIDENT_POOL_SKINNY:
        return RESIDENT_POOL_SKINNY_MAX_K
    return RESIDENT_POOL_MAX_K


def resident_pool(specs, problem) -> list[CutlassSpec]:
    """The resident twins (resident_twins) of `specs` for `problem`, each once and none already
    among `specs`, where K is at most resident_pool_k(problem) (else none): the search's pool
    (search.policy.candidate_pool) takes them beside the enumerated specs, 111 a layout on
    128x12288x128. Before, only a race of a stored winner (build.ahead.variants 'resident')
    offered them, so a new shape's search could not find one."""
    if problem.K > resident_pool_k(problem):
        return []
    have = set(specs)
    out: dict = {}
    done = set()  # the twins follow the tile, tile_k, cluster, layout, precision and swap alone
    for s in specs:
        key = (s.tile_m, s.tile_n, s.tile_k, s.cluster_m, s.cluster_n, s.layout, s.dtype, s.acc, s.swap_ab)
        if key in done:
            continue
        done.add(key)
        for t in resident_twins(s, problem):
            if t not in have:
                out.setdefault(t.name, t)
    return list(out.values())


# Tiles narrower than _TILE_N's 64, for outputs with fewer 64x64 tiles than SMs: on the grid's
# 2^27-2^30 FLOPs shapes (64x2048x1024, 128x512x2048, ...) every CUTLASS trial used 64x64 or
# wider tiles and ran 13-16% behind cuBLASLt autotuned, which chose small-tile kernels without
# split-K there (seventh session). Built clean with nvcc (no spills, no serialized wgmma).
_NARROW_TILES = (("pingpong", 64, 16), ("pingpong", 64, 32), ("cooperative", 128, 32))
# On the grid's 2^24-2^30 FLOPs shapes where CUTLASS still ran 5-10% behind it, cuBLASLt
# autotuned chose tiles 80, 96, 112, 144, 160 or 176 wide on about one shape in seven (its
# stored choices, tenth session): a width that fits the N extent into fewer idle columns.
# Built clean with nvcc (168 registers, no spills) for 48, 80, 96 and 112.
_ODD_TILE_N = (48, 80, 96, 112, 144, 160, 176)
# 128-row tiles 160 and 96 wide, both schedules, persistent, tile_k 64, in both orientations:
# cuBLASLt autotuned's tiles on the H100 grid's shapes below 0.98 of it (2026-11-26). It chose
# tile 128x160 (its enum 29) on 48 of those 166 shapes, the largest among them (16384x16384x8192
# 0.91, 12288x16384x4096 0.92, 16384x4096x2048 0.89), with a 2x1 cluster: 128 along its m,
# which is our N (the row-major trick), so our swapped kernel (swap_ab) of tile 128x160. 160
# rows of M fill whole waves where 192 and 256 leave a partial one (16384/160 x 4096/128 =
# 3,296 tiles, 24.97 waves of 132 SMs). It chose 128x96 (enum 33) on 12288x128xK and 96x128
# (enum 28) on 128..256x12288xK: our 128x96, swapped and plain. (Its other picks there are
# tiles the pool has: 128x128 on 46, 128x256 on 11, 64-row tiles with split-K on most of the
# rest; scripts/lt-tiles.py lists them.)
_WIDE_ODD_TILES = (("cooperative", 128, 160), ("pingpong", 128, 160), ("cooperative", 128, 96),
                   ("pingpong", 128, 96))

# 128-row tiles 144 and 176 wide (plain: 128 rows of M, 144 or 176 columns of N), both
# schedules, persistent, tile_k 64: cuBLASLt autotuned's tiles 144x128 and 176x128 (enums 184
# and 201 of CUDA 13's cublasLt.h, which scripts/lt-tiles.py reads), 1x2 clusters, in 31 of the
# 290 (shape, layout) choices it made on the H100 grid's 145 shapes below 0.98 of it (256..4096
# x 8192..16384 for 144; 4096..16384 x 12288 for 176) and 64 of the H200's 670 (2026-11-27). Its
# 168x128 (enum 197, nine more H100 choices) is no tile here: 168 is no multiple of the
# epilogue's 16 columns. TN only: with B
# N-major (NN) the 144 and 176 columns take 32-byte smem swizzle atoms, and those kernels ran
# at 0.50-0.71 of the best baseline in run 265's trials where their TN forms ran 0.92-1.05.
_WIDE_PLAIN_TILES = (("cooperative", 128, 144), ("pingpong", 128, 144), ("cooperative", 128, 176),
                     ("pingpong", 128, 176))

_SEPARATE_TILES = (("cooperative", 128, 64), ("cooperative", 128, 128), ("cooperative", 128, 256),
                   ("cooperative", 256, 128), ("pingpong", 64, 64), ("pingpong", 64, 128),
                   ("pingpong", 128, 64), ("pingpong", 128, 128))
SEPARATE_SPLITS = (4, 8, 16, 32, 64)
# A wide cluster's time over its unclustered twin's: the median of 50 (shape, kernel) pairs of
# H100 trials with the separate reduction (2x2 1.18, 2x4 1.10, 4x2 1.14; runs 329-330 against
# the twins' trials), where the reread term of estimate_us would have it faster: estimate_us
# prices a wide cluster as its twin times this
WIDE_CLUSTER_COST = 1.12


SMS = 132  # H100 / H200 SXM
L2_BYTES = 50 << 20  # H100 / H200
SEPARATE_LAUNCH_US = 1.5  # a guess: the reduction kernel's launch and tail behind the GEMM
LEAN_SAVING_US = 0.5  # the lean kernels' fixed cost below a persistent kernel's (run 158 races; fixed-cost.py fits)
# a lean kernel's slowdown against its persistent twin per wave of tiles after the first, for
# two at most (run 158: 1.14-1.29x on two waves, 1.33-1.65x on three to 42)
LEAN_WAVE_COST = 0.25
TURNSTILE_GBS = 50.0  # a guess at one SM's rate reading and writing a partial tile (estimate_us)
# The wider TMA epilogue subtile (spec field epi_n) against its twin on the automatic subtile,
# per wave of tiles: each TMA store fewer saves EPI_STORE_US, each mainloop stage the wider
# staging buffers take costs EPI_STAGE_US, and a wider subtile costs EPI_FIXED_US once. Fitted
# (least squares, scripts/epi-price-fit.py) on 932 (winner, wider twin) pairs timed side by side
# in one session on 262 H200 shapes (runs 166-167 and 174-177): the priced prior picks the
# twin it rates fastest on 93 shapes, saving 786 of the 867 us the best twins save over all 262
# (fitted on runs 166-167 alone, it took the twin on 1 of run 174-177's 106 shapes, where twins
# saved 4.9 us at best: results/h200/epi-price-fit.json).
EPI_STORE_US = 0.040
EPI_STAGE_US = 0.36
EPI_FIXED_US = 0.82


def epilogue_stores(spec: CutlassSpec) -> int:
    """TMA stores a tile's epilogue issues: one a subtile (epilogue_tile)."""
    em, en = epilogue_tile(spec)
    return (spec.tile_m // em) * (spec.tile_n // en)


def subtile_us(spec: CutlassSpec, waves: float) -> float:
    """What a wider TMA epilogue subtile (epi_n) adds to its twin on the automatic subtile over
    `waves` waves of tiles: negative where the stores it saves outweigh the stages it gives up
    and its fixed cost (EPI_*_US); 0 for the automatic subtile and the other epilogues."""
    if not spec.epi_n or spec.epilogue != "tma":
        return 0.0
    auto = replace(spec, epi_n=0)
    stores_saved = epilogue_stores(auto) - epilogue_stores(spec)
    stages_lost = pipeline_stages(auto) - pipeline_stages(spec)
    return waves * (EPI_STAGE_US * stages_lost - EPI_STORE_US * stores_saved) + EPI_FIXED_US


def estimate_us(spec: CutlassSpec, problem, tflops_per_sm: float = 5.5, gbs: float = 3300.0,
                l2_gbs: float = 12000.0) -> float:
    """A rough time model for ranking specs before timing, calibrated on an H200 (12 shapes,
    results/logs/probe-2026-11-22.log): work per SM after wave quantization, the compulsory
    HBM bytes, the re-reads of A and B by neighbouring tiles (served mostly by L2), and for
    split-K / stream-K the partial tiles written and read back plus a fixed reduction cost.
    Stream-K splits the K loop only in chunks of at least 8 k-tiles, so it cannot fill the
    GPU from a handful of tiles with a short K loop.

    The compulsory HBM bytes stream at `gbs` only with every SM fetching: with `units` work
    units on fewer SMs the rate falls as sqrt(units / SMs) (issue #3: 256x256x16384 split-K 8 on
    64 of 132 SMs took 22 us where the model said 14; fitted on the store's 790 timed CUTLASS
    trials on the H200, rank correlation within a shape 0.18 -> 0.21, spread of the log error
    unchanged at 0.21). It is what lets split-K 16 outrank split-K 8 where 8 leaves SMs idle.
    A wider epilogue subtile is priced against its automatic twin (subtile_us). A swapped
    kernel (swap_ab) is priced on the transposed problem, the one it runs."""
    if spec.cluster_m * spec.cluster_n > 2:  # measured, not modelled: see WIDE_CLUSTER_COST
        return estimate_us(replace(spec, cluster_m=1, cluster_n=1), problem, tflops_per_sm, gbs,
                           l2_gbs) * WIDE_CLUSTER_COST
    if spec.swap_ab:
        problem = replace(problem, M=problem.N, N=problem.M)
    tiles_m = -(-problem.M // spec.tile_m)
    tiles_n = -(-problem.N // spec.tile_n)
    # CUTLASS's schedulers launch whole clusters: a 4x1 cluster over 2 rows of tiles runs 4
    # (half of them on tiles past the edge), so the work is counted on the cluster-rounded grid
    tiles = _round_up(tiles_m, spec.cluster_m) * _round_up(tiles_n, spec.cluster_n)
    usable = SMS - SMS % (spec.cluster_m * spec.cluster_n)
    k_chunks = max(1, problem.K // (8 * spec.tile_k))
    if spec.scheduler == "splitk":
        splits = spec.splits
    elif spec.scheduler == "streamk" and tiles < usable:
        splits = max(1, min(usable // tiles, k_chunks))
    else:
        splits = 1
    units = tiles * splits
    if spec.scheduler == "streamk" and units >= usable:
        waves = units / usable  # stream-K balances the last wave
    else:
        waves = -(-units // usable)
    tile_flops = 2 * spec.tile_m * spec.tile_n * problem.K / splits
    # bigger tiles keep the tensor cores busier (more math per byte through shared memory)
    efficiency = 0.75 + 0.25 * min(1.0, spec.tile_m * spec.tile_n / 32768)
    compute = waves * tile_flops / (tflops_per_sm * efficiency * 1e6)
    compulsory = 2 * (problem.M * problem.K + problem.N * problem.K + problem.M * problem.N)
    reread = 2 * (problem.M * problem.K * max(0, tiles_n / max(1, spec.cluster_n) - 1)
                  + problem.N * problem.K * max(0, tiles_m / max(1, spec.cluster_m) - 1))
    hbm_gbs = gbs * min(1.0, units / usable) ** 0.5  # fewer fetching SMs, less of HBM reached
    memory = compulsory / (hbm_gbs * 1e3) + reread / (l2_gbs * 1e3)
    reduce = 0.0
    if separate(spec):
        # the partials go out and come back through L2 when they fit in it (else HBM), plus the
        # reduction kernel's launch behind the GEMM. Against 404 timed trials on 23 long-K and
        # skinny shapes (H200, run 35) it predicts 11% high on average (log error +0.11, spread
        # 0.24; persistent kernels there +0.20, split-K with CUTLASS's reductions -0.23) and
        # ranks a shape's candidates with a rank correlation of 0.55; left as it is
        round_trip = 2 * partial_bytes(spec) * splits * problem.M * problem.N
        rate = l2_gbs if round_trip / 2 <= L2_BYTES * 0.6 else gbs
        return (max(compute, memory) + SEPARATE_LAUNCH_US + round_trip / (rate * 1e3) + 3.0
                + subtile_us(spec, waves))
    if spec.scheduler == "tile":
        # the lean one-tile-per-CTA kernels (run 158, H100): about 0.5 us less fixed cost than a
        # persistent kernel within one wave of tiles; each further wave launches its CTAs again,
        # where the SMs hold one block at a time (run 158's lean kernels took every stage that
        # fit). With resident_blocks blocks on an SM, a launch wave is that many waves of tiles,
        # whose loads and epilogues overlap (H200 fp32, run 656: the lean kernels with 2-4 stages
        # won 25 of 108 shapes with K <= 512 from persistent kernels, 1.07x)
        launches = -(-units // (usable * resident_blocks(spec)))
        slower = 1 + LEAN_WAVE_COST * min(launches - 1, 2)
        return (max(compute, memory) * slower + 3.0 - (LEAN_SAVING_US if launches == 1 else 0.0)
                + subtile_us(spec, waves))
    if spec.scheduler == "streamk" and splits == 1 and tiles % usable:
        reduce = 2.0 + 8 * usable * spec.tile_m * spec.tile_n / (gbs * 1e3)  # the split last wave
    if splits > 1:
        tile_partials = 2 * 4 * units * spec.tile_m * spec.tile_n  # fp32 partials out and back in
        reduce = 2.0 + tile_partials / (gbs * 1e3)
        if spec.reduction == "nondeterministic":
            # a prior, not yet fitted: the turnstile the fitted term includes is gone, each of
            # the splits - 1 waits passing one fp32 partial tile at TURNSTILE_GBS per SM
            reduce = max(2.0, reduce - 0.5 * (splits - 1) * 2 * 4 * spec.tile_m * spec.tile_n / (TURNSTILE_GBS * 1e3))
    return max(compute, memory) + reduce + 3.0 + subtile_us(spec, waves)


def skinny_n(problem) -> bool:
    """A narrow output over many rows (N <= 1024 and M >= 8 N), where the swapped kernels
    (swap_ab: C^T = B^T A^T, the tile over N x M) join the search's pool: there the unswapped
    tiles cannot fill the GPU evenly (12288x256xK on an H100 ran 0.78-0.86 of cuBLASLt
    autotuned, 2026-11-26)."""
    return problem.N <= 1024 and problem.M >= 8 * problem.N


def seed_only(spec: CutlassSpec) -> bool:
    """Kernels valid() accepts that only a seed proposes (search/lt_seed.py: cuBLASLt's own
    choices), neither the search pool nor the mutations of other kernels: the swapped kernels
    with the separate reduction, cuBLASLt's short-M split-K twins. Timed on the H200 since
    (run 634: 20 of the 28 new winners of 47 shapes below 0.98), so a mutation of one of them
    (search.policy.mutations) may stay swapped and separate: the region is searched from a seed
    that won it."""
    return spec.swap_ab and separate(spec)


def swapped_twins(specs) -> list[CutlassSpec]:
    """Each spec's swapped twin (swap_ab), where the swap is offered (not with an explicit
    epilogue subtile or the separate reduction) and not among `specs` already (enumerate_specs
    carries _WIDE_ODD_TILES in both orientations)."""
    have = set(specs)
    return [t for t in (replace(s, swap_ab=True) for s in specs if not s.swap_ab and not s.epi_n and not separate(s))
            if t not in have]


def heuristic_specs(problem, layout: str, acc: str | None = None, limit: int = 8) -> list[CutlassSpec]:
    """Specs for a problem ranked by estimate_us (valid ones only), at most one per (tile,
    schedule, scheduler, swap): the model cannot tell swizzles or clusters apart, timing can.
    For a narrow N over many rows (skinny_n) the swapped twins rank beside the rest, as in the
    search's pool."""
    specs = enumerate_specs(layout, problem.dtype, acc or problem.acc)
    if skinny_n(problem):
        specs = specs + swapped_twins(specs)
    specs = [s for s in specs if valid(s, problem) is None]
    specs.sort(key=lambda s: (estimate_us(s, problem), s.name))
    out, seen = [], set()
    for s in specs:
        k = (s.tile_m, s.tile_n, s.tile_k, s.schedule, s.scheduler, s.reduction, s.swap_ab)
        if k not in seen:
            seen.add(k)
            out.append(s)
        if len(out) == limit:
            break
    return out


# ---------------------------------------------------------------------------------------------
# Build settings and rendering

BUILD_FLAGS = ("-Xptxas=-warn-spills",)  # build_shared adds -O3 -std=c++17 -DNDEBUG, relaxed constexpr
USES_CUTLASS = True  # the registry adds the headers and their version to every build


def include_dirs() -> tuple[str, ...]:
    """The CUTLASS/CuTe include directories (the wheel's, or $GEMMRL_CUTLASS_DIR's)."""
    from gemmrl.build.cutlass import cutlass_include_dirs

    return tuple(cutlass_include_dirs())


_CPP_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "fp32": "float"}
_CPP_RASTER = {"heuristic": "Heuristic", "along_m": "AlongM", "along_n": "AlongN"}

# Programmatic dependent launch (spec field `pdl`). CUTLASS's sm90 kernels, compiled with
# CUTLASS_ENABLE_GDC_FOR_SM90, wait in griddepcontrol.wait (every producer warp, before its first
# global load) until the grid before them in the stream has finished and its writes are visible,
# and signal griddepcontrol.launch_dependents once their last tile's mainloop is done. Launched
# with cudaLaunchAttributeProgrammaticStreamSerialization, such a kernel may be scheduled while
# the previous kernel drains: its CTAs start on free SMs and set up (barriers, descriptor
# prefetch) instead of waiting for the launch. Correctness does not depend on the previous
# kernel: one that never signals releases the wait when it completes, as a plain launch would.
PDL_PREFIX = ("// launched as a programmatic dependent: producers wait (griddepcontrol.wait) before their\n"
              "// first global load; the last tile's mainloop signals the next kernel\n"
              "#define CUTLASS_ENABLE_GDC_FOR_SM90 1\n")
# CUTLASS's host code encodes each TMA descriptor (A, B and D: three a call) through a wrapper that
# asks the CUDA runtime for the driver's cuTensorMapEncodeTiled on every call
# (cudaGetDriverEntryPointByVersion, cutlass/cuda_host_adapter.hpp), a symbol lookup in the driver
# that other projects cache for its CPU cost (CUTLASS issue 3003, TransformerEngine PR 999). This
# prefix looks the entry point up once per process and has CUTLASS call it directly. Host code only:
# the kernel and its Params are the same; a failed lookup is not cached (the next call tries again)
# and makes the call return CUDA_ERROR_UNKNOWN, as CUTLASS's own wrapper does.
# On by default since the fifty-second session: on an H200, 8 CUTLASS winners' latency per call
# (synchronise-call-synchronise, scripts/cutlass-host-cost.py --entry-cache) fell by 0.40-1.35 us,
# about 2-4% of their 18-33 us, against 0.02-0.65 us between two copies of one build
# (results/h200/host-cost-entry-cache-2026-11-29k.json). GEMMRL_CUTLASS_ENTRY_CACHE=0 in the build's
# environment (or render(..., entry_cache=False)) gives CUTLASS's own path back; either changes the
# build's key, so the two never share a cached build.
ENTRY_CACHE_ENV = "GEMMRL_CUTLASS_ENTRY_CACHE"
ENTRY_CACHE_PREFIX = r"""// host: the driver's cuTensorMapEncodeTiled looked up once per process, not once per descriptor
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
"""


def entry_cache_default() -> bool:
    """Whether render() adds ENTRY_CACHE_PREFIX when not told: yes unless $GEMMRL_CUTLASS_ENTRY_CACHE
    is '0', 'false', 'no' or 'off' (any case)."""
    return os.environ.get(ENTRY_CACHE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


PDL_LAUNCH = """  // programmatic dependent launch: may start while the stream's previous kernel drains
  cudaLaunchAttribute with_pdl[2];
  with_pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  with_pdl[0].val.programmaticStreamSerializationAllowed = 1;
  with_pdl[1] = attribute[0];
  config.attrs = with_pdl;
  config.numAttrs += 1;
"""

_TEMPLATE = Template(r"""// ${name}: a CUTLASS 3.x sm90 GEMM behind the gemmrl kernel ABI (gemmrl/runtime/abi.py).
// Rendered by gemmrl.space.cutlass_sm90 (render version ${version}) from the spec
//   ${spec_json}
// Do not edit: change the spec or the renderer. Generic over M, N, K; residues are handled by
// TMA (out-of-bounds loads read zeros, stores are clipped). C = A @ ${b_expr}, C is not read.
${extended_mma}#include <atomic>
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

using ElementA = ${element_in};
using ElementB = ${element_in};
${element_d_line}
using ElementAccumulator = ${element_acc};
using ElementCompute = ${element_acc};
${layout_a_line}
using LayoutB = ${layout_b};  // ${layout_b_doc}
${layout_d_line}
constexpr int kAlignment = 8;  // elements: 16 bytes, TMA's minimum

using TileShape = cute::Shape<cute::_${tile_m}, cute::_${tile_n}, cute::_${tile_k}>;
using ClusterShape = cute::Shape<cute::_${cluster_m}, cute::_${cluster_n}, cute::_1>;
using MainloopSchedule = ${mainloop_schedule};
using EpilogueSchedule = ${epilogue_schedule};
using TileSchedulerTag = ${scheduler_tag};

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    ${epilogue_tile}, ElementAccumulator, ElementCompute,
    void, LayoutD, kAlignment,  // no C operand: beta is 0 and C is never read
    ElementD, LayoutD, kAlignment, EpilogueSchedule>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignment, ElementB,
    LayoutB, kAlignment, ElementAccumulator, TileShape, ClusterShape,
    ${stage_count},
    MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, TileSchedulerTag>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

static_assert(GemmKernel::SharedStorageSize <= ${smem_capacity},
              "shared memory over the sm90 limit: fewer stages or a smaller tile");
static_assert(CollectiveMainloop::DispatchPolicy::Stages >= 2, "the mainloop needs at least 2 stages");

// gemmrl_run's return codes (0: launched; anything else: no kernel was launched)
enum Status : int {
  kOk = 0,
  kBadSize = 1,           // M, N or K not positive
  kBadLeadingDim = 2,     // lda < K, ldb < ${ldb_min}, or ldc < N
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
${pdl_launch}  void* kernel_args[] = {&params};
  return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>),
                             kernel_args) == cudaSuccess;
}

typename Gemm::Arguments make_arguments(const void* A, const void* B, void* C, int M, int N, int K,
                                        int lda, int ldb, int ldc, int device, int sms) {
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
${strides}
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = ${problem_shape};
  args.mainloop.ptr_A = static_cast<ElementA const*>(${ptr_a});
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = static_cast<ElementB const*>(${ptr_b});
  args.mainloop.dB = stride_b;
  args.epilogue.thread.alpha = ElementCompute(1);
  args.epilogue.thread.beta = ElementCompute(0);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<ElementD*>(C);
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::${raster};
  args.scheduler.max_swizzle_size = ${swizzle};
${scheduler_args}  return args;
}
${reduce_kernel}
}  // namespace

extern "C" __attribute__((visibility("default"))) const char* gemmrl_meta(void) {
  return "${meta_c}";
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

${entry_points}""")


# The ABI's two entry points for a GEMM that writes C itself.
_ENTRY_POINTS = Template(r"""extern "C" __attribute__((visibility("default"))) size_t gemmrl_workspace_bytes(int M, int N, int K) {
  if (M <= 0 || N <= 0 || K <= 0) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int sms = sm_count(device);
  if (sms <= 0) return 0;
  return Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, M, N, K, K, ${ldb_packed}, N,
                                                 device, sms));
}

extern "C" __attribute__((visibility("default"))) int gemmrl_run(
    const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb, int ldc,
    void* workspace, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0) return kBadSize;
  if (lda < K || ldb < ${ldb_min} || ldc < N) return kBadLeadingDim;
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
""")

# ... and for the separate reduction: the GEMM is a batch of K chunks writing partials (fp32, or
# fp16 for an fp16 accumulator) into the workspace (after CUTLASS's own, if any), then
# gemmrl_separate::splitk_reduce (splitk_reduce_half) writes C.
_ENTRY_POINTS_SEPARATE = Template(r"""// The workspace: CUTLASS's own bytes (if any), then the ${part_doc} partials [kSplits][M][N] from a
// 256-byte boundary.
static size_t partials_offset(size_t cutlass_bytes) { return (cutlass_bytes + 255) / 256 * 256; }

extern "C" __attribute__((visibility("default"))) size_t gemmrl_workspace_bytes(int M, int N, int K) {
  if (M <= 0 || N <= 0 || K <= 0 || K % (kSplits * kAlignment)) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int sms = sm_count(device);
  if (sms <= 0) return 0;
  size_t own = Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, M, N, K, K, ${ldb_packed}, N,
                                                       device, sms));
  return partials_offset(own) + size_t(kSplits) * size_t(M) * size_t(N) * sizeof(${part_cpp});
}

// Two launches on `stream`: the GEMM, then the reduction gemmrl_separate::${reduce_fn} (programmatic dependent launch: it may be
// scheduled early and waits in griddepcontrol.wait until the GEMM's writes are visible). A
// return of kLaunchFailed after the GEMM launched means the reduction did not: C is not written.
extern "C" __attribute__((visibility("default"))) int gemmrl_run(
    const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb, int ldc,
    void* workspace, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0) return kBadSize;
  if (lda < K || ldb < ${ldb_min} || ldc < N) return kBadLeadingDim;
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
  ${part_cpp}* partials = reinterpret_cast<${part_cpp}*>(static_cast<char*>(workspace) + partials_offset(own));
  args.epilogue.ptr_D = partials;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  if (!kernel_ready(device)) return kInitFailed;
  if (GemmKernel::initialize_workspace(args, own > 0 ? workspace : nullptr, stream) != cutlass::Status::kSuccess)
    return kInitFailed;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, own > 0 ? workspace : nullptr);
  if (!launch_gemm(params, stream)) return kLaunchFailed;
  const int64_t quads = int64_t(M) * (N / ${vec});
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
  if (cudaLaunchKernelEx(&config, gemmrl_separate::${reduce_fn}<${out_cpp}, ${splits}>,
                         static_cast<const ${part_cpp}*>(partials), static_cast<${out_cpp}*>(C), M, N, ldc) != cudaSuccess)
    return kLaunchFailed;
  return kOk;
}
""")

# the separate reduction's partials per accumulator (their C++ type is the accumulator's,
# _CPP_ELEMENT): the reduction kernel, the elements one thread sums (one 16-byte load of each)
_SEPARATE_PARTIALS = {
    "fp32": {"part_doc": "fp32", "reduce_fn": "splitk_reduce", "vec": 4},
    "fp16": {"part_doc": "fp16", "reduce_fn": "splitk_reduce_half", "vec": 8},
}

_REDUCE_KERNEL = r"""
}  // namespace

// (a kernel in a named namespace: nvcc's host stubs cannot name one in an anonymous namespace)
namespace gemmrl_separate {

// The separate reduction: C[m][n] = the sum over K chunks s = 0..Splits-1, in that order, of the
// fp32 partials P[s][m][n], rounded once to C's type. Deterministic: no atomics, one order.
// Four consecutive n per thread (N % 8 == 0): float4 loads, one 8-byte store.
constexpr int kReduceThreads = 128;

template <typename Out, int Splits>
__global__ void __launch_bounds__(kReduceThreads)
splitk_reduce(const float* __restrict__ partials, Out* __restrict__ C, int M, int N, int ldc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the GEMM has finished and its writes are visible
#endif
  const int64_t quads_per_row = N / 4, quads = int64_t(M) * quads_per_row;
  const int64_t slice = quads;  // float4 per [M,N] partial
  const float4* p4 = reinterpret_cast<const float4*>(partials);
  for (int64_t i = int64_t(blockIdx.x) * kReduceThreads + threadIdx.x; i < quads;
       i += int64_t(gridDim.x) * kReduceThreads) {
    const int64_t m = i / quads_per_row, n = (i - m * quads_per_row) * 4;
    float4 acc = __ldcs(p4 + i);
#pragma unroll 8
    for (int s = 1; s < Splits; ++s) {
      const float4 v = __ldcs(p4 + i + s * slice);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    alignas(8) Out out[4] = {Out(acc.x), Out(acc.y), Out(acc.z), Out(acc.w)};
    *reinterpret_cast<uint2*>(C + m * ldc + n) = *reinterpret_cast<const uint2*>(out);
  }
}

}  // namespace gemmrl_separate

namespace {
"""

_REDUCE_KERNEL_HALF = r"""
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
"""

def source_variants(spec: CutlassSpec, problem=None) -> list[str]:
    """The sources of one kernel that differ in host code only: render()'s own first, then the one
    with ENTRY_CACHE_PREFIX the other way (registry.Family.source_variants: product sessions timed
    under either count for the kernel)."""
    on = entry_cache_default()
    return [render(spec, problem, entry_cache=on), render(spec, problem, entry_cache=not on)]


def render(spec: CutlassSpec, problem=None, entry_cache: bool | None = None) -> str:
    """The complete .cu source of `spec`: pure and deterministic. The kernel is generic over the
    problem size, so `problem` only has to be one the spec serves (it changes nothing).
    `entry_cache`: the host code looks the driver's TMA encoder up once (ENTRY_CACHE_PREFIX);
    None: as $GEMMRL_CUTLASS_ENTRY_CACHE says (entry_cache_default), on unless it is '0' (or off)."""
    why = valid(spec, problem)
    if why:
        raise ValueError(f"{spec.name}: {why}")
    s = spec
    nn = s.layout == "NN"
    sr = separate(s)
    if s.scheduler == "tile":  # the lean kernels: grid = the (cluster-rounded) tiles
        scheduler_tag, scheduler_args = "void", ""
    elif s.scheduler == "persistent" or sr:  # the separate reduction's GEMM is a persistent batch
        scheduler_tag, scheduler_args = "cutlass::gemm::PersistentScheduler", ""
    else:
        mode = "SplitK" if s.scheduler == "splitk" else "Heuristic"
        scheduler_tag = "cutlass::gemm::StreamKScheduler"
        reduction = "Nondeterministic" if s.reduction == "nondeterministic" else "Deterministic"
        scheduler_args = (f"  args.scheduler.splits = {s.splits};\n"
                          f"  args.scheduler.decomposition_mode =\n"
                          f"      cutlass::gemm::kernel::detail::DecompositionMode::{mode};\n"
                          f"  args.scheduler.reduction_mode =\n"
                          f"      cutlass::gemm::kernel::detail::ReductionMode::{reduction};\n")
    if s.stages:
        stage_count = f"cutlass::gemm::collective::StageCount<{s.stages}>"
    else:
        stage_count = ("cutlass::gemm::collective::StageCountAutoCarveout<\n"
                       "        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>")
    stride_b = ("cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * K)" if nn
                else "cute::make_stride(int64_t(ldb), cute::Int<1>{}, int64_t(ldb) * N)")
    if sr:
        element_d_line = (f"using ElementD = {_CPP_ELEMENT[s.acc]};  // the GEMM's output: {s.acc} partials, an [M,N] slice per K chunk\n"
                          f"using ElementOut = {_CPP_ELEMENT[s.dtype]};  // the ABI's C, written by the reduction\n"
                          f"constexpr int kSplits = {s.splits};  // K chunks: the GEMM's batch, summed by splitk_reduce")
        kc = "int64_t(K / kSplits)"
        stride_b_chunk = ("cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * chunk)" if nn
                          else "cute::make_stride(int64_t(ldb), cute::Int<1>{}, chunk)")
        chunk = f"  const int64_t chunk = {kc};  // K per split: the batch stride of A and of B\n"
        if s.swap_ab:  # C^T = B^T A^T per K chunk: the kernel's D is each [M,N] partial column-major
            strides = (
                chunk + "  // swapped: the kernel's (M, N) are the problem's (N, M)\n"
                f"  StrideA stride_a = {stride_b_chunk};  // B\n"
                "  StrideB stride_b = cute::make_stride(int64_t(lda), cute::Int<1>{}, chunk);  // A [M,K]\n"
                "  StrideD stride_d = cute::make_stride(cute::Int<1>{}, int64_t(N), int64_t(N) * M);"
                "  // packed [M,N] partials\n")
            problem_shape = "cute::make_shape(N, M, K / kSplits, kSplits)"
        else:
            strides = (
                chunk + f"  StrideA stride_a = cute::make_stride(int64_t(lda), cute::Int<1>{{}}, chunk);\n"
                f"  StrideB stride_b = {stride_b_chunk};\n"
                "  StrideD stride_d = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(N) * M);  // packed partials\n")
            problem_shape = "cute::make_shape(M, N, K / kSplits, kSplits)"
        entry = _ENTRY_POINTS_SEPARATE
        prefix = ("// split-K with a separate reduction kernel: the GEMM signals its dependent launch early\n"
                  "#define CUTLASS_ENABLE_GDC_FOR_SM90 1\n#include <algorithm>\n")
        reduce_kernel = _REDUCE_KERNEL if s.acc == "fp32" else _REDUCE_KERNEL_HALF
    elif s.swap_ab:  # C^T = B^T A^T: the kernel's A is B, its B is A, its D is C column-major
        element_d_line = f"using ElementD = {_CPP_ELEMENT[s.dtype]};  // the ABI's C"
        strides = ("  // swapped: the kernel's (M, N) are the problem's (N, M)\n"
                   "  StrideA stride_a = "
                   + ("cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * K);  // B [K,N]: N-contiguous\n" if nn
                      else "cute::make_stride(int64_t(ldb), cute::Int<1>{}, int64_t(ldb) * N);  // B [N,K]: K-contiguous\n")
                   + "  StrideB stride_b = cute::make_stride(int64_t(lda), cute::Int<1>{}, int64_t(lda) * M);  // A [M,K]\n"
                   "  StrideD stride_d = cute::make_stride(cute::Int<1>{}, int64_t(ldc), int64_t(ldc) * M);  // C [M,N]\n")
        problem_shape = "cute::make_shape(N, M, K, 1)"
        entry, prefix, reduce_kernel = _ENTRY_POINTS, "", ""
    else:
        element_d_line = f"using ElementD = {_CPP_ELEMENT[s.dtype]};  // the ABI's C"
        strides = ("  StrideA stride_a = cute::make_stride(int64_t(lda), cute::Int<1>{}, int64_t(lda) * M);\n"
                   f"  StrideB stride_b = {stride_b};\n"
                   "  StrideD stride_d = cute::make_stride(int64_t(ldc), cute::Int<1>{}, int64_t(ldc) * M);\n")
        problem_shape = "cute::make_shape(M, N, K, 1)"
        entry, prefix, reduce_kernel = _ENTRY_POINTS, "", ""
    pdl_launch = ""
    if s.pdl:
        if "CUTLASS_ENABLE_GDC_FOR_SM90" not in prefix:
            prefix = PDL_PREFIX + prefix
        pdl_launch = PDL_LAUNCH
    if entry_cache is None:
        entry_cache = entry_cache_default()
    if entry_cache:
        prefix = ENTRY_CACHE_PREFIX + prefix
    meta = {"layout": s.layout, "dtype": s.dtype, "acc": s.acc, "name": s.name, "family": FAMILY,
            "key": s.key()}
    return _TEMPLATE.substitute(
        name=s.name, version=RENDER_VERSION,
        extended_mma=prefix + ("" if s.tile_n in BASE_MMA_N else
                               "// tile_n is not a base wgmma N: one wide MMA atom needs cute's extended shapes\n"
                               "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1\n"),
        element_d_line=element_d_line, strides=strides, problem_shape=problem_shape, pdl_launch=pdl_launch,
        reduce_kernel=reduce_kernel,
        ldb_min="N" if nn else "K",
        entry_points=entry.substitute(ldb_min="N" if nn else "K", ldb_packed="N" if nn else "K",
                                      out_cpp=_CPP_ELEMENT[s.dtype], splits=s.splits,
                                      part_cpp=_CPP_ELEMENT[s.acc], **_SEPARATE_PARTIALS[s.acc]),
        spec_json=json.dumps(s.to_dict(), sort_keys=True, separators=(",", ":")),
        b_expr="B" if nn else "B^T",
        element_in=_CPP_ELEMENT[s.dtype], element_acc=_CPP_ELEMENT[s.acc],
        layout_b="cutlass::layout::ColumnMajor" if s.swap_ab else "cutlass::layout::RowMajor" if nn else "cutlass::layout::ColumnMajor",
        layout_b_doc=("swapped: the kernel's B is A^T, K-contiguous (A [M,K] row-major)" if s.swap_ab else
                      "NN: B [K,N] row-major, N-contiguous" if nn
                      else "TN: B given as [N,K] row-major, K-contiguous"),
        layout_a_line=("using LayoutA = cutlass::layout::RowMajor;  // A [M,K] row-major: K-contiguous" if not s.swap_ab
                       else "using LayoutA = cutlass::layout::ColumnMajor;  // swapped: the kernel's A is B^T [N,K], "
                            "N-contiguous (B [K,N] row-major)" if nn
                       else "using LayoutA = cutlass::layout::RowMajor;  // swapped: the kernel's A is B [N,K] row-major, K-contiguous"),
        layout_d_line=("using LayoutD = cutlass::layout::RowMajor;  // C [M,N] row-major" if not s.swap_ab
                       else "using LayoutD = cutlass::layout::ColumnMajor;  // swapped: the kernel's D is C^T [N,M] "
                            "column-major, that is C [M,N] row-major"),
        ptr_a="B" if s.swap_ab else "A", ptr_b="A" if s.swap_ab else "B",
        tile_m=s.tile_m, tile_n=s.tile_n, tile_k=s.tile_k, cluster_m=s.cluster_m, cluster_n=s.cluster_n,
        mainloop_schedule=_MAINLOOP_SCHEDULE[s.schedule],
        epilogue_schedule=("cutlass::epilogue::NoSmemWarpSpecialized" if s.epilogue == "nosmem" else
                           "cutlass::epilogue::TmaWarpSpecializedCooperative" if s.schedule == "cooperative"
                           else "cutlass::epilogue::TmaWarpSpecialized"),
        scheduler_tag=scheduler_tag, scheduler_args=scheduler_args, stage_count=stage_count,
        epilogue_tile=("cutlass::epilogue::collective::EpilogueTileAuto" if not s.epi_n else
                       "cute::Shape<cute::_{}, cute::_{}>".format(*epilogue_tile(s))),
        smem_capacity=SMEM_CAPACITY,
        raster=_CPP_RASTER[s.raster], swizzle=s.swizzle,
        meta_c=json.dumps(meta, separators=(", ", ": ")).replace("\\", "\\\\").replace('"', '\\"'),
    )


_MAINLOOP_SCHEDULE = {"cooperative": "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                      "pingpong": "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
                      "ws": "cutlass::gemm::KernelTmaWarpSpecialized",
                      "tma": "cutlass::gemm::KernelTma"}


def with_fields(spec: CutlassSpec, **changes) -> CutlassSpec:
    """A copy of `spec` with some fields changed (for policies that mutate specs)."""
    return replace(spec, **changes)
