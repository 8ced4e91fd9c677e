"""Search policies: which kernel specs to build, verify and time next for a problem.

Records (one-way, plain data): a policy proposes `Candidate`s; the evaluator (a GPU, or a
simulation in the tests) turns each into a `Trial` with a status, a time and a reward; the
policy observes the trials and proposes again (search/tune.py runs the loop).

- `CostModel`: each family's analytic `estimate_us(spec, problem)`, corrected by a ridge
  regression of log(measured / estimated) on features of (spec, problem) that is learned from
  every timed trial, across problems; its posterior width is the bandit's uncertainty.
- `ModelFreePolicy`: needs nothing but a GPU. Per batch, its options are the fixed pool
  (`candidate_pool`) and the families' own heuristic picks, the winners of the nearest tuned
  problems (transfer), and one-field mutations of this problem's best kernels so far (evolution);
  all are ranked by the cost model's lower confidence bound on the time (LinUCB), with an
  epsilon of random exploration. Legality only ever through the family's valid(). A prior from
  another GPU of the same architecture (`add_prior`: what tuning there found best per shape)
  leads a problem's first batch; nothing of it counts as tried here.
- `ExhaustivePolicy` (the comparison baseline): the whole pool in a fixed order.
- `RandomPolicy`: the pool in a seeded random order (the floor any policy must beat).

Every policy never proposes a spec already tried on that problem, nor a quarantined one (the
store's quarantine, and any candidate that crashed its worker here). Identity of a candidate
on a problem is (family, spec.name): the names encode every field, and the quarantine is
keyed by them too. No torch, no GPU: numpy only.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from typing import Callable, Iterable, Protocol

import numpy as np

from gemmrl.core.problem import Problem
from gemmrl.space import cutlass_sm90, registry

STATUSES = ("ok", "rejected", "crashed")
SMS = 132  # H100 / H200 SXM
DEFAULT_FAMILIES = ("cutlass_sm90", "raw")


# ---------------------------------------------------------------------------------------------
# Records

@dataclass(frozen=True)
class Candidate:
    family: str  # a registry.FAMILIES name
    spec: object  # that family's frozen spec dataclass
    # not part of a candidate's identity (equality is family and spec):
    predicted_us: float = field(default=float("nan"), compare=False)
    origin: str = field(default="", compare=False)  # pool, heuristic, transfer, prior, mutation, explore

    @property
    def name(self) -> str:
        return self.spec.name

    def key(self) -> tuple[str, str]:
        return (self.family, self.spec.name)


@dataclass(frozen=True)
class Trial:
    problem: Problem
    candidate: Candidate
    status: str  # ok | rejected (did not build, or failed a check) | crashed (killed its worker)
    time_us: float | None = None  # kernel time, for status ok
    reward: float = 0.0
    details: dict = field(default_factory=dict)  # reason, stage, device_s, rel_err, ...

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"trial status must be one of {', '.join(STATUSES)}, got {self.status!r}")

    def key(self) -> tuple[str, str]:
        return self.candidate.key()

    def to_dict(self) -> dict:
        """A JSON-able form (for logs and the store); from_dict is its inverse."""
        c = self.candidate
        return {"problem": list(self.problem.key()), "family": c.family, "spec": asdict(c.spec),
                "predicted_us": c.predicted_us, "origin": c.origin, "status": self.status,
                "time_us": self.time_us, "reward": self.reward, "details": self.details}

    @staticmethod
    def from_dict(d: dict) -> "Trial":
        spec = registry.get(d["family"]).spec_type()(**d["spec"])
        cand = Candidate(d["family"], spec, float(d.get("predicted_us", float("nan"))), d.get("origin", ""))
        return Trial(Problem(*d["problem"]), cand, d["status"], d.get("time_us"), float(d.get("reward", 0.0)),
                     dict(d.get("details", {})))


# ---------------------------------------------------------------------------------------------
# The fixed candidate pool and one-field mutations

def _raw_pool(problem: Problem, layout: str) -> list:
    from gemmrl.space import raw

    out = []
    for swap in (False, True):
        for (bm, bn), (wm, wn) in raw._WARPS.items():
            for bk in (32, 64, 128):
                for stages in (3, 4):
                    for split in (1, 2, 4, 8, 16):  # split-K with the fetch-add arrival (runs 810-817)
                        # unsplit: C staged in shared memory on a large M*N (raw.staged_epilogue, runs 864-889)
                        out.append(raw.with_epilogue(raw.RawSpec(bm, bn, bk, wm, wn, stages, split, swap, layout,
                                                                 problem.acc, "add" if split > 1 else "cas",
                                                                 dtype=problem.dtype), problem))
    return out


@lru_cache(maxsize=64)
def _enumerated(name: str, layout: str, dtype: str, acc: str) -> tuple:
    return tuple(registry.get(name).mod().enumerate_specs(layout, dtype, acc))


def _family_pool(name: str, problem: Problem, layout: str) -> list:
    """Every spec of a family worth sweeping for a problem, before valid()."""
    if name == "raw":
        return _raw_pool(problem, layout)
    if hasattr(registry.get(name).mod(), "enumerate_specs"):
        specs = list(_enumerated(name, layout, problem.dtype, problem.acc))
        if name == "cutlass_sm90":  # a short K: the resident twins (two or more blocks an SM)
            specs += cutlass_sm90.resident_pool(specs, problem)
        if name == "cutlass_sm90" and cutlass_sm90.skinny_n(problem):  # and their swapped twins
            specs += cutlass_sm90.swapped_twins(specs)
        return specs
    return registry.get(name).candidates(problem, layout, limit=64)


@lru_cache(maxsize=64)
def candidate_pool(problem: Problem, layouts: tuple = ("NN", "TN"),
                   families: tuple = DEFAULT_FAMILIES) -> tuple:
    """The fixed pool: (family, spec) for every valid spec of every family and layout, in a
    fixed order (family, layout, the family's enumeration order). CUTLASS: enumerate_specs
    (787 specs per layout; for K <= 512, or 1024 on a skinny output, their resident twins,
    cutlass_sm90.resident_pool; with their swapped twins for a narrow N over many rows,
    cutlass_sm90.skinny_n); raw: every tile of the family's warp table x block_k 32/64/128 x
    stages 3/4 x split_k 1..16 (powers of 2) x swap_ab, those valid() accepts. Split-K raw
    specs arrive with one fetch-add (arrive='add'), which beat the CAS loop in all 24 twins timed
    side by side (scripts/arrive-twins.py, runs 810-817, by 1.02x-1.96x); the CAS arrival is a
    mutation away (the raw ladder). Unsplit raw specs take raw.staged_epilogue(problem): C staged
    in shared memory where M*N >= 256K and K <= 1024 (8 of 8 twins at 256K faster, runs
    864-889), the direct epilogue a mutation away; the direct one elsewhere."""
    out, seen = [], set()
    for name in families:
        fam = registry.get(name)
        for layout in layouts:
            for spec in _family_pool(name, problem, layout):
                if (name, spec.name) not in seen and fam.valid(spec, problem) is None:
                    seen.add((name, spec.name))
                    out.append((name, spec))
    return tuple(out)


# Neighbouring values of a field (the search steps one place along the ladder; a string field to
# any other value of its ladder). Fields not listed: bools toggle, strings take the values the
# pool uses, ints halve or double.
_LADDERS = {
    "cutlass_sm90": {
        "tile_m": (64, 128, 192, 256), "tile_n": (16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
        "tile_k": (32, 64, 128), "cluster_m": (1, 2), "cluster_n": (1, 2),
        "splits": cutlass_sm90.SPLIT_COUNTS, "stages": (0, 2, 3, 4, 5, 6, 7, 8), "swizzle": cutlass_sm90.SWIZZLES,
        "raster": cutlass_sm90.RASTERS,  # the pool has CUTLASS's heuristic order only
        "epi_n": (0, 64, 96, 128, 192, 256)},  # the TMA epilogue's subtile width (0: CUTLASS's 32)
    "raw": {
        "block_m": (16, 32, 64, 128, 256), "block_n": (16, 32, 64, 128, 256), "block_k": (16, 32, 64, 128),
        "warps_m": (1, 2, 4, 8), "warps_n": (1, 2, 4, 8), "stages": (2, 3, 4),
        "split_k": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), "arrive": ("cas", "add"),
        "epi": ("direct", "smem")},  # the tile of C staged in shared memory, 16-byte stores (raw.staged_epilogue)
}
# dtype and acc: set by the problem; pdl: a launch that overlaps consecutive calls, which the
# kernel-mode timing would credit, so never a search candidate (results/README.md, eleventh session)
_FIXED_FIELDS = ("dtype", "acc", "pdl")  # never mutated


def _repairs(family: str, spec) -> list:
    """Specs one coupled change away from an invalid mutation (a scheduler needs its split
    count, a raw tile its warp grid). Only suggestions: valid() decides."""
    if family == "cutlass_sm90":
        s = replace(spec, splits=max(2, spec.splits) if spec.scheduler == "splitk" else 1)
        out = [s]
        if s.schedule in cutlass_sm90.LEAN_SCHEDULES:  # one CTA per tile: no order, swizzle or split
            lean = replace(s, scheduler="tile", splits=1, raster="heuristic", swizzle=1, reduction="deterministic")
            out.append(lean)
            if lean.epilogue != "nosmem":
                out.append(replace(lean, epilogue="nosmem"))
        elif s.scheduler == "tile":
            out.append(replace(s, scheduler="persistent", splits=1))
        if s.schedule == "pingpong" and s.scheduler not in ("persistent", "tile"):
            out.append(replace(s, scheduler="persistent", splits=1))
        if s.epi_n and (s.epilogue != "tma" or s.tile_n % s.epi_n):  # a subtile the new tile or epilogue lacks
            out.append(replace(s, epi_n=0))
        return out
    if family == "raw":
        from gemmrl.space import raw

        grids = [raw._WARPS.get((spec.block_m, spec.block_n), (2, 2)), (2, 4), (4, 2), (2, 2), (4, 1),
                 (1, 4), (2, 1), (1, 2), (1, 1)]
        out = [replace(spec, warps_m=wm, warps_n=wn) for wm, wn in grids]
        # an arrival needs a split: split_k 1 drops the fetch-add, a fetch-add on split 1 takes split 2
        if spec.split_k == 1 and spec.arrive != "cas":
            out.insert(0, replace(spec, arrive="cas"))
            out.insert(1, replace(spec, split_k=2))
        if getattr(spec, "epi", "direct") != "direct":  # the staged epilogue wants N % 8 == 0
            out.append(replace(spec, epi="direct"))
        return out
    return []


def _field_values(family: str, fname: str, value, pool_values: dict, layouts: tuple) -> list:
    ladder = _LADDERS.get(family, {}).get(fname)
    if isinstance(value, bool):
        return [not value]
    if fname == "layout":
        return [v for v in layouts if v != value]
    if isinstance(value, str):
        return [v for v in (ladder if ladder is not None else pool_values.get(fname, ())) if v != value]
    if isinstance(value, int):
        if ladder is None:
            return [v for v in (value // 2, value * 2) if v != value]
        if value in ladder:
            i = ladder.index(value)
            return [ladder[j] for j in (i - 1, i + 1) if 0 <= j < len(ladder)]
        lower = [v for v in ladder if v < value]
        upper = [v for v in ladder if v > value]
        return ([lower[-1]] if lower else []) + ([upper[0]] if upper else [])
    return []


@lru_cache(maxsize=64)
def _string_values(family: str, problem: Problem, layouts: tuple) -> dict:
    """The values each string field takes in the family's pool (a string field's ladder)."""
    values: dict = {}
    for _, s in candidate_pool(problem, layouts, (family,)):
        for f in fields(s):
            if isinstance(getattr(s, f.name), str):
                values.setdefault(f.name, set()).add(getattr(s, f.name))
    return {k: sorted(v) for k, v in values.items()}


@lru_cache(maxsize=4096)
def mutations(family: str, spec, problem: Problem, layouts: tuple = ("NN", "TN")) -> tuple:
    """Every spec one field away from `spec` (a neighbouring value on the field's ladder, with a
    coupled repair where the plain change is illegal) that the family's valid() accepts for
    `problem`. Specs the family offers to seeds only (seed_only) are among them only where
    `spec` is one itself: a seed that won leads the search into its own region, nothing else does."""
    fam = registry.get(family)
    layouts = tuple(layouts)
    own_region = _seed_only(fam, spec)
    pool_values = _string_values(family, problem, layouts)
    out, seen = [], {spec.name}
    for f in fields(spec):
        if f.name in _FIXED_FIELDS:
            continue
        for v in _field_values(family, f.name, getattr(spec, f.name), pool_values, layouts):
            try:
                m = replace(spec, **{f.name: v})
            except (TypeError, ValueError):
                continue
            for option in [m] + _repairs(family, m):
                if option.name in seen:
                    continue
                if fam.valid(option, problem) is None and (own_region or not _seed_only(fam, option)):
                    seen.add(option.name)
                    out.append(option)
                    break
    return tuple(out)


def _seed_only(fam, spec) -> bool:
    """Whether the family offers `spec` to seeds only (its module's seed_only), not to the
    search's own moves."""
    f = getattr(fam.mod(), "seed_only", None)
    return bool(f is not None and f(spec))


# ---------------------------------------------------------------------------------------------
# The cost model

def _log2(x: float) -> float:
    return math.log2(max(x, 1e-9))


def _tiles(family: str, spec) -> tuple[int, int, int, int]:
    """(tile over M, tile over N, tile over K, K splits) of a spec, in the problem's terms."""
    if family == "cutlass_sm90":
        tm, tn = (spec.tile_n, spec.tile_m) if spec.swap_ab else (spec.tile_m, spec.tile_n)
        return tm, tn, spec.tile_k, spec.splits if spec.scheduler == "splitk" else 1
    if family == "raw":
        tm, tn = (spec.block_n, spec.block_m) if spec.swap_ab else (spec.block_m, spec.block_n)
        return tm, tn, spec.block_k, spec.split_k
    return 128, 128, 64, 1


def _features(family: str, spec, problem: Problem, est_us: float) -> list[float]:
    M, N, K = problem.M, problem.N, problem.K
    lM, lN, lK = _log2(M) / 14, _log2(N) / 14, _log2(K) / 14
    tm, tn, tk, splits = _tiles(family, spec)
    tiles_m, tiles_n = -(-M // tm), -(-N // tn)
    units = tiles_m * tiles_n * splits
    waves = -(-units // SMS)
    fill = units / (waves * SMS)
    pad = M * N / (tiles_m * tm * tiles_n * tn)
    ltm, ltn, lsp = _log2(tm) / 8, _log2(tn) / 8, _log2(splits) / 4
    f = [1.0, lM, lN, lK, lM - lN, _log2(est_us) / 10, ltm, ltn, _log2(tk) / 7, lsp, _log2(units) / 10,
         fill, pad, _log2(waves) / 4, lK * lsp, lM * ltm, lN * ltn, _log2(K / splits) / 14]
    if family == "cutlass_sm90":
        pp = float(spec.schedule == "pingpong")
        small = float(tm * tn <= 128 * 128)
        c21 = float((spec.cluster_m, spec.cluster_n) == (2, 1))
        c12 = float((spec.cluster_m, spec.cluster_n) == (1, 2))
        sk = float(spec.scheduler == "streamk")
        k128 = float(tk == 128)
        sw = _log2(spec.swizzle) / 3
        f += [pp, pp * small, pp * lK, sk, sk * fill, float(spec.scheduler == "splitk"), c21, c12, c21 * lM,
              c12 * lN, k128, k128 * lK, sw, sw * lN, float(spec.raster == "along_m"),
              float(spec.raster == "along_n"), float(spec.layout == "NN"), spec.stages / 8,
              float(spec.reduction == "nondeterministic"), float(spec.reduction == "separate"),
              float(getattr(spec, "epilogue", "tma") == "nosmem"), float(tn % 64 != 0 and tn > 32),
              float(spec.schedule == "ws"), float(spec.schedule == "tma"),
              float(spec.scheduler == "tile") * _log2(waves) / 4]
        # the TMA epilogue's subtile width: wider ones store an output-heavy (short-K) tile faster (run 166)
        epi = _log2(cutlass_sm90.epilogue_tile(spec)[1]) / 8 if getattr(spec, "epilogue", "tma") == "tma" else 0.0
        f += [epi, epi * lK]
    elif family == "raw":
        swap = float(spec.swap_ab)
        st = spec.stages / 4
        f += [swap, swap * lM, swap * lN, st, st * lK, _log2(spec.threads) / 8,
              float(spec.split_k > 1), float(spec.layout == "NN"), float(spec.acc == "fp16"),
              float(getattr(spec, "arrive", "cas") == "add") * lsp,  # the fetch-add arrival, by split depth
              float(getattr(spec, "epi", "direct") == "smem") * (lM + lN)]  # the staged epilogue, by output size
    return f


class CostModel:
    """predict_us = estimate_us(spec, problem) * exp(phi(spec, problem) . w[family]), w learned
    by ridge regression of log(measured / estimated) over every timed trial so far (all
    problems: what one shape teaches carries to the others). The posterior covariance gives each
    prediction a width (in log time) for the bandit's confidence bound."""

    CACHED_PROBLEMS = 16  # feature rows are kept for this many recent problems (memory bound)

    def __init__(self, ridge: float = 1.0, prior_sd: float = 0.3):
        self.ridge, self.prior_sd = ridge, prior_sd
        self._rows: OrderedDict = OrderedDict()  # problem -> {(family, spec): (log estimate, phi)}
        self._data: dict[str, tuple[list, list]] = {}  # family -> (phis, targets)
        self._fits: dict[str, tuple] = {}  # family -> (w, A^-1, residual sd)

    def estimate_us(self, family: str, spec, problem: Problem) -> float:
        return math.exp(self._row(family, spec, problem)[0])

    def _row(self, family: str, spec, problem: Problem):
        rows = self._rows.get(problem)
        if rows is None:
            rows = self._rows[problem] = {}
            while len(self._rows) > self.CACHED_PROBLEMS:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(problem)
        got = rows.get((family, spec))
        if got is None:
            try:
                est = float(registry.get(family).mod().estimate_us(spec, problem))
            except Exception:  # a family without a model, or a spec its model cannot price
                est = float("nan")
            if not math.isfinite(est) or est <= 0:
                est = 1e6
            got = (math.log(est), np.asarray(_features(family, spec, problem, est), dtype=float))
            rows[(family, spec)] = got
        return got

    def observe(self, trials: Iterable[Trial]) -> None:
        for t in trials:
            if t.status != "ok" or not t.time_us or not math.isfinite(t.time_us) or t.time_us <= 0:
                continue
            c = t.candidate
            log_est, phi = self._row(c.family, c.spec, t.problem)
            phis, ys = self._data.setdefault(c.family, ([], []))
            phis.append(phi)
            ys.append(math.log(t.time_us) - log_est)
            self._fits.pop(c.family, None)

    def observed(self, family: str | None = None) -> int:
        if family is not None:
            return len(self._data.get(family, ([], []))[1])
        return sum(len(ys) for _, ys in self._data.values())

    def _fit(self, family: str, dim: int):
        fit = self._fits.get(family)
        if fit is not None:
            return fit
        lam = np.full(dim, self.ridge)
        lam[0] = 1e-3  # the bias (a family's overall offset) is barely shrunk
        phis, ys = self._data.get(family, ([], []))
        if phis:
            X, y = np.vstack(phis), np.asarray(ys)
            A = X.T @ X + np.diag(lam)
            w = np.linalg.solve(A, X.T @ y)
            sse = float(np.sum((y - X @ w) ** 2))
            n = len(y)
        else:
            A, w, sse, n = np.diag(lam), np.zeros(dim), 0.0, 0
        prior_n = 5.0  # the prior sd counts as this many residuals
        sd = math.sqrt((prior_n * self.prior_sd ** 2 + sse) / (prior_n + n))
        fit = (w, np.linalg.inv(A), max(sd, 0.02))
        self._fits[family] = fit
        return fit

    def predict_log(self, family: str, specs: list, problem: Problem) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of log predicted time, per spec."""
        if not specs:
            return np.zeros(0), np.zeros(0)
        rows = [self._row(family, s, problem) for s in specs]
        base = np.array([r[0] for r in rows])
        X = np.vstack([r[1] for r in rows])
        w, Ainv, sd = self._fit(family, X.shape[1])
        width = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", X, Ainv, X), 0.0))
        return base + X @ w, sd * width

    def predict_us(self, family: str, spec, problem: Problem) -> float:
        mu, _ = self.predict_log(family, [spec], problem)
        return float(math.exp(mu[0]))


# ---------------------------------------------------------------------------------------------
# Policies

class Policy(Protocol):
    def propose(self, problem: Problem, k: int) -> list[Candidate]: ...

    def observe(self, trials: Iterable[Trial]) -> None: ...


class _Tracking:
    """What every policy remembers: the specs tried per problem, crashes, timed results."""

    def __init__(self, families: tuple, layouts: tuple,
                 quarantined: Callable[[Problem], Iterable[str]] | None,
                 allow: Callable[[str, object, Problem], bool] | None = None):
        for name in families:
            registry.get(name)  # unknown names fail here, with the known ones listed
        self.families, self.layouts = tuple(families), tuple(layouts)
        self._quarantined = quarantined
        self.allow = allow  # allow(family, spec, problem): a filter on every option (e.g. built only)
        self.tried: dict[Problem, set] = {}
        self.crashed: dict[Problem, set] = {}  # spec names that killed a worker on the problem
        self.ok: dict[Problem, list[Trial]] = {}

    def observe(self, trials: Iterable[Trial]) -> None:
        for t in trials:
            self.tried.setdefault(t.problem, set()).add(t.key())
            if t.status == "crashed":
                self.crashed.setdefault(t.problem, set()).add(t.candidate.name)
            elif t.status == "ok" and t.time_us is not None:
                self.ok.setdefault(t.problem, []).append(t)

    def blocked(self, problem: Problem) -> tuple[set, set]:
        """(tried keys, quarantined names) for a problem."""
        names = set(self.crashed.get(problem, ()))
        if self._quarantined is not None:
            names |= set(self._quarantined(problem))
        return self.tried.get(problem, set()), names

    def pool(self, problem: Problem) -> tuple:
        return candidate_pool(problem, self.layouts, self.families)

    def _open(self, problem: Problem) -> list:
        tried, quarantined = self.blocked(problem)
        return [(f, s) for f, s in self.pool(problem) if (f, s.name) not in tried and s.name not in quarantined
                and (self.allow is None or self.allow(f, s, problem))]


class ExhaustivePolicy(_Tracking):
    """Every valid spec of the fixed pool, in the pool's fixed order: the sweep to compare with."""

    def __init__(self, families: tuple = DEFAULT_FAMILIES, layouts: tuple = ("NN", "TN"),
                 quarantined: Callable[[Problem], Iterable[str]] | None = None,
                 allow: Callable[[str, object, Problem], bool] | None = None):
        super().__init__(families, layouts, quarantined, allow)

    def propose(self, problem: Problem, k: int) -> list[Candidate]:
        return [Candidate(f, s, origin="pool") for f, s in self._open(problem)[:max(0, k)]]


class RandomPolicy(_Tracking):
    """The pool in a seeded random order per problem: what a policy must beat."""

    def __init__(self, families: tuple = DEFAULT_FAMILIES, layouts: tuple = ("NN", "TN"),
                 quarantined: Callable[[Problem], Iterable[str]] | None = None, seed: int = 0,
                 allow: Callable[[str, object, Problem], bool] | None = None):
        super().__init__(families, layouts, quarantined, allow)
        self.seed = seed

    def propose(self, problem: Problem, k: int) -> list[Candidate]:
        options = self._open(problem)
        random.Random(f"{self.seed}:{problem.key()}:{len(options)}").shuffle(options)  # stable seed
        return [Candidate(f, s, origin="explore") for f, s in options[:max(0, k)]]


@lru_cache(maxsize=64)
def _heuristic_specs(problem: Problem, layouts: tuple, families: tuple) -> tuple:
    """Each family's own ranked picks for the problem (Family.candidates), valid ones only."""
    return tuple((name, spec) for name in families for layout in layouts
                 for spec in registry.get(name).candidates(problem, layout, limit=8))


def _distance(a: Problem, b: Problem) -> float:
    return math.sqrt(sum((math.log2(x) - math.log2(y)) ** 2 for x, y in ((a.M, b.M), (a.N, b.N), (a.K, b.K))))


class ModelFreePolicy(_Tracking):
    """An evolutionary, contextual-bandit search over the families' spec spaces (see the module
    doc). Each batch of k takes, in this order: up to ceil(k/4) winners of the nearest tuned
    problems, up to ceil(k/4) mutations of this problem's best kernels, one seed per family on
    a problem's first batch, then the best of everything by the cost model's lower confidence
    bound, each of those slots replaced with probability `epsilon` by a random open option.
    Failures teach too: a generic spec that did not build is never proposed again, and a spec's
    failure rate over problems raises its score."""

    def __init__(self, families: tuple = DEFAULT_FAMILIES, layouts: tuple = ("NN", "TN"), *,
                 cost_model: CostModel | None = None,
                 quarantined: Callable[[Problem], Iterable[str]] | None = None,
                 neighbours: int = 3, transfer_top: int = 2, mutate_top: int = 3,
                 beta: float = 0.5, epsilon: float = 0.1, seed: int = 0,
                 allow: Callable[[str, object, Problem], bool] | None = None):
        super().__init__(families, layouts, quarantined, allow)
        self.model = cost_model or CostModel()
        self.neighbours, self.transfer_top, self.mutate_top = neighbours, transfer_top, mutate_top
        self.beta, self.epsilon = beta, epsilon
        self.rng = random.Random(seed)
        self.fails: dict[tuple, list[int]] = {}  # (family, name) -> [failures, trials] over problems
        self.broken: set[tuple] = set()  # generic specs that did not build: broken for every shape
        self.prior: dict[Problem, list[tuple]] = {}  # problem -> [(family, spec)], best first (add_prior)
        self.prior_top = transfer_top + 1  # what a first batch takes of the prior: the winner, its runners-up

    def add_prior(self, problem: Problem, suggestions: Iterable[tuple]) -> None:
        """What tuning `problem` on another GPU of the same architecture found (or this GPU with
        the other accumulator: search.run.store_prior): (family, spec) suggestions, best first;
        the first `prior_top` lead the problem's first batch (through the nearest such problems,
        on shapes the other GPU never tuned too; on a shape searched here already, the first
        `prior_top` not tried yet lead the next batch, while the prior pays: _prior_paying). Nothing of it counts
        as tried or timed here, and its times do not train the cost model: on the simulated pair
        of GPUs (tests/test_search.py) a model fitted to the other GPU's times was confidently
        wrong and searched worse than a cold one."""
        seen = self.prior.setdefault(problem, [])
        for family, spec in suggestions:
            if (family, spec.name) not in {(f, s.name) for f, s in seen}:
                seen.append((family, spec))

    def observe(self, trials: Iterable[Trial]) -> None:
        trials = list(trials)
        super().observe(trials)
        self.model.observe(trials)
        for t in trials:
            stat = self.fails.setdefault(t.key(), [0, 0])
            stat[1] += 1
            if t.status != "ok":
                stat[0] += 1
                if t.details.get("stage") == "build" and registry.get(t.candidate.family).generic:
                    self.broken.add(t.key())

    def _transfer(self, problem: Problem) -> list:
        near = sorted((p for p in self.ok if p != problem and (p.dtype, p.acc) == (problem.dtype, problem.acc)),
                      key=lambda p: (_distance(p, problem), p.key()))[:self.neighbours]
        out = []
        for p in near:
            best = sorted(self.ok[p], key=lambda t: (-t.reward, t.time_us))[:self.transfer_top]
            out += [(t.candidate.family, t.candidate.spec) for t in best]
        return out

    def _prior(self, problem: Problem) -> list:
        """The prior's suggestions for the problem; for a shape it lacks, those of its nearest
        shapes (same precision), the nearest first."""
        if problem in self.prior:
            return list(self.prior[problem])
        near = sorted((p for p in self.prior if (p.dtype, p.acc) == (problem.dtype, problem.acc)),
                      key=lambda p: (_distance(p, problem), p.key()))[:self.neighbours]
        return [s for p in near for s in self.prior[p][:self.transfer_top]]

    def _prior_paying(self, problem: Problem) -> list:
        """The problem's own prior on a shape searched here, while it pays: once `prior_top` or more
        of its suggestions have been timed here and none of them is the fastest kernel timed here,
        nothing (then _options still offers its first suggestion, once). On the simulated pair of GPUs (tests/test_search.py) a prior whose other GPU had
        searched a poor region took three slots of every batch, 12 of 32 candidates, and the warm
        search missed a target the cold one reached in 6 (512x512x512)."""
        prior = self.prior.get(problem, [])
        keys = {(f, s.name) for f, s in prior}
        mine = [t for t in self.ok.get(problem, ()) if t.time_us]
        timed = [t for t in mine if t.key() in keys]
        if len(timed) >= self.prior_top and min(mine, key=lambda t: t.time_us).key() not in keys:
            return []
        return prior

    def _options(self, problem: Problem) -> dict:
        """key -> [family, spec, origin] of every open option, first origin wins."""
        tried, quarantined = self.blocked(problem)
        opts: dict = {}

        def add(family, spec, origin, checked=False):
            key = (family, spec.name)
            if key in opts or key in tried or key in self.broken or spec.name in quarantined:
                return
            if family not in self.families or getattr(spec, "layout", None) not in (None, *self.layouts):
                return
            # validity first: a filter may render the spec (built_generic_only), and a spec another
            # shape suggests (prior, transfer) may not serve this one (a split-K that does not divide K)
            if not checked and registry.get(family).valid(spec, problem) is not None:
                return
            if self.allow is not None and not self.allow(family, spec, problem):
                return
            opts[key] = [family, spec, origin]

        # the prior's best lead a problem's first batch; then this GPU's own trials lead. On a shape
        # already searched here, the first `prior_top` of its own prior (not its neighbours') are
        # offered once each, those not tried yet, until the prior has lost here (_prior_paying): a seed
        # from the other accumulator's tuning, or from another GPU, on shapes this search has visited
        # (the cap is on those offered: a prior whose first suggestions were tried offers the next)
        prior = self._prior(problem) if not tried else self._prior_paying(problem)
        if tried and not prior:
            # a prior that lost here still offers its first suggestion once, where untried: the
            # other tuning's winner (store_prior puts it first). The fp32 search had timed three or
            # more of the fp16 tuning's runners-up on 74 of the 203 H200 shapes under 1.0x whose fp16
            # winner's fp32 twin it never tried (2026-12-01), and so offered none of them
            prior = self.prior.get(problem, [])[:1]
        for family, spec in prior:
            if sum(o[2] == "prior" for o in opts.values()) >= self.prior_top:
                break
            add(family, spec, "prior")
        for family, spec in self._transfer(problem):
            add(family, spec, "transfer")
        best = sorted(self.ok.get(problem, ()), key=lambda t: t.time_us)[:self.mutate_top]
        for t in best:
            for m in mutations(t.candidate.family, t.candidate.spec, problem, self.layouts):
                add(t.candidate.family, m, "mutation")
        for family, spec in _heuristic_specs(problem, self.layouts, self.families):
            add(family, spec, "heuristic", checked=True)
        for family, spec in self.pool(problem):
            add(family, spec, "pool", checked=True)
        return opts

    def _score(self, problem: Problem, opts: dict) -> None:
        """Appends (lcb of log time, predicted us) to every option."""
        by_family: dict = {}
        for key, o in opts.items():
            by_family.setdefault(o[0], []).append(key)
        for family, keys in by_family.items():
            mu, sd = self.model.predict_log(family, [opts[k][1] for k in keys], problem)
            for key, m, s in zip(keys, mu, sd):
                fails, n = self.fails.get(key, (0, 0))
                risk = math.log1p(3.0 * fails / (n + 1))
                opts[key] += [float(m - self.beta * s + risk), float(math.exp(m))]

    def propose(self, problem: Problem, k: int) -> list[Candidate]:
        if k <= 0:
            return []
        opts = self._options(problem)
        if not opts:
            return []
        self._score(problem, opts)
        ranked = sorted(opts, key=lambda key: (opts[key][3], key))
        chosen: list = []

        def take(keys, n, origin=None):
            for key in keys:
                if n <= 0 or len(chosen) >= k:
                    return
                if key not in chosen:
                    chosen.append(key)
                    n -= 1
                    if origin:
                        opts[key][2] = origin

        quota = -(-k // 4)
        take([key for key in opts if opts[key][2] == "prior"], self.prior_top)  # in the prior's order
        take([key for key in ranked if opts[key][2] == "transfer"], quota)
        take([key for key in ranked if opts[key][2] == "mutation"], quota)
        if not self.tried.get(problem):
            for name in self.families:
                take([key for key in ranked if key[0] == name], 1)
        rest = [key for key in ranked if key not in chosen]
        while len(chosen) < k and rest:
            if self.rng.random() < self.epsilon:
                key = rest.pop(self.rng.randrange(len(rest)))
                take([key], 1, "explore")
            else:
                take([rest.pop(0)], 1)
        return [Candidate(opts[key][0], opts[key][1], opts[key][4], opts[key][2]) for key in chosen]
