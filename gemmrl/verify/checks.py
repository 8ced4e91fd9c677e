"""Correctness checks. The implementation under test is assumed hostile (shared/measuring.md).

One `verify()` call runs, in the same guarded buffers: an exact {0,1} test, two random N(0,1)
tests with fresh values (defeats caches keyed on pointers or shapes), each with a NaN-poisoned
output read back on the caller's stream straight after the call (defeats side streams, threads
and deferred work), guard bands around every buffer, inputs compared to copies, the clock
functions compared to the originals, and, for untrusted implementations on a GPU, a profiler
trace: something must run, only on the caller's stream, and only the implementation's own
kernels. Any failure is a CheckResult with the reason; nothing here raises for a bad kernel.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from gemmrl.core.problem import Problem
from gemmrl.verify import trace as trace_mod

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GUARD_ELEMS = 4096
_CLOCKS = (time, "perf_counter", time.perf_counter), (time, "time", time.time), \
    (time, "monotonic", time.monotonic)
_EVENT_ELAPSED = torch.cuda.Event.elapsed_time
_SYNC = torch.cuda.synchronize


_REFS: dict = {}  # the last problem's reference results (one problem's worth of memory)


def clear_reference_cache() -> None:
    _REFS.clear()


@dataclass
class CheckResult:
    passed: bool
    reason: str = ""
    details: dict = field(default_factory=dict)


class CheckFailed(Exception):
    pass


def clocks_intact() -> str:
    """'' when the clocks the harness reads are the originals, else which one was replaced."""
    for mod, attr, orig in _CLOCKS:
        if getattr(mod, attr) is not orig:
            return f"{mod.__name__}.{attr} was replaced"
    if torch.cuda.Event.elapsed_time is not _EVENT_ELAPSED:
        return "torch.cuda.Event.elapsed_time was replaced"
    if torch.cuda.synchronize is not _SYNC:
        return "torch.cuda.synchronize was replaced"
    return ""


def error_bound(acc: str, K: int, dtype: str = "fp16") -> float:
    """Largest relative Frobenius error accepted on N(0,1) inputs, whatever cuBLAS achieves.
    fp32 accumulation: output rounding dominates (cuBLAS measures ~2e-4 at every K for fp16),
    so a fixed 1e-3; bf16 output keeps 8 bits, not 11, so 8x that (cuBLAS measured up to ~5e-3).
    fp16 accumulation: rounding in the sum grows with sqrt(K)."""
    scale = 8.0 if dtype == "bf16" else 1.0
    if acc == "fp32":
        return 1e-3 * scale
    return 1e-3 * scale * max(1.0, math.sqrt(K) / 8)


REF_FACTOR = 2.0  # no worse than this many times the reference library's error on the same inputs
REF_FLOOR = 1e-4
# fp16 accumulation on few outputs: a correct kernel that sums K in another order (split-K's fp16
# partials) may round an output one or two fp16 ulps away from the reference's, and on a handful
# of outputs that one element is most of the norm (2026-11-29, simulated: a split-4 kernel with fp16
# partials on 1x8x32 failed 2x the in-order error in 7.5% of random draws, 0 of 1,000 with this floor).
# It shrinks as 1/sqrt(outputs): near REF_FLOOR at 64x64, far below it from 256x256 on, where
# twice the yardstick (~2e-4 or more with fp16 accumulation) sets the limit anyway.
FP16_ACC_ULPS = 2.0


def fp16_ulp_floor(ref32: torch.Tensor) -> float:
    """FP16_ACC_ULPS fp16 ulps (2^-10 relative) on the largest output alone, as a relative
    Frobenius error: the most an order of summation can move a tiny output's error."""
    return FP16_ACC_ULPS * 2.0 ** -10 * ref32.abs().max().item() / max(ref32.norm().item(), 1e-30)


def rel_error(out: torch.Tensor, ref32: torch.Tensor) -> float:
    diff = (out.float() - ref32).norm().item()
    return diff / max(ref32.norm().item(), 1e-30)


class Guarded:
    """A tensor inside a larger buffer whose borders hold random bits that must never change."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator):
        numel = math.prod(shape)
        self.flat = torch.empty(numel + 2 * GUARD_ELEMS, dtype=dtype, device=device)
        bits = self.flat.view(torch.int16)
        bits.copy_(torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int32, device=device,
                                 generator=gen).to(torch.int16))
        self.t = self.flat[GUARD_ELEMS:GUARD_ELEMS + numel].view(shape)
        self._guard_copy = torch.cat([bits[:GUARD_ELEMS], bits[-GUARD_ELEMS:]]).clone()

    def guards_intact(self) -> bool:
        bits = self.flat.view(torch.int16)
        now = torch.cat([bits[:GUARD_ELEMS], bits[-GUARD_ELEMS:]])
        return bool(torch.equal(now, self._guard_copy))


def exact_inputs(problem: Problem, gen, device):
    """{0,1} inputs whose products sum exactly: density chosen so a dot product stays well
    under 2048 (exact in fp16 even for an fp16 accumulator), never all zeros."""
    M, N, K = problem.M, problem.N, problem.K
    p = min(0.5, math.sqrt(1024.0 / K))
    a = (torch.rand(M, K, generator=gen, device=device) < p)
    b = (torch.rand(K, N, generator=gen, device=device) < p)
    return a, b


def reference(a: torch.Tensor, b_nn: torch.Tensor) -> torch.Tensor:
    """fp32 product of the (exactly upcast) inputs, TF32 off."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ b_nn.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


class Buffers:
    def __init__(self, problem: Problem, device, gen):
        dt = TORCH_DTYPES[problem.dtype]
        M, N, K = problem.M, problem.N, problem.K
        self.a = Guarded((M, K), dt, device, gen)
        self.b_nn = Guarded((K, N), dt, device, gen)
        self.b_tn = Guarded((N, K), dt, device, gen)
        self.c = Guarded((M, N), dt, device, gen)

    def all(self):
        return (self.a, self.b_nn, self.b_tn, self.c)

    def fill(self, a: torch.Tensor, b_nn: torch.Tensor) -> None:
        self.a.t.copy_(a)
        self.b_nn.t.copy_(b_nn)
        self.b_tn.t.copy_(b_nn.t())


def _call_and_read(fn, bufs: Buffers, device) -> torch.Tensor:
    """Poison C, call, and copy C on the same stream right away: a result that is not in C
    when the call's stream reaches this point does not count."""
    bufs.c.t.fill_(float("nan"))
    inputs = (bufs.a.t.clone(), bufs.b_nn.t.clone(), bufs.b_tn.t.clone())
    ret = fn(bufs.a.t, bufs.b_nn.t, bufs.b_tn.t, bufs.c.t)
    out = bufs.c.t.clone()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if ret is not None:
        raise CheckFailed("the call returned a value: results must be written into C, nothing returned")
    for g, name in zip(bufs.all(), ("A", "B (NN)", "B (TN)", "C")):
        if not g.guards_intact():
            raise CheckFailed(f"wrote outside {name}: a guard band around {name} changed")
    for g, orig, name in zip(bufs.all()[:3], inputs, ("A", "B (NN)", "B (TN)")):
        if not torch.equal(g.t, orig):
            raise CheckFailed(f"input {name} was modified")
    if (why := clocks_intact()):
        raise CheckFailed(f"timer patching: {why}")
    return out


def verify(impl, problem: Problem, *, device: str | torch.device = "cuda", seed: int = 0,
           ref_fn=None, trace: bool | None = None, fn=None) -> CheckResult:
    """Run every check on one problem. `ref_fn(a, b_nn) -> C` is the reference library call
    whose error sets the relative bound (default: torch.matmul, i.e. cuBLAS); `trace` defaults
    to on for untrusted implementations on a GPU."""
    device = torch.device(device)
    details: dict = {"shape": problem.shape}
    try:
        if fn is None:
            fn = impl.prepare(problem)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        bufs = Buffers(problem, device, gen)
        dt = TORCH_DTYPES[problem.dtype]

        # references depend only on (problem, seed, reference library): computed once and
        # shared by every implementation verified on this problem in a row
        key = (problem.key(), seed, str(device), ref_fn)
        if _REFS.get("key") != key:
            _REFS.clear()
            _REFS["key"] = key
        refs = _REFS

        # 1. exact test
        a01, b01 = exact_inputs(problem, gen, device)
        bufs.fill(a01.to(dt), b01.to(dt))
        if "exact" not in refs:
            refs["exact"] = reference(bufs.a.t, bufs.b_nn.t).to(dt)
        expect = refs["exact"]
        out = _call_and_read(fn, bufs, device)
        if torch.isnan(out).any():
            raise CheckFailed(f"exact test: {int(torch.isnan(out).sum())} outputs never written (NaN poison left)")
        if not torch.equal(out, expect):
            bad = int((out != expect).sum())
            raise CheckFailed(f"exact test: {bad} of {out.numel()} outputs differ from the exact product")
        details["exact"] = True

        # 2. random tests, fresh values in the same buffers
        errs, ref_errs = [], []
        for i in range(2):
            a = torch.randn(problem.M, problem.K, generator=gen, device=device).to(dt)
            b = torch.randn(problem.K, problem.N, generator=gen, device=device).to(dt)
            bufs.fill(a, b)
            if ("rand", i) not in refs:
                ref32 = reference(bufs.a.t, bufs.b_nn.t)
                ref_out = (ref_fn or _torch_ref)(bufs.a.t, bufs.b_nn.t)
                lib_err = rel_error(ref_out, ref32)
                del ref_out
                seq_err = None
                if problem.acc == "fp16" and problem.dtype == "fp16":
                    seq_err = rel_error(fp16_sequential_reference(bufs.a.t, bufs.b_nn.t), ref32)
                refs[("rand", i)] = (ref32, lib_err, seq_err)
            ref32, lib_err, seq_err = refs[("rand", i)]
            # the yardstick: the reference library's error, or for fp16 accumulation the larger of
            # it and a non-split in-order fp16 accumulation's (fp16_sequential_reference)
            ref_err = lib_err if seq_err is None else max(lib_err, seq_err)
            out = _call_and_read(fn, bufs, device)
            if not torch.isfinite(out).all():
                n_nan = int(torch.isnan(out).sum())
                what = f"{n_nan} outputs never written (NaN poison left)" if n_nan else "Inf in the output"
                raise CheckFailed(f"random test {i + 1}: {what}")
            err = rel_error(out, ref32)
            errs.append(err)
            ref_errs.append(ref_err)
            bound = error_bound(problem.acc, problem.K, problem.dtype)
            if ref_fn is None and problem.acc != "fp32" and seq_err is None:
                limit, floor = bound, None  # torch.matmul accumulates in fp32: no fp16-accumulate yardstick
            else:
                floor = REF_FLOOR if problem.acc == "fp32" else max(REF_FLOOR, fp16_ulp_floor(ref32))
                limit = min(bound, max(REF_FACTOR * ref_err, floor))
            details.update(rel_err=max(errs), ref_err=max(ref_errs), bound=bound, limit=limit)
            if seq_err is not None:
                details.update(lib_err=lib_err, seq_err=seq_err)
            if err > limit:
                yard = (f"reference library {lib_err:.2e}" if seq_err is None else
                        f"reference library {lib_err:.2e}, in-order fp16 accumulation {seq_err:.2e}, the larger")
                raise CheckFailed(
                    f"random test {i + 1}: relative error {err:.2e} over the limit {limit:.2e} "
                    f"(bound {bound:.1e}; {yard} x {REF_FACTOR}"
                    + (f"; floor {floor:.1e})" if floor is not None else ")"))

        # 3. profiler trace: own kernels, caller's stream
        if trace is None:
            trace = device.type == "cuda" and not getattr(impl, "trusted", False)
        if trace:
            summary = trace_mod.check_call(fn, bufs.a.t, bufs.b_nn.t, bufs.b_tn.t, bufs.c.t,
                                           own=impl.own_kernels() if impl is not None else None)
            details["trace"] = summary
            if summary["problem"]:
                raise CheckFailed("trace: " + summary["problem"])
        return CheckResult(True, "", details)
    except CheckFailed as e:
        return CheckResult(False, str(e), details)
    except torch.cuda.OutOfMemoryError as e:  # noqa: F841
        return CheckResult(False, "out of device memory during verification", details)
    except Exception as e:  # a crash in the implementation is a failed check, with its text
        details["traceback"] = traceback.format_exc(limit=4)
        return CheckResult(False, f"{type(e).__name__}: {e}", details)


SEQ_K_STEP = 16  # the K of one fp16 MMA instruction (mma.sync m16n8k16, wgmma k16)


def fp16_sequential_reference(a: torch.Tensor, b_nn: torch.Tensor, k_step: int = SEQ_K_STEP) -> torch.Tensor:
    """What a correct kernel that accumulates in fp16, in K order and without splitting K,
    computes: the fp16 accumulator is rounded after every `k_step` products (one MMA
    instruction's K; its products are summed exactly enough in between). Every such kernel
    gives this result whatever its tiles (each output's chain is the same), so its error is the
    fp16-accumulate yardstick: a library that splits K (shorter chains) can be more accurate
    than any non-split kernel, its own included (2026-11-22: cuBLASLt's autotuned non-split
    algorithms failed 2x cuBLAS's split-K error on 64x4096x8192)."""
    acc = torch.zeros(a.shape[0], b_nn.shape[1], dtype=torch.float16, device=a.device)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for k0 in range(0, a.shape[1], k_step):
            acc = (acc.float() + a[:, k0:k0 + k_step].float() @ b_nn[k0:k0 + k_step].float()).half()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return acc


def _torch_ref(a: torch.Tensor, b_nn: torch.Tensor) -> torch.Tensor:
    prev = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    try:
        return torch.matmul(a, b_nn)
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = prev


def residue_problems(problem: Problem) -> list[Problem]:
    """Shapes a generic kernel must also get right: sizes that are not multiples of any tile."""
    out = [problem]
    for dm, dn, dk in ((1, 0, 0), (0, 3, 0), (0, 0, 5), (-1, -3, -7)):
        M, N, K = problem.M + dm, problem.N + dn, problem.K + dk
        if min(M, N, K) > 0:
            out.append(Problem(M, N, K, problem.dtype, problem.acc))
    return out


def verify_many(impl, problems, **kw) -> CheckResult:
    """All of `problems` must pass; the first failure is the result."""
    per = {}
    for p in problems:
        r = verify(impl, p, **kw)
        per[p.shape] = r.details
        if not r.passed:
            return CheckResult(False, f"{p.shape}: {r.reason}", per)
    return CheckResult(True, "", per)
