"""The LLM evaluator's process side on the CPU: credentials are gone in the worker, a sample that
kills it is 'crashed' and the next sample still runs."""

from gemmrl.core.problem import Problem
from gemmrl.llm.evaluate import gpu_source_evaluator
import worker_tasks


def test_worker_sees_no_key_and_survives_a_crashing_sample(monkeypatch):
    monkeypatch.setenv("GEMMRL_LLM_API_KEY", "sk-FAKE-test-key")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-FAKE-other")
    evaluate, close = gpu_source_evaluator(lambda p: 10.0, task=worker_tasks.fake_source_task, timeout_s=60)
    try:
        p = Problem(64, 64, 64)
        ok = evaluate(p, "__global__ void k() {}")
        assert ok["status"] == "ok" and ok["time_us"] == 5.0 and ok["key_visible"] is False
        bad = evaluate(p, "// CRASH_ME")
        assert bad["status"] == "crashed" and "SIGSEGV" in bad["reason"]
        assert evaluate(p, "again")["status"] == "ok"
    finally:
        close()
