"""Tasks for the worker tests: importable by the spawned child."""

import ctypes
import os
import time


def add(a, b):
    return a + b


def pid():
    return os.getpid()


def env(name):
    return os.environ.get(name)


def boom():
    raise ValueError("bad kernel")


def segfault():
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as an illegal memory access would


def hard_exit():
    os._exit(3)


def hang(seconds):
    time.sleep(seconds)
    return "woke"


def unpicklable():
    return lambda: None


def fake_problem_task(problem, impl_specs, cfg, device, run_id, db_path, include_dirs=()):
    """Stands in for runner.problem_task: 'segv' crashes, 'hang' hangs, 'search' crashes on its
    candidate 'bad_spec' unless that is quarantined, anything else is measured."""
    from gemmrl.bench.worker import beat
    from gemmrl.store.db import Store

    store = Store(db_path)
    bad = store.quarantined(device, problem)
    done = {}
    for name in impl_specs:
        if name in bad:
            continue
        beat(f"impl:{name}")
        if name == "segv" and problem.M == 128:
            segfault()
        if name == "hang" and problem.M == 256:
            time.sleep(60)
        if name == "search":
            if "bad_spec" not in bad:
                beat("candidate:bad_spec")
                segfault()
            beat(f"impl:{name}")
        done[name] = {"median_us": 1.0, "mean_us": 1.0, "min_us": 1.0, "p10_us": 1.0, "p90_us": 1.0,
                      "std_us": 0.0, "n": 1, "status": "ok", "details": {}}
    store.record_session(run_id, "s", device, problem, "kernel", "kernel:v1", done)
    store.close()
    return {"sessions": 1, "skipped": 0, "rejected": 0}


def fake_evaluate_task(problem, candidates, device, db_path, baseline_us):
    """Stands in for search.run.evaluate_task: the candidate named in $GEMMRL_TEST_BAD crashes
    its worker; the others time at baseline_us / 1.25 and earn reward 1.25."""
    from gemmrl.bench.worker import beat
    from gemmrl.search.policy import Trial

    out = []
    for c in candidates:
        beat("candidate:" + c.name)
        if c.name == os.environ.get("GEMMRL_TEST_BAD"):
            segfault()
        out.append(Trial(problem, c, "ok", baseline_us / 1.25, 1.25, {"device_s": 0.01}))
    return out


def fake_hang_or_evaluate_task(problem, candidates, device, db_path, baseline_us):
    """fake_evaluate_task, but the candidate named in $GEMMRL_TEST_HANG sleeps for a minute."""
    from gemmrl.bench.worker import beat

    for c in candidates:
        if c.name == os.environ.get("GEMMRL_TEST_HANG"):
            beat("candidate:" + c.name)
            time.sleep(60)
    return fake_evaluate_task(problem, candidates, device, db_path, baseline_us)


def fake_gpu_name():
    """The GPU name of the worker: item $GEMMRL_ACTOR_INDEX of $GEMMRL_TEST_GPU_NAMES (comma-separated)."""
    names = os.environ.get("GEMMRL_TEST_GPU_NAMES", "cpu").split(",")
    return names[int(os.environ.get("GEMMRL_ACTOR_INDEX", "0")) % len(names)]


def fake_source_task(problem, source, baseline_us):
    """Stands in for llm.evaluate.source_task: scrubs the environment as it does, reports
    whether the API key is still visible, crashes on a source containing CRASH_ME."""
    from gemmrl.llm.evaluate import _scrub_environment

    _scrub_environment()
    if "CRASH_ME" in source:
        segfault()
    return {"status": "ok", "time_us": baseline_us / 2, "reward": 2.0,
            "key_visible": "GEMMRL_LLM_API_KEY" in os.environ or "OPENAI_API_KEY" in os.environ}


def _simulate_lost_context():
    """From here on this process's CUDA context reads as lost (as after an illegal address)."""
    from gemmrl.bench import worker

    worker.cuda_context_error = lambda: "AcceleratorError: CUDA error: an illegal memory access (simulated)"


def returns_then_context_lost(value):
    """Finishes its task, but CUDA is unusable afterwards: the worker must not serve another."""
    _simulate_lost_context()
    return value


def loses_context_in(name):
    """What the runner does when `name` failed verification and took the CUDA context with it."""
    from gemmrl.bench.worker import beat, stop_if_context_lost

    beat(f"impl:{name}")
    _simulate_lost_context()
    stop_if_context_lost(name)
    return "went on"  # must not be reached


def lose_cuda_context():
    """A real sticky error: a device-side assert (an index out of bounds) in torch's own kernel."""
    import torch

    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 20], device="cuda")] = 1.0
    torch.cuda.synchronize()


def cuda_sum():
    import torch

    return (os.getpid(), float(torch.ones(4, device="cuda").sum().item()))


def build_three(cache_dir, threads):
    """build_many of three tiny sources from inside the worker (a daemon process)."""
    from gemmrl.build.pool import build_many

    src = 'extern "C" int gemmrl_daemon_{n}() {{ return {n}; }}\n'
    res = build_many([(f"d{n}", src.format(n=n), {"cache_dir": cache_dir}) for n in range(3)],
                     workers=3, threads=threads)
    return [r.ok for r in res]


def no_headers():
    from gemmrl.build.cutlass import CutlassHeadersMissing

    raise CutlassHeadersMissing("CUTLASS headers not found")
