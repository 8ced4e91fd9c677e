"""The tuning job on the CPU: trials stored and resumed, winners kept for the runtime, and a
candidate that kills its worker quarantined while the rest of its batch is still evaluated."""

import json

from gemmrl.core.problem import Problem
from gemmrl.search.best_of import BestOf
from gemmrl.search.policy import ModelFreePolicy, Trial
from gemmrl.search.run import TUNED, isolated_evaluator, run_tune
from gemmrl.space import registry
from gemmrl.store.db import Store
import worker_tasks

P1, P2 = Problem(512, 768, 1024), Problem(4096, 4096, 1024)


def fake_evaluate(problem, candidates):
    # a made-up speed: bigger CTA tiles are better on big problems, smaller on small ones
    out = []
    for c in candidates:
        tile = getattr(c.spec, "tile_m", getattr(c.spec, "block_m", 64))
        r = 1.0 + (tile / 256 if problem.M >= 4096 else 64 / tile) * 0.2
        out.append(Trial(problem, c, "ok", 10.0 / r, r, {"device_s": 0.01}))
    return out


def test_trials_are_stored_resumed_and_winners_kept(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    res = run_tune([P1, P2], store, "H100", fake_evaluate, candidates=6, batch=3, layouts=("TN",),
                   policy=ModelFreePolicy(layouts=("TN",), seed=0))
    assert len(res.trials) == 12 and len(store.trials("H100")) == 12
    # resume with a larger budget: only the difference is evaluated, nothing twice
    res2 = run_tune([P1, P2], store, "H100", fake_evaluate, candidates=9, batch=3, layouts=("TN",),
                    policy=ModelFreePolicy(layouts=("TN",), seed=1))
    assert len(res2.trials) == 6
    rows = store.trials("H100")
    assert len(rows) == 18
    per = {}
    for r in rows:
        per.setdefault((r["M"], r["N"], r["K"]), []).append(r["candidate"])
    assert all(len(v) == len(set(v)) == 9 for v in per.values())
    # the winner is kept as 'gemmrl-tuned' and the runtime implementation reads it back
    for p in (P1, P2):
        t = store.get_tuning("H100", p, TUNED)
        assert t is not None
        d = json.loads(bytes(t["choice"]).decode())
        spec = registry.get(d["family"]).spec_type()(**d["spec"])
        tuned = BestOf(list(registry.FAMILIES.values()), store=store, device="H100", name=TUNED, search=False)
        assert tuned._stored(p) == spec
        best = max((r for r in rows if (r["M"], r["N"], r["K"]) == (p.M, p.N, p.K)), key=lambda r: r["reward"])
        assert best["candidate"] == spec.name


def test_a_run_cut_mid_search_keeps_the_winners_it_found(tmp_path):
    """A tune stopped in its search (the machine lost, a timeout's SIGTERM) has stored each
    shape's best so far; a resume with nothing left to search stores the same winners."""
    import pytest

    store = Store(tmp_path / "s.sqlite")
    calls = []

    def cut_after_two_batches(problem, candidates):
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the SIGTERM handler's SystemExit does to the loop
        calls.append(problem)
        return fake_evaluate(problem, candidates)

    with pytest.raises(KeyboardInterrupt):
        run_tune([P1, P2], store, "H100", cut_after_two_batches, candidates=6, batch=3, layouts=("TN",),
                 policy=ModelFreePolicy(layouts=("TN",), seed=0))
    rows = store.trials("H100")
    searched = {(r["M"], r["N"], r["K"]) for r in rows}
    assert len(rows) == 6 and searched
    for key in searched:
        best = max((r for r in rows if (r["M"], r["N"], r["K"]) == key), key=lambda r: r["reward"])
        got = store.get_tuning("H100", Problem(*key), TUNED)
        assert got is not None and got["info"].startswith(best["candidate"] + " ")
    # a shape never reached has no winner; a worse trial never replaces a better one
    for p in (P1, P2):
        if (p.M, p.N, p.K) not in searched:
            assert store.get_tuning("H100", p, TUNED) is None
    before = {p: store.get_tuning("H100", p, TUNED) for p in (P1, P2)}

    def never(problem, candidates):
        raise AssertionError("nothing is left to evaluate for a searched shape")

    done = [Problem(*k) for k in searched if sum((r["M"], r["N"], r["K"]) == k for r in rows) >= 3]
    run_tune(done, store, "H100", never, candidates=3, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=0))
    for p in done:
        assert store.get_tuning("H100", p, TUNED)["info"] == before[p]["info"]


def test_a_crashing_candidate_is_quarantined_and_its_batch_goes_on(tmp_path, monkeypatch):
    store = Store(tmp_path / "s.sqlite")
    cands = ModelFreePolicy(layouts=("TN",), seed=0).propose(P1, 3)
    monkeypatch.setenv("GEMMRL_TEST_BAD", cands[1].name)
    logs = []
    evaluate, close = isolated_evaluator(store, "H100", str(tmp_path / "s.sqlite"), lambda p: 5.0,
                                         log=logs.append, task=worker_tasks.fake_evaluate_task, timeout_s=60)
    try:
        trials = evaluate(P1, cands)
    finally:
        close()
    by = {t.candidate.name: t for t in trials}
    assert set(by) == {c.name for c in cands}
    assert by[cands[1].name].status == "crashed" and "SIGSEGV" in by[cands[1].name].details["reason"]
    assert by[cands[0].name].status == by[cands[2].name].status == "ok"
    assert by[cands[2].name].time_us == 4.0
    assert cands[1].name in store.quarantined("H100", P1)
    assert any("quarantined" in m for m in logs)


def test_a_new_shape_set_learns_from_the_stores_other_shapes(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    run_tune([P2], store, "H100", fake_evaluate, candidates=6, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=0))
    p3 = Problem(4096, 4096, 2048)  # P2's neighbour, never tuned
    policy = ModelFreePolicy(layouts=("TN",), seed=0)
    res = run_tune([p3], store, "H100", fake_evaluate, candidates=3, batch=3, layouts=("TN",), policy=policy)
    # P2's trials taught the cost model and are not re-run or counted as this run's
    assert policy.model.observed() == 6 + 3
    assert len(res.trials) == 3 and all(t.problem == p3 for t in res.trials)
    # P2's winner was proposed for its neighbour as a transfer
    best_p2 = json.loads(bytes(store.get_tuning("H100", P2, TUNED)["choice"]).decode())["spec"]
    assert any(t.candidate.origin == "transfer" and t.candidate.spec.__dict__ == best_p2 for t in res.trials)
    # another device's trials teach nothing
    fresh = ModelFreePolicy(layouts=("TN",), seed=0)
    run_tune([p3], store, "H200", fake_evaluate, candidates=3, batch=3, layouts=("TN",), policy=fresh)
    assert fresh.model.observed() == 3


def test_match_limits_the_search_to_matching_kernels_and_resumes_from_all_trials(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    run_tune([P1], store, "H100", fake_evaluate, candidates=4, batch=4, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=0))
    res = run_tune([P1], store, "H100", fake_evaluate, candidates=10, batch=3, layouts=("TN",),
                   match=r"splitk[0-9]+sr", families=("cutlass_sm90",))
    # the four earlier trials count towards the 10; the six new ones are all separate-reduction kernels
    assert len(res.trials) == 6
    assert all(t.candidate.spec.reduction == "separate" for t in res.trials)
    assert len({t.candidate.name for t in res.trials}) == 6


def test_policy_filter_combines_built_only_and_match():
    from gemmrl.search.run import policy_filter
    from gemmrl.space.cutlass_sm90 import CutlassSpec

    assert policy_filter() is None
    allow = policy_filter(match="_pp_")
    pp = CutlassSpec(64, 128, 64, schedule="pingpong")
    assert allow("cutlass_sm90", pp, P1) and not allow("cutlass_sm90", CutlassSpec(), P1)


def test_a_winner_that_fails_the_final_verification_gives_way_to_the_runner_up(tmp_path):
    from gemmrl.search.run import promote_runner_up

    store = Store(tmp_path / "s.sqlite")
    run_tune([P1], store, "H100", fake_evaluate, candidates=3, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=0))
    ranked = sorted((r for r in store.trials("H100")), key=lambda r: -r["reward"])
    first = json.loads(bytes(store.get_tuning("H100", P1, TUNED)["choice"]).decode())
    assert registry.get(first["family"]).spec_type()(**first["spec"]).name == ranked[0]["candidate"]

    t = promote_runner_up(store, "H100", P1, "random test 1: relative error 2.3e-03 over the limit")
    assert t is not None and t.candidate.name == ranked[1]["candidate"]
    d = json.loads(bytes(store.get_tuning("H100", P1, TUNED)["choice"]).decode())
    assert registry.get(d["family"]).spec_type()(**d["spec"]).name == ranked[1]["candidate"]
    assert "runner-up" in store.get_tuning("H100", P1, TUNED)["info"]
    veto = [r for r in store.trials("H100") if r["status"] == "rejected"]
    assert len(veto) == 1 and veto[0]["candidate"] == ranked[0]["candidate"]
    assert veto[0]["record"]["details"] == {"stage": "final", "reason": "random test 1: relative error 2.3e-03 over the limit"}

    # a resumed tune keeps the runner-up, and the veto is not a candidate: 2 more are tried
    res = run_tune([P1], store, "H100", fake_evaluate, candidates=5, batch=3, layouts=("TN",),
                   policy=ModelFreePolicy(layouts=("TN",), seed=1))
    assert len(res.trials) == 2
    assert res.best[P1].candidate.name != ranked[0]["candidate"]
    d = json.loads(bytes(store.get_tuning("H100", P1, TUNED)["choice"]).decode())
    assert registry.get(d["family"]).spec_type()(**d["spec"]).name != ranked[0]["candidate"]

    # every candidate vetoed in turn: the shape is left without a winner
    while (t := promote_runner_up(store, "H100", P1, "exact test failed")) is not None:
        pass
    assert store.get_tuning("H100", P1, TUNED) is None
    assert promote_runner_up(store, "H100", P1, "again") is None


def test_rejected_winners_reads_the_runs_final_checks():
    from gemmrl.search.run import rejected_winners

    store = Store(":memory:")
    run = store.start_run("gemmrl tune", "H100", {}, {})
    store.record_verification(run, "H100", P1, TUNED, False, "random test 1: too far", {})
    store.record_verification(run, "H100", P2, TUNED, True, "", {})
    store.record_session(run, "s1", "H100", P2, "kernel", "kernel:v1",
                         {TUNED: {"status": "wrong", "n": 0, "details": {"reason": "timed output wrong"}}})
    other = store.start_run("gemmrl tune", "H100", {}, {})
    store.record_verification(other, "H100", P2, TUNED, False, "another run", {})
    got = rejected_winners(store, "H100", [P1, P2], run)
    assert got == {P1: "random test 1: too far", P2: "kernel timing: timed output wrong"}
    assert rejected_winners(store, "H100", [P1], run) == {P1: "random test 1: too far"}
    store.record_verification(run, "H100", P1, TUNED, True, "", {})  # the runner-up passed
    assert P1 not in rejected_winners(store, "H100", [P1, P2], run)


# --- tune --transfer-from: another GPU's tuning seeds this one's search -----------------------

def _tuned_elsewhere(store, device="NVIDIA H200"):
    """Tune P1 and P2 on `device` with the fake GPU; returns each shape's stored winner's name."""
    run_tune([P1, P2], store, device, fake_evaluate, candidates=6, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=0))
    return {p: store.get_tuning(device, p, TUNED)["info"].split()[0] for p in (P1, P2)}


def test_transfer_from_another_gpu_proposes_its_winners_first(tmp_path):
    from gemmrl.search.run import add_store_prior

    store = Store(tmp_path / "s.sqlite")
    won = _tuned_elsewhere(store)
    seen = []

    def record(problem, candidates):
        seen.append((problem, [c for c in candidates]))
        return fake_evaluate(problem, candidates)

    res = run_tune([P1, P2], store, "NVIDIA H100 80GB HBM3", record, candidates=4, batch=4, layouts=("TN",),
                   policy=ModelFreePolicy(layouts=("TN",), seed=3), transfer_from="NVIDIA H200")
    for p in (P1, P2):
        first = next(cands for q, cands in seen if q == p)
        # the other GPU's winner leads this GPU's first batch, and its runners-up follow
        assert first[0].name == won[p] and first[0].origin == "prior"
        assert [c.origin for c in first[:3]] == ["prior"] * 3
        others = sorted((r for r in store.trials("NVIDIA H200", [p]) if r["status"] == "ok"),
                        key=lambda r: -r["reward"])
        assert {c.name for c in first[1:3]} <= {r["candidate"] for r in others}
    # nothing of the other GPU counts as tried or timed here: every prior suggestion was timed anew
    assert len(res.trials) == 8 and len(store.trials("NVIDIA H100 80GB HBM3")) == 8
    # a fresh policy gets suggestions for both shapes, best first, and nothing else of it
    pol = ModelFreePolicy(layouts=("TN",))
    assert add_store_prior(pol, store, "NVIDIA H200", "NVIDIA H100 80GB HBM3") == 2
    for p in (P1, P2):
        assert pol.prior[p][0][1].name == won[p] and len(pol.prior[p]) == 6
    assert pol.model.observed() == 0 and not pol.tried and not pol.ok
    assert add_store_prior(ModelFreePolicy(layouts=("TN",)), store, "NVIDIA H200", "H100", problems=[P2]) == 1


def test_transfer_from_reaches_shapes_the_other_gpu_never_tuned(tmp_path):
    from gemmrl.search.run import add_store_prior

    store = Store(tmp_path / "s.sqlite")
    won = _tuned_elsewhere(store)
    pol = ModelFreePolicy(layouts=("TN",), seed=0)
    add_store_prior(pol, store, "NVIDIA H200", "H100")
    unseen = Problem(4096, 4096, 2048)  # nearest tuned shape: P2 (4096x4096x1024)
    got = pol.propose(unseen, 4)
    assert got[0].name == won[P2] and got[0].origin == "prior"


def test_transfer_from_refuses_this_gpu_and_unknown_ones(tmp_path):
    import click
    import pytest

    from gemmrl.cli import _check_transfer_source
    from gemmrl.search.run import add_store_prior

    store = Store(tmp_path / "s.sqlite")
    _tuned_elsewhere(store)
    rid = store.start_run("gemmrl tune", "NVIDIA H200", {"capability": "9.0"}, {})
    store.finish_run(rid)
    with pytest.raises(click.BadParameter, match="is this GPU"):
        _check_transfer_source(store, "NVIDIA H200", "NVIDIA H200", "9.0")
    with pytest.raises(click.BadParameter, match="no tuning on 'NVIDIA A100'.*'NVIDIA H200'"):
        _check_transfer_source(store, "NVIDIA A100", "NVIDIA H100 80GB HBM3", "9.0")
    with pytest.raises(click.BadParameter, match="compute capability 9.0, this GPU 10.0"):
        _check_transfer_source(store, "NVIDIA H200", "NVIDIA B200", "10.0")
    assert _check_transfer_source(store, "NVIDIA H200", "NVIDIA H100 80GB HBM3", "9.0") == "NVIDIA H200"
    assert _check_transfer_source(store, "h200", "NVIDIA H100 80GB HBM3", "9.0") == "NVIDIA H200"  # short name
    with pytest.raises(click.BadParameter, match="is this GPU"):
        _check_transfer_source(store, "h200", "NVIDIA H200", "9.0")
    with pytest.raises(ValueError, match="nothing tuned on 'GPU X'"):
        add_store_prior(ModelFreePolicy(layouts=("TN",)), store, "GPU X", "H100")


def test_transfer_from_the_other_accumulator_seeds_searched_shapes_with_twins(tmp_path):
    """tune --acc fp16 --transfer-from GPU:fp32: the fp32 tuning's winner and runners-up, each as
    its fp16-accumulator twin, lead the next batch of shapes this search has visited already
    (once each), and the same GPU may be the source."""
    from dataclasses import replace

    from gemmrl.search.run import add_store_prior, store_prior

    store = Store(tmp_path / "s.sqlite")
    won32 = _tuned_elsewhere(store, "NVIDIA H200")  # fp32 tuning of P1, P2
    h1, h2 = replace(P1, acc="fp16"), replace(P2, acc="fp16")
    # an fp16 search that visited both shapes already
    run_tune([h1, h2], store, "NVIDIA H200", fake_evaluate, candidates=2, batch=2, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=5))
    tried16 = {r["candidate"] for r in store.trials("NVIDIA H200", [h1, h2])}
    prior = store_prior(store, "NVIDIA H200", [h1, h2], "fp32", "fp16")
    assert set(prior) == {h1, h2}
    for p, q in ((P1, h1), (P2, h2)):
        first = prior[q][0][1]
        assert first.acc == "fp16" and first.name == won32[p].replace("_f32", "_f16").replace("_fp32_", "_fp16_")
        assert all(s.acc == "fp16" for _f, s in prior[q])
    # only the fp32 tuning is taken, and only the shapes asked for
    assert set(store_prior(store, "NVIDIA H200", [h2], "fp32", "fp16")) == {h2}
    # bf16 tuning in the store (fp32 accumulation only) has no fp16-accumulator twin: left out, not an
    # error (build --transfer-from h200:fp32 --acc fp16 raised ProblemError once runs 979-981 were in)
    run_tune([replace(P1, dtype="bf16")], store, "NVIDIA H200", fake_evaluate, candidates=2, batch=2,
             layouts=("TN",), policy=ModelFreePolicy(layouts=("TN",), seed=2))
    assert set(store_prior(store, "NVIDIA H200", [h1, h2], "fp32", "fp16")) == {h1, h2}
    seen = []

    def record(problem, candidates):
        seen.append((problem, list(candidates)))
        return fake_evaluate(problem, candidates)

    run_tune([h1, h2], store, "NVIDIA H200", record, more=3, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=6), transfer_from="NVIDIA H200", transfer_acc="fp32")
    for q in (h1, h2):
        first = next(c for p, c in seen if p == q)
        fresh = [s.name for _f, s in prior[q] if s.name not in tried16][:3]  # the batch's 3 places
        assert fresh, "the fp32 winners' twins were all tried already: the test shows nothing"
        assert [c.name for c in first if c.origin == "prior"] == fresh
    # the same GPU and accumulator is still refused
    import pytest
    with pytest.raises(ValueError, match="is this GPU"):
        add_store_prior(ModelFreePolicy(layouts=("TN",)), store, "NVIDIA H200", "NVIDIA H200")
    assert add_store_prior(ModelFreePolicy(layouts=("TN",)), store, "NVIDIA H200", "NVIDIA H200",
                           source_acc="fp32", target_acc="fp16") == 2


def test_transfer_from_the_fp16_tuning_seeds_a_bf16_search_with_input_type_twins(tmp_path):
    """tune --dtype bf16 --transfer-from GPU:fp16/fp32: the fp16-input tuning's winner and
    runners-up, each as its bf16 twin (same tiles, schedule and accumulator), lead the bf16
    search's first batch; only fp16-input tuning is taken, and the same GPU may be the source
    (the first bf16 tunes, 2026-12-01, started from the cost model alone)."""
    from dataclasses import replace

    import pytest

    from gemmrl.search.run import add_store_priors, store_prior

    store = Store(tmp_path / "s.sqlite")
    won16 = _tuned_elsewhere(store, "NVIDIA H200")  # fp16 inputs, fp32 accumulation: P1, P2
    # and fp16 accumulation, which no bf16 problem has: left out, not an error (the real store's)
    run_tune([replace(P1, acc="fp16")], store, "NVIDIA H200", fake_evaluate, candidates=2, batch=2,
             layouts=("TN",), policy=ModelFreePolicy(layouts=("TN",), seed=1))
    b1, b2 = replace(P1, dtype="bf16"), replace(P2, dtype="bf16")
    prior = store_prior(store, "NVIDIA H200", [b1, b2], source_dtype="fp16", target_dtype="bf16")
    assert set(prior) == {b1, b2}
    for p, q in ((P1, b1), (P2, b2)):
        first = prior[q][0][1]
        assert first.dtype == "bf16" and first.acc == "fp32"
        twin_name = won16[p].replace("_f16_f32", "_bf16_f32") if won16[p].startswith("sm90") else won16[p] + "_bf16"
        assert first.name == twin_name, (first.name, won16[p])
        assert all(s.dtype == "bf16" for _f, s in prior[q])
    # without the input-type mapping, the fp16 tuning says nothing about bf16 problems
    assert store_prior(store, "NVIDIA H200", [b1, b2]) == {}
    # a bf16 source (none here) gives nothing; the same GPU and types is refused
    assert store_prior(store, "NVIDIA H200", [b1], source_dtype="bf16", target_dtype="bf16") == {}
    with pytest.raises(ValueError, match="is this GPU"):
        add_store_priors(ModelFreePolicy(layouts=("TN",)), store, [("NVIDIA H200", None, "bf16")], "NVIDIA H200",
                         target_dtype="bf16")
    seen = []

    def record(problem, candidates):
        seen.append((problem, list(candidates)))
        return fake_evaluate(problem, candidates)

    run_tune([b1, b2], store, "NVIDIA H200", record, candidates=3, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=6), transfer_from=[("NVIDIA H200", None, "fp16")])
    for q in (b1, b2):
        first = next(c for p, c in seen if p == q)
        assert [c.name for c in first if c.origin == "prior"] == [s.name for _f, s in prior[q]][:3]
        assert all(c.spec.dtype == "bf16" for c in first)
    with pytest.raises(ValueError, match="mix input types"):
        run_tune([b1, P2], store, "NVIDIA H200", record, candidates=1, layouts=("TN",),
                 transfer_from=[("NVIDIA H200", None, "fp16")])


def test_transfer_source_names_an_accumulator_after_a_colon(tmp_path):
    import click
    import pytest

    from gemmrl.cli import _check_transfer_source, split_transfer_source

    assert split_transfer_source("h200:fp32") == ("h200", "fp32", None)
    assert split_transfer_source("NVIDIA H200") == ("NVIDIA H200", None, None)
    assert split_transfer_source("NVIDIA H200: FP16") == ("NVIDIA H200", "fp16", None)
    # IN/ACC: the tuning of that input type too (the fp16 tuning for a bf16 run)
    assert split_transfer_source("h200:fp16/fp32") == ("h200", "fp32", "fp16")
    assert split_transfer_source("NVIDIA H200:BF16/FP32") == ("NVIDIA H200", "fp32", "bf16")
    with pytest.raises(click.BadParameter, match="name the GPU"):
        split_transfer_source(":fp32")
    with pytest.raises(click.BadParameter, match="names an input type"):
        split_transfer_source("h200:fp32/fp32")
    with pytest.raises(click.BadParameter, match="names an input type"):
        split_transfer_source("h200:fp16/bf16")
    store = Store(tmp_path / "s.sqlite")
    _tuned_elsewhere(store)
    assert _check_transfer_source(store, "h200", "NVIDIA H200", "9.0", cross_acc=True) == "NVIDIA H200"
    with pytest.raises(click.BadParameter, match="is this GPU"):
        _check_transfer_source(store, "h200", "NVIDIA H200", "9.0", cross_acc=False)


def test_several_transfer_sources_interleave_by_rank():
    """tune --transfer-from A --transfer-from B: each source's winner leads, then each one's second,
    ...; a kernel both suggest comes once, where it first appears."""
    from gemmrl.search.run import merged_priors
    from gemmrl.space import cutlass_sm90

    specs = [s for s in cutlass_sm90.enumerate_specs("TN") if s.scheduler == "persistent"][:5]
    a, b, c, d, e = (("cutlass_sm90", s) for s in specs)
    other = Problem(64, 64, 64)
    got = merged_priors([{P1: [a, b, c], other: [e]}, {P1: [d, a, e, b]}])
    assert [s.name for _f, s in got[P1]] == [s.name for _f, s in (a, d, b, c, e)]
    assert [s.name for _f, s in got[other]] == [e[1].name]
    assert merged_priors([]) == {} and merged_priors([{}, {P2: [b]}]) == {P2: [b]}


def test_transfer_from_two_sources_leads_with_both_winners(tmp_path):
    from dataclasses import replace

    store = Store(tmp_path / "s.sqlite")
    won32 = _tuned_elsewhere(store, "NVIDIA H200")  # fp32 there
    h1 = replace(P1, acc="fp16")
    def big_tiles_win(problem, candidates):  # another GPU, another taste: the biggest tile wins
        return [Trial(problem, c, "ok", 10.0, getattr(c.spec, "tile_m", getattr(c.spec, "block_m", 64)) / 64,
                      {"device_s": 0.01}) for c in candidates]

    run_tune([h1], store, "NVIDIA H100 80GB HBM3", big_tiles_win, candidates=6, batch=6, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=4))  # an fp16 search elsewhere, to transfer too
    won16 = store.get_tuning("NVIDIA H100 80GB HBM3", h1, TUNED)["info"].split()[0]
    seen = []

    def record(problem, candidates):
        seen.append(list(candidates))
        return fake_evaluate(problem, candidates)

    run_tune([h1], store, "NVIDIA H200", record, candidates=3, batch=3, layouts=("TN",),
             policy=ModelFreePolicy(layouts=("TN",), seed=6),
             transfer_from=[("NVIDIA H200", "fp32"), ("NVIDIA H100 80GB HBM3", None)])
    first = [c.name for c in seen[0] if c.origin == "prior"]
    twin = won32[P1].replace("_f32", "_f16").replace("_fp32_", "_fp16_")
    assert won16 != twin, "the two sources agree: the test shows nothing"
    assert first[0] == twin and first[1] == won16, (first, twin, won16)


def test_run_tune_sweeps_the_pool_with_the_exhaustive_policy_and_refuses_it_a_transfer(tmp_path):
    """run_tune(policy_name=...): the exhaustive sweep times every spec of the pool once (its
    trials, in a store of their own, are what scripts/sample-efficiency.py compares the model-free
    policy's with); a rerun finds nothing left; a transfer seeds only the model-free policy."""
    import pytest

    from gemmrl.search.policy import candidate_pool

    store = Store(tmp_path / "sweep.sqlite")
    pool = {s.name for _f, s in candidate_pool(P1, ("TN",))}
    res = run_tune([P1], store, "H100", fake_evaluate, candidates=10**4, batch=16, layouts=("TN",),
                   policy_name="exhaustive")
    assert sorted(t.candidate.name for t in res.trials) == sorted(pool)
    again = run_tune([P1], store, "H100", fake_evaluate, candidates=10**4, batch=16, layouts=("TN",),
                     policy_name="exhaustive")
    assert again.trials == []
    rand = run_tune([P1], Store(tmp_path / "r.sqlite"), "H100", fake_evaluate, candidates=5, batch=5,
                    layouts=("TN",), policy_name="random", seed=2)
    assert len(rand.trials) == 5 and {t.candidate.name for t in rand.trials} <= pool
    with pytest.raises(ValueError, match="the random policy takes no transfer"):
        run_tune([P1], store, "H100", fake_evaluate, candidates=5, layouts=("TN",), policy_name="random",
                 transfer_from="NVIDIA H200")


def test_a_suggested_spec_that_cannot_serve_the_shape_is_skipped_not_rendered(tmp_path, monkeypatch):
    # the forty-third session's band tune died here: a neighbour's split-K 3 winner (separate
    # reduction) offered on K=16384, which 3 splits x 8 does not divide; the built-only filter
    # rendered it to look in the build cache, and the render raised
    from gemmrl.search.run import built_generic_only, policy_filter
    from gemmrl.space.cutlass_sm90 import CutlassSpec, valid

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    p = Problem(512, 1024, 16384)
    bad = CutlassSpec(64, 64, 64, 4, 1, "pingpong", "splitk", 3, layout="NN", reduction="separate")
    good = CutlassSpec(64, 64, 64, 4, 1, "pingpong", "splitk", 4, layout="NN", reduction="separate")
    assert valid(bad, p) is not None and valid(good, p) is None
    assert built_generic_only()("cutlass_sm90", bad, p) is False
    assert built_generic_only()("cutlass_sm90", good, p) is False  # valid, but not in the empty cache

    seen = []

    def allow(family, spec, problem):
        seen.append(spec.name)
        return policy_filter(generic_built_only=True)(family, spec, problem) or spec.name == good.name

    pol = ModelFreePolicy(families=("cutlass_sm90",), layouts=("NN",), seed=0, allow=allow)
    pol.add_prior(p, [("cutlass_sm90", bad), ("cutlass_sm90", good)])
    names = [c.name for c in pol.propose(p, 4)]
    assert good.name in names and bad.name not in names
    assert bad.name not in seen  # the filter was never asked about it


def test_a_policy_that_raises_on_one_shape_costs_only_that_shape(tmp_path):
    # run 614: one shape's proposal raised, and the whole tune died before the final timing of the
    # 54 shapes it had searched; now that shape is left, said in the result, and the others go on
    class Flaky(ModelFreePolicy):
        def propose(self, problem, k):
            if problem == P1:
                raise ValueError("a suggestion that does not serve this shape")
            return super().propose(problem, k)

    store = Store(tmp_path / "s.sqlite")
    res = run_tune([P1, P2], store, "H100", fake_evaluate, candidates=3, batch=3, layouts=("TN",),
                   policy=Flaky(layouts=("TN",), seed=0))
    assert set(res.failed) == {P1} and "ValueError: a suggestion" in res.failed[P1]
    assert {t.problem for t in res.trials} == {P2} and len(res.trials) == 3
    assert store.get_tuning("H100", P2, TUNED) is not None and store.get_tuning("H100", P1, TUNED) is None


def _raw_candidates(problem, n):
    from gemmrl.search.policy import Candidate
    from gemmrl.space import raw

    specs = raw.heuristic_specs(problem, "TN")[:n]
    assert len(specs) == n
    return [Candidate("raw", s) for s in specs]


def test_a_batch_is_compiled_side_by_side_once_before_it_is_evaluated(tmp_path, monkeypatch):
    """build_batch compiles the batch's unbuilt kernels together (threads: the evaluator's worker
    is a daemon process, which may start no processes), and a batch already in the cache, or
    with one kernel to build, starts no pool."""
    import shutil

    import pytest

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from gemmrl.build import ahead, pool
    from gemmrl.search.tune import build_batch

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    problem = Problem(64, 128, 4096)
    cands = _raw_candidates(problem, 3)
    jobs = [ahead.job_for(c.spec, problem) for c in cands]
    assert ahead.pending(jobs) == jobs
    calls = []
    real = pool.build_many
    monkeypatch.setattr(pool, "build_many", lambda j, **kw: calls.append((len(j), kw)) or real(j, **kw))
    built = build_batch(problem, cands)
    assert calls == [(3, {"workers": None, "threads": True})]
    assert sorted(built) == sorted(c.name for c in cands)
    assert all(r.ok and not r.cached and r.seconds > 0 for r in built.values())
    assert ahead.pending(jobs) == []
    assert build_batch(problem, cands) == {} and len(calls) == 1  # all built: nothing started
    one = _raw_candidates(Problem(64, 64, 4096), 1)
    assert build_batch(Problem(64, 64, 4096), one) == {} and len(calls) == 1  # the evaluator builds it


def test_a_candidate_that_does_not_build_is_rejected_at_the_build_and_never_loaded(tmp_path, monkeypatch):
    """The evaluator takes build failures from the batch's build: the candidate is rejected with
    nvcc's log, and it is not compiled a second time nor loaded (prepare is never called)."""
    import shutil

    import pytest

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from gemmrl.build import ahead
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.search.tune import gpu_evaluate

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    problem = Problem(64, 128, 4096)
    cands = _raw_candidates(problem, 2)
    real_job = ahead.job_for

    def broken(spec, p):
        j = real_job(spec, p)
        return ahead.BuildJob(j.name, j.source + "\nthis is not C++;\n", j.kwargs)
    monkeypatch.setattr(ahead, "job_for", broken)

    def never(self, p):
        raise AssertionError("prepare called for a kernel whose build failed")
    monkeypatch.setattr(SpecImpl, "prepare", never)
    trials = gpu_evaluate(None, "H200", lambda p: 5.0)(problem, cands)
    assert [t.status for t in trials] == ["rejected", "rejected"]
    for t, c in zip(trials, cands):
        assert t.candidate == c and t.details["stage"] == "build"
        assert t.details["reason"].startswith(f"AbiError: {c.name} failed to build")
        assert "error" in t.details["reason"] and t.details["device_s"] == 0.0 and t.details["build_s"] > 0


def test_resume_order_puts_the_shapes_not_searched_lately_first():
    from gemmrl.search.run import resume_order

    a, b, c, d = Problem(64, 64, 64), Problem(128, 64, 64), Problem(256, 64, 64), Problem(512, 64, 64)
    now = 1_000_000.0
    last = {a.key(): now - 60, b.key(): now - 13 * 3600, c.key(): now - 30}  # d: never searched
    assert resume_order([a, b, c, d], last, now) == [b, d, a, c]
    assert resume_order([a, c], last, now) == [a, c]  # all recent: the longest ago first
    assert resume_order([c, a], last, now) == [a, c]
    # a list searched in full before, whose first shapes the last (cut) rerun searched again: the
    # next rerun starts with the shapes that waited longest, not with the list's first
    e = Problem(1024, 64, 64)
    again = {a.key(): now - 10, b.key(): now - 3000, c.key(): now - 2000, e.key(): now - 20}
    assert resume_order([a, e, b, c], again, now) == [b, c, e, a]
    assert resume_order([a, e, c, b], {**again, b.key(): now - 2000}, now) == [c, b, e, a]  # ties: as given
    assert resume_order([d, b], last, now) == [d, b]  # none recent: the order given
    assert resume_order([a, b, c, d], last, now, window_s=10) == [a, b, c, d]


def test_a_more_rerun_goes_on_where_a_run_cut_short_stopped(tmp_path):
    """tune --more counts from each shape's history: a rerun used to start again from the list's
    first shape, so a run cut by its deadline was repeated, never continued (two fp32 runs over a
    28-shape list searched the same 11 shapes, 2026-11-30). The shapes the last run reached now go
    last; --candidates keeps the list's order."""
    p1, p2, p3 = Problem(512, 768, 1024), Problem(1024, 768, 1024), Problem(2048, 768, 1024)
    store = Store(tmp_path / "s.sqlite")
    order = []

    def evaluate(problem, candidates):
        order.append(problem)
        return fake_evaluate(problem, candidates)

    def tune(problems, **kw):
        order.clear()
        run_tune(problems, store, "H100", evaluate, batch=2, layouts=("TN",),
                 policy=ModelFreePolicy(layouts=("TN",), seed=len(store.trials("H100"))), **kw)
        return list(dict.fromkeys(order))  # each shape once, in the order first searched

    assert tune([p1], more=2) == [p1]  # a run that reached only the first shape
    assert tune([p1, p2, p3], more=2) == [p2, p3, p1]
    # each searched lately: the one searched longest ago first (the list's order kept a cut rerun on
    # the list's first shapes)
    assert tune([p1, p2, p3], more=2) == [p2, p3, p1]
    assert tune([p1, p2, p3], candidates=8) == [p1, p2, p3]  # 2, 4 and 4 more
    counts = {}
    for r in store.trials("H100"):
        counts[(r["M"], r["N"], r["K"])] = counts.get((r["M"], r["N"], r["K"]), 0) + 1
    assert counts == {(512, 768, 1024): 8, (1024, 768, 1024): 8, (2048, 768, 1024): 8}


def test_build_ahead_compiles_several_shapes_batches_in_one_pool(tmp_path, monkeypatch):
    """tune's `ahead` (ahead_builder over build_ahead): the kernels of several shapes' batches go to
    one build pool together; what is built already is left out; a failing build is said, not
    raised, and the search goes on (each batch then compiles its own)."""
    from gemmrl.build import pool
    from gemmrl.build.nvcc import BuildResult
    from gemmrl.search.run import ahead_builder
    from gemmrl.search.tune import build_ahead

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    p1, p2 = Problem(64, 128, 4096), Problem(64, 64, 4096)
    a, b = _raw_candidates(p1, 2), _raw_candidates(p2, 2)
    calls = []

    def fake_many(jobs, workers=None, threads=False):
        calls.append(([j[0] for j in jobs], workers, threads))
        return [BuildResult(j[0] != b[1].name, "", None, "", 1.0, False) for j in jobs]
    monkeypatch.setattr(pool, "build_many", fake_many)
    built = build_ahead([(p1, a), (p2, b)], 16)
    assert calls == [([c.name for c in a + b], 16, True)]
    assert sorted(built) == sorted(c.name for c in a + b)
    assert build_ahead([(p2, b[:1])], 16) != {}  # one kernel: built ahead too (build_batch leaves it)
    assert build_ahead([(p2, b[:1])], 1) == {}  # one worker: the evaluator builds its own
    logs = []
    assert ahead_builder(16, logs.append)([(p1, a), (p2, b)])
    assert "built 4 kernels for the next 2 shapes' batches" in logs[-1] and "(1 failed" in logs[-1]

    def broken(pairs, workers):
        raise OSError("no space left on device")
    assert ahead_builder(16, logs.append, build=broken)([(p1, a)]) == {}
    assert logs[-1].startswith("warning: building 2 candidates of 1 shapes ahead failed (OSError: no space")
