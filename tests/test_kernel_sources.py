"""The test kernels (tests/kernels) compile, export the ABI, and go through the build cache.

CPU only: nvcc is needed, a GPU is not. Every source is compiled once per module (two at a
time) into a cache under pytest's tmp dir; the tests then inspect those builds. Whether the
harness accepts the honest kernels and rejects every cheat is tested where a GPU is.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gemmrl.build import nvcc
from gemmrl.build.nvcc import BuildResult, build_shared

TESTS = Path(__file__).resolve().parent
KERNELS = TESTS / "kernels"
REPO = TESTS.parent
ARCH = "sm_90a"
ABI_SYMBOLS = ("gemmrl_meta", "gemmrl_workspace_bytes", "gemmrl_run")

HONEST = {"honest_nn.cu": "NN", "honest_tn.cu": "TN"}
# Each cheat and the harness check that must catch it (see the header comment of each file).
CHEATS = {
    "calls_cublas.cu": "profiler trace: kernels not its own",
    "side_stream.cu": "stream-ordered output read / trace stream id",
    "background_thread.cu": "stream-ordered output read",
    "pointer_cache.cu": "fresh inputs in the same buffers",
    "shape_cache.cu": "fresh inputs in the same buffers",
    "lazy_deferred.cu": "NaN-poisoned output",
    "precision_downgrade.cu": "random test error bound",
    "fp16_accumulate.cu": "random test error bound (K >= 1024)",
    "oob_write.cu": "guard bands",
    "partial_write.cu": "NaN-poisoned output",
    "clobbers_input.cu": "inputs unchanged",
    "uninit_read.cu": "fresh inputs / exact test run twice",
}
CUBLAS_SOURCE = "cheats/calls_cublas.cu"
ALL_SOURCES = [*HONEST, *(f"cheats/{c}" for c in CHEATS)]


# -- finding cuBLAS (headers are needed to compile calls_cublas.cu; the library to link it) -----

def _cuda_homes() -> list[Path]:
    homes = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    return homes + [Path("/usr/local/cuda")]


def _nvidia_package_dirs() -> list[Path]:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_cublas_include() -> Path | None:
    """A directory holding cublas_v2.h, or None."""
    candidates = [h / "include" for h in _cuda_homes()]
    for pkg in _nvidia_package_dirs():
        candidates += [pkg / "cu13" / "include", pkg / "cublas" / "include"]
    for cand in candidates:
        if (cand / "cublas_v2.h").is_file():
            return cand
    ext = REPO / ".ext"  # where a setup step may unpack the nvidia-cublas wheel
    if ext.is_dir():
        for header in sorted(ext.rglob("cublas_v2.h")):
            return header.parent
    return None


def find_cublas_library(include_dir: Path | None) -> tuple[str, str] | None:
    """(library_dir, -l name) for libcublas, or None. A versioned-only file is named as ':file'."""
    dirs = []
    if include_dir is not None:
        dirs += [include_dir.parent / "lib", include_dir.parent / "lib64"]
    dirs += [h / "lib64" for h in _cuda_homes()] + [h / "lib" for h in _cuda_homes()]
    for pkg in _nvidia_package_dirs():
        dirs += [pkg / "cu13" / "lib", pkg / "cublas" / "lib"]
    for d in dirs:
        if (d / "libcublas.so").exists():
            return str(d), "cublas"
        versioned = sorted(d.glob("libcublas.so.*")) if d.is_dir() else []
        if versioned:
            return str(d), ":" + versioned[0].name
    return None


CUBLAS_INCLUDE = find_cublas_include()
CUBLAS_LIB = find_cublas_library(CUBLAS_INCLUDE)
NO_CUBLAS_REASON = ("cublas_v2.h not found (looked in $CUDA_HOME/include, /usr/local/cuda/include, "
                    "the nvidia package's cu13/include, and under .ext/): calls_cublas.cu not built")


def _build_args(rel: str) -> dict:
    args = dict(name=Path(rel).stem, arch=ARCH, include_dirs=(str(KERNELS),))
    if rel == CUBLAS_SOURCE:
        args["include_dirs"] += (str(CUBLAS_INCLUDE),)
        if CUBLAS_LIB is not None:  # without it, the .so is left with cuBLAS symbols undefined
            args["library_dirs"] = (CUBLAS_LIB[0],)
            args["libraries"] = (CUBLAS_LIB[1],)
    return args


def _built_sources() -> list[str]:
    return [s for s in ALL_SOURCES if s != CUBLAS_SOURCE or CUBLAS_INCLUDE is not None]


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    try:
        nvcc.nvcc_version()  # once, before the threads
    except nvcc.NvccNotFound as e:
        pytest.skip(str(e))
    return tmp_path_factory.mktemp("nvcc-cache")


@pytest.fixture(scope="module")
def builds(cache_dir) -> dict[str, BuildResult]:
    """Every test kernel compiled once, two at a time."""
    def one(rel: str) -> BuildResult:
        return build_shared((KERNELS / rel).read_text(), cache_dir=cache_dir, **_build_args(rel))

    sources = _built_sources()
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(sources, pool.map(one, sources)))


def _get(builds: dict[str, BuildResult], rel: str) -> BuildResult:
    if rel not in builds:
        pytest.skip(NO_CUBLAS_REASON)
    return builds[rel]


def _dynamic_symbols(path: str, *extra: str) -> str:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    return subprocess.run([nm, "-D", *extra, path], capture_output=True, text=True,
                          check=True).stdout


# -- tests ----------------------------------------------------------------------------------------

def test_every_cheat_has_a_source():
    on_disk = {p.name for p in (KERNELS / "cheats").glob("*.cu")}
    assert on_disk == set(CHEATS)
    for name in CHEATS:
        head = (KERNELS / "cheats" / name).read_text()[:2000]
        assert "CHEAT" in head and "REJECTED by" in head, f"{name}: header comment missing"


@pytest.mark.parametrize("rel", ALL_SOURCES)
def test_compiles_and_exports_abi(builds, rel):
    res = _get(builds, rel)
    assert res.ok, res.log
    assert res.path and Path(res.path).is_file()
    defined = {line.split()[-1] for line in _dynamic_symbols(res.path, "--defined-only").splitlines()
               if line.strip()}
    for sym in ABI_SYMBOLS:
        assert sym in defined, f"{rel}: {sym} not exported"
    assert res.resources, f"{rel}: parse_ptxas found no kernel\n{res.log}"
    assert any(r.registers > 0 for r in res.resources), res.resources
    assert any("gemmrl_test_gemm_kernel" in r.name for r in res.resources), res.resources


@pytest.mark.parametrize("rel", ALL_SOURCES)
def test_meta(builds, rel):
    """gemmrl_meta() parses (loading the .so needs no GPU: cudart is linked statically)."""
    res = _get(builds, rel)
    assert res.ok, res.log
    if rel == CUBLAS_SOURCE and CUBLAS_LIB is None:
        pytest.skip("libcublas not found: calls_cublas.so was linked without it and cannot load")
    from gemmrl.runtime.abi import AbiKernel

    meta = AbiKernel(res.path).meta
    assert meta.layout == HONEST.get(rel, "NN")
    assert (meta.dtype, meta.acc) == ("fp16", "fp32")  # fp16_accumulate lies here on purpose
    assert meta.name == Path(rel).stem if rel in HONEST else meta.name == "cheat_" + Path(rel).stem


def test_calls_cublas_references_cublas(builds):
    res = _get(builds, CUBLAS_SOURCE)
    assert res.ok, res.log
    undefined = _dynamic_symbols(res.path, "--undefined-only")
    if CUBLAS_LIB is None:
        assert "cublasGemmEx" in undefined
    else:
        needed = subprocess.run(["readelf", "-d", res.path], capture_output=True, text=True).stdout
        assert "libcublas" in needed


@pytest.mark.parametrize("rel", ALL_SOURCES)
def test_second_build_is_a_cache_hit(builds, cache_dir, rel):
    first = _get(builds, rel)
    assert first.ok, first.log
    t0 = time.monotonic()
    again = build_shared((KERNELS / rel).read_text(), cache_dir=cache_dir, **_build_args(rel))
    elapsed = time.monotonic() - t0
    assert again.ok and again.cached
    assert (again.key, again.path) == (first.key, first.path)
    assert elapsed < first.seconds and again.seconds < first.seconds
    assert again.resources == first.resources  # the ptxas log is kept with the build


def test_syntax_error_fails_and_is_not_cached(cache_dir):
    source = ('#include "common.cuh"\n'
              'GEMMRL_EXPORT int gemmrl_run(const void* A { return definitely_not_declared; }\n')
    args = dict(name="syntax_error", arch=ARCH, include_dirs=(str(KERNELS),), cache_dir=cache_dir)
    res = build_shared(source, **args)
    assert not res.ok and res.path is None and not res.cached
    # nvcc's own diagnostics, e.g. 'kernel.cu(2): error: identifier "definitely_not_declared"
    # is undefined'
    assert "error" in res.log and "definitely_not_declared" in res.log, res.log
    assert "No such file" not in res.log, res.log  # failed for the syntax, not the include
    assert not (cache_dir / f"syntax_error-{res.key}").exists()
    again = build_shared(source, **args)
    assert not again.ok and not again.cached and again.key == res.key
    assert not (cache_dir / f"syntax_error-{res.key}").exists()
