"""gemmrl.build.slices: what a run compiles ahead, a slice of the shapes at a time (bench, and tune's race
and final timing)."""

import pytest

from gemmrl.build.slices import build_plans, compile_then_time, cut_slices, unbuilt_counts
from gemmrl.core.problem import Problem


def test_build_slices_count_each_kernel_once_and_only_unbuilt_ones(monkeypatch):
    from gemmrl.build import nvcc

    def build_slices(impls, problems, per_slice):  # as bench cuts them
        return cut_slices(problems, unbuilt_counts(build_plans(impls, problems)), per_slice)

    class Shared:  # a generic kernel every shape shares, and one of each shape's own
        def build_jobs(self, problems):
            return [([("generic", "// generic", {})] if i == 0 else []) + [(f"own{i}", f"// own {i}", {})]
                    for i, _p in enumerate(problems)]

    ps = [Problem(64, 64, 64 * (i + 1)) for i in range(5)]
    monkeypatch.setattr(nvcc, "is_built", lambda src, **kw: src == "// own 1")
    # needs: 2, 0 (built), 1, 1, 1 -> at most 2 a slice
    assert build_slices([Shared()], ps, per_slice=2) == [ps[:2], ps[2:4], ps[4:]]
    assert build_slices([object()], ps, per_slice=2) == [ps]  # nothing to compile: one slice
    assert build_slices([Shared()], ps[:1], per_slice=1) == [ps[:1]]  # a slice holds one shape at least


def test_tune_timing_compiles_each_slice_of_contenders_in_parallel_before_timing_it(monkeypatch):
    """tune's race and final timing (compile_then_time): the kernels the implementations will
    load are compiled a slice at a time, at most one wave of nvcc processes (default_jobs) a slice,
    each slice compiled before it is timed (run 977: the timing worker compiled a fresh machine's
    contenders one at a time, 109 s on the first of 5 shapes). Counts add up over the slices; a
    stop in a slice's timing or a SIGTERM while compiling ends it there; baselines alone compile
    nothing and are timed in one pass."""
    import os
    import signal

    import gemmrl.bench.select as select
    import gemmrl.build.nvcc as nvcc
    import gemmrl.build.pool as pool

    probs = [Problem(64 * (i + 1), 64, 64) for i in range(5)]
    events = []
    prev_term = signal.getsignal(signal.SIGTERM)

    class Builder:
        def __init__(self, name, per_shape):
            self.name, self.per_shape = name, per_shape

        def build_jobs(self, problems):
            return [[(f"{self.name}{j}_{p.M}", "src", {}) for j in range(self.per_shape)] for p in problems]

        def prebuild(self, part, log=print, plan=None):
            events.append(("build", self.name, tuple(p.M for p in part), sum(len(x) for x in plan)))
            if self.name == "term" and len(events) > 2:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(pool, "default_jobs", lambda: 2)
    monkeypatch.setattr(nvcc, "is_built", lambda src, name="", **kw: name.endswith("_64"))  # the first built
    monkeypatch.setattr(select, "impls_from_specs", lambda specs, store, device: [Builder("k", 1), object()])

    def time_part(part, stop_at=None):
        events.append(("time", tuple(p.M for p in part)))
        stopped = stop_at is not None and part[0].M == stop_at
        return {"problems": len(part), "sessions": len(part), "errors": 0, "stopped": stopped,
                **({"deadline_after": 1} if stopped else {})}

    counts = compile_then_time(("baselines", "race:3"), probs, None, "GPU", time_part)
    # 0 + 1 + 1 unbuilt in the first slice, then 1 + 1, then 1: cut at 2 a slice
    assert events == [("build", "k", (64, 128, 192), 3), ("time", (64, 128, 192)),
                      ("build", "k", (256, 320), 2), ("time", (256, 320))], events
    assert counts["sessions"] == 5 and counts["problems"] == 5 and not counts["stopped"]
    # the timing of the second slice stopped (a deadline after its first shape): no third slice
    events.clear()
    monkeypatch.setattr(select, "impls_from_specs", lambda specs, store, device: [Builder("k", 2)])
    counts = compile_then_time(("race:1",), probs, None, "GPU", lambda part: time_part(part, stop_at=192))
    assert [e[0] for e in events] == ["build", "time", "build", "time"], events
    assert events[0][2] == (64, 128) and events[2][2] == (192,)  # 2 unbuilt a shape (one built at 64)
    assert counts["stopped"] and counts["deadline_after"] == 3 and counts["sessions"] == 3
    # a SIGTERM while the second slice compiles: that slice is not timed, the run says stopped
    events.clear()
    monkeypatch.setattr(select, "impls_from_specs", lambda specs, store, device: [Builder("term", 1)])
    said = []
    counts = compile_then_time(("race:3",), probs, None, "GPU", time_part, log=said.append)
    assert events == [("build", "term", (64, 128, 192), 3), ("time", (64, 128, 192)),
                      ("build", "term", (256, 320), 2)], events
    assert counts["stopped"] and counts["sessions"] == 3
    assert said == ["stopped while compiling; the shapes timed so far (3 of 5) are in the store"]
    signal.signal(signal.SIGTERM, prev_term)  # the stop leaves later SIGTERMs ignored (stop_on_sigterm)
    # the builds cannot be planned (no CUTLASS headers here): one pass, the worker compiles as before
    events.clear()

    class NoHeaders(Builder):
        def build_jobs(self, problems):
            raise RuntimeError("no CUTLASS headers")
    monkeypatch.setattr(select, "impls_from_specs", lambda specs, store, device: [NoHeaders("k", 1)])
    said.clear()
    counts = compile_then_time(("race:3",), probs, None, "GPU", time_part, log=said.append)
    assert events == [("time", (64, 128, 192, 256, 320))] and counts["sessions"] == 5
    assert said and said[0].startswith("could not plan the builds ahead (RuntimeError: no CUTLASS headers)")
    # the baselines alone: no implementation is made, one pass over every shape
    events.clear()
    monkeypatch.setattr(select, "impls_from_specs", lambda *a: pytest.fail("baselines compile nothing"))
    counts = compile_then_time(("baselines",), probs, None, "GPU", time_part)
    assert events == [("time", (64, 128, 192, 256, 320))] and counts["sessions"] == 5


def test_an_impl_that_builds_for_itself_is_not_handed_a_plan():
    """An implementation with a prebuild but no build_jobs (CUDA-L2's: prebuild(problems, jobs, log))
    builds each slice itself: time_in_slices calls it without a plan, as its signature takes none
    (bench --impl cuda-l2:DIR raised TypeError in its first slice since bench sliced its builds)."""
    from gemmrl.baselines.cuda_l2 import CudaL2Impl
    from gemmrl.build.slices import time_in_slices

    seen = []

    class OwnBuilder:
        def prebuild(self, problems, jobs=None, log=print):
            seen.append([p.M for p in problems])

    assert "plan" not in CudaL2Impl.prebuild.__code__.co_varnames  # the signature this stands in for
    ps = [Problem(64, 64, 64), Problem(128, 64, 64)]
    impls = [OwnBuilder()]
    counts = time_in_slices(impls, build_plans(impls, ps), [ps[:1], ps[1:]],
                            lambda part: {"sessions": len(part)}, log=lambda m: None)
    assert seen == [[64], [128]] and counts["sessions"] == 2 and not counts["stopped"]
