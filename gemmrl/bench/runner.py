"""A benchmark run: for each problem, prepare every implementation, verify it, time all of them
together in each mode, and store the results as one transaction per (problem, mode).

Resumable: a (problem, mode) whose implementations are all in the store under the same
protocol is skipped, and a verification that passed on this device is not repeated. A deadline
or SIGTERM ends the run between problems with everything done so far kept.
"""

from __future__ import annotations

import gc
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

import torch

from gemmrl.bench import timing
from gemmrl.core.impl import UnsupportedProblem
from gemmrl.verify.checks import clear_reference_cache, verify

REPEAT_SUFFIX = "@repeat"


@dataclass
class RunConfig:
    modes: tuple[str, ...] = ("kernel",)
    kernel: timing.KernelSettings = field(default_factory=timing.KernelSettings)
    offline: timing.HostSettings = field(default_factory=lambda: timing.HostSettings(mode="offline"))
    server: timing.HostSettings = field(default_factory=lambda: timing.HostSettings(
        mode="server", min_rounds=40, max_rounds=100, qps=1000.0))
    do_verify: bool = True
    repeat_impl: str | None = "torch.matmul"  # timed twice in every session: the noise
    retime: bool = False
    deadline: float | None = None  # time.monotonic() after which no new problem starts
    seed: int = 0

    def protocol(self, mode: str) -> str:
        return {"kernel": self.kernel, "offline": self.offline, "server": self.server}[mode].protocol()


class _Stop(Exception):
    pass


def _fp16_acc_reference():
    from gemmrl.baselines.impls import cublas_lib

    lib = cublas_lib()

    def ref(a, b_nn):
        c = torch.empty(a.shape[0], b_nn.shape[1], dtype=a.dtype, device=a.device)
        lib.gemm("NN", "fp16", "fp16", a.data_ptr(), b_nn.data_ptr(), c.data_ptr(), a.shape[0],
                 b_nn.shape[1], a.shape[1], torch.cuda.current_stream().cuda_stream)
        return c
    return ref


def run(problems, impls, store, cfg: RunConfig, *, device: str, run_id: int, progress=None,
        log=print) -> dict:
    """Returns counts: measured, skipped, failed verifications, stopped early."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    counts = {"problems": len(problems), "sessions": 0, "skipped": 0, "rejected": 0,
              "stopped": False}
    prev_handler = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise _Stop("SIGTERM")
    signal.signal(signal.SIGTERM, on_term)
    try:
        for idx, problem in enumerate(problems):
            if cfg.deadline is not None and time.monotonic() > cfg.deadline:
                counts["stopped"] = True
                log(f"deadline reached after {idx} of {len(problems)} problems; rerun to resume")
                break
            _one_problem(problem, impls, store, cfg, device, run_id, l2, counts, log)
            if progress is not None:
                progress(idx + 1, problem)
    except (_Stop, KeyboardInterrupt) as e:
        counts["stopped"] = True
        log(f"stopped ({type(e).__name__}); everything measured so far is in the store")
    finally:
        signal.signal(signal.SIGTERM, prev_handler)
    return counts


def _one_problem(problem, impls, store, cfg, device, run_id, l2, counts, log):
    todo_modes = []
    for mode in cfg.modes:
        names = {i.name for i in impls if i.supports(problem)}
        if cfg.repeat_impl in names:
            names.add(cfg.repeat_impl + REPEAT_SUFFIX)
        have = store.measured_impls(device, problem, mode, cfg.protocol(mode))
        if cfg.retime or not names <= have:
            todo_modes.append(mode)
        else:
            counts["skipped"] += 1
    if not todo_modes:
        return
    calls = {}
    ref_fn = _fp16_acc_reference() if problem.acc == "fp16" else None
    for impl in impls:
        if not impl.supports(problem):
            continue
        try:
            fn = impl.prepare(problem)
        except UnsupportedProblem as e:
            log(f"{problem.shape} {impl.name}: unsupported: {e}")
            continue
        except Exception as e:
            store.record_verification(run_id, device, problem, impl.name, False,
                                      f"prepare failed: {type(e).__name__}: {e}"[:2000], {})
            counts["rejected"] += 1
            log(f"{problem.shape} {impl.name}: prepare failed: {type(e).__name__}: {e}"[:300])
            torch.cuda.synchronize()
            continue
        if cfg.do_verify:
            prior = store.verification(device, problem, impl.name)
            if not (prior and prior["passed"] and not cfg.retime):
                res = verify(impl, problem, fn=fn, ref_fn=ref_fn, seed=cfg.seed)
                store.record_verification(run_id, device, problem, impl.name, res.passed,
                                          res.reason, {**res.details, "impl": impl.describe()})
                if not res.passed:
                    counts["rejected"] += 1
                    log(f"{problem.shape} {impl.name}: REJECTED: {res.reason}")
                    continue
        calls[impl.name] = fn
    if cfg.repeat_impl in calls:
        calls[cfg.repeat_impl + REPEAT_SUFFIX] = calls[cfg.repeat_impl]
    session = uuid.uuid4().hex[:12]
    for mode in todo_modes:
        if not calls:
            break
        if mode == "kernel":
            res = timing.time_kernel(problem, calls, l2_bytes=l2, settings=cfg.kernel, seed=cfg.seed)
        else:
            res = timing.time_host(problem, calls, settings=getattr(cfg, mode), seed=cfg.seed)
        store.record_session(run_id, session, device, problem, mode, cfg.protocol(mode), res)
        counts["sessions"] += 1
        for name, r in res.items():
            if r.get("status") != "ok":
                log(f"{problem.shape} {mode} {name}: {r.get('status')}: {r.get('details', {}).get('reason', '')}")
    del calls
    clear_reference_cache()
    gc.collect()
    if problem.min_bytes > (256 << 20):
        torch.cuda.empty_cache()


def require_gpu() -> None:
    """Refuse a machine without a CUDA GPU with a message saying so."""
    ok = False
    try:
        ok = torch.cuda.is_available()
    except Exception:
        pass
    if not ok:
        sys.stderr.write("gemmrl: no CUDA GPU is visible on this machine (torch.cuda.is_available() "
                         "is False). Verifying and timing kernels needs an NVIDIA GPU; shapes, "
                         "reports and builds work without one.\n")
        raise SystemExit(2)
