"""gemmrl's own kernels end to end on a GPU: candidates of both families built, timed together,
the fastest kept, verified by the full harness, and the choice stored."""

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(512, 768, 1024), (64, 64, 12288)])
def test_best_of_both_families_passes_the_harness(tmp_path, shape):
    from gemmrl.core.problem import Problem
    from gemmrl.search.best_of import BestOf
    from gemmrl.space import registry
    from gemmrl.store.db import Store
    from gemmrl.verify.checks import verify

    store = Store(tmp_path / "s.sqlite")
    p = Problem(*shape)
    impl = BestOf([registry.get("cutlass_sm90"), registry.get("raw")], top=2, store=store,
                  device="gpu", log=print)
    impl.prebuild([p], log=print)
    fn = impl.prepare(p)
    r = verify(impl, p, fn=fn)
    print(shape, impl.chosen.name, r.passed, r.reason, r.details.get("rel_err"))
    assert r.passed, r.reason
    assert store.get_tuning("gpu", p, impl.name) is not None


def _searched(tmp_path, times):
    """A store after a tune of 256x512x1024 whose search timed two raw TN kernels at `times` (us,
    stood in: the search's own timing is not what these tests are about): (store, problem, specs)."""
    from gemmrl.core.problem import Problem
    from gemmrl.search.policy import Candidate, ModelFreePolicy, Trial
    from gemmrl.search.run import run_tune
    from gemmrl.space import registry
    from gemmrl.store.db import Store

    store = Store(tmp_path / "s.sqlite")
    p = Problem(256, 512, 1024)
    specs = registry.get("raw").candidates(p, "TN", limit=2)
    assert len(specs) == 2
    trials = [Trial(p, Candidate("raw", s), "ok", us, 1000.0 / us, {"device_s": 0.01}) for s, us in zip(specs, times)]

    class Fixed(ModelFreePolicy):
        def propose(self, problem, n, exclude=()):
            return [t.candidate for t in trials if t.key() not in set(exclude)][:n]

    run_tune([p], store, "gpu", lambda problem, cands: [t for t in trials if t.candidate in cands],
             candidates=2, batch=2, layouts=("TN",), policy=Fixed(layouts=("TN",)))
    return store, p, specs


def test_a_race_beside_the_baselines_picks_a_contender_and_passes_the_harness(tmp_path):
    """The race times its contenders in the baselines' rounds (bench's v3 protocol) and stores a
    contender, never a baseline."""
    from gemmrl.search.race import Race
    from gemmrl.search.run import TUNED
    from gemmrl.verify.checks import verify

    store, p, specs = _searched(tmp_path, (20.0, 20.5))
    logs = []
    race = Race(store, "gpu", k=2, log=logs.append)
    assert race.specs(p) == specs
    fn = race.prepare(p)
    assert race.chosen.spec in specs
    line = next(m for m in logs if "candidates" in m)
    print(line)
    assert "beside" in line and "by paired ratios" in line
    assert not any(m.startswith(f"{p.shape} race company") for m in logs), logs
    r = verify(race, p, fn=fn)
    assert r.passed, r.reason
    assert race.chosen.spec.name in store.get_tuning("gpu", p, TUNED)["info"]


def test_a_stored_winner_outside_the_top_k_races_the_incumbent_on_the_gpu(tmp_path):
    """The race fix of 05026ec on the GPU: where the search stored a new best that the top k leaves
    out (its own trial slower than the incumbent's older one), both kernels are timed in one race
    beside the baselines, the faster is stored, and it passes the harness."""
    import json
    from dataclasses import asdict

    from gemmrl.search.race import Race
    from gemmrl.search.run import TUNED
    from gemmrl.verify.checks import verify

    store, p, specs = _searched(tmp_path, (20.0, 26.0))
    run = store.start_run("gemmrl tune", "gpu", {}, {})
    store.record_verification(run, "gpu", p, TUNED, True, "", {"impl": {"name": TUNED, "chosen": {
        "family": "raw", "name": specs[0].name, "spec": asdict(specs[0])}}})  # the incumbent
    store.put_tuning("gpu", p, TUNED, json.dumps({"family": "raw", "spec": asdict(specs[1])}).encode(),
                     "search", 26.0)  # a later search's pick, stored untimed beside the incumbent
    logs = []
    race = Race(store, "gpu", k=1, log=logs.append)
    assert race.specs(p) == [specs[0], specs[1]]
    fn = race.prepare(p)
    assert race.chosen.spec in specs
    assert "beside" in next(m for m in logs if "candidates" in m)
    r = verify(race, p, fn=fn)
    assert r.passed, r.reason
    stored = store.get_tuning("gpu", p, TUNED)
    assert race.chosen.spec.name in stored["info"] and stored["info"] != "search"


@pytest.mark.timing
def test_the_race_pre_pass_prunes_a_contender_three_times_slower_on_the_gpu():
    """pick_fastest(prune=RACE_PRUNE) on the GPU: a contender doing the same GEMM three times is
    timed in the pre-pass, left out of the timed rounds with a 'pruned' record, and the fastest
    is picked from rounds beside the company alone."""
    import torch

    from gemmrl.bench.timing import RACE_PRUNE, KernelSettings, pick_fastest
    from gemmrl.core.problem import Problem

    def once(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    def thrice(a, b_nn, b_tn, c):
        for _ in range(3):
            torch.matmul(a, b_nn, out=c)

    def base(a, b_nn, b_tn, c):
        torch.matmul(a, b_tn.t(), out=c)

    p = Problem(2048, 2048, 2048)
    settings = KernelSettings(target_ci=0.005, stat="paired", max_s=1.0)
    best, res = pick_fastest(p, {"once": once, "thrice": thrice}, settings=settings, company={"base": base},
                             prune=RACE_PRUNE)
    print({k: (r["status"], r.get("median_us"), r["details"].get("pruned_ratio")) for k, r in res.items()})
    assert best == "once"
    assert res["thrice"]["status"] == "pruned" and 2.0 < res["thrice"]["details"]["pruned_ratio"] < 4.0
    assert res["once"]["status"] == "ok" and "base" in res["once"]["details"]["paired"]
    assert "thrice" not in res["once"]["details"]["paired"]  # never in the timed rounds
