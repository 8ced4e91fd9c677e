"""The tuning job: every candidate a policy proposes is built, verified and timed in a worker
process (a crash or hang quarantines that candidate and the batch goes on without it), every
trial is stored, and each shape's winner is kept as the implementation 'gemmrl-tuned'."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

from gemmrl.bench.worker import HEARTBEAT_ENV, Worker, last_beat
from gemmrl.core.problem import Problem
from gemmrl.search.policy import Candidate, ExhaustivePolicy, ModelFreePolicy, RandomPolicy, Trial
from gemmrl.search.tune import TuneResult, _better, best_trials, build_ahead, gpu_evaluate, tune
from gemmrl.space import registry

TUNED = "gemmrl-tuned"
_CHILD: dict = {}


def evaluate_task(problem, candidates, device, db_path, baseline_us):
    """In the worker: evaluate one batch on the GPU against the given baseline time."""
    from gemmrl.store.db import Store

    if _CHILD.get("db") != db_path:
        from gemmrl.bench.env import use_harness_settings

        use_harness_settings()
        _CHILD.update(db=db_path, store=Store(db_path))
    return gpu_evaluate(_CHILD["store"], device, lambda p: baseline_us)(problem, candidates)


def run_batch(worker, hb: str, problem, candidates, device: str, db_path: str, baseline_us: float, *,
              timeout_s: float, task, log, quarantine) -> list[Trial]:
    """Evaluate one batch in `worker` (heartbeat file `hb`): when the worker dies or hangs on a
    candidate (named by the heartbeat), that candidate is a 'crashed' trial and is reported to
    `quarantine(problem, name, why)`; the rest of the batch is tried again in a fresh process.
    Shared by isolated_evaluator and the Ray actors (gemmrl.distributed.ray_backend)."""
    pending, out = list(candidates), []
    while pending:
        open(hb, "w").close()
        r = worker.run(task, problem, pending, device, db_path, baseline_us, timeout_s=timeout_s)
        if r.ok:
            out += r.value
            break
        r.raise_if_toolchain_missing()  # no nvcc or headers here: not these candidates' failure
        kind, _, name = last_beat(hb).partition(":")
        if r.status == "error" or kind != "candidate" or name not in {c.name for c in pending}:
            why = f"evaluation {r.status}: {r.reason}"
            log(f"{problem.shape}: {why}")
            out += [Trial(problem, c, "rejected", details={"reason": why, "device_s": 0.0}) for c in pending]
            break
        why = f"{r.status}: {r.reason}"
        quarantine(problem, name, why)
        log(f"{problem.shape} {name}: {why}; quarantined")
        out += [Trial(problem, c, "crashed", details={"reason": why, "device_s": r.seconds})
                for c in pending if c.name == name]
        pending = [c for c in pending if c.name != name]
    return out


def isolated_evaluator(store, device: str, db_path: str, baseline_fn, *, timeout_s: float = 900.0,
                       log=print, task=evaluate_task):
    """An evaluate(problem, candidates) -> trials that runs each batch in a worker process.
    Returns (evaluate, close)."""
    fd, hb = tempfile.mkstemp(prefix="gemmrl-tune-heartbeat-")
    os.close(fd)
    worker = Worker(env={HEARTBEAT_ENV: hb})

    def evaluate(problem, candidates):
        return run_batch(worker, hb, problem, candidates, device, db_path, baseline_fn(problem),
                         timeout_s=timeout_s, task=task, log=log,
                         quarantine=lambda p, name, why: store.quarantine(device, p, name, why))

    def close():
        worker.close()
        os.unlink(hb)

    return evaluate, close


def ahead_builder(workers: int, log=print, build=None):
    """tune's `ahead`: compile the kernels of several shapes' batches side by side, `workers` nvcc
    processes at most (build_ahead), saying what it compiles and what failed. A failure of the
    building itself (not of a kernel: those the evaluator records) is said and the search goes on,
    each batch compiling its own."""
    build = build or build_ahead

    def ahead(pairs):
        n = sum(len(c) for _, c in pairs)
        t0 = time.monotonic()
        try:
            built = build(pairs, workers)
        except Exception as e:  # noqa: BLE001 - the evaluator builds what is missing, one batch at a time
            log(f"warning: building {n} candidates of {len(pairs)} shapes ahead failed ({type(e).__name__}: {e}); "
                "each batch compiles its own")
            return {}
        if built:
            bad = sum(1 for r in built.values() if not r.ok)
            log(f"built {len(built)} kernels for the next {len(pairs)} shapes' batches side by side in "
                f"{time.monotonic() - t0:.0f} s" + (f" ({bad} failed: the evaluator records why)" if bad else ""))
        return built
    return ahead


def stored_history(store, device: str, problems) -> list[Trial]:
    out = []
    for row in store.trials(device, problems):
        try:
            out.append(Trial.from_dict(row["record"]))
        except (KeyError, TypeError, ValueError):
            continue  # a record from an older spec layout: not a reason to stop tuning
    return out


def accumulator_twin(family: str, spec, acc: str):
    """`spec` with its accumulator set to `acc` (the same kernel otherwise), or None where the
    family's spec has no accumulator field."""
    return _field_twin(spec, "acc", acc)


def dtype_twin(family: str, spec, dtype: str):
    """`spec` with its input type set to `dtype` (fp16 <-> bf16; the same kernel otherwise), or
    None where the family's spec has no input-type field."""
    return _field_twin(spec, "dtype", dtype)


def _field_twin(spec, field: str, value: str):
    """`spec` with `field` set to `value`, or None where the spec has no such field."""
    import dataclasses

    if not dataclasses.is_dataclass(spec) or field not in {f.name for f in dataclasses.fields(spec)}:
        return None
    return spec if getattr(spec, field) == value else dataclasses.replace(spec, **{field: value})


def store_prior(store, source: str, problems=None, source_acc: str | None = None,
                target_acc: str | None = None, source_dtype: str | None = None,
                target_dtype: str | None = None) -> dict:
    """What tuning found on `source` (a GPU model in the store), per shape, best first: the stored
    winner, then the other candidates that passed there, highest reward first, as (family, spec).
    With `source_acc` and `target_acc` (differing): the source's tuning with the `source_acc`
    accumulator, each shape and kernel turned into its `target_acc` twin (the same tiles and
    schedule; kernels whose family has no accumulator field, or whose twin is not valid, are left
    out), so the fp32 tuning can seed the fp16 search of the same shapes. Likewise `source_dtype`
    and `target_dtype` (differing): the tuning of `source_dtype` inputs, each kernel turned into its
    `target_dtype` twin (dtype_twin), so the fp16 tuning seeds a bf16 search (on Hopper both run the
    tensor cores at one rate: the same tiles should win). `problems`: only these shapes'
    suggestions (target problems)."""
    from dataclasses import replace

    cross_acc = source_acc is not None and target_acc is not None and source_acc != target_acc
    cross_dtype = source_dtype is not None and target_dtype is not None and source_dtype != target_dtype
    trials = stored_history(store, source, None)
    winners = {c[1]: (c[2], c[3]) for c in store.tuned_choices(TUNED, source)}

    def mapped(problem):
        if (cross_acc and problem.acc != source_acc) or (cross_dtype and problem.dtype != source_dtype):
            return None
        try:
            if cross_acc:
                problem = replace(problem, acc=target_acc)
            if cross_dtype:
                problem = replace(problem, dtype=target_dtype)
        except ValueError:  # ProblemError: no such problem (bf16 inputs with an fp16 accumulator)
            return None
        return problem

    def twin(family, spec, problem):
        if not (cross_acc or cross_dtype):
            return spec
        t = accumulator_twin(family, spec, target_acc) if cross_acc else spec
        if t is not None and cross_dtype:
            t = dtype_twin(family, t, target_dtype)
        return t if t is not None and registry.get(family).valid(t, problem) is None else None

    wanted = None if problems is None else set(problems)
    by_problem: dict = {}
    for t in trials:
        q = mapped(t.problem)
        if (q is not None and t.status == "ok" and t.time_us is not None
                and (wanted is None or q in wanted)):
            by_problem.setdefault(q, []).append(t)
    firsts: dict = {}
    for problem, (family, fields) in winners.items():
        q = mapped(problem)
        if q is None or (wanted is not None and q not in wanted):
            continue
        try:
            firsts[q] = (family, registry.get(family).spec_type()(**fields))
        except (TypeError, ValueError):
            pass  # a choice from an older spec layout
    out: dict = {}
    for problem in sorted(set(by_problem) | set(firsts), key=lambda p: p.key()):
        ranked = sorted(by_problem.get(problem, ()), key=lambda t: (-t.reward, t.time_us, t.candidate.name))
        suggestions, seen = [], set()
        for family, spec in ([firsts[problem]] if problem in firsts else []) + [
                (t.candidate.family, t.candidate.spec) for t in ranked]:
            spec = twin(family, spec, problem)
            if spec is not None and (family, spec.name) not in seen:
                seen.add((family, spec.name))
                suggestions.append((family, spec))
        if suggestions:
            out[problem] = suggestions
    return out


def merged_priors(priors: list) -> dict:
    """Several store_prior results as one, each shape's suggestions interleaved by rank (every
    source's best, then every source's second, ...), each kernel once: with tune's first three,
    two sources' winners lead a shape's batch side by side."""
    out: dict = {}
    for problem in sorted({p for prior in priors for p in prior}, key=lambda p: p.key()):
        lists = [prior.get(problem, []) for prior in priors]
        seen, merged = set(), []
        for rank in range(max(map(len, lists))):
            for suggestions in lists:
                if rank < len(suggestions):
                    family, spec = suggestions[rank]
                    if (family, spec.name) not in seen:
                        seen.add((family, spec.name))
                        merged.append((family, spec))
        out[problem] = merged
    return out


def add_store_priors(policy, store, sources, device: str, problems=None, target_acc: str | None = None,
                     extra=(), target_dtype: str | None = None) -> int:
    """add_store_prior for several sources ((GPU, accumulator or None) pairs, or (GPU, accumulator
    or None, input type or None) triples), their suggestions interleaved by rank (merged_priors)
    after those of the `extra` priors ({problem: [(family, spec)]}, e.g. search.lt_seed's).
    Returns the number of shapes with suggestions."""
    priors = list(extra)
    for item in sources:
        source, source_acc, source_dtype = (tuple(item) + (None,))[:3]
        cross = source_acc is not None and target_acc is not None and source_acc != target_acc
        cross_dtype = source_dtype is not None and target_dtype is not None and source_dtype != target_dtype
        if source == device and not (cross or cross_dtype):
            raise ValueError(f"{source!r} is this GPU: its trials are the search's own history already")
        prior = store_prior(store, source, problems, source_acc, target_acc, source_dtype, target_dtype)
        if not prior and not any(True for _ in store.tuned_choices(TUNED, source)) and not store.trials(source):
            known = sorted(set(store.devices()) - {device})
            raise ValueError(f"the store holds nothing tuned on {source!r}"
                             + (f"; it knows {', '.join(map(repr, known))}" if known else ""))
        priors.append(prior)
    merged = merged_priors(priors)
    for problem, suggestions in merged.items():
        policy.add_prior(problem, suggestions)
    return len(merged)


def add_store_prior(policy, store, source: str, device: str, problems=None, source_acc: str | None = None,
                    target_acc: str | None = None) -> int:
    """Give the policy what tuning found on `source` (`tune --transfer-from`): another GPU of this
    one's architecture, or, with `source_acc` and `target_acc`, this or another GPU's tuning with
    the other accumulator, as twins (store_prior). Returns the number of shapes with suggestions.
    Raises ValueError when the store has nothing tuned on `source`, or `source` is this device
    with the same accumulator."""
    return add_store_priors(policy, store, [(source, source_acc)], device, problems, target_acc)


def built_generic_only():
    """A policy filter: specs of a generic family (one build for every shape, slow to compile:
    CUTLASS) only where their build is already in the cache; per-shape families always."""
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.space import registry

    known: dict[str, bool] = {}

    def allow(family: str, spec, problem) -> bool:
        if not registry.get(family).generic:
            return True
        if registry.get(family).valid(spec, problem) is not None:
            return False  # it cannot serve this shape (and its source cannot be rendered for it)
        if spec.name not in known:  # a generic spec's source does not depend on the shape
            known[spec.name] = SpecImpl(spec).is_built(problem)
        return known[spec.name]
    return allow


def policy_filter(generic_built_only: bool = False, match: str | None = None):
    """The policy's `allow` filter: built generic kernels only, and/or names matching `match`
    (re.search); None when neither is asked for."""
    import re

    built = built_generic_only() if generic_built_only else None
    pattern = re.compile(match) if match is not None else None
    if built is None and pattern is None:
        return None

    def allow(family: str, spec, problem) -> bool:
        if pattern is not None and not pattern.search(spec.name):
            return False
        return built is None or built(family, spec, problem)
    return allow


def rejected_winners(store, device: str, problems, run_id: int) -> dict:
    """problem -> reason, for the problems whose winner this run's final check rejected (its
    full verification, or its timed output), unless a later check in the run passed."""
    wanted = {p.key(): p for p in problems}
    out = {}
    for _created, key, passed, reason in store.run_checks(run_id, device, TUNED):
        if key not in wanted:
            continue
        if passed:
            out.pop(wanted[key], None)
        else:
            out[wanted[key]] = reason
    return out


def promote_runner_up(store, device: str, problem: Problem, reason: str, run_id: int | None = None):
    """The stored winner of `problem` failed the final verification: record that (a trial of
    the same candidate, status 'rejected', stage 'final': it never wins there again) and store
    the next-best ok trial as the winner. Returns that trial, or None (the shape then has no
    winner and falls back to the libraries)."""
    from gemmrl.search.tune import FINAL_STAGE, best_trials

    row = store.get_tuning(device, problem, TUNED)
    if row is None:
        return None
    d = json.loads(bytes(row["choice"]).decode())
    spec = registry.get(d["family"]).spec_type()(**d["spec"])
    cand = Candidate(d["family"], spec, float("nan"), "final verification")
    veto = Trial(problem, cand, "rejected", None, 0.0, {"stage": FINAL_STAGE, "reason": reason[:500]})
    store.record_trial(run_id, device, problem, cand.name, veto.status, 0.0, None, veto.to_dict())
    best = best_trials(stored_history(store, device, [problem])).get(problem)
    if best is None or best.status != "ok" or best.reward <= 0:
        store.delete_tuning(device, problem, TUNED)
        return None
    choice = json.dumps({"family": best.candidate.family, "spec": best.to_dict()["spec"]}, sort_keys=True).encode()
    store.put_tuning(device, problem, TUNED, choice,
                     f"{best.candidate.name} (reward {best.reward:.3f}; runner-up)", float(best.time_us))
    return best


POLICIES = ("model-free", "random", "exhaustive")


def make_policy(name: str = "model-free", *, families: tuple | None = None, layouts=("NN", "TN"),
                allow=None, seed: int = 0):
    """The search policy `name` (POLICIES): the model-free policy that tunes; the pool in a seeded
    random order; or every spec of the pool in its fixed order, the exhaustive sweep a sample-
    efficiency study compares the others with (scripts/sample-efficiency.py). `allow` filters
    every option alike (built only, --match)."""
    kw = {**({"families": tuple(families)} if families else {}), "layouts": tuple(layouts), "allow": allow}
    if name == "model-free":
        return ModelFreePolicy(**kw, seed=seed)
    if name == "random":
        return RandomPolicy(**kw, seed=seed)
    if name == "exhaustive":
        return ExhaustivePolicy(**kw)
    raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")


RESUME_WINDOW_S = 12 * 3600.0


def resume_order(problems, last_trial: dict, now: float, window_s: float = RESUME_WINDOW_S) -> list:
    """The order a `--more` search takes `problems` in: those with no trial in the last `window_s`
    seconds first, in the order given, then those searched within it, the longest ago first (ties
    in the order given). `last_trial`: problem key -> when its newest trial was recorded. `--more`
    counts from each shape's history, so a rerun in list order searched the shapes the last run had
    reached again, and a run cut by its deadline never got further: on 2026-11-30 (sixty-second
    session) two fp32 runs over a 28-shape list both searched the same first 11 shapes. Within the
    window the list's order did the same: on 2026-12-01 (sixty-sixth session) every shape of a
    16-shape bf16 list had been searched the session before, and four cut reruns each searched the
    list's first two or three shapes again (64x256x2048 four times, 11 shapes never)."""
    recent = [p for p in problems if now - last_trial.get(p.key(), -math.inf) < window_s]
    stale = [p for p in problems if now - last_trial.get(p.key(), -math.inf) >= window_s]
    return stale + sorted(recent, key=lambda p: last_trial[p.key()])


def run_tune(problems, store, device: str, evaluate, *, candidates: int = 32, batch: int = 8,
             budget_s: float = float("inf"), layouts=("NN", "TN"), run_id: int | None = None,
             policy=None, on_trial=None, deadline: float | None = None,
             generic_built_only: bool = False, families: tuple | None = None,
             match: str | None = None, more: int | None = None,
             transfer_from=None, transfer_acc: str | None = None, policy_name: str = "model-free",
             seed: int = 0, lt_prior: dict | None = None, reserve=None, ahead=None,
             ahead_kernels: int = 0) -> TuneResult:
    """Tune, resuming from the trials already in the store; store every trial and the winners.
    The policy also learns from the store's trials of other shapes on this device (its cost
    model, and transfer from the nearest tuned shapes), so a new shape set starts informed.
    `match`: a regular expression; only kernels whose name it finds are proposed. `more`: that
    many candidates per shape beyond those already stored, instead of `candidates` in all.
    `transfer_from`: another GPU model in the store (same architecture) whose tuning seeds this
    one's search (add_store_prior); `transfer_acc`: the accumulator of its tuning to take, when it
    is not the problems' own (each kernel's twin with theirs). Or a list of (GPU, accumulator or
    None[, input type or None]) sources, their suggestions interleaved by rank (add_store_priors;
    an input type not the problems' own: each kernel's twin with theirs, dtype_twin). `policy_name`: which
    search (make_policy) where no `policy` is given; only the model-free one takes a transfer.
    `lt_prior`: {problem: [(family, spec)]} of cuBLASLt's autotuned choices (search.lt_seed,
    `tune --seed-from-lt`), a prior like a transfer's, its suggestions ranked with theirs.
    `reserve`: seconds to keep before `deadline` for the final timing (search.tune.tune's).
    `ahead`, `ahead_kernels`: several shapes' batches compiled side by side (search.tune.tune's;
    ahead_builder)."""
    problems = list(problems)
    if more is not None:  # a rerun goes on where a run cut by its deadline stopped (resume_order)
        problems = resume_order(problems, store.last_trial_times(device), time.time())
    wanted = {p.key() for p in problems}
    stored = stored_history(store, device, None)
    history = [t for t in stored if t.problem.key() in wanted]
    others = [t for t in stored if t.problem.key() not in wanted]
    if (transfer_from or lt_prior) and policy_name != "model-free" and policy is None:
        raise ValueError(f"the {policy_name} policy takes no transfer: only the model-free one is seeded")
    policy = policy or make_policy(policy_name, families=families, layouts=layouts,
                                   allow=policy_filter(generic_built_only, match), seed=seed)
    if others:
        policy.observe(others)
    if transfer_from or lt_prior:
        sources = ([] if not transfer_from else
                   [(transfer_from, transfer_acc)] if isinstance(transfer_from, str) else list(transfer_from))
        sources = [(tuple(x) + (None,))[:3] for x in sources]
        accs, dtypes = {p.acc for p in problems}, {p.dtype for p in problems}
        named = [a for _g, a, _d in sources if a is not None]
        if named and len(accs) > 1:
            raise ValueError(f"transfer from the {named[0]} tuning: the problems mix accumulators "
                             f"({', '.join(sorted(accs))})")
        typed = [d for _g, _a, d in sources if d is not None]
        if typed and len(dtypes) > 1:
            raise ValueError(f"transfer from the {typed[0]} tuning: the problems mix input types "
                             f"({', '.join(sorted(dtypes))})")
        add_store_priors(policy, store, sources, device, target_acc=next(iter(accs)) if named and accs else None,
                         extra=[lt_prior] if lt_prior else (),
                         target_dtype=next(iter(dtypes)) if typed and dtypes else None)

    def keep(t: Trial) -> None:
        choice = json.dumps({"family": t.candidate.family, "spec": t.to_dict()["spec"]}, sort_keys=True).encode()
        store.put_tuning(device, t.problem, TUNED, choice, f"{t.candidate.name} (reward {t.reward:.3f})",
                         float(t.time_us))

    # each shape's best so far is stored as soon as a trial beats it, so a run cut mid-search (a
    # lost machine, a timeout) keeps the winners it found; the final pass below stores the same
    # (a trial timed beside its baseline takes the place of an older one that was not: tune._better)
    leader = {p: t for p, t in best_trials(history).items() if t.status == "ok" and t.reward > 0}

    def record(t: Trial):
        store.record_trial(run_id, device, t.problem, t.candidate.name, t.status, t.reward, t.time_us,
                           t.to_dict())
        if t.status == "ok" and t.reward > 0 and _better(t, leader.get(t.problem)):
            leader[t.problem] = t
            keep(t)
        if on_trial is not None:
            on_trial(t)

    res = tune(problems, policy, evaluate, per_shape_candidates=candidates, batch=batch,
               device_budget_s=budget_s, history=history, on_trial=record, deadline=deadline, more=more,
               reserve=reserve, ahead=ahead, ahead_kernels=ahead_kernels)
    # the final pass stores a shape's best only where it is a trial of this run, or where the shape
    # has no winner at all: a stored winner a race chose (in one session, beside the incumbent) is
    # not the search's best by reward, and a run that never reached the shape (a wall-clock
    # deadline) or found nothing better there must leave it as it is; writing the older search
    # best back sent the shape to the final timing again (shapes_to_time: the stored winner differs from
    # the verified one), with the older kernel compiled inside the timed step even under --built-only
    new = {id(t) for t in res.trials}
    for problem, t in res.best.items():
        if t.reward > 0 and t.status == "ok" and (id(t) in new or store.get_tuning(device, problem, TUNED) is None):
            keep(t)
    return res
