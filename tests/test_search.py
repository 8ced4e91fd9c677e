"""The search logic on the CPU, against a simulated GPU.

The simulation: a candidate's true time is its family's analytic estimate_us times exp(g), where
g is a smooth function of tile and problem features (ping-pong pays off on small tiles, clusters
on large M or N, tile_k 128 on large K, stream-K on under-filled grids, swap_ab on tiny M, the
raw family loses ground as problems grow, ...) that a cost model can learn, plus a ripple over
tile_n that it cannot, plus +-5% deterministic noise. Some candidates fail: one CUTLASS tile and
cluster combination never builds (every shape), big raw tiles with split_k >= 16 are wrong
(every shape), and about 4% of (spec, shape) pairs are rejected or crash at random. The best
baseline is 0.92-1.22x the best pool kernel's time, so the exhaustive optimum's reward is ~1.
Everything is seeded; nothing here needs a GPU except the last test.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from gemmrl.core.problem import Problem
from gemmrl.core.shapes import subset
from gemmrl.search.policy import (Candidate, CostModel, ExhaustivePolicy, ModelFreePolicy, RandomPolicy, Trial,
                                  candidate_pool, mutations)
from gemmrl.search.reward import (ERROR_PENALTY_CAP, LENGTH_FREE_BYTES, LENGTH_PENALTY_CAP, error_penalty,
                                  length_penalty, reward)
from gemmrl.search.tune import gpu_evaluate, sample_efficiency, tune, write_curves
from gemmrl.space import registry

LAYOUTS = ("TN",)  # one layout keeps the simulated sweeps small; the logic is the same for two


# ---------------------------------------------------------------------------------------------
# The simulated GPU

def _u(*parts) -> float:
    h = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def _clip(x: float) -> float:
    return max(0.0, min(1.0, x))


def true_us(family: str, spec, problem: Problem) -> float:
    if family == "cutlass_sm90" and spec.schedule in ("ws", "tma"):
        # the lean one-tile-per-CTA kernels, as measured on the H100 (run 158): the ping-pong
        # twin's time less half a microsecond of fixed cost while the tiles fit one wave; 1.2x
        # its time on two waves, 1.45x on more. A wave is what the SMs hold at once: with few
        # stages two or more blocks share an SM (the H200's resident kernels, run 656)
        twin = replace(spec, schedule="pingpong", scheduler="persistent")
        tiles = -(-problem.M // spec.tile_m) * -(-problem.N // spec.tile_n)
        waves = -(-tiles // (132 * registry.get(family).mod().resident_blocks(spec)))
        slower = 1.0 if waves == 1 else 1.2 if waves == 2 else 1.45
        return true_us(family, twin, problem) * slower - (0.5 if waves == 1 else 0.0)
    nd = getattr(spec, "reduction", "deterministic") == "nondeterministic"
    # the simulated world prices a nondeterministic split-K kernel as its deterministic twin, plus
    # a modest hidden gain below: estimate_us's larger gain for it is a prior, not this world's truth
    est = registry.get(family).mod().estimate_us(replace(spec, reduction="deterministic") if nd else spec, problem)
    lM, lN, lK = math.log2(problem.M), math.log2(problem.N), math.log2(problem.K)
    g = 0.0
    if family == "cutlass_sm90":
        if spec.schedule == "pingpong":
            g += -0.4 if spec.tile_m * spec.tile_n <= 128 * 128 else 0.2
        if (spec.cluster_m, spec.cluster_n) == (2, 1):
            g += 0.1 - 0.35 * _clip((lM - 10) / 4)
        if (spec.cluster_m, spec.cluster_n) == (1, 2):
            g += 0.1 - 0.35 * _clip((lN - 10) / 4)
        if spec.tile_k == 128:
            g += 0.1 - 0.3 * _clip((lK - 11) / 3)
        if spec.scheduler == "streamk":
            g += 0.4 - 0.7 * (est < 20)
        if spec.scheduler == "splitk":
            g += 0.1 * math.log2(spec.splits) * _clip((lM + lN - 16) / 8)
            g -= 0.04 * math.log2(spec.splits) * nd
        if spec.swizzle > 1:
            g += 0.05 - 0.15 * (lN >= 12)
        g += 0.08 * (spec.layout == "NN") + 0.1 * math.sin(spec.tile_n / 40.0)
    else:
        gm = problem.N if spec.swap_ab else problem.M
        if spec.swap_ab:
            g += -0.6 if problem.M <= 64 and problem.N >= 256 else 0.2
        g += -0.3 * _clip((lK - 10) / 4) * (spec.stages == 4) + 0.3 * (spec.stages == 2)
        g += 0.5 * (spec.threads <= 32) + 0.2 * (spec.threads >= 256 and spec.block_m * spec.block_n <= 64 * 64)
        size = _clip((math.log2(problem.flops) - 30) / 6)
        g += 0.9 * size - 0.3 * (1 - size) + 0.08 * math.log2(spec.split_k) - 0.2 * (spec.block_m >= 2 * gm)
    noise = 0.05 * (2 * _u("noise", family, spec.name, problem.key()) - 1)
    return est * math.exp(g + noise)


def failure(family: str, spec, problem: Problem):
    """(status, stage, reason) of a simulated failure, or None."""
    if family == "cutlass_sm90" and spec.tile_n == 192 and spec.cluster_n == 2:
        return "rejected", "build", "static_assert failed (simulated)"
    if family == "raw" and spec.split_k >= 16 and spec.block_m * spec.block_n >= 64 * 128:
        return "rejected", "verify", "random test 1: relative error 3e-2 (simulated)"
    u = _u("fail", family, spec.name, problem.key())
    if u < 0.01:
        return "crashed", "time", "illegal memory access (simulated)"
    if u < 0.04:
        return "rejected", "verify", "exact test: 12 outputs differ (simulated)"
    return None


_BASELINES: dict = {}


def baseline_us(problem: Problem) -> float:
    if problem not in _BASELINES:
        best = min(true_us(f, s, problem) for f, s in candidate_pool(problem, LAYOUTS))
        _BASELINES[problem] = best * (0.92 + 0.3 * _u("baseline", problem.key()))
    return _BASELINES[problem]


class SimGPU:
    """evaluate(problem, candidates) -> trials, as gpu_evaluate's would be."""

    def __init__(self):
        self.evaluated: list[tuple[Problem, Candidate]] = []

    def __call__(self, problem: Problem, candidates: list[Candidate]) -> list[Trial]:
        out = []
        for c in candidates:
            self.evaluated.append((problem, c))
            why = failure(c.family, c.spec, problem)
            if why:
                status, stage, reason = why
                out.append(Trial(problem, c, status, details={
                    "stage": stage, "reason": reason, "device_s": 1.0 if status == "crashed" else 0.1}))
                continue
            t = true_us(c.family, c.spec, problem)
            score = reward(baseline_us(problem), t, True, 2e-4, 2e-4, 9000 if c.family == "cutlass_sm90" else 10600)
            out.append(Trial(problem, c, "ok", t, score, {"stage": "time", "device_s": 0.1 + 2e-4 * t}))
        return out


def optimum(problem: Problem) -> float:
    """The exhaustive sweep's best reward on a problem."""
    best = 0.0
    for t in SimGPU()(problem, [Candidate(f, s) for f, s in candidate_pool(problem, LAYOUTS)]):
        best = max(best, t.reward)
    return best


def candidates_to_reach(result, problem: Problem, target: float, budget: int) -> int:
    """How many of a run's candidates on `problem` it took to reach `target` reward; budget + 1
    when it never did."""
    best = 0.0
    for i, t in enumerate((t for t in result.trials if t.problem == problem), 1):
        best = max(best, t.reward)
        if best >= target:
            return i
    return budget + 1


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


PROBLEMS = subset(30)


@pytest.fixture(scope="module")
def sweeps():
    """The exhaustive sweep, the model-free policy and a random policy on the 30-shape subset."""
    exhaustive = tune(PROBLEMS, ExhaustivePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=10**6, batch=512)
    model_free = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=32, batch=8)
    rand = tune(PROBLEMS, RandomPolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=32, batch=8)
    return exhaustive, model_free, rand


# ---------------------------------------------------------------------------------------------
# reward

def test_reward_edge_cases():
    assert reward(10.0, 5.0, False) == 0.0  # any failed check: zero, however fast
    assert reward(10.0, 5.0, True) == pytest.approx(2.0)  # the speedup, no penalties
    assert reward(10.0, 5.0, True, 2e-4, 2e-4, LENGTH_FREE_BYTES) == pytest.approx(2.0)
    for bad in (0.0, -1.0, None, math.nan, math.inf):
        assert reward(10.0, bad, True) == 0.0
        assert reward(bad, 5.0, True) == 0.0
    # code length: 0.01 per 10 KiB beyond 8 KiB, capped
    assert length_penalty(LENGTH_FREE_BYTES + 10 * 1024) == pytest.approx(0.01)
    assert length_penalty(10**9) == LENGTH_PENALTY_CAP
    assert reward(10.0, 10.0, True, source_len=LENGTH_FREE_BYTES + 10 * 1024) == pytest.approx(0.99)
    # numerical error: proportional to rel_err / ref_err - 1, capped; as accurate as the
    # reference (or better) costs nothing; a tiny reference error is floored
    assert error_penalty(2e-4, 2e-4) == 0.0 and error_penalty(1e-5, 2e-4) == 0.0
    assert error_penalty(4e-4, 2e-4) == pytest.approx(0.02)
    assert error_penalty(1.0, 2e-4) == ERROR_PENALTY_CAP
    assert error_penalty(math.nan, 2e-4) == ERROR_PENALTY_CAP
    assert error_penalty(5e-5, 0.0) == 0.0  # floored at 1e-4
    assert error_penalty(None, None) == 0.0
    # never negative
    assert reward(1.0, 100.0, True, 1.0, 1e-4, 10**9) == 0.0
    # penalties (0.10 at most in all) only break near-ties: 11% faster beats any penalties
    assert reward(10.0, 9.0, True, 1.0, 1e-4, 10**9) > reward(10.0, 10.0, True)
    assert reward(10.0, 9.9, True, 1.0, 1e-4, 10**9) < reward(10.0, 10.0, True)


def test_trial_records_round_trip():
    p = Problem(128, 256, 512)
    for family in ("cutlass_sm90", "raw"):
        spec = registry.get(family).candidates(p, "TN", limit=1)[0]
        t = Trial(p, Candidate(family, spec, 12.5, "pool"), "ok", 11.0, 1.2, {"device_s": 0.2})
        back = Trial.from_dict(t.to_dict())
        assert back == t and back.key() == (family, spec.name)
    with pytest.raises(ValueError):
        Trial(p, Candidate("raw", spec), "timeout")


# ---------------------------------------------------------------------------------------------
# the space: pool and mutations

def test_pool_and_mutations_are_legal_and_local():
    for p in (Problem(64, 4096, 8192), Problem(4096, 4096, 4096), Problem(256, 64, 16384)):
        pool = candidate_pool(p, LAYOUTS)
        assert len({(f, s.name) for f, s in pool}) == len(pool)
        assert {f for f, _ in pool} == {"cutlass_sm90", "raw"}
        for f, s in pool:
            assert registry.get(f).valid(s, p) is None
        for f, s in pool[::97]:
            muts = mutations(f, s, p, LAYOUTS)
            assert muts, f"{s.name} has no legal neighbour on {p.shape}"
            for m in muts:
                assert registry.get(f).valid(m, p) is None and m.name != s.name
                changed = [k for k in s.__dataclass_fields__ if getattr(s, k) != getattr(m, k)]
                # one field, plus its coupled repair; into or out of the lean schedules the repair
                # also resets what one tile per CTA has no use for (scheduler, split count and
                # reduction, raster order and swizzle): the schedule and those alone
                if "schedule" in changed and {s.schedule, m.schedule} & {"ws", "tma"}:
                    assert set(changed) <= {"schedule", "scheduler", "splits", "reduction", "raster", "swizzle"}, changed
                else:
                    assert 1 <= len(changed) <= 3, changed
                assert all(getattr(m, k) == getattr(s, k) for k in ("dtype", "acc") if hasattr(s, k))
                assert m.layout in LAYOUTS


def test_raw_splits_arrive_with_the_fetch_add_and_the_cas_loop_is_a_mutation_away():
    """The raw pool's and heuristic's split-K specs arrive with one fetch-add (it beat its CAS twin in
    all 24 pairs timed, runs 810-817); a split spec's CAS twin is one mutation away, a mutation to
    split 1 drops the fetch-add, and the arrival field of an unsplit spec leads to split 2."""
    from gemmrl.space import raw

    p = Problem(128, 64, 8192)
    specs = [s for f, s in candidate_pool(p, LAYOUTS) if f == "raw"]
    assert specs and all(s.arrive == ("add" if s.split_k > 1 else "cas") for s in specs)
    assert {s.split_k for s in specs} >= {1, 2, 4, 8, 16}
    heur = raw.heuristic_specs(p, "TN")
    assert any(s.split_k > 1 for s in heur) and all(s.arrive == ("add" if s.split_k > 1 else "cas") for s in heur)
    fa = next(s for s in specs if s.split_k == 2 and s.layout == "TN")
    muts = mutations("raw", fa, p, LAYOUTS)
    assert replace(fa, arrive="cas") in muts
    assert replace(fa, split_k=1, arrive="cas") in muts and replace(fa, split_k=1) not in muts
    plain = replace(fa, split_k=1, arrive="cas")
    assert replace(plain, split_k=2, arrive="add") in mutations("raw", plain, p, LAYOUTS)
    # priced apart by the arrival's per-split latency alone
    s16 = replace(fa, split_k=16)
    gap = raw.estimate_us(replace(s16, arrive="cas"), p) - raw.estimate_us(s16, p)
    assert gap == pytest.approx((raw.SPLIT_US["cas"] - raw.SPLIT_US["add"]) * 16) and gap > 4.0


def test_the_staged_epilogue_is_in_the_pool_on_a_large_output_and_a_mutation_away_elsewhere():
    """epi='smem' (the tile of C staged in shared memory, 16-byte stores): the raw pool's and
    heuristic's unsplit specs take it where M*N >= 256K and K <= 1024 (its twins were faster in 8 of
    8 at 256K, runs 864-889), split specs and smaller or longer-K problems keep the direct epilogue;
    the pool's size does not change; either epilogue is one mutation from the other wherever N
    allows the staged one; the cost model tells the two apart."""
    from gemmrl.search.policy import _features
    from gemmrl.space import raw

    def raw_specs(p):
        return [s for f, s in candidate_pool(p, LAYOUTS) if f == "raw"]

    big = Problem(4096, 64, 64)
    specs = raw_specs(big)
    assert specs and {s.epi for s in specs if s.split_k == 1} == {"smem"}
    assert {s.epi for s in specs if s.split_k > 1} == {"direct"}
    assert raw.staged_epilogue(big) == "smem"
    heur = raw.heuristic_specs(big, "TN")
    assert heur and all(s.epi == ("smem" if s.split_k == 1 else "direct") for s in heur)
    for other in (Problem(2048, 64, 64), Problem(4096, 64, 2048), Problem(4096, 68, 64)):  # 128K; long K; N % 8
        assert raw.staged_epilogue(other) == "direct"
        assert all(s.epi == "direct" for s in raw_specs(other))
        assert all(s.epi == "direct" for s in raw.heuristic_specs(other, "TN"))
    # the same specs otherwise: only the epilogue field differs from the small problem's pool
    small = raw_specs(Problem(2048, 64, 64))
    assert len(specs) == len(small)
    assert {replace(s, epi="direct").key() for s in specs} == {s.key() for s in small}

    se = next(s for s in specs if s.split_k == 1)
    direct = replace(se, epi="direct")
    assert direct in mutations("raw", se, big, LAYOUTS) and se in mutations("raw", direct, big, LAYOUTS)
    odd = Problem(4096, 68, 64)  # N % 8: no staged epilogue
    assert raw.valid(replace(direct, layout="TN", epi="smem"), odd) is not None
    assert not [m for m in mutations("raw", replace(direct, layout="TN"), odd, LAYOUTS) if m.epi == "smem"]
    est = raw.estimate_us(direct, big)
    assert _features("raw", direct, big, est) != _features("raw", se, big, est)


# ---------------------------------------------------------------------------------------------
# the cost model

def test_the_pool_holds_resident_twins_where_k_is_short():
    """For K <= 512 (1024 where M or N is at most 256) the CUTLASS pool holds the lean kernels with
    few stages (two or more blocks an SM, cutlass_sm90.resident_pool) beside the enumerated specs;
    none for a longer K."""
    from gemmrl.space import cutlass_sm90 as cs

    def resident(p):
        return {s.name for f, s in candidate_pool(p, ("NN", "TN"))
                if f == "cutlass_sm90" and s.scheduler == "tile" and s.stages and cs.resident_blocks(s) > 1}

    short = Problem(128, 12288, 128)
    got = resident(short)
    # the H200's winners there and on two neighbours (run 656; all 25 resident winners of its
    # fp32 grid are in their shapes' pools)
    assert "sm90_ws_64x64x64_c1x1_tile_s2_rh_sw1_tn_f16_f32" in got
    assert "sm90_ws_64x128x64_c1x1_tile_s2_rh_sw1_tn_f16_f32" in resident(Problem(128, 12288, 64))
    assert "sm90_ws_64x128x64_c2x1_tile_s4_rh_sw1_nn_f16_f32" in resident(Problem(128, 16384, 256))
    assert len(got) >= 150  # both layouts
    # stages up to K's k-blocks: two for K = 128 with tile_k 64
    assert all(cs.CutlassSpec.from_name(n).stages == 2 for n in got if "x64_c" in n)
    # on a skinny output (M or N <= 256) up to K = 1024: runs 671-679's winners there, and none
    # for a longer K or a wider output
    assert "sm90_ws_64x64x128_c1x1_tile_s3_rh_sw1_tn_f16_f32" in resident(Problem(64, 16384, 1024))
    assert "sm90_ws_128x64x64_c1x2_tile_s4_rh_sw1_tn_f16_f32" in resident(Problem(16384, 128, 1024))
    assert not resident(Problem(128, 12288, 2048))
    assert not resident(Problem(512, 512, 1024))
    # a narrow N over many rows: their swapped twins too (run 656's winner there)
    assert "sm90_ws_128x96x64_c2x1_tile_s3_rh_sw1_tn_f16_f32_xab" in resident(Problem(12288, 256, 256))


def test_cost_model_ranking_improves_with_trials():
    train, held_out = PROBLEMS[::2], PROBLEMS[1::2]
    model = CostModel()

    def rank_corr():
        out = []
        for p in held_out:
            items = [(f, s) for f, s in candidate_pool(p, LAYOUTS) if failure(f, s, p) is None]
            out.append(spearman([model.predict_us(f, s, p) for f, s in items], [true_us(f, s, p) for f, s in items]))
        return float(np.mean(out)), float(np.min(out))

    before = rank_corr()
    assert model.predict_us("raw", candidate_pool(held_out[0], LAYOUTS)[-1][1], held_out[0]) == pytest.approx(
        registry.get("raw").mod().estimate_us(candidate_pool(held_out[0], LAYOUTS)[-1][1], held_out[0]))
    run = tune(train, RandomPolicy(layouts=LAYOUTS, seed=1), SimGPU(), per_shape_candidates=40, batch=8)
    model.observe(run.trials)
    after = rank_corr()
    assert model.observed() == sum(t.status == "ok" for t in run.trials)
    # measured (estimate_us calibrated on the H200): mean 0.943 -> 0.979, on shapes it never
    # saw; the rank error (1 - rho) falls by more than 40%, and the worst shape improves
    assert 1 - after[0] < 0.6 * (1 - before[0])
    assert after[1] > before[1]


# ---------------------------------------------------------------------------------------------
# the policies against the exhaustive sweep

def test_model_free_matches_exhaustive_with_a_fraction_of_the_candidates(sweeps):
    exhaustive, model_free, _ = sweeps
    assert all(exhaustive.counts[p] == len(candidate_pool(p, LAYOUTS)) for p in PROBLEMS)
    ex_reward, mf_reward = exhaustive.mean_best_reward(), model_free.mean_best_reward()
    # measured: exhaustive 1.049 with 28998 candidates; model-free 1.074 with 960 (3.3%)
    assert mf_reward >= 0.95 * ex_reward
    assert len(model_free.trials) <= 0.25 * len(exhaustive.trials)
    # candidates to 0.95 of the sweep's best, on the mean curve of six seeds: one seed's count swings
    # with any change to the pool or the model (seeds 0-9 gave 6 to more than 32, 2026-11-30), the
    # mean of six much less: 12 with the CAS-only raw pool, 15 with the fetch-add raw splits. Searched
    # one shape at a time with a fresh policy, the two pools reach the same best reward in 16 and in 32
    # candidates on all 30 shapes (21 search alike, 7 differ by the fetch-add twins alone, 2 in a few
    # raw candidates); the joint run's differences come through what its shapes share (one random
    # stream, the cost model, transfers between shapes)
    curves = [model_free.per_shape_curve()] + [
        tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS, seed=seed), SimGPU(), per_shape_candidates=32,
             batch=8).per_shape_curve() for seed in range(1, 6)]
    mean = [(x, sum(c[i][1] for c in curves) / len(curves)) for i, (x, _) in enumerate(curves[0])]
    eff = sample_efficiency(mean, exhaustive.per_shape_curve())
    assert eff["levels"][0.95]["a"] is not None and eff["levels"][0.95]["a"] <= 18, eff["levels"]
    assert eff["levels"][0.95]["b"] > 10 * eff["levels"][0.95]["a"]


def test_model_free_curve_dominates_random(sweeps):
    _, model_free, rand = sweeps
    mf, rd = dict(model_free.per_shape_curve()), dict(rand.per_shape_curve())
    assert set(mf) == set(rd) == set(range(1, 33))
    assert all(mf[n] > rd[n] for n in mf)
    assert all(a[1] <= b[1] for a, b in zip(model_free.per_shape_curve(), model_free.per_shape_curve()[1:]))
    # the run-order curve: one point per batch, x counts every candidate
    assert model_free.curve[-1][0] == len(model_free.trials)
    assert model_free.curve[-1][1] == pytest.approx(model_free.mean_best_reward())


def test_transfer_from_a_tuned_neighbour_saves_candidates():
    pairs = [((64, 4096, 8192), (64, 4096, 12288)), ((4096, 4096, 4096), (4096, 8192, 4096)),
             ((128, 1024, 16384), (128, 2048, 16384)), ((2048, 64, 2048), (2048, 128, 2048)),
             ((512, 512, 512), (512, 1024, 512)), ((8192, 8192, 256), (8192, 12288, 256)),
             ((256, 256, 4096), (256, 512, 4096)), ((16384, 1024, 1024), (12288, 1024, 1024))]

    cold_n, warm_n = [], []
    for q, p in pairs:
        q, p = Problem(*q), Problem(*p)
        target = 0.98 * optimum(p)
        cold = tune([p], ModelFreePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=48, batch=8)
        warm = tune([q, p], ModelFreePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=48, batch=8)
        cold_n.append(candidates_to_reach(cold, p, target, 48))
        warm_n.append(candidates_to_reach(warm, p, target, 48))
        assert any(t.candidate.origin == "transfer" for t in warm.trials if t.problem == p)
    # measured: cold [5, 49, 25, 4, 49, 49, 7, 49], after the neighbour [1, 49, 5, 5, 49, 49, 5, 1]:
    # the neighbour's winners are not always this shape's; shapes where neither run reached the
    # target within 48 candidates say nothing about transfer. (512x1024x512 reached it in 35
    # and 7 before the pool held the resident twins: its optimum is now one of them, lean
    # 64x144 with 4 stages, 5% faster than the lean 64x112 both runs find)
    reached = [(c, w) for c, w in zip(cold_n, warm_n) if min(c, w) < 49]
    print("cold", cold_n, "warm", warm_n)
    assert len(reached) >= 5, (cold_n, warm_n)
    assert sum(w <= c for c, w in reached) >= len(reached) - 2, (cold_n, warm_n)
    assert sum(w for _, w in reached) * 1.5 <= sum(c for c, _ in reached), (cold_n, warm_n)


class OtherGPU(SimGPU):
    """The same architecture with slower memory: memory-heavy shapes (low FLOPs per byte) take up
    to 40% longer whatever the kernel, and every kernel's time moves by up to +-6% more (a
    deterministic draw per spec and shape), so rankings mostly but not always carry over."""

    def __call__(self, problem, candidates):
        out = []
        for t in super().__call__(problem, candidates):
            if t.status == "ok":
                intensity = problem.flops / (2 * (problem.M * problem.K + problem.K * problem.N + problem.M * problem.N))
                f = (1 + 0.4 * _clip((256 - intensity) / 256)) * math.exp(0.12 * (_u("other", t.candidate.name,
                                                                                       problem.key()) - 0.5))
                t = Trial(problem, t.candidate, "ok", t.time_us * f, t.reward / f, t.details)
            out.append(t)
        return out


def test_a_prior_from_another_gpu_saves_candidates():
    """tune --transfer-from on the simulated pair of GPUs: the other GPU's ranking, proposed
    first, reaches 0.98 of this GPU's exhaustive optimum in fewer candidates than a cold start."""
    problems = [Problem(*s) for s in ((64, 4096, 8192), (4096, 4096, 4096), (128, 1024, 16384), (2048, 64, 2048),
                                      (512, 512, 512), (256, 256, 4096), (16384, 1024, 1024), (1024, 8192, 256))]

    # ten seeds of both searches: one seed's counts swing with any change to the pool (a spec more
    # or less moves every later draw); three seeds' sums still swung by a third (2026-11-30)
    cold_n, warm_n = [], []
    for seed in range(1, 11):
        other = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=seed), OtherGPU(), per_shape_candidates=48,
                     batch=8)
        for p in problems:
            target = 0.98 * optimum(p)
            cold = tune([p], ModelFreePolicy(layouts=LAYOUTS, seed=seed + 10), SimGPU(), per_shape_candidates=32,
                        batch=8)
            warm_policy = ModelFreePolicy(layouts=LAYOUTS, seed=seed + 10)
            for q in problems:  # as add_store_prior gives it: best first
                ranked = sorted((t for t in other.trials if t.problem == q and t.status == "ok"),
                                key=lambda t: -t.reward)
                warm_policy.add_prior(q, [(t.candidate.family, t.candidate.spec) for t in ranked])
            warm = tune([p], warm_policy, SimGPU(), per_shape_candidates=32, batch=8)
            assert [t.candidate.origin for t in warm.trials[:3]] == ["prior"] * 3
            cold_n.append(candidates_to_reach(cold, p, target, 32))
            warm_n.append(candidates_to_reach(warm, p, target, 32))
    # (33: not reached within 32) the other GPU's winner is often this one's; where it is not,
    # the three slots it takes in the first batch can cost a few candidates. Measured over the 80
    # searches (2026-11-30, the raw family's split-K arriving with a fetch-add): warm reached at
    # once 31 times, cold 10; warm reached within 32 on 62, cold on 58; no later than cold on 53;
    # 1136 candidates against cold's 1242. With the prior offered three slots of every batch
    # however it fared (before _prior_paying): 1254 against 1242, reached on 54
    print("cold", cold_n, "warm", warm_n)
    assert sum(w == 1 for w in warm_n) >= 2 * sum(c == 1 for c in cold_n) + 5, (cold_n, warm_n)
    assert sum(w <= 32 for w in warm_n) >= sum(c <= 32 for c in cold_n), (cold_n, warm_n)
    assert sum(w <= c for c, w in zip(cold_n, warm_n)) >= 0.6 * len(cold_n), (cold_n, warm_n)
    assert sum(warm_n) * 1.05 <= sum(cold_n), (cold_n, warm_n)


def test_a_prior_that_lost_here_stops_taking_slots():
    """On a shape searched here, the prior's suggestions lead the next batch while one of them is
    the fastest timed here; once `prior_top` of them have been timed and lost, it offers nothing."""
    p = Problem(4096, 4096, 1024)
    pool = [s for f, s in candidate_pool(p, LAYOUTS) if f == "cutlass_sm90"][:12]

    def trial(spec, us):
        return Trial(p, Candidate("cutlass_sm90", spec), "ok", us, 1.0, {})

    lost = ModelFreePolicy(layouts=LAYOUTS, seed=0)
    lost.add_prior(p, [("cutlass_sm90", s) for s in pool[4:]])
    lost.observe([trial(s, 10.0) for s in pool[4:7]] + [trial(pool[0], 5.0)])  # the prior's three: slower
    assert not [c for c in lost.propose(p, 8) if c.origin == "prior"]
    # a lost prior whose first suggestion (the other tuning's winner) was never tried here: that one
    # alone, once (the fp32 search had timed fp16 runners-up, never the fp16 winner's twin)
    head = ModelFreePolicy(layouts=LAYOUTS, seed=0)
    head.add_prior(p, [("cutlass_sm90", s) for s in pool[3:]])
    head.observe([trial(s, 10.0) for s in pool[4:7]] + [trial(pool[0], 5.0)])
    assert [c.spec for c in head.propose(p, 8) if c.origin == "prior"] == [pool[3]]
    head.observe([trial(pool[3], 11.0)])
    assert not [c for c in head.propose(p, 8) if c.origin == "prior"]

    leads = ModelFreePolicy(layouts=LAYOUTS, seed=0)
    leads.add_prior(p, [("cutlass_sm90", s) for s in pool[4:]])
    leads.observe([trial(s, 10.0) for s in pool[5:7]] + [trial(pool[4], 4.0), trial(pool[0], 5.0)])
    assert [c.spec for c in leads.propose(p, 8) if c.origin == "prior"] == pool[7:10]

    few = ModelFreePolicy(layouts=LAYOUTS, seed=0)  # two of the prior timed: too few to judge it by
    few.add_prior(p, [("cutlass_sm90", s) for s in pool[4:]])
    few.observe([trial(s, 10.0) for s in pool[4:6]] + [trial(pool[0], 5.0)])
    assert [c.spec for c in few.propose(p, 8) if c.origin == "prior"] == pool[6:9]


class Checked:
    """Wraps a policy and fails the test on any proposal that repeats a tried spec, is invalid
    for the problem, is quarantined, crashed before on the problem, or repeats within a batch."""

    def __init__(self, policy, quarantine: dict):
        self.policy, self.quarantine = policy, quarantine
        self.tried: dict = {}
        self.crashed: dict = {}
        self.proposed = 0
        self.broken_builds: set = set()

    def propose(self, problem, k):
        out = self.policy.propose(problem, k)
        assert len(out) <= k
        keys = [c.key() for c in out]
        assert len(set(keys)) == len(keys), "duplicate within a batch"
        for c in out:
            assert registry.get(c.family).valid(c.spec, problem) is None, c.name
            assert c.key() not in self.tried.get(problem, set()), f"{c.name} already tried on {problem.shape}"
            assert c.name not in self.quarantine.get(problem, set()), f"{c.name} is quarantined"
            assert c.name not in self.crashed.get(problem, set())
            if isinstance(self.policy, ModelFreePolicy):
                assert c.key() not in self.broken_builds, f"{c.name} did not build before"
        self.proposed += len(out)
        return out

    def observe(self, trials):
        trials = list(trials)
        for t in trials:
            self.tried.setdefault(t.problem, set()).add(t.key())
            if t.status == "crashed":
                self.crashed.setdefault(t.problem, set()).add(t.candidate.name)
            if t.details.get("stage") == "build":
                self.broken_builds.add(t.key())
        self.policy.observe(trials)


def test_no_duplicate_invalid_or_quarantined_proposal():
    problems = PROBLEMS[::3]
    # quarantine each problem's best exhaustive kernel and its families' first heuristic picks
    quarantine = {}
    for p in problems:
        trials = SimGPU()(p, [Candidate(f, s) for f, s in candidate_pool(p, LAYOUTS)])
        names = {max(trials, key=lambda t: t.reward).candidate.name}
        names |= {s.name for f in ("cutlass_sm90", "raw") for s in registry.get(f).candidates(p, "TN", limit=2)}
        quarantine[p] = names
    for policy in (ModelFreePolicy(layouts=LAYOUTS, quarantined=lambda p: quarantine[p], epsilon=0.3, seed=3),
                   RandomPolicy(layouts=LAYOUTS, quarantined=lambda p: quarantine[p], seed=3),
                   ExhaustivePolicy(layouts=LAYOUTS, quarantined=lambda p: quarantine[p])):
        checked = Checked(policy, quarantine)
        result = tune(problems, checked, SimGPU(), per_shape_candidates=40, batch=8)
        assert result.dropped == 0
        assert checked.proposed == len(result.trials) == 40 * len(problems)
        assert not any(t.candidate.name in quarantine[t.problem] for t in result.trials)


def test_a_spec_that_never_builds_is_not_proposed_again():
    policy = ModelFreePolicy(layouts=LAYOUTS, seed=0)
    p0 = Problem(4096, 4096, 4096)
    broken = next(s for f, s in candidate_pool(p0, LAYOUTS) if f == "cutlass_sm90" and failure(f, s, p0)
                  and failure(f, s, p0)[1] == "build")
    policy.observe(SimGPU()(p0, [Candidate("cutlass_sm90", broken)]))
    for p in PROBLEMS[::5]:
        if registry.get("cutlass_sm90").valid(broken, p) is None:
            assert broken.name not in {c.name for c in policy.propose(p, 200)}


def test_budgets_are_respected():
    # candidates per shape
    result = tune(PROBLEMS[:6], ModelFreePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=13, batch=5)
    assert all(result.counts[p] == 13 for p in PROBLEMS[:6]) and not result.stopped
    # device seconds: the run stops once the budget is spent, shrinking its last batches
    sim = SimGPU()
    result = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS), sim, per_shape_candidates=32, batch=8,
                  device_budget_s=25.0)
    spent = sum(t.details["device_s"] for t in result.trials)
    assert result.stopped == "device budget"
    assert result.device_s == pytest.approx(spent)
    assert 25.0 <= spent <= 25.0 + max(t.details["device_s"] for t in result.trials)
    assert len(sim.evaluated) == len(result.trials) < 32 * len(PROBLEMS)


def test_wall_clock_deadline_stops_between_batches():
    sim, now = SimGPU(), [0.0]

    def evaluate(problem, cands):  # each batch takes 10 s of wall time
        now[0] += 10.0
        return sim(problem, cands)
    result = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS), evaluate, per_shape_candidates=16, batch=8,
                  deadline=35.0, clock=lambda: now[0])
    assert result.stopped == "wall-clock deadline"
    assert len(sim.evaluated) == 4 * 8  # batches started at 0, 10, 20 and 30 s; none at 40 s
    assert set(result.best) == set(PROBLEMS[:2])


def test_a_reserve_for_the_final_timing_stops_the_search_before_the_deadline():
    """tune --finish-s: no batch starts once the time left is what the final timing of the shapes
    reached (the one about to start included) needs; without a reserve the same run goes on to
    the deadline."""
    def run(reserve):
        sim, now, seen = SimGPU(), [0.0], []

        def evaluate(problem, cands):  # each batch takes 10 s of wall time
            now[0] += 10.0
            return sim(problem, cands)

        def keep(reached):
            seen.append(reached)
            return reserve(reached)
        result = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS), evaluate, per_shape_candidates=16, batch=8,
                      deadline=100.0, clock=lambda: now[0], reserve=None if reserve is None else keep)
        return result, sim, seen

    result, sim, _ = run(None)
    assert len(sim.evaluated) == 10 * 8  # batches at 0, 10, ..., 90 s: five shapes
    # 8 s a shape reached, and the longest batch so far (10 s) with it: at 40 s the third shape's
    # first batch keeps 24 + 10 s (74 < 100); at 60 s the fourth shape's would keep 32 + 10 (102):
    # stop, where the batch would end at 70 s and its final timing at 102
    result, sim, seen = run(lambda reached: 8.0 * len(reached))
    assert result.stopped == "wall-clock deadline"
    assert len(sim.evaluated) == 6 * 8 and set(result.best) == set(PROBLEMS[:3])
    assert seen[0] == frozenset(PROBLEMS[:1]) and seen[-1] == frozenset(PROBLEMS[:4])
    # a reserve larger than the whole window: nothing is searched
    result, sim, _ = run(lambda reached: 1000.0)
    assert result.stopped == "wall-clock deadline" and not sim.evaluated


def test_a_finish_deadline_keeps_the_longest_batch_too():
    """tune --finish-s: a batch that starts must also end before the final timing's reserve.
    The H200's 2026-11-30j run: CUTLASS batches of about 60 s began inside the window and the
    final timing was cut. A slow batch after fast ones raises what every later start keeps."""
    sim, now, starts = SimGPU(), [0.0], []
    lengths = iter([5.0, 60.0] + [5.0] * 100)  # the second batch is a slow one

    def evaluate(problem, cands):
        starts.append(now[0])
        now[0] += next(lengths)
        return sim(problem, cands)
    result = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS), evaluate, per_shape_candidates=16, batch=8,
                  deadline=150.0, clock=lambda: now[0], reserve=lambda reached: 20.0)
    assert result.stopped == "wall-clock deadline"
    # starts at 0 (keeps 20), 5 (keeps 20 + 5: 30 < 150), 65 (keeps 20 + 60: 145 < 150); at 70 it
    # would keep 80 again (150, not below 150): stop. Keeping only the reserve, batches would have
    # started up to 125 s, where another slow one ends at 185, past the window
    assert starts == [0.0, 5.0, 65.0]
    assert now[0] + 20.0 <= 150.0
    # --wall-s (no reserve) bounds only when batches start
    sim2, now2 = SimGPU(), [0.0]

    def evaluate2(problem, cands):
        now2[0] += 60.0
        return sim2(problem, cands)
    result = tune(PROBLEMS, ModelFreePolicy(layouts=LAYOUTS), evaluate2, per_shape_candidates=16, batch=8,
                  deadline=100.0, clock=lambda: now2[0])
    assert len(sim2.evaluated) == 2 * 8  # started at 0 and 60 s, ended at 120


def test_final_reserve_grows_with_shapes_race_and_unbuilt_incumbents():
    from gemmrl.search.tune import (CUTLASS_BUILD_S, FINAL_S_PER_SHAPE, FINAL_S_START, RACE_S_PER_CONTENDER,
                                    final_reserve_s)

    assert final_reserve_s(0) == 0.0
    assert final_reserve_s(0, unbuilt=3, kernel_us=[5.0]) == 0.0  # no shape: no final timing at all
    # one timing worker's start, then each shape
    assert final_reserve_s(5) == FINAL_S_START + 5 * FINAL_S_PER_SHAPE
    assert final_reserve_s(5, race=3) == FINAL_S_START + 5 * (FINAL_S_PER_SHAPE + 2 * RACE_S_PER_CONTENDER)
    # a contender costs less than a shape: a race of 3 over 5 shapes keeps less than 5 more shapes would
    assert final_reserve_s(5, race=3) < final_reserve_s(10)
    # unbuilt incumbents compile side by side: 17 on 16 cores are two waves, each a slice with its own
    # timing worker; 16 are one
    assert final_reserve_s(20, unbuilt=17, cores=16) == 2 * (FINAL_S_START + CUTLASS_BUILD_S) + 20 * FINAL_S_PER_SHAPE
    assert final_reserve_s(20, unbuilt=16, cores=16) == FINAL_S_START + CUTLASS_BUILD_S + 20 * FINAL_S_PER_SHAPE
    # a millisecond kernel's rounds are long: 5 s a millisecond of its best baseline, at most 16 s more
    base = FINAL_S_START + 2 * FINAL_S_PER_SHAPE
    assert final_reserve_s(2, kernel_us=[3.0, 1500.0]) == pytest.approx(base + 0.015 + 7.5)
    assert final_reserve_s(1, kernel_us=[50_000.0]) == FINAL_S_START + FINAL_S_PER_SHAPE + 16.0
    # what the H200 measured (2026-12-01, run 996): 30 microsecond shapes raced by 2 after 17 builds on 16
    # cores took about 175 s; the reserve keeps more than that, but not twice as much (it kept 421 s)
    kept = final_reserve_s(30, race=2, unbuilt=17, cores=16, kernel_us=[10.0] * 28 + [120.0] * 2)
    assert 175 < kept < 350
    # a fresh machine with no build cache carried (2026-12-01): run 1012's final timing of 20 shapes, 15 + 3
    # kernels built, took 208 s; run 1013's of 10 shapes, 16 + 6 built, 190 s (a 45 s wave kept 171)
    kept = final_reserve_s(20, race=2, unbuilt=18, cores=16, kernel_us=[9.3, 5.4, 6.6, 8.7, 31.3, 143.6, 8.3, 5.5,
                                                                        10.8, 21.2, 7.3, 6.1, 43.2, 6.6, 17.2,
                                                                        18.4, 29.4, 42.7, 7.7, 10.0])
    assert 208 < kept < 2 * 208
    kept = final_reserve_s(10, race=2, unbuilt=22, cores=16,
                           kernel_us=[16.6, 6.6, 413.5, 30.6, 56.1, 80.8, 105.2, 818.2, 100.0, 100.0])
    assert 190 < kept < 2 * 190
    for bad in ({"shapes": -1}, {"shapes": 1, "race": 0}, {"shapes": 1, "cores": 0},
                {"shapes": 1, "kernel_us": [float("nan")]}, {"shapes": 1, "kernel_us": [-1.0]}):
        with pytest.raises(ValueError):
            final_reserve_s(**bad)


def test_allow_filter_applies_to_every_proposal():
    # e.g. generic (CUTLASS) specs only where already built: here, only a fixed library of them
    library = {s.name for f, s in candidate_pool(PROBLEMS[0], LAYOUTS) if f == "cutlass_sm90"}
    library = set(sorted(library)[:5])
    seen = []

    def allow(family, spec, problem):
        seen.append(family)
        return family == "raw" or spec.name in library
    policy = ModelFreePolicy(layouts=LAYOUTS, allow=allow)
    result = tune(PROBLEMS[:8], policy, SimGPU(), per_shape_candidates=24, batch=8)
    names = [t.candidate for t in result.trials]
    assert {"raw", "cutlass_sm90"} <= set(seen)
    assert all(c.family == "raw" or c.name in library for c in names)
    assert any(c.family == "cutlass_sm90" for c in names)  # the library is used, not avoided


def test_resume_from_history_never_reproposes():
    problems = PROBLEMS[:8]
    first = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=12, batch=4)
    history = [Trial.from_dict(t.to_dict()) for t in first.trials]  # as if read back from a store
    sim = SimGPU()
    second = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=1), sim, per_shape_candidates=30, batch=8,
                  history=history)
    before = {(t.problem, t.key()) for t in history}
    assert not any((p, c.key()) in before for p, c in sim.evaluated)
    assert all(second.counts[p] == 30 for p in problems)
    assert len(second.trials) == 18 * len(problems)
    assert all(second.best_reward(p) >= first.best_reward(p) for p in problems)
    assert second.per_shape_curve()[11][1] == pytest.approx(first.per_shape_curve()[11][1])
    # a history that already meets the budget: nothing to do
    third = tune(problems, ModelFreePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=12, history=history)
    assert third.trials == [] and third.mean_best_reward() == pytest.approx(first.mean_best_reward())


def test_more_searches_that_many_beyond_each_shapes_history():
    """tune(more=N): N new candidates per shape whatever its history (shapes searched to
    different depths before), where per_shape_candidates would leave the deep ones alone."""
    problems = PROBLEMS[:4]
    shallow = tune(problems[:2], ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=4, batch=4)
    deep = tune(problems[2:], ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=12, batch=4)
    history = [Trial.from_dict(t.to_dict()) for t in shallow.trials + deep.trials]
    again = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=1), SimGPU(), per_shape_candidates=8, batch=3,
                 history=history, more=5)
    assert [again.counts[p] for p in problems] == [9, 9, 17, 17]
    assert len(again.trials) == 5 * len(problems)
    plain = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=1), SimGPU(), per_shape_candidates=8, batch=3,
                 history=history)
    assert [plain.counts[p] for p in problems] == [8, 8, 12, 12]  # the deep shapes: nothing more
    with pytest.raises(ValueError, match="must not be negative"):
        tune(problems, ModelFreePolicy(layouts=LAYOUTS), SimGPU(), per_shape_candidates=8, more=-1)


def test_tune_drops_repeated_and_invalid_proposals():
    p = Problem(1024, 1024, 1024)
    good = [Candidate(f, s) for f, s in candidate_pool(p, LAYOUTS)[:3]]
    invalid = Candidate("cutlass_sm90", good[0].spec.__class__(tile_m=96))

    class Sloppy:
        def propose(self, problem, k):
            return [good[0], good[0], invalid, good[1], good[2]][:k]

        def observe(self, trials):
            pass

    sim = SimGPU()
    result = tune([p], Sloppy(), sim, per_shape_candidates=10, batch=5)
    assert [c.name for _, c in sim.evaluated] == [c.name for c in good]
    assert result.counts[p] == 3 and result.dropped == 2 + 5  # second batch: all three tried + the invalid


def test_sample_efficiency_and_curve_files(tmp_path, sweeps):
    exhaustive, model_free, rand = sweeps
    eff = sample_efficiency([(1, 0.5), (2, 0.9), (4, 1.0)], [(1, 0.1), (10, 0.95), (100, 1.0)])
    assert eff["target"] == 1.0 and eff["final_ratio"] == 1.0 and eff["b_at_budget_a"] == 0.1
    assert eff["levels"][0.9] == {"a": 2, "b": 10, "saving": 5.0}
    assert eff["levels"][0.99] == {"a": 4, "b": 100, "saving": 25.0}
    curves = {"exhaustive": exhaustive.per_shape_curve(), "model-free": model_free.per_shape_curve(),
              "random": rand.per_shape_curve()}
    csv_path, png_path = write_curves(curves, tmp_path / "report" / "sample_efficiency",
                                      title="simulated, 30 shapes")
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "policy,candidates,mean_best_reward"
    assert len(lines) == 1 + sum(len(c) for c in curves.values())
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# the real evaluator

def test_scale_to_stored_carries_a_session_time_to_the_stored_baselines_clock():
    from gemmrl.search.tune import scale_to_stored

    # the reference ran 10% slower in this session than when stored: candidates' times shrink
    assert scale_to_stored(100.0, 110.0) == pytest.approx(100.0 / 110.0)
    # a candidate at the reference's own session time then gets reward 1 against the stored time
    t = 110.0 * scale_to_stored(100.0, 110.0)
    assert reward(100.0, t, True, None, None, None) == pytest.approx(1.0)
    # no session time (the reference failed or was not timed): no scaling
    for session in (None, 0.0, -1.0):
        assert scale_to_stored(100.0, session) == 1.0
    assert scale_to_stored(0.0, 50.0) == 1.0


def test_gpu_evaluate_stops_at_the_candidate_that_lost_the_cuda_context(tmp_path, monkeypatch):
    """After a candidate's sticky CUDA error the batch's later candidates would fail their checks
    too and be stored as wrong: evaluation stops there (in a worker: the process exits and
    run_batch quarantines the culprit and runs the rest of the batch anew)."""
    from types import SimpleNamespace

    from gemmrl.bench import worker
    from gemmrl.runtime import spec_impl
    from gemmrl.store.db import Store
    from gemmrl.verify import checks

    class FakeSpecImpl:
        def __init__(self, spec):
            self.spec = spec

        def source(self, problem):
            return "// " + self.spec.name

        def prepare(self, problem):
            return lambda *args: None

    verified = []

    def fake_verify(impl, problem, **kw):
        verified.append(impl.spec.name)
        ok = impl.spec.name != "wild"
        return checks.CheckResult(ok, "" if ok else "AcceleratorError: an illegal memory access was encountered")
    monkeypatch.setattr(spec_impl, "SpecImpl", FakeSpecImpl)
    monkeypatch.setattr(checks, "verify", fake_verify)
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    monkeypatch.setattr(worker, "cuda_context_error", lambda: "AcceleratorError: an illegal memory access")
    cands = [Candidate("raw", SimpleNamespace(name=n)) for n in ("first", "wild", "after")]
    store = Store(tmp_path / "store.db")
    run = store.start_run("x", "test-device", {}, {})
    evaluate = gpu_evaluate(store, "test-device", lambda problem: 20.0, run_id=run)
    with pytest.raises(worker.CudaContextLost, match="candidate wild on 64x64x64"):
        evaluate(Problem(64, 64, 64), cands)
    assert verified == ["first", "wild"]
    assert store.verification("test-device", Problem(64, 64, 64), "wild")["passed"] is False


@pytest.mark.gpu
def test_gpu_evaluate_builds_verifies_and_times(tmp_path):
    from gemmrl.store.db import Store

    p = Problem(256, 512, 1024)
    store = Store(tmp_path / "store.db")
    cands = [Candidate("raw", s) for s in registry.get("raw").candidates(p, "TN", limit=2)]
    evaluate = gpu_evaluate(store, "test-device", lambda problem: 20.0)
    trials = evaluate(p, cands)
    assert [t.candidate for t in trials] == cands
    assert any(t.status == "ok" for t in trials)
    for t in trials:
        assert t.status in ("ok", "rejected") and t.details["device_s"] >= 0
        assert "reference" not in t.details  # the store has no baseline for the shape
        if t.status == "ok":
            d = t.details
            assert t.time_us > 0 and t.time_us == d["raw_us"]
            assert t.reward == pytest.approx(reward(20.0, t.time_us, True, d["rel_err"], d["ref_err"], d["source_len"]))
            assert d["build_s"] >= 0 and d["batch_build_s"] >= 0  # the host's share, beside device_s
        else:
            assert t.reward == 0.0 and t.details["reason"]
    # with a stored baseline, it is timed beside the candidates and their times are scaled by
    # its stored / session time (stored here at twice what it runs: times double)
    run = store.start_run("x", "test-device", {}, {})
    store.record_session(run, "s", "test-device", p, "kernel", "kernel:v1", {"torch.matmul": {
        "median_us": 1e3, "n": 10, "status": "ok"}})
    scaled = gpu_evaluate(store, "test-device", lambda problem: 1e3)(p, cands[:1])[0]
    assert scaled.status == "ok", scaled.details
    ref = scaled.details["reference"]
    assert ref["impl"] == "torch.matmul" and ref["stored_us"] == 1e3 and 0 < ref["session_us"] < 1e3
    assert scaled.time_us == pytest.approx(scaled.details["raw_us"] * 1e3 / ref["session_us"])
    assert scaled.reward == pytest.approx(reward(1e3, scaled.time_us, True, scaled.details["rel_err"],
                                                 scaled.details["ref_err"], scaled.details["source_len"]))
    result = tune([p], ModelFreePolicy(families=("raw",), layouts=("TN",)), evaluate, per_shape_candidates=4,
                  batch=4, history=trials)
    assert result.counts[p] == 4 and len(result.trials) == 2


def test_every_policy_takes_the_same_filter_and_make_policy_names_them():
    """tune --policy: the random order and the exhaustive sweep propose only what --built-only or
    --match allow, as the model-free policy does, so a sample-efficiency study compares searches
    over one candidate set (scripts/sample-efficiency.py)."""
    from gemmrl.search.run import POLICIES, make_policy

    p = Problem(1024, 1024, 4096)
    allow = lambda family, spec, problem: family == "raw" and spec.layout == "TN"  # noqa: E731
    for name in POLICIES:
        pol = make_policy(name, layouts=LAYOUTS, allow=allow, seed=1)
        got = pol.propose(p, 1000)
        assert got and all(c.family == "raw" and c.spec.layout == "TN" for c in got), name
    every = make_policy("exhaustive", layouts=LAYOUTS).propose(p, 10**6)
    assert {(c.family, c.spec.name) for c in every} == {(f, s.name) for f, s in candidate_pool(p, LAYOUTS)}
    assert isinstance(make_policy("random", layouts=LAYOUTS, seed=3), RandomPolicy)
    with pytest.raises(ValueError, match="unknown policy 'greedy'"):
        make_policy("greedy")


def test_tune_refuses_a_transfer_for_a_policy_that_takes_none():
    from click.testing import CliRunner

    from gemmrl.cli import main

    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--policy", "exhaustive", "--transfer-from", "h200"])
    assert r.exit_code == 2 and "the exhaustive policy takes none" in r.output


@pytest.mark.gpu
def test_tune_search_only_sweeps_the_raw_pool_and_times_no_winner(tmp_path):
    """gemmrl tune --policy exhaustive --search-only on a store of its own: the baselines (the
    reward's yardstick), every spec of the (matched) pool timed once as a trial, and no race,
    final timing or report: the trials a sample-efficiency study reads."""
    import os
    import subprocess
    import sys

    from gemmrl.search.policy import candidate_pool
    from gemmrl.store.db import Store

    p = Problem(256, 512, 1024)
    db = tmp_path / "sweep.sqlite"
    r = subprocess.run([sys.executable, "-m", "gemmrl.cli", "tune", "--shapes", p.shape, "--family", "raw",
                        "--layouts", "TN", "--match", "_64x64x64_w2x2_s4_k1", "--policy", "exhaustive",
                        "--candidates", "1000", "--search-only",
                        "--db", str(db), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "GEMMRL_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "search only: no race and no final timing" in r.stderr
    store = Store(db)
    dev = store.devices()[0]
    names = [t["candidate"] for t in store.trials(dev)]
    assert len(names) == 4 and sorted(names) == sorted(
        s.name for f, s in candidate_pool(p, ("TN",), ("raw",)) if "_64x64x64_w2x2_s4_k1" in s.name)
    timed = {r[0] for r in store.db.execute("SELECT DISTINCT impl FROM measurements")}
    assert "torch.matmul" in timed and not any(i.startswith("gemmrl") for i in timed), timed
    assert not (tmp_path / "out").exists()  # no report


@pytest.mark.gpu
def test_tune_builds_three_shapes_small_batches_ahead_in_one_wave(tmp_path):
    """gemmrl tune --more 2 --build-ahead 6 over three shapes on a GPU: the first shape's batch and
    the next two shapes' are compiled together once, before the first is timed; each shape then
    times the two kernels built for it (search only: no race, no final timing)."""
    import os
    import subprocess
    import sys

    from gemmrl.store.db import Store

    shapes = tmp_path / "shapes.txt"
    shapes.write_text("256x512x1024\n512x512x1024\n512x256x1024\n")
    db = tmp_path / "ahead.sqlite"
    r = subprocess.run([sys.executable, "-m", "gemmrl.cli", "tune", "--shapes", str(shapes), "--family", "raw",
                        "--layouts", "TN", "--match", "_64x64x64_w2x2_s4_k1", "--more", "2", "--build-ahead", "6",
                        "--search-only", "--db", str(db), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "GEMMRL_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr[-3000:]
    waves = [line for line in r.stderr.splitlines() if "kernels for the next" in line]
    # one wave; a raw kernel's build may serve several shapes (one source): 6 jobs, up to 6 builds
    assert len(waves) == 1 and re.search(r"built [2-6] kernels for the next 3 shapes' batches", waves[0]), \
        r.stderr[-3000:]
    store = Store(db)
    dev = store.devices()[0]
    rows = store.trials(dev)
    per = {}
    for t in rows:
        per.setdefault((t["M"], t["N"], t["K"]), []).append(t["status"])
    assert per == {(256, 512, 1024): ["ok", "ok"], (512, 512, 1024): ["ok", "ok"], (512, 256, 1024): ["ok", "ok"]}
    # the evaluator found every kernel built: none of the trials compiled its own
    assert all(t["record"]["details"].get("build_s") == 0.0 for t in rows), [t["record"]["details"] for t in rows]


def test_on_a_searched_shape_the_prior_offers_its_first_untried_suggestions():
    """add_prior on a shape the search has trials of: the first `prior_top` suggestions not tried
    yet lead the next batch, however many tried ones come before them in the prior (a seed from
    cuBLASLt's own tile, whose first kernels an earlier search had timed, offered nothing)."""
    p = Problem(4096, 4096, 1024)
    pool = [s for f, s in candidate_pool(p, LAYOUTS) if f == "cutlass_sm90"][:8]
    policy = ModelFreePolicy(layouts=LAYOUTS, seed=0)
    policy.observe(SimGPU()(p, [Candidate("cutlass_sm90", s) for s in pool[:4]]))  # searched: 4 tried
    policy.add_prior(p, [("cutlass_sm90", s) for s in pool])  # its first four are the tried ones
    assert policy.prior_top == 3
    got = policy.propose(p, 8)
    assert [c.spec for c in got if c.origin == "prior"] == pool[4:7]
    assert [c.spec for c in got[:3]] == pool[4:7]


def _recording(sim):
    batches = []

    def evaluate(problem, cands):
        batches.append((problem, [c.key() for c in cands]))
        return sim(problem, cands)
    return evaluate, batches


def test_small_batches_of_the_next_shapes_are_built_ahead_together():
    """tune's `ahead` (tune --build-ahead): a --more 2 search compiled 2 kernels at a time on 16
    cores (H200, 2026-12-01: 4 candidates in 99 s over 30 shapes). A batch smaller than
    ahead_kernels now proposes the next shapes' first batches too and builds them all at once;
    each of those shapes then evaluates exactly what was built for it, and the run times as many
    candidates per shape as one without it."""
    problems = PROBLEMS[:7]
    sim, waves = SimGPU(), []
    evaluate, batches = _recording(sim)
    result = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=0), evaluate, per_shape_candidates=0, batch=8,
                  more=2, ahead=lambda pairs: waves.append([(p, [c.key() for c in cs]) for p, cs in pairs]),
                  ahead_kernels=6)
    assert [[p for p, _ in w] for w in waves] == [problems[0:3], problems[3:6]]  # the last shape: no one after it
    assert [b for w in waves for b in w] == batches[:6]  # built ahead = evaluated, batch for batch
    assert [p for p, _ in batches] == problems and all(len(keys) == 2 for _, keys in batches)
    assert result.counts == {p: 2 for p in problems} and len(result.trials) == 14
    # without it: the same shapes, as many candidates, nothing built ahead
    plain = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=0, batch=8, more=2)
    assert plain.counts == result.counts
    # a batch as large as ahead_kernels builds only itself (the evaluator's own build_batch)
    waves.clear()
    tune(problems[:3], ModelFreePolicy(layouts=LAYOUTS, seed=0), SimGPU(), per_shape_candidates=0, batch=8, more=6,
         ahead=lambda pairs: waves.append(pairs), ahead_kernels=6)
    assert waves == []


def test_a_wave_built_ahead_keeps_its_length_before_the_deadline():
    """Under --finish-s a wave (its builds and its first evaluation) counts like a long batch: the
    shapes built in it are evaluated while only their own evaluation fits, and no new wave starts
    unless one as long as the longest so far fits too; a wave takes no shape the reserve would
    stop the search before."""
    problems = PROBLEMS[:6]
    now, waves = [0.0], []

    def ahead(pairs):
        waves.append([p for p, _ in pairs])
        now[0] += 50.0

    sim = SimGPU()
    evaluate, batches = _recording(sim)

    def timed(problem, cands):
        now[0] += 1.0
        return evaluate(problem, cands)
    result = tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=0), timed, per_shape_candidates=0, batch=8, more=2,
                  deadline=100.0, clock=lambda: now[0], reserve=lambda reached: 10.0 * len(reached),
                  ahead=ahead, ahead_kernels=6)
    # the wave: shapes 0-2 built by 50 s, shape 0 evaluated by 51; shapes 1 and 2 keep only their
    # reserve (52 + 20, 53 + 30); shape 3 would start a wave: 53 + 40 + 51 >= 100, stop
    assert waves == [problems[:3]]
    assert [p for p, _ in batches] == problems[:3] and result.stopped == "wall-clock deadline"
    # a reserve of 40 s a shape: the wave stops at the shape the search could not reach
    now[0], waves[:] = 0.0, []
    tune(problems, ModelFreePolicy(layouts=LAYOUTS, seed=0), timed, per_shape_candidates=0, batch=8, more=2,
         deadline=100.0, clock=lambda: now[0], reserve=lambda reached: 40.0 * len(reached), ahead=ahead,
         ahead_kernels=6)
    assert waves == [problems[:2]]


def test_a_policy_failing_on_a_shape_of_a_wave_leaves_that_shape_alone():
    problems = PROBLEMS[:4]

    class Flaky(ModelFreePolicy):
        def propose(self, problem, k):
            if problem == problems[1]:
                raise RuntimeError("no options")
            return super().propose(problem, k)

    sim, waves = SimGPU(), []
    evaluate, batches = _recording(sim)
    result = tune(problems, Flaky(layouts=LAYOUTS, seed=0), evaluate, per_shape_candidates=0, batch=8, more=2,
                  ahead=lambda pairs: waves.append([p for p, _ in pairs]), ahead_kernels=6)
    assert waves == [[problems[0], problems[2], problems[3]]]
    assert [p for p, _ in batches] == [problems[0], problems[2], problems[3]]
    assert result.failed == {problems[1]: "RuntimeError: no options"}
