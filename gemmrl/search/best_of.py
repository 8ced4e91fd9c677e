"""The simplest search: build a family's top candidates for a problem, time them together, keep
the fastest. As an implementation ("gemmrl-<family>") it is gemmrl's best kernel of that family
for each shape; the choice is stored, so every mode and later run uses the same kernel."""

from __future__ import annotations

import json

from gemmrl.core.impl import Impl, UnsupportedProblem
from gemmrl.runtime.spec_impl import SpecImpl
from gemmrl.space.registry import Family


class BestOf(Impl):
    trusted = False

    def __init__(self, families: list[Family], layouts=("NN", "TN"), top: int = 4, store=None,
                 device: str = "", name: str | None = None, log=None, search: bool = True):
        self.families, self.layouts, self.top = families, tuple(layouts), top
        self.store, self.device = store, device
        self.name = name or "gemmrl-" + "+".join(f.name for f in families)
        self.layout = "both"
        self.chosen: SpecImpl | None = None
        self.log = log or (lambda m: None)
        self.search = search  # False: only the stored choice (e.g. the tuner's winner), never a new search
        self.settings = None  # the kernel-mode protocol candidates are raced with (None: the quick one)
        self.prune = None  # pick_fastest's prune: candidates this many times slower leave after a pre-pass

    def specs(self, problem) -> list:
        """The top candidates of every family and layout, minus those quarantined on this
        problem (they crashed or hung here before)."""
        bad = self.store.quarantined(self.device, problem) if self.store is not None else {}
        out = []
        for fam in self.families:
            for lay in self.layouts:
                out += [s for s in fam.candidates(problem, lay, self.top) if s.name not in bad]
        return out

    def build_jobs(self, problems) -> list[list[tuple[str, str, dict]]]:
        """Per problem, in order, the (name, source, build options) of the kernels it will try
        that no earlier problem of the list needs (a generic family's spec builds once for all
        shapes: same source, same cache entry). Built or not: prebuild's work, or a caller's
        plan of it (bench's slices)."""
        seen, out = set(), []
        for p in problems:
            mine = []
            stored = self._stored(p)
            for spec in ([stored] if stored is not None else [] if not self.search else self.specs(p)):
                impl = SpecImpl(spec)
                src = impl.source(p)
                if src in seen:
                    continue
                seen.add(src)
                mine.append((spec.name, src, {"arch": impl.arch, **impl.family.build_kwargs()}))
            out.append(mine)
        return out

    def prebuild(self, problems, jobs: int | None = None, log=print, plan=None) -> None:
        """Compile every candidate the problems will try, in parallel, before any timing; `plan`:
        their build_jobs, where the caller has them already."""
        from gemmrl.build.pool import build_many

        work = [w for mine in (self.build_jobs(problems) if plan is None else plan) for w in mine]
        if not work:
            return
        log(f"{self.name}: building {len(work)} candidate kernels")
        results = build_many(work, workers=jobs)
        bad = [(w[0], r) for w, r in zip(work, results) if not r.ok]
        cached = sum(1 for r in results if r.ok and r.cached)
        log(f"{self.name}: {len(work) - len(bad)} built ({cached} of them in the cache already), {len(bad)} failed")
        for name, r in bad[:5]:
            log(f"  {name}: {r.log[-400:]}")

    def _stored(self, problem):
        """The stored choice. Without a search of its own (bench --impl tuned), where a run was
        cut between its search and its final timing (the stored choice differs from the kernel
        the newest passed verification chose), that verified kernel: the one the pack ships, not
        a quick trial's pick that no race or final timing has seen (H200, run 271: such picks ran
        8-16% slower than the kernels they displaced)."""
        if self.store is None:
            return None
        got = self.store.get_tuning(self.device, problem, self.name)
        if got is None:
            return None
        d = json.loads(bytes(got["choice"]).decode())
        if not self.search:
            from gemmrl.runtime.pack import verified_differs

            ver = self.store.verified_choices(self.device, problem, self.name)
            if ver and verified_differs(d, ver[0]) and any(f.name == ver[0]["family"] for f in self.families):
                self.log(f"{problem.shape}: the stored {self.name} choice awaits its final verification "
                         f"(a cut run); timing the verified {ver[0].get('name', ver[0]['family'])}")
                d = ver[0]
        fam = next(f for f in self.families if f.name == d["family"])
        return fam.spec_type()(**d["spec"])

    def prepare(self, problem):
        from gemmrl.bench.timing import pick_fastest

        spec = self._stored(problem)
        if spec is not None:
            self.chosen = SpecImpl(spec)
            return self.chosen.prepare(problem)
        if not self.search:
            raise UnsupportedProblem(f"{self.name}: nothing tuned for {problem.shape} on this device")
        from gemmrl.bench.worker import beat, stop_if_context_lost
        from gemmrl.verify.checks import verify

        impls, calls = {}, {}
        for spec in self.specs(problem):
            impl = SpecImpl(spec)
            beat(f"candidate:{spec.name}")  # if this candidate kills the process, it is the one
            try:
                fn = impl.prepare(problem)
                r = verify(impl, problem, fn=fn, trace=False)
            except Exception as e:  # a candidate that does not build or load is skipped
                self.log(f"{problem.shape} {spec.name}: {type(e).__name__}: {str(e)[:200]}")
                stop_if_context_lost(f"candidate {spec.name} on {problem.shape}")
                continue
            if not r.passed:
                self.log(f"{problem.shape} {spec.name}: rejected: {r.reason[:200]}")
                stop_if_context_lost(f"candidate {spec.name} on {problem.shape}")
                continue
            calls[spec.name], impls[spec.name] = fn, impl
        beat(f"impl:{self.name}")
        if not calls:
            raise UnsupportedProblem(f"{self.name}: no candidate built and verified for {problem.shape}")
        company = self.company(problem) if len(calls) > 1 else {}
        try:
            best, res = pick_fastest(problem, calls, **({"settings": self.settings} if self.settings else {}),
                                     company=company, prune=self.prune)
        except RuntimeError as e:
            raise UnsupportedProblem(f"{self.name}: {e}") from None
        from gemmrl.bench.timing import rank_times

        ranked = rank_times(res, {n: r["median_us"] for n, r in res.items()
                                  if n in calls and r.get("status") == "ok"}, company)
        paired = any(res.get(n, {}).get("details", {}).get("paired") for n in company)
        beside = f", beside {len(company)} baselines{', by paired ratios' if paired else ''}" if company else ""
        self.log(f"{problem.shape} candidates (median us{beside}): "
                 + ", ".join(f"{n}={ranked[n]:.2f}" if n in ranked else _unranked(n, res[n])
                             for n in sorted((n for n in res if n in calls), key=lambda n: ranked.get(n, 1e18))))
        self.chosen = impls[best]
        if self.store is not None:
            choice = json.dumps({"family": self.chosen.family.name, "spec": dict(self.chosen.spec.__dict__)},
                                sort_keys=True).encode()
            self.store.put_tuning(self.device, problem, self.name, choice,
                                  f"{best} (best of {sum(r.get('status') == 'ok' for r in res.values())}/{len(calls)})",
                                  res[best]["median_us"])
        return calls[best]

    def company(self, problem) -> dict:
        """name -> fn of implementations timed beside the candidates but never chosen (none here;
        a Race times its contenders beside the baselines)."""
        return {}

    def own_kernels(self):
        return self.chosen.own_kernels() if self.chosen else None

    def describe(self) -> dict:
        return {"name": self.name, "chosen": self.chosen.describe() if self.chosen else None}


def _unranked(name: str, rec: dict) -> str:
    """A candidate the race did not rank, for its log line: how far behind a pruned one was, or its
    status."""
    if rec.get("status") == "pruned":
        return f"{name}=pruned ({rec.get('median_us', float('nan')):.2f}, {rec['details']['pruned_ratio']:.2f}x)"
    return f"{name}={rec.get('status')}"
