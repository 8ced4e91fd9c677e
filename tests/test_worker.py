"""The worker process: crashes, hangs and errors become records and the next task still runs.
Real subprocesses that really segfault, exit and sleep."""

import pytest

from gemmrl.bench.worker import Worker
import worker_tasks as t


@pytest.fixture
def worker():
    w = Worker(env={"GEMMRL_TEST_PIN": "3"})
    yield w
    w.close()


def test_runs_tasks_in_one_child_with_its_env(worker):
    assert worker.run(t.add, 2, 3).value == 5
    p1 = worker.run(t.pid).value
    assert worker.run(t.pid).value == p1  # the same process serves task after task
    assert worker.run(t.env, "GEMMRL_TEST_PIN").value == "3"


def test_exception_is_an_error_record_and_the_worker_lives(worker):
    p1 = worker.run(t.pid).value
    r = worker.run(t.boom)
    assert r.status == "error" and r.reason == "ValueError: bad kernel"
    assert "worker_tasks.py" in r.details["traceback"]
    assert worker.run(t.pid).value == p1 and worker.restarts == 0


def test_segfault_is_a_crash_record_and_a_new_worker_takes_over(worker):
    p1 = worker.run(t.pid).value
    r = worker.run(t.segfault)
    assert r.status == "crashed" and "SIGSEGV" in r.reason
    after = worker.run(t.add, 1, 1)
    assert after.ok and after.value == 2
    assert worker.run(t.pid).value != p1 and worker.restarts == 1


def test_exit_code_is_reported(worker):
    r = worker.run(t.hard_exit)
    assert r.status == "crashed" and "exited with code 3" in r.reason
    assert worker.run(t.add, 2, 2).value == 4


def test_hang_is_killed_at_the_time_limit(worker):
    r = worker.run(t.hang, 30, timeout_s=1.0)
    assert r.status == "timeout" and 0.9 < r.seconds < 10
    assert worker.run(t.hang, 0, timeout_s=30).value == "woke"


def test_unpicklable_result_is_the_tasks_error(worker):
    r = worker.run(t.unpicklable)
    assert r.status == "error" and "could not be sent back" in r.reason
    assert worker.run(t.add, 1, 2).value == 3


def test_starting_and_importing_are_not_charged_to_the_task(tmp_path, monkeypatch):
    # a task module that takes 2 s to import (like torch on a loaded machine): a 1 s task limit
    # applies to the task, not to the fresh process's start and imports
    import importlib
    import sys

    (tmp_path / "slow_import_task.py").write_text(
        "import time\ntime.sleep(2)\n\ndef quick(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("slow_import_task")
    try:
        w = Worker()
        try:
            r = w.run(mod.quick, 41, timeout_s=1.0)
            assert r.ok and r.value == 42 and r.seconds < 1.0, r
        finally:
            w.close()
        w = Worker()  # but starting has its own limit
        try:
            r = w.run(mod.quick, 1, timeout_s=30, startup_s=0.5)
            assert r.status == "timeout" and "did not start the task within 0.5 s" in r.reason
            assert w.run(t.add, 2, 3).value == 5  # and a fresh process serves the next task
        finally:
            w.close()
    finally:
        sys.modules.pop("slow_import_task", None)


def test_a_task_that_cannot_be_loaded_is_an_error(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "vanishing_task.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("vanishing_task")
    (tmp_path / "vanishing_task.py").write_text("raise ImportError('gone')\n")
    try:
        w = Worker()
        try:
            r = w.run(mod.f, timeout_s=30)
            assert r.status == "error" and "could not be loaded" in r.reason and "gone" in r.reason
            assert w.run(t.add, 1, 1).value == 2 and w.restarts == 0
        finally:
            w.close()
    finally:
        sys.modules.pop("vanishing_task", None)


def test_a_task_that_leaves_cuda_unusable_is_answered_and_the_next_gets_a_fresh_process(worker):
    p1 = worker.run(t.pid).value
    r = worker.run(t.returns_then_context_lost, 7)
    assert r.ok and r.value == 7 and "illegal memory access (simulated)" in r.details["context_lost"]
    assert worker.restarts == 1 and worker.run(t.pid).value != p1
    assert "context_lost" not in worker.run(t.add, 1, 2).details  # the new process is sound


def test_a_lost_context_mid_task_exits_the_worker_and_the_heartbeat_names_the_culprit(tmp_path):
    from gemmrl.bench.worker import CONTEXT_LOST_EXIT, HEARTBEAT_ENV, last_beat

    hb = tmp_path / "hb"
    with Worker(env={HEARTBEAT_ENV: str(hb)}) as w:
        p1 = w.run(t.pid).value
        r = w.run(t.loses_context_in, "bad_kernel")
        assert r.status == "crashed" and r.details["exitcode"] == CONTEXT_LOST_EXIT
        assert "lost its CUDA context" in r.reason and last_beat(str(hb)) == "impl:bad_kernel"
        assert w.run(t.pid).value != p1


def test_outside_a_worker_a_lost_context_raises_and_a_sound_one_is_left_alone(monkeypatch):
    from gemmrl.bench import worker

    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    assert worker.cuda_context_error() is None  # no CUDA started in this process: nothing lost
    worker.stop_if_context_lost("anything")
    monkeypatch.setattr(worker, "cuda_context_error", lambda: "AcceleratorError: an illegal memory access")
    with pytest.raises(worker.CudaContextLost, match="cuda-l2 on 64x64x64 left the CUDA context unusable"):
        worker.stop_if_context_lost("cuda-l2 on 64x64x64")


def _fake_impls(*names):
    """NN implementations that do nothing, named: for the runner's bookkeeping, with verify and
    the timing patched."""
    from gemmrl.core.impl import Impl

    class Fake(Impl):
        layout = "NN"

        def __init__(self, name):
            self.name = name

        def prepare(self, problem):
            return lambda a, b_nn, b_tn, c: None

    return [Fake(n) for n in names]


def test_the_runner_stops_at_the_implementation_that_lost_the_context(tmp_path, monkeypatch):
    """Without the stop, every implementation after the culprit failed its verification too and
    was stored as wrong (a bench of CUDA-L2's kernels, 2026-11-27: torch.matmul and cuBLAS
    'rejected' on two shapes)."""
    from gemmrl.bench import runner, worker
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store
    from gemmrl.verify.checks import CheckResult

    verified = []

    def fake_verify(impl, problem, **kw):
        verified.append(impl.name)
        if impl.name == "wild":
            return CheckResult(False, "AcceleratorError: CUDA error: an illegal memory access was encountered")
        return CheckResult(True, "")
    monkeypatch.setattr(runner, "verify", fake_verify)
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    store = Store(tmp_path / "s.sqlite")
    run = store.start_run("test", "cpu", {}, {})
    p = Problem(64, 64, 64)
    impls = _fake_impls("honest_first", "wild", "honest_after")
    counts = {"sessions": 0, "skipped": 0, "rejected": 0}
    monkeypatch.setattr(worker, "cuda_context_error", lambda: None)  # a plain wrong answer: go on
    monkeypatch.setattr(runner.timing, "time_kernel", lambda *a, **k: {})
    runner._one_problem(p, impls, store, runner.RunConfig(repeat_impl=None), "cpu", run, 0, counts, lambda m: None)
    assert verified == ["honest_first", "wild", "honest_after"] and counts["rejected"] == 1
    verified.clear()
    monkeypatch.setattr(worker, "cuda_context_error", lambda: "AcceleratorError: an illegal memory access")
    cfg = runner.RunConfig(repeat_impl=None, retime=True)
    with pytest.raises(worker.CudaContextLost, match="wild on 64x64x64"):
        runner._one_problem(p, impls, store, cfg, "cpu", run, 0, counts, lambda m: None)
    assert verified == ["honest_first", "wild"]  # nothing after the culprit ran in that process
    assert store.verification("cpu", p, "wild")["passed"] is False
    store.close()


def test_each_session_records_the_gpu_state_after_it(tmp_path, monkeypatch):
    """The runner stores env.gpu_state() with every implementation's record of a session, read
    after that session's timing; where NVML says nothing, the records carry no state."""
    import json

    from gemmrl.bench import env, runner, worker
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store
    from gemmrl.verify.checks import CheckResult

    monkeypatch.setattr(runner, "verify", lambda impl, problem, **kw: CheckResult(True, ""))
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    monkeypatch.setattr(worker, "cuda_context_error", lambda: None)
    order = []

    def time_kernel(problem, calls, **kw):
        order.append("timed")
        return {n: {"median_us": 5.0, "n": 50, "status": "ok", "details": {"graph": True}} for n in calls}

    states = iter([{"temp_c": 70, "sm_mhz": 1410, "clock_events": ["sw_power_cap"]}, {}])
    monkeypatch.setattr(runner.timing, "time_kernel", time_kernel)
    monkeypatch.setattr(env, "gpu_state", lambda: order.append("state") or next(states))
    store = Store(tmp_path / "s.sqlite")
    run = store.start_run("bench", "cpu", {}, {})
    counts = {"sessions": 0, "skipped": 0, "rejected": 0}
    for p in (Problem(64, 64, 64), Problem(64, 64, 128)):
        runner._one_problem(p, _fake_impls("a", "b"), store, runner.RunConfig(repeat_impl=None), "cpu", run, 0,
                            counts, lambda m: None)
    assert order == ["timed", "state", "timed", "state"]
    rows = store.db.execute("SELECT K, impl, details FROM measurements ORDER BY K, impl").fetchall()
    got = {(k, impl): json.loads(d) for k, impl, d in rows}
    assert got[(64, "a")] == got[(64, "b")] == {
        "graph": True, "gpu_state": {"temp_c": 70, "sm_mhz": 1410, "clock_events": ["sw_power_cap"]}}
    assert got[(128, "a")] == {"graph": True}
    store.close()


def test_retime_after_a_run_times_again_only_what_later_runs_did_not(tmp_path, monkeypatch):
    """RunConfig.retime_after: a shape whose every implementation a later run measured in the
    mode is skipped; one timed only before (or by a later run, in part) is timed again, and
    verified again as --retime does."""
    from gemmrl.bench import runner, worker
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store
    from gemmrl.verify.checks import CheckResult

    verified, timed = [], []
    monkeypatch.setattr(runner, "verify", lambda impl, problem, **kw: verified.append(impl.name) or CheckResult(True, ""))
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    monkeypatch.setattr(worker, "cuda_context_error", lambda: None)

    def time_kernel(problem, calls, **kw):
        timed.append(problem.shape)
        return {n: {"median_us": 5.0, "n": 50, "status": "ok"} for n in calls}
    monkeypatch.setattr(runner.timing, "time_kernel", time_kernel)
    store = Store(tmp_path / "s.sqlite")
    cfg0 = runner.RunConfig(repeat_impl=None)
    impls = _fake_impls("a", "b")
    done, half, old = Problem(64, 64, 64), Problem(64, 64, 128), Problem(64, 64, 192)
    counts = {"sessions": 0, "skipped": 0, "rejected": 0}
    first = store.start_run("bench", "cpu", {}, {})
    for p in (done, half, old):
        runner._one_problem(p, impls, store, cfg0, "cpu", first, 0, counts, lambda m: None)
    later = store.start_run("bench", "cpu", {}, {})
    runner._one_problem(done, impls, store, cfg0.__class__(repeat_impl=None, retime=True), "cpu", later, 0,
                        counts, lambda m: None)
    runner._one_problem(half, impls[:1], store, cfg0.__class__(repeat_impl=None, retime=True), "cpu", later, 0,
                        counts, lambda m: None)
    verified.clear(), timed.clear()
    resumed = store.start_run("bench", "cpu", {}, {})
    cfg = runner.RunConfig(repeat_impl=None, retime=True, retime_after=first)
    skipped = counts["skipped"]
    for p in (done, half, old):
        runner._one_problem(p, impls, store, cfg, "cpu", resumed, 0, counts, lambda m: None)
    assert timed == [half.shape, old.shape] and counts["skipped"] == skipped + 1
    assert verified == ["a", "b", "a", "b"]  # verified again, as a retime is
    timed.clear()
    for p in (done, half, old):  # without retime_after, plain --retime times all three
        runner._one_problem(p, impls, store, runner.RunConfig(repeat_impl=None, retime=True), "cpu", resumed, 0,
                            counts, lambda m: None)
    assert timed == [done.shape, half.shape, old.shape]
    store.close()
