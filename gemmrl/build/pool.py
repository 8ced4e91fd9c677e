"""Build many sources at once in worker processes that never touch CUDA.

Each job is (name, source, build_shared keyword arguments); results come back in job order as
BuildResult records (a failed or timed-out build is a record with its log, not an exception).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from multiprocessing import get_context

from gemmrl.build.nvcc import BuildResult, build_shared


def _job(args):
    name, source, kw = args
    try:
        return build_shared(source, name=name, **kw)
    except Exception as e:  # nvcc missing, disk full: still a record
        return BuildResult(False, "", None, f"{type(e).__name__}: {e}", 0.0, False)


def default_jobs() -> int:
    return max(1, (os.cpu_count() or 2))


def build_many(jobs: list[tuple[str, str, dict]], workers: int | None = None,
               progress=None, threads: bool = False) -> list[BuildResult]:
    """Compile every job; `progress(done, total, name, result)` is called as each finishes.
    `threads`: run the builds from threads of this process instead of worker processes (each
    build is an nvcc subprocess either way), for a caller that may not start processes: the
    search's evaluator runs in a daemon process, which multiprocessing refuses children."""
    if not jobs:
        return []
    workers = max(1, min(workers or default_jobs(), len(jobs)))
    if workers == 1:
        out = []
        for i, j in enumerate(jobs):
            out.append(_job(j))
            if progress:
                progress(i + 1, len(jobs), j[0], out[-1])
        return out
    results: list[BuildResult | None] = [None] * len(jobs)
    ex = (ThreadPoolExecutor(max_workers=workers) if threads
          else ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")))
    try:
        futs = {ex.submit(_job, j): i for i, j in enumerate(jobs)}
        for done, fut in enumerate(as_completed(futs), 1):
            i = futs[fut]
            results[i] = fut.result()
            if progress:
                progress(done, len(jobs), jobs[i][0], results[i])
    except BaseException:
        # stopped (a SIGTERM, Ctrl-C): the builds not started are dropped, not run to the end;
        # those running finish into the cache
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return results  # type: ignore[return-value]
