"""gemmrl.bench.hostcost's bookkeeping, without a GPU: a fake host clock that each call advances
by its own cost, and a no-op device wait."""

import pytest

from gemmrl.bench.hostcost import enqueue_and_latency


def test_medians_per_call_and_every_call_counted():
    now = [0.0]
    calls = {"a": 0, "b": 0}
    seen_out = {}

    def make(name, us):
        def fn(x, y, z, c):
            assert (x, y, z) == (1, 2, 3)
            seen_out.setdefault(name, set()).add(c)
            calls[name] += 1
            now[0] += us * 1e-6
        return fn

    syncs = []
    enq, lat = enqueue_and_latency({"a": make("a", 1.0), "b": make("b", 3.0)}, (1, 2, 3), {"a": "ca", "b": "cb"},
                                   bursts=3, burst_calls=10, rounds=7, warm=2, seed=5,
                                   sync=lambda: syncs.append(1), clock=lambda: now[0])
    assert enq == pytest.approx({"a": 1.0, "b": 3.0}) and lat == pytest.approx({"a": 1.0, "b": 3.0})
    assert calls == {"a": 2 + 3 * 10 + 7, "b": 2 + 3 * 10 + 7}
    assert seen_out == {"a": {"ca"}, "b": {"cb"}}  # each writes its own output
    assert len(syncs) == 1 + 3 * 2 * 2 + 7 * 2 * 2  # around every burst and every single call


def test_refuses_empty_protocols():
    for kw in ({"bursts": 0}, {"burst_calls": 0}, {"rounds": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            enqueue_and_latency({}, (), {}, sync=lambda: None, **kw)
