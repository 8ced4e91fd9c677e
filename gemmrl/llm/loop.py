"""Multi-turn refinement of one shape's kernel by an LLM, with several samples per turn.

Each turn: build the prompt (best so far, the previous turn's outcomes, retrieved examples),
ask for `samples` completions, then for each reply: parse (parse_error), static check
(refused), and `evaluate_source(problem, source)` -> {status, reason, time_us, reward,
build_log, resources} (compile_error / rejected / crashed / ok). The best ok kernel is kept; the
turn's outcomes are the next turn's feedback; every sample is a trajectory row in the store.
A spent token budget ends the loop (stopped='budget'); an LLM failure after retries ends it too
(stopped='llm_error'). Nothing here ever sees or records the API key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gemmrl.core.problem import Problem
from gemmrl.llm.client import BudgetExceeded, LLMError
from gemmrl.llm.parse import ParseError, extract_kernel
from gemmrl.llm.prompt import build_messages
from gemmrl.llm.retrieve import similar_examples
from gemmrl.llm.static_check import check_source

log = logging.getLogger("gemmrl.llm")

STATUSES = ("ok", "compile_error", "rejected", "crashed", "refused", "parse_error")


@dataclass
class Outcome:
    turn: int
    sample: int
    status: str
    reason: str = ""
    source: str | None = None
    kernel_sha256: str | None = None
    time_us: float | None = None
    reward: float = 0.0
    build_log: str = ""
    resources: list = field(default_factory=list)

    def feedback(self) -> dict:
        return {"status": self.status, "reason": self.reason, "build_log": self.build_log,
                "time_us": self.time_us, "reward": self.reward, "resources": self.resources}


@dataclass
class RefineResult:
    problem: Problem
    best: Outcome | None
    outcomes: list[Outcome]
    turns_done: int
    stopped: str  # done | budget | llm_error
    message: str = ""


def _sha(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()


def _evaluate_one(problem, reply: str, evaluate_source, turn: int, sample: int) -> tuple[Outcome, dict]:
    try:
        source = extract_kernel(reply)
    except ParseError as e:
        return Outcome(turn, sample, "parse_error", str(e)), {"parse": str(e)}
    sha = _sha(source)
    refusals = check_source(source)
    if refusals:
        return (Outcome(turn, sample, "refused", "static check: " + "; ".join(refusals), source, sha),
                {"static": refusals})
    try:
        res = dict(evaluate_source(problem, source))
    except Exception as e:  # an evaluator failure is this sample's failure, not the loop's
        log.exception("evaluate_source failed")
        res = {"status": "crashed", "reason": f"evaluator error: {type(e).__name__}: {e}"}
    status = res.get("status", "crashed")
    if status not in STATUSES:
        status = "rejected"
    reward = float(res.get("reward") or 0.0) if status == "ok" else 0.0
    out = Outcome(turn, sample, status, str(res.get("reason", "")), source, sha,
                  res.get("time_us") if status == "ok" else None, reward,
                  str(res.get("build_log", "") or ""), list(res.get("resources") or []))
    checks = {"static": [], **{k: v for k, v in res.items() if k not in ("build_log", "resources")}}
    return out, checks


def refine(problem: Problem, client, evaluate_source: Callable[[Problem, str], dict], *,
           turns: int = 3, samples: int = 4, store=None, device: str = "unknown",
           run_id: int | None = None, layout: str = "NN", baselines: dict | None = None,
           best: dict | None = None, k_examples: int = 3, ncu: dict | None = None,
           on_outcome: Callable[[Outcome], None] | None = None) -> RefineResult:
    """Refine one problem's kernel for up to `turns` turns of `samples` completions each."""
    examples = similar_examples(store, device, problem, k=k_examples, layout=layout) if store else []
    best_out: Outcome | None = None
    best_info = dict(best) if best else None  # {source, time_us, resources, reward}
    feedback: list[dict] = []
    outcomes: list[Outcome] = []
    stopped, message, done = "done", "", 0
    for turn in range(turns):
        messages = build_messages(problem, layout, best=best_info, baselines=baselines,
                                  feedback=feedback, examples=examples, ncu=ncu)
        try:
            completion = client.chat(messages, n=samples)
        except BudgetExceeded as e:
            stopped, message = "budget", str(e)
            log.info("stopping %s: %s", problem.shape, e)
            break
        except LLMError as e:
            stopped, message = "llm_error", str(e)
            log.warning("stopping %s: %s", problem.shape, e)
            break
        feedback = []
        for i, reply in enumerate(completion.texts):
            out, checks = _evaluate_one(problem, reply, evaluate_source, turn, i)
            outcomes.append(out)
            feedback.append(out.feedback())
            if store is not None:
                store.record_trajectory(run_id, device, problem, turn, i, messages, reply, out.source,
                                        out.kernel_sha256, out.status, out.reason, out.time_us,
                                        out.reward, {**checks, "usage": completion.usage,
                                                     "attempts": completion.attempts})
            if out.status == "ok" and out.reward > 0 and (best_out is None or out.reward > best_out.reward):
                best_out = out
                best_info = {"source": out.source, "time_us": out.time_us, "resources": out.resources,
                             "reward": out.reward}
                if checks.get("ncu"):  # Nsight Compute metrics of the new best kernel, when ncu ran
                    from gemmrl.llm.ncu import describe

                    ncu = describe(checks["ncu"])
            if on_outcome is not None:
                on_outcome(out)
        done = turn + 1
    return RefineResult(problem, best_out, outcomes, done, stopped, message)


def export_trajectories(store, path: str | Path, device: str | None = None) -> int:
    """Every trajectory row as one JSON line (prompt messages, reply, kernel sha256, status,
    reason, time_us, reward, ...): a dataset for RL fine-tuning. Returns the line count."""
    n = 0
    with open(path, "w") as f:
        for r in store.trajectories(device):
            f.write(json.dumps({
                "id": r["id"], "run_id": r["run_id"], "device": r["device"],
                "problem": {"M": r["M"], "N": r["N"], "K": r["K"], "dtype": r["dtype"], "acc": r["acc"]},
                "turn": r["turn"], "sample": r["sample"], "prompt": r["prompt"], "reply": r["reply"],
                "kernel_sha256": r["kernel_sha256"], "status": r["status"], "reason": r["reason"],
                "time_us": r["time_us"], "reward": r["reward"], "checks": r["checks"]},
                sort_keys=True) + "\n")
            n += 1
    return n
