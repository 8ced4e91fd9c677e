"""A worker process that runs tasks for the parent and may die doing so.

A candidate kernel can crash its process (illegal address, lost CUDA context) or hang. Work that
runs one goes to a `Worker`: a child process (spawned, so the parent never initialises CUDA for
it) that runs `fn(*args)` for each task. A task that raises comes back as an 'error' record, one
that kills the process as 'crashed' (with the exit code or signal), one that outlives its time
limit as 'timeout' (the process is killed). Either way a fresh process serves the next task, and
the caller goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field


HEARTBEAT_ENV = "GEMMRL_HEARTBEAT"
# a worker exits with this code when its CUDA context is lost (stop_if_context_lost)
CONTEXT_LOST_EXIT = 75


class CudaContextLost(RuntimeError):
    """A sticky CUDA error (an illegal memory access, a device-side assert, a launch failure)
    left this process's CUDA context unusable: every later CUDA call in it fails."""


def cuda_context_error() -> str | None:
    """The error a trivial CUDA operation raises now, or None where it runs (or CUDA was never
    started in this process). After a sticky error every CUDA call fails the same way, so the
    implementations verified or timed after the culprit would fail too, for no fault of theirs."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        torch.cuda.synchronize()
        x = torch.ones(1, device="cuda")
        if float(x.add_(1).item()) != 2.0:  # .item() waits for the kernel
            return "a one-element add on the GPU gave a wrong answer"
    except Exception as e:  # noqa: BLE001 - whatever CUDA raises is the answer
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return None


def stop_if_context_lost(culprit: str) -> None:
    """Call after `culprit` failed on the GPU. Where the CUDA context is gone, a worker exits at
    once with CONTEXT_LOST_EXIT: its heartbeat still names the culprit, so the parent quarantines
    it and runs the rest again in a fresh process; outside a worker, CudaContextLost is raised."""
    err = cuda_context_error()
    if err is None:
        return
    msg = f"{culprit} left the CUDA context unusable ({err}); nothing more can run in this process"
    if os.environ.get(HEARTBEAT_ENV):
        sys.stderr.write(f"worker: {msg}; exiting ({CONTEXT_LOST_EXIT})\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(CONTEXT_LOST_EXIT)
    raise CudaContextLost(msg)


def beat(what: str) -> None:
    """Say what the worker is about to run (an implementation, a candidate kernel), so that if
    it dies the parent knows whom to blame. A no-op outside a worker."""
    path = os.environ.get(HEARTBEAT_ENV)
    if path:
        with open(path, "w") as f:
            f.write(what)
            f.flush()


def last_beat(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _serve(conn, env: dict) -> None:
    os.environ.update(env)
    while True:
        try:
            msg = conn.recv()  # unpickling imports the task's module: part of starting, not of the task
        except (EOFError, KeyboardInterrupt):
            return
        except BaseException as e:  # noqa: BLE001 - a task that cannot be loaded is its error
            conn.send(("started", None))
            conn.send(("error", f"the task could not be loaded: {type(e).__name__}: {e}"))
            continue
        if msg is None:
            return
        conn.send(("started", None))  # the time limit runs from here
        fn, args, kwargs = msg
        flags = {}
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything goes back as a record
            out = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
            from gemmrl.build.toolchain import ToolchainMissing

            if isinstance(e, ToolchainMissing):  # the machine's problem: the parent stops its run
                flags["toolchain_missing"] = True
        # the task (or its error) may have left CUDA unusable here: then the record says so,
        # and this process exits, so that the next task gets a fresh one rather than failing
        lost = cuda_context_error()
        try:
            conn.send(out + (lost, flags))
        except Exception as e:  # an unpicklable result is the task's error, not the worker's
            conn.send(("error", f"result could not be sent back: {type(e).__name__}: {e}", lost, {}))
        if lost is not None:
            conn.close()
            os._exit(CONTEXT_LOST_EXIT)


@dataclass
class TaskResult:
    status: str  # ok | error | crashed | timeout
    value: object = None
    reason: str = ""
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raise_if_toolchain_missing(self) -> None:
        """A task that failed for want of nvcc or the CUDA headers (build.toolchain) fails its
        caller's whole run: no record of it is the kernel's."""
        if self.details.get("toolchain_missing"):
            from gemmrl.build.toolchain import ToolchainMissing

            raise ToolchainMissing(self.reason)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code == CONTEXT_LOST_EXIT:
        return (f"exited with code {code}: a sticky CUDA error (an illegal memory access, a device-side "
                "assert) lost its CUDA context")
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Worker:
    """One child process, replaced whenever it dies or hangs. `env` is set in the child before
    any task runs (e.g. CUDA_VISIBLE_DEVICES to pin it to one GPU)."""

    def __init__(self, env: dict | None = None, start_method: str = "spawn"):
        self.env = dict(env or {})
        self.ctx = mp.get_context(start_method)
        self.proc = None
        self.conn = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child, self.env), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def _crashed(self, t0: float, when: str = "") -> TaskResult:
        """The worker process died: a record with how it exited; a fresh one serves next."""
        self.proc.join(timeout=10)
        code = self.proc.exitcode
        self._kill()
        self.restarts += 1
        return TaskResult("crashed", reason=f"worker {_describe_exit(code)}{when}",
                          seconds=time.monotonic() - t0, details={"exitcode": code})

    def run(self, fn, *args, timeout_s: float = 600.0, startup_s: float = 300.0, **kwargs) -> TaskResult:
        """Run fn(*args, **kwargs) in the worker; fn must be importable (a module-level function).
        `timeout_s` limits the task itself; starting a fresh process and importing the task's
        module (slow on a loaded machine, or the first time torch is imported) has its own
        limit, `startup_s`."""
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self.restarts += 1
            self._kill()
            self._start()
        t0 = time.monotonic()
        try:
            self.conn.send((fn, args, kwargs))
        except (BrokenPipeError, OSError) as e:
            self._kill()
            return TaskResult("crashed", reason=f"worker gone before the task started: {e}")
        try:
            started = self.conn.poll(startup_s) and self.conn.recv()[0] == "started"
        except (EOFError, OSError):
            started = None
        if not started:
            if started is False and self.proc.is_alive():
                self._kill()
                self.restarts += 1
                return TaskResult("timeout", reason=f"the worker did not start the task within {startup_s:g} s; "
                                  "worker killed", seconds=time.monotonic() - t0)
            return self._crashed(t0, " before the task started")
        t0 = time.monotonic()
        if not self.conn.poll(timeout_s):
            self._kill()
            self.restarts += 1
            return TaskResult("timeout", reason=f"no answer within {timeout_s:g} s; worker killed",
                              seconds=time.monotonic() - t0)
        try:
            got = self.conn.recv()
        except (EOFError, OSError):
            return self._crashed(t0)
        dt = time.monotonic() - t0
        status, value = got[0], got[1]
        lost = got[2] if len(got) > 2 else None
        extra = dict(got[3]) if len(got) > 3 else {}  # toolchain_missing: see _serve
        if lost is not None:  # the worker exits after this task (_serve): wait for it, start anew
            self._kill()
            self.restarts += 1
            extra["context_lost"] = lost
        if status == "ok":
            return TaskResult("ok", value=value, seconds=dt, details=extra)
        return TaskResult("error", reason=str(value).splitlines()[0], seconds=dt,
                          details={"traceback": value, **extra})

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(timeout=5)
            except (BrokenPipeError, OSError):
                pass
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
