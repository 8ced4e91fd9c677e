"""The runtime: `gemmrl.matmul`, the torch custom op `gemmrl::mm`, and `gemmrl.patch(model)`.

    gemmrl.use_pack("packs/h100-fp16")            # process-wide; refuses a foreign pack
    with torch.inference_mode():
        c = gemmrl.matmul(a, b)                    # a [.., K] @ b [K, N]
        c = gemmrl.matmul(x, w, b_layout="TN")     # x [.., K] @ w[N, K].T, as nn.Linear
    model = gemmrl.patch(model)                    # every nn.Linear through gemmrl::mm

A call runs a pack's kernel when one serves it, else it falls back: to cuBLASLt with a plan made
once per shape where the C++ fast path has it and the call is fp16/bf16, contiguous, 16-byte
aligned, at most 2^39 FLOPs and needs no autograd (`set_fallback('torch')` or GEMMRL_FALLBACK=torch: never), else to
exactly torch.matmul (a @ b, or a @ b.t() for TN). Falls back for: no active pack; CPU (non-CUDA) tensors; a tensor on another
device than the current one; a dtype other than the pack's; a and b of different dtypes or
devices; b not 2-D or a 1-D; a or b not row-major contiguous (a >2-D contiguous is viewed as
[M, K] and served; a non-contiguous one falls back); empty or misaligned (not 16-byte) data;
a shape no tuned kernel serves natively (exact entry, else the nearest generic kernel whose
validity predicate accepts it); a kernel that cannot be built or loaded here, or that refuses
the call at run time. A served call allocates only its output (and, the first time per
(kernel, shape, device, stream), the kernel's workspace, which is kept) and enqueues on torch's
current stream (torch._C._cuda_getCurrentRawStream), so it can be captured in a CUDA graph.
Warm a shape up eagerly before capturing it, as with any CUDA graph: the first call builds or
loads the kernel.

Inference only: when autograd would record the call (grad mode on and an input requiring grad),
`matmul` and patched layers use torch.matmul / F.linear instead; the op itself has no backward
(calling it directly on tensors that need grad fails at backward with torch's clear error).

Under torch.compile the op is opaque with a fake (meta) implementation that is torch.matmul's,
so shapes and strides trace exactly; the dispatch decision is made when the compiled graph runs.

The hot path is C++ (issue #4: "a C++ dispatch table with no more host overhead than
torch.matmul"): fastpath.cpp, built on first use (fastpath.py), does _plan's checks, reads the
current stream, looks (M, N, K, layout, dtype, device, stream) up in its table and launches the
kernel, allocating only the output; a call it falls back on, it also serves itself with the ATen
function torch.matmul calls (at::matmul / at::matmul_out), so a fallback costs no more host time
than torch.matmul from Python. A key it has not seen comes back here once: Python resolves
it (Dispatcher.call_for: the exact or nearest kernel, built and loaded, its workspace) and
registers the call, or the fallback, in the C++ table. Where the extension cannot be built the
whole dispatch stays in Python (one warning), with the same decisions. tests/test_runtime_gpu.py
records the host time per call of both paths beside torch.matmul's.
"""

from __future__ import annotations

import os
import threading
import types
import warnings

import torch
import torch.nn.functional as F

from gemmrl.core.problem import LAYOUTS
from gemmrl.runtime.dispatch import NEAREST_MAX_DISTANCE, Dispatcher
from gemmrl.runtime.pack import Pack, load_pack

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_is_compiling = torch.compiler.is_compiling
_ACTIVE: Dispatcher | None = None
_SWITCH = threading.Lock()  # a pack switch and a registration in the C++ table, never interleaved
_UNSET = object()
_FAST = _UNSET  # the C++ fast path (fastpath.get()) once looked for; None: dispatch in Python


def _fast():
    """The C++ fast path, built or loaded on first use; None where it is unavailable. Only with
    CUDA: a process that cannot have CUDA tensors has nothing for it to serve."""
    global _FAST
    if _FAST is _UNSET:
        from gemmrl.runtime import fastpath

        f = fastpath.get() if torch.cuda.is_available() else None
        if f is not None:
            _wire(f)
        _FAST = f
    return _FAST


FALLBACKS = ("cublaslt", "torch")


def _fallback_kind() -> str:
    kind = os.environ.get("GEMMRL_FALLBACK", "cublaslt").strip().lower() or "cublaslt"
    if kind not in FALLBACKS:
        raise ValueError(f"GEMMRL_FALLBACK must be one of {FALLBACKS}, got {kind!r}")
    return kind


_FALLBACK = _UNSET  # set_fallback's choice; unset: GEMMRL_FALLBACK's


def _fallback_choice() -> str:
    return _fallback_kind() if _FALLBACK is _UNSET else _FALLBACK


def _wire(fast) -> None:
    """Tell the C++ module's matmul() what Python serves (the full call, and a key it missed),
    whether a pack is active and what a fallback runs."""
    fast.set_python(matmul, _c_miss)
    fast.set_active(_ACTIVE is not None)
    fast.set_lt(_fallback_choice() == "cublaslt")
    _install_lt(fast, _ACTIVE)


# the active pack's cuBLASLt algorithms: device index -> the (M, N, K, layout)s installed there
_LT: dict = {"installed": {}, "refused": 0, "note": "no pack"}


def _lt_devices(pack) -> list[int]:
    """The devices the pack's cuBLASLt algorithms go to: the current one (whatever its model: a
    forced pack's algorithms are still checked by cuBLASLt) and every other visible GPU of the
    model the pack was made on."""
    from gemmrl.runtime.pack import _norm_device

    cur, made_on = torch.cuda.current_device(), _norm_device(str(pack.stamp.get("device", "")))
    return [cur] + [d for d in range(torch.cuda.device_count())
                    if d != cur and _norm_device(torch.cuda.get_device_name(d)) == made_on]


def _install_lt(fast, d: Dispatcher | None) -> None:
    """Give the C++ fallback the active pack's autotuned cuBLASLt algorithms, on the current
    device and every other GPU of the pack's model, where it links the cuBLASLt version they were
    chosen with; the rest of the shapes (and other GPUs) get the heuristic's first choice."""
    global _LT
    pack = d.pack if d is not None else None
    if pack is None or not pack.lt_algos:
        _LT = {"installed": {}, "refused": 0, "note": "no pack" if pack is None else "the pack has none"}
        return
    have = fast.lt_version()
    if have is None or not torch.cuda.is_available():
        _LT = {"installed": {}, "refused": 0, "note": "cuBLASLt is not compiled into the fast path"}
        return
    if have != pack.lt_version:
        _LT = {"installed": {}, "refused": 0,
               "note": f"chosen with cuBLASLt {pack.lt_version}, this process links {have}: heuristic plans"}
        return
    installed, refused = {}, 0
    devices = _lt_devices(pack)
    for dev in devices:
        ok = set()
        with torch.cuda.device(dev):  # the device's cuBLASLt handle is made on it
            for (M, N, K, layout), algo in pack.lt_algos.items():
                if fast.lt_install(M, N, K, layout == "TN", pack.dtype, dev, algo):
                    ok.add((M, N, K, layout))
                else:
                    refused += 1
        installed[dev] = frozenset(ok)
    _LT = {"installed": installed, "refused": refused,
           "note": "device " + ", ".join(str(x) for x in devices)}


def lt_status() -> dict:
    """The active pack's autotuned cuBLASLt algorithms in the fallback: how many were installed
    on the current device (and per device, `devices`), refused by cuBLASLt (all devices
    together), and why none were where none were."""
    per = {dev: len(s) for dev, s in _LT["installed"].items()}
    cur = torch.cuda.current_device() if per and torch.cuda.is_available() else None
    return {"installed": per.get(cur, 0), "devices": per, "refused": _LT["refused"], "note": _LT["note"]}


def set_fallback(kind: str) -> bool:
    """What a call no kernel serves runs: 'cublaslt' (the default: cuBLASLt with a plan made once
    per shape, in the C++ fast path, for fp16/bf16 contiguous calls; less host time per call than
    torch.matmul's cuBLAS) or 'torch' (torch.matmul itself, bit for bit). The environment's
    GEMMRL_FALLBACK sets the default. Returns whether cuBLASLt fallbacks are available here (the
    fast path loaded, with cuBLASLt compiled in); where they are not, every fallback is torch.matmul."""
    global _FALLBACK
    if kind not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {kind!r}")
    _FALLBACK = kind
    f = _fast()
    if f is None:
        return False
    return bool(f.set_lt(kind == "cublaslt")) and kind == "cublaslt"


def _clear_fast() -> None:
    """After a pack switch: the table's entries were the previous pack's calls."""
    if _FAST is not _UNSET and _FAST is not None:
        _FAST.clear()
        _wire(_FAST)


_POLYFILLED: set[int] = set()


def _traced_matmul(a, b, *, b_layout: str = "NN", out=None):
    """What dynamo traces in place of the C matmul (torch.compiler.substitute_in_graph)."""
    return matmul(a, b, b_layout=b_layout, out=out)


def public_matmul():
    """gemmrl.matmul: the C++ module's matmul() where it loads (no Python frame on the call: the
    host time of torch.matmul's own call), else `matmul` below. Both take and do the same; the C
    one hands Python every call it does not serve itself, and dynamo traces `matmul` for it."""
    f = _fast()
    fn = getattr(f, "matmul", None) if f is not None else None
    if fn is None:
        return matmul
    if id(fn) not in _POLYFILLED:
        sub = getattr(torch.compiler, "substitute_in_graph", None)
        if sub is None:  # an older torch: torch.compile breaks the graph at the call instead
            warnings.warn("gemmrl: this torch has no torch.compiler.substitute_in_graph; "
                          "torch.compile will not trace gemmrl.matmul", RuntimeWarning, stacklevel=2)
        else:
            sub(fn, skip_signature_check=True)(_traced_matmul)
        _POLYFILLED.add(id(fn))
    return fn


def _c_miss(a, b, layout: str, key: tuple, out=None):
    """The C matmul() missed `key` (or its kernel refused): what _mm_impl does with a miss."""
    d, fast = _ACTIVE, _FAST
    if d is None or fast is _UNSET or fast is None:
        return _fallback(a, b, layout, out)
    return _fast_miss(d, fast, a, b, layout, key, out)


# ------------------------------------------------------------------------------ activation

def use_pack(pack=None, *, force: bool = False, never_compile: bool = False,
             arch: str | None = None, nearest: float = NEAREST_MAX_DISTANCE) -> Dispatcher | None:
    """Activate a pack (a path or a loaded Pack) for the whole process; None deactivates.
    The pack's stamp is checked against the current GPU (StampError unless force); other GPUs
    of another model are checked on first use and fall back. A shape the pack was not tuned for
    is served by the nearest generic kernel within `nearest` (sum of |log2| size ratios; 0: only
    tuned shapes, math.inf: any), else by torch.matmul. Returns the Dispatcher."""
    global _ACTIVE
    if pack is None:
        with _SWITCH:
            _ACTIVE = None
            _clear_fast()
        return None
    if not isinstance(pack, Pack):
        pack = load_pack(pack)
    if torch.cuda.is_available():
        for w in pack.check_stamp(torch.cuda.get_device_name(), cuda=torch.version.cuda, force=force):
            warnings.warn(f"gemmrl: pack {pack.path}: {w}", RuntimeWarning, stacklevel=2)
    d = Dispatcher(pack, never_compile=never_compile, arch=arch, force=force, nearest=nearest)
    with _SWITCH:
        _ACTIVE = d
        _clear_fast()  # its entries are the previous pack's calls
    return d


def active() -> Dispatcher | None:
    return _ACTIVE


def warmup(workers: int | None = None, log=None) -> dict[str, str]:
    """Build every kernel of the active pack now (in parallel) and load them, and the C++ fast
    path; returns the kernels that failed, {file: log}. Afterwards never_compile mode finds them
    all."""
    d = _ACTIVE
    if d is None:
        raise RuntimeError("gemmrl.warmup: no active pack (gemmrl.use_pack first)")
    _fast()
    failed = d.build_all(workers=workers, log=log)
    for e in d.pack.entries:
        if e.file not in failed:
            d.kernel(e)
    return failed


# ------------------------------------------------------------------------------ the decision

def _plan(a, b, layout: str, d: Dispatcher | None, cuda: bool = True):
    """(M, N, K, dtype) when a kernel of `d` serves the call, else the reason to fall back.
    `cuda=False` skips the device checks (for testing the rest on CPU tensors)."""
    if d is None:
        return "no active pack"
    if cuda and not a.is_cuda:
        return "not a CUDA tensor"
    dtype = _DTYPES.get(a.dtype)
    if dtype is None or b.dtype is not a.dtype:
        return f"dtype {a.dtype} x {b.dtype}: kernels take fp16 or bf16, both alike"
    if dtype != d.pack.dtype:
        return f"dtype {dtype} is not the pack's ({d.pack.dtype})"
    if a.dim() < 2 or b.dim() != 2:
        return f"a {a.dim()}-D, b {b.dim()}-D: kernels take a [.., K] and a 2-D b"
    if b.device != a.device:
        return "a and b on different devices"
    if cuda and a.device.index != torch.cuda.current_device():
        return "not on the current device"
    if not (a.is_contiguous() and b.is_contiguous()):
        return "not row-major contiguous"
    K = a.shape[-1]
    N, Kb = (b.shape[0], b.shape[1]) if layout == "TN" else (b.shape[1], b.shape[0])
    if Kb != K:
        return "inner sizes differ"
    M = a.numel() // K if K else 0
    if M == 0 or N == 0:
        return "empty"
    if (a.data_ptr() | b.data_ptr()) & 15:
        return "data not 16-byte aligned"
    if d.lookup(M, N, K, layout, dtype) is None:
        if (M, N, K, layout, dtype) in d.table.library:
            return "tuned on this GPU, where the libraries beat every kernel of ours in this layout"
        return "no tuned kernel serves this shape"
    return (M, N, K, dtype)


def _fallback(a, b, layout: str, out=None):
    if layout == "TN":
        b = b.t() if b.dim() <= 2 else b.transpose(-2, -1)
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


def _out_ok(a, b, out, N: int) -> bool:
    """Whether a kernel may write `out` directly: exactly the result's shape, dtype and device,
    contiguous, 16-byte aligned and sharing no memory with the inputs (anything else goes to
    torch.matmul's own out= rules)."""
    if type(out) is not torch.Tensor or out.requires_grad or out.dtype is not a.dtype or out.device != a.device:
        return False
    if not out.is_contiguous() or tuple(out.shape) != (*a.shape[:-1], N) or out.data_ptr() & 15:
        return False
    o0, o1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    return all(o1 <= t.data_ptr() or t.data_ptr() + t.numel() * t.element_size() <= o0 for t in (a, b))


def _mm_impl(a, b, layout: str, out=None):
    """The dispatch: the C++ table first, Python for what it does not know. With `out`, the
    result goes there (a kernel writes it when _out_ok; else torch.matmul(out=))."""
    d = _ACTIVE
    if d is None:
        return _fallback(a, b, layout, out)
    fast = _FAST if _FAST is not _UNSET else _fast()
    if fast is not None:
        # a Tensor: the kernel's result, or torch.matmul's computed in C++ (a fallback)
        r = fast.run(a, b, layout == "TN", out)
        if r.__class__ is tuple:
            return _fast_miss(d, fast, a, b, layout, r, out)
        if r is not None:
            return r
    return _py_mm(a, b, layout, d, out)


def _fast_miss(d: Dispatcher, fast, a, b, layout: str, key: tuple, out=None):
    """A key the C++ table did not have (M, N, K, device, stream), or whose kernel refused the
    call (the same and its status): resolve or disable it here, once, then serve the call."""
    M, N, K, dev, stream = key[:5]
    dtype, tn = _DTYPES[a.dtype], layout == "TN"
    if len(key) == 6:
        _refused(d, M, N, K, layout, dtype, dev, stream, key[5])
        return _fallback(a, b, layout, out)
    # the C++ checks passed (they are _plan's): what is left is the pack's part of _plan
    call = None
    served = dtype == d.pack.dtype and d.lookup(M, N, K, layout, dtype) is not None
    if served:
        call = d.call_for(M, N, K, layout, dtype, dev, stream)
    with _SWITCH:
        if d is not _ACTIVE:  # the pack changed meanwhile: register nothing of the old one
            return _py_mm(a, b, layout, d, out)
        if not served:  # no kernel for the shape at all: decided before device and stream next time
            fast.register_unserved(M, N, K, tn, dtype)
        elif call is None:  # a kernel, but not on this device (its build or load failed)
            fast.register_fallback(M, N, K, tn, dtype, dev, stream)
        elif call.fn_ptr:
            fast.register(M, N, K, tn, dtype, dev, stream, call.fn_ptr, call.ws, call.ldb)
    if call is None:  # registered as a fallback just now: the C++ table computes it (cuBLASLt)
        r = fast.run(a, b, tn, out)
        return r if isinstance(r, torch.Tensor) else _fallback(a, b, layout, out)
    if not call.fn_ptr:  # a call only Python can make
        return _py_mm(a, b, layout, d, out)
    r = fast.run(a, b, tn, out)  # now a hit
    if r is None:  # an out= the kernel may not write directly
        return _py_mm(a, b, layout, d, out)
    if r.__class__ is not tuple:
        return r
    if len(r) == 6:
        _refused(d, M, N, K, layout, dtype, dev, stream, r[5])
        return _fallback(a, b, layout, out)
    return _py_mm(a, b, layout, d, out)  # missed again: the table was cleared meanwhile


def _refused(d: Dispatcher, M, N, K, layout, dtype, dev, stream, status) -> None:
    """A kernel returned a nonzero status (nothing was launched): never use it for this shape,
    in Python's table and in C++'s."""
    d.disable(M, N, K, layout, dtype, dev, stream, f"gemmrl_run returned {status}")
    if _FAST is not _UNSET and _FAST is not None:
        _FAST.forget(M, N, K, layout == "TN", dtype)


def _py_mm(a, b, layout: str, d: Dispatcher, out=None):
    """The dispatch in Python: where the C++ fast path is unavailable or declines a call."""
    plan = _plan(a, b, layout, d)
    if plan.__class__ is str:
        return _fallback(a, b, layout, out)
    M, N, K, dtype = plan
    if out is not None and not _out_ok(a, b, out, N):
        return _fallback(a, b, layout, out)
    dev = a.device.index
    stream = _raw_stream(dev) if _raw_stream else torch.cuda.current_stream(dev).cuda_stream
    call = d.call_for(M, N, K, layout, dtype, dev, stream)
    if call is None:
        return _fallback(a, b, layout, out)
    c = torch.empty((*a.shape[:-1], N), dtype=a.dtype, device=a.device) if out is None else out
    status = call.run(a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, K, call.ldb, N, call.ws_ptr, stream)
    if status != 0:  # nothing was launched: the ABI checks before it enqueues
        _refused(d, M, N, K, layout, dtype, dev, stream, status)
        torch.matmul(a, b.t() if layout == "TN" else b, out=c)
    return c


def _lt_fallback_name(a, b, layout: str) -> str | None:
    """What the C++ fast path's cuBLASLt fallback would run for this call ('cuBLASLt', or with
    the pack's algorithm), by its own checks less the plan (cuBLASLt may still offer no
    algorithm, and then it is torch.matmul); None where it would not take the call."""
    f = _FAST if _FAST is not _UNSET else None
    if f is None or _fallback_choice() == "torch":
        return None
    lt = f.stats().get("lt", {})
    if not (lt.get("compiled") and lt.get("on")):
        return None
    if not (a.is_cuda and a.dtype in _DTYPES and b.dtype is a.dtype and a.dim() >= 2 and b.dim() == 2
            and b.device == a.device and a.is_contiguous() and b.is_contiguous() and not _needs_grad(a, b)):
        return None
    K, (N, Kb) = a.shape[-1], ((b.shape[0], b.shape[1]) if layout == "TN" else (b.shape[1], b.shape[0]))
    if not (Kb == K and K > 0 and N > 0 and a.numel() > 0 and (a.data_ptr() | b.data_ptr()) % 16 == 0):
        return None
    M = a.numel() // K
    if ((M, N, K, layout) in _LT["installed"].get(a.device.index, ())
            and (a.data_ptr() | b.data_ptr()) % 256 == 0):
        return "cuBLASLt (the pack autotuned algorithm)"
    return "cuBLASLt" if 2.0 * M * N * K <= lt["max_flops"] else None


def explain(a, b, b_layout: str = "NN") -> str:
    """Why a call would run a kernel (which) or fall back, for people."""
    d = _ACTIVE
    plan = _plan(a, b, b_layout, d)
    if plan.__class__ is str:
        return f"{_lt_fallback_name(a, b, b_layout) or 'torch.matmul'}: {plan}"
    M, N, K, dtype = plan
    e = d.lookup(M, N, K, b_layout, dtype)
    how = "exact" if e.problem.M == M and e.problem.N == N and e.problem.K == K else f"nearest {e.problem.shape}"
    return f"{e.file} ({how})"


# ------------------------------------------------------------------------------ the op

@torch.library.custom_op("gemmrl::mm", mutates_args=())
def mm(a: torch.Tensor, b: torch.Tensor, b_layout: str = "NN") -> torch.Tensor:
    """C = a @ b (NN, b [K, N]) or a @ b.T (TN, b [N, K]) with a pack's kernel when one serves
    it, else torch.matmul. Inference only (no backward)."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    return _mm_impl(a, b, b_layout)


@mm.register_fake
def _mm_fake(a, b, b_layout="NN"):
    if b_layout not in LAYOUTS:
        raise ValueError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    return _fallback(a, b, b_layout)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def matmul(a: torch.Tensor, b: torch.Tensor, *, b_layout: str = "NN", out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (b_layout 'NN', b [K, N]) or a @ b.T ('TN', b [N, K], as nn.Linear's weight).
    With `out`, the result is written there and `out` returned, as torch.matmul(out=) does; a
    kernel writes it directly when it is exactly the result's shape, dtype and device,
    contiguous, 16-byte aligned and not sharing memory with the inputs."""
    # every check here is on the host path of every call: cheapest first, nothing allocated
    if b_layout != "NN" and b_layout != "TN":
        raise ValueError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    if (a.requires_grad or b.requires_grad) and torch.is_grad_enabled():  # _needs_grad, inlined
        return _fallback(a, b, b_layout, out)
    if _is_compiling():
        return _fallback(a, b, b_layout, out) if out is not None else torch.ops.gemmrl.mm(a, b, b_layout)
    return _mm_impl(a, b, b_layout, out)  # eager: the op's body, without the custom op's dispatch cost


# ------------------------------------------------------------------------------ nn.Linear

def _linear_forward(self, x):
    w, bias = self.weight, self.bias
    if (_needs_grad(x, w, bias) or not x.is_cuda or x.dtype is not w.dtype or x.dtype not in _DTYPES
            or (bias is not None and bias.dtype is not x.dtype)
            or (not _is_compiling() and _ACTIVE is None)):
        return F.linear(x, w, bias)
    y = matmul(x, w, b_layout="TN")
    return y if bias is None else y.add_(bias)


_PATCHED = "_gemmrl_patched_forward"  # the instance's own forward before patching (or None)


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Route every nn.Linear of `model` (exactly nn.Linear: subclasses such as quantized layers
    keep their own forward) through gemmrl::mm with its weight as a TN operand, plus bias.
    In place; returns the model. Idempotent; `unpatch` undoes it."""
    for m in model.modules():
        if type(m) is torch.nn.Linear and _PATCHED not in m.__dict__:
            m.__dict__[_PATCHED] = m.__dict__.get("forward")
            m.forward = types.MethodType(_linear_forward, m)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if _PATCHED in m.__dict__:
            prev = m.__dict__.pop(_PATCHED)
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = prev
    return model
