"""The three timing modes, one harness for baselines and candidates alike (shared/measuring.md).

- kernel: each implementation's calls captured in a CUDA graph over rotating input sets larger
  than the L2 cache; graph replays timed with CUDA events, implementations interleaved in a
  shuffled order every round; per-call time = replay time / calls in the graph.
- offline: CUDA-L2's method: fresh random inputs every round, implementations shuffled, one
  call per sample timed with the host clock between two device syncs.
- server: offline with an exponential idle gap (Poisson arrivals at a target QPS) before each
  call, so clocks and caches are cold as in real-time serving. With gaps="round" every
  implementation of a round waits the same drawn gap (each call's gap is still exponential at
  the target QPS), so the gap lengths, which move a call's time, are the same sample for every
  implementation: common random numbers, a variance reduction for the comparison.

Every timed output is checked against a reference computed outside the clock; an
implementation whose output is wrong, or that raises, gets status 'wrong'/'error' and no time.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from gemmrl.bench.stats import PairedRounds, precise_enough, summarize_samples
from gemmrl.core.problem import Problem
from gemmrl.verify.checks import TORCH_DTYPES, clocks_intact, rel_error

_perf_counter = time.perf_counter  # bound at import: a patched time.perf_counter is not read
_sleep = time.sleep
RECHECK_TOL = 1e-2  # timed outputs vs torch.matmul on the same inputs (correctness is verify's job)


KERNEL_STATS = ("median", "paired")


def _stop_by_rounds(s, rounds: int, elapsed_s: float) -> bool | None:
    """The stopping rules kernel and host settings (`s`) share: stop at max_rounds; go on below
    min_rounds; without a precision target, stop once past budget_s. None: the target decides."""
    if rounds >= s.max_rounds:
        return True
    if rounds < s.min_rounds:
        return False
    if s.target_ci is None:
        return elapsed_s > s.budget_s
    return None


@dataclass(frozen=True)
class KernelSettings:
    min_rounds: int = 10
    max_rounds: int = 40
    budget_s: float = 0.5  # per problem, all implementations together, after min_rounds
    target_replay_us: float = 2000.0
    max_sets: int = 1024
    max_set_bytes: int = 6 << 30
    l2_multiple: float = 2.0
    # opt-in (gemmrl bench's default): past min_rounds, stop once every implementation's `stat`
    # is known to within this (relative CI half-width), or after max_s of rounds, or at
    # max_rounds, instead of after budget_s; None: the v1 rule
    target_ci: float | None = None
    max_s: float = 3.0
    # what the precision target is on: each implementation's median (v2), or 'paired' (v3): every
    # pair's median within-round time ratio (stats.PairedRounds). At the power limit the SM clock
    # steps over seconds (H100, 256x16384x16384: 203 to 241 us a call within 40 rounds) while
    # the calls of one round share its clock: three copies of torch.matmul timed 20 rounds
    # disagreed by up to 3.81% by their medians and 0.50% by the paired ratio
    # (scripts/kernel-noise.py, 34 shapes, 2026-11-25). Records then carry details['paired'],
    # which the reports compare (report.export._Rec.over).
    stat: str = "median"

    def __post_init__(self):
        if self.target_ci is not None and not self.target_ci > 0:
            raise ValueError(f"target_ci must be positive, got {self.target_ci!r}")
        if not self.max_s > 0:
            raise ValueError(f"max_s must be positive, got {self.max_s!r}")
        if not 1 <= self.min_rounds <= self.max_rounds:
            raise ValueError(f"need 1 <= min_rounds <= max_rounds, got {self.min_rounds}, {self.max_rounds}")
        if self.stat not in KERNEL_STATS:
            raise ValueError(f"stat must be one of {', '.join(KERNEL_STATS)}, got {self.stat!r}")
        if self.stat == "paired" and self.target_ci is None:
            raise ValueError("stat='paired' is the statistic of a precision target: give target_ci")

    def protocol(self) -> str:
        # v1: min_rounds, then until budget_s; v2: until the precision target on the medians;
        # v3: on the paired ratios
        if self.target_ci is None:
            return "kernel:v1"
        return f"kernel:{'v3' if self.stat == 'paired' else 'v2'}:ci={self.target_ci:g}"

    def done(self, rounds: int, elapsed_s: float, samples: dict, paired: PairedRounds | None = None) -> bool:
        """Whether kernel timing stops after `rounds` rounds, `elapsed_s` seconds into them
        (`paired`: the rounds' ratios, which the 'paired' statistic's target is on)."""
        by_rounds = _stop_by_rounds(self, rounds, elapsed_s)
        if by_rounds is not None:
            return by_rounds
        return elapsed_s > self.max_s or bool(self.reached(samples, paired))

    def reached(self, samples: dict, paired: PairedRounds | None = None) -> bool | None:
        """Whether the precision target holds for these samples (None: no target was set)."""
        if self.target_ci is None:
            return None
        if self.stat == "paired":
            if paired is None:
                raise ValueError("stat='paired' needs the rounds' PairedRounds")
            return paired.precise_enough(list(samples), self.target_ci, fresh=True)
        return precise_enough(samples, self.target_ci)


GAP_DRAWS = ("each", "round")
PRECISION_EVERY = 10  # rounds between precision checks of the median / mean, past the first 10
HOST_STATS = ("median", "mean", "paired")


@dataclass(frozen=True)
class HostSettings:
    mode: str = "offline"
    min_rounds: int = 30
    max_rounds: int = 200
    budget_s: float = 0.5
    warmup_rounds: int = 3
    qps: float = 1000.0
    # opt-in: past min_rounds, stop once every implementation's median is known to within this
    # (relative CI half-width, stats.median_ci_rel), or at max_rounds / max_s, instead of at
    # budget_s; None: the v2 rule
    target_ci: float | None = None
    max_s: float = 5.0
    # server mode: "each" draws an idle gap before every call; "round" draws one per round and
    # every implementation waits it (the same gaps for all: common random numbers)
    gaps: str = "each"
    # the statistic the precision target is on: the median, the mean (server mode's cold calls
    # make the distribution bimodal and the median unstable), or 'paired' (server mode only:
    # every pair's median within-round time ratio, stats.PairedRounds; the reports compare
    # these ratios where a record has them)
    stat: str = "median"

    def __post_init__(self):
        if self.stat not in HOST_STATS:
            raise ValueError(f"stat must be one of {', '.join(HOST_STATS)}, got {self.stat!r}")
        if self.stat == "paired" and self.mode != "server":
            raise ValueError("stat='paired' is a server-mode statistic (its rounds share an idle gap)")
        if self.gaps not in GAP_DRAWS:
            raise ValueError(f"gaps must be one of {GAP_DRAWS}, got {self.gaps!r}")
        if self.gaps != "each" and self.mode != "server":
            raise ValueError("gaps='round' is a server-mode setting (offline mode has no idle gaps)")
        if not self.max_s > 0:
            raise ValueError(f"max_s must be positive, got {self.max_s!r}")

    def protocol(self) -> str:
        # v2: 30 offline / 40 server samples at least (v1 took 20 / 15: too noisy in server mode)
        # v3: v2 plus a precision target (target_ci) on the median; v4: on the mean; v5: on the
        # paired statistic (stats.PairedRounds)
        if self.target_ci is None:
            base = f"{self.mode}:v2"
        else:
            version = {"median": "v3", "mean": "v4", "paired": "v5"}[self.stat]
            base = f"{self.mode}:{version}:ci={self.target_ci:g}"
        if self.mode != "server":
            return base
        return base + f":qps={self.qps:g}" + (f":gaps={self.gaps}" if self.gaps != "each" else "")

    def done(self, rounds: int, elapsed_s: float, samples: dict, paired: PairedRounds | None = None) -> bool:
        """Whether host timing stops after `rounds` timed rounds (warm-up excluded). `paired`:
        the rounds' ratios, which the 'paired' statistic's precision target is on."""
        by_rounds = _stop_by_rounds(self, rounds, elapsed_s)
        if by_rounds is not None:
            return by_rounds
        if elapsed_s > self.max_s:
            return True
        if self.stat == "paired":
            if paired is None:
                raise ValueError("stat='paired' needs the rounds' PairedRounds")
            return paired.precise_enough(samples, self.target_ci)
        if rounds > PRECISION_EVERY and rounds % PRECISION_EVERY:
            return False  # the check sorts every sample: not between every two rounds of thousands
        return precise_enough(samples, self.target_ci, stat=self.stat)

    def reached(self, samples: dict, paired: PairedRounds | None = None) -> bool | None:
        """Whether the precision target holds for these samples (None: no target was set), checked
        afresh: what a record says about itself when sampling stopped, at the target or at a cap."""
        if self.target_ci is None:
            return None
        if self.stat == "paired":
            if paired is None:
                raise ValueError("stat='paired' needs the rounds' PairedRounds")
            return paired.precise_enough(samples, self.target_ci, fresh=True)
        return precise_enough(samples, self.target_ci, stat=self.stat)


def draw_gaps(rng: random.Random, order: list, settings: HostSettings) -> list[float]:
    """The idle gap (seconds) before each call of a round, in `order`: none offline; in server
    mode exponential at settings.qps, one draw per call ("each") or one per round that every
    call waits ("round")."""
    if settings.mode != "server":
        return [0.0] * len(order)
    if settings.gaps == "round":
        return [rng.expovariate(settings.qps)] * len(order)
    return [rng.expovariate(settings.qps) for _ in order]


def settings_dict(s) -> dict:
    return asdict(s)


# How many calls a kernel-mode graph holds. Each replay has a fixed cost of about 4 us on an H100
# (the graph's launch and drain: two timings of one implementation whose graphs held 56 and 8
# calls differed by 0.42 us a call, 84 and 12 calls by 0.27 us, 19 and 1 by 14%), which the per-call time
# carries divided by the calls. The calls were sized from ONE call timed after a sync, which also
# times the launch and the clock's ramp, often several times the call itself: replays came out at
# a median 0.8-1.0 ms instead of 2 ms, as short as 44 us, so the fixed cost weighed 0.4% of a
# call's time at the median and up to 9%, differently for each implementation and for the same
# implementation timed twice (most of kernel mode's repeat disagreements beyond 2%). A burst of
# calls amortizes the launch and the ramp, and every implementation of a session gets the same
# number of calls (session_calls). The burst is captured in a probe graph and replayed
# (_graph_burst_us): an eager burst of a small GEMM is bound by the host's launch rate, and graphs
# sized from eager bursts still replayed in 0.75 ms (H100, 2026-11-25: 128x4096x512).
ESTIMATE_BURST_CALLS = 32
ESTIMATE_BURST_BELOW_US = 1000.0  # a single call this long is its own estimate (and needs few calls)


def estimate_burst(single_call_us: float) -> int:
    """How many calls to time back to back for the per-call estimate that sizes the graph."""
    return ESTIMATE_BURST_CALLS if single_call_us < ESTIMATE_BURST_BELOW_US else 1


def calls_per_replay(est_us: float, n_sets: int, target_replay_us: float) -> int:
    """Calls in one graph replay: whole passes over the `n_sets` input sets, enough that a replay
    takes about `target_replay_us` at `est_us` a call."""
    if not (est_us > 0 and n_sets >= 1 and target_replay_us > 0):
        raise ValueError("need a positive estimate, at least one input set and a positive target")
    return n_sets * max(1, math.ceil(target_replay_us / (est_us * n_sets)))


MAX_REPLAY_MULTIPLE = 4.0  # a slow implementation's replay may run this many times the target


def session_calls(ests_us: dict[str, float], n_sets: int, target_replay_us: float) -> dict[str, int]:
    """Calls per replay for each implementation of one kernel-mode session: the same number for
    all, sized for the fastest estimate, so every implementation's per-call time carries the same
    share of a replay's fixed cost whatever its launch path costs on the host (an eager burst of a
    tiny kernel is bound by the host's launch rate, which differs between implementations); a
    much slower implementation gets fewer, so that its replay stays within MAX_REPLAY_MULTIPLE
    times the target (it then carries even less of the fixed cost per call)."""
    if not ests_us:
        return {}
    common = calls_per_replay(min(ests_us.values()), n_sets, target_replay_us)
    return {name: min(common, calls_per_replay(est, n_sets, MAX_REPLAY_MULTIPLE * target_replay_us))
            for name, est in ests_us.items()}


def n_input_sets(problem: Problem, l2_bytes: int, s: KernelSettings) -> int:
    """Enough input sets that one pass over them is `l2_multiple` times the L2 cache."""
    per_set = problem.min_bytes + 2 * problem.K * problem.N  # A, B (both layouts), C
    want = math.ceil(s.l2_multiple * l2_bytes / per_set)
    fit = max(1, s.max_set_bytes // per_set)
    return int(max(1, min(want, s.max_sets, fit)))


def make_sets(problem: Problem, n: int, gen: torch.Generator, device="cuda"):
    dt = TORCH_DTYPES[problem.dtype]
    sets = []
    for _ in range(n):
        a = torch.randn(problem.M, problem.K, generator=gen, device=device, dtype=torch.float32).to(dt)
        b = torch.randn(problem.K, problem.N, generator=gen, device=device, dtype=torch.float32).to(dt)
        c = torch.empty(problem.M, problem.N, dtype=dt, device=device)
        sets.append((a, b, b.t().contiguous(), c))
    return sets


def _ref_half(a, b_nn):
    prev = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    try:
        return torch.matmul(a, b_nn).float()
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = prev


def _fail(status: str, reason: str) -> dict:
    return {"status": status, "n": 0, "details": {"reason": reason}}


def _capture_writing(fn, sets, n_calls: int, check: bool = True):
    """`n_calls` calls of `fn` over the input sets in turn, captured in a CUDA graph and replayed
    once. Raises if the capture fails, or if the replay leaves C unwritten: a graph that captured
    nothing (work launched on the legacy default stream instead of the caller's, as CUDA-L2's
    kernels do) runs but writes nothing. With `check` (a GEMM), the replay must also compute C
    from the inputs as they are now: the first set's A is drawn afresh before it, so a graph that
    captured only part of the work (CUDA-L2's padded calls: torch's copies into and out of the
    padded buffers on the caller's stream, their GEMM on the legacy stream, run once during the
    capture and never again) and copies out a stale result is caught too (H200, 2026-11-27: such
    graphs timed the copies alone, 1.7x under the physical floor, and returned stale outputs).
    Drawn, not negated: every capture of a session changes the one shared A, and after an even
    number of negations a result computed before them was right again, so a call captured
    second passed (H200, run 481: four padded CUDA-L2 calls passed here and failed the re-check
    after timing with error 2)."""
    n_sets = len(sets)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(*sets[i % n_sets])
    a_first, b_first, _, c_first = sets[0]
    if check:  # new inputs for the first set, drawn in place: only work the graph replays can follow them
        a_first.normal_()
    c_first.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    if torch.isnan(c_first).any():
        raise RuntimeError("the captured graph does not write C: the implementation "
                           "launches outside the caller's stream")
    if check and not rel_error(c_first, _ref_half(a_first, b_first)) <= RECHECK_TOL:
        raise RuntimeError("the captured graph writes C but does not compute it from the inputs: part of "
                           "the implementation's work runs outside the caller's stream")
    return g


def _graph_burst_us(fn, sets, burst: int, stream, check: bool = True) -> float | None:
    """Per-call time of `burst` calls captured in one probe graph and replayed (the second replay:
    the first one warms), or None where the calls cannot be captured or the captured graph does
    not write C (work launched outside the caller's stream). Eager bursts of small GEMMs are bound
    by the host's launch rate (on an H100, 32 eager torch.matmul calls of 128x64x8192 took 20 us
    a call against 7.9 us replayed), so graphs sized from them held a third of the target's calls."""
    try:
        g = _capture_writing(fn, sets, burst, check)
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record(stream)
        g.replay()
        t1.record(stream)
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) * 1e3 / burst
    except Exception:
        torch.cuda.set_stream(stream)  # see time_kernel: a failed capture leaves its stream current
        torch.cuda.synchronize()
        return None


def time_kernel(problem: Problem, calls: dict, *, l2_bytes: int, settings: KernelSettings = KernelSettings(),
                seed: int = 0, unchecked: frozenset = frozenset(),
                trace: list | None = None) -> dict[str, dict]:
    """Kernel-mode timing of `calls` (name -> fn(a, b_nn, b_tn, c)), interleaved. Each timed
    call's output is re-checked against torch.matmul afterwards, except for the names in
    `unchecked`: reference kernels that are not GEMMs (bench.floor's memory floor), whose records
    say so. `trace`, if given, receives one (round, name, per-call us) per timed replay, in the
    order the round ran them."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    n_sets = n_input_sets(problem, l2_bytes, settings)
    sets = make_sets(problem, n_sets, gen)
    results: dict[str, dict] = {}
    graphs: dict[str, tuple] = {}
    stream = torch.cuda.current_stream()
    ests: dict[str, float] = {}
    for name, fn in calls.items():  # warm each call and estimate its time
        try:
            for s in sets[: min(2, n_sets)]:
                fn(*s)  # warm: handles, plans, lazy module loads stay out of the graph
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            fn(*sets[0])
            t1.record()
            torch.cuda.synchronize()
            est_us = max(t0.elapsed_time(t1) * 1e3, 1.0)
            burst = estimate_burst(est_us)
            if burst > 1:  # the estimate from a burst of calls: see estimate_burst
                probe = _graph_burst_us(fn, sets, burst, stream, name not in unchecked)
                if probe is None:  # not capturable: an eager burst (an upper bound: the launch rate)
                    t0.record()
                    for i in range(burst):
                        fn(*sets[i % n_sets])
                    t1.record()
                    torch.cuda.synchronize()
                    probe = t0.elapsed_time(t1) * 1e3 / burst
                est_us = max(probe, 0.5)
            ests[name] = est_us
        except Exception as e:
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize()
            results[name] = _fail("error", f"{type(e).__name__}: {e}"[:500])
    if torch.cuda.current_stream() != stream:  # a call switched streams and left it so
        torch.cuda.set_stream(stream)
    sizes = session_calls(ests, n_sets, settings.target_replay_us)
    for name, n_calls in sizes.items():
        fn = calls[name]
        try:
            try:
                graphs[name] = (_capture_writing(fn, sets, n_calls, name not in unchecked), n_calls, True)
            except Exception as e:  # not capturable: time eager launches instead, and say so
                # torch.cuda.graph's exit leaves its capture stream current when capture_end raises
                # (a call that failed inside the capture): put the timing stream back, or every
                # graph after it replays on the capture stream while the events time this one
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize()
                graphs[name] = (None, n_calls, False)
                results.setdefault(name, {})["capture_error"] = f"{type(e).__name__}: {e}"[:300]
        except Exception as e:
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize()
            results[name] = _fail("error", f"{type(e).__name__}: {e}"[:500])

    def replay(name):
        g, n_calls, graphed = graphs[name]
        if graphed:
            g.replay()
        else:
            fn = calls[name]
            for i in range(n_calls):
                fn(*sets[i % n_sets])

    if torch.cuda.current_stream() != stream:  # an implementation switched streams and left it so
        torch.cuda.set_stream(stream)
    live = [n for n in calls if n in graphs]
    samples: dict[str, list[float]] = {n: [] for n in live}
    paired = PairedRounds()
    for name in live:  # warm the graphs
        replay(name)
    torch.cuda.synchronize()
    start = _perf_counter()
    rounds = 0
    while live and rounds < settings.max_rounds:
        order = live[:]
        random.shuffle(order)
        evs = []
        for name in order:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            replay(name)
            e1.record(stream)
            evs.append((name, e0, e1))
        torch.cuda.synchronize()
        for name, e0, e1 in evs:
            samples[name].append(e0.elapsed_time(e1) * 1e3 / graphs[name][1])
            if trace is not None:
                trace.append((rounds, name, samples[name][-1]))
        paired.add_round({name: samples[name][-1] for name, _, _ in evs})
        rounds += 1
        if settings.done(rounds, _perf_counter() - start, samples, paired):
            break
    if (why := clocks_intact()):
        return {n: _fail("cheat", f"timer patching: {why}") for n in calls}
    # with a precision target: whether sampling stopped because it was met (True) or at a cap
    reached = settings.reached({n: v for n, v in samples.items() if v}, paired) if rounds else None

    # re-check what the timed calls leave in C: poison, one replay, compare with torch.matmul
    a0, b0, _, c0 = sets[0]
    ref = _ref_half(a0, b0)
    for name in live:
        c0.fill_(float("nan"))
        replay(name)
        torch.cuda.synchronize()
        err = rel_error(c0, ref) if name not in unchecked else None
        info = results.get(name, {})
        details = {"sets": n_sets, "calls_per_replay": graphs[name][1], "graph": graphs[name][2],
                   "replay_us": graphs[name][1] * statistics.median(samples[name]) if samples[name] else None,
                   "recheck_err": err, **({"capture_error": info["capture_error"]} if "capture_error" in info else {}),
                   **({} if reached is None else {"target_ci": settings.target_ci, "ci_reached": reached})}
        if name in unchecked:
            details["unchecked"] = True
        elif not err <= RECHECK_TOL:
            results[name] = {"status": "wrong", "n": 0,
                             "details": {**details, "reason": f"timed output wrong: error {err:.2e}"}}
            continue
        results[name] = {**summarize_samples(samples[name]), "status": "ok", "details": details}
    if settings.stat == "paired":  # t_other / t_self, each the median of the rounds' ratios
        ok = [n for n in live if results[n].get("status") == "ok"]
        ratios = paired.ratios(ok)
        for name in ok:
            results[name]["details"]["paired"] = ratios.get(name, {})
    return results


def time_host(problem: Problem, calls: dict, *, settings: HostSettings = HostSettings(),
              seed: int = 0, trace: list | None = None) -> dict[str, dict]:
    """Host-clock timing (offline or server mode). `trace`, if given, receives one
    (round, name, gap_s, time_us) per timed call, warm-up included (round < warmup_rounds)."""
    if settings.mode not in ("offline", "server"):
        raise ValueError(f"host timing mode must be offline or server, got {settings.mode!r}")
    if settings.mode == "server" and not settings.qps > 0:
        raise ValueError("server mode needs a positive --qps")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    rng = random.Random(seed)
    (a, b_nn, b_tn, c), = make_sets(problem, 1, gen)
    recheck_every = 1 if problem.M * problem.N <= (1 << 26) else 8
    samples: dict[str, list[float]] = {n: [] for n in calls}
    paired = PairedRounds()
    failed: dict[str, dict] = {}
    sync = torch.cuda.synchronize
    start = _perf_counter()
    total = settings.warmup_rounds + settings.max_rounds
    for r in range(total):
        a.normal_(generator=gen)
        b_nn.normal_(generator=gen)
        b_tn.copy_(b_nn.t())
        check = r % recheck_every == 0
        ref = _ref_half(a, b_nn) if check else None
        order = [n for n in calls if n not in failed]
        if not order:
            break
        rng.shuffle(order)
        this_round: dict[str, float] = {}
        for name, gap in zip(order, draw_gaps(rng, order, settings)):
            fn = calls[name]
            if check:
                c.fill_(float("nan"))
            if gap:
                _sleep(gap)
            try:
                sync()
                t0 = _perf_counter()
                fn(a, b_nn, b_tn, c)
                sync()
                t1 = _perf_counter()
            except Exception as e:
                sync()
                failed[name] = _fail("error", f"{type(e).__name__}: {e}"[:500])
                continue
            if check:
                err = rel_error(c, ref)
                if not err <= RECHECK_TOL:
                    failed[name] = _fail("wrong", f"timed output wrong in round {r}: error {err:.2e}")
                    continue
            if r >= settings.warmup_rounds:
                samples[name].append((t1 - t0) * 1e6)
                this_round[name] = (t1 - t0) * 1e6
            if trace is not None:
                trace.append((r, name, gap, (t1 - t0) * 1e6))
        if settings.mode == "server":
            paired.add_round({n: t for n, t in this_round.items() if n not in failed})
        done = r + 1 - settings.warmup_rounds
        if done > 0 and settings.done(done, _perf_counter() - start,
                                      {n: v for n, v in samples.items() if n not in failed}, paired):
            break
    if (why := clocks_intact()):
        return {n: _fail("cheat", f"timer patching: {why}") for n in calls}
    out = {}
    ok_names = [n for n in calls if n not in failed]
    ratios = paired.ratios(ok_names) if settings.mode == "server" else {}
    ok_samples = {n: samples[n] for n in ok_names if samples[n]}
    # with a precision target: whether sampling stopped because it was met (True) or at a cap
    # (False: max_rounds or max_s came first); the report counts the latter per mode
    reached = settings.reached(ok_samples, paired) if ok_samples else None
    for name in calls:
        if name in failed:
            out[name] = failed[name]
        else:
            details = {} if reached is None else {"target_ci": settings.target_ci, "ci_reached": reached}
            if settings.mode == "server":
                # t_other / t_self, each the median of the rounds' ratios (stats.PairedRounds)
                details = {**details, "qps": settings.qps, "gaps": settings.gaps, "paired": ratios.get(name, {})}
            out[name] = {**summarize_samples(samples[name]), "status": "ok", "details": details}
    return out


# The search's short protocol: fewer rounds, but the same input rotation as the judge's kernel
# mode (2x the L2). With 64 sets (before 2026-11-22) a small shape's inputs stayed in L2 during
# the search and its candidates looked faster than the judge then measured them.
QUICK = KernelSettings(min_rounds=5, max_rounds=10, budget_s=0.05, target_replay_us=500.0)
# The search's candidates: QUICK's rounds with the judge's 2 ms replays. The GPU runs at its
# power limit (about 690 W on an H200) in any sustained GEMM, and its SM clock then swings
# between 1.3 and 2.0 GHz with the load of the last milliseconds; 0.5 ms bursts ran at higher
# clocks than the judge's 2 ms replays, and a kernel limited by its issue rate gained more from
# them than one limited by memory (scripts/protocol-gap.py, 2026-11-22: 12288x256x12288 ran
# 128 us in bursts, 160 us sustained; cuBLASLt 111 and 123). gpu_evaluate also times the
# shape's best baseline in the same rounds and scales by it (see there).
SEARCH = KernelSettings(min_rounds=5, max_rounds=10, budget_s=0.05, target_replay_us=2000.0)
# A baseline's own choice (cuBLASLt autotuned, exhaustive): the judge's kernel-mode protocol
# itself. Until 2026-11-25 it was QUICK, and for the reason above a choice made in 0.5 ms bursts
# could be slower in the judge's replays than the heuristic's first suggestion, one of its own
# candidates (H100 subset: 512x1024x8192 at 1.14x in four sessions).
# Since the sixteenth session: in the judge's own kernel protocol (v3: paired ratios to 0.5%, at
# most 2 s). The choices made before sat on graphs sized from eager bursts (0.75 ms replays of
# small shapes); under the probe-sized 2 ms replays a stored H100 choice for 512x1024x4096 TN ran
# 8% slower than the heuristic's first suggestion (runs 137 and 139), having been 2-5% faster.
BASELINE_PICK = KernelSettings(target_ci=0.005, max_rounds=400, max_s=2.0, stat="paired")
# Another suggestion replaces the heuristic's first only where it is at least this much faster:
# with picks in 2 ms replays and no margin, near-ties still flipped between sessions (H100
# subset, 2026-11-25: 3 of 200 picks 3-3.5% slower than the first in an independent session).
BASELINE_PICK_MARGIN = 0.01
# in a stored choice's info: made with BASELINE_PICK and BASELINE_PICK_MARGIN (a choice whose info
# lacks it, such as "picked in 2 ms replays, 1% over the first" before, is made again)
BASELINE_PICK_TAG = "paired pick in 2 ms replays, 1% over the first"


def times_beside(res: dict, first) -> dict:
    """key -> time (us) of every candidate timed ok in `res` (time_kernel's records), on `first`'s
    scale: first's median times the paired ratio t_key / t_first where first's record has it
    (kernel protocol v3), else each one's own median."""
    ok = {k: r for k, r in res.items() if r.get("status") == "ok"}
    base = ok.get(first)
    paired = (base or {}).get("details", {}).get("paired") or {}
    out = {}
    for k, r in ok.items():
        ratio = paired.get(k)
        out[k] = base["median_us"] * ratio if k != first and ratio and ratio > 0 else r["median_us"]
    return out


def pick_with_margin(times: dict, first, margin: float = BASELINE_PICK_MARGIN):
    """The fastest key of `times` (key -> median us), unless it is less than `margin` faster than
    `first` (the default, e.g. the heuristic's first suggestion), which is then kept."""
    if not times:
        raise ValueError("no times to pick from")
    best = min(times, key=times.get)
    if first in times and times[best] > times[first] * (1.0 - margin):
        return first
    return best


# A race's contenders (search.race.Race) more than this many times slower than the fastest in a
# short pre-pass leave before the precise timing (pick_fastest's `prune`). At the power limit the
# SM clock follows the load of the last milliseconds, and a round's slow contenders (the lean
# kernels of a large shape, 1.5-3x the fastest) leave the next kernel's replay a higher clock than
# the final timing's rounds give it, so the paired ratio to the baseline misreads it: on 279
# H200 fp32 races (the bench logs of runs 624-684, scripts/race-final-gap.py) the race's time of
# the winner and its final timing beside the same baselines agreed (median 1.000, 1 of 104 more
# than 3% apart) where every contender ran within 1.3x of the fastest, and the final read a
# median 3.6% slower (33 of 59 more than 3% apart, up to 16%) where one ran 2x or slower
# (results/README.md, 2026-11-29, forty-ninth session). A 1.1x contender misread by 16% stays
# inside 1.5x.
RACE_PRUNE = 1.5
# the pre-pass: 3 rounds of the caller's replays, up to 6 within 20 ms, no precision target (its
# times only prune)
PRUNE_PASS_ROUNDS = (3, 6)


def prune_slow(times: dict, factor: float) -> tuple[list, list]:
    """(kept, pruned): the keys of `times` (key -> us) within `factor` of the fastest, and the
    others, each list fastest first."""
    if not (isinstance(factor, (int, float)) and factor >= 1.0):
        raise ValueError(f"factor must be a number >= 1, got {factor!r}")
    if not times:
        return [], []
    fastest = min(times.values())
    order = sorted(times, key=lambda k: (times[k], str(k)))
    kept = [k for k in order if times[k] <= factor * fastest]
    return kept, [k for k in order if times[k] > factor * fastest]


def _l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def pick_fastest(problem: Problem, calls: dict, settings: KernelSettings = QUICK,
                 company: dict | None = None, prune: float | None = None) -> tuple[object, dict]:
    """Time candidates together in kernel mode (short protocol) and return the fastest key whose
    timed output was right, with every candidate's record. Raises if none ran correctly.

    `company` (name -> fn): implementations timed in the same rounds but never picked, such as
    the baselines a kernel will be judged beside: the candidates then run under the judge's load.
    With the paired statistic the candidates rank by their within-round time ratio to the first
    member of the company that ran (times_beside), which the rounds' shared clock divides out of.
    On an H100 one kernel ran 2-3% ahead of its rivals in races among kernels alone, and 8-16% behind
    them in most rounds beside the baselines (128x144 at 4096x8192xK, 2026-11-27)."""
    company = {k: v for k, v in (company or {}).items() if k not in calls}
    l2 = _l2_bytes()
    pruned: dict = {}
    if prune is not None and len(calls) > 1:
        # `prune`: the candidates, alone, in a few rounds first; those more than `prune` times
        # slower than the fastest leave with a 'pruned' record, and the rest are timed as without
        lo, hi = PRUNE_PASS_ROUNDS
        quick = replace(settings, min_rounds=lo, max_rounds=hi, budget_s=0.02, target_ci=None, stat="median")
        pre = time_kernel(problem, calls, l2_bytes=l2, settings=quick)
        times = {k: r["median_us"] for k, r in pre.items() if r.get("status") == "ok"}
        kept, slow = prune_slow(times, prune)
        fastest = times[kept[0]] if kept else None
        for k in slow:
            pruned[k] = {**pre[k], "status": "pruned",
                         "details": {**pre[k].get("details", {}), "pruned_ratio": times[k] / fastest,
                                     "reason": f"{times[k] / fastest:.2f}x the fastest in the pre-pass "
                                               f"(over {prune:g}x: left out of the timed rounds)"}}
        calls = {k: v for k, v in calls.items() if k not in pruned}
    res = time_kernel(problem, {**calls, **company}, l2_bytes=l2, settings=settings)
    res.update(pruned)
    ok = {k: r["median_us"] for k, r in res.items() if k in calls and r.get("status") == "ok"}
    if not ok:
        reasons = "; ".join(f"{k}: {r.get('details', {}).get('reason', r.get('status'))}"
                            for k, r in res.items() if k in calls)
        raise RuntimeError(f"none of {len(calls)} candidates ran correctly ({reasons[:500]})")
    return min(ok, key=rank_times(res, ok, company).get), res


def rank_times(res: dict, ok: dict, company: dict) -> dict:
    """key -> the time candidates in `ok` (key -> median us) rank by: their own medians, or, where
    a member of the company ran with paired ratios, each one's time on that member's scale."""
    pacer = next((n for n in company if res.get(n, {}).get("status") == "ok"
                  and res[n].get("details", {}).get("paired")), None)
    if pacer is None:
        return dict(ok)
    beside = times_beside({k: res[k] for k in (*ok, pacer)}, pacer)
    return {k: beside[k] for k in ok}
