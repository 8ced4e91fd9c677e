"""The tuning job: every candidate a policy proposes is built, verified and timed in a worker
process (a crash or hang quarantines that candidate and the batch goes on without it), every
trial is stored, and each shape's winner is kept as the implementation 'gemmrl-tuned'."""

from __future__ import annotations

import json
import os
import tempfile

from gemmrl.bench.worker import HEARTBEAT_ENV, Worker, last_beat
from gemmrl.core.problem import Problem
from gemmrl.search.policy import Candidate, ModelFreePolicy, Trial
from gemmrl.search.tune import TuneResult, _better, best_trials, gpu_evaluate, tune
from gemmrl.space import registry

TUNED = "gemmrl-tuned"
_CHILD: dict = {}


def evaluate_task(problem, candidates, device, db_path, baseline_us):
    """In the worker: evaluate one batch on the GPU against the given baseline time."""
    from gemmrl.store.db import Store

    if _CHILD.get("db") != db_path:
        import torch

        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
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


def stored_history(store, device: str, problems) -> list[Trial]:
    out = []
    for row in store.trials(device, problems):
        try:
            out.append(Trial.from_dict(row["record"]))
        except (KeyError, TypeError, ValueError):
            continue  # a record from an older spec layout: not a reason to stop tuning
    return out


def add_store_prior(policy, store, source: str, device: str, problems=None) -> int:
    """Give the policy what tuning found on `source`, another GPU of this one's architecture
    (`tune --transfer-from`): per shape, the stored winner first, then the other candidates that
    passed there, highest reward first. `problems`: only these shapes' suggestions.
    Returns the number of shapes with suggestions. Raises ValueError when the store has nothing
    tuned on `source`, or `source` is this device."""
    if source == device:
        raise ValueError(f"{source!r} is this GPU: its trials are the search's own history already")
    trials = stored_history(store, source, None)
    winners = {c[1]: (c[2], c[3]) for c in store.tuned_choices(TUNED, source)}
    if not trials and not winners:
        known = sorted(set(store.devices()) - {device})
        raise ValueError(f"the store holds nothing tuned on {source!r}"
                         + (f"; it knows {', '.join(map(repr, known))}" if known else ""))
    wanted = None if problems is None else set(problems)
    by_problem: dict = {}
    for t in trials:
        if t.status == "ok" and t.time_us is not None and (wanted is None or t.problem in wanted):
            by_problem.setdefault(t.problem, []).append(t)
    shapes = 0
    for problem in sorted(set(by_problem) | {p for p in winners if wanted is None or p in wanted},
                          key=lambda p: p.key()):
        first = []
        if problem in winners:
            family, fields = winners[problem]
            try:
                first = [(family, registry.get(family).spec_type()(**fields))]
            except (TypeError, ValueError):
                first = []  # a choice from an older spec layout
        ranked = sorted(by_problem.get(problem, ()), key=lambda t: (-t.reward, t.time_us, t.candidate.name))
        suggestions = first + [(t.candidate.family, t.candidate.spec) for t in ranked]
        if suggestions:
            policy.add_prior(problem, suggestions)
            shapes += 1
    return shapes


def built_generic_only():
    """A policy filter: specs of a generic family (one build for every shape, slow to compile:
    CUTLASS) only where their build is already in the cache; per-shape families always."""
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.space import registry

    known: dict[str, bool] = {}

    def allow(family: str, spec, problem) -> bool:
        if not registry.get(family).generic:
            return True
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


def run_tune(problems, store, device: str, evaluate, *, candidates: int = 32, batch: int = 8,
             budget_s: float = float("inf"), layouts=("NN", "TN"), run_id: int | None = None,
             policy=None, on_trial=None, deadline: float | None = None,
             generic_built_only: bool = False, families: tuple | None = None,
             match: str | None = None, more: int | None = None,
             transfer_from: str | None = None) -> TuneResult:
    """Tune, resuming from the trials already in the store; store every trial and the winners.
    The policy also learns from the store's trials of other shapes on this device (its cost
    model, and transfer from the nearest tuned shapes), so a new shape set starts informed.
    `match`: a regular expression; only kernels whose name it finds are proposed. `more`: that
    many candidates per shape beyond those already stored, instead of `candidates` in all.
    `transfer_from`: another GPU model in the store (same architecture) whose tuning seeds this
    one's search (add_store_prior)."""
    problems = list(problems)
    wanted = {p.key() for p in problems}
    stored = stored_history(store, device, None)
    history = [t for t in stored if t.problem.key() in wanted]
    others = [t for t in stored if t.problem.key() not in wanted]
    policy = policy or ModelFreePolicy(**({"families": tuple(families)} if families else {}),
                                       layouts=tuple(layouts),
                                       allow=policy_filter(generic_built_only, match))
    if others:
        policy.observe(others)
    if transfer_from is not None:
        add_store_prior(policy, store, transfer_from, device)

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
               device_budget_s=budget_s, history=history, on_trial=record, deadline=deadline, more=more)
    for problem, t in res.best.items():
        if t.reward > 0 and t.status == "ok":
            keep(t)
    return res
