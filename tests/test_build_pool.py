from gemmrl.build.pool import build_many

import worker_tasks

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


def test_cutlass_builds_are_keyed_by_header_version_not_install_path(tmp_path, monkeypatch):
    """The same CUTLASS headers installed at two places (a virtual environment here, /tmp/site on
    the GPU machine) give the same cache entry, so a cache built ahead is found there; headers of
    another version give another; and a plain include directory is still keyed by its path."""
    from gemmrl.build import nvcc
    from gemmrl.build.cutlass import cutlass_build_kwargs
    from gemmrl.space import cutlass_sm90 as cs
    from gemmrl.space.registry import get

    def tree(where, version):
        root = tmp_path / where
        (root / "include" / "cutlass").mkdir(parents=True)
        (root / "tools" / "util" / "include").mkdir(parents=True)
        (root / "include" / "cutlass" / "cutlass.h").write_text("")
        major, minor, patch = version.split(".")
        (root / "include" / "cutlass" / "version.h").write_text(
            f"#define CUTLASS_MAJOR {major}\n#define CUTLASS_MINOR {minor}\n#define CUTLASS_PATCH {patch}\n")
        return root

    spec = cs.CutlassSpec(64, 64, 64, 1, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32")
    from gemmrl.core.problem import Problem
    source = cs.render(spec, Problem(256, 256, 256))
    entries = {}
    for where, version in (("venv", "4.2.0"), ("site", "4.2.0"), ("other", "4.3.0")):
        monkeypatch.setenv("GEMMRL_CUTLASS_DIR", str(tree(where, version)))
        kw = get("cutlass_sm90").build_kwargs()
        assert kw["include_dirs"][0].startswith(str(tmp_path / where))
        assert kw["include_keys"] == (f"cutlass-{version}/include", f"cutlass-{version}/tools/util/include")
        assert kw == {**cutlass_build_kwargs(), "extra_flags": kw["extra_flags"]}
        entries[where] = nvcc.cache_entry(source, name=spec.name, cache_dir=tmp_path / "cache", **kw)
    assert entries["venv"] == entries["site"] != entries["other"]
    plain = [nvcc.cache_entry(source, name="k", cache_dir=tmp_path / "cache", include_dirs=(str(tmp_path / d),))
             for d in ("venv", "site")]
    assert plain[0] != plain[1]
    import pytest
    with pytest.raises(ValueError, match="1 include_keys for 2 include_dirs"):
        nvcc.cache_entry(source, include_dirs=("/a", "/b"), include_keys=("x",))


def test_a_relative_cache_path_builds_and_is_found_from_elsewhere(tmp_path, monkeypatch):
    # nvcc runs in the build's own directory: a relative GEMMRL_CACHE (or cache_dir) must not be
    # handed to it as it stands (every build of `GEMMRL_CACHE=.ext/gcache gemmrl build` failed so)
    from gemmrl.build.nvcc import build_shared, cache_root, is_built

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GEMMRL_CACHE", "rel/cache")
    assert cache_root() == tmp_path / "rel" / "cache"
    src = OK_SRC.format(n=11)
    r = build_shared(src, name="eleven")
    assert r.ok, r.log[-500:]
    assert r.path.startswith(str(tmp_path / "rel" / "cache" / "builds"))
    r2 = build_shared(OK_SRC.format(n=12), name="twelve", cache_dir="other")
    assert r2.ok and r2.path.startswith(str(tmp_path / "other"))
    monkeypatch.chdir("/")  # the absolute artifact path outlives the directory it was made from
    assert build_shared(src, name="eleven", cache_dir=tmp_path / "rel" / "cache" / "builds").cached
    assert is_built(OK_SRC.format(n=12), name="twelve", cache_dir=tmp_path / "other")


def test_builds_run_from_the_search_worker_with_threads_where_processes_are_refused(tmp_path):
    """The search's evaluator runs in a daemon worker process (bench.worker), where multiprocessing
    refuses children: build_many's process pool fails there, its threads (each build an nvcc
    subprocess) do not."""
    from gemmrl.bench.worker import Worker

    w = Worker()
    try:
        r = w.run(worker_tasks.build_three, str(tmp_path / "t"), True, timeout_s=300)
        assert r.ok and r.value == [True, True, True], r.reason
        r = w.run(worker_tasks.build_three, str(tmp_path / "p"), False, timeout_s=300)
        assert not r.ok and "daemonic processes are not allowed to have children" in r.reason
    finally:
        w.close()
