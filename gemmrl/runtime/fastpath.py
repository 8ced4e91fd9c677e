"""Builds and loads the C++ fast path (fastpath.cpp): the dispatch table that gemmrl.matmul and
the gemmrl::mm op look up first, so that a served call costs about what torch.matmul's own call
costs on the host (issue #4).

Built with torch.utils.cpp_extension.load (needs ninja and a C++ compiler) into
$GEMMRL_CACHE/fastpath/<hash of the source, flags, torch and Python>, once per machine; a later
process only loads it. Under a torch with CUDA it is compiled with GEMMRL_FASTPATH_CUDA and
linked to c10_cuda, so it reads the caller's current stream itself
(c10::cuda::getCurrentCUDAStream, the call behind torch._C._cuda_getCurrentRawStream). A CPU-only
torch has no libc10_cuda: the module is then built without that branch, which is what the CPU
tests exercise (with CPU tensors, in its test-only host mode).

Where cuBLASLt's headers and library are found (gemmrl.baselines.cublas.find_cublas: the nvidia
wheels torch depends on first), it is also compiled with GEMMRL_FASTPATH_LT and linked to
libcublasLt: a fallback then runs cuBLASLt with a plan made once per shape, instead of
torch.matmul's cuBLAS call, which costs more host time per call (fastpath.cpp says how much).
GEMMRL_FASTPATH_LT=0 builds without it; GEMMRL_FALLBACK=torch turns it off at run time.

`get()` is what the runtime calls: the loaded module, or None (with one warning) when it cannot
be built here, in which case gemmrl dispatches in Python as before. GEMMRL_FASTPATH=0 turns the
fast path off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("fastpath.cpp")
NAME = "gemmrl_fastpath"
BUILD_VERSION = "1"  # bump when the way the extension is built changes

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}
_failed: str | None = None


def torch_has_cuda() -> bool:
    """Whether this torch links CUDA (a libc10_cuda to link against), GPU or not."""
    import torch

    return torch.version.cuda is not None and any(
        (Path(torch.__file__).parent / "lib").glob("libc10_cuda.*"))


def cuda_include_dir() -> str | None:
    """A directory holding cuda_runtime_api.h (the c10/cuda headers include it)."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        cands.append(CUDA_HOME)
    except Exception:
        pass
    nvcc = os.environ.get("GEMMRL_NVCC") or shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    cands += ["/usr/local/cuda"]
    dirs = [str(Path(c) / "include") for c in cands if c]
    try:  # CUDA from pip wheels (nvidia-cuda-runtime, nvidia/cu13)
        import nvidia

        for root in nvidia.__path__:
            dirs += [str(p.parent) for p in Path(root).glob("*/include/cuda_runtime_api.h")]
    except ImportError:
        pass
    return next((d for d in dirs if Path(d, "cuda_runtime_api.h").is_file()), None)


def find_lt():
    """The cuBLASLt the fallback links (gemmrl.baselines.cublas.CublasPaths), or None where
    there is none or GEMMRL_FASTPATH_LT=0."""
    if os.environ.get("GEMMRL_FASTPATH_LT", "1") == "0":
        return None
    from gemmrl.baselines.cublas import find_cublas

    try:
        return find_cublas(require_lib=True)
    except RuntimeError:
        return None


def build_flags(cuda: bool, lt=None) -> dict:
    """The arguments for cpp_extension.load beside name and sources; `lt` (CublasPaths) compiles
    in the cuBLASLt fallback, linked to its libcublasLt (rpath: the same file at run time)."""
    from gemmrl.baselines.cublas import _link_flag

    flags = {"extra_cflags": ["-O2"], "extra_ldflags": [], "extra_include_paths": []}
    inc = cuda_include_dir() if (cuda or lt is not None) else None
    if lt is not None:
        if inc is None:
            raise RuntimeError("cuBLASLt was found but no cuda_runtime_api.h (set CUDA_HOME)")
        flags["extra_cflags"].append("-DGEMMRL_FASTPATH_LT")
        flags["extra_include_paths"] += [str(lt.include), inc]
        flags["extra_ldflags"] += [f"-L{lt.lib}", _link_flag(Path(lt.lib), "cublasLt"), f"-Wl,-rpath,{lt.lib}"]
    if cuda:
        if inc is None:
            raise RuntimeError("torch has CUDA but no cuda_runtime_api.h was found (set CUDA_HOME)")
        flags["extra_cflags"].append("-DGEMMRL_FASTPATH_CUDA")
        import torch

        if not (Path(torch.__file__).parent / "include/c10/cuda/impl/cuda_cmake_macros.h").exists():
            # a CPU torch's headers lack this generated file (export macros, Windows only);
            # only a build against a stand-in c10_cuda (the tests) gets here
            flags["extra_cflags"].append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
        if inc not in flags["extra_include_paths"]:
            flags["extra_include_paths"].append(inc)
        flags["extra_ldflags"].append("-lc10_cuda")
    return flags


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja wheel's may sit in a bin not on it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        d = getattr(ninja, "BIN_DIR", None)
    except ImportError:
        return
    if d and Path(d, "ninja").exists():
        os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")


def load(*, cuda: bool | None = None, lt=None, name: str = NAME, extra_ldflags: tuple[str, ...] = (),
         verbose: bool = False):
    """Build (or find built) and import the extension; raises when that fails. `lt`: None finds
    cuBLASLt where torch has CUDA (find_lt), False builds without it, a CublasPaths links that."""
    import torch
    from torch.utils.cpp_extension import load as cpp_load

    from gemmrl.build.nvcc import cache_root

    if cuda is None:
        cuda = torch_has_cuda()
    if lt is None:
        lt = find_lt() if cuda else None
    elif lt is False:
        lt = None
    flags = build_flags(cuda, lt)
    flags["extra_ldflags"] += list(extra_ldflags)
    ident = (name, cuda, None if lt is None else (str(lt.include), str(lt.lib)), tuple(extra_ldflags))
    with _lock:
        if ident in _loaded:
            return _loaded[ident]
        h = hashlib.sha256()
        for part in (SOURCE.read_bytes(), repr(sorted(flags.items())).encode(), torch.__version__.encode(),
                     sys.implementation.cache_tag.encode(), BUILD_VERSION.encode()):
            h.update(part)
            h.update(b"\0")
        build_dir = cache_root() / "fastpath" / f"{name}-{h.hexdigest()[:16]}"
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob(f"{name}*.so")):  # a build, not a load: say why the call waits
            print(f"gemmrl: compiling the C++ dispatch fast path once (about half a minute) into {build_dir}",
                  file=sys.stderr, flush=True)
        _ninja_on_path()
        mod = cpp_load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir), verbose=verbose,
                       with_cuda=False, **flags)
        _loaded[ident] = mod
        return mod


def get():
    """The fast path module, or None when it is turned off or cannot be built (warned once)."""
    global _failed
    if os.environ.get("GEMMRL_FASTPATH", "1") == "0" or _failed is not None:
        return None
    try:
        return load()
    except Exception as e:  # no compiler, no ninja, no CUDA headers...: Python dispatch instead
        _failed = f"{type(e).__name__}: {e}"
        warnings.warn(f"gemmrl: the C++ dispatch fast path cannot be built here, dispatching in "
                      f"Python instead (more host time per call): {_failed[-1500:]}",
                      RuntimeWarning, stacklevel=3)
        return None
