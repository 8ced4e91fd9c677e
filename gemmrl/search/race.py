"""The final race of a tune: the search ranks candidates by a quick timing (a few rounds each),
which misranks the largest shapes (at 16384^3 the search's best ran 0.64 of cuBLASLt in the
final timing, while its cluster-2x1 twin ran at parity on neighbouring shapes). So, before the
final timing, the shape's top candidates from the search (those within `margin` of the fastest,
at most `k`), the winner that last passed the final verification (the incumbent), and the stored
winner (the search's new best, where the top k left it out), are built,
verified and timed together, in the rounds of the baselines they will be judged beside and with
the judge's protocol (ranked by paired ratios to a baseline; `beside=False`: among themselves, in
the full kernel-mode protocol), and the fastest becomes the stored winner; the final session then
times it beside the baselines. Contenders more than RACE_PRUNE (1.5x) slower than the fastest in a
short pre-pass leave before those rounds (bench.timing.pick_fastest's `prune`): beside them the
fast ones read up to 16% faster than the final timing then finds.

`contenders` is pure (tested on the CPU); `Race` is the implementation the final session runs,
named like the tuner's winner so its records are the winner's."""

from __future__ import annotations

from gemmrl.search.best_of import BestOf


def contenders(trials, k: int, margin: float) -> list:
    """The specs of the fastest passing trials of one shape, fastest first, at most k of them,
    each within `margin` (0.10: 10% slower) of the fastest; each kernel once (the fastest of its
    trials). Trials that did not pass, or whose kernel later failed (a trial of another status
    for the same kernel), are out; so are older trials where the shape has trials timed beside
    its baseline (tune.comparable)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if margin < 0:
        raise ValueError(f"margin must not be negative, got {margin}")
    from gemmrl.search.tune import comparable

    trials = list(trials)
    failed = {t.candidate.key() for t in trials if t.status != "ok"}
    trials = comparable(trials)  # times of one kind: burst-timed trials do not race timed-beside-baseline ones
    best: dict = {}
    for t in trials:
        if t.status != "ok" or t.time_us is None or t.candidate.key() in failed:
            continue
        if t.candidate.key() not in best or t.time_us < best[t.candidate.key()].time_us:
            best[t.candidate.key()] = t
    ranked = sorted(best.values(), key=lambda t: (t.time_us, t.candidate.name))
    if not ranked:
        return []
    limit = ranked[0].time_us * (1.0 + margin)
    return [t.candidate.spec for t in ranked if t.time_us <= limit][:k]


def burst_only(trials, n: int) -> list:
    """The specs of the `n` fastest kernels of one shape whose every trial was timed in a short
    burst (before the shape had trials timed beside its baseline: tune.is_referenced), none of
    which failed; fastest burst time first, each kernel once. `contenders` leaves them out (a burst
    reads up to 30% fast, so their times do not compare), and the search never proposes a kernel
    it has tried: without a race that names them, such kernels are never timed again. Empty on a
    shape with no trial timed beside its baseline (its burst trials are `contenders`' own)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a whole number >= 0, got {n!r}")
    from gemmrl.search.tune import is_referenced

    trials = list(trials)
    if n == 0 or not any(is_referenced(t) for t in trials):
        return []
    out_of = {t.candidate.key() for t in trials if t.status != "ok" or is_referenced(t)}
    best: dict = {}
    for t in trials:
        if t.time_us is None or t.candidate.key() in out_of:
            continue
        if t.candidate.key() not in best or t.time_us < best[t.candidate.key()].time_us:
            best[t.candidate.key()] = t
    ranked = sorted(best.values(), key=lambda t: (t.time_us, t.candidate.name))
    return [t.candidate.spec for t in ranked[:n]]


class Race(BestOf):
    """gemmrl's tuned winner, chosen again per shape by a race of the search's top candidates
    timed with the full kernel protocol; the choice is stored as the winner (`name`)."""

    def __init__(self, store, device: str, k: int = 3, margin: float = 0.10, name: str | None = None,
                 log=None, built_only: bool = False, twins: tuple = (), former: int = 0,
                 exclude: str | None = None, beside: bool = True, burst: int = 0,
                 prune: float | None = None):
        from gemmrl.bench.timing import RACE_PRUNE, KernelSettings, prune_slow
        from gemmrl.search.run import TUNED
        from gemmrl.space import registry

        super().__init__(list(registry.FAMILIES.values()), store=store, device=device, name=name or TUNED,
                         log=log, search=True)
        self.k, self.margin = k, margin
        # built_only (tune --built-only): a generic contender (CUTLASS) races only if its build is
        # in the cache, as the search proposed only those; the fastest, the stored winner, always
        self.built_only = built_only
        # twins: fields (build.ahead.VARIANT_FIELDS) in which each contender's variants race too,
        # e.g. ('pdl',): the same kernel launched as a programmatic dependent (under built_only,
        # only those already built)
        self.twins = tuple(twins)
        # former: the winners that passed the final verification before the incumbent (up to this
        # many, newest first) race too: a round that stored a winner which later ran slower beside
        # the baselines is undone by racing its predecessors again in one session
        if isinstance(former, bool) or not isinstance(former, int) or former < 0:
            raise ValueError(f"former must be a whole number >= 0, got {former!r}")
        self.former = former
        # burst: the N fastest kernels whose only trials on the shape were burst-timed race too
        # (burst_only; beyond those racing already): the search never proposes them again and
        # `contenders` leaves them out
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
            raise ValueError(f"burst must be a whole number >= 0, got {burst!r}")
        self.burst = burst
        # exclude: a regular expression; kernels whose names match never race (not even as the
        # incumbent or a former winner), e.g. a tile whose race times its final timing disowns
        import re

        self.exclude = re.compile(exclude) if exclude else None
        # beside: the contenders race in the rounds of the baselines they will be judged beside, and
        # with the judge's protocol (bench's v3: paired ratios to 0.5%, at most 3 s), ranked by their
        # paired ratio to a baseline. Raced alone in the full protocol's shorter rounds (before
        # 2026-11-27's twenty-seventh session, and with beside=False), an H100 kernel (128x144 at
        # 4096x8192xK) won by 2-3% and then ran 8-16% slower in most rounds beside the baselines
        # (scripts/protocol-gap.py --companies, results/README.md).
        self.beside = beside
        self._baselines = None
        if beside:
            from gemmrl.bench.stats import kernel_precision

            self.settings = KernelSettings(**kernel_precision(False, None, None))
        else:
            self.settings = KernelSettings()  # the final timing's protocol, not the search's quick one
        # prune: contenders more than this many times slower than the fastest in a short pre-pass
        # leave before the timed rounds (bench.timing.RACE_PRUNE, the default: a slow contender's
        # replay lifts the next one's clock, and the race then misreads the fast ones by up to 16%)
        self.prune = RACE_PRUNE if prune is None else prune
        prune_slow({}, self.prune)  # a bad factor fails here, not in the first race

    def specs(self, problem) -> list:
        from gemmrl.search.run import stored_history
        from gemmrl.space import registry

        bad = self.store.quarantined(self.device, problem) if self.store is not None else {}
        trials = [t for t in stored_history(self.store, self.device, [problem]) if t.problem == problem]
        if self.exclude is not None:  # the excluded kernels' trials out: the race's k and margin are of the rest
            trials = [t for t in trials if not self.exclude.search(t.candidate.spec.name)]
            bad = set(bad) | {c["name"] for c in self.store.verified_choices(self.device, problem, self.name)
                              if self.exclude.search(str(c.get("name", "")))}
        from gemmrl.search.run import built_generic_only

        built = built_generic_only() if self.built_only else None
        stored = BestOf._stored(self, problem)
        if built is None:
            out = [s for s in contenders(trials, self.k, self.margin) if s.name not in bad]
        else:
            # the stored winner races though unbuilt (the final timing builds it in any case);
            # any other contender only if built: a race after the search (bench --impl race),
            # where the search's fastest is no longer the stored winner, compiles nothing generic
            ranked = [s for s in contenders(trials, len(trials) or 1, self.margin) if s.name not in bad]
            out = [s for s in ranked if s == stored or built(registry.family_of(s).name, s, problem)][:self.k]
        inc = self.incumbent(problem, trials, bad)
        if inc is not None and inc not in out and (out or self.twins or self.former or self.burst
                                                    or self.exclude is not None):
            out = out + [inc]
        # the stored winner races too: the search stores a new best as it goes, and where an older
        # run's quick trial of the incumbent reads faster than the new best's (trial times of two
        # runs), the top k left the new best out; the final timing then timed it alone and it
        # replaced the incumbent unraced (H200 fp32, runs 618-622: 9 of 58 new winners, one of
        # them 0.983 -> 0.931 of cuBLASLt autotuned)
        failed = {t.candidate.spec.name for t in trials if t.status != "ok"}
        if (stored is not None and out and stored not in out and stored.name not in bad
                and stored.name not in failed):
            out.append(stored)
        if self.former and inc is not None:
            for spec in self.predecessors(problem, trials, bad, inc):
                if spec not in out and (built is None or built(registry.family_of(spec).name, spec, problem)):
                    out.append(spec)
        if self.burst:  # the fastest burst-only kernels not racing already
            extra = [s for s in burst_only(trials, len(trials)) if s not in out and s.name not in bad and (
                built is None or built(registry.family_of(s).name, s, problem))]
            out += extra[:self.burst]
        if self.twins and out:
            from gemmrl.build.ahead import variants

            for spec in list(out):
                for v in variants(spec, problem, self.twins):
                    if v not in out and v.name not in bad and (
                            built is None or built(registry.family_of(v).name, v, problem)):
                        out.append(v)
        if self.exclude is not None:  # the stored winner and the twins too
            out = [s for s in out if not self.exclude.search(s.name)]
        return out

    def company(self, problem) -> dict:
        """The baselines `bench --impl baselines` times (those that serve the problem and prepare),
        as name -> fn for the race's rounds; none unless `beside`."""
        if not self.beside:
            return {}
        if self._baselines is None:
            from gemmrl.baselines.impls import baseline_impls

            self._baselines = baseline_impls(self.store, self.device)
        out = {}
        for impl in self._baselines:
            try:
                if impl.supports(problem):
                    out[impl.name] = impl.prepare(problem)
            except Exception as e:  # a baseline that cannot run here only leaves the race's company
                self.log(f"{problem.shape} race company {impl.name}: {type(e).__name__}: {str(e)[:200]}")
        return out

    def incumbent(self, problem, trials, bad):
        """The kernel that last passed the final verification as the winner: it races too, so a
        new winner must beat it in one session. Quick trial times from different runs do not
        compare (a re-search's variants all looked faster than the winner and left it out of the
        race; the race's pick then ran 3% slower than it beside the same baselines)."""
        failed = {t.candidate.spec.name for t in trials if t.status != "ok"}
        got = verified_spec(self.store, self.device, problem, self.name, set(bad) | failed)
        return None if got is None else got[1]

    def predecessors(self, problem, trials, bad, incumbent) -> list:
        """Up to `former` distinct kernels that passed the final verification as the winner
        before `incumbent`, newest first (none that failed a trial or is quarantined)."""
        failed = {t.candidate.spec.name for t in trials if t.status != "ok"}
        out, seen = [], {incumbent.name} | set(bad) | failed
        for _fam, spec in verified_specs(self.store, self.device, problem, self.name):
            if len(out) == self.former:
                break
            if spec.name not in seen:
                seen.add(spec.name)
                out.append(spec)
        return out

    def _stored(self, problem):
        """Never the stored choice before the race (prepare races, then stores the winner); with
        one contender or none there is nothing to race: the stored winner."""
        specs = self.specs(problem)
        if len(specs) > 1:
            return None
        if self.exclude is not None and specs:  # the one kernel left, not an excluded stored one
            return specs[0]
        stored = super()._stored(problem)
        if specs and stored is not None and specs[0] != stored:
            return None  # the one kernel left is not the stored winner (quarantined, or failed a
            # trial): prepare verifies it, times it and stores it as the winner
        return stored


def unbuilt_incumbents(store, device: str, problems, impl: str | None = None) -> list:
    """(problem, spec) for each shape whose incumbent (the winner that last passed the final
    verification) is a generic kernel (CUTLASS) not in the build cache. The race times the
    incumbent even under --built-only, so each such shape compiles one kernel inside the timed
    step (about 45 s on a device call's core): `gemmrl build --tuned-in DB --device GPU --race K
    --shapes ...` compiles them ahead. Per-shape kernels build in seconds and are left out."""
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.search.run import TUNED

    out = []
    for p in problems:
        got = verified_spec(store, device, p, impl or TUNED)
        if got is None:
            continue
        fam, spec = got
        try:
            unbuilt = fam.generic and not SpecImpl(spec).is_built(p)
        except (OSError, RuntimeError):  # no CUTLASS headers here: the race cannot build it either way
            unbuilt = False
        if unbuilt:
            out.append((p, spec))
    return out


def unbuilt_contenders(store, device: str, problems, k: int = 1, built_only: bool = False) -> dict:
    """problem -> the names of the generic (CUTLASS) kernels a final timing after a search would
    compile for it, as far as the store tells before the search: the race's contenders (Race(k)'s
    specs: the fastest stored trials, the incumbent, the stored winner) and, where nothing races,
    the stored winner the final timing loads; each not in the build cache. A search's own
    candidates are built by the time it ends, so they add none. On the H200 (2026-11-30f) five
    final timings each compiled one or two such kernels, 31-43 s apiece, where the incumbents were
    all built (unbuilt_incumbents saw none). A generic kernel is one build for every shape: the
    names count once across shapes. Without CUTLASS headers nothing can be built here: {}."""
    from gemmrl.runtime.spec_impl import SpecImpl
    from gemmrl.space import registry

    racer = Race(store, device, k=k, built_only=built_only)
    out: dict = {}
    for p in problems:
        specs = list(racer.specs(p))
        stored = BestOf._stored(racer, p)
        if stored is not None and stored not in specs:
            specs.append(stored)
        names = set()
        for spec in specs:
            try:
                if registry.family_of(spec).generic and not SpecImpl(spec).is_built(p):
                    names.add(spec.name)
            except (OSError, RuntimeError):  # no CUTLASS headers here: the race cannot build it either way
                continue
        if names:
            out[p] = frozenset(names)
    return out


def verified_specs(store, device: str, problem, impl: str):
    """(family, spec) of each passed verification in which `impl` chose a kernel for `problem`
    on `device`, newest first, leaving out choices of a family or spec layout this version no
    longer reads."""
    from gemmrl.space import registry

    for chosen in store.verified_choices(device, problem, impl):
        try:
            fam = registry.get(chosen["family"])
            spec = fam.spec_type()(**chosen["spec"])
        except (ValueError, TypeError):
            continue
        yield fam, spec


def verified_spec(store, device: str, problem, impl: str, skip=frozenset()):
    """The newest of verified_specs whose kernel is not named in `skip`; None when there is none."""
    return next(((fam, spec) for fam, spec in verified_specs(store, device, problem, impl)
                 if spec.name not in skip), None)
