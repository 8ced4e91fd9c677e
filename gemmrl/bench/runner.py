"""A benchmark run: for each problem, prepare every implementation, verify it, time all of them
together in each mode, and store the results as one transaction per (problem, mode).

Resumable: a (problem, mode) whose implementations are all in the store under the same
protocol is skipped, and a verification that passed on this device is not repeated. A deadline
or SIGTERM ends the run between problems with everything done so far kept.
"""

from __future__ import annotations

import gc
import signal
from contextlib import contextmanager
import sys
import time
import uuid
from dataclasses import dataclass, field

import torch

from gemmrl.bench import env, timing
from gemmrl.bench.stats import judge_floor
from gemmrl.bench.worker import HEARTBEAT_ENV, Worker, beat, last_beat, stop_if_context_lost
from gemmrl.build.toolchain import ToolchainMissing
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
    # with retime: measure again only where no run after this one measured every implementation
    # in that mode (a cut retime resumed in a later call)
    retime_after: int | None = None
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


class StopFlag:
    stopped = False
    reason = ""  # the exception's type name: _Stop (a SIGTERM) or KeyboardInterrupt


def _ignore_later_sigterm(signum, frame):
    """The SIGTERM handler once a stop has begun: the stop finishes what it writes."""


@contextmanager
def stop_on_sigterm():
    """A SIGTERM or Ctrl-C inside cuts the block and sets the flag it yields, instead of killing
    the process before the run's end is recorded (bench's compiling between its slices, and
    _stoppable's loop). The first SIGTERM stops; any more are ignored, so the stop's own logging
    and the command's summary are not cut (coreutils `timeout` signals the command and then its
    whole process group, so the command gets SIGTERM twice). They are ignored by a Python handler
    that does nothing, not by SIG_IGN: the second SIGTERM can reach the interpreter's C handler
    after the first one's Python handler began and before SIG_IGN is in place, and Python then
    finds a signal pending whose handler is SIG_IGN and prints "OSError: Signal 15 ignored due to
    race condition" with a traceback into the log (H200, 2026-11-30, run 720: a clean stop that
    read as a crash). A child started after the stop does not inherit the handler, as it would
    SIG_IGN: it can still be stopped."""
    flag = StopFlag()
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, _ignore_later_sigterm)
        raise _Stop("SIGTERM")
    signal.signal(signal.SIGTERM, on_term)
    try:
        yield flag
    except (_Stop, KeyboardInterrupt) as e:
        flag.stopped, flag.reason = True, type(e).__name__
    finally:
        if not flag.stopped:
            signal.signal(signal.SIGTERM, prev)


@contextmanager
def _stoppable(counts: dict, log):
    """SIGTERM or Ctrl-C ends the loop inside between problems' store writes, never mid-write:
    everything finished is in the store and a rerun resumes."""
    with stop_on_sigterm() as flag:
        yield
    if flag.stopped:
        counts["stopped"] = True
        log(f"stopped ({flag.reason}); everything measured so far is in the store")


def _until_deadline(problems, cfg, counts: dict, log, progress):
    """The problems in turn, until the deadline passes (checked before each, so none is cut)."""
    for idx, problem in enumerate(problems):
        if cfg.deadline is not None and time.monotonic() > cfg.deadline:
            counts["stopped"] = True
            counts["deadline_after"] = idx  # the first idx problems were done (a SIGTERM sets no such key)
            log(f"deadline reached after {idx} of {len(problems)} problems; rerun to resume")
            return
        yield problem
        if progress is not None:
            progress(idx + 1, problem)


def run(problems, impls, store, cfg: RunConfig, *, device: str, run_id: int, progress=None,
        log=print) -> dict:
    """Returns counts: measured, skipped, failed verifications, stopped early."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    counts = {"problems": len(problems), "sessions": 0, "skipped": 0, "rejected": 0,
              "stopped": False}
    with _stoppable(counts, log):
        for problem in _until_deadline(problems, cfg, counts, log, progress):
            _one_problem(problem, impls, store, cfg, device, run_id, l2, counts, log)
    return counts


def _usable(problem, impls, store, cfg, device) -> list:
    """Implementations to run on a problem: those that serve it, minus the quarantined (crashed
    or hung here before) and, unless re-timing, those already rejected on this device."""
    bad = store.quarantined(device, problem)
    out = []
    for impl in impls:
        if impl.name in bad or not impl.supports(problem):
            continue
        prior = store.verification(device, problem, impl.name) if cfg.do_verify else None
        if prior is not None and not prior["passed"] and not cfg.retime:
            continue
        out.append(impl)
    return out


def _one_problem(problem, impls, store, cfg, device, run_id, l2, counts, log):
    impls = _usable(problem, impls, store, cfg, device)
    todo_modes = []
    for mode in cfg.modes:
        names = {i.name for i in impls}
        if cfg.repeat_impl in names:
            names.add(cfg.repeat_impl + REPEAT_SUFFIX)
        # retime_after: what runs after it measured counts as done; plain retime: nothing does
        if (cfg.retime and cfg.retime_after is None) or not names <= store.measured_impls(
                device, problem, mode, cfg.protocol(mode), after_run=cfg.retime_after):
            todo_modes.append(mode)
        else:
            counts["skipped"] += 1
    if not todo_modes:
        return
    calls = {}
    ref_fn = _fp16_acc_reference() if problem.acc == "fp16" else None
    for impl in impls:
        beat(f"impl:{impl.name}")
        try:
            fn = impl.prepare(problem)
        except UnsupportedProblem as e:
            log(f"{problem.shape} {impl.name}: unsupported: {e}")
            continue
        except ToolchainMissing:  # the machine lacks nvcc or headers: no failure of the impl's
            raise
        except Exception as e:
            store.record_verification(run_id, device, problem, impl.name, False,
                                      f"prepare failed: {type(e).__name__}: {e}"[:2000], {})
            counts["rejected"] += 1
            log(f"{problem.shape} {impl.name}: prepare failed: {type(e).__name__}: {e}"[:300])
            stop_if_context_lost(f"{impl.name} on {problem.shape}")
            torch.cuda.synchronize()
            continue
        if cfg.do_verify:
            prior = store.verification(device, problem, impl.name)
            # a baseline that chose anew (cuBLASLt autotuned) is verified again with its new choice
            choice = impl.describe().get("choice")
            same = prior is not None and (choice is None
                                          or (prior["details"].get("impl") or {}).get("choice") == choice)
            if not (prior and prior["passed"] and same and not cfg.retime):
                beat(f"impl:{impl.name}")
                res = verify(impl, problem, fn=fn, ref_fn=ref_fn, seed=cfg.seed)
                store.record_verification(run_id, device, problem, impl.name, res.passed,
                                          res.reason, {**res.details, "impl": impl.describe()})
                if not res.passed:
                    counts["rejected"] += 1
                    log(f"{problem.shape} {impl.name}: REJECTED: {res.reason}")
                    # a sticky CUDA error here would fail every implementation after this one
                    # (and record them as wrong): the worker exits, its parent quarantines this
                    # one and runs the problem again without it
                    stop_if_context_lost(f"{impl.name} on {problem.shape}")
                    continue
        calls[impl.name] = fn
    if cfg.repeat_impl in calls:
        calls[cfg.repeat_impl + REPEAT_SUFFIX] = calls[cfg.repeat_impl]
    session = uuid.uuid4().hex[:12]
    for mode in todo_modes:
        if not calls:
            break
        beat(f"timing:{mode}")
        if mode == "kernel":
            res = timing.time_kernel(problem, calls, l2_bytes=l2, settings=cfg.kernel, seed=cfg.seed)
        else:
            res = timing.time_host(problem, calls, settings=getattr(cfg, mode), seed=cfg.seed)
        res = judge_floor(problem, res, store.reference_peaks(device), {i.name for i in impls if i.trusted})
        state = env.gpu_state()  # the GPU right after the session: temperatures, clocks, throttling
        if state:
            for r in res.values():
                r["details"] = {**(r.get("details") or {}), "gpu_state": state}
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


_CHILD: dict = {}


def problem_task(problem, impl_specs, cfg, device, run_id, db_path, include_dirs=()):
    """One problem, in a worker process: implementations are rebuilt from their names once per
    worker and kept (autotuning and candidate choices live in the store either way)."""
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.store.db import Store

    key = (tuple(impl_specs), str(db_path), tuple(include_dirs), device)
    if _CHILD.get("key") != key:
        env.use_harness_settings()
        store = Store(db_path)
        _CHILD.clear()
        _CHILD.update(key=key, store=store, impls=impls_from_specs(impl_specs, store, device, include_dirs),
                      l2=torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    counts = {"sessions": 0, "skipped": 0, "rejected": 0}
    _one_problem(problem, _CHILD["impls"], _CHILD["store"], cfg, device, run_id, _CHILD["l2"], counts,
                 lambda m: print(m, flush=True))
    return counts


def run_isolated(problems, impl_specs, store, cfg: RunConfig, *, device: str, run_id: int,
                 db_path: str, include_dirs=(), progress=None, log=print, task=None,
                 timeout_s: float = 900.0, max_attempts: int = 3) -> dict:
    """`run`, with every problem done in a worker process. A crash or hang kills only the worker;
    what was running (the last heartbeat: an implementation or a candidate kernel) is
    quarantined for that problem and recorded, and the problem is tried again without it."""
    import os
    import tempfile

    task = task or problem_task
    fd, hb = tempfile.mkstemp(prefix="gemmrl-heartbeat-")
    os.close(fd)
    counts = {"problems": len(problems), "sessions": 0, "skipped": 0, "rejected": 0, "quarantined": 0,
              "errors": 0, "stopped": False}
    worker = Worker(env={HEARTBEAT_ENV: hb})
    try:
        with _stoppable(counts, log):
            for problem in _until_deadline(problems, cfg, counts, log, progress):
                _isolated_problem(problem, worker, hb, task, impl_specs, store, cfg, device, run_id,
                                  db_path, include_dirs, timeout_s, max_attempts, counts, log)
    finally:
        worker.close()
        os.unlink(hb)
    return counts


def _isolated_problem(problem, worker, hb, task, impl_specs, store, cfg, device, run_id, db_path,
                      include_dirs, timeout_s, max_attempts, counts, log) -> None:
    for _attempt in range(max_attempts):
        beat_clear(hb)
        r = worker.run(task, problem, list(impl_specs), cfg, device, run_id, db_path,
                       tuple(include_dirs), timeout_s=timeout_s)
        if r.ok:
            for k, v in r.value.items():
                counts[k] = counts.get(k, 0) + v
            return
        r.raise_if_toolchain_missing()  # every later problem would fail the same way: stop the run
        if r.status == "error":  # an exception in gemmrl's own code: report, move on
            counts["errors"] += 1
            lost = r.details.get("context_lost")
            log(f"{problem.shape}: error: {r.reason}"
                + (f" (it left the CUDA context unusable: {lost}; a fresh worker takes the next problem)"
                   if lost else ""))
            return
        culprit = last_beat(hb)
        kind, _, name = culprit.partition(":")
        if kind not in ("impl", "candidate") or not name:
            counts["errors"] += 1
            log(f"{problem.shape}: worker {r.status} ({r.reason}) during {culprit or 'setup'}; skipped")
            return
        why = f"{r.status} on {problem.shape}: {r.reason}"
        store.quarantine(device, problem, name, why)
        if kind == "impl":
            store.record_verification(run_id, device, problem, name, False, why + "; quarantined", {})
        counts["quarantined"] += 1
        log(f"{problem.shape} {name}: {why}; quarantined, trying the problem again without it")


def beat_clear(path: str) -> None:
    with open(path, "w"):
        pass


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
