from gemmrl.build.pool import build_many

OK_SRC = 'extern "C" int gemmrl_answer_{n}() {{ return {n}; }}\n'


def test_build_many_keeps_order_and_failures(tmp_path):
    jobs = [(f"ok{n}", OK_SRC.format(n=n), {"cache_dir": str(tmp_path)}) for n in range(3)]
    jobs.insert(1, ("broken", "int main( {", {"cache_dir": str(tmp_path)}))
    seen = []
    res = build_many(jobs, workers=2, progress=lambda d, t, name, r: seen.append((d, t, name, r.ok)))
    assert [r.ok for r in res] == [True, False, True, True]
    assert "error" in res[1].log
    assert sorted(s[0] for s in seen) == [1, 2, 3, 4] and {s[1] for s in seen} == {4}
    # a second round is all cache hits, in-process
    again = build_many(jobs, workers=1)
    assert [r.cached for r in again] == [True, False, True, True]
    assert again[0].path == res[0].path


def test_is_built_matches_the_cache(tmp_path):
    from gemmrl.build.nvcc import build_shared, is_built

    src = OK_SRC.format(n=7)
    assert not is_built(src, name="seven", cache_dir=tmp_path)
    assert build_shared(src, name="seven", cache_dir=tmp_path).ok
    assert is_built(src, name="seven", cache_dir=tmp_path)
    # other flags or another arch are another build
    assert not is_built(src, name="seven", cache_dir=tmp_path, extra_flags=("-DX=1",))
    assert not is_built(src, name="seven", cache_dir=tmp_path, arch="sm_80")
    # a failed build is not a built one
    assert not build_shared("int main( {", name="bad", cache_dir=tmp_path).ok
    assert not is_built("int main( {", name="bad", cache_dir=tmp_path)


def test_ahead_plan_builds_a_generic_spec_once_and_raw_per_shape(tmp_path, monkeypatch):
    from gemmrl.build import ahead
    from gemmrl.core.problem import Problem
    from gemmrl.space import registry

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    probs = [Problem(4096, 4096, 4096), Problem(4096, 4096, 2048)]
    cut = ahead.plan(probs, [registry.get("cutlass_sm90")], ("NN",), top=3)
    per_shape = [{s.name for s in registry.get("cutlass_sm90").candidates(p, "NN", 3)} for p in probs]
    assert [j.name for j in cut] == list(dict.fromkeys(
        n for p in probs for n in (s.name for s in registry.get("cutlass_sm90").candidates(p, "NN", 3))))
    assert len(cut) == len(per_shape[0] | per_shape[1]) < 6  # shared specs are one build
    raw = ahead.plan(probs, [registry.get("raw")], ("NN", "TN"), top=2)
    assert len(raw) == 2 * 2 * 2  # the shape is compiled in: every (shape, layout, pick) is a build
    assert len({j.source for j in raw}) == len(raw)
    assert ahead.pending(raw) == raw  # nothing built yet in this cache
