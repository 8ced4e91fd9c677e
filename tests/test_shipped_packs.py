"""The kernel packs shipped in packs/ load, their sources match their manifests, their entries
regenerate from the specs (the pack is what the family renders today), and a raw kernel of each
compiles with nvcc for the pack's arch."""

from pathlib import Path

import pytest

from gemmrl.core.problem import Problem
from gemmrl.runtime.pack import load_pack
from gemmrl.space import registry

PACKS = sorted(p.parent for p in (Path(__file__).parent.parent / "packs").glob("*/manifest.json"))


def test_there_is_a_shipped_pack():
    assert PACKS, "packs/ holds no pack"


@pytest.mark.parametrize("path", PACKS, ids=[p.name for p in PACKS])
def test_pack_loads_and_every_source_is_the_family_render_of_its_spec(path):
    pack = load_pack(path)
    assert pack.stamp["device"] and pack.entries
    floor = pack.manifest.get("min_speedup", 1.0)
    raw = {(d["M"], d["N"], d["K"], d["layout"]): d for d in pack.manifest["entries"]}
    for e in pack.entries:
        src = pack.source(e)  # raises when the file does not match its sha256
        fam = registry.get(e.family)
        spec = e.spec  # rebuilt from the manifest's fields by load_pack
        assert isinstance(spec, fam.spec_type()) and spec.name == e.spec_name
        problem = Problem(e.problem.M, e.problem.N, e.problem.K, e.problem.dtype, e.problem.acc)
        assert fam.valid(spec, problem) is None, e.file
        assert fam.render(spec, problem) == src, f"{e.file} is no longer what {e.family} renders"
        # it beat the best baseline beside it: in its one session, or, timed in several since it
        # was chosen, by the median of its per-session speedups (the export's rule: a near-tie in
        # the latest session alone does not decide)
        d = raw[(e.problem.M, e.problem.N, e.problem.K, e.layout)]
        if d.get("sessions", 1) >= 2:
            assert d["speedup_median"] >= floor, e.file
        elif e.kernel_us is not None and e.baseline_us is not None:
            assert e.baseline_us >= floor * e.kernel_us, e.file


@pytest.mark.parametrize("path", PACKS, ids=[p.name for p in PACKS])
def test_a_raw_kernel_of_the_pack_compiles(path, tmp_path, monkeypatch):
    from gemmrl.build.nvcc import NvccNotFound, build_shared, nvcc_path

    try:
        nvcc_path()
    except NvccNotFound:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    pack = load_pack(path)
    raw = [e for e in pack.entries if e.family == "raw"]
    if not raw:
        pytest.skip("no raw kernel in this pack")
    e = raw[0]
    res = build_shared(pack.source(e), name=e.spec_name, arch=pack.arch, **registry.get("raw").build_kwargs())
    assert res.ok, res.log[-2000:]
    assert Path(res.path).stat().st_size > 0
