"""The CUTLASS sm90 family on the CPU: the legality statement, the spec space, the renderer
(deterministic, golden files) and real nvcc builds of two specs (no GPU needed).

Regenerate the golden sources after an intended renderer change with
    GEMMRL_UPDATE_GOLDEN=1 python -m pytest tests/test_cutlass_sm90.py -k golden
and review the diff: it is every change the refactor makes to a kernel.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path

import pytest

from gemmrl.core.problem import Problem
from gemmrl.space import cutlass_sm90 as cs
from gemmrl.space.cutlass_sm90 import CutlassSpec, enumerate_specs, estimate_us, render, skinny_n, valid

GOLDEN = Path(__file__).resolve().parent / "golden" / "cutlass_sm90"
GOLDEN_SPECS = [
    CutlassSpec(128, 256, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32"),
    CutlassSpec(64, 128, 64, 1, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp16"),
    CutlassSpec(128, 128, 64, 1, 1, "cooperative", "streamk", 1, 0, "heuristic", 1, "TN", "bf16", "fp32"),
    # split-K with the separate reduction: fp32 partials (its text is the build-cache key of every
    # fp32 winner of this kind) and fp16 partials of an fp16 accumulator
    CutlassSpec(128, 128, 64, 1, 1, "cooperative", "splitk", 8, 0, "heuristic", 1, "TN", "fp16", "fp32", "separate"),
    CutlassSpec(64, 64, 64, 1, 1, "pingpong", "splitk", 16, 0, "heuristic", 1, "NN", "fp16", "fp16", "separate"),
]
BASE = CutlassSpec()  # 128x128x64 cooperative persistent, TN fp16 -> fp32 accumulate


# -- names and keys ------------------------------------------------------------------------------

def test_name_encodes_every_field_and_parses_back():
    s = GOLDEN_SPECS[0]
    assert s.name == "sm90_coop_128x256x64_c2x1_persist_s0_rh_sw1_nn_f16_f32"
    assert GOLDEN_SPECS[1].name == "sm90_pp_64x128x64_c1x1_persist_s0_rh_sw1_tn_f16_f16"
    sk = replace(BASE, scheduler="splitk", splits=4, stages=3, raster="along_n", swizzle=8, dtype="bf16")
    assert sk.name == "sm90_coop_128x128x64_c1x1_splitk4_s3_rn_sw8_tn_bf16_f32"
    ns = replace(GOLDEN_SPECS[1], epilogue="nosmem")
    assert ns.name == "sm90_pp_64x128x64_c1x1_persist_s0_rh_sw1_tn_f16_f16_nosmem"
    pdl = replace(ns, pdl=True)
    assert pdl.name == "sm90_pp_64x128x64_c1x1_persist_s0_rh_sw1_tn_f16_f16_nosmem_pdl"
    assert replace(BASE, pdl=True).name.endswith("_tn_f16_f32_pdl")
    for spec in (*GOLDEN_SPECS, sk, ns, pdl, replace(BASE, pdl=True)):
        assert CutlassSpec.from_name(spec.name) == spec
    with pytest.raises(ValueError, match="not a cutlass_sm90 kernel name"):
        CutlassSpec.from_name("sm90_coop_128x128")


def test_lean_kernels_names_and_rules():
    ws = CutlassSpec(64, 64, 64, 1, 2, "ws", "tile", layout="NN")
    assert ws.name == "sm90_ws_64x64x64_c1x2_tile_s0_rh_sw1_nn_f16_f32"
    tma = CutlassSpec(128, 64, 64, 2, 1, "tma", "tile", epilogue="nosmem")
    assert tma.name == "sm90_tma_128x64x64_c2x1_tile_s0_rh_sw1_tn_f16_f32_nosmem"
    for spec in (ws, tma, replace(ws, epilogue="nosmem"), replace(ws, stages=4)):
        assert valid(spec) is None, valid(spec)
        assert CutlassSpec.from_name(spec.name) == spec
    # one MMA warpgroup holds the whole tile: 128 rows at most, and its accumulators are counted
    # over 128 threads (128x192 fp32: 192 registers, the limit; 128x224 over it)
    assert "tile_m must be 64 or 128" in valid(replace(ws, tile_m=256))
    assert cs.mma_threads(ws) == cs.mma_threads(tma) == 128
    assert valid(replace(ws, tile_m=128, tile_n=192)) is None
    assert "registers" in valid(replace(ws, tile_m=128, tile_n=224))
    # the lean kernels run one CTA per tile, and only they do
    assert "scheduler 'tile'" in valid(replace(ws, scheduler="persistent"))
    assert "scheduler 'tile'" in valid(replace(ws, scheduler="splitk", splits=2))
    assert "lean kernels" in valid(replace(BASE, scheduler="tile"))
    assert "lean kernels" in valid(CutlassSpec(64, 64, 64, 1, 1, "pingpong", "tile"))
    # block-index tiles: CUTLASS's raster order and swizzle would be silently ignored, so refused
    assert "raster" in valid(replace(ws, raster="along_m"))
    assert "swizzle 1" in valid(replace(ws, swizzle=4))
    assert "nosmem" in valid(replace(tma, epilogue="tma"))
    assert "persistent kernels" in valid(replace(ws, pdl=True))
    assert "partial tiles" in valid(replace(ws, reduction="nondeterministic"))
    src = render(ws)
    assert "cutlass::gemm::KernelTmaWarpSpecialized;" in src and "using TileSchedulerTag = void;" in src
    assert "cutlass::epilogue::TmaWarpSpecialized;" in src
    src = render(tma)
    assert "cutlass::gemm::KernelTma;" in src and "cutlass::epilogue::NoSmemWarpSpecialized;" in src
    # raced as a winner's twins, not searched: same tile, cluster, stages and precision
    win = CutlassSpec(64, 64, 128, 1, 2, "pingpong", "persistent", 1, 5, "along_n", 4, "NN")
    twins = cs.lean_twins(win, forms=cs.LEAN_FORMS)
    assert [(t.schedule, t.epilogue) for t in twins] == [("ws", "tma"), ("ws", "nosmem"), ("tma", "nosmem")]
    assert cs.lean_twins(win) == twins[:1]  # by default the one form that won races (run 158)
    assert all((t.tile_m, t.tile_n, t.tile_k, t.cluster_m, t.cluster_n, t.stages, t.layout)
               == (64, 64, 128, 1, 2, 5, "NN") and t.scheduler == "tile" for t in twins)
    assert cs.lean_twins(BASE, forms=cs.LEAN_FORMS) == [replace(BASE, schedule=s, scheduler="tile", epilogue=e)
                                                        for s, e in cs.LEAN_FORMS]
    assert cs.lean_twins(replace(BASE, tile_m=256)) == []  # no lean tile 256 rows high
    pool = enumerate_specs("TN")  # the search's pool holds the form that won (run 158), not the others
    assert any(s.schedule == "ws" for s in pool)
    assert not any(s.schedule == "tma" or (s.schedule == "ws" and s.epilogue == "nosmem") for s in pool)


def test_resident_twins_take_few_stages_so_two_blocks_share_an_sm():
    """The lean kernels of a winner's tile and its halves with the most stages up to K's k-blocks
    (4 at most) that leave shared memory for two blocks on an SM; 2 stages at least."""
    from gemmrl.build.ahead import variants

    half = cs.SM_SMEM_BYTES // 2 - cs.SM_SMEM_RESERVED
    win = CutlassSpec(128, 128, 64, 2, 1, "pingpong", "persistent", epi_n=64)
    got = cs.resident_twins(win, Problem(2048, 2048, 128))  # K = 128: two k-blocks
    assert [t.name for t in got] == ["sm90_ws_128x128x64_c2x1_tile_s2_rh_sw1_tn_f16_f32",
                                     "sm90_ws_64x128x64_c2x1_tile_s2_rh_sw1_tn_f16_f32",
                                     "sm90_ws_128x64x64_c2x1_tile_s2_rh_sw1_tn_f16_f32"]
    assert all(cs.smem_bytes(t) <= half and valid(t, Problem(2048, 2048, 128)) is None for t in got)
    # K = 256 has four k-blocks: the halves take 4 stages, the whole tile 3 (4 would not fit twice)
    got = cs.resident_twins(win, Problem(256, 16384, 256))
    assert [(t.tile_m, t.tile_n, t.stages) for t in got] == [(128, 128, 3), (64, 128, 4), (128, 64, 4)]
    assert cs.smem_bytes(replace(got[0], stages=4)) > half
    # K = 64, one k-block: still two stages; a tile under 128x128 has no halves
    got = cs.resident_twins(replace(win, tile_m=64), Problem(512, 8192, 64))
    assert [(t.tile_m, t.tile_n, t.stages) for t in got] == [(64, 128, 2)]
    # a swapped winner keeps its swap; split-K and stream-K winners give plain one-tile kernels
    sw = cs.resident_twins(CutlassSpec(128, 96, 64, 2, 1, "cooperative", "persistent", swap_ab=True),
                           Problem(12288, 256, 256))
    assert [t.name for t in sw] == ["sm90_ws_128x96x64_c2x1_tile_s3_rh_sw1_tn_f16_f32_xab"]
    sk = cs.resident_twins(replace(win, scheduler="splitk", splits=4, reduction="separate", epi_n=0),
                           Problem(256, 512, 12288))
    assert sk and all(t.scheduler == "tile" and t.splits == 1 and t.reduction == "deterministic" for t in sk)
    # build --variants resident / bench --impl race:K:built:resident
    assert variants(win, Problem(2048, 2048, 128), ("resident",)) == cs.resident_twins(win, Problem(2048, 2048, 128))


def test_resident_blocks_from_shared_memory_and_registers():
    """Blocks an SM holds at once: one for the persistent kernels and a lean kernel with every
    stage that fits; the lean kernels with few stages as many as their shared memory and
    registers (accumulators + LEAN_EXTRA_REGISTERS, in 8s) leave room for."""
    lean64x128 = CutlassSpec(64, 128, 64, 2, 1, "ws", "tile", stages=2)
    assert cs.resident_blocks(lean64x128) == 2  # 96 registers x 256 threads: two, not three
    assert 3 * (cs.smem_bytes(lean64x128) + cs.SM_SMEM_RESERVED) <= cs.SM_SMEM_BYTES  # registers decide
    assert cs.resident_blocks(replace(lean64x128, stages=4)) == 2
    assert cs.resident_blocks(CutlassSpec(128, 128, 64, 2, 1, "ws", "tile", stages=2)) == 1  # 154 registers
    assert cs.resident_blocks(CutlassSpec(64, 64, 64, 1, 1, "ws", "tile", stages=2)) == 4  # 64 x 256 each
    assert cs.resident_blocks(CutlassSpec(64, 64, 64, 1, 2, "ws", "tile")) == 1  # every stage that fits
    # fp16 accumulators take half the registers
    assert cs.resident_blocks(replace(lean64x128, acc="fp16")) == 3
    # the 'tma' lean kernel is one warpgroup of 128 threads
    assert cs.resident_blocks(CutlassSpec(128, 64, 64, 2, 1, "tma", "tile", epilogue="nosmem", stages=2)) == 4
    for sched, n in (("persistent", 1), ("streamk", 1), ("splitk", 2)):
        assert cs.resident_blocks(CutlassSpec(64, 64, 64, 1, 1, "pingpong", sched, n, stages=2)) == 1


def test_estimate_prices_a_resident_kernel_by_its_launch_waves():
    """A lean kernel relaunches its blocks each wave the SMs cannot hold at once: two blocks an
    SM make two waves of tiles one launch (H200 run 656: the lean kernels with 2-4 stages won 25
    of 108 shapes with K <= 512 from persistent kernels). Within one wave nothing changes."""
    full = CutlassSpec(64, 128, 64, 2, 1, "ws", "tile")
    two = replace(full, stages=2)
    assert cs.resident_blocks(full) == 1 and cs.resident_blocks(two) == 2
    p = Problem(128, 16384, 128)  # 2 x 128 = 256 tiles: two waves of 132 SMs, one launch of two blocks each
    assert estimate_us(two, p) < estimate_us(full, p) - 0.4
    one_wave = Problem(128, 8192, 128)  # 128 tiles
    assert estimate_us(two, one_wave) == pytest.approx(estimate_us(full, one_wave))


def test_key_is_a_stable_content_hash():
    assert BASE.key() == CutlassSpec().key()
    # fields added later are left out at their default, so older specs keep key, source and builds
    assert "epilogue" not in BASE.to_dict() and "reduction" not in BASE.to_dict() and "pdl" not in BASE.to_dict()
    pdl = replace(BASE, pdl=True)
    assert pdl.to_dict()["pdl"] is True and pdl.key() != BASE.key() and CutlassSpec.from_dict(pdl.to_dict()) == pdl
    ns = replace(BASE, epilogue="nosmem")
    assert ns.to_dict()["epilogue"] == "nosmem" and ns.key() != BASE.key()
    assert CutlassSpec.from_dict(ns.to_dict()) == ns
    assert len(BASE.key()) == 16 and int(BASE.key(), 16) >= 0
    assert CutlassSpec.from_dict(BASE.to_dict()) == BASE
    with pytest.raises(ValueError, match="unknown CutlassSpec fields"):
        CutlassSpec.from_dict({**BASE.to_dict(), "warps": 4})


def test_epilogue_subtile_override():
    """epi_n: the TMA epilogue's subtile width, CUTLASS's EpilogueTileType override; 0 keeps
    EpilogueTileAuto (and every older spec's key and source)."""
    pp = CutlassSpec(128, 192, 64, 2, 1, "pingpong", "persistent")
    assert "epi_n" not in pp.to_dict()
    e96 = replace(pp, epi_n=96)
    assert e96.name == "sm90_pp_128x192x64_c2x1_persist_s0_rh_sw1_tn_f16_f32_e96"
    assert e96.to_dict()["epi_n"] == 96 and e96.key() != pp.key() and CutlassSpec.from_dict(e96.to_dict()) == e96
    for spec in (e96, replace(e96, pdl=True), replace(BASE, epi_n=64)):
        assert valid(spec) is None and CutlassSpec.from_name(spec.name) == spec
    # the subtile rows CUTLASS requires: 64 for one warpgroup a tile, 128 for cooperative
    assert cs.epilogue_tile(pp) == (64, 32) and cs.epilogue_tile(e96) == (64, 96)
    assert cs.epilogue_tile(replace(BASE, epi_n=128)) == (128, 128)
    # two staged subtiles: wider ones take shared memory from the mainloop's stages
    assert cs.epilogue_smem_bytes(e96) == 2 * 64 * 96 * 2 + 1024  # 2 x 12 KiB, plus the C barriers' KiB
    assert cs.pipeline_stages(replace(pp, epi_n=192)) == cs.pipeline_stages(pp) - 1
    assert "multiple of 16 that divides" in valid(replace(pp, epi_n=80))
    assert "multiple of 16 that divides" in valid(replace(pp, epi_n=-64))
    assert "multiple of 16 that divides" in valid(replace(pp, epi_n=128))  # does not divide 192
    assert "has none" in valid(replace(e96, epilogue="nosmem"))
    assert "integer" in valid(replace(pp, epi_n=64.0))
    src = render(e96)
    assert "cute::Shape<cute::_64, cute::_96>, ElementAccumulator, ElementCompute," in src
    assert "EpilogueTileAuto" not in src and "EpilogueTileAuto" in render(pp)
    # the pool carries one wider subtile for three persistent ping-pong tiles, and no other
    wider = [s for s in enumerate_specs("TN") if s.epi_n]
    assert wider and {(s.tile_m, s.tile_n, s.epi_n) for s in wider} == {
        (m, n, e) for (m, n), e in cs.EPI_TWINS.items()}
    assert all(s.schedule == "pingpong" and s.scheduler == "persistent" and valid(s) is None
               and replace(s, epi_n=0) in enumerate_specs("TN") for s in wider)


def test_wider_subtile_priced_against_its_automatic_twin():
    """estimate_us charges a wider epilogue subtile what its races measured (subtile_us): the
    stores it saves per wave against the stages it gives up and a fixed cost, so the twin ranks
    first on an output-heavy short-K shape and not on a one-wave one."""
    from gemmrl.space.cutlass_sm90 import estimate_us, heuristic_specs
    pp = CutlassSpec(128, 192, 64, 2, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32")
    e96 = replace(pp, epi_n=96)
    assert cs.epilogue_stores(pp) == 2 * 6 and cs.epilogue_stores(e96) == 2 * 2
    assert cs.subtile_us(pp, 40) == 0.0 and cs.subtile_us(replace(e96, epilogue="nosmem"), 40) == 0.0
    lost = cs.pipeline_stages(pp) - cs.pipeline_stages(e96)
    assert cs.subtile_us(e96, 3) == pytest.approx(
        3 * (cs.EPI_STAGE_US * lost - cs.EPI_STORE_US * 8) + cs.EPI_FIXED_US)
    big, one_wave = Problem(16384, 8192, 64), Problem(1024, 2048, 64)  # 42 waves of 128x192; 1
    assert estimate_us(e96, big) < estimate_us(pp, big)
    assert estimate_us(e96, one_wave) > estimate_us(pp, one_wave)
    # a width that gives up a stage for too few stores saved stays behind its twin
    e192 = replace(pp, epi_n=192)
    assert cs.pipeline_stages(e192) < cs.pipeline_stages(pp)
    assert estimate_us(e192, big) > estimate_us(e96, big)
    first = {s.name for s in heuristic_specs(big, "TN", limit=3)}
    assert any(s.endswith("_e96") for s in first)
    assert not any(s.epi_n for s in heuristic_specs(one_wave, "TN", limit=8))


# -- valid(): every rule has a case that breaks only that rule ------------------------------------

RULES = [
    ({"schedule": "warpspecialized"}, "schedule must be one of"),
    ({"scheduler": "dynamic"}, "scheduler must be one of"),
    ({"raster": "hilbert"}, "raster must be one of"),
    ({"layout": "NT"}, "layout must be one of"),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"acc": "fp64"}, "acc must be one of"),
    ({"tile_n": 128.0}, "tile_n must be an integer"),
    ({"stages": True}, "stages must be an integer"),
    ({"dtype": "bf16", "acc": "fp16"}, "fp16 accumulator needs fp16 inputs"),
    ({"tile_m": 96, "schedule": "pingpong"}, "tile_m must be 64, 128, 192 or 256"),
    ({"tile_m": 320}, "tile_m must be 64, 128, 192 or 256"),
    ({"tile_m": 64}, "cooperative schedule splits tile_m"),
    ({"tile_m": 192}, "cooperative schedule splits tile_m"),
    ({"tile_n": 24}, "tile_n must be a multiple of 16 in 16..256"),
    ({"tile_n": 272}, "tile_n must be a multiple of 16 in 16..256"),
    ({"tile_k": 48}, "tile_k must be one of 32, 64, 128"),
    ({"tile_k": 256}, "tile_k must be one of 32, 64, 128"),
    ({"cluster_m": 2, "cluster_n": 2}, "offered with split-K only"),
    ({"cluster_m": 4}, "offered with split-K only"),
    ({"cluster_m": 4, "scheduler": "streamk"}, "offered with split-K only"),
    ({"cluster_m": 3}, "cluster must be 1x1, 2x1 or 1x2"),
    ({"cluster_m": 4, "cluster_n": 4, "scheduler": "splitk", "splits": 4}, "cluster must be 1x1, 2x1 or 1x2"),
    ({"schedule": "pingpong", "scheduler": "streamk"}, "ping-pong kernel supports only the persistent"),
    ({"schedule": "pingpong", "scheduler": "splitk", "splits": 2}, "ping-pong kernel supports only"),
    ({"scheduler": "splitk"}, "needs splits in 2..16"),
    ({"scheduler": "splitk", "splits": 17}, "needs splits in 2..16"),
    ({"splits": 2}, "needs scheduler 'splitk'"),
    ({"scheduler": "streamk", "splits": 4}, "needs scheduler 'splitk'"),
    ({"swizzle": 3}, "swizzle must be one of 1, 2, 4, 8"),
    ({"epilogue": "smem"}, "epilogue must be one of tma, nosmem"),
    ({"pdl": 1}, "pdl must be true or false"),
    ({"epilogue": "nosmem", "scheduler": "streamk"}, "nosmem) is offered with the persistent scheduler only"),
    ({"epilogue": "nosmem", "scheduler": "splitk", "splits": 4}, "nosmem) is offered with the persistent"),
    ({"tile_m": 256, "tile_n": 256}, "registers per MMA thread"),
    ({"schedule": "pingpong", "tile_n": 256}, "registers per MMA thread"),
    ({"stages": 1}, "stages must be 0 (auto) or at least 2"),
    ({"stages": -2}, "stages must be 0 (auto) or at least 2"),
    # 256x256x128 fp16-accumulate: registers fit, one 128 KiB stage does not leave room for two
    ({"tile_m": 256, "tile_n": 256, "tile_k": 128, "acc": "fp16"}, "a pipeline needs at least 2"),
    ({"tile_n": 256, "stages": 5}, "shared memory:"),
]


@pytest.mark.parametrize("changes,reason", RULES, ids=[r for _, r in RULES])
def test_each_rule_rejects_with_its_reason(changes, reason):
    assert valid(BASE) is None
    why = valid(replace(BASE, **changes))
    assert why is not None and reason in why, why


@pytest.mark.parametrize("changes", [
    {"tile_m": 64, "schedule": "pingpong"},
    {"tile_m": 192, "tile_n": 80, "schedule": "pingpong"},  # odd but legal
    {"tile_m": 256, "tile_n": 64},
    {"tile_n": 16, "tile_k": 32},
    {"tile_n": 256, "stages": 4},  # the auto count for 128x256x64, stated explicitly
    {"tile_m": 256, "tile_n": 256, "acc": "fp16"},  # fp16 accumulators: half the registers
    {"schedule": "pingpong", "tile_n": 256, "acc": "fp16"},
    {"cluster_m": 2}, {"cluster_n": 2},
    {"cluster_m": 2, "cluster_n": 2, "scheduler": "splitk", "splits": 8},
    {"cluster_m": 2, "cluster_n": 4, "scheduler": "splitk", "splits": 16, "reduction": "separate"},
    {"scheduler": "splitk", "splits": 16}, {"scheduler": "streamk", "raster": "along_m", "swizzle": 8},
    {"layout": "NN", "dtype": "bf16"},
])
def test_legal_specs_are_accepted(changes):
    assert valid(replace(BASE, **changes)) is None


def test_problem_rules():
    nn, tn = replace(BASE, layout="NN"), BASE
    assert valid(tn, Problem(513, 768, 1024)) is None  # M is free: TMA clips rows
    assert valid(nn, Problem(1, 8, 8)) is None
    assert "K=1029 is not a multiple of 8" in valid(tn, Problem(512, 768, 1029))
    assert "B [N,K]" in valid(tn, Problem(512, 768, 1029))
    assert "K=1029" in valid(nn, Problem(512, 768, 1029)) and "B [N,K]" not in valid(nn, Problem(512, 768, 1029))
    assert "N=771 is not a multiple of 8" in valid(nn, Problem(512, 771, 1024))
    assert "B [K,N] and C" in valid(nn, Problem(512, 771, 1024))
    assert "the problem is bf16" in valid(tn, Problem(512, 768, 1024, "bf16", "fp32"))
    assert "the problem is fp16 with fp16" in valid(tn, Problem(512, 768, 1024, "fp16", "fp16"))
    # a spec's own flaw is reported before anything about the problem
    assert "swizzle" in valid(replace(BASE, swizzle=5), Problem(512, 768, 1029))


# Measured with CUTLASS 4.2.0 (a host-only probe printing GemmKernel::SharedStorageSize and the
# mainloop's stage count): (tile_m, tile_n, tile_k, schedule, stages asked) -> (bytes, stages)
MEASURED_SMEM = {
    (128, 256, 64, "cooperative", 0): (214016, 4),
    (128, 256, 64, "cooperative", 3): (164864, 3),
    (128, 128, 64, "cooperative", 0): (214016, 6),
    (128, 16, 32, "cooperative", 0): (226048, 24),
    (256, 48, 64, "cooperative", 0): (203264, 5),
    (128, 192, 128, "cooperative", 0): (181248, 2),
    (64, 256, 64, "pingpong", 0): (214016, 5),
    (128, 128, 64, "pingpong", 2): (74752, 2),
    (64, 64, 128, "pingpong", 0): (205824, 6),
    (64, 16, 32, "pingpong", 0): (228608, 44),
    (192, 80, 64, "pingpong", 0): (213504, 6),
    (64, 128, 64, "pingpong", 0): (230400, 9),
    (256, 192, 64, "cooperative", 2): (132096, 2),
    (192, 80, 128, "pingpong", 0): (213504, 3),
    (128, 48, 128, "cooperative", 0): (188928, 4),
}


@pytest.mark.parametrize("cfg", list(MEASURED_SMEM), ids=lambda c: "x".join(map(str, c[:3])) + f"-{c[3]}-s{c[4]}")
def test_smem_model_matches_cutlass(cfg):
    tm, tn, tk, schedule, stages = cfg
    real_bytes, real_stages = MEASURED_SMEM[cfg]
    spec = replace(BASE, tile_m=tm, tile_n=tn, tile_k=tk, schedule=schedule, stages=stages)
    assert cs.pipeline_stages(spec) == real_stages
    # the estimate may only err high (valid() must never accept what does not fit), by little
    assert real_bytes <= cs.smem_bytes(spec) <= real_bytes + 1024


# -- the space ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,dtype,acc", [("NN", "fp16", "fp32"), ("TN", "fp16", "fp32"),
                                              ("TN", "fp16", "fp16"), ("NN", "bf16", "fp32")])
def test_enumerated_space_is_valid_and_unique(layout, dtype, acc):
    specs = enumerate_specs(layout, dtype, acc)
    assert 100 <= len(specs) <= 1000
    assert all(valid(s) is None for s in specs)
    assert all((s.layout, s.dtype, s.acc) == (layout, dtype, acc) for s in specs)
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.key() for s in specs}) == len(specs)
    assert {s.schedule for s in specs} == {"cooperative", "pingpong", "ws"}
    assert {s.scheduler for s in specs} == {"persistent", "streamk", "splitk", "tile"}
    lean = [s for s in specs if s.schedule == "ws"]  # the lean kernel: its TMA-epilogue form only
    assert all(s.scheduler == "tile" and s.epilogue == "tma" and s.tile_m <= 128 for s in lean)
    assert {(s.tile_m, s.tile_n) for s in lean} == set(cs._LEAN_TILES)
    assert {(s.cluster_m, s.cluster_n) for s in specs} == set(cs.CLUSTERS)  # the wide ones lost (runs 329-330)
    assert enumerate_specs(layout, dtype, acc) == specs  # deterministic order


def test_golden_specs_are_in_the_space():
    for s in GOLDEN_SPECS:
        assert s in enumerate_specs(s.layout, s.dtype, s.acc)


# -- render ----------------------------------------------------------------------------------------

# for each field, a different legal value (from BASE, or from a split-K BASE for `splits`)
MUTATIONS = {
    "tile_m": 256, "tile_n": 256, "tile_k": 128, "cluster_m": 2, "cluster_n": 2,
    "schedule": "pingpong", "scheduler": "streamk", "stages": 3, "raster": "along_m", "swizzle": 2,
    "layout": "NN", "dtype": "bf16", "acc": "fp16", "epilogue": "nosmem", "pdl": True, "epi_n": 64,
    "swap_ab": True,
}


def test_render_is_deterministic():
    for s in GOLDEN_SPECS:
        assert render(s) == render(s) == render(CutlassSpec(**s.to_dict()))


@pytest.mark.parametrize("field", [f.name for f in fields(CutlassSpec)])
def test_render_changes_when_any_field_changes(field):
    if field == "splits":
        base = replace(BASE, scheduler="splitk", splits=2)
        other = replace(base, splits=4)
    elif field == "reduction":
        base = replace(BASE, scheduler="splitk", splits=4)
        other = replace(base, reduction="nondeterministic")
    else:
        base, other = BASE, replace(BASE, **{field: MUTATIONS[field]})
    assert valid(other) is None, valid(other)
    assert render(base) != render(other)
    assert base.name != other.name and base.key() != other.key()


def test_nondeterministic_reduction_is_a_split_k_option_that_keeps_old_keys():
    det = replace(BASE, scheduler="splitk", splits=8)
    nd = replace(det, reduction="nondeterministic")
    # the default is left out of the dict, the key and the rendered spec: every spec made before
    # the field existed keeps its key, its source and its cached build
    assert "reduction" not in det.to_dict() and nd.to_dict()["reduction"] == "nondeterministic"
    assert '"reduction"' not in render(det) and "ReductionMode::Deterministic" in render(det)
    assert "ReductionMode::Nondeterministic" in render(nd)
    assert nd.name == det.name.replace("_splitk8_", "_splitk8nd_")
    assert CutlassSpec.from_name(nd.name) == nd and CutlassSpec.from_name(det.name) == det
    assert CutlassSpec.from_dict(nd.to_dict()) == nd and CutlassSpec.from_dict(det.to_dict()) == det
    assert "reduction mode needs split-K" in valid(replace(BASE, reduction="nondeterministic"))
    assert "reduction must be one of" in valid(replace(det, reduction="atomic"))
    sk = replace(BASE, scheduler="streamk")
    assert valid(replace(sk, reduction="nondeterministic")) is None
    assert CutlassSpec.from_name(replace(sk, reduction="nondeterministic").name).reduction == "nondeterministic"


SR = CutlassSpec(128, 128, 64, 1, 1, "cooperative", "splitk", 8, 0, "heuristic", 1, "TN", "fp16", "fp32",
                 "separate")


def test_separate_reduction_is_a_split_k_mode_with_its_own_rules():
    assert valid(SR) is None and SR.name == "sm90_coop_128x128x64_c1x1_splitk8sr_s0_rh_sw1_tn_f16_f32"
    assert CutlassSpec.from_name(SR.name) == SR and CutlassSpec.from_dict(SR.to_dict()) == SR
    assert SR.to_dict()["reduction"] == "separate"
    det = replace(SR, reduction="deterministic")
    assert len({SR.key(), det.key(), replace(SR, reduction="nondeterministic").key()}) == 3
    # deeper splits than CUTLASS's own split-K, and ping-pong (the GEMM is a persistent batch)
    assert valid(replace(SR, splits=64)) is None and "splits in 2..64" in valid(replace(SR, splits=65))
    assert "splits in 2..16" in valid(replace(det, splits=32))
    assert valid(replace(SR, schedule="pingpong", tile_m=64)) is None
    assert "only the persistent scheduler" in valid(replace(det, schedule="pingpong", tile_m=64))
    assert valid(replace(SR, acc="fp16")) is None  # fp16 partials (test below)
    assert "fp16 accumulator needs fp16 inputs" in valid(replace(SR, acc="fp16", dtype="bf16"))
    assert "split-K mode" in valid(replace(SR, scheduler="streamk", splits=1))
    # K is cut into `splits` equal chunks, each a whole number of 16-byte rows
    assert valid(SR, Problem(256, 256, 16384)) is None and valid(SR, Problem(256, 256, 64)) is None
    why = valid(SR, Problem(256, 256, 16384 + 8))
    assert "multiple of 8 splits x 8" in why
    # the fp32 partials double the epilogue's staging buffers; fp16 ones are C's size
    assert cs.epilogue_smem_bytes(SR) > cs.epilogue_smem_bytes(det)
    assert cs.epilogue_smem_bytes(replace(SR, acc="fp16")) == cs.epilogue_smem_bytes(replace(det, acc="fp16"))


def test_separate_reduction_of_an_fp16_accumulator_keeps_fp16_partials_and_sums_in_fp32():
    sr16 = replace(SR, acc="fp16")
    assert sr16.name == "sm90_coop_128x128x64_c1x1_splitk8sr_s0_rh_sw1_tn_f16_f16"
    src = render(sr16)
    assert "using ElementAccumulator = cutlass::half_t;" in src
    assert "using ElementD = cutlass::half_t;  // the GEMM's output: fp16 partials" in src
    # the workspace holds half-size partials, read 8 to a 16-byte load, added in fp32 in chunk order
    assert "size_t(M) * size_t(N) * sizeof(cutlass::half_t);" in src
    assert "gemmrl_separate::splitk_reduce_half<cutlass::half_t, 8>" in src
    assert "static_cast<const cutlass::half_t*>(partials)" in src
    assert "int64_t(M) * (N / 8);" in src and "int64_t(M) * (N / 4);" not in src
    assert "__half22float2" in src and "float acc[8];" in src and "atomicAdd" not in src
    assert "splitk_reduce<" not in src
    # the fp32 kernel keeps its reduction (and its text: the golden file)
    src32 = render(SR)
    assert "splitk_reduce_half" not in src32 and "sizeof(float);" in src32
    # the model prices half the partial bytes
    from gemmrl.space.cutlass_sm90 import estimate_us
    p = Problem(1024, 1024, 16384)
    deep = replace(SR, splits=32)
    assert estimate_us(replace(deep, acc="fp16"), p) < estimate_us(deep, p)
    # and the fp16 pool offers them as the fp32 one does
    pool16 = {s.name.replace("_f16_f16", "") for s in enumerate_specs("TN", "fp16", "fp16") if cs.separate(s)}
    pool32 = {s.name.replace("_f16_f32", "") for s in enumerate_specs("TN", "fp16", "fp32") if cs.separate(s)}
    assert pool16 and pool16 <= pool32


def test_separate_reduction_renders_a_batched_gemm_and_a_deterministic_reduction():
    src = render(SR)
    assert "PersistentScheduler" in src and "StreamKScheduler" not in src
    assert "using ElementD = float;" in src and "using ElementOut = cutlass::half_t;" in src
    assert "constexpr int kSplits = 8;" in src
    assert "args.problem_shape = cute::make_shape(M, N, K / kSplits, kSplits);" in src
    # A and B step by one K chunk per batch (TN: both K-contiguous); the partials are packed
    assert "StrideA stride_a = cute::make_stride(int64_t(lda), cute::Int<1>{}, chunk);" in src
    assert "StrideB stride_b = cute::make_stride(int64_t(ldb), cute::Int<1>{}, chunk);" in src
    nn = render(replace(SR, layout="NN"))
    assert "StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * chunk);" in nn
    # the reduction: its own kernel, launched behind the GEMM as a programmatic dependent launch,
    # summing the chunks in one fixed order
    assert "splitk_reduce<cutlass::half_t, 8>" in src and "cudaLaunchKernelEx" in src
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src
    first_cutlass = min(src.index("#include <cute"), src.index("#include <cutlass"))  # the prefix's own come first
    assert "griddepcontrol.wait" in src and src.index("#define CUTLASS_ENABLE_GDC_FOR_SM90") < first_cutlass
    assert "for (int s = 1; s < Splits; ++s)" in src and "atomicAdd" not in src
    assert "K % (kSplits * kAlignment)" in src
    # nothing of it leaks into the other specs (their sources, keys and builds are unchanged)
    for other in (replace(SR, reduction="deterministic"), BASE):
        assert "splitk_reduce" not in render(other) and "CUTLASS_ENABLE_GDC" not in render(other)
    assert "cutlass::bfloat16_t" in render(replace(SR, dtype="bf16"))


def test_a_swapped_separate_reduction_writes_the_same_packed_partials():
    """cuBLASLt's split-K tiles on a short M (64x2048x8192 on the H200: a 64x32 tile, 64 along N,
    in a 1x2 cluster) are our swapped kernels: the batch of K chunks computes C^T = B^T A^T per
    chunk, its column-major D is each [M,N] partial packed as the unswapped kernel packs it, so
    the reduction kernel is the same one."""
    from gemmrl.core.problem import Problem

    for layout in ("NN", "TN"):
        s = CutlassSpec(64, 32, 64, 1, 2, "pingpong", "splitk", 2, 0, "heuristic", 1, layout,
                        reduction="separate", swap_ab=True)
        assert s.name == f"sm90_pp_64x32x64_c1x2_splitk2sr_s0_rh_sw1_{layout.lower()}_f16_f32_xab"
        assert valid(s, Problem(64, 2048, 8192)) is None
        assert "the separate reduction cuts K" in valid(s, Problem(64, 2048, 8200))
        src = render(s)
        assert "args.problem_shape = cute::make_shape(N, M, K / kSplits, kSplits);" in src
        assert "ptr_A = static_cast<ElementA const*>(B);" in src and "ptr_B = static_cast<ElementB const*>(A);" in src
        assert "using LayoutD = cutlass::layout::ColumnMajor;" in src
        # the kernel's D (N x M, column-major) is the [M,N] partial slice, slices M*N apart
        assert "StrideD stride_d = cute::make_stride(cute::Int<1>{}, int64_t(N), int64_t(N) * M);" in src
        # the kernel's B is A, one K chunk per batch; its A is B, stepping a chunk along K
        assert "StrideB stride_b = cute::make_stride(int64_t(lda), cute::Int<1>{}, chunk);  // A [M,K]" in src
        b_chunk = ("cute::make_stride(cute::Int<1>{}, int64_t(ldb), int64_t(ldb) * chunk)" if layout == "NN"
                   else "cute::make_stride(int64_t(ldb), cute::Int<1>{}, chunk)")
        assert f"StrideA stride_a = {b_chunk};  // B" in src
        assert "splitk_reduce<cutlass::half_t, 2>" in src
        assert CutlassSpec.from_name(s.name) == s
    # the search pool's swapped twins still leave the separate reduction out, and so do its
    # mutations (a swapped in-kernel split-K one step from it): only the cuBLASLt seed offers them
    # until they are timed (seed_only)
    assert not any(t.swap_ab and cs.separate(t) for t in cs.swapped_twins(enumerate_specs("NN")))
    from gemmrl.search.policy import mutations

    inkernel = CutlassSpec.from_name("sm90_coop_128x64x64_c1x1_splitk2_s0_rh_sw1_nn_f16_f32_xab")
    big = Problem(16384, 1024, 1024)
    assert cs.seed_only(replace(inkernel, reduction="separate")) and not cs.seed_only(inkernel)
    assert valid(replace(inkernel, reduction="separate"), big) is None
    assert not any(m.swap_ab and cs.separate(m) for m in mutations("cutlass_sm90", inkernel, big, ("NN",)))
    # ... while a swapped separate kernel (a seed that won: run 634's 64x1024x12288) mutates within
    # its region: other split counts and clusters, still swapped with the separate reduction
    won = CutlassSpec.from_name("sm90_pp_128x64x64_c4x1_splitk8sr_s0_rh_sw1_nn_f16_f32_xab")
    short = Problem(64, 1024, 12288)
    assert valid(won, short) is None and cs.seed_only(won)
    near = mutations("cutlass_sm90", won, short, ("NN",))
    region = {m.name for m in near if cs.seed_only(m)}
    assert {"sm90_pp_128x64x64_c4x1_splitk6sr_s0_rh_sw1_nn_f16_f32_xab",
            "sm90_pp_128x64x64_c4x1_splitk12sr_s0_rh_sw1_nn_f16_f32_xab",
            "sm90_pp_128x64x64_c2x1_splitk8sr_s0_rh_sw1_nn_f16_f32_xab"} <= region, sorted(region)
    assert "sm90_pp_128x64x64_c4x1_splitk8sr_s0_rh_sw1_nn_f16_f32" in {m.name for m in near}  # unswapped
    assert all(valid(m, short) is None for m in near)


def test_separate_reduction_is_enumerated_and_modelled():
    from gemmrl.space.cutlass_sm90 import estimate_us

    specs = [s for s in enumerate_specs("NN") if s.reduction == "separate"]
    assert {s.splits for s in specs} == set(cs.SEPARATE_SPLITS)
    assert {s.schedule for s in specs} == {"cooperative", "pingpong"}
    assert all((s.cluster_m, s.cluster_n) == (1, 1) and s.scheduler == "splitk" for s in specs)
    p = Problem(256, 256, 16384)
    by_splits = {s.splits: estimate_us(s, p) for s in specs if (s.tile_m, s.tile_n, s.tile_k) == (128, 128, 64)
                 and s.schedule == "cooperative"}
    # 4 tiles: 8 splits leave most SMs idle, 32 fill them, 64 only add partials
    assert by_splits[32] < by_splits[8] and by_splits[32] < by_splits[64]
    # partials that fit in L2 cost less than partials that do not
    big = Problem(4096, 4096, 16384)
    s8 = replace(SR, layout="NN")
    assert estimate_us(replace(s8, splits=64), big) > estimate_us(s8, big)


def test_wide_clusters_are_split_k_kernels_the_model_prices_as_measured():
    """Clusters of 4 and 8 CTAs are valid with split-K only, both reductions. Their multicast did
    not pay on the shapes it was for (H100, runs 329-330), so the model prices one as its 1x1
    twin times WIDE_CLUSTER_COST rather than by the L2 bytes it saves. And the model counts work
    on the cluster-rounded tile grid: a 2x1 cluster over 11 rows of tiles runs 12."""
    from gemmrl.space.cutlass_sm90 import estimate_us

    sr = CutlassSpec(128, 128, 64, 1, 1, "cooperative", "splitk", 16, 0, "heuristic", 1, "NN", "fp16", "fp32",
                     "separate")
    for c in cs.WIDE_CLUSTERS:
        assert valid(replace(sr, cluster_m=c[0], cluster_n=c[1])) is None
        assert valid(replace(sr, cluster_m=c[0], cluster_n=c[1], reduction="deterministic")) is None
        assert "split-K only" in valid(replace(BASE, cluster_m=c[0], cluster_n=c[1]))
    p = Problem(256, 512, 12288)  # 2 x 4 tiles of 128x128
    c22 = replace(sr, cluster_m=2, cluster_n=2)
    assert abs(estimate_us(c22, p) / estimate_us(sr, p) - cs.WIDE_CLUSTER_COST) < 1e-9
    assert c22.name == "sm90_coop_128x128x64_c2x2_splitk16sr_s0_rh_sw1_nn_f16_f32"
    assert CutlassSpec.from_name(c22.name) == c22
    # 11 x 12 = 132 tiles: one wave unclustered; a 2x1 cluster rounds to 12 x 12, two waves
    full = Problem(128 * 11, 128 * 12, 8192)
    one, two = BASE, replace(BASE, cluster_m=2)
    assert estimate_us(two, full) > 1.5 * estimate_us(one, full)
    assert estimate_us(two, Problem(128 * 12, 128 * 11, 8192)) < 1.2 * estimate_us(one, full)


def test_render_states_the_spec_in_cutlass_terms():
    nn = render(GOLDEN_SPECS[0])
    assert "using LayoutB = cutlass::layout::RowMajor;" in nn
    assert "cute::Shape<cute::_128, cute::_256, cute::_64>" in nn and "cute::Shape<cute::_2, cute::_1, cute::_1>" in nn
    assert "KernelTmaWarpSpecializedCooperative" in nn and "PersistentScheduler" in nn
    assert "StageCountAutoCarveout" in nn
    tn = render(GOLDEN_SPECS[1])
    assert "using LayoutB = cutlass::layout::ColumnMajor;" in tn
    assert "KernelTmaWarpSpecializedPingpong" in tn and "cutlass::epilogue::TmaWarpSpecialized;" in tn
    assert "using ElementAccumulator = cutlass::half_t;" in tn
    sk = render(replace(BASE, scheduler="splitk", splits=4, stages=3, raster="along_n", swizzle=8))
    assert "StreamKScheduler" in sk and "splits = 4;" in sk and "DecompositionMode::SplitK" in sk
    assert "StageCount<3>" in sk and "RasterOrderOptions::AlongN" in sk and "max_swizzle_size = 8" in sk
    assert "DecompositionMode::Heuristic" in render(GOLDEN_SPECS[2])
    for text in (nn, tn, sk):
        assert "cutlass::bfloat16_t" not in text
    assert "cutlass::bfloat16_t" in render(GOLDEN_SPECS[2])
    # a tile_n without a base wgmma N (80) turns on cute's extended MMA shapes, only then
    assert "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" not in nn + tn + sk
    odd = render(replace(BASE, tile_m=192, tile_n=80, schedule="pingpong"))
    assert odd.index("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1") < odd.index("#include <cute")


def test_render_refuses_illegal_specs_and_unserved_problems():
    with pytest.raises(ValueError, match="registers per MMA thread"):
        render(replace(BASE, tile_m=256, tile_n=256))
    assert render(BASE, Problem(513, 768, 1024)) == render(BASE)  # generic: the problem changes nothing
    with pytest.raises(ValueError, match="K=1001"):
        render(BASE, Problem(512, 768, 1001))


@pytest.mark.parametrize("spec", GOLDEN_SPECS, ids=lambda s: s.name)
def test_golden(spec):
    path = GOLDEN / f"{spec.name}.cu"
    text = render(spec)
    if os.environ.get("GEMMRL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with GEMMRL_UPDATE_GOLDEN=1 to write it"
    want = path.read_text()
    if text != want:
        a, b = want.splitlines(), text.splitlines()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pytest.fail(f"render({spec.name}) differs from {path.name} from line {first + 1}:\n"
                    f"  golden:   {a[first] if first < len(a) else '<end>'}\n"
                    f"  rendered: {b[first] if first < len(b) else '<end>'}\n"
                    "If the change is intended, regenerate with GEMMRL_UPDATE_GOLDEN=1 and review the diff.")


def test_no_stale_golden_files():
    assert {p.name for p in GOLDEN.glob("*.cu")} == {f"{s.name}.cu" for s in GOLDEN_SPECS}


# -- real builds (nvcc, no GPU) -----------------------------------------------------------------

# cooperative fp32-acc NN c2x1; ping-pong TN fp16-acc; split-K 8 with the separate reduction (TN)
NOSMEM = CutlassSpec(64, 32, 128, 1, 2, "pingpong", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32",
                     epilogue="nosmem")
# ... and the register-to-global epilogue, launched as a programmatic dependent; the two lean
# one-tile-per-CTA kernels (producer + one consumer warpgroup; one warpgroup doing both)
LEAN_WS = CutlassSpec(64, 64, 64, 1, 2, "ws", "tile", layout="NN")
LEAN_TMA = CutlassSpec(128, 64, 64, 2, 1, "tma", "tile", epilogue="nosmem")
# ... and a wider TMA epilogue subtile (CUTLASS's EpilogueTileType override): ping-pong 128x192, 64x96
EPI = CutlassSpec(128, 192, 64, 2, 1, "pingpong", "persistent", epi_n=96)
# ... and a lean kernel with few stages (cutlass_sm90.resident_twins): two blocks to an SM
RESIDENT = CutlassSpec(64, 128, 64, 2, 1, "ws", "tile", stages=2)
# ... and a 2x2 cluster (TMA multicast over two rows and two columns of tiles) with split-K 8 and
# the separate reduction (NN)
WIDE = CutlassSpec(128, 128, 64, 2, 2, "cooperative", "splitk", 8, 0, "heuristic", 1, "NN", "fp16", "fp32",
                   "separate")
# ... and the separate reduction of an fp16 accumulator (fp16 partials, NN ping-pong); and a swapped
# kernel with the separate reduction (cuBLASLt's short-M split-K tile: 64x32, 1x2 cluster, NN)
XSR = CutlassSpec(64, 32, 64, 1, 2, "pingpong", "splitk", 2, 0, "heuristic", 1, "NN", "fp16", "fp32", "separate",
                  swap_ab=True)
COMPILED = [GOLDEN_SPECS[0], GOLDEN_SPECS[1], SR, replace(NOSMEM, pdl=True), LEAN_WS, LEAN_TMA, EPI, WIDE,
            GOLDEN_SPECS[4], XSR, RESIDENT]
THREADS = {"cooperative": 384, "pingpong": 384, "ws": 256, "tma": 128}


def _cutlass_dirs():
    try:
        return cs.include_dirs()
    except FileNotFoundError as e:
        return str(e)


def _toolchain() -> tuple[tuple[str, ...], str]:
    """The CUTLASS include directories and nvcc, or skip the test that needs them."""
    from gemmrl.build.nvcc import NvccNotFound, nvcc_path

    dirs = _cutlass_dirs()
    if isinstance(dirs, str):
        pytest.skip(f"CUTLASS headers not found ({dirs})")
    try:
        return dirs, nvcc_path()
    except NvccNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The specs compiled two at a time (about 100 s each with two in parallel on 2 cores)."""
    from gemmrl.build.nvcc import build_shared

    dirs, _nvcc = _toolchain()
    # a GEMMRL_CACHE the user set is reused across runs; else a fresh cache for this module
    cache = None if os.environ.get("GEMMRL_CACHE") else tmp_path_factory.mktemp("cutlass-builds")

    def one(spec):
        return build_shared(render(spec), name=spec.name, include_dirs=dirs, extra_flags=cs.BUILD_FLAGS,
                            cache_dir=cache)

    with ThreadPoolExecutor(2) as ex:
        return dict(zip((s.name for s in COMPILED), ex.map(one, COMPILED)))


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.name)
def test_build_is_clean(builds, spec):
    r = builds[spec.name]
    assert r.ok, r.log[-4000:]
    assert "C7510" not in r.log, "ptxas serialized wgmma (C7510): an assert or call in the mainloop"
    assert r.resources, "ptxas -v reported no kernel"
    kernels = [k for k in r.resources if "GemmUniversal" in k.name]
    assert len(kernels) == 1, [k.name for k in r.resources]
    for k in r.resources:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name}: spills {k.spill_stores}/{k.spill_loads}"
        assert 0 < k.registers <= 255
    assert r.spills == 0
    print(f"\n{spec.name}: {r.seconds:.0f} s, {kernels[0].registers} registers, "
          f"{kernels[0].smem_bytes} bytes static smem")


def test_a_resident_kernel_leaves_registers_and_shared_memory_for_two_blocks(builds):
    """What resident_twins promises, from ptxas: two blocks of the lean 64x128 kernel with two
    stages fit an SM's 64K registers (256 threads each) and its shared memory."""
    r = builds[RESIDENT.name]
    assert r.ok, r.log[-4000:]
    k = next(k for k in r.resources if "GemmUniversal" in k.name)
    assert 2 * THREADS[RESIDENT.schedule] * k.registers <= 65536, k.registers
    assert 2 * (cs.smem_bytes(RESIDENT) + k.smem_bytes + cs.SM_SMEM_RESERVED) <= cs.SM_SMEM_BYTES
    # resident_blocks' register count, for this kernel and the full-stage lean one
    assert k.registers == cs.accumulator_registers(RESIDENT) + cs.LEAN_EXTRA_REGISTERS
    assert cs.resident_blocks(RESIDENT) == 2
    lean = next(k for k in builds[LEAN_WS.name].resources if "GemmUniversal" in k.name)
    assert lean.registers == cs.accumulator_registers(LEAN_WS) + cs.LEAN_EXTRA_REGISTERS


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.name)
def test_build_exports_the_abi(builds, spec):
    from gemmrl.runtime.abi import REQUIRED_SYMBOLS, AbiKernel, KernelMeta, kernel_names

    r = builds[spec.name]
    assert r.ok, r.log[-2000:]
    out = subprocess.run(["nm", "-D", "--defined-only", r.path], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert set(REQUIRED_SYMBOLS) <= exported
    k = AbiKernel(r.path)
    assert k.meta == KernelMeta(spec.layout, spec.dtype, spec.acc, spec.name)
    names = kernel_names(r.path)
    assert any("GemmUniversal" in n for n in names)
    # on the H200 the profiler named these kernels by their mangled names
    assert any(n.startswith("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversal")
               and n.endswith("EEvNT_6ParamsE") for n in names)  # the kernel's name alone, no stub parameters

    info = json.loads(_info(r.path))
    assert info["stages"] == cs.pipeline_stages(spec)
    assert info["smem_bytes"] <= cs.smem_bytes(spec) <= cs.SMEM_CAPACITY
    assert info["threads"] == THREADS[spec.schedule]
    print(f"\n{spec.name}: {info}")


def _info(path: str) -> str:
    lib = ctypes.CDLL(path)
    lib.gemmrl_cutlass_info.restype = ctypes.c_char_p
    return lib.gemmrl_cutlass_info().decode()


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.name)
def test_abi_guards_refuse_before_touching_the_device(builds, spec):
    """Unsupported calls return their distinct codes without a GPU (nothing is launched)."""
    from gemmrl.runtime.abi import AbiKernel

    r = builds[spec.name]
    assert r.ok, r.log[-2000:]
    k = AbiKernel(r.path)
    buf = ctypes.create_string_buffer(4096 + 16)
    p = (ctypes.addressof(buf) + 15) // 16 * 16  # a 16-byte aligned host address: never dereferenced
    ldb = 64  # N = K = 64: the same minimum for NN and TN
    assert k.run(p, p, p, 0, 64, 64, 64, ldb, 64, 0, 0) == 1  # M not positive
    assert k.run(p, p, p, 64, 64, 64, 32, ldb, 64, 0, 0) == 2  # lda < K
    assert k.run(p, p, p, 64, 64, 64, 64, ldb, 32, 0, 0) == 2  # ldc < N
    assert k.run(p, p, p, 64, 64, 60, 64, ldb, 64, 0, 0) == 3  # K not a multiple of 8
    assert k.run(p, p, p, 64, 60, 64, 64, ldb, 64, 0, 0) == 3  # N not a multiple of 8
    assert k.run(p, p, p, 64, 64, 64, 68, ldb, 64, 0, 0) == 3  # lda not a multiple of 8
    # (a K the separate reduction's chunks divide: its K check comes before the pointers')
    kk = max(64, 8 * spec.splits) if cs.separate(spec) else 64
    ldb_kk = kk if spec.layout == "TN" else 64
    assert k.run(0, p, p, 64, 64, kk, kk, ldb_kk, 64, 0, 0) == 4  # null A
    assert k.run(p + 2, p, p, 64, 64, kk, kk, ldb_kk, 64, 0, 0) == 4  # misaligned A
    assert k.workspace_bytes(0, 64, 64) == 0
    if cs.separate(spec):
        K = 8 * 8 * spec.splits  # a K the chunks divide
        ldb_k = (lambda k_: k_) if spec.layout == "TN" else (lambda k_: 64)  # TN: B is [N,K]
        assert k.run(p, p, p, 64, 64, K + 8, K + 8, ldb_k(K + 8), 64, p, 0) == 6  # K not in equal 16-byte chunks
        assert k.run(p, p, p, 64, 64, K, K, ldb_k(K), 64, 0, 0) == 7  # the partials need a workspace
        assert k.workspace_bytes(64, 64, K + 8) == 0


def test_heuristic_ranks_valid_diverse_specs_and_prefers_full_waves():
    from gemmrl.space.cutlass_sm90 import estimate_us, heuristic_specs

    big = Problem(8192, 8192, 8192)
    hs = heuristic_specs(big, "TN", limit=6)
    assert len(hs) == 6 and all(valid(s, big) is None for s in hs)
    assert len({(s.tile_m, s.tile_n, s.tile_k, s.schedule, s.scheduler) for s in hs}) == 6
    times = [estimate_us(s, big) for s in hs]
    assert times == sorted(times)
    # measured on the H200 (results/logs/probe-2026-11-22.log): with a short K loop, splitting
    # K does not pay (1024^3: stream-K 17.9 us, split-K 22.8 us); small tiles rank first, as the
    # lean one-tile-per-CTA kernel where they fit one wave (96 tiles of 64x64: run 158 had it
    # 0.4-0.7 us faster than the persistent twin there)
    first = heuristic_specs(Problem(512, 768, 1024), "NN", limit=1)[0]
    assert first.scheduler == "tile" and first.schedule == "ws" and first.tile_m * first.tile_n <= 128 * 128
    # many waves of small tiles: the persistent kernel (a lean one launches each wave again)
    first = heuristic_specs(Problem(4096, 4096, 512), "NN", limit=1)[0]  # 1,024 tiles of 128x128
    assert first.scheduler != "tile"
    # few tiles and a long K loop: split the K loop (256x4096x12288: split-K 4 was fastest)
    assert heuristic_specs(Problem(256, 4096, 12288), "NN", limit=1)[0].scheduler in ("splitk", "streamk")
    # a huge problem is best served by big tiles (128x256 or larger: 705 TFLOP/s at 8192^3)
    first = heuristic_specs(Problem(16384, 16384, 16384), "NN", limit=1)[0]
    assert first.tile_m * first.tile_n >= 128 * 256


def test_split_k_16_is_offered_for_small_tiles_only_and_ranks_on_long_k_small_mn_shapes():
    from gemmrl.space import registry
    from gemmrl.space.cutlass_sm90 import DEEP_SPLIT_TILE, estimate_us, heuristic_specs

    for layout in ("NN", "TN"):
        specs = enumerate_specs(layout)
        # CUTLASS's own split-K (the separate reduction has its own tiles and splits: its test)
        own = [s for s in specs if s.reduction != "separate"]
        deep = [s for s in own if s.scheduler == "splitk" and s.splits == 16]
        assert deep and all(s.schedule == "cooperative" and s.tile_m * s.tile_n <= DEEP_SPLIT_TILE
                            for s in deep)
        assert {(s.tile_m, s.tile_n) for s in deep} >= {(128, 64), (128, 128)}
        assert all(s.splits <= 8 for s in own if s.tile_m * s.tile_n > DEEP_SPLIT_TILE)
        det = [s for s in specs if s.reduction == "deterministic" and s.schedule != "ws"]
        nd = [s for s in specs if s.reduction == "nondeterministic"]
        # 267 before split-K 16, 15 more (5 tiles x 3 cluster shapes), then 42 ping-pong tiles of
        # odd widths and 60 register-to-global (nosmem) twins of the persistent 64-row ones, and
        # the wider-subtile twins (EPI_TWINS' persistent ping-pong tiles), and the 48 of
        # cuBLASLt's 128x160 and 128x96 tiles (two schedules, three clusters, both orientations,
        # swizzles 1 and 2) and the 24 of its 128x144 and 128x176 (plain); then every main tile
        # order of swizzle 4 again with swizzle 2 (MAIN_ORDERS), the subtile twins too (24 -> 36)
        wide = [s for s in det if (s.tile_m, s.tile_n) in ((128, 160), (128, 96))]
        plain = [s for s in det if (s.tile_m, s.tile_n) in ((128, 144), (128, 176))]
        main = [s for s in det if s not in wide and s not in plain]
        sw2 = [s for s in main if s.swizzle == 2]
        assert sorted(s.name for s in sw2) == sorted(replace(s, swizzle=2).name for s in main if s.swizzle == 4)
        assert len([s for s in det if s.epi_n]) == 36 and len(wide) == 48 and len(plain) == (24 if layout == "TN" else 0)
        assert len(main) - len(sw2) <= 434
        # every split-K spec of a tile up to 128x128 again with the nondeterministic reduction
        assert sorted(s.name for s in nd) == sorted(
            replace(s, reduction="nondeterministic").name for s in det
            if s.scheduler == "splitk" and s.tile_m * s.tile_n <= DEEP_SPLIT_TILE)
        sr = [s for s in specs if s.reduction == "separate"]
        lean = [s for s in specs if s.schedule == "ws"]
        assert len(specs) == len(det) + len(nd) + len(sr) + len(lean) and len(nd) > 0 and len(sr) > 0
        # 256x256x16384: split-K 8 leaves 64 of 132 SMs idle (measured 22 us against cuBLAS's 10)
        for problem in (Problem(256, 256, 16384), Problem(128, 512, 16384)):
            hs = heuristic_specs(problem, layout)
            assert all(valid(s, problem) is None for s in hs)
            assert any(s.scheduler == "splitk" and s.splits == 16 for s in hs[:3]), [s.name for s in hs]
            assert any(s.splits == 16 for s in registry.get("cutlass_sm90").candidates(problem, layout, 4))
            s16 = next(s for s in hs if s.splits == 16)
            s8 = replace(s16, splits=8)
            assert estimate_us(s16, problem) < estimate_us(s8, problem)
        # a short K loop or a big grid never ranks split-K 16 first
        for problem in (Problem(512, 768, 1024), Problem(4096, 4096, 4096), Problem(256, 4096, 12288)):
            assert heuristic_specs(problem, layout, limit=1)[0].splits < 16


def test_split_k_16_render_differs_from_split_k_8_only_in_the_split_count():
    s8 = CutlassSpec(128, 64, 64, 1, 1, "cooperative", "splitk", 8, 0, "heuristic", 1, "TN", "fp16", "fp32")
    s16 = replace(s8, splits=16)
    assert valid(s16) is None and valid(replace(s8, splits=32)) is not None
    a, b = render(s8).splitlines(), render(s16).splitlines()
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    # the name (comment, metadata), the fields comment and the runtime split count: one kernel type
    assert len(a) == len(b) and len(diff) == 4, diff
    assert all("splitk8" in x or '"splits":8' in x or "splits = 8;" in x for x, _ in diff), diff
    assert "  args.scheduler.splits = 16;" in b


def test_narrow_tiles_lead_only_where_64x64_tiles_leave_most_sms_idle():
    from gemmrl.core.problem import Problem

    narrow = [s for s in cs.enumerate_specs("NN") if s.tile_n < 64 and s.schedule != "ws"]
    assert {(s.schedule, s.tile_m, s.tile_n) for s in narrow} == {
        ("pingpong", 64, 16), ("pingpong", 64, 32), ("pingpong", 64, 48), ("cooperative", 128, 32)}
    assert all(s.scheduler == "persistent" and cs.valid(s) is None for s in narrow)
    # 64x2048x1024: 32 tiles of 64x64 for 132 SMs; narrow tiles give 64 or 128
    small = cs.heuristic_specs(Problem(64, 2048, 1024), "NN")
    assert small[0].tile_n < 64
    # 4096^3: 4,096 tiles of 64x64, the GPU is full either way: wide tiles lead
    assert all(s.tile_n >= 128 for s in cs.heuristic_specs(Problem(4096, 4096, 4096), "TN")[:4])


def test_the_register_to_global_epilogue_is_a_twin_of_small_ping_pong_tiles():
    """nosmem: D from registers straight to global memory (cutlass::epilogue::NoSmemWarpSpecialized),
    offered for every persistent 64-row ping-pong tile up to 128 wide and nothing else; its
    source differs from its TMA-epilogue twin in the schedule, the name and the spec only."""
    for layout in ("NN", "TN"):
        specs = enumerate_specs(layout)
        ns = [s for s in specs if s.epilogue == "nosmem"]
        assert ns and all(s.schedule == "pingpong" and s.tile_m == 64 and s.tile_n <= 128
                          and s.scheduler == "persistent" for s in ns)
        names = {s.name for s in specs}
        assert all(replace(s, epilogue="tma").name in names for s in ns)  # each has its twin
        assert {s.tile_n for s in ns} >= {16, 32, 48, 64, 80, 96, 112, 128}
    tma = replace(NOSMEM, epilogue="tma")
    a, b = render(tma).splitlines(), render(NOSMEM).splitlines()
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and len(diff) == 4, diff
    assert ("using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;",
            "using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;") in diff
    # the rest: the name in the header comment and in the metadata, and the fields comment
    assert sum(NOSMEM.name in y for _, y in diff) == 2 and sum('"epilogue":"nosmem"' in y for _, y in diff) == 1
    # no staging buffer: the epilogue's shared memory is 128 bytes of slack, so up to 128 bytes
    # of the mainloop's budget come back (a stage, where the TMA staging was what kept it out)
    assert cs.epilogue_smem_bytes(NOSMEM) == cs.NOSMEM_EPILOGUE_BYTES < cs.epilogue_smem_bytes(tma)
    assert cs.pipeline_stages(NOSMEM) >= cs.pipeline_stages(tma)


def test_pdl_twin_differs_in_the_gdc_define_and_the_launch_attribute_only():
    """pdl: the kernel compiled with CUTLASS's grid-dependency control (its producers wait in
    griddepcontrol.wait before their first global load) and launched with the programmatic
    stream serialization attribute; nothing else in the source changes."""
    for plain in (NOSMEM, GOLDEN_SPECS[0], SR):
        pdl = replace(plain, pdl=True)
        assert valid(pdl) is None
        a, b = render(plain), render(pdl)
        assert "cudaLaunchAttributeProgrammaticStreamSerialization;\n  with_pdl" not in a
        assert b.count("#define CUTLASS_ENABLE_GDC_FOR_SM90 1") == 1  # once, also where split-K had it
        assert "with_pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;" in b
        assert "config.numAttrs += 1;" in b and "config.numAttrs += 1;" not in a
        back = b.replace(cs.PDL_LAUNCH, "", 1)
        if plain is not SR:
            back = back.replace(cs.PDL_PREFIX, "", 1)
        back = (back.replace(pdl.name, plain.name).replace(pdl.key(), plain.key())
                .replace(',"pdl":true', ""))
        assert back == a
    # the separate split-K kernel already had the define (for its reduction kernel's launch)
    assert "CUTLASS_ENABLE_GDC_FOR_SM90" in render(SR)


def test_odd_wgmma_widths_are_offered_for_64_row_ping_pong_tiles():
    specs = enumerate_specs("TN")
    odd = {(s.tile_m, s.tile_n) for s in specs if s.tile_n % 64 and s.tile_n > 32 and s.tile_m == 64}
    assert odd == {(64, n) for n in (48, 80, 96, 112, 144, 160, 176)}
    assert all(s.schedule == "pingpong" and s.scheduler == "persistent"
               for s in specs if s.tile_n % 64 and s.tile_n > 32 and s.tile_m == 64)
    # 128 rows: only the 160, 96, 144 and 176 widths (cuBLASLt's tiles, test_cublaslt_big_output_tile_...;
    # 144 and 176 with B K-major only)
    assert {(s.tile_m, s.tile_n) for s in specs if s.tile_n % 64 and s.tile_n > 32 and s.tile_m > 64} == {
        (128, 160), (128, 96), (128, 144), (128, 176)}
    # 64x4096x128: 64x64 tiles give 64 CTAs on 132 SMs, 64x48 give 86 and 64x32 128
    from gemmrl.core.problem import Problem
    assert all(valid(replace(s, layout="TN"), Problem(64, 4096, 128)) is None
               for s in specs if s.tile_n in (48, 80, 112))


def test_swapped_kernels_compute_the_transpose_and_keep_every_other_source():
    """swap_ab: C^T = B^T A^T with the kernel's A the ABI's B, its B the ABI's A, its D column
    major over (N, M); the name gains _xab and parses back; a spec without it keeps its key and
    its rendered source byte for byte (every shipped pack's CUTLASS source renders unchanged)."""
    import json
    from pathlib import Path

    from gemmrl.core.problem import Problem

    for layout in ("NN", "TN"):
        s = CutlassSpec(128, 192, 64, 2, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, layout, swap_ab=True)
        assert s.name == f"sm90_coop_128x192x64_c2x1_persist_s0_rh_sw1_{layout.lower()}_f16_f32_xab"
        assert CutlassSpec.from_name(s.name) == s and s.to_dict()["swap_ab"] is True
        src = render(s)
        assert "using LayoutD = cutlass::layout::ColumnMajor;" in src
        assert "args.problem_shape = cute::make_shape(N, M, K, 1);" in src
        assert "ptr_A = static_cast<ElementA const*>(B);" in src and "ptr_B = static_cast<ElementB const*>(A);" in src
        assert "StrideD stride_d = cute::make_stride(cute::Int<1>{}, int64_t(ldc), int64_t(ldc) * M);" in src
        a_layout = "ColumnMajor" if layout == "NN" else "RowMajor"  # B [K,N] is N-contiguous; B [N,K] K-contiguous
        assert f"using LayoutA = cutlass::layout::{a_layout};" in src
        plain = replace(s, swap_ab=False)
        assert "swap_ab" not in plain.to_dict() and "LayoutD = cutlass::layout::RowMajor;" in render(plain)
        # priced on the problem it runs: the transposed one
        p = Problem(12288, 256, 16384)
        assert estimate_us(s, p) == estimate_us(plain, Problem(256, 12288, 16384))
    assert "swap_ab" in valid(replace(BASE, epi_n=64, swap_ab=True))
    assert "swap_ab must be true or false" in valid(replace(BASE, swap_ab=1))
    root = Path(__file__).resolve().parents[1] / "packs"
    n = 0
    for manifest in root.glob("*/manifest.json"):
        m = json.loads(manifest.read_text())
        for e in m["entries"]:
            if e["family"] == "cutlass_sm90" and n < 200:
                spec = CutlassSpec.from_dict(e["spec"])
                prob = Problem(e["M"], e["N"], e["K"], e["dtype"], e["acc"])
                assert render(spec, prob) == (manifest.parent / e["file"]).read_text(), e["file"]
                n += 1
    assert n > 0


def test_swapped_twins_join_the_pool_for_a_narrow_n_over_many_rows_only():
    from gemmrl.core.problem import Problem
    from gemmrl.search.policy import _tiles, candidate_pool

    narrow, square = Problem(12288, 256, 16384), Problem(4096, 4096, 4096)
    assert skinny_n(narrow) and not skinny_n(square) and not skinny_n(Problem(1024, 256, 4096))
    pool = [s for f, s in candidate_pool(narrow, ("TN",), ("cutlass_sm90",))]
    plain = [s for s in pool if not s.swap_ab]
    twins = [s for s in pool if s.swap_ab]
    assert twins and len(twins) <= len(plain) and all(valid(s, narrow) is None for s in twins)
    assert {replace(s, swap_ab=False).name for s in twins} <= {s.name for s in plain}
    # elsewhere only cuBLASLt's 128x160 and 128x96 tiles come swapped (test_cublaslt_big_output_tile_...)
    assert {(s.tile_m, s.tile_n) for f, s in candidate_pool(square, ("TN",), ("cutlass_sm90",)) if s.swap_ab} \
        == {(128, 160), (128, 96)}
    assert len(pool) == len(set(pool))  # its twins once, though the space already holds them
    # the cost model's tile over the problem's M and N: transposed for a swapped kernel
    s = CutlassSpec(128, 192, 64, 1, 1, "cooperative", "persistent", 1, 0, "heuristic", 1, "TN", swap_ab=True)
    assert _tiles("cutlass_sm90", s)[:2] == (192, 128) and _tiles("cutlass_sm90", replace(s, swap_ab=False))[:2] == (128, 192)
    # 128x192 swapped tiles make 128 CTAs of 12288x256 (132 SMs): ranked above every unswapped spec
    best = min(pool, key=lambda x: estimate_us(x, narrow))
    assert best.swap_ab, best.name
    # the heuristic ranking (what `gemmrl build --top K` and the harness's best-of compile) sees the
    # same twins: `build --shapes NARROW --top 4` compiles swapped kernels ahead
    from gemmrl.space.cutlass_sm90 import heuristic_specs

    ranked = heuristic_specs(narrow, "TN", limit=6)
    assert ranked[0].swap_ab and all(valid(x, narrow) is None for x in ranked)
    assert not any(x.swap_ab and x.tile_n not in (160, 96) for x in heuristic_specs(square, "TN", limit=20))


def test_cublaslt_big_output_tile_is_offered_in_both_orientations():
    """128x160 (and 128x96), persistent, both schedules and every cluster, plain and swapped:
    cuBLASLt autotuned's tiles (128 along its m, our N: our swapped kernel) on the H100's largest
    grid shapes below 0.98 of it (and on 12288x128xK, 256x12288xK). 160 rows fill whole waves
    where 192 and 256 leave a partial one."""
    from gemmrl.core.problem import Problem
    from gemmrl.search.policy import candidate_pool

    for layout in ("NN", "TN"):
        for tn in (160, 96):
            tiles = [s for s in enumerate_specs(layout) if (s.tile_m, s.tile_n) == (128, tn)]
            assert sorted((s.schedule, s.cluster_m, s.cluster_n, s.swap_ab, s.swizzle) for s in tiles) == sorted(
                (sch, cm, cn, sw, order) for sch in ("cooperative", "pingpong") for cm, cn in cs.CLUSTERS
                for sw in (False, True) for order in (1, 2))
        for tn in (144, 176):  # 144x128 and 176x128 in cuBLAS's terms: 128 rows of M, plain, TN only
            tiles = [s for s in enumerate_specs(layout) if (s.tile_m, s.tile_n) == (128, tn)]
            assert sorted((s.schedule, s.cluster_m, s.cluster_n, s.swap_ab, s.swizzle) for s in tiles) == sorted(
                (sch, cm, cn, False, order) for sch in ("cooperative", "pingpong") for cm, cn in cs.CLUSTERS
                for order in (1, 2) if layout == "TN")
            assert all(s.scheduler == "persistent" and s.tile_k == 64 and CutlassSpec.from_name(s.name) == s
                       for s in tiles)
        wide = [s for s in enumerate_specs(layout) if (s.tile_m, s.tile_n) in ((128, 160), (128, 96))]
        assert all(s.scheduler == "persistent" and s.tile_k == 64 and s.stages == 0 and not s.epi_n for s in wide)
        assert all(CutlassSpec.from_name(s.name) == s for s in wide)
        big = Problem(16384, 4096, 2048)
        assert all(valid(s, big) is None for s in wide)
        names = {s.name for f, s in candidate_pool(big, (layout,), ("cutlass_sm90",))}
        assert {s.name for s in wide} <= names
        # the swapped kernel is priced on the transposed problem: 4096 x 16384 in 128x160 tiles
        xab = next(s for s in wide if s.swap_ab and s.schedule == "cooperative" and s.cluster_m == 2)
        assert estimate_us(xab, big) == estimate_us(replace(xab, swap_ab=False), Problem(4096, 16384, 2048))
        assert render(xab) != render(replace(xab, swap_ab=False))


# -- the host's TMA encoder looked up once (ENTRY_CACHE_PREFIX, on by default) ---------------------

def test_entry_cache_adds_the_prefix_only_and_is_the_default(monkeypatch):
    """render(entry_cache=True) is the plain source with ENTRY_CACHE_PREFIX in front of the CUTLASS
    includes and nothing else changed; it is what render() gives unless told otherwise, and
    $GEMMRL_CUTLASS_ENTRY_CACHE=0 (or false, no, off) gives CUTLASS's own host path back."""
    monkeypatch.delenv(cs.ENTRY_CACHE_ENV, raising=False)
    for spec in (GOLDEN_SPECS[0], SR, replace(NOSMEM, pdl=True)):
        plain, cached = render(spec, entry_cache=False), render(spec, entry_cache=True)
        assert render(spec) == cached
        assert cs.ENTRY_CACHE_PREFIX not in plain
        assert cached.replace(cs.ENTRY_CACHE_PREFIX, "", 1) == plain
        assert cached.index(cs.ENTRY_CACHE_PREFIX) < cached.index("#include <cute/tensor.hpp>")
        for value, expect in (("0", plain), (" 0 ", plain), ("Off", plain), ("false", plain), ("no", plain),
                              ("1", cached), ("", cached), ("yes", cached)):
            monkeypatch.setenv(cs.ENTRY_CACHE_ENV, value)
            assert render(spec) == expect, value
            assert render(spec, entry_cache=True) == cached and render(spec, entry_cache=False) == plain
        monkeypatch.delenv(cs.ENTRY_CACHE_ENV)


def test_runs_record_whether_the_entry_cache_was_rendered(monkeypatch):
    """Every run's provenance names the setting (bench.env.codegen_settings): runs 701-704 timed
    entry-cache builds under a commit whose default was off, and nothing in the store said so."""
    from gemmrl.bench.env import codegen_settings

    for value, on in (("0", False), ("1", True), (None, True)):
        if value is None:
            monkeypatch.delenv(cs.ENTRY_CACHE_ENV, raising=False)
        else:
            monkeypatch.setenv(cs.ENTRY_CACHE_ENV, value)
        assert codegen_settings() == {"cutlass_entry_cache": on}


_LOOKUP_PROBE = r"""
#include <cstdio>
#include <cstring>
${prefix}
#include <cutlass/cuda_host_adapter.hpp>

// stands in for the driver: counts the runtime's entry-point lookups and the encodes
static int lookups = 0, encodes = 0, fail_lookups = 0;
static CUresult fake_encode(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                            const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                            CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  ++encodes;
  return CUDA_SUCCESS;
}
extern "C" cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int,
                                                                  unsigned long long,
                                                                  cudaDriverEntryPointQueryResult* status) {
  ++lookups;
  bool ok = std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0 && fail_lookups == 0;
  if (fail_lookups > 0) --fail_lookups;
  *fn = ok ? reinterpret_cast<void*>(&fake_encode) : nullptr;
  if (status) *status = ok ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

static CUresult encode() {  // as cute's make_tma_copy_desc calls it
  CUtensorMap map;
  return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, nullptr, nullptr, nullptr, nullptr, nullptr,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

int main() {
  fail_lookups = 1;  // the first lookup fails: that call fails, and the failure is not kept
  CUresult first = encode();
  for (int i = 0; i < 3; ++i)
    if (encode() != CUDA_SUCCESS) return 1;
  std::printf("%d %d %d\n", int(first != CUDA_SUCCESS), lookups, encodes);
  return 0;
}
"""


@pytest.mark.parametrize("cached", [False, True], ids=["cutlass", "entry-cache"])
def test_entry_cache_looks_the_encoder_up_once(tmp_path, cached):
    """CUTLASS's own wrapper asks for the driver's entry point on every encode (three a GEMM call);
    with ENTRY_CACHE_PREFIX the first successful lookup is kept, a failed one is not. Host code
    only: the runtime's lookup is replaced by a counting stand-in, so no GPU or driver is needed."""
    from string import Template

    dirs, nvcc = _toolchain()
    src = tmp_path / "probe.cu"
    src.write_text(Template(_LOOKUP_PROBE).substitute(prefix=cs.ENTRY_CACHE_PREFIX if cached else ""))
    exe = tmp_path / "probe"
    r = subprocess.run([nvcc, "-std=c++17", "-cudart", "shared", *[f"-I{d}" for d in dirs], str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    failed_first, lookups, encodes = map(int, out.stdout.split())
    assert failed_first == 1 and encodes == 3
    # CUTLASS: a lookup for every call (4); cached: the failed one, then one that is kept (2)
    assert lookups == (2 if cached else 4)


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    """LEAN_WS without the prefix (GEMMRL_CUTLASS_ENTRY_CACHE=0's source)."""
    from gemmrl.build.nvcc import build_shared

    dirs, _nvcc = _toolchain()
    cache = None if os.environ.get("GEMMRL_CACHE") else tmp_path_factory.mktemp("cutlass-plain")
    return build_shared(render(LEAN_WS, entry_cache=False), name=LEAN_WS.name, include_dirs=dirs,
                        extra_flags=cs.BUILD_FLAGS, cache_dir=cache)


def test_an_entry_cache_kernel_builds_clean_and_keeps_the_abi(builds, plain_build):
    """A whole kernel rendered with the prefix (the default: `builds` compiled render(spec)): the
    same kernel (registers, shared memory) as CUTLASS's own host path, the ABI's guards as before,
    and CUTLASS's encoder calls bound to the cached lookup (its instantiation is in the library;
    without the prefix it is not)."""
    from gemmrl.runtime.abi import AbiKernel

    r, plain = builds[LEAN_WS.name], plain_build
    assert plain.ok, plain.log[-4000:]
    assert r.ok, r.log[-4000:]
    assert r.spills == 0
    mine = next(k for k in r.resources if "GemmUniversal" in k.name)
    theirs = next(k for k in plain.resources if "GemmUniversal" in k.name)
    assert (mine.name, mine.registers, mine.smem_bytes) == (theirs.name, theirs.registers, theirs.smem_bytes)

    def symbols(path):
        return subprocess.run(["nm", "-C", path], capture_output=True, text=True, check=True).stdout

    assert "gemmrl_driver::encode_tiled" in symbols(r.path)
    assert "gemmrl_driver::encode_tiled" not in symbols(plain.path)
    k = AbiKernel(r.path)
    buf = ctypes.create_string_buffer(4096 + 16)
    p = (ctypes.addressof(buf) + 15) // 16 * 16
    assert k.run(p, p, p, 0, 64, 64, 64, 64, 64, 0, 0) == 1
    assert k.run(0, p, p, 64, 64, 64, 64, 64, 64, 0, 0) == 4
