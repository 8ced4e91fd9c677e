"""Packs: the tuned kernels of one (GPU, dtype, accumulator), as files another machine can use.

A pack is a directory:
    manifest.json   stamp (where and with what it was tuned) and one entry per (M, N, K, layout):
                    the winning spec (family + fields), its source's sha256 and file, and the
                    measured kernel time beside the best baseline's
    kernels/*.cu    one source per distinct kernel; a generic (CUTLASS) spec that wins many
                    shapes is one file shared by all of them, a raw kernel is one file per shape
Sources, not binaries: the importing machine compiles each on first use (build_shared's content
cache) or ahead of time (Dispatcher.build_all). A pack is written to a temp dir and moved into
place with os.replace, so a reader sees a whole pack or none.

What goes in: for every problem whose stored gemmrl winner (tuning rows of impls 'gemmrl-*')
passed verification on the device, and, when kernel-mode measurements exist, was at least
`min_speedup` times faster than the best baseline measured beside it (by the median over the
sessions since it was chosen, where there are several; a winner with one session is left out
when that session's baselines ran more than BASELINE_DRIFT slower than the same baselines in the
shape's other sessions: a slow library session alone must not ship a kernel). When several gemmrl impls
won the same (problem, layout), the fastest measured one is kept.

`load_pack` trusts nothing: every field, family, spec and file hash is checked, and all problems
are reported together. `Pack.check_stamp` refuses a pack tuned on another GPU model (or another
CUDA major, or another gemmrl minor version), unless forced: tuning data is only valid where it
was measured.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gemmrl.core.problem import ACCS, DTYPES, LAYOUTS, Problem, ProblemError
from gemmrl.space import registry

FORMAT = "gemmrl-pack"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNEL_DIR = "kernels"
GEMMRL_IMPL_PREFIX = "gemmrl-"
_ENTRY_KEYS = ("M", "N", "K", "dtype", "acc", "layout", "family", "spec", "spec_name",
               "source_sha256", "file")


class PackError(ValueError):
    """A pack that cannot be written, read or used; the message names what is wrong."""


class StampError(PackError):
    """A pack tuned somewhere else (another GPU model, CUDA major or gemmrl version)."""


@dataclass(frozen=True)
class PackEntry:
    problem: Problem
    layout: str
    family: str
    spec: object
    spec_name: str
    source_sha256: str
    file: str  # relative to the pack directory
    impl: str = ""
    kernel_us: float | None = None
    baseline_us: float | None = None
    baseline: str | None = None

    @property
    def key(self) -> tuple:
        """The dispatch key: (M, N, K, layout, dtype)."""
        p = self.problem
        return (p.M, p.N, p.K, self.layout, p.dtype)

    @property
    def generic(self) -> bool:
        """True when one build serves every shape the spec accepts (else only its own shape)."""
        return registry.get(self.family).generic


@dataclass
class Pack:
    path: Path
    stamp: dict
    dtype: str
    acc: str
    arch: str
    entries: tuple[PackEntry, ...]
    manifest: dict = field(repr=False, default_factory=dict)
    # (M, N, K, layout) tuned on this GPU where no verified gemmrl kernel beat the libraries in
    # that layout: the op calls torch.matmul there, never a neighbouring shape's kernel
    library: frozenset = field(default_factory=frozenset)
    # (M, N, K, layout) -> the cuBLASLt algorithm (64 bytes) the autotuned baseline chose on this
    # GPU (fp32 accumulation, the fallback's): the fallback's plan for that shape where the
    # runtime links the same cuBLASLt version (lt_version), instead of the heuristic's first choice
    lt_algos: dict = field(default_factory=dict)
    lt_version: int | None = None

    def source(self, entry: PackEntry) -> str:
        """The entry's kernel source, re-checked against its hash (files may change after load)."""
        data = (self.path / entry.file).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != entry.source_sha256:
            raise PackError(f"{self.path / entry.file}: sha256 {got} does not match the manifest's "
                            f"{entry.source_sha256}: the file changed after the pack was made")
        return data.decode()

    def check_stamp(self, device_name: str, *, cuda: str | None = None, force: bool = False) -> list[str]:
        """Refuse (StampError) a pack made on another GPU model, CUDA major or gemmrl minor
        version, unless `force`; returns warnings (what differs but is tolerated, or forced)."""
        from gemmrl import __version__

        problems, warnings = [], []
        made_on = str(self.stamp.get("device", ""))
        if _norm_device(made_on) != _norm_device(device_name):
            problems.append(f"made on {made_on!r}, this GPU is {device_name!r}: tuning is per GPU model")
        theirs = self.stamp.get("cuda")
        if cuda and theirs and str(cuda).split(".")[0] != str(theirs).split(".")[0]:
            problems.append(f"tuned under CUDA {theirs}, this process has CUDA {cuda}")
        if _minor(str(self.stamp.get("gemmrl", ""))) != _minor(__version__):
            problems.append(f"made by gemmrl {self.stamp.get('gemmrl')!r}, this is gemmrl {__version__}")
        if problems and not force:
            raise StampError(f"pack {self.path} refused: " + "; ".join(problems)
                             + " (force=True uses it anyway)")
        return [f"forced: {p}" for p in problems] + warnings


def _norm_device(name: str) -> str:
    return re.sub(r"\s+", " ", name.strip()).casefold()


def _minor(version: str) -> tuple:
    return tuple(version.split(".")[:2])


def serving(manifest: Mapping) -> dict:
    """What a manifest serves each (shape, layout) with: {"MxNxK:LAYOUT": "kernel:<source sha256>"
    or "lt:<algorithm hex>"}; the rest fall back to the heuristic's plan (malformed items are
    left out, as _keys leaves them). Pure."""
    out = {}
    for (kind, field_), items in ((("lt", "algo"), manifest.get("lt_algos")),
                                  (("kernel", "source_sha256"), manifest.get("entries"))):
        for (M, N, K, layout), d in _keys(items).items():
            out[f"{M}x{N}x{K}:{layout}"] = f"{kind}:{d.get(field_)}"
    return out


def serving_digest(manifest: Mapping) -> str:
    """A short digest of serving(manifest): two exports that serve every (shape, layout) alike
    share it, whatever their stamps, timings and notes. Pure."""
    text = "\n".join(f"{k} {v}" for k, v in sorted(serving(manifest).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def variant_shas(fam, spec, problem) -> list[str]:
    """sha256 of every source of this one kernel (Family.source_variants), in its order: the one
    render() gives now (what a pack ships) first, then those that differ from it in host code only."""
    return [sha256_text(src) for src in fam.source_variants(spec, problem)]


def kernel_shas(fam, spec, problem) -> frozenset:
    """variant_shas as a set: every source a product session of this kernel may name."""
    return frozenset(variant_shas(fam, spec, problem))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------- export

def _latest_kernel_times(store, device: str, dtype: str, acc: str) -> dict:
    """{(M, N, K): {impl: measurement record}} of kernel-mode timings that finished ok."""
    from gemmrl.report.export import is_repeat  # pure; the report stage owns baseline naming

    out: dict = {}
    for r in store.measurements(device=device, mode="kernel", dtype=dtype, acc=acc):
        if is_repeat(r["impl"]):
            continue
        out.setdefault((r["M"], r["N"], r["K"]), {})[r["impl"]] = r
    return out


def _best_baseline(latest: dict, session: dict) -> tuple[str | None, float | None]:
    """The fastest baseline of `session` (_kernel_sessions' value for the session that timed our
    kernel), else the latest of any (`latest`: {impl: latest record}). A baseline timed again in
    a later session (the autotuned one picked again, say) still counts in our kernel's session:
    the latest records alone would leave it out there and compare with the weaker rest."""
    from gemmrl.report.export import is_baseline

    pool = {i: us for i, (us, _) in session.items() if is_baseline(i)}
    if not pool:
        pool = {i: float(r["median_us"]) for i, r in latest.items()
                if is_baseline(i) and r.get("status") == "ok" and r.get("median_us")}
    if not pool:
        return None, None
    name = min(pool, key=lambda i: (pool[i], i))
    return name, pool[name]


# a winner with one kernel-mode session ships on that session alone, unless that session's
# baselines ran more than this much slower than the same baselines in the shape's other sessions
# (the median over the baselines of each one's ratio to its median elsewhere): on the H100,
# 256x4096x4096 entered the pack on a session (run 223) whose seven baselines ran a median 10%
# slower than in runs 206 and 211, and gemmrl.matmul then served it at 0.933 of torch.matmul
BASELINE_DRIFT = 0.03


def _baseline_history(every_session: dict) -> dict:
    """(M, N, K, baseline impl) -> [(session, median us)] over every kernel-mode session
    (_kernel_sessions' value)."""
    from gemmrl.report.export import is_baseline

    out: dict = {}
    for (M, N, K, session), t in every_session.items():
        for impl, (us, _) in t.items():
            if is_baseline(impl):
                out.setdefault((M, N, K, impl), []).append((session, us))
    return out


def _session_drift(history: dict, shape: tuple, session: str, timed: dict) -> tuple[float, int] | None:
    """How much slower the baselines of one session ran than the same baselines in the shape's
    other sessions: the median over the session's baselines of its time over that baseline's
    median elsewhere, and how many baselines had another session; None when none had. Each
    baseline against itself, so a faster library timed only elsewhere (an exhaustive search in a
    session of its own) does not count against the session."""
    from gemmrl.report.export import is_baseline

    ratios = []
    for impl, (us, _) in timed.items():
        if not is_baseline(impl):
            continue
        others = [x for s_, x in history.get((*shape, impl), ()) if s_ != session]
        if others:
            ratios.append(us / statistics.median(others))
    return (statistics.median(ratios), len(ratios)) if ratios else None


def _kernel_sessions(store, device: str, dtype: str, acc: str, impls=None, since_choice=None,
                     since: dict | None = None) -> dict:
    """(M, N, K, session) -> {impl: (median us, paired)} of the kernel-mode measurements that
    finished ok (only `impls`, if given); `paired`: the record's within-round ratios {other:
    t_other / t_self} (kernel protocol v3; {} before). `since_choice`: impl names whose sessions
    count only from the time that impl's stored choice (its tuning row) for the shape was made;
    `since`: {(M, N, K, impl): time} in place of that row's time (_waiting_since)."""
    q = ("SELECT session, M, N, K, impl, median_us, created, details FROM measurements WHERE device=? AND dtype=? "
         "AND acc=? AND mode='kernel' AND status='ok' AND median_us > 0")
    args: tuple = (device, dtype, acc)
    if impls is not None:
        q += f" AND impl IN ({', '.join('?' * len(impls))})"
        args += tuple(impls)
    chosen: dict = {}
    if since_choice is not None:
        rows = store.db.execute("SELECT M, N, K, impl, created FROM tuning WHERE device=? AND dtype=? AND acc=? "
                                "AND impl LIKE ?", (device, dtype, acc, since_choice))
        chosen = {(int(M), int(N), int(K), impl): created for M, N, K, impl, created in rows}
        chosen.update(since or {})
    out: dict = {}
    for session, M, N, K, impl, us, created, details in store.db.execute(q, args):
        since = chosen.get((int(M), int(N), int(K), impl))
        if since is not None and created < since:
            continue  # timed an earlier choice
        paired = json.loads(details or "{}").get("paired") or {}
        out.setdefault((int(M), int(N), int(K), session), {})[impl] = (float(us), paired)
    return out


def _over(t: dict, a: str, b: str) -> float:
    """b's time over a's in one session (_kernel_sessions' values): a's paired ratio to b where
    recorded, else the medians' (bench.stats.paired_over)."""
    from gemmrl.bench.stats import paired_over

    return paired_over(t[a][1], b, t[a][0], t[b][0])


def _session_speedups(store, device: str, dtype: str, acc: str, since: dict | None = None) -> dict:
    """(M, N, K, impl) -> [speedup] for every kernel-mode session since the gemmrl impl's stored
    choice (or `since`'s time: _kernel_sessions) that timed it beside at least one baseline: the
    session's fastest baseline over the impl's time (by the impl's paired ratio to it where recorded)."""
    from gemmrl.report.export import is_baseline

    out: dict = {}
    for (M, N, K, _), t in _kernel_sessions(store, device, dtype, acc, since_choice=GEMMRL_IMPL_PREFIX + "%",
                                             since=since).items():
        base = [i for i in t if is_baseline(i)]
        if not base:
            continue
        for impl in t:
            if impl.startswith(GEMMRL_IMPL_PREFIX):  # the fastest baseline over the impl
                out.setdefault((M, N, K, impl), []).append(min(_over(t, impl, b) for b in base))
    return out


PRODUCT_IMPLS = ("gemmrl.matmul-nn", "gemmrl.matmul-tn")  # bench --impl pack:DIR (runtime.pack_impl)


def _product_served(store, device: str, dtype: str, acc: str, read) -> dict:
    """(run id, M, N, K, gemmrl.matmul impl) -> what `read` finds in the impl details of each
    gemmrl.matmul verification (pack_impl's describe(): the kernel or the cuBLASLt algorithm
    that served the shape in that run); records where it finds None are left out."""
    served: dict = {}
    for run_id, M, N, K, impl, details in store.db.execute(
            "SELECT run_id, M, N, K, impl, details FROM verifications WHERE device=? AND dtype=? AND acc=? "
            "AND impl IN (?, ?) ORDER BY id", (device, dtype, acc, *PRODUCT_IMPLS)):
        got = read(json.loads(details).get("impl"))
        if got is not None:
            served[(run_id, int(M), int(N), int(K), impl)] = got
    return served


def _served_sha(impl_details) -> str | None:
    """The source of the pack kernel that served a gemmrl.matmul verification; None where none
    did or it failed there (the call fell back: not that kernel's session)."""
    from gemmrl.runtime.pack_impl import served_kernel

    got = served_kernel(impl_details)
    return None if got is None else got["source_sha256"]


def _product_speedups(store, device: str, dtype: str, acc: str) -> dict:
    """(M, N, K, layout) -> [(source_sha256, speedup, created)] for every kernel-mode session in
    which gemmrl.matmul ran the shape with a pack kernel (its verification in the same run names
    the kernel's source: pack_impl's `served`; a bench verifies and times a shape once a run): the
    session's fastest baseline over gemmrl.matmul's
    time, by gemmrl.matmul's paired ratio to it where recorded (kernel protocol v3), else by the
    medians. Sessions before `served` was recorded say nothing and are left out, as do those
    where the served kernel failed to build or load (the call fell back)."""
    from gemmrl.report.export import is_baseline

    served = _product_served(store, device, dtype, acc, _served_sha)
    if not served:
        return {}
    sessions: dict = {}
    for run_id, session, M, N, K, impl, us, details, created in store.db.execute(
            "SELECT run_id, session, M, N, K, impl, median_us, details, created FROM measurements WHERE device=? "
            "AND dtype=? AND acc=? AND mode='kernel' AND status='ok' AND median_us > 0 AND session IN "
            "(SELECT session FROM measurements WHERE device=? AND mode='kernel' AND impl IN (?, ?))",
            (device, dtype, acc, device, *PRODUCT_IMPLS)):
        t, where = sessions.setdefault(session, ({}, {}))
        t[impl] = (float(us), json.loads(details).get("paired") or {})  # as _kernel_sessions' values
        where[impl] = (run_id, int(M), int(N), int(K), created)
    out: dict = {}
    for t, where in sessions.values():
        base = [i for i in t if is_baseline(i)]
        for impl in PRODUCT_IMPLS:
            if impl not in t or not base:
                continue
            run_id, M, N, K, created = where[impl]
            sha = served.get((run_id, M, N, K, impl))
            if sha is None:
                continue
            speedup = min(_over(t, impl, b) for b in base)
            out.setdefault((M, N, K, impl[-2:].upper()), []).append((sha, speedup, created))
    return out


HOST_MODES = ("offline", "server")
HOST_SLOWER = 0.02  # a kernel gemmrl.matmul runs this much slower than torch.matmul in a host mode leaves
SLOWER_FLOOR = {"kernel": 0.01, "offline": HOST_SLOWER, "server": HOST_SLOWER}


def slower_beyond_noise(ratio: float, noise: float, mode: str, floor: float | None = None) -> bool:
    """Whether gemmrl.matmul at `ratio` of torch.matmul's speed (torch.matmul's time over its
    own) is slower beyond the measured noise: under 1 less the mode's floor (1% in kernel time,
    2% in the host modes; `floor` in every mode where given) or twice `noise` (how far
    torch.matmul and its repeat disagreed in that session), whichever is larger. Pure."""
    return ratio < 1 - max(SLOWER_FLOOR[mode] if floor is None else floor, 2 * noise)


PRODUCT_VERSUS = {"gemmrl.matmul-nn": "torch.matmul", "gemmrl.matmul-tn": "torch.matmul-tn"}
PRODUCT_MODES = ("kernel",) + HOST_MODES


def _product_host_ratios(store, device: str, dtype: str, acc: str, read=_served_sha,
                         modes: tuple = HOST_MODES) -> dict:
    """(M, N, K, layout) -> [(source_sha256, mode, ratio, noise, created)] for every host-mode
    (offline, server) session in which gemmrl.matmul ran the shape with a pack kernel: torch.matmul
    of the same layout over gemmrl.matmul (its paired ratio where recorded, else the medians; the
    means in server mode, as the reports take them), and that session's noise, how far torch.matmul
    and its repeat disagreed (0 where there was no repeat). With `read` = pack_impl's served_lt,
    the sessions in which the fallback ran a cuBLASLt algorithm of the pack instead, that
    algorithm (hex) in place of the kernel's source. `modes` = PRODUCT_MODES adds the kernel-mode
    sessions (medians, or the paired ratio where recorded)."""
    from gemmrl.bench.stats import paired_over

    served = _product_served(store, device, dtype, acc, read)
    if not served:
        return {}
    wanted, modes = tuple(modes), ", ".join("?" * len(modes))
    sessions: dict = {}
    for run_id, session, mode, M, N, K, impl, med, mean, details, created in store.db.execute(
            "SELECT run_id, session, mode, M, N, K, impl, median_us, mean_us, details, created FROM measurements "
            f"WHERE device=? AND dtype=? AND acc=? AND mode IN ({modes}) AND status='ok' AND session IN "
            f"(SELECT session FROM measurements WHERE device=? AND mode IN ({modes}) AND impl IN (?, ?))",
            (device, dtype, acc, *wanted, device, *wanted, *PRODUCT_IMPLS)):
        t = mean if mode == "server" else med
        if t and t > 0:
            got = sessions.setdefault(session, {})
            got[impl] = (float(t), json.loads(details or "{}").get("paired") or {},
                         (run_id, mode, int(M), int(N), int(K), created))
    out: dict = {}
    for t in sessions.values():
        noise = 0.0
        if "torch.matmul" in t and "torch.matmul@repeat" in t:
            noise = abs(1 - paired_over(t["torch.matmul@repeat"][1], "torch.matmul", t["torch.matmul@repeat"][0],
                                        t["torch.matmul"][0]))
        for impl, base in PRODUCT_VERSUS.items():
            if impl not in t or base not in t:
                continue
            run_id, mode, M, N, K, created = t[impl][2]
            got = served.get((run_id, M, N, K, impl))
            if got is None:
                continue
            ratio = paired_over(t[impl][1], base, t[impl][0], t[base][0])
            out.setdefault((M, N, K, impl[-2:].upper()), []).append((got, mode, ratio, noise, created))
    return out


def host_verdict(sessions, floor: float | None = None) -> tuple[str, float, float, int] | None:
    """The host mode in which gemmrl.matmul ran a kernel slower than torch.matmul beyond the
    noise: [(mode, ratio, noise)] of its sessions -> (mode, median ratio, median noise, sessions)
    of the first such mode, or None. Slower beyond the noise: the median ratio under 1 less the
    mode's floor (SLOWER_FLOOR; `floor` in every mode where given: LT_HOST_SLOWER for a cuBLASLt
    algorithm) or twice the median disagreement of torch.matmul with its repeat, whichever is
    larger. Pure."""
    per: dict = {}
    for mode, ratio, noise in sessions:
        per.setdefault(mode, []).append((ratio, noise))
    for mode in sorted(per):
        ratios = [r for r, _ in per[mode]]
        noise = statistics.median(n for _, n in per[mode])
        ratio = statistics.median(ratios)
        if slower_beyond_noise(ratio, noise, mode, floor):
            return mode, ratio, noise, len(ratios)
    return None


def disputed(store, manifest: dict, device: str, min_sessions: int = 3) -> list[tuple]:
    """(M, N, K, layout, mode) where the pack `manifest` serves a kernel (its source) or a cuBLASLt
    algorithm whose newest product session in that mode ran slower than torch.matmul beyond that
    session's noise (an algorithm: beyond the export's own floor for algorithms, LT_HOST_SLOWER),
    while the export kept it (its sessions' median is not slower), with fewer
    than `min_sessions` sessions of it in that mode: one more session decides, for the export's
    median and for the grid report, which reads the newest session (H200, 2026-11-27: 512x512x4096
    TN at 1.043 and then 0.959 of torch.matmul, torch.matmul-tn itself 10.29 and 9.10 us; the
    export kept it, the product target failed on it). Sessions of the very source the pack ships,
    as the grid report reads them: the export's median also counts the kernel's host-only variants
    (kernel_shas) until the shipped source has three (own_build_first), but a kernel with two
    sessions of its old build and one of the shipped one was left undisputed at three while the
    report failed it on that one (H200, runs 742-751: six kernels, torch.matmul up to 12% faster
    in that session than in each earlier one). Sorted by FLOPs."""
    from gemmrl.runtime.pack_impl import served_lt

    dtype, acc = manifest.get("dtype", "fp16"), manifest.get("acc", "fp32")
    serving = {(e["M"], e["N"], e["K"], e["layout"]): {e["source_sha256"].lower()}
               for e in manifest.get("entries", []) if e.get("source_sha256")}
    algos = {(a["M"], a["N"], a["K"], a["layout"]): {str(a["algo"]).lower()} for a in manifest.get("lt_algos", [])}
    out = set()
    for table, read, floor in ((serving, _served_sha, None), (algos, served_lt, LT_HOST_SLOWER)):
        if not table:
            continue
        for key, got in _product_host_ratios(store, device, dtype, acc, read, modes=PRODUCT_MODES).items():
            if key not in table:
                continue
            per_mode: dict = {}
            for what, mode, ratio, noise, created in got:
                if str(what).lower() in table[key]:  # hex, in either case
                    per_mode.setdefault(mode, []).append((created, ratio, noise))
            for mode, rows in per_mode.items():
                rows.sort()
                _, ratio, noise = rows[-1]
                if len(rows) < min_sessions and slower_beyond_noise(ratio, noise, mode, floor):
                    out.add((*key, mode))
    return sorted(out, key=lambda k: (k[0] * k[1] * k[2], k))


# a kernel's product sessions of the very source the pack ships: once a mode has this many, the
# sessions of its host-only variants (older builds of the same device code) stop counting there
OWN_BUILD_SESSIONS = 3


def own_build_first(rows: list[tuple], shipped: str, min_own: int = OWN_BUILD_SESSIONS) -> list[tuple]:
    """[(source sha, mode, ...)] of one kernel's product sessions, any of its host-only variants ->
    those the export judges it by: in a mode where the shipped source has `min_own` sessions or
    more, those alone; elsewhere all. The grid report reads the shipped source's newest session and
    `disputed` asks for more of them until there are `min_own`; with the older builds' sessions
    counted for ever, the export's median could keep a kernel that three sessions of its shipped
    build ran slower (H200, 2026-11-30: ten kept kernels whose older-build sessions ran beside
    slow library kernels, results/README.md). Pure; order kept."""
    own: dict = {}
    for r in rows:
        if r[0] == shipped:
            own[r[1]] = own.get(r[1], 0) + 1
    return [r for r in rows if r[0] == shipped or own.get(r[1], 0) < min_own]


def _slower_note(what: str, verdict) -> str:
    """The `skipped` note for a kernel or algorithm host_verdict judged slower than torch.matmul."""
    mode, ratio, noise, n = verdict
    return (f"{what}: gemmrl.matmul ran it at {ratio:.4f} of torch.matmul in {mode} mode ({n} session"
            f"{'s' * (n != 1)}; torch.matmul within {noise:.2%} of its repeat): slower beyond the noise")


def _winners(store, device: str, dtype: str, acc: str, min_speedup: float) -> tuple[list, set, list, list]:
    """(candidates, run ids, skipped reasons, shapes to time again): one dict per verified gemmrl
    winner; the last, the (M, N, K) of winners left out because their one kernel session's
    baselines ran slow (a second session decides them). A winner
    timed in several kernel-mode sessions since it was chosen is judged by the median of its
    per-session speedups over each session's best baseline (one session's near-tie no longer
    decides alone); with one session, by that session. The product's own sessions count too:
    gemmrl.matmul timed in kernel mode while the pack served the shape with this very kernel
    (its source), since the choice (_product_speedups)."""
    rows = store.db.execute(
        "SELECT M, N, K, impl, choice, time_us, created FROM tuning WHERE device=? AND dtype=? AND acc=? "
        "AND impl LIKE ? ORDER BY M, N, K, impl", (device, dtype, acc, GEMMRL_IMPL_PREFIX + "%")).fetchall()
    times = _latest_kernel_times(store, device, dtype, acc)
    every_session = _kernel_sessions(store, device, dtype, acc)  # our kernel's own, for its baselines
    history = _baseline_history(every_session)
    # each row's newest verification, read once: _waiting_since and the loop below both need it
    vers = {(int(r["M"]), int(r["N"]), int(r["K"]), r["impl"]): store.verification(
        device, Problem(r["M"], r["N"], r["K"], dtype, acc), r["impl"]) for r in rows}
    waiting = _waiting_since(store, device, dtype, acc, rows, vers)
    speedups = _session_speedups(store, device, dtype, acc, since=waiting)
    product = _product_speedups(store, device, dtype, acc)
    host = _product_host_ratios(store, device, dtype, acc, modes=PRODUCT_MODES)
    cands, runs, skipped, again = [], set(), [], []
    for row in rows:
        problem = Problem(row["M"], row["N"], row["K"], dtype, acc)
        impl = row["impl"]
        ver = vers[(problem.M, problem.N, problem.K, impl)]
        if ver is None or not ver["passed"]:
            skipped.append(f"{problem.shape} {impl}: {'not verified' if ver is None else 'failed verification'}")
            continue
        tuned_us = float(row["time_us"])
        try:
            choice = json.loads(bytes(row["choice"]).decode())
            verified = verified_choice(ver)
            if verified_differs(choice, verified):
                # a run cut between its search and its final timing: the stored choice was never
                # verified in full nor timed; ship the kernel that was (the timing below is its)
                skipped.append(f"{problem.shape} {impl}: stored choice {_choice_name(choice)} awaits its final "
                               f"verification; the pack keeps the verified {_choice_name(verified)}")
                choice, tuned_us = verified, None
            fam = registry.get(choice["family"])
            spec = fam.spec_type()(**choice["spec"])
        except (ValueError, KeyError, TypeError) as e:
            skipped.append(f"{problem.shape} {impl}: unreadable choice: {e}")
            continue
        why = fam.valid(spec, problem)
        if why is not None:
            skipped.append(f"{problem.shape} {impl}: stored spec {spec.name} does not serve it: {why}")
            continue
        recs = times.get((problem.M, problem.N, problem.K), {})
        ours = recs.get(impl)
        chosen_at = waiting.get((problem.M, problem.N, problem.K, impl), row["created"])
        kernel_us = baseline = baseline_us = None
        sessions: dict = {}
        # the hashes this kernel's product sessions may name: its source now and its host-only
        # variants (CUTLASS's before the entry-point cache became the default); rendered once, if at all
        variants = functools.cache(lambda: variant_shas(fam, spec, problem))
        own_shas = functools.cache(lambda: frozenset(variants()))
        shipped = lambda: variants()[0]  # noqa: E731  render()'s own: the source the pack ships
        if ours is not None:
            if ours.get("status") != "ok" or not ours.get("median_us"):
                skipped.append(f"{problem.shape} {impl}: kernel timing {ours.get('status')}")
                continue
            kernel_us = float(ours["median_us"])
            shape = (problem.M, problem.N, problem.K)
            own_session = every_session.get((*shape, ours["session"]), {})
            baseline, baseline_us = _best_baseline(recs, own_session)
            since = list(speedups.get((problem.M, problem.N, problem.K, impl), []))
            theirs = product.get((problem.M, problem.N, problem.K, spec.layout), [])
            if theirs:
                shas = own_shas()
                mine = [x for s_, _, x in own_build_first(
                    [(s_, "kernel", x) for s_, x, created in theirs if s_ in shas and created >= chosen_at],
                    shipped())]
                since += mine
                if mine:
                    sessions["product_sessions"] = len(mine)
            if len(since) >= 2:
                median = statistics.median(since)
                if median < min_speedup:
                    skipped.append(f"{problem.shape} {impl}: median speedup {median:.4f} over the best baseline "
                                   f"in {len(since)} sessions: under the {min_speedup}x asked for")
                    continue
                sessions = {**sessions, "sessions": len(since), "speedup_median": round(median, 4)}
            elif baseline_us is not None and baseline_us < min_speedup * kernel_us:
                skipped.append(f"{problem.shape} {impl}: {kernel_us:.2f} us vs {baseline} "
                               f"{baseline_us:.2f} us: under the {min_speedup}x speedup asked for")
                continue
            elif baseline_us is not None:
                drift = _session_drift(history, shape, ours["session"], own_session)
                if drift is not None and drift[0] > 1 + BASELINE_DRIFT:
                    skipped.append(f"{problem.shape} {impl}: its one session's baselines ran a median "
                                   f"{drift[0] - 1:.1%} slower than in their other sessions ({drift[1]} "
                                   f"baselines): one session is not enough; time it again")
                    again.append(shape)
                    continue
            runs.add(ours["run_id"])
        in_host = host.get((problem.M, problem.N, problem.K, spec.layout), [])
        if in_host:  # the product timed as users call it: never slower than torch.matmul beyond the noise,
            # in a host mode (2% floor) nor in kernel time (1%), whatever the kernel did against the
            # best baseline (H200, run 352-355: the fp16-accumulator pack's 12288x256x64 TN kernel ran
            # 0.953 of torch.matmul-tn's speed through gemmrl.matmul, its median speedup still 1.0 or more)
            shas = own_shas()
            mine = [(mode, r, n) for s_, mode, r, n in own_build_first(
                [(s_, mode, r, n) for s_, mode, r, n, created in in_host if s_ in shas and created >= chosen_at],
                shipped())]
            bad = host_verdict(mine)
            if bad is not None:
                skipped.append(_slower_note(f"{problem.shape} {impl}", bad))
                continue
            n_host = sum(1 for mode, _, _ in mine if mode in HOST_MODES)
            if n_host:
                sessions["host_sessions"] = n_host
        runs.add(ver["run_id"])
        cands.append({"problem": problem, "impl": impl, "family": fam, "spec": spec,
                      "kernel_us": kernel_us, "baseline": baseline, "baseline_us": baseline_us,
                      "tuned_us": kernel_us if tuned_us is None else tuned_us, **sessions})
    return cands, runs, skipped, again


def _tuned_shapes(store, device: str, dtype: str, acc: str) -> set:
    """(M, N, K) of every shape a gemmrl tune stored a choice for on `device`: measured here, so
    a layout the pack does not serve there is one the libraries serve better (or no verified
    kernel of ours serves), which the op must not hand to a neighbour's kernel."""
    rows = store.db.execute("SELECT DISTINCT M, N, K FROM tuning WHERE device=? AND dtype=? AND acc=? "
                            "AND impl LIKE ?", (device, dtype, acc, GEMMRL_IMPL_PREFIX + "%")).fetchall()
    return {(int(r[0]), int(r[1]), int(r[2])) for r in rows}


LT_IMPL = "cuBLASLt-auto-tuning-{}"  # the autotuned baseline whose stored choices lt_algos are


def _lt_version(cublas: str) -> int | None:
    """cuBLASLt's version (cublasLtGetVersion) from a provenance's cuBLAS string, or None."""
    m = re.search(r"cublasLt=(\d+)", cublas or "")
    return int(m.group(1)) if m else None


# an autotuned algorithm ships where, against the heuristic's first choice in the same sessions,
# its median time ratio is at most LT_MARGIN and no session had it slower
LT_MARGIN = 0.99
# ... and leaves when gemmrl.matmul's fallback ran it this much slower than torch.matmul (the
# heuristic's plan, what it replaces) in a host mode, by the median of that mode's sessions: the
# margin it had to win by, where a kernel is allowed HOST_SLOWER. On the H200 (2026-11-27) the
# autotuned choices of 4096x4096x16384 TN and 12288x2048x12288 TN, each about 1-2% under the
# heuristic's kernel time, ran 0.976-0.985 of torch.matmul-tn's speed offline in both packs'
# sessions: on the largest shapes a kernel-time lead shrinks by 2-4% in the host modes
# (scripts/mode-transfer.py), so a 1-2% pick only costs there.
LT_HOST_SLOWER = round(1 - LT_MARGIN, 6)


def _lt_vs_heuristic(store, device: str, dtype: str) -> dict:
    """(M, N, K, layout) -> the kernel-time ratio of the autotuned cuBLASLt baseline (its stored
    choice) to the heuristic's first choice in every session that timed both (fp32 accumulation)
    since that choice was stored, by the paired ratio where recorded: sessions of an earlier
    choice of the same shape do not count."""
    impls = [LT_IMPL.format(x) for x in ("nn", "tn")] + [f"cuBLASLt-heuristic-{x}" for x in ("nn", "tn")]
    sess = _kernel_sessions(store, device, dtype, "fp32", impls, since_choice=LT_IMPL.format("%"))
    out: dict = {}
    for (M, N, K, _), t in sess.items():
        for layout in LAYOUTS:
            a, h = LT_IMPL.format(layout.lower()), f"cuBLASLt-heuristic-{layout.lower()}"
            if a in t and h in t:  # the autotuned choice's time over the heuristic's
                out.setdefault((int(M), int(N), int(K), layout), []).append(_over(t, h, a))
    return out


def _product_lt(store, device: str, dtype: str) -> tuple[dict, dict]:
    """(kernel, host) for every session in which gemmrl.matmul's fallback ran a cuBLASLt
    algorithm of the pack (its verification in the same run names it: pack_impl's `served_lt`;
    _product_host_ratios over every mode), the packs of either accumulator counted: the fallback
    accumulates in fp32 whatever the pack's. kernel: (M, N, K, layout, algo hex) ->
    [gemmrl.matmul's time over torch.matmul's of the same layout] in kernel time; host: the same
    key -> [(mode, ratio, noise)] offline and in server mode. torch.matmul is what the algorithm
    replaces: without it the fallback runs the heuristic's first choice, as torch.matmul's
    cuBLAS does."""
    from gemmrl.runtime.pack_impl import served_lt

    kernel: dict = {}
    host: dict = {}
    for acc in ("fp32", "fp16"):
        ratios = _product_host_ratios(store, device, dtype, acc, served_lt, modes=PRODUCT_MODES)
        for key, sessions in ratios.items():
            for algo, mode, ratio, noise, _ in sessions:
                if mode == "kernel":  # torch.matmul's time over gemmrl.matmul's, inverted
                    kernel.setdefault(key + (algo,), []).append(1.0 / ratio)
                else:
                    host.setdefault(key + (algo,), []).append((mode, ratio, noise))
    return kernel, host


def _lt_choices(store, device: str, dtype: str, served: set, margin: float = LT_MARGIN,
                skipped: list | None = None) -> list[dict]:
    """The autotuned cuBLASLt baseline's stored algorithm for each (shape, layout) of `device` the
    pack's kernels do not serve, where, in the sessions that timed it beside the heuristic's first
    choice, its kernel time was at most `margin` of the heuristic's by the median ratio and never
    above it: fp32 accumulation whatever the pack's, since a
    fallback accumulates in fp32 as torch.matmul does. The rest keep the heuristic's choice (a
    stored autotuned choice can be slower than the heuristic's in every later session: on the
    H100's subset, 2026-11-25, 512x1024x8192 ran 1.14x the heuristic's time in four sessions).
    The product's own sessions count too: gemmrl.matmul timed in kernel mode while its fallback
    ran this very algorithm, its time over torch.matmul's of the layout (_product_lt; on the
    H100, run 233, 2048x256x12288 TN's algorithm ran 1.05x torch.matmul-tn's time). And an
    algorithm that gemmrl.matmul ran slower than torch.matmul beyond the noise in a host mode
    (host_verdict, the kernels' host rule, with the 1% floor of LT_HOST_SLOWER) is left out, with
    a note in `skipped`: on the H200, runs 340-351, the autotuned choice of 4096x16384x8192 NN,
    0.967 of the heuristic's kernel time, ran 0.97 of torch.matmul's speed offline and 0.96 in
    server mode."""
    ratios, out = _lt_vs_heuristic(store, device, dtype), []
    product, host = _product_lt(store, device, dtype)

    def passes(x):  # faster than the heuristic's choice by the margin, and in every session
        return bool(x) and max(x) <= 1.0 and statistics.median(x) <= margin

    for layout in LAYOUTS:
        rows = store.db.execute("SELECT M, N, K, choice, info, time_us FROM tuning WHERE device=? AND dtype=? "
                                "AND acc='fp32' AND impl=? ORDER BY M, N, K",
                                (device, dtype, LT_IMPL.format(layout.lower()))).fetchall()
        for M, N, K, choice, info, us in rows:
            key = (int(M), int(N), int(K), layout)
            own, mine = ratios.get(key, []), product.get(key + (bytes(choice).hex(),), [])
            r = own + mine
            if key in served or len(bytes(choice)) != LT_ALGO_BYTES or not passes(r):
                if skipped is not None and key not in served and mine and passes(own):
                    # the baselines' sessions alone would ship it: the product's own left it out
                    skipped.append(f"{key[0]}x{key[1]}x{key[2]} {layout} cuBLASLt algorithm: gemmrl.matmul ran "
                                   f"it at up to {max(mine):.4f}x torch.matmul's time in kernel mode "
                                   f"({len(mine)} session{'s' * (len(mine) != 1)}), so the fallback keeps the "
                                   f"heuristic's plan")
                continue
            verdict = host_verdict(host.get(key + (bytes(choice).hex(),), []), LT_HOST_SLOWER)
            if verdict is not None:  # faster in kernel time, slower through gemmrl.matmul in a host mode
                if skipped is not None:
                    skipped.append(_slower_note(f"{key[0]}x{key[1]}x{key[2]} {layout} cuBLASLt algorithm", verdict)
                                   + ", so the fallback keeps the heuristic's plan")
                continue
            out.append({"M": key[0], "N": key[1], "K": key[2], "layout": layout, "algo": bytes(choice).hex(),
                        "us": None if us is None else round(float(us), 3), "info": info,
                        "vs_heuristic": round(statistics.median(r), 4), "vs_heuristic_max": round(max(r), 4),
                        "sessions": len(r)})
    out.sort(key=lambda d: (d["M"], d["N"], d["K"], d["layout"]))
    return out


LT_ALGO_BYTES = 64  # sizeof(cublasLtMatmulAlgo_t)


def verified_choice(ver: dict | None):
    """The kernel a verification record names as chosen ({family, name, spec}), or None."""
    return None if ver is None else (ver["details"].get("impl") or {}).get("chosen")


def _spec_key(choice: dict):
    """A choice's spec as its family's spec object, the fields a stored dict lacks at their
    defaults; the raw dict where it does not parse."""
    try:
        return registry.get(choice["family"]).spec_type()(**choice["spec"])
    except (ValueError, KeyError, TypeError):
        return choice.get("spec")


def verified_differs(choice: dict, verified) -> bool:
    """Whether a verification names the kernel it chose (gemmrl-tuned and the races do) and it
    is not the stored choice {family, spec}. Records without a name say nothing: False. The
    specs compare as their family's spec objects: a choice stored before a spec field existed
    lacks it, where the verification of the same kernel, written later, names its default (H200,
    2026-11-27: 6 of 7 shapes timed their verified kernel "instead" of the same stored one)."""
    if not isinstance(verified, dict) or "family" not in verified or "spec" not in verified:
        return False
    if verified["family"] != choice.get("family"):
        return True
    return _spec_key(verified) != _spec_key(choice)


def _waiting_since(store, device: str, dtype: str, acc: str, rows, vers: dict) -> dict:
    """{(M, N, K, impl): time} for the tuning rows (_winners') whose stored choice awaits its final
    verification (a tune cut after its search): the time its verified kernel became the verified
    choice, the oldest of the newest passed verifications that all chose it. The pack ships that
    kernel, judged on its sessions since then: the row's own time is the search's rewrite, which
    left the kernel one session (fp16 64x64x8192, 2026-11-30f: its median speedup over 4 sessions,
    1.017, gave way to the last one's 0.977, and the shape fell back). `vers`: each row's newest
    verification, by (M, N, K, impl)."""
    out: dict = {}
    for row in rows:
        key = (int(row["M"]), int(row["N"]), int(row["K"]), row["impl"])
        try:
            choice = json.loads(bytes(row["choice"]).decode())
        except ValueError:
            continue
        verified = verified_choice(vers.get(key))
        if not verified_differs(choice, verified):
            continue
        since = None
        for created, details in store.db.execute(
                "SELECT created, details FROM verifications WHERE device=? AND M=? AND N=? AND K=? AND dtype=? "
                "AND acc=? AND impl=? AND passed=1 ORDER BY id DESC", (device, *key[:3], dtype, acc, key[3])):
            chosen = (json.loads(details or "{}").get("impl") or {}).get("chosen")
            if not isinstance(chosen, dict) or verified_differs(chosen, verified):
                break
            since = created
        if since is not None:
            out[key] = since
    return out


def _choice_name(choice: dict) -> str:
    try:
        return registry.get(choice["family"]).spec_type()(**choice["spec"]).name
    except (ValueError, KeyError, TypeError):
        return str(choice.get("name") or choice.get("family"))


def _stamp(store, device: str, run_ids: set) -> dict:
    from gemmrl import __version__
    from gemmrl.bench.env import gpu_slug

    runs = sorted((r for r in store.runs() if r["id"] in run_ids and r["device"] == device),
                  key=lambda r: r["id"], reverse=True)
    stamp = {"device": device, "gpu": gpu_slug(device), "gemmrl": __version__,
             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
             "runs": sorted(run_ids)}
    # each from the newest run that recorded it: a tune's provenance has no cuBLAS version (before
    # 2026-11-26 it did not load the library first), and a pack whose newest run was a tune lost
    # its lt_algos, which need the version the stored algorithms were chosen under
    for key in ("capability", "sm_count", "cuda", "driver", "torch", "cublas", "commit"):
        value = next((r["provenance"][key] for r in runs if r["provenance"].get(key) not in (None, "")), None)
        if value is not None:
            stamp[key] = value
    cudas = sorted({str(r["provenance"].get("cuda")) for r in runs if r["provenance"].get("cuda")})
    if len(cudas) > 1:
        stamp["cuda_seen"] = cudas
    return stamp


def export_pack(store, device: str, out_dir, dtype: str = "fp16", acc: str = "fp32",
                min_speedup: float = 1.0, arch: str = "sm_90a") -> Path:
    """Write the verified gemmrl winners of `device` for (dtype, acc) as a pack at `out_dir`
    (replacing a pack there). Raises PackError when there is nothing to export."""
    if dtype not in DTYPES or acc not in ACCS:
        raise PackError(f"dtype must be one of {DTYPES} and acc one of {ACCS}, got {dtype!r}, {acc!r}")
    cands, run_ids, skipped, again = _winners(store, device, dtype, acc, min_speedup)
    best: dict = {}
    for c in cands:  # several gemmrl impls may have won a (problem, layout): keep the fastest
        k = (c["problem"], c["spec"].layout)
        rank = (c["kernel_us"] is None, c["kernel_us"] or c["tuned_us"] or math.inf, c["impl"])
        if k not in best or rank < best[k][0]:
            best[k] = (rank, c)
    if not best:
        why = "; ".join(skipped[:10]) or "the store holds no gemmrl tuning choices for it"
        raise PackError(f"nothing to export for {device!r} ({dtype}, acc {acc}): {why}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        (tmp / KERNEL_DIR).mkdir()
        files: dict[str, str] = {}  # sha -> relative file
        entries = []
        for (problem, layout), (_, c) in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            spec, fam = c["spec"], c["family"]
            source = fam.render(spec, problem)
            sha = sha256_text(source)
            if sha not in files:
                stem = spec.name if fam.generic else f"{spec.name}_{problem.M}x{problem.N}x{problem.K}"
                rel = f"{KERNEL_DIR}/{stem}.cu"
                if rel in files.values():  # same name, other source: keep both
                    rel = f"{KERNEL_DIR}/{stem}-{sha[:12]}.cu"
                (tmp / rel).write_text(source)
                files[sha] = rel
            entries.append({
                "M": problem.M, "N": problem.N, "K": problem.K, "dtype": dtype, "acc": acc,
                "layout": layout, "family": fam.name, "spec": dict(spec.__dict__),
                "spec_name": spec.name, "source_sha256": sha, "file": files[sha], "impl": c["impl"],
                "kernel_us": c["kernel_us"], "baseline": c["baseline"], "baseline_us": c["baseline_us"],
                "speedup": (round(c["baseline_us"] / c["kernel_us"], 4)
                            if c["kernel_us"] and c["baseline_us"] else None),
                "tuned_us": c["tuned_us"],
                **{k: c[k] for k in ("sessions", "speedup_median", "product_sessions", "host_sessions") if k in c}})
        served = {(e["M"], e["N"], e["K"], e["layout"]) for e in entries}
        library = [f"{M}x{N}x{K}:{layout}" for M, N, K in sorted(_tuned_shapes(store, device, dtype, acc))
                   for layout in LAYOUTS if (M, N, K, layout) not in served]
        stamp = _stamp(store, device, run_ids)
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "stamp": stamp,
                    "dtype": dtype, "acc": acc, "arch": arch, "min_speedup": min_speedup,
                    "entries": entries, "library": library, "skipped": skipped,
                    "time_again": [f"{m}x{n}x{k}" for m, n, k in sorted(set(again), key=lambda t: (t[0] * t[1] * t[2], t))]}
        lt_version = _lt_version(stamp.get("cublas", ""))
        if lt_version is not None:
            manifest["lt_version"] = lt_version
            manifest["lt_algos"] = _lt_choices(store, device, dtype, served, skipped=skipped)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-old-", dir=out_dir.parent))
            os.replace(out_dir, old / "pack")  # a directory cannot be replaced by rename while full
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ------------------------------------------------------------------------------------- load

def _entry(i: int, e, dtype: str, acc: str, root: Path, errors: list) -> PackEntry | None:
    where = f"entry {i}"
    if not isinstance(e, dict):
        errors.append(f"{where}: not an object")
        return None
    missing = [k for k in _ENTRY_KEYS if k not in e]
    if missing:
        errors.append(f"{where}: missing fields {', '.join(missing)}")
        return None
    try:
        problem = Problem(e["M"], e["N"], e["K"], e["dtype"], e["acc"])
    except ProblemError as err:
        errors.append(f"{where}: {err}")
        return None
    where = f"entry {i} ({problem.shape} {e['layout']})"
    if (e["dtype"], e["acc"]) != (dtype, acc):
        errors.append(f"{where}: {e['dtype']}/{e['acc']} in a {dtype}/{acc} pack")
        return None
    if e["layout"] not in LAYOUTS:
        errors.append(f"{where}: layout must be one of {', '.join(LAYOUTS)}, got {e['layout']!r}")
        return None
    if e["family"] not in registry.FAMILIES:
        errors.append(f"{where}: unknown family {e['family']!r}; known: {', '.join(registry.FAMILIES)}")
        return None
    fam = registry.get(e["family"])
    if not isinstance(e["spec"], dict):
        errors.append(f"{where}: spec must be an object of fields")
        return None
    try:
        spec = fam.spec_type()(**e["spec"])
    except TypeError as err:
        errors.append(f"{where}: bad {fam.name} spec fields: {err}")
        return None
    if getattr(spec, "layout", None) != e["layout"]:
        errors.append(f"{where}: spec layout {getattr(spec, 'layout', None)!r} is not the entry's")
        return None
    why = fam.valid(spec, problem)
    if why is not None:
        errors.append(f"{where}: spec {e['spec_name']} does not serve its own shape: {why}")
        return None
    if spec.name != e["spec_name"]:
        errors.append(f"{where}: spec_name {e['spec_name']!r} but the fields name {spec.name!r}")
        return None
    rel = e["file"]
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
        errors.append(f"{where}: file must be a path inside the pack, got {rel!r}")
        return None
    f = root / rel
    if not f.is_file():
        errors.append(f"{where}: missing file {rel}")
        return None
    got = hashlib.sha256(f.read_bytes()).hexdigest()
    if got != e["source_sha256"]:
        errors.append(f"{where}: hash mismatch for {rel}: sha256 {got}, manifest says {e['source_sha256']}")
        return None
    nums = {}
    for k in ("kernel_us", "baseline_us"):
        v = e.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            errors.append(f"{where}: {k} must be a number or null, got {v!r}")
            return None
        nums[k] = None if v is None else float(v)
    return PackEntry(problem, e["layout"], fam.name, spec, e["spec_name"], e["source_sha256"], rel,
                     str(e.get("impl", "")), nums["kernel_us"], nums["baseline_us"], e.get("baseline"))


def _keys(items) -> dict:
    """{(M, N, K, layout): item} of a manifest's entries or lt_algos; malformed items left out
    (a summary of a hand-edited or broken manifest must not fail the export that replaces it)."""
    out: dict = {}
    for e in items if isinstance(items, list) else []:
        try:
            out[(int(e["M"]), int(e["N"]), int(e["K"]), str(e["layout"]))] = e
        except (TypeError, KeyError, ValueError):
            continue
    return out


def _names(keys, limit: int = 8) -> str:
    shown = [f"{M}x{N}x{K} {layout}" for M, N, K, layout in sorted(keys)[:limit]]
    return ", ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def pack_changes(new: dict, old: dict | None = None) -> list[str]:
    """What an export wrote (manifest `new`), and what changed against the pack it replaced
    (manifest `old`, None if there was none): lines for a person to read. Pure. A rule change or
    a new session that moves many entries at once shows here before the pack is timed."""
    entries, lt = _keys(new.get("entries")), _keys(new.get("lt_algos"))
    fams: dict = {}
    for e in entries.values():
        fams[e.get("family")] = fams.get(e.get("family"), 0) + 1
    lines = [f"{len(entries)} kernel entries ("
             + ", ".join(f"{n} {f}" for f, n in sorted(fams.items(), key=lambda kv: str(kv[0])))
             + f"), {len(set(e.get('source_sha256') for e in entries.values()))} sources; "
             f"{len(lt)} cuBLASLt algorithms (lt_algos); {len(new.get('skipped') or [])} notes in `skipped` "
             f"(winners left out, and why)"]
    again = time_again_shapes(new)
    if again:
        lines.append(f"{len(again)} winners left out wait for a second kernel session, their one session's "
                     f"baselines having run slow (`time_again`; pack --again-shapes FILE lists them)")
    if old is None:
        return lines
    for what, now, before, field in (("kernel entries", entries, _keys(old.get("entries")), "source_sha256"),
                                     ("lt_algos", lt, _keys(old.get("lt_algos")), "algo")):
        came, went = set(now) - set(before), set(before) - set(now)
        moved = {k for k in set(now) & set(before) if now[k].get(field) != before[k].get(field)}
        if not (came or went or moved):
            lines.append(f"{what}: as in the pack replaced")
            continue
        parts = [f"{len(came)} in" + (f" ({_names(came)})" if came else ""),
                 f"{len(went)} out" + (f" ({_names(went)})" if went else ""),
                 f"{len(moved)} changed" + (f" ({_names(moved)})" if moved else "")]
        lines.append(f"{what} against the pack replaced: " + "; ".join(parts))
    return lines


def changed_shapes(new: dict, old: dict | None) -> list[tuple[int, int, int]]:
    """The (M, N, K) whose entries (kernel or cuBLASLt algorithm, either layout) came, went or
    changed between manifest `old` and manifest `new`, sorted by FLOPs: what to time through
    gemmrl.matmul before the new pack ships. Pure; with no old pack, every shape of the new one."""
    shapes = set()
    for items, field in (("entries", "source_sha256"), ("lt_algos", "algo")):
        now, before = _keys(new.get(items)), _keys((old or {}).get(items))
        for k in set(now) ^ set(before):
            shapes.add(k[:3])
        for k in set(now) & set(before):
            if now[k].get(field) != before[k].get(field):
                shapes.add(k[:3])
    return sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s))


def time_again_shapes(manifest: dict) -> list[tuple[int, int, int]]:
    """The manifest's `time_again` (absent in older packs): the (M, N, K) of winners the export
    left out because their one kernel-mode session's baselines ran more than BASELINE_DRIFT slow.
    A second kernel session of each (`bench --shapes FILE --mode kernel --impl baselines --impl
    tuned --retime`) decides them at the next export. Pure; malformed items are dropped."""
    out = []
    for item in manifest.get("time_again") or []:
        parts = item.split("x") if isinstance(item, str) else []
        if len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts):
            out.append(tuple(int(p) for p in parts))
    return out


def load_pack(path) -> Pack:
    """Read and check a pack directory (or its manifest.json); PackError lists every problem."""
    path = Path(path)
    if path.is_file() and path.name == MANIFEST:
        path = path.parent
    mf = path / MANIFEST
    if not mf.is_file():
        raise PackError(f"{path}: not a pack (missing file {MANIFEST})")
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackError(f"{mf}: not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise PackError(f"{mf}: not a {FORMAT} manifest (format field is {m.get('format') if isinstance(m, dict) else None!r})")
    if m.get("version") != FORMAT_VERSION:
        raise PackError(f"{mf}: pack format version {m.get('version')!r}; this gemmrl reads {FORMAT_VERSION}")
    errors = []
    stamp, dtype, acc, arch = m.get("stamp"), m.get("dtype"), m.get("acc"), m.get("arch", "sm_90a")
    if not isinstance(stamp, dict) or not isinstance(stamp.get("device"), str) or not stamp["device"]:
        errors.append("stamp: missing or without a device name")
    elif not isinstance(stamp.get("gemmrl"), str):
        errors.append("stamp: missing the gemmrl version")
    if dtype not in DTYPES or acc not in ACCS:
        errors.append(f"dtype/acc must be one of {DTYPES}/{ACCS}, got {dtype!r}/{acc!r}")
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+a?", arch):
        errors.append(f"arch must look like sm_90a, got {arch!r}")
    raw = m.get("entries")
    if not isinstance(raw, list) or not raw:
        errors.append("entries: missing or empty")
        raw = []
    entries, seen = [], {}
    if not errors:
        for i, e in enumerate(raw):
            ent = _entry(i, e, dtype, acc, path, errors)
            if ent is None:
                continue
            if ent.key in seen:
                errors.append(f"entry {i}: duplicate of entry {seen[ent.key]} for {ent.key}")
                continue
            seen[ent.key] = i
            entries.append(ent)
    library = _library(m.get("library", []), seen, errors) if not errors else frozenset()
    lt_algos = _lt_algos(m.get("lt_algos", []), seen, errors) if not errors else {}
    lt_version = m.get("lt_version")
    if lt_version is not None and (not isinstance(lt_version, int) or isinstance(lt_version, bool) or lt_version <= 0):
        errors.append(f"lt_version: must be a positive integer (cublasLtGetVersion), got {lt_version!r}")
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise PackError(f"pack {path} is invalid:\n  {shown}")
    return Pack(path, stamp, dtype, acc, arch, tuple(entries), m, library, lt_algos, lt_version)


def _lt_algos(raw, entry_keys: dict, errors: list) -> dict:
    """The manifest's `lt_algos` (absent in older packs) checked: positive sizes, a known layout,
    a 64-byte algorithm in hex, no shape that also has an entry, no duplicates."""
    if not isinstance(raw, list):
        errors.append(f"lt_algos: must be a list, got {type(raw).__name__}")
        return {}
    out, served = {}, {k[:4] for k in entry_keys}
    for i, d in enumerate(raw):
        try:
            key = (d["M"], d["N"], d["K"], d["layout"])
            ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in key[:3]) and key[3] in LAYOUTS
            algo = bytes.fromhex(d["algo"]) if isinstance(d["algo"], str) else b""
        except (TypeError, KeyError, ValueError):
            ok, algo, key = False, b"", None
        if not ok or len(algo) != LT_ALGO_BYTES:
            errors.append(f"lt_algos {i}: needs positive M, N, K, a layout ({' or '.join(LAYOUTS)}) and "
                          f"algo, {LT_ALGO_BYTES} bytes in hex")
            continue
        if key in served or key in out:
            errors.append(f"lt_algos {i}: {key} {'has a kernel entry' if key in served else 'is listed twice'}")
            continue
        out[key] = algo
    return out


def _library(raw, entry_keys: dict, errors: list) -> frozenset:
    """The manifest's `library` list ("MxNxK:LAYOUT" each; absent in older packs) checked:
    positive sizes, a known layout, no shape that also has an entry. Returns (M, N, K, layout)."""
    if not isinstance(raw, list):
        errors.append(f"library: must be a list of \"MxNxK:LAYOUT\" strings, got {type(raw).__name__}")
        return frozenset()
    out, served = set(), {k[:4] for k in entry_keys}
    for i, item in enumerate(raw):
        m = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)x([1-9]\d*):(\w+)", item) if isinstance(item, str) else None
        if m is None or m.group(4) not in LAYOUTS:
            errors.append(f"library {i}: must look like 4096x4096x4096:NN (positive sizes, layout "
                          f"{' or '.join(LAYOUTS)}), got {item!r}")
            continue
        key = (int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4))
        if key in served:
            errors.append(f"library {i}: {item} also has an entry")
            continue
        out.add(key)
    return frozenset(out)
