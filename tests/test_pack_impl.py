"""`bench --impl pack:DIR`: gemmrl.matmul with a pack active, as the harness calls it (out=C),
one implementation per B layout. On the CPU every call is torch.matmul's fallback, which is what
these tests can check for real: the wiring, out=, the layouts and the refusals."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gemmrl.bench.select import impls_from_specs  # noqa: E402
from gemmrl.core.impl import UnsupportedProblem  # noqa: E402
from gemmrl.core.problem import Problem  # noqa: E402
from gemmrl.runtime import ops  # noqa: E402

PACK = Path(__file__).parent.parent / "packs" / "h200-fp16-F32F16F16F32"


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """These check the wiring on the CPU path: on a GPU machine the H200 pack would be refused
    by its stamp on another model (run on an H100, 2026-11-26), or would serve with CUDA kernels.
    test_runtime_lt_gpu covers the product on the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_pack_spec_gives_the_product_in_both_layouts_and_falls_back_exactly():
    impls = impls_from_specs([f"pack:{PACK}"])
    assert [(i.name, i.layout, i.trusted) for i in impls] == [
        ("gemmrl.matmul-nn", "NN", True), ("gemmrl.matmul-tn", "TN", True),
        ("torch.matmul-tn", "TN", True)]  # torch on the TN layout, to compare -tn against
    p = Problem(64, 256, 128)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-2, 3, (p.M, p.K), generator=g).half()
    b_nn = torch.randint(-2, 3, (p.K, p.N), generator=g).half()
    b_tn = b_nn.t().contiguous()
    try:
        for impl in impls:
            call = impl.prepare(p)
            c = torch.full((p.M, p.N), float("nan"), dtype=torch.float16)
            call(a, b_nn, b_tn, c)
            assert torch.equal(c, torch.matmul(a, b_nn))  # no CUDA: torch.matmul, written into C
            if impl.name.startswith("gemmrl."):
                assert ops.active() is not None and ops.active().pack.path.resolve() == PACK.resolve()
                assert impl.describe()["pack"] == str(PACK)
        # the verification record names the kernel the pack serves the shape with (the pack's
        # median rule counts the product's sessions by it), or None where the libraries serve it
        import json

        m = json.loads((PACK / "manifest.json").read_text())
        e = next(x for x in m["entries"] if x["layout"] == "TN")
        tn = impls[1]
        tn.prepare(Problem(e["M"], e["N"], e["K"]))
        assert tn.describe()["served"] == {"shape": f"{e['M']}x{e['N']}x{e['K']}", "spec_name": e["spec_name"],
                                           "source_sha256": e["source_sha256"], "exact": True}
        lib = next(x for x in m["library"] if x.endswith(":TN"))
        M, N, K = (int(v) for v in lib.split(":")[0].split("x"))
        tn.prepare(Problem(M, N, K))
        assert tn.describe()["served"] is None
        # nor a cuBLASLt algorithm: none is installed without CUDA, though the pack lists some
        lt = next(x for x in m["lt_algos"] if x["layout"] == "TN")
        tn.prepare(Problem(lt["M"], lt["N"], lt["K"]))
        assert tn.describe()["served"] is None and tn.describe()["served_lt"] is None
        with pytest.raises(UnsupportedProblem, match="accumulates in fp32"):
            impls[0].prepare(Problem(64, 256, 128, acc="fp16"))
    finally:
        ops.use_pack(None)


def test_pack_spec_refuses_a_directory_that_is_not_a_pack(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a pack"):
        impls_from_specs([f"pack:{tmp_path}"])


def test_pack_spec_takes_the_neighbour_distance():
    import math

    impls = impls_from_specs([f"pack:{PACK}@nearest=2"])
    assert [i.nearest for i in impls[:2]] == [2.0, 2.0]
    try:
        impls[0].prepare(Problem(64, 256, 128))
        assert ops.active().table.max_distance == 2.0
        assert impls[0].describe()["nearest"] == 2.0  # the verification record keeps it
        impls = impls_from_specs([f"pack:{PACK}@nearest=inf"])
        impls[1].prepare(Problem(64, 256, 128))
        assert ops.active().table.max_distance == math.inf
        assert impls_from_specs([f"pack:{PACK}"])[0].nearest is None  # use_pack's default
        assert "nearest" not in impls_from_specs([f"pack:{PACK}"])[0].describe()
    finally:
        ops.use_pack(None)
    for bad in ("-1", "far", "nan"):
        with pytest.raises(ValueError, match="@nearest= needs a distance"):
            impls_from_specs([f"pack:{PACK}@nearest={bad}"])

