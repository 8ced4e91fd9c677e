"""Compile ahead, a slice of the shapes at a time: the kernels an implementation will load for a list of
shapes (its build_jobs), how many of them the build cache lacks per shape, and slices of the shapes
that each hold at most one wave of nvcc processes, so that a run compiles a slice in parallel and
times it before compiling the next (bench, and tune's race and final timing). A run cut early keeps
the slices it timed; compiling every shape's kernels first could spend all its time compiling (the
forty-fifth session: 119 kernels, 150 s, then the step's end: nothing timed)."""

from __future__ import annotations


def build_plans(impls, problems) -> list:
    """Per implementation, its build_jobs over the problems (None where it compiles nothing)."""
    return [impl.build_jobs(problems) if hasattr(impl, "build_jobs") else None for impl in impls]


def unbuilt_counts(plans) -> list[int]:
    """Per problem, the kernels the plans list under it that the cache does not hold yet."""
    from gemmrl.build.nvcc import is_built

    todo = [0] * max((len(p) for p in plans if p is not None), default=0)
    for plan in plans:
        for i, jobs in enumerate(plan or ()):
            todo[i] += sum(1 for name, src, kw in jobs if not is_built(src, name=name, **kw))
    return todo


def cut_slices(problems, todo: list[int], per_slice: int) -> list[list]:
    """Consecutive slices of `problems`, each with at most `per_slice` of `todo` (a slice holds
    at least one problem)."""
    todo = todo or [0] * len(problems)
    out, cur, n = [], [], 0
    for p, k in zip(problems, todo):
        if cur and n + k > per_slice:
            out.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += k
    if cur:
        out.append(cur)
    return out


def compile_then_time(specs, problems, store, device: str, time_part, log=print) -> dict:
    """tune's timing passes: the kernels `specs` will load for `problems` (a race's contenders, a
    stored winner: BestOf.prebuild) compiled in parallel on this machine's cores, a slice of the
    shapes at a time (as bench does: at most one wave of nvcc processes a slice), each slice then
    timed by time_part(slice) -> the runner's counts. The timing worker otherwise compiles each
    contender as it reaches it, one at a time (H200, run 977: a fresh machine's race of 5 large fp16
    shapes spent 109 s on its first shape, most of it compiling its CUTLASS contenders in turn, while
    --finish-s had kept 115 s for all five, reckoned as parallel builds: search.tune.final_reserve_s).
    Counts summed over the slices; a SIGTERM while compiling stops with counts['stopped']. `log`:
    where the builds' and the stop's lines go."""
    from gemmrl.bench.select import impls_from_specs
    from gemmrl.build.pool import default_jobs
    from gemmrl.build.toolchain import ToolchainMissing

    named = [s for s in specs if s != "baselines"]
    builders = [i for i in impls_from_specs(named, store, device) if hasattr(i, "build_jobs")] if named else []
    if not builders:
        return time_part(list(problems))
    try:
        plans = build_plans(builders, problems)
        slices = cut_slices(list(problems), unbuilt_counts(plans), default_jobs())
    except ToolchainMissing:  # no nvcc or CUTLASS headers: nothing here can build, so nothing is timed
        raise
    except (OSError, RuntimeError) as e:
        log(f"could not plan the builds ahead ({type(e).__name__}: {str(e)[:200]}); the timing compiles "
            "what it needs as it goes")
        return time_part(list(problems))
    return time_in_slices(builders, plans, slices, time_part, log)


def time_in_slices(impls, plans, slices, time_part, log=print, deadline: float | None = None) -> dict:
    """Each slice of the shapes compiled, then timed (bench, and compile_then_time): every impl with
    a prebuild compiles its share of `plans` (build_plans over the concatenated slices; an impl with
    no plan builds what it needs for the slice itself), then time_part(slice) -> the runner's counts.
    Counts summed over the slices ('deadline_after' counted from the whole list's start). Stops
    before a slice once time.monotonic() passes `deadline`, at a SIGTERM while compiling, or after
    a slice whose timing stopped; counts['stopped'] says so."""
    import time

    from gemmrl.bench import runner

    total = sum(len(part) for part in slices)
    counts: dict = {"problems": total, "stopped": False}
    offset = 0
    for part in slices:
        share = slice(offset, offset + len(part))
        if deadline is not None and time.monotonic() > deadline:
            counts["stopped"] = True
            log(f"deadline reached after {offset} of {total} problems; rerun to resume")
            break
        with runner.stop_on_sigterm() as stop:
            for impl, plan in zip(impls, plans):
                if not hasattr(impl, "prebuild"):
                    continue
                if plan is None:  # it builds what the slice needs itself (CUDA-L2's takes no plan)
                    impl.prebuild(part, log=log)
                else:
                    impl.prebuild(part, log=log, plan=plan[share])
        if stop.stopped:
            log(f"stopped while compiling; the shapes timed so far ({offset} of {total}) are in the store")
            counts["stopped"] = True
            break
        got = time_part(part)
        for k, v in got.items():
            if k == "deadline_after":
                counts[k] = offset + v
            elif isinstance(v, bool):
                counts[k] = counts.get(k, False) or v
            elif isinstance(v, (int, float)) and k != "problems":
                counts[k] = counts.get(k, 0) + v
            elif k != "problems":
                counts[k] = v
        offset += len(part)
        if got.get("stopped"):
            break
    return counts
