"""NVIDIA's own GEMMs as baselines: cublasGemmEx and cuBLASLt, through a small C-ABI library.

`cublas_baselines.cu` (beside this file) is compiled by nvcc into a cached shared object and
loaded with ctypes; nothing here imports torch. Pointers and streams are plain integers
(`tensor.data_ptr()`, `torch.cuda.current_stream().cuda_stream`).

Conventions (see the .cu file): row-major A [M,K]; layout 'NN' takes B as [K,N], layout 'TN'
takes B as [N,K] and computes A @ B^T; C [M,N] has the input dtype; alpha = 1, beta = 0.
`gemm` and `run` never allocate or synchronize, so they can be captured into a CUDA graph;
they share one workspace, so don't run them concurrently on different streams.

It is built with the project's build cache (gemmrl.build.nvcc). The pure parts (argument
mapping, finding cuBLAS) need no GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from gemmrl.build.nvcc import build_shared, cache_root

SOURCE = Path(__file__).with_name("cublas_baselines.cu")
ALGO_BYTES = 64  # sizeof(cublasLtMatmulAlgo_t)
DEFAULT_ARCH = "sm_90"
MAX_HEURISTIC = 100

LAYOUTS = {"NN": 0, "TN": 1}
DTYPES = {"fp16": 0, "bf16": 1}
ACCS = {"fp32": 0, "fp16": 1}

# Status codes of the library's own errors (negative); cuBLAS statuses are returned as they are,
# CUDA runtime errors as CUDA_ERROR_BASE + cudaError_t.
CUDA_ERROR_BASE = 10000
ERR_ARG, ERR_NOT_INIT, ERR_PLAN, ERR_NO_ALGO, ERR_WORKSPACE, ERR_MISALIGNED, ERR_ALGO_REJECTED = range(-1, -8, -1)


class CublasError(RuntimeError):
    """A nonzero status from the baselines library."""

    def __init__(self, func: str, status: int, detail: str = ""):
        self.func = func
        self.status = status
        msg = f"{func} failed with status {status}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


# ---------------------------------------------------------------------------------------------
# Pure helpers (no GPU, no nvcc)


def map_args(layout: str, dtype: str, acc: str) -> tuple[int, int, int]:
    """('NN'|'TN', 'fp16'|'bf16', 'fp32'|'fp16') -> the library's integer codes."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    if acc not in ACCS:
        raise ValueError(f"unknown accumulator {acc!r}: expected one of {sorted(ACCS)}")
    if acc == "fp16" and dtype != "fp16":
        raise ValueError(f"fp16 accumulation is only available for fp16 inputs, not {dtype!r}")
    return LAYOUTS[layout], DTYPES[dtype], ACCS[acc]


def check_shape(M: int, N: int, K: int) -> tuple[int, int, int]:
    out = []
    for name, v in (("M", M), ("N", N), ("K", K)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31:
            raise ValueError(f"{name} must be a positive int below 2**31, got {v!r}")
        out.append(v)
    return out[0], out[1], out[2]


def parse_description(text: str) -> dict[str, int]:
    """'algo=23 tile=20 stages=8 ...' (from describe) -> {'algo': 23, 'tile': 20, ...}."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", text)}


# cublasLtMatmulTile_t: enum value -> rows x columns (cuBLAS's m x n) of the first 35 (CUDA 11's;
# CUDA 13's cublasLt.h lists 600+, read by lt_enums where the header is found: 184 is 144x128,
# 197 168x128, 495 256x96)
LT_TILES = {1: (8, 8), 2: (8, 16), 3: (16, 8), 4: (8, 32), 5: (16, 16), 6: (32, 8), 7: (8, 64), 8: (16, 32),
            9: (32, 16), 10: (64, 8), 11: (32, 32), 12: (32, 64), 13: (64, 32), 14: (32, 128), 15: (64, 64),
            16: (128, 32), 17: (64, 128), 18: (128, 64), 19: (64, 256), 20: (128, 128), 21: (256, 64),
            22: (64, 512), 23: (128, 256), 24: (256, 128), 25: (512, 64), 26: (64, 96), 27: (96, 64),
            28: (96, 128), 29: (128, 160), 30: (160, 128), 31: (192, 128), 32: (128, 192), 33: (128, 96),
            34: (32, 256), 35: (256, 32)}
# cublasLtClusterShape_t: enum value -> (m, n)
LT_CLUSTERS = {2: (1, 1), 3: (2, 1), 4: (4, 1), 5: (1, 2), 6: (2, 2), 7: (4, 2), 8: (1, 4), 9: (2, 4),
               10: (4, 4), 11: (8, 1), 12: (1, 8), 13: (8, 2), 14: (2, 8), 15: (16, 1), 16: (1, 16)}

_LT_TILE = re.compile(r"CUBLASLT_MATMUL_TILE_(\d+)x(\d+)\s*=\s*(\d+)")
_LT_CLUSTER = re.compile(r"CUBLASLT_CLUSTER_SHAPE_(\d+)x(\d+)x1\s*=\s*(\d+)")


def lt_enums(header_text: str) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """cublasLt.h's text -> ({cublasLtMatmulTile_t value: (rows, columns)},
    {cublasLtClusterShape_t value: (m, n)}), read from the header's enums (CUDA 13's lists 600+
    tiles, e.g. CUBLASLT_MATMUL_TILE_168x128 = 197): the numbers a stored algorithm description
    ('tile=197 cluster=5', describe()) names. Raises ValueError on a text without the tile enum."""
    tiles = {int(v): (int(m), int(n)) for m, n, v in _LT_TILE.findall(header_text)}
    clusters = {int(v): (int(m), int(n)) for m, n, v in _LT_CLUSTER.findall(header_text)}
    if not tiles:
        raise ValueError("no CUBLASLT_MATMUL_TILE_<m>x<n> = <value> entries: not cublasLt.h")
    return tiles, clusters


def lt_enum_tables(header: Path | None = None, extra_roots: tuple[Path, ...] = ()) -> tuple[dict, dict, str]:
    """(tiles, clusters, source): LT_TILES and LT_CLUSTERS with every entry of cublasLt.h added
    (`header`, else where lt_header finds one), and where they came from. Without a header the
    CUDA 11 tables alone: a newer tile (enum above 35) is then unknown."""
    tiles, clusters = dict(LT_TILES), dict(LT_CLUSTERS)
    if header is None:
        header = lt_header(extra_roots)
    if header is None:
        return tiles, clusters, "no cublasLt.h found: CUDA 11's tiles only"
    more_tiles, more_clusters = lt_enums(Path(header).read_text(errors="replace"))
    tiles.update(more_tiles)
    clusters.update(more_clusters)
    return tiles, clusters, f"tiles from {header}"


def lt_header(extra_roots: tuple[Path, ...] = ()) -> Path | None:
    """cublasLt.h where find_cublas looks (headers only), else under one of `extra_roots`
    (e.g. a checkout's .ext/*/nvidia/cu13, where .ci/run unpacks the headers); None if absent."""
    try:
        return find_cublas(require_lib=False).include / "cublasLt.h"
    except RuntimeError:
        pass
    for root in extra_roots:
        inc = next((d for d in _include_dirs(root) if _has_headers(d)), None)
        if inc is not None:
            return inc / "cublasLt.h"
    return None


@dataclass(frozen=True)
class CublasPaths:
    include: Path  # holds cublas_v2.h, cublasLt.h, cublas_api.h
    lib: Path  # holds libcublas.so* and libcublasLt.so*
    origin: str  # where it was found, for messages

    def link_flags(self) -> list[str]:
        """-l flags; the pip wheels ship only versioned names (libcublas.so.13), linked by file name."""
        return [_link_flag(self.lib, name) for name in ("cublasLt", "cublas")]


def _link_flag(lib: Path, name: str) -> str:
    if (lib / f"lib{name}.so").exists():
        return f"-l{name}"
    versioned = sorted(lib.glob(f"lib{name}.so.*"), key=lambda p: (len(p.name), p.name))
    if versioned:
        return f"-l:{versioned[0].name}"
    return f"-l{name}"


def _has_headers(include: Path) -> bool:
    return all((include / h).is_file() for h in ("cublas_v2.h", "cublasLt.h", "cublas_api.h"))


def _has_libs(lib: Path) -> bool:
    return all(any(lib.glob(f"lib{n}.so*")) for n in ("cublas", "cublasLt"))


def _lib_dirs(root: Path) -> list[Path]:
    return [root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib",
            root / "targets" / "sbsa-linux" / "lib"]


def _include_dirs(root: Path) -> list[Path]:
    return [root / "include", root / "targets" / "x86_64-linux" / "include",
            root / "targets" / "sbsa-linux" / "include"]


def _candidates() -> list[tuple[str, Path]]:
    """(origin, root) pairs in the order they are tried, the env-var one first."""
    out: list[tuple[str, Path]] = []
    home = os.environ.get("GEMMRL_CUBLAS_HOME")
    if home:
        out.append(("GEMMRL_CUBLAS_HOME", Path(home)))
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels (torch depends on them)

        for base in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13", "cublas", "cu12"):
                out.append((f"python package nvidia.{sub}", Path(base) / sub))
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((var, Path(os.environ[var])))
    out.append(("/usr/local/cuda", Path("/usr/local/cuda")))
    return out


def find_cublas(require_lib: bool = True) -> CublasPaths:
    """Locate cuBLAS headers (and libraries): GEMMRL_CUBLAS_HOME, the `nvidia` pip packages
    (nvidia/cu13, nvidia/cublas), CUDA_HOME / CUDA_PATH, /usr/local/cuda."""
    looked = []
    for origin, root in _candidates():
        inc = next((d for d in _include_dirs(root) if _has_headers(d)), None)
        lib = next((d for d in _lib_dirs(root) if _has_libs(d)), None)
        if inc is not None and (lib is not None or not require_lib):
            return CublasPaths(inc, lib if lib is not None else root / "lib", origin)
        what = "no cuBLAS headers" if inc is None else "headers but no libcublas/libcublasLt"
        looked.append(f"{origin}: {root} ({what})")
        if origin == "GEMMRL_CUBLAS_HOME":
            raise RuntimeError(f"GEMMRL_CUBLAS_HOME={root} has {what}: it needs include/ with "
                               "cublas_v2.h, cublasLt.h, cublas_api.h and lib/ with libcublas*.so*")
    raise RuntimeError("cuBLAS not found; looked in:\n  " + "\n  ".join(looked)
                       + "\nSet GEMMRL_CUBLAS_HOME to a directory with include/ and lib/, or "
                       "install the nvidia-cublas wheel.")


def link_libraries(paths: CublasPaths) -> tuple[str, ...]:
    """Library names for build_shared (-l<name>): ':libcublas.so.13' links a versioned file."""
    return tuple(f[2:] for f in paths.link_flags())


def cache_dir() -> Path:
    return cache_root() / "baselines"


# ---------------------------------------------------------------------------------------------
# Build and load


def build(build_dir: str | Path | None = None, arch: str = DEFAULT_ARCH,
          paths: CublasPaths | None = None) -> Path:
    """Compile cublas_baselines.cu with the project's build cache; returns the shared object."""
    paths = paths or find_cublas()
    res = build_shared(SOURCE.read_text(), name="cublas_baselines", arch=arch,
                       include_dirs=(str(paths.include),), library_dirs=(str(paths.lib),),
                       libraries=link_libraries(paths), cache_dir=build_dir or cache_dir())
    if not res.ok:
        raise RuntimeError(f"nvcc failed building the cuBLAS baselines:\n{res.log[-4000:]}")
    return Path(res.path)


_P, _I, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_IP = ctypes.POINTER(ctypes.c_int)
_SIGNATURES = {
    "gbl_init": (_I, [_S]),
    "gbl_cublas_gemm": (_I, [_I, _I, _I, _P, _P, _P, _I, _I, _I, _P]),
    "gbl_lt_heuristic": (_I, [_I, _I, _I, _I, _I, _I, _I, _P, _IP]),
    "gbl_lt_enumerate": (_I, [_I, _I, _I, _I, _I, _I, _I, _P, _IP]),
    "gbl_lt_plan_create": (_I, [_I, _I, _I, _I, _I, _I, _P, _IP]),
    "gbl_lt_plan_run": (_I, [_I, _P, _P, _P, _P]),
    "gbl_lt_plan_destroy": (_I, [_I]),
    "gbl_algo_describe": (_I, [_P, ctypes.c_char_p, _I]),
    "gbl_version": (ctypes.c_char_p, []),
    "gbl_status_string": (ctypes.c_char_p, [_I]),
    "gbl_workspace_bytes": (_S, []),
}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _ptr(x: int | None) -> int | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected a pointer as an int, got {type(x).__name__}")
    return x or None


class CublasBaselines:
    """Python face of the loaded library. Pointers and streams are ints (0 = default stream)."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None = None):
        self._lib = lib
        self.path = path

    def _check(self, func: str, status: int) -> None:
        if status != 0:
            detail = self._lib.gbl_status_string(status)
            raise CublasError(func, status, detail.decode() if detail else "")

    @property
    def workspace_bytes(self) -> int:
        return int(self._lib.gbl_workspace_bytes())

    def gemm(self, layout: str, dtype: str, acc: str, a_ptr: int, b_ptr: int, c_ptr: int,
             M: int, N: int, K: int, stream: int = 0) -> None:
        lay, dt, ac = map_args(layout, dtype, acc)
        M, N, K = check_shape(M, N, K)
        self._check("gbl_cublas_gemm", self._lib.gbl_cublas_gemm(
            lay, dt, ac, _ptr(a_ptr), _ptr(b_ptr), _ptr(c_ptr), M, N, K, _ptr(stream)))

    def _algos(self, func: str, layout, dtype, acc, M, N, K, count: int) -> list[bytes]:
        lay, dt, ac = map_args(layout, dtype, acc)
        M, N, K = check_shape(M, N, K)
        buf = ctypes.create_string_buffer(ALGO_BYTES * count)
        n = ctypes.c_int(0)
        self._check(func, getattr(self._lib, func)(lay, dt, ac, M, N, K, count, buf, ctypes.byref(n)))
        raw = buf.raw
        return [raw[i * ALGO_BYTES:(i + 1) * ALGO_BYTES] for i in range(n.value)]

    def heuristic(self, layout: str, dtype: str, acc: str, M: int, N: int, K: int,
                  requested: int = MAX_HEURISTIC) -> list[bytes]:
        """cuBLASLt's suggestions, best first, as 64-byte cublasLtMatmulAlgo_t blobs."""
        if not 1 <= requested <= MAX_HEURISTIC:
            raise ValueError(f"requested must be in 1..{MAX_HEURISTIC}, got {requested}")
        return self._algos("gbl_lt_heuristic", layout, dtype, acc, M, N, K, requested)

    def enumerate(self, layout: str, dtype: str, acc: str, M: int, N: int, K: int,
                  max_out: int = 256) -> list[bytes]:
        """A deterministic sample (at most max_out) of every configuration cuBLASLt accepts."""
        if max_out <= 0:
            raise ValueError(f"max_out must be positive, got {max_out}")
        return self._algos("gbl_lt_enumerate", layout, dtype, acc, M, N, K, max_out)

    def plan(self, layout: str, dtype: str, acc: str, M: int, N: int, K: int,
             algo: bytes | None = None) -> int:
        """A cuBLASLt plan; algo=None takes the heuristic's first suggestion."""
        lay, dt, ac = map_args(layout, dtype, acc)
        M, N, K = check_shape(M, N, K)
        blob = None
        if algo is not None:
            if len(algo) != ALGO_BYTES:
                raise ValueError(f"algo must be {ALGO_BYTES} bytes, got {len(algo)}")
            blob = ctypes.create_string_buffer(bytes(algo), ALGO_BYTES)
        pid = ctypes.c_int(-1)
        self._check("gbl_lt_plan_create", self._lib.gbl_lt_plan_create(
            lay, dt, ac, M, N, K, blob, ctypes.byref(pid)))
        return pid.value

    def run(self, plan_id: int, a_ptr: int, b_ptr: int, c_ptr: int, stream: int = 0) -> None:
        self._check("gbl_lt_plan_run", self._lib.gbl_lt_plan_run(
            plan_id, _ptr(a_ptr), _ptr(b_ptr), _ptr(c_ptr), _ptr(stream)))

    def destroy(self, plan_id: int) -> None:
        self._check("gbl_lt_plan_destroy", self._lib.gbl_lt_plan_destroy(plan_id))

    def describe(self, algo: bytes) -> str:
        if len(algo) != ALGO_BYTES:
            raise ValueError(f"algo must be {ALGO_BYTES} bytes, got {len(algo)}")
        blob = ctypes.create_string_buffer(bytes(algo), ALGO_BYTES)
        out = ctypes.create_string_buffer(256)
        self._check("gbl_algo_describe", self._lib.gbl_algo_describe(blob, out, len(out)))
        return out.value.decode()

    def version(self) -> str:
        return self._lib.gbl_version().decode()


_loaded: dict[tuple, CublasBaselines] = {}
_load_lock = threading.Lock()


def load(build_dir: str | Path | None = None, arch: str = DEFAULT_ARCH,
         workspace_bytes: int = 0) -> CublasBaselines:
    """Build (or reuse) the library, load it, call gbl_init (workspace 0 = 32 MiB)."""
    with _load_lock:
        path = build(build_dir, arch)
        key = (str(path.resolve()),)
        if key not in _loaded:
            lib = _declare(ctypes.CDLL(str(path)))
            obj = CublasBaselines(lib, path)
            obj._check("gbl_init", lib.gbl_init(workspace_bytes))
            _loaded[key] = obj
        return _loaded[key]
