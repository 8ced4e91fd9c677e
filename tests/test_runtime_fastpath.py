"""The C++ fast path of the runtime (gemmrl/runtime/fastpath.cpp), compiled for real, on the CPU.

Without a GPU the extension runs in its test-only host mode: CPU tensors pass the device checks
and the stream is 0. A stand-in kernel (plain C, following the ABI, compiled here with cc) is
registered like a real one, so the lookup -> call -> status path runs as it does on a GPU. The
CUDA branch (the caller's stream from c10::cuda) is built and run against a stand-in c10_cuda."""

import ctypes
import json
import math
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import gemmrl
from gemmrl.runtime import fastpath, ops
from gemmrl.runtime.abi import AbiKernel
from gemmrl.runtime.dispatch import Dispatcher, _Call
from test_pack_dispatch import pack_dir, store  # noqa: F401  (the CPU pack of those tests)

# a stand-in kernel: C = A @ B (+1, the mark that it ran), counting its calls, keeping the
# stream and workspace it was given, refusing M == 7 (nothing written: the ABI's promise)
FAKE_KERNEL = r"""
#include <stddef.h>
#include <stdint.h>
static int calls;
static void* last_stream;
static void* last_ws;
const char* gemmrl_meta(void) {
  return TN ? "{\"layout\": \"TN\", \"dtype\": \"fp16\", \"acc\": \"fp32\", \"name\": \"host_fake\"}"
            : "{\"layout\": \"NN\", \"dtype\": \"fp16\", \"acc\": \"fp32\", \"name\": \"host_fake\"}";
}
size_t gemmrl_workspace_bytes(int M, int N, int K) { return 64; }
int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K, int lda, int ldb, int ldc,
               void* ws, void* stream) {
  if (M == 7) return 5;
  const _Float16* a = A;
  const _Float16* b = B;
  _Float16* c = C;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = 1.0f;
      for (int k = 0; k < K; ++k) s += (float)a[i * lda + k] * (float)(TN ? b[j * ldb + k] : b[k * ldb + j]);
      c[i * ldc + j] = (_Float16)s;
    }
  ++calls;
  last_stream = stream;
  last_ws = ws;
  if (ws) ((int64_t*)ws)[0] += 1;
  return 0;
}
int fake_calls(void) { return calls; }
void* fake_last_stream(void) { return last_stream; }
void* fake_last_ws(void) { return last_ws; }
"""


class Fake:
    def __init__(self, so):
        self.kernel = AbiKernel(so)  # the runtime's own loader: run_ptr is what it registers
        lib = self.kernel.lib
        lib.fake_last_stream.restype = lib.fake_last_ws.restype = ctypes.c_void_p
        self.lib = lib

    @property
    def calls(self):
        return self.lib.fake_calls()

    @property
    def last_stream(self):
        return self.lib.fake_last_stream() or 0

    @property
    def last_ws(self):
        return self.lib.fake_last_ws() or 0


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    d, cc, out = tmp_path_factory.mktemp("fake-kernels"), _cc(), {}
    (d / "fake.c").write_text(FAKE_KERNEL)
    for layout, tn in (("TN", 1), ("NN", 0)):
        so = d / f"fake_{layout}.so"
        subprocess.run([cc, "-O1", "-shared", "-fPIC", f"-DTN={tn}", str(d / "fake.c"), "-o", str(so)], check=True)
        out[layout] = Fake(str(so))
    return out


@pytest.fixture(scope="session")
def fast_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    if "GEMMRL_CACHE" not in os.environ:  # conftest's per-session cache (its fixture is per test)
        mp.setenv("GEMMRL_CACHE", str(tmp_path_factory.getbasetemp() / "gemmrl-cache"))
    try:
        yield fastpath.load()
    finally:
        mp.undo()


@pytest.fixture
def fast(fast_module):
    fast_module.set_host_mode(True)
    fast_module.clear()
    yield fast_module
    fast_module.set_host_mode(False)
    fast_module.set_limit(1 << 16)
    fast_module.clear()


def _t(*shape, dtype=torch.float16):  # small integers (never garbage: fallbacks compute with them)
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def _ints(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)  # small integers: every product is exact in fp16
    return torch.randint(-2, 3, shape, generator=g).to(torch.float16)


# ------------------------------------------------------------------------------- the table

def test_register_lookup_forget_clear(fast, fakes):
    fn = fakes["TN"].kernel.run_ptr
    ws = torch.zeros(8, dtype=torch.int64)
    fast.register(16, 64, 32, True, "fp16", -1, 0, fn, ws, 32)
    fast.register(16, 64, 32, True, "fp16", 0, 0xBEEF, fn, None, 32)
    fast.register_fallback(16, 64, 32, False, "fp16", -1, 0)
    fast.register_fallback(8, 8, 8, True, "bf16", -1, 0)
    assert fast.lookup(16, 64, 32, True, "fp16", -1, 0) == (fn, ws.data_ptr(), 32)
    assert fast.lookup(16, 64, 32, True, "fp16", 0, 0xBEEF) == (fn, 0, 32)
    assert fast.lookup(16, 64, 32, False, "fp16", -1, 0) is False  # another layout: its own key
    assert fast.lookup(16, 64, 32, True, "bf16", -1, 0) is None     # another dtype
    assert fast.lookup(16, 64, 32, True, "fp16", -1, 1) is None     # another stream
    assert fast.lookup(16, 64, 32, True, "fp16", 1, 0xBEEF) is None  # another device
    s = fast.stats()
    assert (s["entries"], s["served"], s["host_mode"]) == (4, 2, True)
    assert s["cuda_stream"] is fastpath.torch_has_cuda()
    # a refused shape falls back on every (device, stream), in both layouts' own keys only
    assert fast.forget(16, 64, 32, True, "fp16") == 2
    assert fast.lookup(16, 64, 32, True, "fp16", 0, 0xBEEF) is False
    assert fast.lookup(16, 64, 32, True, "fp16", -1, 0) is False
    assert fast.lookup(8, 8, 8, True, "bf16", -1, 0) is False
    fast.register(16, 64, 32, True, "fp16", -1, 0, fn, None, 32)  # registering again replaces
    assert fast.lookup(16, 64, 32, True, "fp16", -1, 0) == (fn, 0, 32)
    fast.clear()
    assert fast.stats()["entries"] == 0 and fast.lookup(16, 64, 32, True, "fp16", -1, 0) is None


def test_a_full_table_is_cleared_before_it_grows(fast):
    fast.set_limit(3)
    for m in (1, 2, 3):
        fast.register_fallback(m, 8, 8, True, "fp16", -1, 0)
    fast.register_fallback(2, 8, 8, True, "fp16", -1, 0)  # an existing key: no clearing
    assert fast.stats()["entries"] == 3
    fast.register_fallback(4, 8, 8, True, "fp16", -1, 0)
    assert fast.stats()["entries"] == 1 and fast.lookup(4, 8, 8, True, "fp16", -1, 0) is False


def test_bad_registrations_are_refused(fast):
    with pytest.raises(ValueError, match="dtype must be"):
        fast.register_fallback(8, 8, 8, True, "fp32", -1, 0)
    with pytest.raises(ValueError, match="address of gemmrl_run"):
        fast.register(8, 8, 8, True, "fp16", -1, 0, 0, None, 8)
    with pytest.raises(ValueError, match="M, N and K"):
        fast.register_fallback(0, 8, 8, True, "fp16", -1, 0)
    with pytest.raises(TypeError, match="ws must be"):
        fast.register(8, 8, 8, True, "fp16", -1, 0, 1, "ws", 8)
    with pytest.raises(TypeError):
        fast.run(_t(8, 8))
    assert fast.stats()["entries"] == 0


# ------------------------------------------------------------------------------- the checks

def _eligible_by_plan(plan) -> bool:
    """Whether Python's _plan lets a call reach the table (the pack's own answer aside)."""
    return plan.__class__ is tuple or plan == "no tuned kernel serves this shape" or plan.endswith("not the pack's (fp16)")


def test_checks_are_the_python_plans(fast, pack_dir):  # noqa: F811
    d = Dispatcher(gemmrl.load_pack(pack_dir))
    a, w = _t(256, 64), _t(128, 64)
    off = _t(256 * 64 + 1)[1:].view(256, 64)
    cases = {
        "served TN": (a, w, "TN"), "served NN": (a, _t(64, 128), "NN"),
        "batch dims folded": (_t(2, 128, 64), w, "TN"),
        "no kernel (K % 8)": (_t(4, 20), _t(8, 20), "TN"),
        "bf16 (not the pack's)": (a.bfloat16(), w.bfloat16(), "TN"),
        "fp32": (a.float(), w.float(), "TN"), "mixed dtypes": (a, w.bfloat16(), "TN"),
        "1-D a": (_t(64), w, "TN"), "3-D b": (a, _t(1, 128, 64), "TN"),
        "a not contiguous": (_t(64, 256).t(), w, "TN"), "b not contiguous": (a, _t(64, 128).t(), "TN"),
        "batched a not contiguous": (_t(2, 128, 64).transpose(0, 1), w, "TN"),
        "inner sizes differ": (a, _t(128, 63), "TN"), "inner sizes differ NN": (a, _t(128, 64), "NN"),
        "M = 0": (_t(0, 64), w, "TN"), "N = 0": (a, _t(0, 64), "TN"), "K = 0": (_t(4, 0), _t(8, 0), "TN"),
        "a misaligned": (off, w, "TN"), "b misaligned": (a, _t(128 * 64 + 1)[1:].view(128, 64), "TN"),
        "Parameter b": (a, torch.nn.Parameter(w, requires_grad=False), "TN"),
    }
    fallbacks = 0
    for name, (x, y, layout) in cases.items():
        plan = ops._plan(x, y, layout, d, cuda=False)
        if _eligible_by_plan(plan):
            r = fast.run(x, y, layout == "TN")
            K = x.shape[-1]
            N = y.shape[0] if layout == "TN" else y.shape[1]
            assert r == (x.numel() // K, N, K, -1, 0), (name, plan, r)  # a miss: Python resolves it
        else:  # torch.matmul, decided and computed in C++: its result, or its very error
            fallbacks += 1
            _assert_is_torch_matmul(lambda: fast.run(x, y, layout == "TN"), x, y, layout, name)
    assert fast.stats()["entries"] == 0  # run never registers anything itself
    assert fast.stats()["fallbacks"] == fallbacks
    fast.set_host_mode(False)
    # a CPU tensor, as on a real run: not a CUDA tensor, torch.matmul
    assert torch.equal(fast.run(a, w, True), torch.matmul(a, w.t()))


def _assert_is_torch_matmul(call, x, y, layout, name=""):
    """`call()` returns what torch.matmul(x, y or y.T) returns, bit for bit, or raises the same
    exception type with the same message."""
    yy = (y.t() if y.dim() <= 2 else y.transpose(-2, -1)) if layout == "TN" else y
    try:
        want = torch.matmul(x, yy)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)) as got:
            call()
        assert str(got.value) == str(e), name
        return
    r = call()
    assert type(r) is torch.Tensor and r.shape == want.shape and r.dtype == want.dtype, name
    assert torch.equal(r, want), name


def test_fallbacks_in_cpp_write_out_as_torch_matmul_does(fast):
    a, w = _t(16, 64), _t(32, 64)
    fast.register_fallback(16, 32, 64, True, "fp16", -1, 0)
    out = torch.full((16, 32), float("nan"), dtype=torch.float16)
    assert fast.run(a, w, True, out) is out and torch.equal(out, torch.matmul(a, w.t()))
    # out of another shape: resized, as torch.matmul(out=) does (with its warning)
    wrong = torch.empty(3, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fast.run(a, w, True, wrong) is wrong
    assert wrong.shape == (16, 32) and torch.equal(wrong, torch.matmul(a, w.t()))
    # out of another dtype: torch.matmul's own error
    bad = torch.empty(16, 32, dtype=torch.float32)
    with pytest.raises(RuntimeError) as e:
        torch.matmul(a, w.t(), out=bad)
    with pytest.raises(RuntimeError) as got:
        fast.run(a, w, True, bad)
    assert str(got.value) == str(e.value)
    # a fp32 call (no kernel ever) with out=
    af, wf, of = a.float(), w.float(), torch.empty(16, 32)
    assert fast.run(af, wf, True, of) is of and torch.equal(of, af @ wf.t())
    assert fast.stats()["fallbacks"] == 4


def test_subclasses_and_torch_function_modes_are_left_to_python(fast):
    class Sub(torch.Tensor):
        pass

    a, w = _t(16, 64), _t(32, 64)
    assert fast.run(a.as_subclass(Sub), w, True) is None
    assert fast.run(a, w.as_subclass(Sub), True) is None
    assert fast.run([1], w, True) is None

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert fast.run(a, w, True) is None
    assert fast.run(a, w, True) == (16, 32, 64, -1, 0)


# ------------------------------------------------------------------------------- calls

def test_a_hit_calls_the_kernel_with_its_workspace_and_stream(fast, fakes):
    for layout, fake in fakes.items():
        tn = layout == "TN"
        a, b = _ints(2, 3, 40), _ints(24, 40, seed=1) if tn else _ints(40, 24, seed=1)
        ws = torch.zeros(8, dtype=torch.int64)
        key = fast.run(a, b, tn)
        assert key == (6, 24, 40, -1, 0)
        fast.register(6, 24, 40, tn, "fp16", -1, 0, fake.kernel.run_ptr, ws, 40 if tn else 24)
        calls = fake.calls
        c = fast.run(a, b, tn)
        ref = a.float() @ (b.float().t() if tn else b.float())
        assert c.shape == (2, 3, 24) and c.dtype == torch.float16 and c.is_contiguous()
        assert torch.equal(c.float(), ref + 1)  # the stand-in's mark: it ran, not torch.matmul
        assert fake.calls == calls + 1 and fake.last_ws == ws.data_ptr() and fake.last_stream == 0
        assert ws[0].item() == 1
        # the table holds its own reference to the workspace: dropping Python's keeps it alive
        ptr, ws = ws.data_ptr(), None
        fast.run(a, b, tn)
        assert fake.last_ws == ptr and ctypes.c_int64.from_address(ptr).value == 2
    s = fast.stats()
    assert (s["hits"], s["misses"], s["refusals"]) == (4, 2, 0)


def test_a_refusal_is_reported_once_then_falls_back(fast, fakes):
    fake = fakes["TN"]
    a, w = _ints(7, 16), _ints(8, 16)
    fast.register(7, 8, 16, True, "fp16", -1, 0, fake.kernel.run_ptr, None, 16)
    calls = fake.calls
    assert fast.run(a, w, True) == (7, 8, 16, -1, 0, 5)  # the key and the kernel's status
    assert fake.calls == calls and fast.lookup(7, 8, 16, True, "fp16", -1, 0) is False
    r = fast.run(a, w, True)  # from now on torch.matmul, computed in C++
    assert fake.calls == calls and torch.equal(r, torch.matmul(a, w.t()))
    assert fast.stats()["refusals"] == 1


# ------------------------------------------------------------------------------- through ops

@pytest.fixture
def served(fast, fakes, pack_dir, monkeypatch):  # noqa: F811
    """gemmrl.matmul on CPU tensors through the C++ path, with the pack of test_pack_dispatch
    and every kernel replaced by the stand-in (Dispatcher._resolve is what builds and loads)."""
    resolved = []

    def resolve(self, M, N, K, layout, dtype, device):
        if (M, N, K, layout, dtype) in self._refused:
            return None
        entry = self.table.lookup(M, N, K, layout, dtype)
        k = fakes[layout].kernel
        ws = torch.zeros(8, dtype=torch.int64)
        resolved.append((M, N, K, layout, dtype, device))
        return _Call(k.run, ws.data_ptr(), K if layout == "TN" else N, ws, entry, k.run_ptr)

    monkeypatch.setattr(Dispatcher, "_resolve", resolve)
    monkeypatch.setattr(ops, "_FAST", fast)
    # the tiny CPU shapes are far from the pack's, and nearer to its `library` shapes (the
    # libraries won there) than to its kernels: without the list, the nearest kernel serves them
    mf = pack_dir / "manifest.json"
    m = json.loads(mf.read_text())
    m.pop("library")
    mf.write_text(json.dumps(m))
    d = ops.use_pack(pack_dir, nearest=math.inf)
    yield d, resolved
    ops.use_pack(None)


def test_matmul_misses_once_then_hits(served, fast, fakes):
    d, resolved = served
    a, w = _ints(16, 64), _ints(128, 64, seed=1)
    ref = a.float() @ w.float().t()
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(gemmrl.matmul(a, w, b_layout="TN").float(), ref + 1)
        assert torch.equal(torch.ops.gemmrl.mm(a, w, "TN").float(), ref + 1)  # the op: the same path
        b = _ints(64, 128, seed=2)
        assert torch.equal(gemmrl.matmul(a, b).float(), a.float() @ b.float() + 1)  # NN: its own kernel
    assert resolved == [(16, 128, 64, "TN", "fp16", -1), (16, 128, 64, "NN", "fp16", -1)]
    s = fast.stats()
    assert (s["misses"], s["hits"], s["served"]) == (2, 5, 2)
    assert d._calls[(16, 128, 64, "TN", "fp16", -1, 0)].fn_ptr == fakes["TN"].kernel.run_ptr


def test_matmul_fallbacks_are_registered_and_exactly_torch_matmul(served, fast):
    d, resolved = served
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(4, 20, generator=g).half(), torch.randn(8, 20, generator=g).half()),  # no kernel
             (torch.randn(16, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16())]  # bf16
    with torch.inference_mode():
        for _ in range(2):
            for a, w in cases:
                assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))
        x, y = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
        assert torch.equal(gemmrl.matmul(x, y), torch.matmul(x, y))  # fp32: decided in C++, not registered
    assert resolved == []
    # no kernel for these shapes at all: registered per shape, not per (device, stream), and
    # decided before the device and stream are read
    assert fast.lookup(4, 8, 20, True, "fp16", -1, 0) is None and fast.is_unserved(4, 8, 20, True, "fp16")
    assert fast.is_unserved(16, 8, 64, True, "bf16") and not fast.is_unserved(16, 8, 64, False, "bf16")
    s = fast.stats()
    assert (s["misses"], s["entries"], s["unserved"], s["served"], s["hits"]) == (2, 0, 2, 0, 0)
    assert s["fallbacks"] == 5, "every call computed in C++, a miss's own call too"
    # with grad: torch.matmul before any dispatch, gradients flow
    x = torch.randn(4, 64, requires_grad=True)
    gemmrl.matmul(x, torch.randn(8, 64).half().float().t().contiguous()).sum().backward()
    assert x.grad is not None


def test_matmul_refusal_disables_the_shape(served, fast):
    d, resolved = served
    a, w = _ints(7, 64), _ints(32, 64, seed=1)
    ref = torch.matmul(a, w.t())
    with pytest.warns(RuntimeWarning, match="refused 7x32x64 TN fp16 .gemmrl_run returned 5"):
        assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), ref)
    assert (7, 32, 64, "TN", "fp16") in d._refused and d._calls[(7, 32, 64, "TN", "fp16", -1, 0)] is None
    assert fast.lookup(7, 32, 64, True, "fp16", -1, 0) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disabled once: no more warnings, no more calls to it
        assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), ref)
    assert fast.stats()["refusals"] == 1 and len(resolved) == 1


def test_a_refusal_seen_by_the_python_path_reaches_the_table(served, fast):
    d, _ = served
    a, w = _ints(16, 64), _ints(32, 64, seed=1)
    gemmrl.matmul(a, w, b_layout="TN")
    assert fast.lookup(16, 32, 64, True, "fp16", -1, 0)[0] == d._calls[(16, 32, 64, "TN", "fp16", -1, 0)].fn_ptr
    with pytest.warns(RuntimeWarning, match="returned 9"):
        ops._refused(d, 16, 32, 64, "TN", "fp16", -1, 0, 9)  # what _py_mm does on a nonzero status
    assert fast.lookup(16, 32, 64, True, "fp16", -1, 0) is False
    assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))


def test_use_pack_clears_the_table(served, fast, pack_dir):  # noqa: F811
    fast.register_unserved(4, 8, 20, True, "fp16")
    with pytest.raises(ValueError, match="positive"):
        fast.register_unserved(0, 8, 20, True, "fp16")
    with pytest.raises(ValueError, match="dtype"):
        fast.register_unserved(4, 8, 20, True, "fp8")
    ops.use_pack(pack_dir, nearest=math.inf)
    assert not fast.is_unserved(4, 8, 20, True, "fp16")  # the new pack may serve it
    a, w = _ints(16, 64), _ints(32, 64, seed=1)
    gemmrl.matmul(a, w, b_layout="TN")
    assert fast.stats()["served"] == 1
    ops.use_pack(pack_dir, nearest=math.inf)
    assert fast.stats()["entries"] == 0
    gemmrl.matmul(a, w, b_layout="TN")
    assert fast.stats()["served"] == 1
    ops.use_pack(None)
    assert fast.stats()["entries"] == 0
    assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))  # no pack: torch


def test_a_pack_switch_during_a_resolution_registers_nothing(served, fast, pack_dir, monkeypatch):  # noqa: F811
    resolve = Dispatcher._resolve  # the stand-in's

    def switching(self, *args):
        call = resolve(self, *args)
        ops.use_pack(pack_dir, nearest=math.inf)  # as another thread might, while this one resolves
        return call

    monkeypatch.setattr(Dispatcher, "_resolve", switching)
    a, w = _ints(16, 64), _ints(32, 64, seed=1)
    # the old pack's call is not registered under the new one; this call goes the Python way
    assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))
    assert fast.stats()["entries"] == 0


def test_without_the_extension_the_python_path_decides(served, monkeypatch):
    monkeypatch.setattr(ops, "_FAST", None)
    a, w = _ints(16, 64), _ints(32, 64, seed=1)
    assert torch.equal(gemmrl.matmul(a, w, b_layout="TN"), torch.matmul(a, w.t()))  # CPU: fallback


# ------------------------------------------------------------------- gemmrl.matmul in C

def test_c_matmul_is_gemmrl_matmul_and_serves_like_the_python_one(served, fast, fakes):
    """The C++ module's matmul() (gemmrl.matmul where it loads): hits, misses resolved through
    Python once, out=, fallbacks computed in C++ and registered, fp32 decided in C++."""
    d, resolved = served
    cm = ops.public_matmul()
    assert cm is fast.matmul and cm.__name__ == "matmul"
    a, w = _ints(16, 64), _ints(128, 64, seed=1)
    ref = a.float() @ w.float().t()
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(cm(a, w, b_layout="TN").float(), ref + 1)
        o = torch.empty(16, 128, dtype=torch.float16)
        assert cm(a, w, b_layout="TN", out=o) is o and torch.equal(o.float(), ref + 1)
        b = _ints(64, 128, seed=2)
        assert torch.equal(cm(a, b).float(), a.float() @ b.float() + 1)  # NN: its own kernel
        assert torch.equal(cm(a, b, b_layout="NN", out=None).float(), a.float() @ b.float() + 1)
    assert resolved == [(16, 128, 64, "TN", "fp16", -1), (16, 128, 64, "NN", "fp16", -1)]
    s = fast.stats()
    assert (s["misses"], s["served"], s["to_python"]) == (2, 2, 0)
    assert s["hits"] == 4 + 2  # every call a hit: the two misses' too, once Python registered them
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 20, generator=g).half(), torch.randn(8, 20, generator=g).half()  # no kernel
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(cm(x, y, b_layout="TN"), torch.matmul(x, y.t()))
        xf, yf = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
        assert torch.equal(cm(xf, yf), torch.matmul(xf, yf))  # fp32: decided in C++
    assert fast.is_unserved(4, 8, 20, True, "fp16")
    assert fast.stats()["misses"] == 3 and fast.stats()["fallbacks"] >= 3


def test_c_matmul_without_a_pack_is_torch_matmul_and_touches_no_table(served, fast):
    ops.use_pack(None)
    cm = ops.public_matmul()
    a, w = _ints(16, 64), _ints(128, 64, seed=1)
    o = torch.empty(16, 128, dtype=torch.float16)
    assert torch.equal(cm(a, w, b_layout="TN"), torch.matmul(a, w.t()))
    assert cm(a, w, b_layout="TN", out=o) is o and torch.equal(o, torch.matmul(a, w.t()))
    s = fast.stats()
    assert (s["entries"], s["misses"], s["hits"], s["fallbacks"], s["to_python"]) == (0, 0, 0, 2, 0)


def test_c_matmul_hands_python_its_errors_grad_and_modes(served, fast):
    cm = ops.public_matmul()
    a, w = _ints(16, 64), _ints(128, 64, seed=1)
    with pytest.raises(ValueError, match="b_layout must be one of"):
        cm(a, w, b_layout="NT")
    with pytest.raises(ValueError, match="b_layout must be one of"):
        cm(a, w, b_layout=1)
    with pytest.raises(TypeError):
        cm(a, w, "TN")  # b_layout is keyword-only, as in Python
    with pytest.raises(TypeError):
        cm(a, w, layout="TN")
    with pytest.raises(TypeError):
        cm(a)
    assert fast.stats()["to_python"] == 5  # each call above, handed whole to Python
    x = torch.randn(4, 64, requires_grad=True)  # autograd: torch.matmul, gradients flow
    cm(x, torch.randn(64, 8)).sum().backward()
    assert x.grad is not None and fast.stats()["misses"] == 0 and fast.stats()["to_python"] == 6

    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(4, 20).half(), torch.randn(8, 20).half()
    with Watch():  # a mode sees the fallback's torch.matmul: the call went the Python way
        assert torch.equal(cm(x, y, b_layout="TN"), torch.matmul(x, y.t()))
    assert seen.count("matmul") >= 2


def test_c_matmul_traces_under_torch_compile(served, fast):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cm = ops.public_matmul()
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda a, b: cm(a, b, b_layout="TN") * 2, backend=backend, fullgraph=True)
        a, w = _ints(16, 64), _ints(128, 64, seed=1)
        with torch.inference_mode():
            assert torch.equal(fn(a, w).float(), (a.float() @ w.float().t() + 1) * 2)  # the op ran the kernel
        ops_in_graph = {n.target for n in graphs[0].graph.nodes if n.op == "call_function"}
        assert ops_in_graph & {torch.ops.gemmrl.mm, torch.ops.gemmrl.mm.default}, ops_in_graph
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------- loading

def test_a_build_failure_warns_once_and_dispatch_stays_in_python(monkeypatch):
    def broken(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(fastpath, "load", broken)
    monkeypatch.setattr(fastpath, "_failed", None)
    with pytest.warns(RuntimeWarning, match="cannot be built here, dispatching in Python.*Ninja"):
        assert fastpath.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fastpath.get() is None
    monkeypatch.setattr(fastpath, "_failed", None)
    monkeypatch.setenv("GEMMRL_FASTPATH", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fastpath.get() is None
    # a process without CUDA never builds it: it would have nothing to serve
    monkeypatch.setattr(ops, "_FAST", ops._UNSET)
    assert ops._fast() is None


def test_the_extension_is_built_once_into_the_cache(fast_module):
    from gemmrl.build.nvcc import cache_root

    assert fastpath.load() is fast_module  # once per process
    built = list((cache_root() / "fastpath").glob("gemmrl_fastpath-*/gemmrl_fastpath*.so"))
    assert built, "not under $GEMMRL_CACHE/fastpath"


# ------------------------------------------------------------------------------- CUDA branch

STAND_IN_C10_CUDA = r"""
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
namespace c10::cuda {
DeviceIndex current_device() { return 0; }
CUDAStream getCurrentCUDAStream(DeviceIndex device) {
  return CUDAStream(CUDAStream::UNCHECKED, Stream(Stream::UNSAFE, Device(DeviceType::CUDA, 0), 40 + device));
}
cudaStream_t CUDAStream::stream() const { return reinterpret_cast<cudaStream_t>(0x5000 + id()); }
}  // namespace c10::cuda
"""


def test_the_cuda_branch_reads_the_current_stream(tmp_path, fakes, fast_module):
    """The extension built as under a CUDA torch (GEMMRL_FASTPATH_CUDA, linked to c10_cuda),
    against a stand-in libc10_cuda whose current stream is 0x5000 + 40 + device: the key and the
    kernel get the stream that c10 says is current."""
    if fastpath.torch_has_cuda():
        pytest.skip("this torch has the real c10_cuda")
    inc = fastpath.cuda_include_dir()
    if inc is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h) here")
    from torch.utils.cpp_extension import include_paths, library_paths

    (tmp_path / "c10_cuda.cpp").write_text(STAND_IN_C10_CUDA)
    cmd = [shutil.which("c++") or "g++", "-shared", "-fPIC", "-O1", "-std=c++17",
           "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", f"-I{inc}", *(f"-I{p}" for p in include_paths()),
           str(tmp_path / "c10_cuda.cpp"), "-o", str(tmp_path / "libc10_cuda.so"),
           f"-L{library_paths()[0]}", "-lc10", "-Wl,-soname,libc10_cuda.so"]
    subprocess.run(cmd, check=True)
    m = fastpath.load(cuda=True, name="gemmrl_fastpath_cuda_stand_in",
                      extra_ldflags=(f"-L{tmp_path}", f"-Wl,-rpath,{tmp_path}"))
    assert m is not fast_module and m.stats()["cuda_stream"] is True
    m.set_host_mode(True)
    try:
        a, w = _ints(16, 32), _ints(8, 32, seed=1)
        assert m.run(a, w, True) == (16, 8, 32, -1, 0x5000 + 40 - 1)  # host mode: the current device's
        m.register(16, 8, 32, True, "fp16", -1, 0x5000 + 39, fakes["TN"].kernel.run_ptr, None, 32)
        c = m.run(a, w, True)
        assert torch.equal(c.float(), a.float() @ w.float().t() + 1)
        assert fakes["TN"].last_stream == 0x5000 + 39
    finally:
        m.set_host_mode(False)
        m.clear()


def test_a_build_says_so_once_and_a_load_says_nothing(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    monkeypatch.setattr(fastpath, "_loaded", {})

    def fake_load(name, build_directory, **kw):  # what cpp_extension leaves behind: a built .so
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")
        return object()
    monkeypatch.setattr(cpp, "load", fake_load)
    fastpath.load(cuda=False, name="gemmrl_fastpath_msgtest")
    assert "compiling the C++ dispatch fast path once" in capsys.readouterr().err
    monkeypatch.setattr(fastpath, "_loaded", {})  # a new process: the .so is in the cache
    fastpath.load(cuda=False, name="gemmrl_fastpath_msgtest")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------- out=

def test_out_is_written_by_the_kernel_only_when_it_is_exactly_the_result(fast, fakes):
    fake = fakes["TN"]
    a, w = _ints(2, 8, 40), _ints(24, 40, seed=1)
    fast.register(16, 24, 40, True, "fp16", -1, 0, fake.kernel.run_ptr, None, 40)
    ref = a.float() @ w.float().t()
    out = torch.full((2, 8, 24), 7.0, dtype=torch.float16)
    r = fast.run(a, w, True, out)
    assert r is out and torch.equal(out.float(), ref + 1)  # the stand-in wrote out itself
    assert torch.equal(fast.run(a, w, True, None).float(), ref + 1)  # None: a new tensor
    big = torch.empty(2 * 8 * 24 + 8, dtype=torch.float16)
    refused = {
        "wrong shape": torch.empty(16, 24, dtype=torch.float16),
        "wrong dtype": torch.empty(2, 8, 24, dtype=torch.float32),
        "not contiguous": torch.empty(2, 24, 8, dtype=torch.float16).transpose(1, 2),
        "misaligned": big[1:1 + 2 * 8 * 24].view(2, 8, 24),
        "aliases a": a[..., :24],
        "requires grad": torch.nn.Parameter(torch.empty(2, 8, 24, dtype=torch.float16)),
    }
    hits = fast.stats()["hits"]
    for name, o in refused.items():
        assert fast.run(a, w, True, o) is None, name  # Python decides: torch.matmul(out=) rules
    assert fast.stats()["hits"] == hits

    class Sub(torch.Tensor):
        pass
    assert fast.run(a, w, True, torch.empty(2, 8, 24, dtype=torch.float16).as_subclass(Sub)) is None


def test_matmul_out_through_the_table_and_the_fallback(served, fast):
    d, resolved = served
    a, w = _ints(16, 64), _ints(128, 64, seed=1)
    ref = a.float() @ w.float().t()
    out = torch.empty(16, 128, dtype=torch.float16)
    with torch.inference_mode():
        for _ in range(2):  # a miss resolved in Python, then a hit
            assert gemmrl.matmul(a, w, b_layout="TN", out=out) is out
            assert torch.equal(out.float(), ref + 1)
        assert fast.stats()["hits"] >= 2
        # an out the kernel may not write: torch.matmul's own out= (which resizes an empty one)
        empty = torch.empty(0, dtype=torch.float16)
        assert gemmrl.matmul(a, w, b_layout="TN", out=empty) is empty
        assert torch.equal(empty, torch.matmul(a, w.t()))
        # a shape without a kernel: torch.matmul(out=) too
        a2, w2 = _ints(4, 20), _ints(8, 20)
        o2 = torch.empty(4, 8, dtype=torch.float16)
        assert gemmrl.matmul(a2, w2, b_layout="TN", out=o2) is o2
        assert torch.equal(o2, torch.matmul(a2, w2.t()))
    with pytest.raises(ValueError, match="b_layout"):
        gemmrl.matmul(a, w, b_layout="NT", out=out)
