"""Candidates after cuBLASLt's own autotuned choice (`tune --seed-from-lt`): the autotuned
baseline stores, per shape and layout, the algorithm it picked out of up to 100 (its tile,
cluster and split-K, in the description `algo=66 tile=29 ... cluster=3`). That choice is the
library's measured answer for the shape on this GPU, so the CUTLASS kernels of the same output
tile and cluster are a prior worth timing first, like another GPU's winners (--transfer-from).
On the H200's fp32 shapes of 2^36 FLOPs or more below 0.98 of it (2026-11-27), it chose tile
128x160 with a 2x1 cluster on 46 of 68 (shape, layout) pairs, a tile our search had tried on 8
of the grid's shapes; on the H100 our swapped 128x160 kernels won those shapes.

cuBLAS is column-major: the harness computes row-major C = A B as C^T = B^T A^T, so its m x n
tile lies m along our N and n along our M, and its cluster likewise. Its faithful twin is our
swapped kernel (swap_ab: the kernel's M is our N) with tile_m = m, tile_n = n and the cluster as
it is; our plain kernel of the same output tile has tile_m = n, tile_n = m and the cluster
turned. Both, in both schedules, wherever the CUTLASS family accepts them for the shape.

A split-K choice (`splitk=S`) has its own twins (lt_split_specs): our split-K kernels of the same
output tile and cluster with S splits. cuBLASLt's `reduction=2` (CUBLASLT_REDUCTION_SCHEME_
COMPUTE_TYPE: the partials in fp32 in a workspace, then a reduction kernel) is our separate
reduction (`splitkSsr`); any other scheme, our in-kernel reduction (`splitkS`). On the H200's fp32
shapes below 0.98 of it (2026-11-28), 56 of the 494 (shape, layout) choices were split-K ones.
Those twins come with cuBLASLt's cluster, then again with a 1x1 cluster (unclustered): on the
H200 our split-K kernels ran faster unclustered."""

from __future__ import annotations

import dataclasses
import functools

FAMILY = "cutlass_sm90"


def lt_specs(tile: tuple[int, int], cluster: tuple[int, int], layout: str, dtype: str = "fp16",
             acc: str = "fp32", problem=None) -> list:
    """The CUTLASS specs of cuBLASLt's (m, n) tile and (m, n) cluster in our orientation: the
    swapped twin first (cooperative, then pingpong), then the plain kernel of the same output
    tile; persistent, default stages, raster and swizzle; only those of the search pool (which
    leaves out legal kernels known to run badly, e.g. the NN forms of 144 and 176 wide tiles)
    that the family accepts (for `problem`, when given), each once. Pure."""
    from gemmrl.space import cutlass_sm90 as cs

    (m, n), (cm, cn) = tile, cluster
    pool = _pool(layout, dtype, acc)
    out, seen = [], set()
    for swap in (True, False):
        tm, tn, clm, cln = (m, n, cm, cn) if swap else (n, m, cn, cm)
        for schedule in ("cooperative", "pingpong"):
            spec = cs.CutlassSpec(tile_m=tm, tile_n=tn, cluster_m=clm, cluster_n=cln, schedule=schedule,
                                  layout=layout, dtype=dtype, acc=acc, swap_ab=swap)
            if spec.name in pool and spec.name not in seen and cs.valid(spec, problem) is None:
                seen.add(spec.name)
                out.append(spec)
    return out


def lt_split_specs(tile: tuple[int, int], cluster: tuple[int, int], splits: int, reduction: int, layout: str,
                   dtype: str = "fp16", acc: str = "fp32", problem=None) -> list:
    """The CUTLASS split-K specs twinning cuBLASLt's split-K choice of (m, n) tile, (m, n)
    cluster and `splits`: the plain kernel of the same output tile (tile and cluster turned),
    then the swapped twin (its faithful one: cuBLASLt's m along our N) where the family allows
    it; each schedule; first with the reduction of cuBLASLt's scheme (its compute-type
    out-of-place scheme, 2: our separate reduction; any other: the in-kernel one), then with
    the other (where the first has no valid form, or as a runner-up); where K does not split into
    `splits` equal aligned chunks, the separate reduction's forms at the nearest split counts that
    do (nearest_even_splits) come last. Not limited to the search
    pool (it holds split-K for a few tiles only); the family's valid() decides, for `problem`
    when given. Pure."""
    from gemmrl.space import cutlass_sm90 as cs

    (m, n), (cm, cn) = tile, cluster
    reds = ("separate", "deterministic") if reduction == 2 else ("deterministic", "separate")
    out, seen = [], set()

    def add(red: str, n_splits: int) -> None:
        for swap in (False, True):
            tm, tn, clm, cln = (m, n, cm, cn) if swap else (n, m, cn, cm)
            for schedule in ("cooperative", "pingpong"):
                try:
                    spec = cs.CutlassSpec(tile_m=tm, tile_n=tn, cluster_m=clm, cluster_n=cln, schedule=schedule,
                                          scheduler="splitk", splits=n_splits, layout=layout, dtype=dtype, acc=acc,
                                          reduction=red, swap_ab=swap)
                except (TypeError, ValueError):
                    continue
                if spec.name not in seen and cs.valid(spec, problem) is None:
                    seen.add(spec.name)
                    out.append(spec)

    for red in reds:
        add(red, splits)
    if problem is not None and not any(cs.separate(s) for s in out):
        # the separate reduction cuts K into equal 16-byte-aligned chunks, so cuBLASLt's uneven
        # splits (3, 5, 9 or 12 of K = 4096-16384: 82 of the 116 H200 fp32 shapes it runs split-K,
        # 2026-11-29) have no twin of its tile and cluster with it: the nearest split counts that
        # do divide K, one below and one above, within a third of S, follow as runners-up
        for near in nearest_even_splits(problem.K, splits):
            add("separate", near)
    return out


def unclustered(specs, problem=None) -> list:
    """The 1x1-cluster twins of the split-K specs among `specs` whose cluster is wider (the same
    tile, schedule, split count, reduction and swap), in their order, each once and none already
    in `specs`; the family's valid() decides, for `problem` when given. A split-K CTA does one
    K-slice of its tile, and sharing operand loads across a cluster did not pay for it on the
    H200: in run 644's race of split-K winners against their cluster shapes, 15 of the 16 winners
    that changed only their cluster went from 1x2, 2x1 or 4x1 to 1x1 (geomean 1.064x). cuBLASLt's
    split-K choices name wide clusters, so their twins (lt_split_specs) follow them: lt_prior
    offers these after them. Pure."""
    from gemmrl.space import cutlass_sm90 as cs

    seen = {s.name for s in specs}
    out = []
    for spec in specs:
        if spec.scheduler != "splitk" or (spec.cluster_m, spec.cluster_n) == (1, 1):
            continue
        twin = dataclasses.replace(spec, cluster_m=1, cluster_n=1)
        if twin.name not in seen and cs.valid(twin, problem) is None:
            seen.add(twin.name)
            out.append(twin)
    return out


def nearest_even_splits(K: int, splits: int) -> list[int]:
    """The split counts nearest `splits` that cut K into equal chunks on 16-byte boundaries
    (what the separate reduction needs), the nearest below and the nearest above, each within
    ceil(splits / 3) of it and in 2..MAX_SEPARATE_SPLITS; none where `splits` itself does. Pure."""
    from gemmrl.space import cutlass_sm90 as cs

    align = cs.TMA_ALIGN_ELEMS
    if K % (splits * align) == 0:
        return []
    reach = -(-splits // 3)
    ok = [s for s in range(max(2, splits - reach), min(cs.MAX_SEPARATE_SPLITS, splits + reach) + 1)
          if K % (s * align) == 0]
    below = [s for s in ok if s < splits]
    above = [s for s in ok if s > splits]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _parse(info: str, tiles: dict, clusters: dict) -> tuple | None:
    """((m, n) tile, (m, n) cluster, splits, reduction scheme) of a stored autotuned choice's
    description, or None where it names no tile and cluster these tables know. Pure."""
    from gemmrl.baselines.cublas import parse_description

    d = parse_description(info or "")
    tile, cluster = tiles.get(d.get("tile")), clusters.get(d.get("cluster"))
    if tile is None or cluster is None:
        return None
    return tile, cluster, int(d.get("splitk", 1)), int(d.get("reduction", 0))


def parse_split_choice(info: str, tiles: dict, clusters: dict) -> tuple | None:
    """((m, n) tile, (m, n) cluster, splits, reduction scheme) of a stored split-K autotuned
    choice; None for any other (parse_choice reads those) or one whose tile or cluster the tables
    do not know. Pure."""
    got = _parse(info, tiles, clusters)
    return got if got is not None and got[2] > 1 else None


@functools.lru_cache(maxsize=16)
def _pool(layout: str, dtype: str, acc: str) -> frozenset:
    """The names of the CUTLASS search pool's specs of a layout, swapped twins included."""
    from gemmrl.space import cutlass_sm90 as cs

    specs = cs.enumerate_specs(layout, dtype, acc)
    return frozenset(s.name for s in specs + cs.swapped_twins(specs))


def parse_choice(info: str, tiles: dict, clusters: dict) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((m, n) tile, (m, n) cluster) of a stored autotuned choice's description, or None where it
    names no tile and cluster these tables know, or a split-K one (our plain persistent kernels
    are no twin of it: parse_split_choice). Pure."""
    got = _parse(info, tiles, clusters)
    return got[:2] if got is not None and got[2] <= 1 else None


def lt_prior(store, device: str, problems, tiles: dict, clusters: dict, layouts=("NN", "TN")) -> dict:
    """{problem: [(family, spec), ...]} for tune's policy (add_prior): per problem, the specs of
    the autotuned cuBLASLt choices stored on `device` for each of `layouts` (lt_specs; a split-K
    choice's twins, then their 1x1-cluster twins), all with the problem's accumulator. The
    choices read are those of the problem's own accumulator first (an fp16-accumulator baseline
    runs cuBLASLt with CUBLAS_COMPUTE_16F, and its autotuning stores its own pick), then the
    fp32-accumulator ones (choice_accs). Each spec once; problems with no usable stored choice
    are left out."""
    out: dict = {}
    for problem in problems:
        suggestions, seen = [], set()
        for acc in choice_accs(problem.acc):
            for layout in layouts:
                for spec in _choice_specs(store, device, problem, layout, acc, tiles, clusters):
                    if spec.name not in seen:
                        seen.add(spec.name)
                        suggestions.append((FAMILY, spec))
        if suggestions:
            out[problem] = suggestions
    return out


def choice_accs(acc: str) -> tuple[str, ...]:
    """The accumulators whose stored cuBLASLt choices seed a problem of accumulator `acc`, in the
    order lt_prior offers them: its own, then fp32's. Before 2026-12-01 an fp16 problem read only
    the fp32 choices: on the H200's three largest fp16 rows under 0.98 of cuBLASLt autotuned, the
    fp16 autotuning had picked tile 128x256 with a 2x1 cluster on NN, whose twins no trial had
    tried, where the fp32 picks were 192x192, 128x160 and 256x96. Pure."""
    return (acc,) if acc == "fp32" else (acc, "fp32")


def _choice_specs(store, device: str, problem, layout: str, acc: str, tiles: dict, clusters: dict) -> list:
    """The specs (the problem's accumulator) of the cuBLASLt choice stored on `device` for the
    problem's shape and dtype, `layout`, by the baseline of accumulator `acc`: lt_specs of a
    plain choice, lt_split_specs and then their unclustered twins of a split-K one; [] where none
    is stored or the tables do not know its tile or cluster."""
    from gemmrl.runtime.pack import LT_IMPL

    row = store.db.execute(
        "SELECT info FROM tuning WHERE device=? AND M=? AND N=? AND K=? AND dtype=? AND acc=? AND impl=?",
        (device, problem.M, problem.N, problem.K, problem.dtype, acc, LT_IMPL.format(layout.lower()))).fetchone()
    got = _parse(row[0], tiles, clusters) if row else None
    if got is None:
        return []
    if got[2] <= 1:
        return lt_specs(*got[:2], layout, problem.dtype, problem.acc, problem)
    split = lt_split_specs(*got, layout, problem.dtype, problem.acc, problem)
    return split + unclustered(split, problem)


def lt_devices(store) -> list[str]:
    """The GPUs with a stored autotuned cuBLASLt choice in either layout (what lt_prior reads)."""
    from gemmrl.runtime.pack import LT_IMPL

    return sorted({d for lay in ("nn", "tn") for d in store.tuned_devices(LT_IMPL.format(lay))})


def untried(prior: dict, store, device: str) -> dict:
    """{problem: suggestions} of `prior` less those `device` has a trial of on that problem, in
    their order; problems with none left are left out. On a shape it has searched, tune offers
    the first suggestions not tried there yet (policy._options): what to compile or list."""
    tried: dict = {}
    for row in store.trials(device, list(prior)):
        tried.setdefault((row["M"], row["N"], row["K"], row["dtype"], row["acc"]), set()).add(row["candidate"])
    return {p: left for p, sugg in prior.items()
            if (left := [(f, s) for f, s in sugg if s.name not in tried.get(p.key(), ())])}
