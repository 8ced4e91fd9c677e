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
