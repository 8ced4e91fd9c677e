"""Kernels in CUDA-L2's published format, measured beside the baselines in the same run.

A CUDA-L2 kernel file (kernels/<gpu>_<acc>/<M>_<N>_<K>.cu in their repository) defines
`void cuda_l2_<gpu>_<acc>(torch::Tensor a, torch::Tensor b, torch::Tensor b_col_major,
torch::Tensor c)` on torch tensors; `b_col_major` holds B^T's memory ([N,K] row-major) under
B's [K,N] shape. It is built as a torch extension with a binding file of our own. Where its tile
sizes do not divide the problem (their own harness pads the inputs outside the clock), the call
here copies the inputs into zero-padded buffers inside the timed call: what a user would pay.
Their sources are read from a directory the user names; nothing of theirs is kept here.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

from gemmrl.build.cutlass import cutlass_include_dirs
from gemmrl.core.impl import Impl, UnsupportedProblem

FUNC_RE = re.compile(r"void\s+(cuda_l2_[A-Za-z0-9]+_fp(?:16|32))\s*\(\s*torch::Tensor")
# their harness's rule (tools/utils.py in their repository): on each line with the spaces taken
# out, the first `BM=Int<n>` (or BN, BK) anywhere in it, the last such line winning; their files
# write `auto BM = Int<128>{};`, which is `autoBM=Int<128>{};` once the spaces are gone, so the
# name has no word boundary before it (a \b here found no tile in any of their files, and kernels
# whose tiles do not divide the shape then ran unpadded and wrote out of bounds)
TILE_RE = re.compile(r"(BM|BN|BK)=Int<(\d+)>")

BINDING = """#include <torch/extension.h>
void {func}(torch::Tensor a, torch::Tensor b, torch::Tensor b_col_major, torch::Tensor c);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("run", &{func}, "CUDA-L2 kernel"); }}
"""

CUDA_FLAGS = ["-O3", "-std=c++17", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "-diag-suppress=177",
              "-gencode=arch=compute_90a,code=sm_90a"]


ENTRY_GPU_RE = re.compile(r"cuda_l2_([A-Za-z0-9]+)_fp(?:16|32)")


def written_for(verification_details: dict) -> str | None:
    """The GPU a measured CUDA-L2 kernel was written for ('h100', 'a100'), from a verification
    record's details: the entry point its description names (`cuda_l2_<gpu>_<acc>`), or, for
    records from before the description held it, the kernels the profiler saw run, whose
    mangled names carry the same prefix. None where neither says."""
    entry = ((verification_details or {}).get("impl") or {}).get("entry")
    names = [entry] if entry else list(((verification_details or {}).get("trace") or {}).get("kernels") or [])
    for name in names:
        m = ENTRY_GPU_RE.search(str(name))
        if m:
            return m.group(1).lower()
    return None


def entry_point(source: str) -> str:
    m = FUNC_RE.search(source)
    if not m:
        raise UnsupportedProblem("no `void cuda_l2_<gpu>_<acc>(torch::Tensor a, ...)` entry point found")
    return m.group(1)


def tile_sizes(source: str) -> tuple[int, int, int] | None:
    """(BM, BN, BK) where the file states them as `BM = Int<..>` (as their harness reads them)."""
    found = {}
    for line in source.splitlines():
        m = TILE_RE.search(re.sub(r"\s+", "", line))
        if m:
            found[m.group(1)] = int(m.group(2))
    if all(k in found for k in ("BM", "BN", "BK")):
        return found["BM"], found["BN"], found["BK"]
    return None


def padding(problem, tiles) -> tuple[int, int, int]:
    if tiles is None:
        return 0, 0, 0
    bm, bn, bk = tiles
    return (math.ceil(problem.M / bm) * bm - problem.M, math.ceil(problem.N / bn) * bn - problem.N,
            math.ceil(problem.K / bk) * bk - problem.K)


def module_name(source_path: str | Path, text: str | None = None) -> str:
    """The extension's name: the file's stem and a digest of its text and the build flags."""
    src = Path(source_path)
    text = src.read_text() if text is None else text
    return f"cudal2_{src.stem}_{hashlib.sha256((text + chr(0).join(CUDA_FLAGS)).encode()).hexdigest()[:16]}"


def _import_built(path: Path, name: str):
    """Import an extension built earlier (the same torch, elsewhere: a build cache carried to this
    machine holds the .so alone, without the objects torch's JIT would want to see)."""
    import importlib.util

    import torch  # noqa: F401  (the extension resolves torch's libraries from the loaded process)

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(source_path: str | Path, build_root: str | Path, verbose: bool = False):
    """Build one CUDA-L2 file as a torch extension (cached by content in build_root)."""
    from torch.utils.cpp_extension import load

    src = Path(source_path)
    text = src.read_text()
    func = entry_point(text)
    name = module_name(src, text)
    bdir = Path(build_root) / name
    built = bdir / f"{name}.so"
    if built.exists() and not (bdir / "build.ninja").exists():
        return _import_built(built, name)
    bdir.mkdir(parents=True, exist_ok=True)
    binding = bdir / "binding.cc"
    if not binding.exists():
        binding.write_text(BINDING.format(func=func))
    inc = cutlass_include_dirs()
    return load(name=name, sources=[str(src), str(binding)], build_directory=str(bdir),
                extra_cuda_cflags=CUDA_FLAGS + [f"-I{d}" for d in inc],
                extra_cflags=["-O2", "-std=c++17"], verbose=verbose)


def _build_worker(args):
    path, root = args
    try:
        build(path, root)
        return path, ""
    except Exception as e:
        return path, f"{type(e).__name__}: {e}"[-2000:]


def prebuild(paths: list[str], build_root: str, jobs: int, on_done=None) -> dict[str, str]:
    """Build many files in parallel processes; returns {path: error ('' when built)}.
    `on_done(path, error)` is called as each finishes. Interrupted (KeyboardInterrupt, or a
    SIGTERM handler raising it), it cancels the builds not started, leaves the running ones
    and re-raises: what finished is already in build_root."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ex = ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=mp.get_context("spawn"))
    out: dict[str, str] = {}
    try:
        for fut in as_completed([ex.submit(_build_worker, (p, build_root)) for p in paths]):
            path, err = fut.result()
            out[path] = err
            if on_done is not None:
                on_done(path, err)
    except KeyboardInterrupt:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown()
    return out


class CudaL2Impl(Impl):
    """All CUDA-L2 kernels in one directory: the one named <M>_<N>_<K>.cu serves that shape."""

    trusted = False
    layout = "both"
    name = "cuda-l2"

    def __init__(self, directory: str | Path, build_root: str | Path | None = None):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"CUDA-L2 kernel directory {self.dir} does not exist")
        from gemmrl.build.nvcc import cache_root

        self.build_root = Path(build_root) if build_root else cache_root() / "cuda_l2"
        self._own: set[str] | None = None
        self.padded = False
        self._entry: str | None = None  # the last prepared file's entry point (describe)

    def prebuild(self, problems, jobs: int | None = None, log=print) -> None:
        """Build the kernels these problems need, in parallel processes, before any timing."""
        paths = sorted({str(self.path_for(p)) for p in problems if self.supports(p)})
        if not paths:
            return
        jobs = jobs or max(1, (os.cpu_count() or 2) - 1)
        log(f"building {len(paths)} CUDA-L2 kernels with {jobs} processes")
        for path, err in prebuild(paths, str(self.build_root), jobs).items():
            if err:
                log(f"CUDA-L2 {Path(path).name} did not build: {err[-500:]}")

    def path_for(self, problem) -> Path:
        return self.dir / f"{problem.M}_{problem.N}_{problem.K}.cu"

    def supports(self, problem) -> bool:
        return problem.dtype == "fp16" and self.path_for(problem).exists()

    def describe(self) -> dict:
        # the entry point names the GPU the kernel was written for (cuda_l2_a100_fp16: an A100's);
        # `padded`: the last prepared call copies into padded buffers inside the timed call
        return {**super().describe(), "dir": str(self.dir), "entry": self._entry, "padded": self.padded}

    def own_kernels(self):
        # padded calls also run torch's copy kernels, so the own-kernel list is not checked there
        return None if self.padded else self._own

    def prepare(self, problem):
        import torch

        from gemmrl.runtime.abi import kernel_names

        path = self.path_for(problem)
        if not path.exists():
            raise UnsupportedProblem(f"no CUDA-L2 kernel file {path.name} in {self.dir}")
        text = path.read_text()
        self._entry = entry_point(text)
        mod = build(path, self.build_root)
        self._own = kernel_names(mod.__file__)
        run = mod.run
        pm, pn, pk = padding(problem, tile_sizes(text))
        M, N, K = problem.M, problem.N, problem.K
        self.padded = bool(pm or pn or pk)
        if not self.padded:
            def call(a, b_nn, b_tn, c):
                run(a, b_nn, b_tn.view(K, N), c)
            return call
        dev = torch.device("cuda")
        ap = torch.zeros(M + pm, K + pk, dtype=torch.float16, device=dev)
        bp = torch.zeros(K + pk, N + pn, dtype=torch.float16, device=dev)
        btp = torch.zeros(N + pn, K + pk, dtype=torch.float16, device=dev)
        cp = torch.empty(M + pm, N + pn, dtype=torch.float16, device=dev)

        def call_padded(a, b_nn, b_tn, c):
            ap[:M, :K].copy_(a)
            bp[:K, :N].copy_(b_nn)
            btp[:N, :K].copy_(b_tn)
            run(ap, bp, btp.view(K + pk, N + pn), cp)
            c.copy_(cp[:M, :N])
        return call_padded
