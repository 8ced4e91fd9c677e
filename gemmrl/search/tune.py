"""The tuning loop: a policy proposes, an evaluator builds/verifies/times, the policy learns.

    tune(problems, policy, evaluate, per_shape_candidates=..., batch=..., device_budget_s=...)

`evaluate(problem, candidates) -> list[Trial]` is injected: `gpu_evaluate(...)` on a GPU, a
simulation in the tests. Budgets: candidates per shape (history included, so a resumed run
finishes the same budget) and device seconds for the whole run (the sum of the trials'
details['device_s']; near the end a batch is shrunk to what the remaining budget affords at the
highest cost per candidate seen so far, so the overshoot is about one candidate). Resumable: trials of an
earlier run (`history`) are fed to the policy first and never proposed again.

Reported: the best trial per problem and two curves. `TuneResult.curve` is the run as it went
(candidates timed so far -> mean best reward over the problems visited so far);
`TuneResult.per_shape_curve()` is the sample-efficiency curve (n -> mean over all problems of
the best reward among each problem's first n candidates), the one `sample_efficiency` and the
report compare between policies.
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from gemmrl.build.toolchain import ToolchainMissing
from gemmrl.core.problem import Problem
from gemmrl.search.policy import Candidate, Policy, Trial
from gemmrl.search.reward import reward
from gemmrl.space import registry

Evaluate = Callable[[Problem, list[Candidate]], list[Trial]]


FINAL_STAGE = "final"  # details['stage'] of a winner that failed the final, full verification


def is_veto(t: Trial) -> bool:
    """A record that a winner failed the final verification: its candidate never wins again on
    that problem (the search's quick checks passed it, the judge's did not)."""
    return t.status != "ok" and t.details.get("stage") == FINAL_STAGE


def is_referenced(t: Trial) -> bool:
    """Whether the trial passed and was timed beside the shape's best baseline (gpu_evaluate's
    reference), so its reward is a ratio from one session."""
    ref = t.details.get("reference") if isinstance(t.details, dict) else None
    return t.status == "ok" and isinstance(ref, dict) and bool(ref.get("session_us"))


def comparable(trials: Iterable[Trial]) -> list[Trial]:
    """The trials whose rewards and times compare with each other: on a problem that has ok
    trials timed beside its baseline (is_referenced), only those of its ok trials; older trials,
    timed in short bursts at higher clocks against the judge's baseline times, read up to 30%
    fast. Trials that did not pass are kept (they veto their kernels)."""
    trials = list(trials)
    with_ref = {t.problem for t in trials if is_referenced(t)}
    return [t for t in trials if t.status != "ok" or t.problem not in with_ref or is_referenced(t)]


def best_trials(history: Iterable[Trial]) -> dict[Problem, Trial]:
    """The best trial per problem (_better), vetoed candidates left out."""
    history = list(history)
    vetoed = {(t.problem, t.key()) for t in history if is_veto(t)}
    best: dict[Problem, Trial] = {}
    for t in history:
        if (t.problem, t.key()) not in vetoed and _better(t, best.get(t.problem)):
            best[t.problem] = t
    return best


def _better(t: Trial, than: Trial | None) -> bool:
    """Whether `t` takes the best place from `than`: a trial timed beside its baseline always
    does from one that was not, and never the reverse (comparable()); otherwise the higher
    reward, then the shorter time."""
    if than is None:
        return True
    if is_referenced(t) != is_referenced(than):
        return is_referenced(t)
    return (t.reward, -(t.time_us or math.inf)) > (than.reward, -(than.time_us or math.inf))


@dataclass
class TuneResult:
    problems: list[Problem]
    trials: list[Trial]  # this run's, in the order they were evaluated
    history: list[Trial]  # the earlier trials on these problems that the run started from
    best: dict[Problem, Trial]  # highest reward per problem (history included)
    curve: list[tuple[int, float]]  # (candidates timed so far, mean best reward over problems so far)
    device_s: float  # this run's
    stopped: str = ""  # '' or why the run ended early ('device budget')
    dropped: int = 0  # proposals tune refused: already tried, repeated in a batch, or invalid
    counts: dict = field(default_factory=dict)  # candidates per problem (history included)
    # problem -> 'ErrorType: message' where the policy raised while proposing for it: that problem
    # was left there and the run went on with the next (one shape's bad suggestion does not cost
    # the other shapes' search and final timing)
    failed: dict = field(default_factory=dict)

    def best_reward(self, problem: Problem) -> float:
        t = self.best.get(problem)
        return t.reward if t is not None else 0.0

    def mean_best_reward(self) -> float:
        return sum(self.best_reward(p) for p in self.problems) / max(1, len(self.problems))

    def per_shape_curve(self, max_n: int | None = None) -> list[tuple[int, float]]:
        """n -> mean over every problem of the best reward in its first n candidates (a problem
        keeps its best once its candidates run out; one never visited counts 0)."""
        seqs: dict[Problem, list[float]] = {p: [] for p in self.problems}
        for t in [*self.history, *self.trials]:
            if t.problem in seqs:
                seqs[t.problem].append(t.reward)
        longest = max((len(s) for s in seqs.values()), default=0)
        max_n = longest if max_n is None else max_n
        running = {p: 0.0 for p in seqs}
        out = []
        for n in range(1, max_n + 1):
            for p, s in seqs.items():
                if n <= len(s):
                    running[p] = max(running[p], s[n - 1])
            out.append((n, sum(running.values()) / max(1, len(running))))
        return out


# What follows a search (tune --finish-s keeps this before its deadline): the race and the final
# verification and timing beside the baselines, in slices (build.slices.compile_then_time): each slice
# first compiles its share of the CUTLASS contenders not in the build cache, side by side on the
# machine's cores (CUTLASS_BUILD_S a wave; race.unbuilt_contenders), then times
# its shapes in a fresh worker process (FINAL_S_START: the worker's start, the first record's
# elapsed less the others' median; 9-10 s for a microsecond shape's first record). Since the builds
# left the timing worker (07cad3e), a shape of a microsecond kernel took a median 2 s, at most 9 s
# (H200, 2026-12-01, runs 983-1008: 54 shapes after each slice's first, --race 1-3; the constants
# before, 8 s a shape and 3 s a contender from runs 821-839 whose workers still compiled, kept 421 s
# for a final timing of 30 shapes that took about 175, and stopped that search at 30 of 59 shapes).
# FINAL_S_PER_SHAPE and RACE_S_PER_CONTENDER keep about twice the median.
# A wave of CUTLASS builds took 31-45 s on the H200 with a warm page cache; on a fresh machine with no
# build cache carried (2026-12-01, runs 1012-1013) the search's waves of 6-14 kernels took 50-60 s, and
# the final timings' two slices (15 + 3 and 16 + 6 kernels) about 60 s a wave: run 1013's took 190 s
# where a 45 s wave had kept 171, and the step's limit stopped it with winners untimed. Hence 60.
FINAL_S_START = 8.0
FINAL_S_PER_SHAPE = 4.0
RACE_S_PER_CONTENDER = 1.5
CUTLASS_BUILD_S = 60.0
# A shape whose kernels run for milliseconds takes longer: its rounds beside 7 baselines are long. The
# H200's --race 1 final timings of 1-16 ms shapes (fp16 and fp32, 2026-11-30 to 12-01, 22 shapes whose
# kernels were built) took a median 11 s a shape at 1-2 ms of cuBLASLt's time, 16 s at 2-8 ms and 20 s
# at 8-16 ms; so FINAL_S_PER_MS a millisecond of the best baseline's kernel time more, at most
# FINAL_S_LONG_CAP more (4 + 5 * 1.5 ms = 11.5 s; 20 s from 3.2 ms up).
FINAL_S_PER_MS = 5.0
FINAL_S_LONG_CAP = 16.0


def final_reserve_s(shapes: int, race: int = 1, unbuilt: int = 0, cores: int = 1, kernel_us=()) -> float:
    """Seconds to keep for the final timing of `shapes` shapes raced with `race` (tune --race),
    for which `unbuilt` CUTLASS kernels compile first, side by side on `cores` (a wave of builds,
    then a timing worker of its own, per slice: at least one); `kernel_us`: the best baseline's
    kernel time of each shape that has one (microseconds), for the long ones' rounds. No shapes,
    no final timing: 0."""
    if shapes < 0 or race < 1 or unbuilt < 0 or cores < 1 or any(not us >= 0 for us in kernel_us):
        raise ValueError(f"final_reserve_s({shapes}, race={race}, unbuilt={unbuilt}, cores={cores}, "
                         f"kernel_us={list(kernel_us)})")
    if shapes == 0:
        return 0.0
    waves = math.ceil(unbuilt / cores)
    return (max(1, waves) * FINAL_S_START + waves * CUTLASS_BUILD_S
            + shapes * (FINAL_S_PER_SHAPE + RACE_S_PER_CONTENDER * (race - 1))
            + sum(min(FINAL_S_PER_MS * us / 1000.0, FINAL_S_LONG_CAP) for us in kernel_us))


def tune(problems: Iterable[Problem], policy: Policy, evaluate: Evaluate, *, per_shape_candidates: int,
         batch: int = 8, device_budget_s: float = math.inf, history: Iterable[Trial] = (),
         on_trial: Callable[[Trial], None] | None = None, deadline: float | None = None,
         clock: Callable[[], float] = time.monotonic, more: int | None = None,
         reserve: Callable[[frozenset], float] | None = None,
         ahead: Callable[[list[tuple[Problem, list[Candidate]]]], object] | None = None,
         ahead_kernels: int = 0) -> TuneResult:
    """`more`: instead of `per_shape_candidates` in all, that many beyond each problem's history.
    `reserve(problems)`: seconds to keep before `deadline` for what follows the search when it
    has reached `problems` (this run's searched shapes, and the one a batch is about to start
    on): no batch starts later than that, less the longest batch this run has timed so far, so
    that the batch too ends inside the window (tune --finish-s; final_reserve_s). Without a
    reserve (tune --wall-s) the deadline bounds when batches start, not when they end.
    `ahead(pairs)`: compile [(problem, candidates)] side by side before a batch of fewer than
    `ahead_kernels` candidates is evaluated: that batch and the first batches of the problems after
    it, proposed now, up to `ahead_kernels` kernels in all; each of those problems then evaluates
    the candidates proposed for it here (build_ahead; tune --build-ahead). A `--more 2` search
    compiled 2 CUTLASS kernels at a time on 16 cores, about 50 s a shape (H200, 2026-12-01: 4
    candidates in 99 s over 30 shapes). A problem whose candidates were built ahead keeps only the
    longest evaluation before the deadline, one that starts a wave the longest wave (its builds and
    its evaluation) too."""
    problems = list(dict.fromkeys(problems))
    wanted = set(problems)
    history = [t for t in history if t.problem in wanted]
    policy.observe(history)
    tried: dict[Problem, set] = {p: set() for p in problems}
    counts = {p: 0 for p in problems}
    best: dict[Problem, Trial] = best_trials(history)
    costs: list[float] = []
    for t in history:
        tried[t.problem].add(t.key())
        if is_veto(t):
            continue  # a second record of a candidate already counted
        counts[t.problem] += 1
        costs.append(float(t.details.get("device_s", 0.0)))

    trials: list[Trial] = []
    touched: set[Problem] = set()  # the problems this run has searched
    curve: list[tuple[int, float]] = []
    spent, dropped, stopped = 0.0, 0, ""
    # the wall time of this run's longest batch: a --finish-s run keeps it too before starting
    # another (H200, 2026-11-30j: a batch of 8 CUTLASS kernels for 8192x8192x8192 compiled and
    # timed for about 60 s, began inside the window left before the final timing's reserve and
    # pushed that timing past the step's end: every winner of the run went untimed)
    longest = 0.0
    failed: dict[Problem, str] = {}

    def point():
        visited = [p for p in problems if counts[p]]
        mean = sum(best[p].reward if p in best else 0.0 for p in visited) / max(1, len(visited))
        curve.append((sum(counts.values()), mean))

    if more is not None and more < 0:
        raise ValueError(f"more must not be negative, got {more}")
    limit = {p: counts[p] + more if more is not None else per_shape_candidates for p in problems}
    if history:
        point()
    queued: dict[Problem, list[Candidate]] = {}  # proposed and built ahead, not evaluated yet
    longest_wave = 0.0  # the longest batch that built a wave ahead: its builds and its evaluation

    def size(problem: Problem) -> int:
        k = min(batch, limit[problem] - counts[problem])
        per, remaining = max(costs, default=0.0), device_budget_s - spent
        if per > 0 and math.isfinite(remaining):
            k = max(1, min(k, int(remaining / per)))
        return k

    def fresh_for(problem: Problem) -> list[Candidate] | None:
        """The policy's next batch for `problem`, less what was tried or is not valid; None where
        the policy failed (said in the result)."""
        nonlocal dropped
        k = size(problem)
        try:
            proposed = policy.propose(problem, k)[:k]
        except Exception as e:  # noqa: BLE001 - a policy's bug on one shape; said in the result
            failed[problem] = f"{type(e).__name__}: {e}"
            return None
        fresh, keys = [], set()
        for c in proposed:
            key = c.key()
            if key in tried[problem] or key in keys or registry.get(c.family).valid(c.spec, problem):
                dropped += 1
                continue
            keys.add(key)
            fresh.append(c)
        return fresh

    def keep(reached: set, wave: float) -> float:
        return reserve(frozenset(reached)) + wave if reserve is not None else 0.0

    for i, problem in enumerate(problems):
        while counts[problem] < limit[problem] and not stopped and problem not in failed:
            remaining = device_budget_s - spent
            if remaining <= 0:
                stopped = "device budget"
                break
            built = problem in queued
            if deadline is not None and clock() + keep(touched | {problem}, longest if built else
                                                       max(longest, longest_wave)) >= deadline:
                stopped = "wall-clock deadline"
                break
            began = clock()
            wave: list[tuple[Problem, list[Candidate]]] = []
            if built:
                fresh = queued.pop(problem)
            else:
                fresh = fresh_for(problem)
                if fresh is None:
                    break
                total = len(fresh)
                for q in (problems[i + 1:] if ahead is not None and fresh and total < ahead_kernels else ()):
                    if total >= ahead_kernels:
                        break
                    if q in queued or q in failed or counts[q] >= limit[q]:
                        continue
                    reached = touched | {problem} | {w for w, _ in wave} | {q}
                    if deadline is not None and clock() + keep(reached, max(longest, longest_wave)) >= deadline:
                        break  # the deadline would stop the search before it reached q
                    got_q = fresh_for(q)
                    if got_q:
                        queued[q] = got_q
                        wave.append((q, got_q))
                        total += len(got_q)
                if wave:
                    ahead([(problem, fresh)] + wave)
            if not fresh:
                break  # the policy has nothing new for this problem
            got = evaluate(problem, fresh)
            if wave:
                longest_wave = max(longest_wave, clock() - began)
            else:
                longest = max(longest, clock() - began)
            touched.add(problem)
            for t in got:
                trials.append(t)
                tried[problem].add(t.key())
                counts[problem] += 1
                cost = float(t.details.get("device_s", 0.0))
                spent += cost
                costs.append(cost)
                if _better(t, best.get(problem)):
                    best[problem] = t
                if on_trial is not None:
                    on_trial(t)
            policy.observe(got)
            point()
            if not got:
                break
        if stopped:
            break
    return TuneResult(problems, trials, history, best, curve, spent, stopped, dropped, counts, failed)


# ---------------------------------------------------------------------------------------------
# Reporting

def sample_efficiency(curve_a: list[tuple[int, float]], curve_b: list[tuple[int, float]],
                      levels: tuple = (0.9, 0.95, 0.99)) -> dict:
    """Compare policy A's curve with reference B's (e.g. the exhaustive sweep), both (x, y) with
    x candidates timed. For each level, the first x at which each curve reaches level x B's best;
    'saving' is B's x over A's x. Also each final value, A's final as a share of B's, and B's
    value at A's budget (what the reference achieves with as many candidates)."""
    def first(curve, y):
        return next((x for x, v in curve if v >= y), None)

    target = max((v for _, v in curve_b), default=0.0)
    final_a = curve_a[-1][1] if curve_a else 0.0
    final_b = curve_b[-1][1] if curve_b else 0.0
    budget_a = curve_a[-1][0] if curve_a else 0
    at_budget = max((v for x, v in curve_b if x <= budget_a), default=0.0)
    out = {"target": target, "final_a": final_a, "final_b": final_b,
           "final_ratio": final_a / final_b if final_b else math.nan,
           "budget_a": budget_a, "budget_b": curve_b[-1][0] if curve_b else 0,
           "b_at_budget_a": at_budget, "levels": {}}
    for level in levels:
        xa, xb = first(curve_a, level * target), first(curve_b, level * target)
        out["levels"][level] = {"a": xa, "b": xb, "saving": (xb / xa) if xa and xb else None}
    return out


def write_curves(curves: dict[str, list[tuple[int, float]]], path_stem: str | Path, *,
                 xlabel: str = "candidates timed per shape", ylabel: str = "mean best reward",
                 title: str = "") -> tuple[Path, Path]:
    """`<stem>.csv` (policy, candidates, mean_best_reward) and `<stem>.png`, each written to a
    temporary name and moved into place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = stem.with_suffix(".csv"), stem.with_suffix(".png")
    tmp = csv_path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "candidates", "mean_best_reward"])
        for name, curve in curves.items():
            for x, y in curve:
                w.writerow([name, x, f"{y:.6f}"])
    os.replace(tmp, csv_path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        if curve:
            ax.plot([x for x, _ in curve], [y for _, y in curve], label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png_path)
    return csv_path, png_path


# ---------------------------------------------------------------------------------------------
# The real evaluator (GPU)

def best_baseline_from_store(store, device: str, mode: str = "kernel") -> Callable[[Problem], float]:
    """baseline_us_fn for gpu_evaluate: the fastest correctly timed baseline in the store for
    the problem on `device` in `mode` (gemmrl's own implementations and repeats excluded), all
    problems read at once (Store.best_baseline: one problem)."""
    from gemmrl.store.db import is_baseline

    table: dict = {}
    for m in store.measurements(device=device, mode=mode):
        if m["status"] != "ok" or m["median_us"] is None or not is_baseline(m["impl"]):
            continue
        key = (m["M"], m["N"], m["K"], m["dtype"], m["acc"])
        table[key] = min(table.get(key, math.inf), m["median_us"])

    def baseline_us(problem: Problem) -> float:
        if problem.key() not in table:
            raise KeyError(f"no {mode}-mode baseline for {problem.shape} on {device} in the store")
        return table[problem.key()]
    return baseline_us


REFERENCE = "@reference"  # the best baseline, timed in the search's rounds beside the candidates


def scale_to_stored(stored_us: float, session_us: float | None) -> float:
    """The factor that carries a time measured in this session to the clock state of the
    stored baseline measurement: stored / session time of the same baseline kernel (1.0 when
    the reference did not time)."""
    if not session_us or session_us <= 0 or not stored_us or stored_us <= 0:
        return 1.0
    return stored_us / session_us


def build_batch(problem: Problem, candidates: list[Candidate], workers: int | None = None) -> dict:
    """Compile the batch's kernels that are not in the build cache yet, side by side (build.pool:
    one nvcc process per core, `workers` at most), before the evaluator takes the candidates one
    at a time. A raw kernel compiles in about 1.3 s, so a batch of 8 built in turn was most of a
    search's wall time (2026-11-30f: 96 raw candidates searched in 150 s, 4 of them on the GPU).
    Returns {name: BuildResult} for the kernels it compiled (ok or not). One that is not valid for
    the problem or does not render is left to the evaluator, which says why; with one kernel to
    build there is no pool to start, and the evaluator builds it."""
    return build_ahead([(problem, candidates)], workers, least=2)


def build_ahead(pairs: list[tuple[Problem, list[Candidate]]], workers: int | None = None,
                least: int = 1) -> dict:
    """build_batch for the batches of several problems at once ([(problem, candidates)]): the
    kernels not in the build cache compiled side by side into it, where the evaluator of each
    batch finds them (tune's `ahead`). Nothing is compiled with fewer than `least` to build or
    with `workers` 1. Returns {name: BuildResult}."""
    from gemmrl.build import ahead
    from gemmrl.build.pool import build_many

    jobs = []
    for problem, candidates in pairs:
        for c in candidates:
            try:
                if registry.get(c.family).valid(c.spec, problem) is None:
                    jobs.append(ahead.job_for(c.spec, problem))
            except ToolchainMissing:  # the machine's, not the candidate's: the run stops
                raise
            except Exception:  # noqa: BLE001 - the evaluator renders it again and records why
                continue
    todo = ahead.pending(ahead.unique(jobs))
    if not todo or len(todo) < least or workers == 1:
        return {}
    results = build_many([j.as_tuple() for j in todo], workers=workers, threads=True)
    return {j.name: r for j, r in zip(todo, results)}


def gpu_evaluate(store, device: str, baseline_us_fn: Callable[[Problem], float], *,
                 run_id: int | None = None, settings=None, seed: int = 0, reference: bool = True,
                 build_workers: int | None = None) -> Evaluate:
    """The evaluator for a GPU: for each candidate, render and build it (host time), verify it
    (trace off, for speed), then time every verified one together in kernel mode with the
    search's protocol (timing.SEARCH); the reward is against `baseline_us_fn(problem)` (the best
    baseline's time in the same mode). With `reference` (and a store that names that baseline),
    the baseline is timed in the same rounds as the candidates and their times are scaled by its
    stored / session time: the reward is then a ratio taken in one session, and trial times of
    different sessions compare (the SM clock under a power limit moves by 30% between sessions;
    before this, rewards against the judge's baseline times ran up to 30% high on compute-bound
    shapes). A trial keeps its unscaled time as details['raw_us']. A candidate that does not build, fails a check or times wrong is a
    'rejected' trial with the reason, never an exception. One that kills the process cannot be
    recorded here: run this inside a bench.worker.Worker; the heartbeat ('candidate:<name>')
    names the culprit, the runner quarantines it, and the policy never proposes it again.
    device_s = verification wall time + an equal share of the timing session. With `store`:
    quarantined candidates are refused unrun, and with a `run_id` verifications are recorded.
    The batch's kernels are compiled first, side by side (build_batch, `build_workers` nvcc
    processes at most, 1: each in turn as the loop reaches it)."""

    def evaluate(problem: Problem, candidates: list[Candidate]) -> list[Trial]:
        import torch

        from gemmrl.bench import timing
        from gemmrl.bench.stats import judge_floor
        from gemmrl.bench.worker import beat, stop_if_context_lost
        from gemmrl.runtime.spec_impl import SpecImpl
        from gemmrl.verify.checks import verify

        out: dict[str, Trial] = {}
        calls, info = {}, {}
        bad = store.quarantined(device, problem) if store is not None else {}
        beat("search:build")
        t_build = time.perf_counter()
        built = build_batch(problem, [c for c in candidates if c.name not in bad], build_workers)
        batch_build_s = time.perf_counter() - t_build  # the batch's builds side by side, wall time
        for c in candidates:
            name = c.name
            if name in bad:
                out[name] = Trial(problem, c, "rejected", details={"stage": "quarantine", "reason": bad[name],
                                                                  "device_s": 0.0})
                continue
            if name in built and not built[name].ok:
                out[name] = Trial(problem, c, "rejected", details={
                    "stage": "build", "reason": f"AbiError: {name} failed to build:\n{built[name].log[-1800:]}",
                    "device_s": 0.0, "build_s": round(built[name].seconds, 2)})
                continue
            beat("candidate:" + name)  # if this candidate kills the process, it is the one
            impl, stage, t0 = SpecImpl(c.spec), "build", time.perf_counter()
            try:
                source_len = len(impl.source(problem).encode())
                fn = impl.prepare(problem)
                stage, t0 = "verify", time.perf_counter()
                r = verify(impl, problem, fn=fn, trace=False)
            except ToolchainMissing:  # no candidate's fault: nothing is recorded, the run stops
                raise
            except Exception as e:
                out[name] = Trial(problem, c, "rejected", details={
                    "stage": stage, "reason": f"{type(e).__name__}: {e}"[:2000],
                    "device_s": time.perf_counter() - t0 if stage == "verify" else 0.0})
                stop_if_context_lost(f"candidate {name} on {problem.shape}")
                continue
            verify_s = time.perf_counter() - t0
            if store is not None and run_id is not None:
                store.record_verification(run_id, device, problem, name, r.passed, r.reason, r.details)
            if not r.passed:
                out[name] = Trial(problem, c, "rejected", details={"stage": "verify", "reason": r.reason,
                                                                  "device_s": verify_s})
                # after a sticky CUDA error the batch's later candidates would all fail here: the
                # worker exits instead, and run_batch quarantines this one and runs the rest anew
                stop_if_context_lost(f"candidate {name} on {problem.shape}")
                continue
            calls[name] = fn
            # nvcc's seconds for this kernel (0 where the cache held it), and the batch's side-by-side
            # build wall time: the host's share of a search, beside device_s
            own = getattr(impl, "build", None)
            build_s = built[name].seconds if name in built else (own.seconds if own is not None else 0.0)
            info[name] = {"source_len": source_len, "rel_err": r.details.get("rel_err"),
                          "ref_err": r.details.get("ref_err"), "verify_s": verify_s,
                          "build_s": round(build_s, 2), "batch_build_s": round(batch_build_s, 2)}
        if calls:
            beat("search:timing")
            base_us = float(baseline_us_fn(problem))
            timed, ref = dict(calls), None
            if reference and store is not None:
                ref = _reference(store, device, problem)
                fn = ref.pop("fn") if ref is not None else None
                if fn is not None:
                    timed[REFERENCE] = fn
            t0 = time.perf_counter()
            try:
                l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
                res = timing.time_kernel(problem, timed, l2_bytes=l2, settings=settings or timing.SEARCH,
                                         seed=seed)
            except Exception as e:
                res = {n: {"status": "error", "details": {"reason": f"{type(e).__name__}: {e}"[:500]}}
                       for n in timed}
            if store is not None:  # a time beyond the physical floor earns nothing (bench/stats.py)
                res = judge_floor(problem, res, store.reference_peaks(device), {REFERENCE})
            share = (time.perf_counter() - t0) / len(calls)
            scale = 1.0
            if ref is not None:
                r_ref = res.get(REFERENCE, {})
                ref["session_us"] = r_ref.get("median_us") if r_ref.get("status") == "ok" else None
                scale = scale_to_stored(ref["stored_us"], ref["session_us"])
                ref["scale"] = scale
            by_name = {c.name: c for c in candidates}
            for name, meta in info.items():
                r = res.get(name, {"status": "error", "details": {"reason": "not timed"}})
                details = {**meta, "device_s": meta["verify_s"] + share, "baseline_us": base_us,
                           "timing": {k: v for k, v in r.items() if k != "details"}, **r.get("details", {})}
                if ref is not None:
                    details["reference"] = dict(ref)
                if r.get("status") != "ok":
                    out[name] = Trial(problem, by_name[name], "rejected",
                                      details={**details, "stage": "time"})
                    continue
                details["raw_us"] = float(r["median_us"])
                t_us = float(r["median_us"]) * scale
                score = reward(base_us, t_us, True, meta["rel_err"], meta["ref_err"], meta["source_len"])
                out[name] = Trial(problem, by_name[name], "ok", t_us, score, {**details, "stage": "time"})
        beat("search:done")
        return [out[c.name] for c in candidates]

    return evaluate


def _reference(store, device: str, problem: Problem) -> dict | None:
    """The problem's best stored baseline, prepared to run beside the candidates: {'impl',
    'stored_us', 'fn'} ('fn' None, with 'error', where it cannot run here), or None when the
    store has no baseline for it."""
    got = store.best_baseline(device, problem)
    if got is None:
        return None
    name, stored_us = got
    from gemmrl.baselines.impls import baseline_impls

    impl = {i.name: i for i in baseline_impls(store, device, extra=True)}.get(name)
    if impl is None:
        return {"impl": name, "stored_us": stored_us, "fn": None, "error": "not a core baseline"}
    try:
        return {"impl": name, "stored_us": stored_us, "fn": impl.prepare(problem)}
    except Exception as e:
        return {"impl": name, "stored_us": stored_us, "fn": None, "error": f"{type(e).__name__}: {e}"[:300]}
