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
