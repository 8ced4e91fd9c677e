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
