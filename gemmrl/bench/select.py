"""Implementations from their command-line names (also how a worker process rebuilds them)."""

from __future__ import annotations


def impls_from_specs(specs, store=None, device: str = "", include_dirs=()) -> list:
    """Implementation specs: 'baselines' (torch + cuBLAS + cuBLASLt heuristic/auto-tuning, both
    layouts), 'exhaustive', 'torch.compile', a baseline's own name, 'cuda-l2:DIR',
    'kernel:FILE.cu|FILE.so', 'pack:DIR[@nearest=D]' (gemmrl.matmul with that pack active, NN and
    TN, fallback included: the product as a user calls it; with torch.matmul-tn, torch on the TN
    layout; D: how far a neighbour's kernel may serve an unseen shape, use_pack's `nearest`, a
    number >= 0 or inf), or gemmrl's own kernels: 'gemmrl:FAMILY[+FAMILY]' (the fastest of
    each family's top candidates per shape; families: cutlass_sm90, raw), 'ours' (both) and
    'tuned' (the winners `gemmrl tune` stored) or 'race[:K[:built]]' (the tuned winner chosen again
    by a race of the search's top K candidates, default 3, timed beside the baselines in bench's
    kernel protocol and ranked by paired ratios; stored; ':built': generic contenders only if
    already built; ':alone': the contenders race among themselves in the full kernel protocol
    (the rule before 2026-11-27's twenty-seventh session); ':pdl': each contender's programmatic-
    dependent-launch twin races too)."""
    from gemmrl.baselines import impls as bl

    all_named = {i.name: i for i in bl.baseline_impls(store, device, exhaustive=True, compile_=True,
                                                        extra=True)}
    out = []
    for spec in specs:
        for s in (x.strip() for x in spec.split(",") if x.strip()):
            if s == "baselines":
                out += bl.baseline_impls(store, device)
            elif s == "exhaustive":
                out += [i for i in all_named.values() if "exhaustive" in i.name]
            elif s in all_named:
                out.append(all_named[s])
            elif s.startswith("cuda-l2:"):
                from gemmrl.baselines.cuda_l2 import CudaL2Impl

                out.append(CudaL2Impl(s.split(":", 1)[1]))
            elif s.startswith("gemmrl:") or s == "ours":
                from gemmrl.search.best_of import BestOf
                from gemmrl.space import registry

                names = "cutlass_sm90+raw" if s == "ours" else s.split(":", 1)[1]
                fams = [registry.get(n) for n in names.split("+")]
                out.append(BestOf(fams, store=store, device=device, log=_log_stderr))
            elif s == "tuned":
                from gemmrl.search.best_of import BestOf
                from gemmrl.search.run import TUNED
                from gemmrl.space import registry

                out.append(BestOf(list(registry.FAMILIES.values()), store=store, device=device,
                                  name=TUNED, search=False, log=_log_stderr))
            elif s == "race" or s.startswith("race:"):
                from gemmrl.search.race import Race

                parts = s.split(":")
                k = parts[1] if len(parts) > 1 else "3"
                opts = parts[2:]
                from gemmrl.build.ahead import VARIANT_FIELDS

                former = [o for o in opts if o.startswith("former")]
                burst = [o for o in opts if o.startswith("burst")]
                exclude = [o[4:] for o in opts if o.startswith("not=")]
                if not k.isdigit() or int(k) < 1 or len(set(opts)) < len(opts) or len(former) > 1 or (
                        len(burst) > 1) or (
                        set(opts) - {"built", "alone", *VARIANT_FIELDS, *former, *burst,
                                     *(f"not={x}" for x in exclude)}) or (
                        former and not (former[0] == "former" or former[0][6:].isdigit())) or (
                        burst and not (burst[0] == "burst" or (burst[0][5:].isdigit() and int(burst[0][5:]) >= 1))) or (
                        len(exclude) > 1 or (exclude and not _is_regex(exclude[0]))):
                    raise ValueError(f"race:K[:built][:alone][:formerN][:burstN][:not=REGEX][:FIELD...] needs a positive "
                                     f"whole number of contenders, then optionally 'built', 'alone' (the "
                                     f"contenders race among themselves, not beside the baselines), 'formerN' (the N winners "
                                     f"before the incumbent race too; 'former': 2), 'burstN' (the N fastest kernels "
                                     f"whose only trials were burst-timed race too; 'burst': 2), 'not=REGEX' (kernels whose "
                                     f"names match never race) and variant fields ({', '.join(VARIANT_FIELDS)}); "
                                     f"got {s!r}")
                # twins: each contender's variants in those fields, e.g. 'pdl' (its programmatic-
                # dependent twin), 'lean' (its one-tile-per-CTA ones), 'epi' (wider epilogue subtiles)
                n_former = (int(former[0][6:]) if former[0][6:] else 2) if former else 0
                n_burst = (int(burst[0][5:]) if burst[0][5:] else 2) if burst else 0
                out.append(Race(store, device, k=int(k), log=_log_stderr, built_only="built" in opts,
                                twins=tuple(o for o in VARIANT_FIELDS if o in opts), former=n_former, burst=n_burst,
                                exclude=exclude[0] if exclude else None, beside="alone" not in opts))
            elif s.startswith("pack:"):
                from gemmrl.runtime.pack_impl import PackMatmul

                path, nearest = _pack_spec(s)
                # with torch.matmul-tn: each layout of the product against torch on that layout
                out += [PackMatmul(path, lay, nearest=nearest) for lay in ("NN", "TN")]
                out.append(all_named["torch.matmul-tn"])
            elif s.startswith("kernel:"):
                from gemmrl.runtime.abi import AbiImpl

                out.append(AbiImpl(s.split(":", 1)[1], include_dirs=tuple(include_dirs)))
            else:
                raise ValueError(
                    f"unknown implementation {s!r}; known: baselines, exhaustive, "
                    f"{', '.join(all_named)}, cuda-l2:DIR, kernel:FILE, pack:DIR[@nearest=D], gemmrl:FAMILY, ours, tuned, "
                    f"race[:K[:built][:alone][:FIELD...]]")
    seen, unique = set(), []
    for i in out:
        if i.name not in seen:
            seen.add(i.name)
            unique.append(i)
    return unique


def _is_regex(text: str) -> bool:
    import re

    try:
        re.compile(text)
    except re.error:
        return False
    return bool(text)


def _pack_spec(s: str) -> tuple[str, float | None]:
    """'pack:DIR[@nearest=D]' -> (DIR, D or None for use_pack's default)."""
    rest = s.split(":", 1)[1]
    path, sep, value = rest.rpartition("@nearest=")
    if not sep:
        return rest, None
    try:
        nearest = float(value)
    except ValueError:
        nearest = float("nan")
    if not nearest >= 0:  # also refuses NaN
        raise ValueError(f"{s!r}: @nearest= needs a distance >= 0 (inf: any), got {value!r}")
    return path, nearest


def _log_stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)

