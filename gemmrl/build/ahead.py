"""Compile ahead of time, on any machine with nvcc and no GPU: the candidate kernels a set of
shapes will try, deduplicated by source (a generic family's spec is one build for every shape),
into the content-hash cache. A cache built here and copied to the GPU machine (same nvcc and
CUTLASS version, wherever its headers are installed) saves the GPU's time: CUTLASS kernels take
about a minute each to compile."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildJob:
    name: str
    source: str
    kwargs: dict  # build_shared keyword arguments: arch, include_dirs, extra_flags

    def as_tuple(self) -> tuple[str, str, dict]:
        return self.name, self.source, self.kwargs


def job_for(spec, problem) -> BuildJob:
    """What SpecImpl(spec).prepare(problem) compiles."""
    from gemmrl.runtime.spec_impl import SpecImpl

    impl = SpecImpl(spec)
    return BuildJob(spec.name, impl.source(problem), {"arch": impl.arch, **impl.family.build_kwargs()})


def pack_job(pack, entry, arch: str | None = None) -> BuildJob:
    """The build of one entry of a loaded pack (runtime.pack.load_pack), for `arch` (default the
    pack's): named and flagged as the search builds it (SpecImpl), so the tuning machine's cache,
    an ahead-of-time one and the runtime's are the same."""
    from gemmrl.space import registry

    return BuildJob(entry.spec_name, pack.source(entry),
                    {"arch": arch or pack.arch, **registry.get(entry.family).build_kwargs()})


def plan_pack(pack, entries=None) -> list[BuildJob]:
    """What Dispatcher.build_all compiles for a loaded pack: each kernel source once; of
    `entries` alone where given (those serving the shapes a bench will load)."""
    return unique(pack_job(pack, e) for e in (pack.entries if entries is None else entries))


def unique(jobs) -> list[BuildJob]:
    """Each source once, in first-seen order (a generic family's spec is one build for every shape)."""
    seen, out = set(), []
    for job in jobs:
        if job.source not in seen:
            seen.add(job.source)
            out.append(job)
    return out


def plan(problems, families, layouts=("NN", "TN"), top: int = 4) -> list[BuildJob]:
    """The builds for each family's top `top` candidates per problem and layout, each source
    once, in first-seen order."""
    return unique(job_for(spec, p) for p in problems for fam in families for layout in layouts
                  for spec in fam.candidates(p, layout, top))


def plan_match(problems, families, layouts=("NN", "TN"), top: int = 4, pattern: str = "") -> list[BuildJob]:
    """The builds a search restricted to kernel names matching `pattern` (re.search; `tune
    --match`) would try: per problem, family and layout, the search pool's valid specs whose
    names match, the family's cost model's fastest first (pool order where it has none), at
    most `top`; each source once, in first-seen order."""
    import re

    from gemmrl.search.policy import candidate_pool

    rx = re.compile(pattern)
    out = []
    for p in problems:
        for fam in families:
            estimate = getattr(fam.mod(), "estimate_us", None)
            for layout in layouts:
                specs = [s for _, s in candidate_pool(p, (layout,), (fam.name,)) if rx.search(s.name)]
                if estimate is not None:
                    specs.sort(key=lambda s: (estimate(s, p), s.name))
                out.extend(job_for(s, p) for s in specs[:top])
    return unique(out)


def pending(jobs: list[BuildJob]) -> list[BuildJob]:
    """The jobs whose result is not in the cache yet."""
    from gemmrl.build.nvcc import is_built

    return [j for j in jobs if not is_built(j.source, name=j.name, **j.kwargs)]


def entries(jobs: list[BuildJob]) -> list[str]:
    """Each job's build-cache directory relative to the cache root ("builds/<name>-<key>"), built
    or not: the list a packer takes to carry exactly these builds."""
    from gemmrl.build.nvcc import cache_entry

    return [f"builds/{cache_entry(j.source, name=j.name, **j.kwargs).name}" for j in jobs]


# the CUTLASS fields a search restricted to built kernels (tune --built-only) never moved: the
# ahead-of-time builds were each family's heuristic candidates, all with CUTLASS's own raster
# order, swizzle 1 and as many stages as fit
# ... and 'lean': the one-tile-per-CTA kernel with the spec's tile (cutlass_sm90.lean_twins), which
# the search's pool holds for seven small tiles only
# ... and 'epi': the TMA epilogue's subtile width (spec field epi_n), which the pool never sets
# ... and 'splits': a split-K kernel's neighbouring split counts (cutlass_sm90.SPLIT_COUNTS). The
# cuBLASLt seeds' winners (H200, run 634) took the autotuned choice's tile and cluster with its
# split count or the nearest that divides K, untried beside them: cuBLASLt picks 2-12 splits where
# our earlier winners had 8-16 (results/h200/lt-profile-splitk-2026-11-29d.md)
# ... and 'resident': the lean kernels with few stages, two or more blocks to an SM
# (cutlass_sm90.resident_twins), which no search or race had tried: every lean kernel took as
# many stages as fit
VARIANT_FIELDS = ("raster", "swizzle", "stages", "epilogue", "pdl", "cluster", "lean", "epi", "splits", "resident")
EPI_WIDTHS = (64, 96, 128, 192, 256)  # the 'epi' variants: those that divide the tile's width


def variants(spec, problem, fields=VARIANT_FIELDS) -> list:
    """A CUTLASS spec's neighbours one field away, in `fields`: the other raster orders, the
    other swizzle sizes, one or two stages fewer than fit (explicit counts), and the other
    epilogue (TMA store or registers to global), the other launch (programmatic dependent or
    not), the other cluster shapes (a split-K kernel's wide ones too), the lean one-tile-per-CTA
    kernels of the same tile, the TMA epilogue's wider subtiles (EPI_WIDTHS that divide the
    tile, and auto), a split-K kernel's
    nearest split counts down and up that `problem` takes (SPLIT_COUNTS, more than one: the
    separate reduction needs K in multiples of 8 x splits), the lean kernels with as few stages
    as K needs, two or more blocks to an SM (resident); only those the family accepts for
    `problem`.
    Other families: none."""
    from dataclasses import replace

    from gemmrl.space import cutlass_sm90 as cs

    if not isinstance(spec, cs.CutlassSpec):
        return []
    bad = set(fields) - set(VARIANT_FIELDS)
    if bad:
        raise ValueError(f"variant fields are {', '.join(VARIANT_FIELDS)}; got {', '.join(sorted(bad))}")
    out = []
    if "raster" in fields:
        out += [replace(spec, raster=r) for r in cs.RASTERS if r != spec.raster]
    if "swizzle" in fields:
        out += [replace(spec, swizzle=w) for w in cs.SWIZZLES if w != spec.swizzle]
    if "stages" in fields:
        n = cs.pipeline_stages(spec)
        out += [replace(spec, stages=k) for k in (n - 1, n - 2) if k >= 2 and k != spec.stages]
    if "epilogue" in fields:
        out += [replace(spec, epilogue=e) for e in cs.EPILOGUES if e != spec.epilogue]
    if "pdl" in fields:
        out.append(replace(spec, pdl=not spec.pdl))
    if "cluster" in fields:  # split-K kernels: the wide clusters too (cuBLASLt's 2-8 CTA clusters won
        # as seeds on the H200's split-K shapes, run 634: 4x1, 1x4, 2x4 and 4x2 among them)
        shapes = cs.CLUSTERS + (cs.WIDE_CLUSTERS if spec.scheduler == "splitk" else ())
        out += [replace(spec, cluster_m=cm, cluster_n=cn) for cm, cn in shapes
                if (cm, cn) != (spec.cluster_m, spec.cluster_n)]
    if "lean" in fields:
        out += cs.lean_twins(spec)
    if "epi" in fields and spec.epilogue == "tma":
        out += [replace(spec, epi_n=w) for w in (0,) + EPI_WIDTHS
                if w != spec.epi_n and (w == 0 or spec.tile_n % w == 0)]
    if "resident" in fields and problem is not None:  # its stage count follows the problem's K
        out += cs.resident_twins(spec, problem)
    if "splits" in fields and spec.scheduler == "splitk":
        for side in ([k for k in reversed(cs.SPLIT_COUNTS) if 1 < k < spec.splits],
                     [k for k in cs.SPLIT_COUNTS if k > spec.splits]):
            out += [v for v in (replace(spec, splits=k) for k in side) if cs.valid(v, problem) is None][:1]
    return [v for v in out if cs.valid(v, problem) is None]


def plan_tuned(choices, families=None, variant_fields=()) -> tuple[list[BuildJob], list[str]]:
    """The builds of stored winners (Store.tuned_choices rows: device, problem, family name, spec
    fields), each source once, limited to `families` (names) if given, and with `variant_fields`
    each CUTLASS winner's variants() too (for a search around the winners); and a line for each
    choice that names an unknown family or spec fields the family no longer reads."""
    from gemmrl.space import registry

    out, skipped = [], []
    for _device, problem, fam_name, fields in choices:
        if families is not None and fam_name not in families:
            continue
        try:
            fam = registry.get(fam_name)
            spec = fam.spec_type()(**fields)
        except (ValueError, TypeError) as e:
            skipped.append(f"{problem.shape} ({problem.acc}): {fam_name}: {e}")
            continue
        out += [job_for(s, problem) for s in [spec] + (variants(spec, problem, variant_fields) if variant_fields else [])]
    return unique(out), skipped


def plan_transfer(prior: dict, top: int, families=None) -> list[BuildJob]:
    """The builds of what `tune --transfer-from` proposes first on each shape: the first `top`
    suggestions of search.run.store_prior (problem -> [(family, spec)], best first), limited to
    `families` (names) if given; each source once."""
    return unique(job_for(spec, problem) for problem, suggestions in prior.items()
                  for family, spec in [x for x in suggestions if families is None or x[0] in families][:top])


def plan_race(store, choices, k: int, families=None, former: int = 0, burst: int = 0) -> list[BuildJob]:
    """The builds a race of `k` (search.race.Race, `bench --impl race:K[:formerN][:burstN]`)
    compiles on each chosen shape (Store.tuned_choices rows): the shape's fastest stored trials
    within the race's margin, the incumbent winner, the `former` winners before it and the
    `burst` fastest burst-only kernels, limited to `families` (names) if given; each source once."""
    from gemmrl.search.race import Race
    from gemmrl.space import registry

    return unique(job_for(spec, problem) for device, problem, _fam, _fields in choices
                  for spec in Race(store, device, k=k, former=former, burst=burst).specs(problem)
                  if families is None or registry.family_of(spec).name in families)
