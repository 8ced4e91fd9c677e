"""Tuning and benchmarking on several GPUs of one machine without Ray: one `gemmrl tune` (or
`gemmrl bench`) process per GPU.

`gemmrl tune --gpus N` splits its shapes into N shards of about equal expected work, writes each
shard to a shape file, and starts one child `gemmrl tune --shapes SHARD --no-report` per GPU
with CUDA_VISIBLE_DEVICES naming that GPU alone. The children share the one SQLite store (WAL,
so their writes interleave safely) and each resumes from the trials already in it, as a single
process would; the parent streams their output with a `[gpuI]` prefix and writes the report once
they are done. A shape is never in two shards, so no candidate is timed twice. `gemmrl bench
--gpus N` does the same. Either passes every option it was given on to its children (`cli_args`).

The pure parts (the split, the child command lines, the GPU list) are tested on a CPU; the
process supervision is tested with stand-in children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# a shape's expected tuning work in seconds of one GPU: a fixed part (loading and verifying the
# candidates, timing nine implementations at the end) and a part that grows with its FLOPs (the
# timed calls of a 16384^3 product take about 13 ms each on an H100/H200); from the tune runs
# in results/README.md (about 1 s a shape for small ones, 3 s for the largest)
FIXED_S = 1.0
FLOPS_PER_S = 4e12
DONE_WEIGHT = 0.02  # a shape whose search is over still costs a store lookup and a skip


def shape_cost(problem, done: bool = False) -> float:
    """Expected seconds of one GPU to tune `problem` (DONE_WEIGHT if its search is over)."""
    if done:
        return DONE_WEIGHT
    return FIXED_S + 2.0 * problem.M * problem.N * problem.K / FLOPS_PER_S


def split_shapes(problems, n: int, done=frozenset()) -> list[list]:
    """Split `problems` into n shards of about equal expected work: the costliest shape first to
    the least loaded shard (LPT), ties to the lower index, so the split is deterministic. Within a
    shard the shapes keep their order in `problems`. Shapes in `done` weigh almost nothing."""
    if n < 1:
        raise ValueError(f"need at least one shard, got {n}")
    problems = list(dict.fromkeys(problems))
    order = {p: i for i, p in enumerate(problems)}
    loads = [0.0] * n
    shards: list[list] = [[] for _ in range(n)]
    for p in sorted(problems, key=lambda q: (-shape_cost(q, q in done), order[q])):
        i = min(range(n), key=lambda j: (loads[j], j))
        loads[i] += shape_cost(p, p in done)
        shards[i].append(p)
    return [sorted(s, key=order.__getitem__) for s in shards]


def visible_gpus(count: int, environ=None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each of the first `count` GPUs this process may use:
    the parent's own list where it has one (so `CUDA_VISIBLE_DEVICES=2,3 gemmrl tune --gpus 2`
    uses GPUs 2 and 3), else indices 0..count-1."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        ids = [x.strip() for x in listed.split(",") if x.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


# options that are one budget for all the children together (each gets an equal share); every
# other option is each child's own (a wall-clock limit, say)
SHARED_BUDGETS = {"tune": ("budget_s",)}
# options whose default is this machine's cores (tune --build-ahead: nvcc processes at once): a child
# not told otherwise gets its share, so that n children do not start n times the cores' compiles
SHARED_CORES = {"tune": ("build_ahead_n",)}


def child_command(verb: str, command, params: dict, shapes_file: str, n: int,
                  python: str = sys.executable) -> list[str]:
    """The command line of one of the n children of `gemmrl VERB --gpus n`: the parent's options
    (`params`, as click parsed them for `command`) with the child's own shape file, one GPU (a
    child never fans out again), no report (the parent writes it), and an equal share of any
    budget the children spend together, and of the cores where an option defaults to them."""
    from gemmrl.build.pool import default_jobs

    child = {**params, "shape_spec": shapes_file, "gpus": 1, "no_report": True}
    for name in SHARED_BUDGETS.get(verb, ()):
        if child.get(name) is not None:
            child[name] = child[name] / n
    for name in SHARED_CORES.get(verb, ()):
        if name in child and child[name] is None:
            child[name] = max(1, default_jobs() // n)
    return [python, "-m", "gemmrl.cli", verb] + cli_args(command, child)


def cli_args(command, params: dict) -> list[str]:
    """The command-line arguments that make the click `command` parse to `params` (its options
    by parameter name; those missing or None are left to their defaults): how a parent passes
    every option it was given on to its children, with the shapes and such replaced."""
    import click

    out: list[str] = []
    for p in command.params:
        if not isinstance(p, click.Option) or params.get(p.name) is None:
            continue
        v = params[p.name]
        if p.is_flag and p.secondary_opts:  # --x/--no-x
            out.append(p.opts[0] if v else p.secondary_opts[0])
        elif p.is_flag:
            if v:
                out.append(p.opts[0])
        elif p.multiple:
            for item in v:
                out += [p.opts[0], str(item)]
        else:
            out += [p.opts[0], str(v)]
    return out


def write_shard(problems, path: Path) -> Path:
    """A shape file `gemmrl tune --shapes FILE` reads: one MxNxK a line."""
    path.write_text("".join(f"{p.shape}\n" for p in problems))
    return path


def run_children(cmds: list[list[str]], gpus: list[str], log, environ=None, cwd=None) -> list[int]:
    """Run one command per GPU at once, each seeing only its GPU, their output (stdout and
    stderr) streamed line by line to `log` with a [gpuI] prefix; return their exit codes.
    If the parent is interrupted, every child is terminated (then killed) before re-raising."""
    if len(cmds) != len(gpus):
        raise ValueError(f"{len(cmds)} commands for {len(gpus)} GPUs")
    base = dict(os.environ if environ is None else environ)
    procs, threads = [], []
    lock = threading.Lock()

    def pump(tag: str, stream) -> None:
        for line in stream:
            with lock:
                log(f"[{tag}] {line.rstrip()}")
        stream.close()

    # `timeout` and schedulers stop the parent with SIGTERM: make it an exception here, so the
    # children are stopped too instead of writing on into a store that is being copied
    restore = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise SystemExit(128 + signum)
        restore = signal.signal(signal.SIGTERM, on_term)
    try:
        for cmd, gpu in zip(cmds, gpus):
            env = {**base, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"}
            p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, errors="replace")
            procs.append(p)
            t = threading.Thread(target=pump, args=(f"gpu{gpu}", p.stdout), daemon=True)
            t.start()
            threads.append(t)
        while any(p.poll() is None for p in procs):  # short waits: Ctrl-C gets through
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        for t in threads:
            t.join()
        return codes
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    finally:
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)
