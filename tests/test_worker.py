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
