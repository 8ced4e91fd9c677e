"""A whole isolated run on the CPU with a stand-in task: real worker processes that really
segfault and hang; the run goes on, the culprits are quarantined and recorded, nothing is lost."""

from gemmrl.bench.runner import RunConfig, run_isolated
from gemmrl.core.problem import Problem
from gemmrl.store.db import Store
import worker_tasks


def test_crash_and_hang_are_quarantined_and_the_run_goes_on(tmp_path):
    db = tmp_path / "s.sqlite"
    store = Store(db)
    run = store.start_run("test", "cpu", {}, {})
    problems = [Problem(64, 64, 64), Problem(128, 64, 64), Problem(256, 64, 64)]
    logs = []
    counts = run_isolated(problems, ["good", "segv", "hang", "search"], store, RunConfig(), device="cpu",
                          run_id=run, db_path=str(db), log=logs.append, task=worker_tasks.fake_problem_task,
                          timeout_s=8)
    assert counts["sessions"] == 3 and counts["errors"] == 0
    # 'search' crashed on its candidate for every problem; 'segv' on 128, 'hang' on 256
    assert counts["quarantined"] == 5
    q = {p.M: store.quarantined("cpu", p) for p in problems}
    assert set(q[64]) == {"bad_spec"}
    assert set(q[128]) == {"bad_spec", "segv"} and "SIGSEGV" in q[128]["segv"]
    assert set(q[256]) == {"bad_spec", "hang"} and q[256]["hang"].startswith("timeout")
    # a crashed implementation is a failed verification on record; a candidate is not an impl
    assert store.verification("cpu", problems[1], "segv")["passed"] is False
    assert store.verification("cpu", problems[0], "bad_spec") is None
    # every problem was measured, without its culprits
    measured = {(r["M"], r["impl"]) for r in store.measurements(device="cpu")}
    assert (128, "segv") not in measured and (256, "hang") not in measured
    assert {(m, "good") for m in (64, 128, 256)} <= measured and (64, "search") in measured
    assert any("quarantined" in line for line in logs)


def test_a_passed_deadline_starts_nothing_and_says_so(tmp_path):
    import time

    db = tmp_path / "s.sqlite"
    store = Store(db)
    run = store.start_run("test", "cpu", {}, {})
    logs = []
    counts = run_isolated([Problem(64, 64, 64)], ["good"], store, RunConfig(deadline=time.monotonic() - 1),
                          device="cpu", run_id=run, db_path=str(db), log=logs.append,
                          task=worker_tasks.fake_problem_task)
    assert counts["stopped"] is True and counts["sessions"] == 0
    assert store.measurements() == [] and "deadline reached after 0 of 1" in logs[0]


def test_a_second_sigterm_during_the_stop_does_not_cut_it():
    """coreutils `timeout` sends SIGTERM to the command and then to its process group, so the
    command gets it twice: the first stops the loop, the second (here: while the stop is being
    logged) must be ignored rather than raised out of the stop's own logging."""
    import os
    import signal
    import sys
    import time

    from gemmrl.bench.runner import _stoppable

    before = signal.getsignal(signal.SIGTERM)
    logged, counts = [], {}

    def log(msg):
        os.kill(os.getpid(), signal.SIGTERM)  # the second one, mid-log
        time.sleep(0.05)
        logged.append(msg)
    try:
        with _stoppable(counts, log):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                time.sleep(0.01)
            raise AssertionError("the first SIGTERM did not stop the loop")
        assert counts["stopped"] and len(logged) == 1 and "stopped (_Stop)" in logged[0]
        # stopping: later ones ignored, by a handler that does nothing (not SIG_IGN, whose race
        # with a second SIGTERM already on its way printed an OSError traceback into run 720's log)
        from gemmrl.bench.runner import _ignore_later_sigterm
        assert signal.getsignal(signal.SIGTERM) is _ignore_later_sigterm
        unraisable = []
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # one more: handled, nothing raised or printed
            for _ in range(20):
                time.sleep(0.01)
        finally:
            sys.unraisablehook = hook
        assert unraisable == []
    finally:
        signal.signal(signal.SIGTERM, before)

    counts = {}
    with _stoppable(counts, print):  # no signal: the handler it found is put back
        pass
    assert signal.getsignal(signal.SIGTERM) == before and not counts
