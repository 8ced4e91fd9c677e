"""Ray actors that verify and time candidates, one per GPU, and Ray tasks that compile them.

Scheduling is Ray's: actors are placed with `num_gpus=1` (Ray pins each to its GPU through
CUDA_VISIBLE_DEVICES) and a batch is split into one chunk per actor and gathered with ray.get.
Inside an actor the chunk runs in a `Worker` child process through `search.run.run_batch`, the
same crash/hang/quarantine loop as `isolated_evaluator`; quarantines go back to the driver, which
alone writes the store. Ray is imported lazily, so this module loads without it.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from gemmrl.build.nvcc import cache_entry, install_built
from gemmrl.build.toolchain import ToolchainMissing
from gemmrl.search.policy import Trial

INSTALL_HINT = "pip install 'gemmrl[distributed]'"


def available() -> bool:
    """Whether Ray can be imported."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray():
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"Ray is not installed: {INSTALL_HINT}") from e
    return ray


def gpu_name() -> str:
    """In a worker process: the name of the GPU it sees ('cpu' without one)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a broken driver is 'no GPU' here
        pass
    return "cpu"


class EvalActor:
    """Holds one Worker (one process on one GPU) and runs batches in it."""

    def __init__(self, index: int, env: dict, timeout_s: float, task, name_task):
        from gemmrl.bench.worker import HEARTBEAT_ENV, Worker

        fd, self.hb = tempfile.mkstemp(prefix="gemmrl-ray-heartbeat-")
        os.close(fd)
        self.worker = Worker(env={**env, HEARTBEAT_ENV: self.hb, "GEMMRL_ACTOR_INDEX": str(index)})
        self.timeout_s, self.task, self.name_task = timeout_s, task, name_task
        # the cache the worker process builds into: its environment's, else this process's
        cache = env.get("GEMMRL_CACHE") or os.environ.get("GEMMRL_CACHE")
        self.cache_dir = os.path.join(cache, "builds") if cache else None
        self.where = f"{socket.gethostname()}:gpu{os.environ.get('CUDA_VISIBLE_DEVICES', '-')}:actor{index}"

    def gpu_name(self) -> str:
        r = self.worker.run(self.name_task, timeout_s=300)
        return str(r.value) if r.ok else f"unknown ({r.status}: {r.reason})"

    def evaluate(self, problem, candidates, device: str, db_path: str, baseline_us: float, builds=()):
        from gemmrl.search.run import run_batch

        logs, bad = [], []
        if builds:  # compiled by Ray CPU tasks, maybe on another node: into this node's cache
            import ray

            installed = 0
            for b in ray.get(list(builds)):
                if b.get("ok"):
                    entry = _entry_for(b["job"], self.cache_dir)
                    installed += install_built(entry, b["files"])
            if installed:
                logs.append(f"{problem.shape}: installed {installed} kernel(s) compiled by Ray tasks")
        trials = run_batch(self.worker, self.hb, problem, candidates, device, db_path, baseline_us,
                           timeout_s=self.timeout_s, task=self.task, log=logs.append,
                           quarantine=lambda p, name, why: bad.append((name, why)))
        for t in trials:
            t.details.setdefault("worker", self.where)
        return trials, bad, [f"[{self.where}] {m}" for m in logs]

    def restarts(self) -> int:
        return self.worker.restarts

    def close(self) -> None:
        self.worker.close()
        try:
            os.unlink(self.hb)
        except OSError:
            pass


def _entry_for(job: tuple, cache_dir: str | None):
    name, source, kwargs = job
    kw = dict(kwargs)
    if cache_dir is not None:
        kw["cache_dir"] = cache_dir
    return cache_entry(source, name=name, **kw)


def build_artifact(job: tuple) -> dict:
    """A Ray CPU task: compile one job (name, source, build_shared keywords) into this node's
    cache and return the result with its files, so the node that runs the kernel can install
    them. Failed builds return their log only."""
    from gemmrl.build.pool import _job

    r = _job(job)
    out = {"job": job, "ok": bool(r.ok), "log": r.log[-4000:], "seconds": r.seconds, "cached": r.cached}
    if r.ok:
        folder = Path(r.path).parent
        out["files"] = {f.name: f.read_bytes() for f in folder.iterdir()
                        if not f.name.startswith(".") and f.is_file()}
    return out


def candidate_jobs(problem, candidates) -> list[tuple]:
    """The build jobs of a batch (one per candidate): what SpecImpl.prepare would compile."""
    from gemmrl.build.ahead import job_for

    return [job_for(c.spec, problem).as_tuple() for c in candidates]


def _gpu_count(ray, gpus_per_node: int | None) -> int:
    total = 0
    for node in ray.nodes():
        if node.get("Alive"):
            g = int(node.get("Resources", {}).get("GPU", 0))
            total += min(g, gpus_per_node) if gpus_per_node else g
    return total


def ray_evaluator(address, store, device: str, db_path: str, baseline_fn, *, gpus_per_node: int | None = None,
                  timeout_s: float = 900.0, log=print, task=None, actors: int | None = None,
                  num_gpus: float = 1, num_cpus: float = 1, worker_env: dict | None = None, name_task=None,
                  compile_tasks: bool = True, build_cpus: float = 1, jobs_fn=None):
    """Like `search.run.isolated_evaluator`, on a pool of Ray actors: returns (evaluate, close).

    `address`: a Ray address to `ray.init`, or None to use the Ray already initialised (or a
    local one). One actor per GPU of the cluster (at most `gpus_per_node` per node), or `actors`
    of them (needed with num_gpus=0, for CPU tests). Actors whose GPU name is not `device` are
    not used (logged). `worker_env` is set in every worker process; `task` and `name_task`
    stand in for evaluate_task and gpu_name in the tests.

    With `compile_tasks`, every candidate of a batch is first compiled by a Ray task on a CPU
    worker (`build_cpus` CPUs each, anywhere in the cluster); the actor installs the results into
    its node's build cache before its worker runs, so GPU actors never wait on nvcc for a kernel
    another task has built. `jobs_fn(problem, candidates)` gives the build jobs (default: what
    SpecImpl would compile)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address)
    if task is None:
        from gemmrl.search.run import evaluate_task as task
    n = actors if actors is not None else _gpu_count(ray, gpus_per_node)
    if n < 1:
        raise RuntimeError("no GPU in the Ray cluster (pass actors= with num_gpus=0 to run on CPUs)")
    Actor = ray.remote(EvalActor).options(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=1,
                                          max_task_retries=1, scheduling_strategy="SPREAD")
    pool = [Actor.remote(i, dict(worker_env or {}), timeout_s, task, name_task or gpu_name) for i in range(n)]
    names = ray.get([a.gpu_name.remote() for a in pool], timeout=600)
    used = []
    for i, (a, name) in enumerate(zip(pool, names)):
        if name == device:
            used.append(a)
        else:
            log(f"ray actor {i}: GPU {name!r} is not {device!r}; not used (timings are compared within one GPU model)")
            ray.kill(a)
    if not used:
        raise RuntimeError(f"no Ray actor has a {device!r} GPU (found: {', '.join(sorted(set(names)))})")
    log(f"ray: {len(used)} {device} worker(s)" + (", kernels compiled by Ray CPU tasks" if compile_tasks else ""))
    build = ray.remote(num_cpus=build_cpus)(build_artifact) if compile_tasks else None

    def evaluate(problem, candidates):
        candidates = list(candidates)
        if not candidates:
            return []
        k = min(len(used), len(candidates))
        chunks = [candidates[i * len(candidates) // k:(i + 1) * len(candidates) // k] for i in range(k)]
        base = baseline_fn(problem)
        builds = [[] for _ in chunks]
        if compile_tasks:
            try:
                per = [(jobs_fn or candidate_jobs)(problem, c) for c in chunks]
            except Exception as e:  # noqa: BLE001 - a spec that cannot render fails in its worker
                log(f"{problem.shape}: no build tasks ({type(e).__name__}: {e})")
                per = [[] for _ in chunks]
            builds = [[build.remote(j) for j in js] for js in per]
        refs = [a.evaluate.remote(problem, c, device, db_path, base, b)
                for a, c, b in zip(used, chunks, builds)]
        got: dict[str, Trial] = {}
        for ref, chunk in zip(refs, chunks):
            try:
                trials, bad, logs = ray.get(ref)
            except ray.exceptions.RayError as e:  # the actor itself died twice: not the candidates' fault
                if isinstance(getattr(e, "cause", None), ToolchainMissing):  # that node lacks nvcc/headers
                    raise ToolchainMissing(f"{e.cause} (a Ray worker)") from e
                why = f"ray actor lost: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{problem.shape}: {why}")
                trials, bad, logs = [Trial(problem, c, "rejected", details={"reason": why, "device_s": 0.0})
                                     for c in chunk], [], []
            for m in logs:
                log(m)
            for name, why in bad:
                store.quarantine(device, problem, name, why)
            got.update((t.candidate.name, t) for t in trials)
        return [got[c.name] for c in candidates if c.name in got]

    def close():
        try:
            ray.get([a.close.remote() for a in used], timeout=60)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        for a in used:
            ray.kill(a)

    return evaluate, close


def ray_prebuild(jobs: list[tuple[str, str, dict]], *, num_cpus: float = 1) -> list:
    """Compile jobs (as in build.pool.build_many: name, source, build_shared keywords) as Ray
    tasks on CPU workers; BuildResults in job order (each node caches on its own disk)."""
    ray = _ray()
    from gemmrl.build.pool import _job

    if not jobs:
        return []
    build = ray.remote(num_cpus=num_cpus)(_job)
    return ray.get([build.remote(j) for j in jobs])
