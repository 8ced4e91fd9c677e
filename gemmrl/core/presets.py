"""Shape presets for common LLMs: the projection GEMMs of one decoder layer plus the LM head, at
several token counts, so a user can tune for their model in one command
(`--shapes preset:llama3-8b` or `preset:qwen2.5-7b@tokens=1,64`).

Every projection is a TN problem, as nn.Linear computes it: A = activations [tokens, in],
B = weight [out, in], C = A @ B.T, so M = tokens, N = out features, K = in features.
Projections are separate as in Hugging Face transformers (q, k, v, o, gate, up, down, lm_head);
`fused=True` gives the fused forms serving engines use (qkv, gate_up). Projections of equal shape
(k and v; gate and up) are one problem with both names in its label. Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemmrl.core.problem import Problem, ProblemError

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder-only transformer that fix its GEMM shapes (from its config.json)."""
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def projections(self, fused: bool = False) -> list[tuple[str, int, int]]:
        """(name, N = out features, K = in features) of each nn.Linear, in forward order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        attn = [("qkv_proj", q + 2 * kv, h)] if fused else [("q_proj", q, h), ("k_proj", kv, h),
                                                             ("v_proj", kv, h)]
        mlp = [("gate_up_proj", 2 * i, h)] if fused else [("gate_proj", i, h), ("up_proj", i, h)]
        return attn + [("o_proj", h, q)] + mlp + [("down_proj", h, i), ("lm_head", self.vocab, h)]


# meta-llama/Meta-Llama-3-8B (3.1 has the same shapes) and Qwen/Qwen2.5-7B config.json
MODELS = {
    "llama3-8b": ModelDims("llama3-8b", hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                           head_dim=128, vocab=128256),
    "qwen2.5-7b": ModelDims("qwen2.5-7b", hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                            head_dim=128, vocab=152064),
}
ALIASES = {"llama-3-8b": "llama3-8b", "llama3.1-8b": "llama3-8b", "llama-3.1-8b": "llama3-8b",
           "meta-llama-3-8b": "llama3-8b", "qwen2.5-7b-instruct": "qwen2.5-7b"}


def model(name: str) -> ModelDims:
    key = name.strip().lower().split("/")[-1]
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ProblemError(f"unknown preset {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def preset(name: str, tokens=DEFAULT_TOKENS, dtype: str = "fp16", acc: str = "fp32",
           fused: bool = False) -> list[tuple[Problem, str, str]]:
    """(Problem, layout, label) for each distinct projection shape at each token count, ordered
    by token count then forward order; label e.g. 'llama3-8b.k_proj+v_proj@16'."""
    dims = model(name)
    tokens = tuple(tokens)
    if not tokens:
        raise ProblemError(f"preset {dims.name}: no token counts given")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or t <= 0:
            raise ProblemError(f"preset {dims.name}: token counts must be positive integers, got {t!r}")
    out: dict[tuple[Problem, str], list[str]] = {}
    for t in dict.fromkeys(tokens):
        for proj, n, k in dims.projections(fused):
            out.setdefault((Problem(t, n, k, dtype, acc), "TN"), []).append(proj)
    return [(p, layout, f"{dims.name}.{'+'.join(names)}@{p.M}") for (p, layout), names in out.items()]


_SPEC_RE = re.compile(r"^preset:(?P<name>[^@]+)(?P<opts>(@[^@]*)*)$")


def parse_spec(text: str) -> dict:
    """'preset:NAME[@tokens=1,64][@fused]' -> keyword arguments of preset()."""
    m = _SPEC_RE.match(text.strip())
    if not m:
        raise ProblemError(f"bad preset spec {text!r}: expected preset:NAME[@tokens=1,64][@fused]")
    kw: dict = {"name": m.group("name").strip()}
    for opt in filter(None, (o.strip() for o in m.group("opts").split("@"))):
        key, _, value = opt.partition("=")
        if key == "tokens" and value:
            try:
                kw["tokens"] = tuple(int(v) for v in re.split(r"[,\s]+", value.strip()) if v)
            except ValueError:
                raise ProblemError(f"bad token counts in {text!r}: expected @tokens=1,64,256") from None
        elif key == "fused" and not value:
            kw["fused"] = True
        else:
            raise ProblemError(f"unknown preset option {opt!r} in {text!r}; known: tokens=N,N,..., fused")
    return kw
