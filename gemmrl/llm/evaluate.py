"""The GPU side of the LLM loop: a generated kernel is built in the sandbox, then loaded,
verified (every check, the profiler trace included) and timed in a worker process whose
environment holds no credentials; a crash or hang is that sample's 'crashed' outcome."""

from __future__ import annotations

import os

from gemmrl.bench.worker import Worker
from gemmrl.llm.sandbox import sandboxed_build, scrubbed_env
from gemmrl.search.reward import reward


def _scrub_environment() -> None:
    keep = scrubbed_env()
    for name in list(os.environ):
        if name not in keep:
            del os.environ[name]


def source_task(problem, source: str, baseline_us: float) -> dict:
    """In the worker: build, load, verify, time, reward. Never raises for a bad kernel."""
    _scrub_environment()
    from gemmrl.bench.timing import pick_fastest
    from gemmrl.runtime.abi import AbiError, AbiImpl
    from gemmrl.verify.checks import verify

    b = sandboxed_build(source, name=f"llm_{problem.M}x{problem.N}x{problem.K}")
    out = {"build_log": str(b.get("log", ""))[-4000:], "resources": b.get("resources", [])}
    if not b.get("ok"):
        return {**out, "status": "compile_error", "reason": "nvcc failed"}
    try:
        impl = AbiImpl(b["path"], name="llm-candidate")
    except AbiError as e:
        return {**out, "status": "rejected", "reason": str(e)}
    if not impl.supports(problem):
        return {**out, "status": "rejected", "reason": f"gemmrl_meta() says {impl.kernel.meta}, "
                                                          f"the problem is {problem.dtype}/{problem.acc}"}
    fn = impl.prepare(problem)
    v = verify(impl, problem, fn=fn)
    if not v.passed:
        return {**out, "status": "rejected", "reason": v.reason, "rel_err": v.details.get("rel_err")}
    try:
        _, res = pick_fastest(problem, {"llm": fn})
    except RuntimeError as e:
        return {**out, "status": "rejected", "reason": f"timed output wrong: {e}"}
    t = res["llm"]["median_us"]
    if os.environ.get("GEMMRL_NCU", "1") != "0":
        from gemmrl.llm import ncu

        metrics = ncu.profile(b["path"], problem.M, problem.N, problem.K)
        if metrics:
            out["ncu"] = metrics
    return {**out, "status": "ok", "time_us": t, "baseline_us": baseline_us,
            "rel_err": v.details.get("rel_err"),
            "reward": reward(baseline_us, t, True, v.details.get("rel_err"), v.details.get("ref_err"),
                             len(source))}


def gpu_source_evaluator(baseline_fn, *, timeout_s: float = 600.0, task=source_task):
    """evaluate_source(problem, source) -> dict for gemmrl.llm.loop.refine, and close()."""
    worker = Worker(env={})

    def evaluate_source(problem, source: str) -> dict:
        r = worker.run(task, problem, source, baseline_fn(problem), timeout_s=timeout_s)
        if r.ok:
            return r.value
        r.raise_if_toolchain_missing()  # no nvcc here: not the model's kernel's fault
        if r.status == "error":
            return {"status": "rejected", "reason": r.reason}
        return {"status": "crashed", "reason": f"{r.status}: {r.reason}"}

    return evaluate_source, worker.close
