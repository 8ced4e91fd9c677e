"""The torch.compile baseline compiles every shape it is given, however many, and refuses a shape
instead of timing an eager fallback under its name (on the CPU, with dynamo's eager backend: the
caching and recompile-limit logic is dynamo's, whatever the backend)."""

import pytest

torch = pytest.importorskip("torch")

from gemmrl.baselines.impls import TorchCompile  # noqa: E402
from gemmrl.core.impl import UnsupportedProblem  # noqa: E402
from gemmrl.core.problem import Problem  # noqa: E402


def test_twelve_shapes_in_one_process_each_compile_a_graph_and_compute_a_at_b():
    from torch._dynamo.utils import counters

    impl = TorchCompile(backend="eager")
    for i in range(12):  # more than dynamo's recompile limit of 8
        p = Problem(16 + 16 * i, 32, 64, "bf16")
        before = counters["stats"]["unique_graphs"]
        call = impl.prepare(p)
        assert counters["stats"]["unique_graphs"] > before, f"shape {i} ran eagerly"
        a = torch.randn(p.M, p.K).to(torch.bfloat16)
        b = torch.randn(p.K, p.N).to(torch.bfloat16)
        c = torch.empty(p.M, p.N, dtype=torch.bfloat16)
        call(a, b, b.t().contiguous(), c)
        assert torch.equal(c, a @ b)


def test_a_shape_that_is_not_compiled_is_refused(monkeypatch):
    import torch._dynamo

    impl = TorchCompile(backend="eager")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 0)  # dynamo gives up at once
    with pytest.raises(UnsupportedProblem, match="did not compile"):
        impl.prepare(Problem(64, 64, 64, "bf16"))
