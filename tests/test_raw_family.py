"""The raw family on the CPU: the legality rules, pure and deterministic rendering, names and
keys, golden sources, the heuristic, a real nvcc build of the golden kernels, and two
simulations of the index math that need no GPU:

- a pure-Python model of the grid (tiles x splits x warps x lanes x fragments) proving every
  output element is written exactly once, every K tile summed exactly once, the workspace
  slots disjoint and in bounds, every ldmatrix row address inside its stage and free of bank
  conflicts, for residue shapes in M, N and K;
- the rendered kernel itself compiled with g++ against a CPU stand-in of CUDA (one thread per
  GPU thread, warp collectives ldmatrix / mma.m16n8k16 / shfl emulated from the PTX ISA's
  fragment layouts, cp.async applied at issue or only at wait_group) and run through its own
  gemmrl_run: exact {0,1} products, random products, NaN-poisoned output, guard bands, a
  workspace of garbage, split-K results bit-identical whatever order the blocks run in, the
  counters back at (tag, 0) after every call, the refusals of other shapes and strides.

What neither can show: that the PTX does on the device what the emulation assumes of it, and
anything about speed (tests/test_raw_family_gpu.py, on a GPU).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import os
import re
import shutil
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gemmrl.core.problem import Problem
from gemmrl.runtime.abi import REQUIRED_SYMBOLS, KernelMeta
from gemmrl.space import registry
from gemmrl.space.raw import (ACC_COL, ACC_ROW, COUNTER_TAG, DEEP_MIN_KT, LDSM_ROW_COL, MAX_REDUCE_BYTES,
                              SMEM_PER_BLOCK, SM_COUNT, RawSpec, _splits, _WARPS, estimate_us, geometry,
                              heuristic_specs, is_deep_split, kernel_name, render, valid, workspace_bytes)

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "raw"
GOLDEN = [
    (RawSpec(64, 64, 64, 2, 2, 4, 8, False, "NN", "fp32"), Problem(64, 64, 12288)),
    (RawSpec(64, 64, 64, 2, 2, 4, 16, False, "TN", "fp32"), Problem(512, 64, 12288)),
    (RawSpec(128, 128, 32, 2, 4, 3, 1, False, "NN", "fp32"), Problem(256, 4096, 512)),
]
GOLDEN_IDS = [kernel_name(s, p) for s, p in GOLDEN]


def S(**kw) -> RawSpec:
    return dataclasses.replace(RawSpec(), **kw)


# -- valid(): every rule, and the message that names it ----------------------------------------

P = Problem(256, 256, 4096)
RULES = [
    (S(layout="NT"), P, "layout"),
    (S(acc="bf16"), P, "acc must be"),
    (S(), Problem(256, 256, 4096, "bf16", "fp32"), "spec multiplies fp16 but the problem is bf16"),
    (S(dtype="bf16"), P, "spec multiplies bf16 but the problem is fp16"),
    (S(dtype="fp8"), P, "dtype must be one of fp16, bf16"),
    (S(dtype="bf16", acc="fp16"), Problem(256, 256, 4096, "bf16", "fp32"), "bf16 accumulates in fp32 only"),
    (S(acc="fp16"), P, "problem asks for fp32"),
    (S(block_m=64.0), P, "must be ints"),
    (S(swap_ab=1), P, "must be ints"),
    (S(warps_m=4, warps_n=4, block_m=64, block_n=64), P, "warps_m*warps_n"),
    (S(warps_m=0), P, "warps_m*warps_n"),
    (S(block_m=48), P, "block_m=48"),
    (S(block_n=40), P, "block_n=40"),
    (S(block_n=16, warps_n=2), P, "block_n=16"),
    (S(block_k=48), P, "block_k"),
    (S(block_m=512, warps_m=8, warps_n=1), P, "at most 256"),
    (S(stages=5), P, "stages"),
    (S(stages=1), P, "stages"),
    (S(block_m=128, block_n=128, warps_m=1, warps_n=1), P, "accumulators per thread"),
    (S(), Problem(256, 256, 4100), "K=4100 must be a multiple of 8"),
    (S(layout="TN"), Problem(256, 256, 4100), "A and B"),
    (S(layout="NN"), Problem(256, 260, 4096), "NN needs N % 8"),
    (S(block_m=128, block_n=256, block_k=128, warps_m=2, warps_n=4, stages=4), P, "shared memory"),
    (S(split_k=0), P, "split_k must be"),
    (S(split_k=300), P, "split_k must be"),
    (S(split_k=65), Problem(256, 256, 4096), "more than the 64 K tiles"),
    (S(split_k=24), Problem(256, 256, 4096), "leaves the last split empty"),
    # exactly 48 KB of dynamic shared memory, no opt-in, and split-K's static flag on top
    (S(block_m=64, block_n=16, block_k=64, warps_m=4, warps_n=1, stages=4, split_k=2),
     Problem(8192, 128, 8192), "split-K's static flag"),
    (S(split_k=2, arrive="xchg"), P, "arrive must be one of"),
    (S(arrive="add"), P, "split_k must be more than 1"),
    (S(epi="tma"), P, "epi must be one of"),
    (S(layout="TN", epi="smem"), Problem(64, 68, 4096), "N % 8 == 0"),
]


@pytest.mark.parametrize("spec,problem,why", RULES, ids=[r[2] + f"-{i}" for i, r in enumerate(RULES)])
def test_each_validity_rule_can_fail(spec, problem, why):
    reason = valid(spec, problem)
    assert reason is not None and why in reason, reason
    with pytest.raises(ValueError, match="cannot serve"):
        render(spec, problem)


def test_valid_accepts_sensible_specs_and_the_residues_it_promises():
    assert valid(S(), P) is None
    assert valid(S(layout="TN"), Problem(33, 71, 4104)) is None       # odd N and a K tail in TN
    assert valid(S(swap_ab=True), Problem(65, 72, 520)) is None       # residues everywhere in NN
    assert valid(S(split_k=64), Problem(64, 64, 4096)) is None        # one K tile per split
    assert valid(S(acc="fp16"), Problem(64, 64, 4096, "fp16", "fp16")) is None
    for spec, problem in GOLDEN:
        assert valid(spec, problem) is None
    # the shared-memory rule is the budget, exactly
    big = S(block_m=128, block_n=256, block_k=128, warps_m=2, warps_n=4, stages=2)
    assert geometry(big, P).smem_bytes <= SMEM_PER_BLOCK and valid(big, P) is None
    # exactly 48 KB without split-K (no static shared memory) launches without opting in
    at48 = S(block_m=64, block_n=16, block_k=64, warps_m=4, warps_n=1, stages=4)
    assert geometry(at48, Problem(8192, 128, 8192)).smem_bytes == 48 * 1024 and valid(at48, Problem(8192, 128, 8192)) is None


# -- rendering is pure; names and keys ------------------------------------------------------------

def test_render_is_deterministic_and_specialized():
    spec, problem = GOLDEN[0]
    a, b = render(spec, problem), render(dataclasses.replace(spec), Problem(64, 64, 12288))
    assert a == b
    assert "constexpr int M = 64, N = 64, K = 12288;" in a
    assert render(spec, Problem(64, 64, 12280)) != a
    assert render(dataclasses.replace(spec, stages=3), problem) != a
    meta = KernelMeta.parse(json.loads(re.search(r"gemmrl_meta\(void\) \{ return (\".*\"); \}", a).group(1)))
    assert (meta.layout, meta.dtype, meta.acc, meta.name) == ("NN", "fp16", "fp32", kernel_name(spec, problem))


def test_a_bf16_kernel_is_its_fp16_twin_retyped():
    """dtype='bf16': the fp16 twin's source with the element type, its conversions, the MMA's
    operand types and the meta retyped; nothing else differs, and no fp16 type, conversion or MMA
    is left. fp16 sources carry no bf16 text."""
    from gemmrl.space.raw import _BF16_TEXT, _retype

    for spec, problem in [(S(block_n=32, split_k=3, swap_ab=True, arrive="add"), Problem(65, 72, 264)),
                          (S(layout="TN"), Problem(33, 71, 200)), (S(epi="smem"), Problem(72, 136, 96))]:
        half = render(spec, problem)
        bspec, bprob = dataclasses.replace(spec, dtype="bf16"), Problem(problem.M, problem.N, problem.K, "bf16", "fp32")
        bf = render(bspec, bprob)
        assert "bfloat" not in half and "bf16" not in half
        assert not re.search(r"__half|2half|\.f16\.f16", bf), "fp16 text left in a bf16 kernel"
        assert "#include <cuda_bf16.h>" in bf and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in bf
        meta = KernelMeta.parse(json.loads(re.search(r"gemmrl_meta\(void\) \{ return (\".*\"); \}", bf).group(1)))
        assert (meta.dtype, meta.acc, meta.name) == ("bf16", "fp32", kernel_name(bspec, bprob))
        # line by line: only lines holding a retyped word (or the name, the fields, C's type) differ
        diff = [(a, b) for a, b in zip(half.replace(spec.name, bspec.name).splitlines(),
                                       bf.replace("#include <cuda_bf16.h>\n", "").splitlines()) if a != b]
        assert len(half.splitlines()) + 1 == len(bf.splitlines())
        for a, b in diff:
            assert any(old in a for old, _new in _BF16_TEXT) or any(w in a for w in ("fp16 =", "acc=fp32", "gemmrl_meta")), (a, b)
    assert _retype("fp16", "anything") == "anything"
    with pytest.raises(ValueError, match="no element type"):
        _retype("fp8", "#include <cuda_fp16.h>\n")
    with pytest.raises(ValueError, match="not in the fp16 source"):
        _retype("bf16", "// no include here\n")


def test_the_pool_and_heuristic_take_the_problems_element_type():
    from gemmrl.search.policy import _raw_pool

    for problem in (Problem(65, 72, 4096, "bf16", "fp32"), Problem(65, 72, 4096)):
        for layout in ("NN", "TN"):
            specs = _raw_pool(problem, layout) + heuristic_specs(problem, layout)
            assert specs and {s.dtype for s in specs} == {problem.dtype}
            assert any(valid(s, problem) is None for s in specs)


def test_render_emits_only_what_the_spec_uses():
    split = render(*GOLDEN[0])
    plain = render(*GOLDEN[2])
    assert "arrive_is_last" in split and "arrive_is_last" not in plain
    assert "WORKSPACE_BYTES = 0ull" in plain
    assert "ldsm_x4_trans(t," in split and "ldsm_x4(t," not in split          # NN: B is N-contiguous
    tn = render(*GOLDEN[1])
    assert "ldsm_x4(t," in tn and "ldsm_x4_trans(t," not in tn
    f16 = render(S(acc="fp16"), Problem(64, 64, 4096, "fp16", "fp16"))
    assert "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" in f16
    assert "row.col.f32.f16.f16.f32" in split
    swapped = render(S(swap_ab=True), Problem(16, 256, 4096))
    assert "__shfl_xor_sync" in swapped and "static_cast<const __half*>(B), static_cast<const __half*>(A)" in swapped
    assert "c[1] = __float2half_rn(v1)" in render(S(layout="TN"), Problem(64, 71, 4096))  # odd N: scalar
    # the shared-memory epilogue: staged tile, 16-byte copies, a 16-byte aligned C; the default has none
    se = render(S(epi="smem"), P)
    assert "copy16_to_global(C + " in se and "C_ROWS = 64, C_COLS = 64" in se and "% 16 != 0) return 4;" in se
    assert "copy16_to_global" not in split and "C_ROWS" not in split and "(C) % 4 != 0) return 4;" in split
    assert "C_ROWS = 256, C_COLS = 16" in render(S(block_m=16, block_n=256, warps_m=1, warps_n=4, swap_ab=True,
                                                   epi="smem"), Problem(256, 16, 4096))


def test_the_smem_epilogue_fits_its_tile_of_c_in_shared_memory():
    """epi='smem' stages the CTA's tile of C (rows padded by 8 halves) in the pipeline's shared
    memory, or takes more where the tile is the larger (a big tile over a short block_k)."""
    small_k = S(block_m=128, block_n=128, block_k=16, warps_m=2, warps_n=4, stages=2)
    pipe = geometry(small_k, P).smem_bytes
    assert pipe < 128 * 136 * 2 == geometry(dataclasses.replace(small_k, epi="smem"), P).smem_bytes
    assert geometry(S(epi="smem"), P).smem_bytes == geometry(S(), P).smem_bytes  # the pipeline is the larger
    se = render(dataclasses.replace(small_k, epi="smem"), P)
    assert f"static_assert(SMEM_BYTES == {128 * 136 * 2}," in se


def _spec_grid():
    for bm, bn, bk, (wm, wn), st, sk, sw, lay, acc in itertools.product(
            (32, 64), (32, 64), (32, 64), ((1, 1), (2, 2)), (2, 4), (1, 4), (False, True),
            ("NN", "TN"), ("fp32", "fp16")):
        yield RawSpec(bm, bn, bk, wm, wn, st, sk, sw, lay, acc)
        if sk > 1:
            yield RawSpec(bm, bn, bk, wm, wn, st, sk, sw, lay, acc, "add")


def test_names_and_keys_are_unique_and_encode_every_field():
    specs = list(_spec_grid())
    assert len({s.name for s in specs}) == len(specs) == len({s.key() for s in specs})
    base = RawSpec(split_k=2)
    changes = {"block_m": 128, "block_n": 32, "block_k": 32, "warps_m": 4, "warps_n": 1,
               "stages": 4, "split_k": 4, "swap_ab": True, "layout": "TN", "acc": "fp16", "arrive": "add",
               "epi": "smem", "dtype": "bf16"}
    assert set(changes) == {f.name for f in dataclasses.fields(RawSpec)}
    # the default arrival and epilogue keep the names and keys every stored raw winner has
    assert RawSpec(split_k=2).name == "raw_nn_fp32_64x64x64_w2x2_s3_k2" and len(RawSpec().key()) == 11
    assert RawSpec(split_k=2, arrive="add", epi="smem").name == "raw_nn_fp32_64x64x64_w2x2_s3_k2_fa_se"
    assert RawSpec(split_k=2, dtype="bf16").name == "raw_nn_fp32_64x64x64_w2x2_s3_k2_bf16"
    # a stored spec (a dict from before the dtype field) reads back as the fp16 spec it was
    assert RawSpec(**{k: v for k, v in dataclasses.asdict(base).items() if k != "dtype"}) == base
    for field, value in changes.items():
        other = dataclasses.replace(base, **{field: value})
        assert other.name != base.name and other.key() != base.key(), field
    assert re.fullmatch(r"[a-z0-9_]+", base.name)


# -- golden sources --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,problem", GOLDEN, ids=GOLDEN_IDS)
def test_golden_source(spec, problem):
    path = GOLDEN_DIR / f"{kernel_name(spec, problem)}.cu"
    text = render(spec, problem)
    if os.environ.get("GEMMRL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with GEMMRL_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} changed: review the diff, then GEMMRL_UPDATE_GOLDEN=1"


# -- heuristic ---------------------------------------------------------------------------------------

HEUR_PROBLEMS = [Problem(64, 64, 12288), Problem(512, 64, 12288), Problem(64, 64, 128),
                 Problem(128, 64, 64), Problem(256, 4096, 512), Problem(1, 4096, 12288),
                 Problem(8, 4096, 4096), Problem(4096, 64, 8192), Problem(4096, 4096, 4096),
                 Problem(65, 72, 4104), Problem(64, 64, 4096, "fp16", "fp16")]


@pytest.mark.parametrize("problem", HEUR_PROBLEMS, ids=lambda p: f"{p.shape}-{p.acc}")
@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_heuristic_specs_are_valid_ranked_and_fill_the_gpu_on_skinny_shapes(problem, layout):
    specs = heuristic_specs(problem, layout)
    assert 1 <= len(specs) <= 6 and len(set(specs)) == len(specs)
    assert specs == heuristic_specs(problem, layout)
    for s in specs:
        assert valid(s, problem) is None and s.layout == layout and s.acc == problem.acc
    est = [estimate_us(s, problem) for s in specs]
    assert all(a <= b + 0.01 for a, b in zip(est, est[1:]))
    best = specs[0]
    g = geometry(best, problem)
    if min(problem.M, problem.N) <= 256 and problem.K >= 4096:
        assert g.tiles * best.split_k >= SM_COUNT, (best.name, g.tiles, best.split_k)
    if problem.M <= 16 and problem.N >= 1024:
        assert any(s.swap_ab or s.block_m == 16 for s in specs)


# the long-K small-MN shapes furthest behind cuBLASLt (results/shapes/worst-kernel-2026-11-22.txt)
LONG_K = [Problem(256, 256, 16384), Problem(128, 512, 16384)]


@pytest.mark.parametrize("problem", LONG_K, ids=lambda p: p.shape)
@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_long_k_small_mn_shapes_get_split_k_16_and_a_deep_split(problem, layout):
    specs = heuristic_specs(problem, layout)
    assert all(valid(s, problem) is None for s in specs)
    assert any(s.split_k >= 16 for s in specs[:3]), [s.name for s in specs]  # gemmrl build --top 3
    tuner = registry.get("raw").candidates(problem, layout, limit=8)        # what the tuner asks for
    assert any(s.split_k >= 16 for s in tuner) and any(is_deep_split(s, problem) for s in tuner)
    deep = [s for s in specs if is_deep_split(s, problem)]
    assert deep and geometry(deep[0], problem).tiles * deep[0].split_k >= 3 * SM_COUNT
    # the deep place is taken by the best-ranked deep spec, after everything the model prefers
    est = [estimate_us(s, problem) for s in specs]
    assert all(a <= b + 0.01 for a, b in zip(est, est[1:]))


@pytest.mark.parametrize("layout", ["NN", "TN"])
def test_deep_splits_are_valid_bounded_and_only_for_long_k(layout):
    for K in (64, 512, 1024, 4096, 16384, 65536):
        for (bm, bn), (wm, wn) in _WARPS.items():
            for bk in (32, 64, 128):
                problem = Problem(256, 256, K)
                tiles = -(-256 // bm) * -(-256 // bn)
                kt = -(-K // bk)
                splits = _splits(tiles, kt, bm * bn)
                assert splits[0] == 1 and len(set(splits)) == len(splits) <= 4
                base = splits[1] if len(splits) > 1 else 1
                for sk in splits:
                    spec = RawSpec(bm, bn, bk, wm, wn, 3, sk, False, layout, "fp32")
                    why = valid(spec, problem)
                    if why is not None:
                        assert "shared memory" in why, (spec.name, why)  # the only rule _splits leaves to valid()
                        continue
                    g = geometry(spec, problem)
                    assert sk == 1 or g.kt_per >= 2
                    if sk > base:  # a deep split: a long K loop each, a bounded serial reduction
                        assert g.kt_per >= DEEP_MIN_KT and sk * bm * bn * 4 <= MAX_REDUCE_BYTES, spec.name
                        assert (sk - 1) * g.kt_per < g.kt, spec.name
    # short K loops: nothing deeper than 8; long ones: 32 for 64x64 tiles (~4 CTAs per SM)
    assert max(s.split_k for s in heuristic_specs(Problem(256, 256, 512), layout)) <= 8
    assert 32 in _splits(16, 16384 // 64, 64 * 64) and max(_splits(16, 512 // 64, 64 * 64)) <= 4


def test_workspace_is_what_split_k_needs():
    for spec, problem in GOLDEN:
        g = geometry(spec, problem)
        ws = workspace_bytes(spec, problem)
        if spec.split_k == 1:
            assert ws == 0
        else:
            assert ws >= problem.M * problem.N * spec.split_k * 4 + 8 * g.tiles
            assert ws == g.counter_offset + 8 * g.tiles and g.counter_offset % 256 == 0


# -- a pure-Python model of the grid: who writes what, which K each split sums ---------------------

def _ev(expr: str, **env):
    """Evaluate one of the renderer's index expressions (C and Python agree on & >> * +)."""
    return eval(expr, {}, env)  # noqa: S307 - our own constant expressions


def _ldmatrix_elements(op: str, store: str):
    """(mn, k) each lane receives in each of the 4 registers (2 halves), per the PTX ISA:
    ldmatrix gives thread t row t/4, columns 2(t%4)+j of each 8x8 matrix i, whose row r is at
    the address of lane 8i+r; .trans gives row 2(t%4)+j, column t/4 of the stored matrix."""
    row_e, col_e = LDSM_ROW_COL[(op, store)]
    out = np.zeros((32, 4, 2, 2), dtype=int)  # lane, reg, half -> (mn, k)
    for t in range(32):
        for i in range(4):
            for j in range(2):
                if store == "K":  # stored [mn][k], plain
                    src = 8 * i + t // 4
                    mn, k = _ev(row_e, lane=src), _ev(col_e, lane=src) + 2 * (t % 4) + j
                else:             # stored [k][mn], transposed
                    src = 8 * i + 2 * (t % 4) + j
                    k, mn = _ev(row_e, lane=src), _ev(col_e, lane=src) + t // 4
                out[t, i, j] = (mn, k)
    return out


@pytest.mark.parametrize("op,store", sorted(LDSM_ROW_COL))
def test_ldmatrix_addressing_gives_the_mma_fragments(op, store):
    got = _ldmatrix_elements(op, store)
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            for j in range(2):
                if op == "P":   # a0..a7: rows g / g+8, k 2q+j / +8 (PTX m16n8k16 A fragment)
                    want = (g + 8 * (i & 1), 2 * q + j + 8 * (i >> 1))
                else:           # two n8 blocks: b0,b1 of block 0 then of block 1
                    want = (g + 8 * (i >> 1), 2 * q + j + 8 * (i & 1))
                assert tuple(got[t, i, j]) == want, (t, i, j)


MODEL_CASES = [
    (S(swap_ab=sw, layout=lay, split_k=sk, block_m=bm, block_n=bn, warps_m=wm, warps_n=wn, block_k=bk), Problem(M, N, K))
    for (sw, lay, sk, bm, bn, wm, wn, bk, M, N, K) in [
        (False, "NN", 1, 64, 64, 2, 2, 64, 64, 64, 128),
        (False, "NN", 8, 64, 64, 2, 2, 64, 65, 72, 4104),
        (True, "NN", 3, 64, 32, 2, 2, 64, 65, 72, 520),
        (False, "TN", 2, 32, 64, 1, 2, 32, 33, 71, 200),
        (True, "TN", 2, 64, 32, 2, 2, 64, 33, 71, 264),
        (True, "TN", 4, 64, 16, 4, 1, 32, 3, 136, 1000),
        (False, "NN", 1, 128, 128, 2, 4, 32, 130, 264, 96),
        (False, "TN", 5, 16, 16, 1, 1, 128, 17, 9, 1032),
    ]]


@pytest.mark.parametrize("spec,problem", MODEL_CASES, ids=[kernel_name(s, p) for s, p in MODEL_CASES])
def test_grid_model_covers_every_output_once_and_every_k_tile_once(spec, problem):
    assert valid(spec, problem) is None
    g = geometry(spec, problem)
    M, N = problem.M, problem.N
    S_, bm, bn, bk = spec.split_k, spec.block_m, spec.block_n, spec.block_k
    wtm, wtn = bm // spec.warps_m, bn // spec.warps_n
    lane = np.arange(32)
    writes = np.zeros((M, N), dtype=int)
    ktiles = np.zeros((g.tiles, g.kt), dtype=int)
    slots = set()
    for bid in range(g.tiles * S_):
        split, tile = bid % S_, bid // S_
        m0, n0 = (tile // g.tiles_n) * bm, (tile % g.tiles_n) * bn
        kt0 = split * g.kt_per
        nkt = min(g.kt, kt0 + g.kt_per) - kt0
        assert nkt >= 1
        ktiles[tile, kt0:kt0 + nkt] += 1
        if S_ > 1:
            lo = (tile * S_ + split) * bm * bn * 4
            assert lo + bm * bn * 4 <= g.counter_offset and lo not in slots
            slots.add(lo)
            if split != S_ - 1:
                continue  # one CTA per tile runs the epilogue: pretend the last split arrived last
        for warp in range(spec.warps_m * spec.warps_n):
            wm, wn = divmod(warp, spec.warps_n)
            for mi in range(wtm // 16):
                for ni in range(wtn // 8):
                    for h in range(2):
                        # D coordinates of v0 and v1 (accumulators 2h, 2h+1), from the shared exprs
                        gm = m0 + wm * wtm + mi * 16 + _ev(ACC_ROW, lane=lane, r=2 * h)
                        gn = n0 + wn * wtn + ni * 8 + _ev(ACC_COL, lane=lane, r=2 * h)
                        assert (gm == m0 + wm * wtm + mi * 16 + _ev(ACC_ROW, lane=lane, r=2 * h + 1)).all()
                        assert (gn + 1 == n0 + wn * wtn + ni * 8 + _ev(ACC_COL, lane=lane, r=2 * h + 1)).all()
                        v0, v1 = (gm, gn), (gm, gn + 1)
                        stores = []  # (C row, C col, D coords of the value, mask)
                        if not spec.swap_ab:
                            ok_m = gm < g.GM
                            stores += [(gm, gn, v0, ok_m & (gn < g.GN)), (gm, gn + 1, v1, ok_m & (gn + 1 < g.GN))]
                            if N % 2 == 0:  # the vector store writes both or neither
                                assert ((gn < g.GN) == (gn + 1 < g.GN)).all()
                        elif N % 2 == 0:    # swap, half2 along C rows after the lane^4 trade
                            odd = ((lane >> 2) & 1).astype(bool)
                            sender = lane ^ 4
                            # the sender (lane ^ 4) sends its v0 if it is odd, its v1 if even
                            o_m, o_n = gm[sender], np.where(odd, gn[sender] + 1, gn[sender])
                            row = np.where(odd, gn + 1, gn)
                            col = np.where(odd, gm - 1, gm)
                            lo_val = (np.where(odd, o_m, gm), np.where(odd, o_n, gn))
                            hi_val = (np.where(odd, gm, o_m), np.where(odd, gn + 1, o_n))
                            ok = (row < g.GN) & (col < g.GM)
                            assert (col % 2 == 0).all() and ((col < g.GM) == (col + 1 < g.GM)).all()
                            stores += [(row, col, lo_val, ok), (row, col + 1, hi_val, ok)]
                        else:               # swap, N odd: scalar C[gn][gm], C[gn+1][gm]
                            ok_m = gm < g.GM
                            stores += [(gn, gm, v0, ok_m & (gn < g.GN)), (gn + 1, gm, v1, ok_m & (gn + 1 < g.GN))]
                        for r, c, (dm, dn), mask in stores:
                            r, c, dm, dn = (np.broadcast_to(x, lane.shape)[mask] for x in (r, c, dm, dn))
                            assert (r < M).all() and (c < N).all() and (r >= 0).all() and (c >= 0).all()
                            # C[r][c] must receive D[r][c] (or D[c][r] when D = C^T)
                            if spec.swap_ab:
                                assert (dm == c).all() and (dn == r).all()
                            else:
                                assert (dm == r).all() and (dn == c).all()
                            np.add.at(writes, (r, c), 1)
    assert (writes == 1).all(), f"{(writes == 0).sum()} never written, {(writes > 1).sum()} written twice"
    assert (ktiles == 1).all()
    assert g.kt * bk >= problem.K > (g.kt - 1) * bk


@pytest.mark.parametrize("spec,problem", MODEL_CASES, ids=[kernel_name(s, p) for s, p in MODEL_CASES])
def test_loader_model_fills_each_stage_once_in_bounds_and_ldmatrix_is_conflict_free(spec, problem):
    g = geometry(spec, problem)
    threads = spec.threads
    for op, store, bmn, G, ld, stage in (("P", g.p_store, spec.block_m, g.GM, g.p_ld, g.p_stage),
                                         ("Q", g.q_store, spec.block_n, g.GN, g.q_ld, g.q_stage)):
        rows, cols = (bmn, spec.block_k) if store == "K" else (spec.block_k, bmn)
        assert rows * ld == stage and ld == cols + 8 and (ld * 2 // 16) % 2 == 1  # odd 16-byte pitch
        cpr, total = cols // 8, rows * cols // 8
        hit = np.zeros((rows, cols), dtype=int)
        for tid in range(threads):
            for i in range(-(-total // threads)):
                c = tid + i * threads
                if c < total:
                    r, c8 = c // cpr, (c % cpr) * 8
                    assert (r * ld + c8) * 2 % 16 == 0
                    hit[r, c8:c8 + 8] += 1
        assert (hit == 1).all()
        if store == "MN":  # a 16-byte chunk along M/N is all in bounds or all out
            assert G % 8 == 0
        # ldmatrix row addresses of every warp, block and k-step: inside the stage, 16-byte
        # aligned, and the 8 rows of each 8x8 matrix in 8 different 16-byte bank groups
        row_e, col_e = LDSM_ROW_COL[(op, store)]
        lane = np.arange(32)
        wt = bmn // (spec.warps_m if op == "P" else spec.warps_n)
        step = 16
        for w in range(bmn // wt):
            for blk in range(wt // step):
                for kk in range(spec.block_k // 16):
                    r_, c_ = _ev(row_e, lane=lane), _ev(col_e, lane=lane)
                    if store == "K":
                        addr = ((w * wt + blk * 16 + r_) * ld + kk * 16 + c_) * 2
                    else:
                        addr = ((kk * 16 + r_) * ld + w * wt + blk * 16 + c_) * 2
                    assert (addr % 16 == 0).all() and (addr + 16 <= stage * 2).all()
                    for m in range(4):
                        assert len(set((addr[8 * m:8 * m + 8] // 16) % 8)) == 8


# -- a real nvcc build of the golden kernels ---------------------------------------------------------

def _cuobjdump() -> str | None:
    from gemmrl.build.nvcc import nvcc_path

    found = shutil.which("cuobjdump")
    if found:
        return found
    for d in (Path(nvcc_path()).resolve().parent, Path("/usr/local/cuda/bin")):
        if (d / "cuobjdump").exists():
            return str(d / "cuobjdump")
    return None


@pytest.fixture(scope="module")
def golden_builds(tmp_path_factory):
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path

    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    cache = tmp_path_factory.mktemp("raw-builds")

    def build(case):
        spec, problem = case
        return build_shared(render(spec, problem), name=kernel_name(spec, problem), arch="sm_90a",
                            cache_dir=cache)

    with ThreadPoolExecutor(2) as ex:
        return dict(zip(GOLDEN_IDS, ex.map(build, GOLDEN)))


@pytest.mark.parametrize("name", GOLDEN_IDS)
def test_golden_kernel_builds_for_sm90a_without_spills_and_exports_the_abi(golden_builds, name):
    res = golden_builds[name]
    assert res.ok, res.log[-3000:]
    kernels = [k for k in res.resources if "gemmrl_raw_gemm" in k.name]
    assert len(kernels) == 1, res.resources
    k = kernels[0]
    assert res.spills == 0 and k.spill_stores == 0 and k.spill_loads == 0, k
    assert k.stack_bytes == 0 and 0 < k.registers <= 255, k
    print(f"{name}: {k.registers} registers, {k.smem_bytes} B static smem, "
          f"{geometry(*GOLDEN[GOLDEN_IDS.index(name)]).smem_bytes} B dynamic smem, {res.seconds:.1f} s")
    nm = subprocess.run(["nm", "-D", "--defined-only", res.path], capture_output=True, text=True,
                        check=True).stdout
    for sym in REQUIRED_SYMBOLS:
        assert re.search(rf"\sT\s{sym}$", nm, re.M), f"{sym} not exported:\n{nm}"


@pytest.mark.parametrize("name", GOLDEN_IDS)
def test_golden_kernel_loads_and_refuses_other_calls_before_touching_cuda(golden_builds, name):
    from gemmrl.runtime.abi import AbiKernel

    spec, problem = GOLDEN[GOLDEN_IDS.index(name)]
    kern = AbiKernel(golden_builds[name].path)  # the static CUDA runtime needs no driver to load
    assert (kern.meta.layout, kern.meta.acc, kern.meta.name) == (spec.layout, spec.acc, name)
    M, N, K = problem.M, problem.N, problem.K
    assert kern.workspace_bytes(M, N, K) == workspace_bytes(spec, problem)
    assert kern.workspace_bytes(M, N, K + 8) == 0
    ldb = K if spec.layout == "TN" else N
    fake = 1 << 20  # aligned addresses that are never dereferenced: each refusal comes first
    assert kern.run(fake, fake, fake, M, N + 8, K, K, ldb, N, fake, 0) == 1
    assert kern.run(fake, fake, fake, M, N, K, K, ldb + 8, N, fake, 0) == 2
    assert kern.run(0, fake, fake, M, N, K, K, ldb, N, fake, 0) == 3
    assert kern.run(fake + 8, fake, fake, M, N, K, K, ldb, N, fake, 0) == 4
    if spec.split_k > 1:
        assert kern.run(fake, fake, fake, M, N, K, K, ldb, N, 0, 0) == 5


DEEP = (RawSpec(64, 64, 64, 2, 2, 3, 32, False, "TN", "fp32"), Problem(256, 256, 16384))


def test_deep_split_kernel_builds_for_sm90a_without_spills(tmp_path):
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path

    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    spec, problem = DEEP
    assert valid(spec, problem) is None and is_deep_split(spec, problem)
    source = render(spec, problem)
    assert "SPLIT_K = 32" in source and "arrive_is_last" in source
    res = build_shared(source, name=kernel_name(spec, problem), arch="sm_90a", cache_dir=tmp_path)
    assert res.ok, res.log[-3000:]
    k = [k for k in res.resources if "gemmrl_raw_gemm" in k.name][0]
    assert res.spills == 0 and k.spill_stores == 0 and k.spill_loads == 0 and k.stack_bytes == 0, k
    from gemmrl.runtime.abi import AbiKernel

    kern = AbiKernel(res.path)
    assert kern.workspace_bytes(256, 256, 16384) == workspace_bytes(spec, problem) \
        == 16 * 32 * 64 * 64 * 4 + 8 * 16  # 16 tiles x 32 partials of 16 KiB, then the counters


def test_a_fetch_add_twin_differs_from_its_cas_twin_only_in_the_arrival_and_builds_alike(tmp_path):
    """arrive='add': the same kernel but for the arrival on the tile's counter (one fetch-add, after
    a CAS that tags a never-initialised word, instead of the CAS loop), built by nvcc for sm_90a
    with the CAS twin's registers and no spills; the default arrival renders what it always did."""
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path

    spec, problem = DEEP
    add = dataclasses.replace(spec, arrive="add")
    cas_src, add_src = render(spec, problem), render(add, problem)
    assert "arrive_is_last_add" not in cas_src and "ctr_seen" not in cas_src
    assert "atomicAdd(ctr, 1ull)" in add_src and "arrive_is_last_add(counters + tile, ctr_seen)" in add_src
    removed = [ln for ln in difflib.ndiff(cas_src.splitlines(), add_src.splitlines()) if ln.startswith("- ")]
    assert len(removed) == 4, removed  # the name (twice: comment and meta), the fields line, the arrival call
    assert kernel_name(add, problem).endswith("_k32_fa_256x256x16384") and workspace_bytes(add, problem) == \
        workspace_bytes(spec, problem)
    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    builds = [build_shared(src, name=kernel_name(s, problem), arch="sm_90a", cache_dir=tmp_path)
              for s, src in ((spec, cas_src), (add, add_src))]
    assert all(b.ok for b in builds), builds[1].log[-3000:]
    regs = []
    for b in builds:
        k = [k for k in b.resources if "gemmrl_raw_gemm" in k.name][0]
        assert b.spills == 0 and k.spill_stores == 0 and k.stack_bytes == 0, k
        regs.append(k.registers)
    assert regs[1] <= regs[0] + 2, regs


def test_a_smem_epilogue_twin_builds_for_sm90a_without_spills(tmp_path):
    """epi='smem': the direct twin's kernel up to its epilogue (staged through shared memory, then
    16-byte copies), built by nvcc for sm_90a without spills, for a plain tile, a swapped one and a
    fetch-add split-K; the ABI refuses a C that is not 16-byte aligned before touching CUDA."""
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path
    from gemmrl.runtime.abi import AbiKernel

    cases = [(S(block_m=16, block_n=32, warps_m=1, warps_n=2, stages=4, block_k=128, layout="TN"), Problem(1024, 128, 64)),
             (S(block_m=32, block_n=16, warps_m=2, warps_n=1, stages=4, block_k=128, swap_ab=True, layout="TN"),
              Problem(64, 1024, 512)),
             (S(block_m=16, block_n=32, warps_m=1, warps_n=2, stages=4, block_k=128, split_k=4, arrive="add",
                layout="TN", acc="fp16"), Problem(64, 128, 2048, "fp16", "fp16"))]
    for spec, problem in cases:
        direct, se = render(spec, problem), render(dataclasses.replace(spec, epi="smem"), problem)
        assert "C_ROWS" in se and "C_ROWS" not in direct
        loop = direct.split("  // prologue:", 1)[1].split("// ---- epilogue", 1)[0]
        assert loop in se  # the same main loop, to the letter
    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    for spec, problem in cases:
        se = dataclasses.replace(spec, epi="smem")
        res = build_shared(render(se, problem), name=kernel_name(se, problem), arch="sm_90a", cache_dir=tmp_path)
        assert res.ok, res.log[-3000:]
        k = [k for k in res.resources if "gemmrl_raw_gemm" in k.name][0]
        assert res.spills == 0 and k.spill_stores == 0 and k.stack_bytes == 0, k
        kern = AbiKernel(res.path)
        M, N, K = problem.M, problem.N, problem.K
        fake = 1 << 20
        assert kern.run(fake, fake, fake + 4, M, N, K, K, K, N, fake, 0) == 4  # C 4-byte but not 16-byte aligned


def test_bf16_kernels_build_for_sm90a_without_spills_and_say_bf16(tmp_path):
    """dtype='bf16', built by nvcc for sm_90a: a plain tile with residues, a swapped fetch-add split-K,
    a staged epilogue and the deepest split the heuristic offers a long-K shape; no spills, and the
    loaded library's meta says bf16 (what the harness reads to feed it bf16 inputs)."""
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path
    from gemmrl.runtime.abi import AbiKernel

    long_k = Problem(64, 64, 12288, "bf16", "fp32")
    cases = [(S(dtype="bf16"), Problem(72, 136, 96, "bf16", "fp32")),
             (S(block_n=32, split_k=3, swap_ab=True, arrive="add", dtype="bf16"), Problem(65, 72, 264, "bf16", "fp32")),
             (S(epi="smem", dtype="bf16", layout="TN"), Problem(512, 512, 256, "bf16", "fp32")),
             (max((s for s in heuristic_specs(long_k, "TN") if s.split_k > 1), key=lambda s: s.split_k), long_k)]
    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    for spec, problem in cases:
        assert spec.dtype == "bf16" and valid(spec, problem) is None
        res = build_shared(render(spec, problem), name=kernel_name(spec, problem), arch="sm_90a", cache_dir=tmp_path)
        assert res.ok, res.log[-3000:]
        k = [k for k in res.resources if "gemmrl_raw_gemm" in k.name][0]
        assert res.spills == 0 and k.spill_stores == 0 and k.stack_bytes == 0, k
        meta = AbiKernel(res.path).meta
        assert (meta.dtype, meta.acc, meta.name) == ("bf16", "fp32", kernel_name(spec, problem))


def test_golden_kernels_run_hmma_ldsm_and_cp_async_in_sass(golden_builds):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (neither on PATH, next to nvcc, nor in /usr/local/cuda/bin)")
    for name, res in golden_builds.items():
        assert res.ok
        run = subprocess.run([tool, "-sass", res.path], capture_output=True, text=True)
        if run.returncode and "nvdisasm" in run.stderr:
            pytest.skip("cuobjdump found but not nvdisasm, which it needs for -sass")
        assert run.returncode == 0, run.stderr
        sass = run.stdout
        assert "HMMA.16816.F32" in sass, name
        assert "LDSM" in sass and "LDGSTS" in sass, name


# -- the rendered kernel, compiled for the CPU and run through its own gemmrl_run --------------------

EMU_CASES = [
    (GOLDEN[0][0], Problem(64, 64, 1024)),                                  # golden 1, shorter K
    (GOLDEN[1][0], Problem(40, 64, 1024)),                                  # golden 2: M residue, 1 K tile a split
    (GOLDEN[2][0], Problem(72, 136, 96)),                                   # golden 3: M and N residues
    (S(block_n=32, split_k=3, swap_ab=True), Problem(65, 72, 264)),         # swap, NN, K tail
    (S(block_n=32, split_k=2, swap_ab=True, layout="TN"), Problem(33, 71, 264)),   # swap, odd N
    (S(block_m=32, block_k=32, warps_m=1, stages=4, layout="TN"), Problem(33, 71, 200)),  # odd N
    (S(block_n=32, split_k=2, swap_ab=True, acc="fp16"), Problem(65, 72, 256, "fp16", "fp16")),
    (S(layout="TN", acc="fp16"), Problem(100, 64, 64, "fp16", "fp16")),
    (S(block_m=32, block_n=32, stages=2, split_k=3, layout="TN"), Problem(65, 72, 392)),
    (S(block_n=16, block_k=32, warps_m=4, warps_n=1, split_k=2, swap_ab=True, layout="TN"), Problem(3, 136, 128)),
    (S(block_m=16, block_n=16, warps_m=1, warps_n=1, stages=4, split_k=4), Problem(40, 24, 512)),
    (S(block_m=128, block_n=64, block_k=32, warps_m=4, warps_n=2), Problem(130, 72, 64)),
    (S(block_k=32, stages=3, split_k=32, layout="TN"), Problem(72, 64, 2048)),    # deep split: 32 partials
    # the fetch-add arrival (arrive='add'): from a garbage workspace, blocks at once and shuffled
    (S(block_m=16, block_n=16, warps_m=1, warps_n=1, stages=4, split_k=4, arrive="add"), Problem(40, 24, 512)),
    (S(block_n=32, split_k=3, swap_ab=True, arrive="add"), Problem(65, 72, 264)),
    (S(block_k=32, stages=3, split_k=32, layout="TN", arrive="add"), Problem(72, 64, 2048)),
    # the shared-memory epilogue (epi='smem'): residues in M and N, swap_ab, split-K, fp16
    (S(epi="smem"), Problem(72, 136, 96)),
    (S(block_n=32, split_k=3, swap_ab=True, arrive="add", epi="smem"), Problem(65, 72, 264)),
    (S(block_m=16, block_n=32, warps_m=1, warps_n=2, stages=4, layout="TN", acc="fp16", epi="smem"),
     Problem(40, 24, 256, "fp16", "fp16")),
    (S(block_m=128, block_n=64, block_k=32, warps_m=4, warps_n=2, epi="smem"), Problem(130, 72, 64)),
    # the extremes of the tiles the raw pool now stages (raw.staged_epilogue; all 128 of its tile, swap,
    # layout and accumulator combinations passed a one-off sweep of this emulation, 2026-11-30)
    (S(block_m=128, block_n=128, block_k=64, warps_m=2, warps_n=4, swap_ab=True, layout="TN", epi="smem"),
     Problem(264, 264, 128)),
    (S(block_m=16, block_n=128, block_k=64, warps_m=1, warps_n=4, acc="fp16", epi="smem"),
     Problem(40, 264, 128, "fp16", "fp16")),
    # bf16 (2026-12-01): plain with residues, swapped NN split-K (fetch-add, lane trade), TN odd N, staged C
    (S(dtype="bf16"), Problem(72, 136, 96, "bf16", "fp32")),
    (S(block_n=32, split_k=3, swap_ab=True, arrive="add", dtype="bf16"), Problem(65, 72, 264, "bf16", "fp32")),
    (S(block_m=32, block_n=32, warps_m=2, warps_n=2, layout="TN", dtype="bf16"), Problem(33, 71, 200, "bf16", "fp32")),
    (S(block_n=32, swap_ab=True, epi="smem", dtype="bf16"), Problem(64, 72, 128, "bf16", "fp32")),
]
EMU_IDS = [kernel_name(s, p) for s, p in EMU_CASES]
# each call: inputs, cp.async applied lazily?, blocks run at once, block order (0 in order, -1 reversed, else a shuffle seed)
EMU_RUNS = [("exact", 0, 1, 0), ("random", 1, 2, 7), ("repeat", 0, 3, -1)]

_SURGERY = [  # (pattern, replacement, least matches): CUDA-only syntax to the CPU stand-in's
    (r"#include <cuda_fp16\.h>\n(#include <cuda_bf16\.h>\n)?#include <cuda_runtime\.h>\n", "", 1),
    (r"// ---- PTX wrappers: the only inline assembly ----\n.*?// ---- end of PTX wrappers ----\n", "", 1),
    (r"extern __shared__ __align__\(128\) unsigned char smem\[\];", "unsigned char* smem = emu_dynamic_smem();", 1),
    (r"__shared__ int (\w+);", r"int& \1 = emu_block_int();", 0),
    (r"(\w+)<<<(.*?)>>>\(", r"emu_launch(\1, emu_cfg(\2), ", 1),
]


def cpu_source(source: str) -> str:
    bf16 = "#include <cuda_bf16.h>" in source  # the stand-in reads bf16 fragments and writes bf16 NaNs
    for pattern, repl, least in _SURGERY:
        source, n = re.subn(pattern, repl, source, flags=re.S)
        assert n >= least, f"the CPU stand-in no longer matches the rendered source: {pattern}"
    assert "asm" not in source and "__shared__" not in source
    return ("#define EMU_BF16 1\n" if bf16 else "") + EMU_SHIM + source + EMU_DRIVER


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as bf16 bit patterns (uint16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32, exactly."""
    return (u.astype(np.uint32) << 16).view(np.float32)


# planted bugs the emulation must catch: (id, case, text in the source, its replacement)
_MUT = (S(block_n=32, split_k=2, swap_ab=True), Problem(40, 64, 256))  # NN swap: .trans, lane trade, split-K
_MUT_ADD = (S(block_m=16, block_n=16, warps_m=1, warps_n=1, split_k=4, arrive="add"), Problem(40, 24, 512))
MUTANTS = [
    ("wait-one-group-too-few", _MUT, "cp_async_wait<STAGES - 2>();", "cp_async_wait<STAGES - 1>();"),
    ("trans-fragment-column", _MUT, "(((lane >> 3) & 1) * 8)) * 2u);", "0) * 2u);"),
    ("swap-trade-wrong-value", _MUT, "odd ? v0 : v1, 4)", "odd ? v1 : v0, 4)"),
    ("split-k-sum-skips-last", _MUT, "s < SPLIT_K; ++s)", "s < SPLIT_K - 1; ++s)"),
    ("k-tail-unpredicated", (S(layout="TN"), Problem(40, 64, 200)), "(FULL_K || gk < K)", "true"),
    # the fetch-add arrival without its fix of an untagged (garbage) word, and without its reset
    ("add-adds-to-garbage", _MUT_ADD, "if ((seen >> 16) != TAG) atomicCAS(ctr, seen, TAG << 16);", ""),
    ("add-never-resets", _MUT_ADD, "if (last) atomicExch(ctr, TAG << 16);", ""),
    # the shared-memory epilogue: copies past C's last row, and stages a swapped tile unswapped
    ("smem-copy-unguarded-rows", (S(epi="smem"), Problem(72, 136, 96)), "(FULL_M || r0 + r < M)", "true"),
    ("smem-swap-staged-unswapped", (S(block_n=32, swap_ab=True, epi="smem"), Problem(64, 72, 128)),
     "cs[ln * C_LD + lm] = __float2half_rn(v0);", "cs[lm * C_LD + ln] = __float2half_rn(v0);"),
]


def _emulate(case, root: Path, gxx: str, mutation: tuple[str, str] | None = None, tag: str = "") -> dict:
    spec, problem = case
    M, N, K = problem.M, problem.N, problem.K
    d = root / (kernel_name(spec, problem) + tag)
    d.mkdir()
    source = render(spec, problem)
    if mutation:
        assert mutation[0] in source, mutation
        source = source.replace(mutation[0], mutation[1])
    (d / "k.cpp").write_text(cpu_source(source))
    cc = subprocess.run([gxx, "-std=c++20", "-O1", "-pthread", "-w", "-fno-strict-aliasing", "k.cpp",
                         "-o", "k"], cwd=d, capture_output=True, text=True, timeout=600)
    if cc.returncode:
        return {"error": "g++ failed:\n" + cc.stderr[-4000:]}
    rng = np.random.default_rng(zlib.crc32(kernel_name(spec, problem).encode()))
    inputs = []
    bf16 = problem.dtype == "bf16"  # inputs exact in bf16, kept as float32; files hold the bit patterns
    elem = (lambda x: from_bf16(to_bf16(x))) if bf16 else (lambda x: x.astype(np.float16))
    store = to_bf16 if bf16 else (lambda x: x)
    for i, (kind, lazy, conc, order) in enumerate(EMU_RUNS):
        if kind == "exact":
            a = elem((rng.random((M, K)) < 0.1).astype(np.float32))
            b = elem((rng.random((K, N)) < 0.1).astype(np.float32))
        elif kind == "random":
            a = elem(rng.standard_normal((M, K)))
            b = elem(rng.standard_normal((K, N)))
        inputs.append((a, b))
        store(a).tofile(d / f"a{i}.bin")
        store(np.ascontiguousarray(b.T) if spec.layout == "TN" else b).tofile(d / f"b{i}.bin")
        (d / f"run{i}.txt").write_text(f"{lazy} {conc} {order}\n")
    run = subprocess.run([str(d / "k"), str(d), str(len(EMU_RUNS))], capture_output=True, text=True,
                         timeout=600)
    out = {"rc": run.returncode, "stdout": run.stdout, "stderr": run.stderr[-4000:], "inputs": inputs}
    if run.returncode == 0:
        read = (lambda f: from_bf16(np.fromfile(f, dtype=np.uint16))) if bf16 else \
            (lambda f: np.fromfile(f, dtype=np.float16))
        out["outs"] = [read(d / f"c{i}.bin").reshape(M, N) for i in range(len(EMU_RUNS))]
    return out


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    gxx = shutil.which("g++")
    if not gxx:
        pytest.skip("g++ not found")
    root = tmp_path_factory.mktemp("raw-emu")
    jobs = [(c, None, "") for c in EMU_CASES] + [(c, (a, b), "-" + m) for m, c, a, b in MUTANTS]
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda j: _emulate(j[0], root, gxx, j[1], j[2]), jobs))
    return dict(zip(EMU_IDS + [m[0] for m in MUTANTS], results))


def _lines(stdout: str, tag: str) -> list[list[str]]:
    return [ln.split()[1:] for ln in stdout.splitlines() if ln.startswith(tag + " ")] + \
        [[] for ln in stdout.splitlines() if ln == tag]


@pytest.mark.parametrize("spec,problem", EMU_CASES, ids=EMU_IDS)
def test_emulated_kernel_computes_the_product(emulated, spec, problem):
    r = emulated[kernel_name(spec, problem)]
    assert "error" not in r, r.get("error")
    assert r["rc"] == 0 and "EMU FAIL" not in r["stderr"], r["stderr"]
    out = r["stdout"]
    meta = KernelMeta.parse(out.split("META ", 1)[1].splitlines()[0])
    assert (meta.layout, meta.acc, meta.name) == (spec.layout, spec.acc, kernel_name(spec, problem))
    assert meta.dtype == problem.dtype
    assert _lines(out, "WS") == [[str(workspace_bytes(spec, problem)), "0"]]
    assert _lines(out, "RC") == [["0"]] * len(EMU_RUNS)
    outs, inputs = r["outs"], r["inputs"]
    for o in outs:
        assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} outputs never written"
    (a0, b0), (a1, b1) = inputs[0], inputs[1]
    exact = a0.astype(np.float64) @ b0.astype(np.float64)
    assert np.array_equal(outs[0].astype(np.float64), exact), f"{(outs[0] != exact).sum()} wrong"
    ref = a1.astype(np.float64) @ b1.astype(np.float64)
    err = np.linalg.norm(outs[1].astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < (1e-3 if (spec.acc, spec.dtype) == ("fp32", "fp16") else 1e-2), err  # bf16 keeps 8 bits
    # same inputs, other block order and cp.async timing: bit-identical (split-K sums in split order)
    assert np.array_equal(outs[1].view(np.uint8), outs[2].view(np.uint8))


@pytest.mark.parametrize("mutant", [m[0] for m in MUTANTS])
def test_emulation_catches_planted_bugs(emulated, mutant):
    r = emulated[mutant]
    assert "error" not in r, r.get("error")
    if r["rc"] != 0:
        return  # the stand-in refused it (e.g. a read outside A/B)
    (a0, b0), (a1, b1) = r["inputs"][:2]
    exact = a0.astype(np.float64) @ b0.astype(np.float64)
    ref = a1.astype(np.float64) @ b1.astype(np.float64)
    o0, o1 = (o.astype(np.float64) for o in r["outs"][:2])
    wrong = not np.array_equal(o0, exact) or not np.isfinite(o1).all() or \
        np.linalg.norm(o1 - ref) / np.linalg.norm(ref) > 1e-3
    assert wrong, f"planted bug {mutant} went unnoticed"


@pytest.mark.parametrize("spec,problem", EMU_CASES, ids=EMU_IDS)
def test_emulated_abi_refuses_guards_and_resets_counters(emulated, spec, problem):
    r = emulated[kernel_name(spec, problem)]
    assert "error" not in r and r["rc"] == 0, r.get("error") or r["stderr"]
    out = r["stdout"]
    split = spec.split_k > 1
    # other M; other lda; misaligned A; (no workspace | other ldb); null A
    assert _lines(out, "REJECT") == [["1", "2", "4", "5" if split else "2", "3"]]
    assert _lines(out, "UNTOUCHED") == [["1"]] and _lines(out, "GUARDS") == [["1"]]
    assert _lines(out, "CONFLICTS") == [["0"]], "ldmatrix bank conflicts"
    counters = _lines(out, "COUNTERS")[0]
    g = geometry(spec, problem)
    assert counters == ([f"{COUNTER_TAG << 16:x}"] * g.tiles if split else [])


EMU_SHIM = r'''// A CPU stand-in for the CUDA features a raw-family kernel uses: one OS thread per GPU thread,
// std::barrier for __syncthreads and warp collectives, ldmatrix / mma.m16n8k16 / shfl emulated
// from the PTX ISA's fragment layouts, cp.async applied at issue ('eager') or at wait_group
// ('lazy'), shared memory filled with fp16 NaNs, global accesses of the helpers range-checked.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(x)
using std::max;
using std::min;

[[noreturn]] inline void emu_fail(const char* what) {
  std::fprintf(stderr, "EMU FAIL: %s\n", what);
  std::fflush(stderr);
  std::_Exit(3);
}

struct __half { uint16_t x; };
struct __half2 { __half x, y; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline __half __float2half_rn(float f) {
  _Float16 h = (_Float16)f;
  __half r;
  std::memcpy(&r, &h, 2);
  return r;
}
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return (float)f;
}
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {  // nearest even (the kernels convert only finite sums)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return {uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
#ifdef EMU_BF16
constexpr unsigned char EMU_NAN_LO = 0xC0, EMU_NAN_HI = 0x7F;  // bf16 NaN 0x7FC0
#else
constexpr unsigned char EMU_NAN_LO = 0x7E, EMU_NAN_HI = 0x7E;  // fp16 NaN 0x7E7E
#endif

typedef void* cudaStream_t;
typedef int cudaError_t;
constexpr int cudaSuccess = 0;
constexpr int cudaFuncAttributeMaxDynamicSharedMemorySize = 8;
static int g_smem_optin = 48 * 1024;
template <class F>
inline cudaError_t cudaFuncSetAttribute(F, int, int v) { g_smem_optin = v; return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
static int g_launch_error = 0;
inline cudaError_t cudaGetLastError() { int e = g_launch_error; g_launch_error = 0; return e; }

struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;

struct Region { const unsigned char* lo; size_t n; };
static std::vector<Region> g_global;  // buffers the kernel may touch
inline void check_global(const void* p, size_t n, const char* what) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (const Region& r : g_global)
    if (c >= r.lo && c + n <= r.lo + r.n) return;
  emu_fail(what);
}

struct Block {
  std::vector<unsigned char> smem;
  std::barrier<> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<uint32_t> xchg;  // [warp][lane][16]
  int shared_int = 0;
  std::atomic<long> conflicts{0};
  Block(int threads, size_t smem_bytes) : smem(smem_bytes + 16), bar(threads), xchg(threads * 16) {
    for (size_t i = 0; i + 1 < smem.size(); i += 2) { smem[i] = EMU_NAN_LO; smem[i + 1] = EMU_NAN_HI; }  // NaN
    for (int w = 0; w < (threads + 31) / 32; ++w) warp_bar.emplace_back(new std::barrier<>(min(32, threads - 32 * w)));
  }
};
thread_local Block* tl_block = nullptr;
static int g_lazy = 0;        // cp.async: 0 applied at issue, 1 applied at wait_group
static long g_conflicts = 0;  // ldmatrix phases whose 8 rows share a 16-byte bank group
static std::mutex g_mu;

inline void __syncthreads() { tl_block->bar.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int emu_lane() { return threadIdx.x & 31; }
inline uint32_t* emu_slot(int lane) { return &tl_block->xchg[((threadIdx.x >> 5) * 32 + lane) * 16]; }
inline void emu_warp_sync() { tl_block->warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<const unsigned char*>(p) - tl_block->smem.data();
}
inline unsigned char* emu_dynamic_smem() { return tl_block->smem.data(); }
inline int& emu_block_int() { return tl_block->shared_int; }

inline void __stcg(float4* p, float4 v) { check_global(p, 16, "__stcg outside the workspace"); *p = v; }
static Region g_c;  // C: the only buffer copy16_to_global (epi='smem') may write
inline void copy16_to_global(void* dst, const void* src) {  // __half or __nv_bfloat16
  const unsigned char* d = reinterpret_cast<const unsigned char*>(dst);
  if (reinterpret_cast<uintptr_t>(dst) % 16 || d < g_c.lo || d + 16 > g_c.lo + g_c.n)
    emu_fail("copy16_to_global: outside C or misaligned");
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  if (s < tl_block->smem.data() || s + 16 > tl_block->smem.data() + tl_block->smem.size() - 16)
    emu_fail("copy16_to_global: source outside shared memory");
  std::memcpy(dst, src, 16);
}
inline float4 __ldcg(const float4* p) { check_global(p, 16, "__ldcg outside the workspace"); return *p; }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
  check_global(p, 8, "atomicCAS outside the workspace");
  return __sync_val_compare_and_swap(p, c, v);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  check_global(p, 8, "atomicAdd outside the workspace");
  return __sync_fetch_and_add(p, v);
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  check_global(p, 8, "atomicExch outside the workspace");
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  std::memcpy(emu_slot(emu_lane()), &v, 4);
  emu_warp_sync();
  float o;
  std::memcpy(&o, emu_slot(emu_lane() ^ mask), 4);
  emu_warp_sync();
  return o;
}

// cp.async: per-thread open group and committed groups
struct Copy { uint32_t dst; unsigned char data[16]; };
thread_local std::vector<Copy> tl_open;
thread_local std::vector<std::vector<Copy>> tl_groups;
inline void emu_apply(const Copy& c) { std::memcpy(&tl_block->smem[c.dst], c.data, 16); }
inline void cp_async16(uint32_t dst, const void* src, bool pred) {
  if (dst % 16 || dst + 16 > tl_block->smem.size() - 16) emu_fail("cp.async: bad shared address");
  Copy c{dst, {}};
  if (pred) {
    if (reinterpret_cast<uintptr_t>(src) % 16) emu_fail("cp.async: source not 16-byte aligned");
    check_global(src, 16, "cp.async reads outside A/B");
    std::memcpy(c.data, src, 16);
  }
  if (g_lazy) tl_open.push_back(c); else emu_apply(c);
}
inline void cp_async_commit() { tl_groups.push_back(std::move(tl_open)); tl_open.clear(); }
template <int PENDING>
inline void cp_async_wait() {
  while ((int)tl_groups.size() > PENDING) {
    for (const Copy& c : tl_groups.front()) emu_apply(c);
    tl_groups.erase(tl_groups.begin());
  }
}

inline void emu_ldsm(uint32_t (&r)[4], uint32_t addr, bool trans) {
  if (addr % 16 || addr + 16 > tl_block->smem.size() - 16) emu_fail("ldmatrix: bad row address");
  const int lane = emu_lane();
  emu_slot(lane)[0] = addr;
  emu_warp_sync();
  if (lane == 0)
    for (int m = 0; m < 4; ++m) {
      unsigned used = 0;
      for (int j = 0; j < 8; ++j) used |= 1u << ((emu_slot(8 * m + j)[0] / 16) % 8);
      if (used != 0xFFu) tl_block->conflicts++;
    }
  for (int m = 0; m < 4; ++m) {
    uint16_t e[2];
    for (int j = 0; j < 2; ++j) {
      const int row = trans ? 2 * (lane % 4) + j : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + j;
      std::memcpy(&e[j], &tl_block->smem[emu_slot(8 * m + row)[0] + 2 * col], 2);
    }
    r[m] = e[0] | (uint32_t(e[1]) << 16);
  }
  emu_warp_sync();
}
inline void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu_ldsm(r, addr, true); }

#ifdef EMU_BF16  // the operands' 16-bit elements as the kernel's element type
inline float emu_lo(uint32_t u) { __nv_bfloat16 h; h.x = u & 0xFFFF; return __bfloat162float(h); }
inline float emu_hi(uint32_t u) { __nv_bfloat16 h; h.x = u >> 16; return __bfloat162float(h); }
#else
inline float emu_lo(uint32_t u) { __half h; h.x = u & 0xFFFF; return __half2float(h); }
inline float emu_hi(uint32_t u) { __half h; h.x = u >> 16; return __half2float(h); }
#endif
// A (16x16, row) and B (16x8, col) of a warp's mma from every lane's fragment registers
inline void emu_mma_operands(const uint32_t (&a)[4], uint32_t b0, uint32_t b1, float (&A)[16][16], float (&B)[16][8]) {
  uint32_t* s = emu_slot(emu_lane());
  for (int i = 0; i < 4; ++i) s[i] = a[i];
  s[4] = b0; s[5] = b1;
  emu_warp_sync();
  for (int l = 0; l < 32; ++l) {
    const uint32_t* t = emu_slot(l);
    const int g = l / 4, q = l % 4;
    A[g][2 * q] = emu_lo(t[0]);         A[g][2 * q + 1] = emu_hi(t[0]);
    A[g + 8][2 * q] = emu_lo(t[1]);     A[g + 8][2 * q + 1] = emu_hi(t[1]);
    A[g][2 * q + 8] = emu_lo(t[2]);     A[g][2 * q + 9] = emu_hi(t[2]);
    A[g + 8][2 * q + 8] = emu_lo(t[3]); A[g + 8][2 * q + 9] = emu_hi(t[3]);
    B[2 * q][g] = emu_lo(t[4]);         B[2 * q + 1][g] = emu_hi(t[4]);
    B[2 * q + 8][g] = emu_lo(t[5]);     B[2 * q + 9][g] = emu_hi(t[5]);
  }
  emu_warp_sync();
}
inline float emu_dot(const float (&A)[16][16], const float (&B)[16][8], int row, int col) {
  float s = 0.0f;
  for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
  return s;
}
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  float A[16][16], B[16][8];
  emu_mma_operands(a, b0, b1, A, B);
  const int g = emu_lane() / 4, q = emu_lane() % 4;
  for (int r = 0; r < 4; ++r) d[r] += emu_dot(A, B, g + (r >> 1) * 8, 2 * q + (r & 1));
}
inline void mma(uint32_t (&d)[2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  float A[16][16], B[16][8];
  emu_mma_operands(a, b0, b1, A, B);
  const int g = emu_lane() / 4, q = emu_lane() % 4;
  for (int h = 0; h < 2; ++h) {
    const float lo = emu_lo(d[h]) + emu_dot(A, B, g + 8 * h, 2 * q);
    const float hi = emu_hi(d[h]) + emu_dot(A, B, g + 8 * h, 2 * q + 1);
    d[h] = __float2half_rn(lo).x | (uint32_t(__float2half_rn(hi).x) << 16);
  }
}
inline float2 h2_to_f2(uint32_t u) { return {emu_lo(u), emu_hi(u)}; }

// <<<grid, block, smem, stream>>> becomes emu_launch(kernel, emu_cfg(grid, block, smem, stream), ...)
struct EmuCfg { unsigned grid, block; size_t smem; };
inline EmuCfg emu_cfg(unsigned grid, unsigned block, size_t smem, cudaStream_t) { return {grid, block, smem}; }
static std::vector<unsigned> g_order;  // block order (a permutation of the grid); empty: 0..grid-1
static int g_concurrent = 1;           // blocks run at once
template <class K, class... Args>
void emu_launch(K kernel, EmuCfg cfg, Args... args) {
  if (cfg.smem > (size_t)max(g_smem_optin, 48 * 1024)) { g_launch_error = 1; return; }
  if (cfg.block == 0 || cfg.block > 1024 || cfg.block % 32) { g_launch_error = 9; return; }
  std::vector<unsigned> order = g_order;
  if (order.size() != cfg.grid) { order.resize(cfg.grid); for (unsigned i = 0; i < cfg.grid; ++i) order[i] = i; }
  for (size_t w = 0; w < order.size(); w += g_concurrent) {
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<std::thread> threads;
    for (size_t b = w; b < min(order.size(), w + g_concurrent); ++b) {
      blocks.emplace_back(new Block(cfg.block, cfg.smem));
      Block* blk = blocks.back().get();
      for (unsigned t = 0; t < cfg.block; ++t)
        threads.emplace_back([=]() {
          tl_block = blk;
          threadIdx.x = t;
          blockIdx.x = order[b];
          tl_open.clear();
          tl_groups.clear();
          kernel(args...);
          for (auto& grp : tl_groups) if (!grp.empty()) emu_fail("cp.async copies never waited for");
          if (!tl_open.empty()) emu_fail("cp.async copies never committed");
        });
    }
    for (auto& th : threads) th.join();
    for (auto& b : blocks) g_conflicts += b->conflicts;
  }
}
'''

EMU_DRIVER = r'''// driver: calls gemmrl_run like the harness, on the CPU stand-in of the device.
// argv: dir calls — reads dir/a<i>.bin, dir/b<i>.bin, dir/run<i>.txt ("lazy concurrent seed"),
// writes dir/c<i>.bin; prints META, WS, RC, REJECT, GUARDS and CONFLICTS lines.
#include <fstream>
#include <string>

static const size_t kGuard = 4096;
struct Guarded {
  std::vector<unsigned char> mem;
  unsigned char* p;
  size_t n;
  explicit Guarded(size_t bytes) : mem(bytes + 2 * kGuard + 256), n(bytes) {
    uintptr_t base = reinterpret_cast<uintptr_t>(mem.data()) + kGuard;
    p = reinterpret_cast<unsigned char*>((base + 255) / 256 * 256);
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = (unsigned char)(i * 131 + 7);
  }
  bool guards_ok() const {
    for (size_t i = 0; i < mem.size(); ++i) {
      const unsigned char* q = mem.data() + i;
      if (q >= p && q < p + n) continue;
      if (mem[i] != (unsigned char)(i * 131 + 7)) return false;
    }
    return true;
  }
};

static void read_into(const std::string& path, unsigned char* dst, size_t n) {
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(dst), n);
  if ((size_t)f.gcount() != n) emu_fail("short input file");
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string dir = argv[1];
  const int calls = std::atoi(argv[2]);
  using namespace raw;
  std::printf("META %s\n", gemmrl_meta());
  const size_t ws_bytes = gemmrl_workspace_bytes(M, N, K);
  std::printf("WS %zu %zu\n", ws_bytes, gemmrl_workspace_bytes(M + 1, N, K));
  const size_t a_bytes = (size_t)M * K * 2, b_bytes = (size_t)K * N * 2, c_bytes = (size_t)M * N * 2;
  Guarded A(a_bytes), B(b_bytes), C(c_bytes), W(max<size_t>(ws_bytes, 16));
  std::mt19937_64 rng(12345);
  for (size_t i = 0; i < W.n; ++i) W.p[i] = (unsigned char)rng();  // a workspace of garbage
  g_global = {{A.p, a_bytes}, {B.p, b_bytes}, {W.p, W.n}};
  g_c = {C.p, c_bytes};
  for (int i = 0; i < calls; ++i) {
    read_into(dir + "/a" + std::to_string(i) + ".bin", A.p, a_bytes);
    read_into(dir + "/b" + std::to_string(i) + ".bin", B.p, b_bytes);
    int lazy = 0, conc = 1;
    long seed = 0;
    std::ifstream cfg(dir + "/run" + std::to_string(i) + ".txt");
    cfg >> lazy >> conc >> seed;
    g_lazy = lazy;
    g_concurrent = max(1, conc);
    g_order.clear();
    if (seed) {
      g_order.resize(TILES * SPLIT_K);
      for (size_t j = 0; j < g_order.size(); ++j) g_order[j] = (unsigned)j;
      if (seed < 0) std::reverse(g_order.begin(), g_order.end());
      else std::shuffle(g_order.begin(), g_order.end(), std::mt19937_64(seed));
    }
    for (size_t j = 0; j + 1 < c_bytes; j += 2) { C.p[j] = EMU_NAN_LO; C.p[j + 1] = EMU_NAN_HI; }  // NaN poison
    const int rc = gemmrl_run(A.p, B.p, C.p, M, N, K, LDA, LDB, LDC, W.p, nullptr);
    std::printf("RC %d\n", rc);
    std::ofstream out(dir + "/c" + std::to_string(i) + ".bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(C.p), c_bytes);
  }
  // calls it must refuse, launching nothing (C keeps its last contents)
  std::vector<unsigned char> before(C.p, C.p + c_bytes);
  std::printf("REJECT %d %d %d %d %d\n",
              gemmrl_run(A.p, B.p, C.p, M + 1, N, K, LDA, LDB, LDC, W.p, nullptr),
              gemmrl_run(A.p, B.p, C.p, M, N, K, LDA + 8, LDB, LDC, W.p, nullptr),
              gemmrl_run(A.p + 2, B.p, C.p, M, N, K, LDA, LDB, LDC, W.p, nullptr),
              ws_bytes ? gemmrl_run(A.p, B.p, C.p, M, N, K, LDA, LDB, LDC, nullptr, nullptr)
                       : gemmrl_run(A.p, B.p, C.p, M, N, K, LDA, LDB + 8, LDC, W.p, nullptr),
              gemmrl_run(nullptr, B.p, C.p, M, N, K, LDA, LDB, LDC, W.p, nullptr));
  std::printf("UNTOUCHED %d\n", (int)std::equal(before.begin(), before.end(), C.p));
  std::printf("GUARDS %d\n", (int)(A.guards_ok() && B.guards_ok() && C.guards_ok() && W.guards_ok()));
  std::printf("CONFLICTS %ld\n", g_conflicts);
  std::printf("COUNTERS");
  if (WORKSPACE_BYTES > 0)
    for (int t = 0; t < TILES; ++t)
      std::printf(" %llx", reinterpret_cast<const unsigned long long*>(W.p + COUNTER_OFFSET)[t]);
  std::printf("\n");
  return 0;
}
'''
