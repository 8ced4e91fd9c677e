"""The kernel ABI: every candidate, whatever wrote it, is one .cu exporting these C symbols.

    extern "C" const char* gemmrl_meta(void);
        // JSON: {"layout": "NN"|"TN", "dtype": "fp16"|"bf16", "acc": "fp32"|"fp16", "name": "..."}
    extern "C" size_t gemmrl_workspace_bytes(int M, int N, int K);
    extern "C" int gemmrl_run(const void* A, const void* B, void* C, int M, int N, int K,
                              int lda, int ldb, int ldc, void* workspace, cudaStream_t stream);
        // 0 on success; nonzero: the shape is not supported (nothing was launched) or an error.

Row-major A [M,K]; B [K,N] for NN, [N,K] for TN; C [M,N] with the input dtype. A call enqueues
work on `stream` only: no allocation, no synchronisation, no host round trip, so it can be
captured in a CUDA graph. No torch headers.
"""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass

from gemmrl.core.problem import DTYPES, ACCS, LAYOUTS

REQUIRED_SYMBOLS = ("gemmrl_meta", "gemmrl_workspace_bytes", "gemmrl_run")


class AbiError(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelMeta:
    layout: str
    dtype: str
    acc: str
    name: str

    @staticmethod
    def parse(text: str) -> "KernelMeta":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise AbiError(f"gemmrl_meta() is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise AbiError("gemmrl_meta() must return a JSON object")
        layout, dtype, acc = d.get("layout"), d.get("dtype", "fp16"), d.get("acc", "fp32")
        if layout not in LAYOUTS:
            raise AbiError(f"gemmrl_meta(): layout must be one of {LAYOUTS}, got {layout!r}")
        if dtype not in DTYPES:
            raise AbiError(f"gemmrl_meta(): dtype must be one of {DTYPES}, got {dtype!r}")
        if acc not in ACCS:
            raise AbiError(f"gemmrl_meta(): acc must be one of {ACCS}, got {acc!r}")
        return KernelMeta(layout, dtype, acc, str(d.get("name", "kernel")))


class AbiKernel:
    """A loaded shared object that follows the ABI."""

    def __init__(self, so_path: str):
        try:
            self.lib = ctypes.CDLL(so_path)
        except OSError as e:
            raise AbiError(f"cannot load {so_path}: {e}") from None
        missing = [s for s in REQUIRED_SYMBOLS if not hasattr(self.lib, s)]
        if missing:
            raise AbiError(f"{so_path} lacks the ABI symbols {', '.join(missing)}")
        self.path = so_path
        self.lib.gemmrl_meta.restype = ctypes.c_char_p
        self.lib.gemmrl_meta.argtypes = []
        self.lib.gemmrl_workspace_bytes.restype = ctypes.c_size_t
        self.lib.gemmrl_workspace_bytes.argtypes = [ctypes.c_int] * 3
        self.lib.gemmrl_run.restype = ctypes.c_int
        self.lib.gemmrl_run.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2
        self.meta = KernelMeta.parse(self.lib.gemmrl_meta().decode())
        self._run = self.lib.gemmrl_run
        # the address of gemmrl_run, for callers in C++ (the runtime's fast path); ctypes never
        # unloads a library, so it stays valid for the life of the process
        self.run_ptr = ctypes.cast(self._run, ctypes.c_void_p).value

    def workspace_bytes(self, M: int, N: int, K: int) -> int:
        return int(self.lib.gemmrl_workspace_bytes(M, N, K))

    def run(self, a_ptr: int, b_ptr: int, c_ptr: int, M: int, N: int, K: int,
            lda: int, ldb: int, ldc: int, workspace_ptr: int, stream: int) -> int:
        return self._run(a_ptr, b_ptr, c_ptr, M, N, K, lda, ldb, ldc, workspace_ptr, stream)


_STUB = re.compile(r"(\d+)__device_stub__")


def kernel_names(so_path: str) -> set[str]:
    """Names of the __global__ functions defined in a shared object, as a profiler may report
    them: demangled, and mangled (kineto gives long CUTLASS names mangled). nvcc emits host
    symbols named after each kernel's launch stub, `__device_stub__<mangled kernel name>`: the
    stub function, or only its static variables when the stub is inlined. Inside the symbol the
    stub's identifier carries its length (`...L1253__device_stub__ZN7cutlass...`), which says
    exactly where the kernel's name ends; the rest of the symbol is the stub's parameters."""
    import subprocess

    out = subprocess.run(["nm", "--defined-only", so_path], capture_output=True, text=True,
                         check=True).stdout
    names, mangled = set(), set()
    for sym in (ln.split()[-1] for ln in out.splitlines() if "__device_stub__" in ln):
        for m in _STUB.finditer(sym):
            ident = sym[m.start(0) + len(m.group(1)):][:int(m.group(1))]
            kernel = ident[len("__device_stub__"):]
            if not kernel:
                continue
            if kernel.startswith("Z"):
                mangled.add("_" + kernel)
            else:
                names.add(kernel)  # extern "C": the kernel's symbol is its plain name
    names |= mangled
    if mangled:
        dem = subprocess.run(["c++filt"], input="\n".join(sorted(mangled)), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        names.update(d.strip() for d in dem if d.strip())
    return names


def abi_call(kernel: AbiKernel, problem, name: str):
    """The harness call `fn(a, b_nn, b_tn, c)` for a loaded ABI kernel and one problem: the
    workspace is allocated here, once; the call passes pointers and torch's current stream."""
    import torch

    M, N, K = problem.M, problem.N, problem.K
    ws = torch.empty(max(kernel.workspace_bytes(M, N, K), 1), dtype=torch.uint8, device="cuda")
    ws_ptr = ws.data_ptr()
    run, tn = kernel.run, kernel.meta.layout == "TN"
    ldb = K if tn else N
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    dev = torch.cuda.current_device()

    def call(a, b_nn, b_tn, c, _ws=ws):
        b = b_tn if tn else b_nn
        stream = raw_stream(dev) if raw_stream else torch.cuda.current_stream().cuda_stream
        status = run(a.data_ptr(), b.data_ptr(), c.data_ptr(), M, N, K, K, ldb, N, ws_ptr, stream)
        if status != 0:
            raise AbiError(f"{name}: gemmrl_run returned {status} for {problem.shape}")

    return call


class AbiImpl:
    """A candidate kernel (.cu source or built .so) that follows the ABI, as a harness Impl."""

    trusted = False

    def __init__(self, path: str, name: str | None = None, include_dirs: tuple[str, ...] = (),
                 arch: str = "sm_90a", libraries: tuple[str, ...] = (),
                 library_dirs: tuple[str, ...] = ()):
        from pathlib import Path

        p = Path(path)
        if not p.exists():
            raise AbiError(f"kernel file {path} does not exist")
        if p.suffix == ".cu":
            from gemmrl.build.nvcc import build_shared

            source = p.read_text()
            if re.search(r"#\s*include\s*[<\"]cublas", source):
                # a candidate may link cuBLAS (the trace check then sees whose kernels ran)
                from gemmrl.baselines.cublas import find_cublas

                cb = find_cublas()
                include_dirs = (*include_dirs, str(cb.include))
                library_dirs = (*library_dirs, str(cb.lib))
                libraries = (*libraries, *(f[2:] for f in cb.link_flags()))
            res = build_shared(source, name=p.stem, arch=arch,
                               include_dirs=(str(p.parent), *include_dirs),
                               libraries=libraries, library_dirs=library_dirs)
            if not res.ok:
                raise AbiError(f"{path} failed to build:\n{res.log[-3000:]}")
            so = res.path
        else:
            so = str(p)
        self.kernel = AbiKernel(so)
        self.name = name or f"kernel:{p.stem}"
        self.layout = self.kernel.meta.layout
        self._own = None

    def supports(self, problem) -> bool:
        return (problem.dtype, problem.acc) == (self.kernel.meta.dtype, self.kernel.meta.acc)

    def own_kernels(self) -> set[str]:
        if self._own is None:
            self._own = kernel_names(self.kernel.path)
        return self._own

    def prepare(self, problem):
        return abi_call(self.kernel, problem, self.name)

    def describe(self) -> dict:
        return {"name": self.name, "layout": self.layout, "so": self.kernel.path,
                "meta": self.kernel.meta.__dict__}
