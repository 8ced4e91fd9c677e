"""Retrieved examples for a prompt: the best kernels of the most similar shapes in the store,
found by a lexical BM25 index. A document is one shape's best kernel (from ok trials, the
tuning table, or ok LLM trajectories with their source); its tokens are the shape (exact sizes
and log2 buckets of M, N, K, their ratios), dtype, accumulator, layout, family and spec fields,
and the identifiers of the kernel source when there is one."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field

from gemmrl.core.problem import Problem

_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")


def shape_tokens(M: int, N: int, K: int, dtype: str, acc: str) -> list[str]:
    toks = [f"m{M}", f"n{N}", f"k{K}", f"dtype_{dtype}", f"acc_{acc}"]
    for name, v in (("m", M), ("n", N), ("k", K)):
        lg = int(round(math.log2(max(v, 1))))
        toks += [f"{name}log{lg}", f"{name}log{lg - 1}~", f"{name}log{lg + 1}~", f"{name}log{lg}~"]
    toks += [f"mn_{int(round(math.log2(M / N)))}", f"mk_{int(round(math.log2(M / K)))}",
             f"nk_{int(round(math.log2(N / K)))}"]
    return toks


def _spec_tokens(obj, prefix="") -> list[str]:
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _spec_tokens(v, f"{k}")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _spec_tokens(v, prefix)
    elif obj is not None:
        out.append(f"{prefix}={obj}".lower() if prefix else str(obj).lower())
    return out


@dataclass
class Example:
    problem: Problem
    origin: str  # trial | tuning | trajectory
    name: str
    time_us: float | None
    reward: float | None
    text: str  # the spec (JSON) or the kernel source
    tokens: list[str] = field(default_factory=list, repr=False)
    score: float = 0.0


def _docs(store, device: str) -> list[Example]:
    best: dict[tuple, Example] = {}

    def offer(ex: Example):
        k = ex.problem.key()
        cur = best.get(k)
        # a kernel with source beats a spec; then the higher reward, then the lower time
        rank = (ex.origin == "trajectory", ex.reward or 0.0, -(ex.time_us or math.inf))
        if cur is None or rank > (cur.origin == "trajectory", cur.reward or 0.0, -(cur.time_us or math.inf)):
            best[k] = ex

    for r in store.trials(device):
        if r["status"] != "ok":
            continue
        rec = r["record"] or {}
        spec = rec.get("spec", {})
        p = Problem(r["M"], r["N"], r["K"], r["dtype"], r["acc"])
        toks = [f"family_{rec.get('family', '')}"] + _spec_tokens(spec)
        offer(Example(p, "trial", r["candidate"], r["time_us"], r["reward"],
                      json.dumps({"family": rec.get("family"), "spec": spec}, sort_keys=True), toks))
    rows = store.db.execute("SELECT * FROM tuning WHERE device=?", (device,)).fetchall()
    for r in rows:
        choice = r["choice"]
        text = choice.decode("utf-8", "replace") if isinstance(choice, (bytes, bytearray)) else str(choice)
        try:
            toks = _spec_tokens(json.loads(text))
        except (ValueError, TypeError):
            toks, text = [], f"{r['impl']}: {r['info']}"
        p = Problem(r["M"], r["N"], r["K"], r["dtype"], r["acc"])
        offer(Example(p, "tuning", f"{r['impl']}: {r['info']}", r["time_us"], None, text,
                      [f"impl_{r['impl']}"] + toks))
    for r in store.trajectories(device):
        if r["status"] != "ok" or not r.get("source"):
            continue
        p = Problem(r["M"], r["N"], r["K"], r["dtype"], r["acc"])
        layout = re.search(r'layout\W+(NN|TN)', r["source"])
        toks = [f"layout_{layout.group(1)}"] if layout else []
        toks += [t.lower() for t in _IDENT_RE.findall(r["source"])]
        offer(Example(p, "trajectory", f"llm:{(r['kernel_sha256'] or '')[:12]}", r["time_us"],
                      r["reward"], r["source"], toks))
    for ex in best.values():
        ex.tokens = shape_tokens(*ex.problem.key()) + ex.tokens
    return list(best.values())


class BM25:
    def __init__(self, docs: list[list[str]], k1: float = 1.2, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs]
        self.len = [len(d) for d in docs]
        self.avg = sum(self.len) / len(docs) if docs else 0.0
        df = Counter(t for d in self.tf for t in d)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: list[str]) -> list[float]:
        out = []
        for tf, dl in zip(self.tf, self.len):
            s = 0.0
            for t in set(query):
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * dl / (self.avg or 1)))
            out.append(s)
        return out


def similar_examples(store, device: str, problem: Problem, k: int = 3, layout: str | None = None,
                     exclude_same_shape: bool = True) -> list[Example]:
    """Up to k best kernels of the shapes most similar to `problem` (its own shape excluded)."""
    if store is None or k <= 0:
        return []
    docs = [d for d in _docs(store, device) if not (exclude_same_shape and d.problem == problem)]
    if not docs:
        return []
    query = shape_tokens(*problem.key()) + ([f"layout_{layout}", f"layout={layout.lower()}"] if layout else [])
    scores = BM25([d.tokens for d in docs]).scores(query)
    for d, s in zip(docs, scores):
        d.score = s
    ranked = sorted(docs, key=lambda d: (-d.score, d.problem.key()))
    return [d for d in ranked[:k] if d.score > 0]
