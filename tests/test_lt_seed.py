"""tune --seed-from-lt: cuBLASLt autotuned's stored choice (its tile and cluster) turned into the
CUTLASS kernels of our orientation, and given to the search as a prior. CPU only: the choices
are written into a store here as the autotuned baseline stores them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gemmrl.baselines.cublas import LT_CLUSTERS, LT_TILES
from gemmrl.cli import main
from gemmrl.core.problem import Problem
from gemmrl.runtime.pack import LT_IMPL
from gemmrl.search.lt_seed import (lt_prior, lt_specs, lt_split_specs, nearest_even_splits, parse_choice,
                                   parse_split_choice, unclustered)
from gemmrl.store.db import Store

DEV = "Fake H200"
# as the autotuned baseline describes its pick (H200, 16384x4096x4096: tile 29 = 128x160, cluster 3 = 2x1)
INFO = "algo=66 tile=29 stages=35 splitk=1 reduction=0 swizzle=0 custom=1 inner=0 cluster=3 (best of 3/3)"


def names(specs) -> list[str]:
    return [s.name for s in specs]


def test_a_cublas_tile_becomes_our_swapped_twin_and_the_plain_kernel_of_its_output_tile():
    """cuBLAS's m x n tile lies m along our N: its twin is our swapped kernel with the same tile
    and cluster; the plain kernel of the same output tile has the tile and the cluster turned.
    Only kernels of the search pool, in both schedules."""
    p = Problem(16384, 4096, 4096)
    # 128x160 (2x1): the swapped 128x160 with a 2x1 cluster; no 160-row plain tile in the pool
    assert names(lt_specs((128, 160), (2, 1), "TN", problem=p)) == [
        "sm90_coop_128x160x64_c2x1_persist_s0_rh_sw1_tn_f16_f32_xab",
        "sm90_pp_128x160x64_c2x1_persist_s0_rh_sw1_tn_f16_f32_xab"]
    # 176x128 (1x2): the plain 128x176, its cluster turned to 2x1; the pool has it in TN only
    assert names(lt_specs((176, 128), (1, 2), "TN", problem=p)) == [
        "sm90_coop_128x176x64_c2x1_persist_s0_rh_sw1_tn_f16_f32",
        "sm90_pp_128x176x64_c2x1_persist_s0_rh_sw1_tn_f16_f32"]
    assert lt_specs((176, 128), (1, 2), "NN", problem=p) == []
    # a square tile: both orientations, swapped first; the accumulator is the problem's
    got = names(lt_specs((128, 128), (2, 1), "NN", acc="fp16", problem=Problem(4096, 4096, 4096, acc="fp16")))
    assert got[:2] == ["sm90_coop_128x128x64_c2x1_persist_s0_rh_sw1_nn_f16_f16_xab",
                       "sm90_pp_128x128x64_c2x1_persist_s0_rh_sw1_nn_f16_f16_xab"]
    assert "sm90_coop_128x128x64_c1x2_persist_s0_rh_sw1_nn_f16_f16" in got and len(got) == len(set(got))


def test_a_stored_description_gives_its_tile_and_cluster_or_nothing():
    assert parse_choice(INFO, LT_TILES, LT_CLUSTERS) == ((128, 160), (2, 1))
    # a tile the tables do not know (CUDA 13's 197 without cublasLt.h), a split-K pick, no description
    assert parse_choice(INFO.replace("tile=29", "tile=197"), LT_TILES, LT_CLUSTERS) is None
    assert parse_choice(INFO.replace("splitk=1", "splitk=4"), LT_TILES, LT_CLUSTERS) is None
    assert parse_choice("", LT_TILES, LT_CLUSTERS) is None


def test_a_split_k_choice_becomes_our_split_k_kernels_of_its_tile():
    """cuBLASLt's split-K pick (splitk=S): our split-K kernels of the same output tile, cluster and
    S, first with the reduction of its scheme (2, the compute-type workspace: our separate
    reduction), then the other; the family's valid() decides (no cooperative 64-row tile, no
    ping-pong in-kernel split-K, no separate reduction where K does not split evenly)."""
    split = INFO.replace("tile=29", "tile=17").replace("splitk=1", "splitk=4").replace("reduction=0", "reduction=2")
    assert parse_split_choice(split, LT_TILES, LT_CLUSTERS) == ((64, 128), (2, 1), 4, 2)
    assert parse_split_choice(INFO, LT_TILES, LT_CLUSTERS) is None  # not split-K: parse_choice's
    assert parse_split_choice(split.replace("tile=17", "tile=197"), LT_TILES, LT_CLUSTERS) is None
    p = Problem(256, 512, 12288)
    assert names(lt_split_specs((64, 128), (2, 1), 4, 2, "TN", problem=p)) == [
        "sm90_coop_128x64x64_c1x2_splitk4sr_s0_rh_sw1_tn_f16_f32",
        "sm90_pp_128x64x64_c1x2_splitk4sr_s0_rh_sw1_tn_f16_f32",
        "sm90_pp_64x128x64_c2x1_splitk4sr_s0_rh_sw1_tn_f16_f32_xab",  # the faithful (swapped) twin
        "sm90_coop_128x64x64_c1x2_splitk4_s0_rh_sw1_tn_f16_f32"]
    # the in-place scheme (1): the in-kernel reduction first, which no 64x64 form has; the separate one
    assert names(lt_split_specs((64, 64), (2, 1), 4, 1, "NN", problem=p)) == [
        "sm90_pp_64x64x64_c1x2_splitk4sr_s0_rh_sw1_nn_f16_f32", "sm90_pp_64x64x64_c2x1_splitk4sr_s0_rh_sw1_nn_f16_f32_xab"]
    # K = 12296 splits into 4 chunks of 3074, not 16-byte aligned: no separate reduction, and no
    # split count within a third of 4 (2, 3, 5, 6) cuts it evenly either
    got = names(lt_split_specs((64, 128), (2, 1), 4, 2, "TN", problem=Problem(256, 512, 12296)))
    assert got == ["sm90_coop_128x64x64_c1x2_splitk4_s0_rh_sw1_tn_f16_f32"]


def test_an_uneven_split_choice_gets_the_nearest_even_splits_with_the_separate_reduction():
    """cuBLASLt splits K = 4096 three ways (256x512x4096 on the H200, tile 64x64, cluster 4x2);
    our separate reduction needs equal aligned chunks and the in-kernel one no 64-row tile, so
    its tile and cluster had no twin at all. The nearest split counts that divide K, one each
    side, take the separate reduction's form of its tile and cluster."""
    assert nearest_even_splits(4096, 3) == [2, 4]
    assert nearest_even_splits(16384, 5) == [4]  # 6 leaves 16384/6 uneven; 3 and 7 too
    assert nearest_even_splits(12288, 9) == [8, 12]
    assert nearest_even_splits(16384, 12) == [8, 16]
    assert nearest_even_splits(8192, 4) == []  # 4 divides it: the exact twin exists
    assert nearest_even_splits(12296, 4) == []  # nothing within reach
    got = names(lt_split_specs((64, 64), (4, 2), 3, 2, "NN", problem=Problem(256, 512, 4096)))
    assert got == ["sm90_pp_64x64x64_c2x4_splitk2sr_s0_rh_sw1_nn_f16_f32",
                   "sm90_pp_64x64x64_c4x2_splitk2sr_s0_rh_sw1_nn_f16_f32_xab",
                   "sm90_pp_64x64x64_c2x4_splitk4sr_s0_rh_sw1_nn_f16_f32",
                   "sm90_pp_64x64x64_c4x2_splitk4sr_s0_rh_sw1_nn_f16_f32_xab"]
    # where the exact split has a separate form, no runner-up of another split count
    got = names(lt_split_specs((64, 64), (4, 2), 4, 2, "NN", problem=Problem(256, 512, 4096)))
    assert got == ["sm90_pp_64x64x64_c2x4_splitk4sr_s0_rh_sw1_nn_f16_f32",
                   "sm90_pp_64x64x64_c4x2_splitk4sr_s0_rh_sw1_nn_f16_f32_xab"]
    # an in-kernel form of the exact split comes first; the runners-up follow it
    got = names(lt_split_specs((64, 128), (2, 1), 3, 2, "TN", problem=Problem(256, 512, 4096)))
    assert got[0] == "sm90_coop_128x64x64_c1x2_splitk3_s0_rh_sw1_tn_f16_f32"
    assert got[1:] == ["sm90_coop_128x64x64_c1x2_splitk2sr_s0_rh_sw1_tn_f16_f32",
                       "sm90_pp_128x64x64_c1x2_splitk2sr_s0_rh_sw1_tn_f16_f32",
                       "sm90_pp_64x128x64_c2x1_splitk2sr_s0_rh_sw1_tn_f16_f32_xab",
                       "sm90_coop_128x64x64_c1x2_splitk4sr_s0_rh_sw1_tn_f16_f32",
                       "sm90_pp_128x64x64_c1x2_splitk4sr_s0_rh_sw1_tn_f16_f32",
                       "sm90_pp_64x128x64_c2x1_splitk4sr_s0_rh_sw1_tn_f16_f32_xab"]
    # a short M (64x2048x8192: cuBLASLt's 64x32 tile, 64 along our N, in a 1x2 cluster) has only the
    # swapped twin: a 32-row plain tile is no wgmma tile
    assert names(lt_split_specs((64, 32), (1, 2), 2, 2, "NN", problem=Problem(64, 2048, 8192))) == [
        "sm90_pp_64x32x64_c1x2_splitk2sr_s0_rh_sw1_nn_f16_f32_xab"]


def test_a_wide_cluster_split_k_twin_gets_its_1x1_cluster_twin_after_it():
    """A split-K kernel of a 1x2 (or wider) cluster has a 1x1 twin of the same tile, schedule,
    split count, reduction and swap (run 644: 15 of 16 split-K winners that changed only their
    cluster went to 1x1); kernels already 1x1, and those not split-K, have none; no twin twice."""
    p = Problem(256, 512, 12288)
    split = lt_split_specs((64, 128), (2, 1), 4, 2, "TN", problem=p)
    assert names(unclustered(split, p)) == [
        "sm90_coop_128x64x64_c1x1_splitk4sr_s0_rh_sw1_tn_f16_f32",
        "sm90_pp_128x64x64_c1x1_splitk4sr_s0_rh_sw1_tn_f16_f32",
        "sm90_pp_64x128x64_c1x1_splitk4sr_s0_rh_sw1_tn_f16_f32_xab",
        "sm90_coop_128x64x64_c1x1_splitk4_s0_rh_sw1_tn_f16_f32"]
    assert unclustered(unclustered(split, p), p) == []  # 1x1 already
    assert unclustered(split + unclustered(split, p), p) == []  # each twin once: already offered
    persistent = lt_specs((128, 160), (2, 1), "TN", problem=Problem(16384, 4096, 4096))
    assert persistent and unclustered(persistent) == []  # only split-K kernels


def _store_with_choices(path) -> tuple[Store, Problem, Problem]:
    """A store where the autotuned baseline chose tile 128x160 on TN and 128x128 on NN of one
    shape, and nothing on another."""
    store = Store(path)
    p, q = Problem(16384, 4096, 4096), Problem(64, 64, 64)
    store.put_tuning(DEV, p, LT_IMPL.format("tn"), b"\x01" * 64, INFO, 800.0)
    store.put_tuning(DEV, p, LT_IMPL.format("nn"), b"\x02" * 64, INFO.replace("tile=29", "tile=20"), 810.0)
    return store, p, q


def test_the_prior_reads_the_stored_choices_of_each_layout(tmp_path):
    store, p, q = _store_with_choices(tmp_path / "s.sqlite")
    try:
        prior = lt_prior(store, DEV, [p, q], LT_TILES, LT_CLUSTERS)
        assert set(prior) == {p}  # no stored choice on q: nothing to suggest
        got = [(fam, s.layout, s.tile_m, s.tile_n, s.swap_ab) for fam, s in prior[p]]
        assert got[:2] == [("cutlass_sm90", "NN", 128, 128, True)] * 2
        assert ("cutlass_sm90", "TN", 128, 160, True) in got
        # an fp16-accumulator problem takes the fp32 choices (the baseline accumulates in fp32)
        p16 = Problem(16384, 4096, 4096, acc="fp16")
        assert {s.acc for _f, s in lt_prior(store, DEV, [p16], LT_TILES, LT_CLUSTERS)[p16]} == {"fp16"}
        assert lt_prior(store, "Other GPU", [p], LT_TILES, LT_CLUSTERS) == {}
        # a split-K choice seeds our split-K kernels of its tile
        r = Problem(256, 512, 12288)
        store.put_tuning(DEV, r, LT_IMPL.format("tn"), b"\x03" * 64, INFO.replace("tile=29", "tile=17").replace(
            "splitk=1", "splitk=4").replace("reduction=0", "reduction=2"), 12.0)
        got = names(s for _f, s in lt_prior(store, DEV, [r], LT_TILES, LT_CLUSTERS)[r])
        assert got[0] == "sm90_coop_128x64x64_c1x2_splitk4sr_s0_rh_sw1_tn_f16_f32"
        # cuBLASLt's own cluster first, then the 1x1 twins of those forms
        assert got[4:] == names(unclustered(lt_split_specs((64, 128), (2, 1), 4, 2, "TN", problem=r), r))
        assert got.index("sm90_coop_128x64x64_c1x1_splitk4sr_s0_rh_sw1_tn_f16_f32") == 4
    finally:
        store.close()


def test_an_fp16_problem_reads_its_own_accumulators_choice_first(tmp_path):
    """The fp16-accumulator baseline runs cuBLASLt in fp16 compute and stores its own pick: an fp16
    problem is seeded with that pick's kernels first, then with the fp32 pick's; an fp32 problem
    never reads the fp16 pick (H200, 2026-12-01: the fp16 autotuning chose 128x256 with a 2x1
    cluster where the fp32 one chose 128x160, and only the latter was ever offered)."""
    from gemmrl.search.lt_seed import choice_accs

    assert choice_accs("fp32") == ("fp32",) and choice_accs("fp16") == ("fp16", "fp32")
    store, p, _q = _store_with_choices(tmp_path / "s.sqlite")  # fp32 picks: TN 128x160, NN 128x128
    try:
        p16 = Problem(p.M, p.N, p.K, acc="fp16")
        only32 = names(s for _f, s in lt_prior(store, DEV, [p16], LT_TILES, LT_CLUSTERS)[p16])
        store.put_tuning(DEV, p16, LT_IMPL.format("nn"), b"\x04" * 64, INFO.replace("tile=29", "tile=23"), 700.0)
        own = names(lt_specs(LT_TILES[23], LT_CLUSTERS[3], "NN", "fp16", "fp16", p16))
        assert own and all(n.endswith(("_f16_f16", "_f16_f16_xab")) for n in own)
        got = names(s for _f, s in lt_prior(store, DEV, [p16], LT_TILES, LT_CLUSTERS)[p16])
        assert got[:len(own)] == own  # its own pick first (NN; no fp16 TN pick stored)
        assert got[len(own):] == [n for n in only32 if n not in own]  # then the fp32 picks, each spec once
        assert len(got) == len(set(got))
        # an fp32 problem of the shape: the fp32 picks only, as before
        assert names(s for _f, s in lt_prior(store, DEV, [p], LT_TILES, LT_CLUSTERS)[p]) == [
            n.replace("_f16_f16", "_f16_f32") for n in only32]
    finally:
        store.close()


def test_the_search_proposes_the_prior_first(tmp_path):
    """run_tune(lt_prior=...): the model-free policy's first batch on the shape leads with the
    suggestions; a policy that takes no prior refuses it."""
    from gemmrl.search.policy import Trial
    from gemmrl.search.run import run_tune

    store, p, _q = _store_with_choices(tmp_path / "s.sqlite")
    prior = lt_prior(store, DEV, [p], LT_TILES, LT_CLUSTERS)
    seen = []

    def evaluate(problem, candidates):
        seen.extend(c.name for c in candidates)
        return [Trial(problem, c, "ok", 1000.0, 0.9, {"stage": "time", "device_s": 0.1}) for c in candidates]
    try:
        run_tune([p], store, DEV, evaluate, candidates=8, batch=8, lt_prior=prior)
        want = [s.name for _f, s in prior[p]]
        assert seen[:3] == want[:3]  # the policy's prior slots (prior_top) take the first three
        with pytest.raises(ValueError, match="takes no transfer"):
            run_tune([p], store, DEV, evaluate, candidates=8, batch=8, lt_prior=prior, policy_name="random")
    finally:
        store.close()


def test_build_compiles_what_the_prior_puts_first(tmp_path, monkeypatch):
    """gemmrl build --tuned-in DB --seed-from-lt GPU: the first --top suggestions per shape (a
    dry run lists them); without --tuned-in, or naming a GPU the store lacks, a clear error."""
    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "s.sqlite"
    store, p, _q = _store_with_choices(db)
    store.close()
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("16384x4096x4096\n64x64x64\n")
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--seed-from-lt", "fake", "--shapes", str(shapes),
                                  "--acc", "fp32", "--top", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "on 1 of 2 shapes" in r.output and "cuBLASLt autotuned" in r.output
    assert "sm90_coop_128x128x64_c2x1_persist_s0_rh_sw1_nn_f16_f32_xab" in r.output
    assert "sm90_pp_128x128x64_c2x1_persist_s0_rh_sw1_nn_f16_f32_xab" in r.output
    r = CliRunner().invoke(main, ["build", "--seed-from-lt", "fake", "--shapes", str(shapes), "--dry-run"])
    assert r.exit_code == 2 and "--seed-from-lt goes with --tuned-in" in r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--seed-from-lt", "H100", "--shapes", str(shapes),
                                  "--dry-run"])
    assert r.exit_code == 1 and "H100" in r.output


def test_tune_refuses_the_lt_seed_for_a_policy_that_takes_none():
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--policy", "random", "--seed-from-lt"])
    assert r.exit_code == 2 and "the random policy takes none" in r.output


def test_build_leaves_out_the_suggestions_the_search_tried_there(tmp_path, monkeypatch):
    """build --seed-from-lt GPU plans what tune proposes on that GPU: on a shape with trials
    there, the suggestions not tried yet (the first --top of them)."""
    from gemmrl.search.policy import Candidate, Trial

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "s.sqlite"
    store, p, _q = _store_with_choices(db)
    first = [s for _f, s in lt_prior(store, DEV, [p], LT_TILES, LT_CLUSTERS)[p]]
    run = store.start_run("gemmrl tune", DEV, {}, {})
    t = Trial(p, Candidate("cutlass_sm90", first[0]), "ok", 900.0, 0.9, {"device_s": 0.1})
    store.record_trial(run, DEV, p, t.candidate.name, t.status, t.reward, t.time_us, t.to_dict())
    store.close()
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--seed-from-lt", "fake", "--shapes",
                                  "16384x4096x4096", "--acc", "fp32", "--top", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "not tried there yet on 1 of 1 shapes" in r.output
    assert first[0].name not in r.output and first[1].name in r.output and first[2].name in r.output
