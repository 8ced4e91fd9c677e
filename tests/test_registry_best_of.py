"""Families through the registry, specs as implementations, and the best-of search's CPU side."""

import json

import pytest

from gemmrl.core.impl import UnsupportedProblem
from gemmrl.core.problem import Problem
from gemmrl.runtime.spec_impl import SpecImpl
from gemmrl.search.best_of import BestOf
from gemmrl.space import registry
from gemmrl.store.db import Store

P = Problem(512, 768, 1024)


def test_every_family_proposes_valid_distinct_specs_that_render():
    for fam in registry.FAMILIES.values():
        for layout in ("NN", "TN"):
            specs = fam.candidates(P, layout, 4)
            assert specs, f"{fam.name} {layout}: no candidate"
            assert len({s.name for s in specs}) == len(specs)
            for s in specs:
                assert fam.valid(s, P) is None and s.layout == layout
                assert registry.family_of(s) is fam
                src = fam.render(s, P)
                assert "gemmrl_run" in src and "gemmrl_meta" in src


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kernel family 'nope'; known: cutlass_sm90, raw"):
        registry.get("nope")


def test_spec_impl_refuses_a_problem_its_spec_rejects():
    raw = registry.get("raw")
    spec = raw.candidates(P, "NN", 1)[0]
    impl = SpecImpl(spec)
    odd = Problem(512, 770, 1023)  # K not a multiple of 8: no 16-byte cp.async
    assert impl.supports(P)
    assert not impl.supports(odd)
    with pytest.raises(UnsupportedProblem):
        impl.prepare(odd)


def test_best_of_reads_its_stored_choice(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    fam = registry.get("raw")
    b = BestOf([fam], store=store, device="H100")
    assert b.name == "gemmrl-raw"
    assert b._stored(P) is None
    spec = fam.candidates(P, "TN", 2)[1]
    choice = json.dumps({"family": "raw", "spec": dict(spec.__dict__)}).encode()
    store.put_tuning("H100", P, b.name, choice, spec.name, 3.0)
    assert b._stored(P) == spec
    assert BestOf([fam], store=store, device="H200")._stored(P) is None  # other GPU: not reused


def test_best_of_prebuild_compiles_each_source_once(tmp_path, monkeypatch):
    fam = registry.get("raw")
    seen = []

    def fake_build_many(work, workers=None):
        seen.extend(work)
        from gemmrl.build.nvcc import BuildResult
        return [BuildResult(True, "k", "/x.so", "", 0.0, i < 3) for i, _ in enumerate(work)]

    monkeypatch.setattr("gemmrl.build.pool.build_many", fake_build_many)
    b = BestOf([fam], top=2)
    logs = []
    b.prebuild([P, P, Problem(64, 64, 4096)], log=logs.append)
    names = [w[0] for w in seen]
    assert len(names) == len({w[1] for w in seen})  # one job per distinct source
    assert len(names) == 2 * 2 * 2  # 2 distinct problems x 2 layouts x top 2 (raw is per shape)
    assert "8 built (3 of them in the cache already), 0 failed" in logs[-1]
