"""CPU tests of the cuBLAS baselines library: argument mapping, finding cuBLAS, flags, the build
cache (with a stand-in nvcc), and a real `nvcc -c` of cublas_baselines.cu against cuBLAS headers.

The real compile needs cuBLAS headers. It takes them from find_cublas() (GEMMRL_CUBLAS_HOME, the
nvidia pip packages, CUDA_HOME, /usr/local/cuda) or from a copy extracted under <repo>/.ext
(ignored by git), e.g. from the nvidia-cublas wheel:
    python -m pip download --no-deps -d /tmp/w nvidia-cublas
    mkdir -p .ext/cublas && cd .ext/cublas && unzip -o /tmp/w/nvidia_cublas-*.whl '*/include/*'
and is skipped, saying so, when there are none.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from gemmrl.baselines import cublas as cb

REPO = Path(__file__).resolve().parents[1]


# --- argument mapping ------------------------------------------------------------------------


def test_map_args_known_values():
    assert cb.map_args("NN", "fp16", "fp32") == (0, 0, 0)
    assert cb.map_args("TN", "bf16", "fp32") == (1, 1, 0)
    assert cb.map_args("TN", "fp16", "fp16") == (1, 0, 1)


@pytest.mark.parametrize("layout", ["NT", "TT", "nn", "", None])
def test_map_args_rejects_unknown_layout(layout):
    with pytest.raises(ValueError, match="unknown layout"):
        cb.map_args(layout, "fp16", "fp32")


@pytest.mark.parametrize("dtype", ["fp32", "half", "float16", "BF16"])
def test_map_args_rejects_unknown_dtype(dtype):
    with pytest.raises(ValueError, match="unknown dtype"):
        cb.map_args("NN", dtype, "fp32")


def test_map_args_rejects_unknown_accumulator():
    with pytest.raises(ValueError, match="unknown accumulator"):
        cb.map_args("NN", "fp16", "tf32")


def test_map_args_rejects_fp16_accumulate_for_bf16():
    with pytest.raises(ValueError, match="only available for fp16"):
        cb.map_args("NN", "bf16", "fp16")


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, True, "8"])
def test_check_shape_rejects(bad):
    with pytest.raises(ValueError):
        cb.check_shape(64, bad, 64)


def test_parse_description():
    d = cb.parse_description("algo=23 tile=20 stages=8 splitk=1 reduction=0 swizzle=1 custom=0 inner=0 cluster=2")
    assert d == {"algo": 23, "tile": 20, "stages": 8, "splitk": 1, "reduction": 0, "swizzle": 1,
                 "custom": 0, "inner": 0, "cluster": 2}


def test_lt_enums_reads_tile_and_cluster_numbers_from_the_header_text():
    text = """typedef enum {
  CUBLASLT_MATMUL_TILE_UNDEFINED = 0,
  CUBLASLT_MATMUL_TILE_8x8 = 1,
  CUBLASLT_MATMUL_TILE_144x128 = 184,
  CUBLASLT_MATMUL_TILE_END
} cublasLtMatmulTile_t;
typedef enum {
  CUBLASLT_CLUSTER_SHAPE_AUTO = 0,
  CUBLASLT_CLUSTER_SHAPE_1x2x1 = 5,
} cublasLtClusterShape_t;"""
    tiles, clusters = cb.lt_enums(text)
    assert tiles == {1: (8, 8), 184: (144, 128)} and clusters == {5: (1, 2)}
    with pytest.raises(ValueError, match="not cublasLt.h"):
        cb.lt_enums("#define CUBLAS_VER_MAJOR 13")


def test_lt_enums_of_the_real_header_name_the_tiles_cublaslt_autotuned_chose():
    """CUDA 13's cublasLt.h numbers the tiles past CUDA 11's 35: 184, 197, 201 and 495 are the
    144x128, 168x128, 176x128 and 256x96 tiles cuBLASLt autotuned chose on big H100 shapes."""
    include = _cublas_include()
    if include is None:
        pytest.skip("no cuBLAS headers (see this file's docstring)")
    tiles, clusters = cb.lt_enums((include / "cublasLt.h").read_text(errors="replace"))
    if 184 not in tiles:
        pytest.skip(f"{include}/cublasLt.h predates the numbered newer tiles")
    assert (tiles[20], tiles[29], tiles[184], tiles[197], tiles[201], tiles[495]) == (
        (128, 128), (128, 160), (144, 128), (168, 128), (176, 128), (256, 96))
    assert (clusters[2], clusters[3], clusters[5]) == ((1, 1), (2, 1), (1, 2))
    assert cb.lt_header((include.parent,)) is not None


def test_lt_header_looks_under_the_extra_roots(tmp_path, monkeypatch):
    monkeypatch.setattr(cb, "find_cublas", lambda require_lib=True: (_ for _ in ()).throw(RuntimeError("none")))
    assert cb.lt_header((tmp_path / "a",)) is None
    inc = tmp_path / "b" / "include"
    inc.mkdir(parents=True)
    for h in ("cublas_v2.h", "cublasLt.h", "cublas_api.h"):
        (inc / h).write_text("")
    assert cb.lt_header((tmp_path / "a", tmp_path / "b")) == inc / "cublasLt.h"


# --- building ---------------------------------------------------------------------------------


def _fake_cublas(root: Path, versioned: bool = True) -> Path:
    (root / "include").mkdir(parents=True)
    for h in ("cublas_v2.h", "cublasLt.h", "cublas_api.h"):
        (root / "include" / h).write_text("/* stub */\n")
    (root / "lib").mkdir()
    for n in ("cublas", "cublasLt"):
        (root / "lib" / (f"lib{n}.so.13" if versioned else f"lib{n}.so")).write_bytes(b"")
    return root


def test_link_libraries_name_versioned_wheel_files(tmp_path):
    paths = cb.CublasPaths(tmp_path / "include", _fake_cublas(tmp_path / "w") / "lib", "test")
    assert cb.link_libraries(paths) == (":libcublasLt.so.13", ":libcublas.so.13")
    root = _fake_cublas(tmp_path / "cuda", versioned=False)
    assert cb.link_libraries(cb.CublasPaths(root / "include", root / "lib", "t")) == ("cublasLt", "cublas")


# --- finding cuBLAS --------------------------------------------------------------------------


def test_find_cublas_from_env(tmp_path, monkeypatch):
    root = _fake_cublas(tmp_path / "home")
    monkeypatch.setenv("GEMMRL_CUBLAS_HOME", str(root))
    found = cb.find_cublas()
    assert found.include == root / "include" and found.lib == root / "lib"
    assert found.origin == "GEMMRL_CUBLAS_HOME"


def test_find_cublas_env_without_headers_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMRL_CUBLAS_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="GEMMRL_CUBLAS_HOME"):
        cb.find_cublas()


def test_find_cublas_names_where_it_looked(tmp_path, monkeypatch):
    headers_only = tmp_path / "h"
    _fake_cublas(headers_only)
    shutil.rmtree(headers_only / "lib")
    monkeypatch.setattr(cb, "_candidates", lambda: [("python package nvidia.cu13", tmp_path / "nope"),
                                                    ("CUDA_HOME", headers_only)])
    with pytest.raises(RuntimeError) as e:
        cb.find_cublas()
    msg = str(e.value)
    assert "nvidia.cu13" in msg and str(tmp_path / "nope") in msg and "no cuBLAS headers" in msg
    assert "CUDA_HOME" in msg and "headers but no libcublas" in msg
    assert cb.find_cublas(require_lib=False).include == headers_only / "include"


def test_find_cublas_looks_in_nvidia_package(tmp_path, monkeypatch):
    import sys
    import types

    _fake_cublas(tmp_path / "nvidia" / "cu13")
    pkg = types.ModuleType("nvidia")
    pkg.__path__ = [str(tmp_path / "nvidia")]
    monkeypatch.setitem(sys.modules, "nvidia", pkg)
    monkeypatch.delenv("GEMMRL_CUBLAS_HOME", raising=False)
    found = cb.find_cublas()
    assert found.origin == "python package nvidia.cu13"
    assert found.include == tmp_path / "nvidia" / "cu13" / "include"


# --- the build, with a stand-in nvcc ----------------------------------------------------------


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    from gemmrl.build import nvcc

    log = tmp_path / "calls.log"
    fake = tmp_path / "nvcc"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake nvcc 1.0"; exit 0; fi
echo "$@" >> {log}
case "$*" in *FAIL_PLEASE*) echo "bad thing" >&2; exit 3;; esac
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("GEMMRL_NVCC", str(fake))
    nvcc.nvcc_path.cache_clear()
    nvcc.nvcc_version.cache_clear()
    yield log
    nvcc.nvcc_path.cache_clear()
    nvcc.nvcc_version.cache_clear()


def test_build_links_cublas_and_caches(tmp_path, fake_nvcc):
    root = _fake_cublas(tmp_path / "cublas")
    paths = cb.CublasPaths(root / "include", root / "lib", "test")
    out = tmp_path / "cache"
    first = cb.build(out, paths=paths)
    assert first.read_text() == "built\n" and out in first.parents
    call = fake_nvcc.read_text()
    for flag in (f"-I{paths.include}", f"-L{paths.lib}", "-l:libcublasLt.so.13", "-l:libcublas.so.13",
                 f"-Xlinker=-rpath={paths.lib}", "-shared", "code=sm_90"):
        assert flag in call
    assert cb.build(out, paths=paths) == first
    assert len(fake_nvcc.read_text().splitlines()) == 1  # second call was a cache hit
    assert cb.build(out, arch="sm_90a", paths=paths) != first


def test_build_reports_nvcc_failure(tmp_path, fake_nvcc):
    root = _fake_cublas(tmp_path / "FAIL_PLEASE")
    with pytest.raises(RuntimeError, match="bad thing"):
        cb.build(tmp_path / "cache", paths=cb.CublasPaths(root / "include", root / "lib", "test"))


def test_cache_dir_follows_gemmrl_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    assert cb.cache_dir() == tmp_path / "baselines"
    monkeypatch.delenv("GEMMRL_CACHE")
    assert cb.cache_dir() == Path.home() / ".cache" / "gemmrl" / "baselines"


def test_every_exported_function_is_declared():
    src = cb.SOURCE.read_text()
    body = src[src.index('extern "C" {'):]
    exported = set(re.findall(r"^(?:int|const char\*|size_t) (gbl_\w+)\(", body, re.M))
    assert exported == set(cb._SIGNATURES)


# --- a real compile ---------------------------------------------------------------------------


def _cublas_include() -> Path | None:
    try:
        return cb.find_cublas(require_lib=False).include
    except RuntimeError:
        pass
    ext = REPO / ".ext"
    if ext.is_dir():
        for h in sorted(ext.rglob("cublasLt.h")):
            if (h.parent / "cublas_v2.h").is_file() and (h.parent / "cublas_api.h").is_file():
                return h.parent
    return None


def test_source_compiles_with_nvcc_without_warnings(tmp_path):
    try:
        from gemmrl.build.nvcc import nvcc_path

        nvcc = nvcc_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    include = _cublas_include()
    if include is None:
        pytest.skip("no cuBLAS headers: set GEMMRL_CUBLAS_HOME, install the nvidia-cublas wheel, or extract "
                    "its include/ under .ext/ (see this file's docstring)")
    obj = tmp_path / "cublas_baselines.o"
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Wextra", "-arch=sm_90", "-Werror",
           "all-warnings", f"-I{include}", "-c", str(cb.SOURCE), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, " ".join(cmd) + "\n" + out
    assert "warning" not in out.lower(), out
    if shutil.which("nm"):
        syms = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True).stdout
        defined = set(re.findall(r"\bT (gbl_\w+)$", syms, re.M))
        assert defined == set(cb._SIGNATURES), syms


class _FakeLt:
    """Stands in for the cuBLASLt library: three suggested algorithms, plans that record nothing."""

    def __init__(self):
        self.heuristic_calls = 0
        self.plans, self.destroyed = 0, []

    def heuristic(self, layout, dtype, acc, M, N, K, requested=100):
        self.heuristic_calls += 1
        return [bytes([i]) * 64 for i in (1, 2, 3)]

    def plan(self, *args):
        self.plans += 1
        return self.plans

    def run(self, *args):
        pass

    def destroy(self, plan_id):
        self.destroyed.append(plan_id)

    def describe(self, algo):
        return f"algo={algo[0]}"


def test_autotuned_choice_is_picked_with_the_judges_protocol_and_old_choices_are_made_again(tmp_path, monkeypatch):
    """cuBLASLt autotuned picks with the judge's kernel-mode protocol (2 ms replays), keeps the
    heuristic's first suggestion unless another is at least 1% faster, keeps a choice made by
    this rule, and makes again a stored choice made by an earlier rule."""
    from gemmrl.baselines import impls
    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    fake, picked = _FakeLt(), []
    monkeypatch.setattr(impls, "_LIB", fake)
    times = {0: 10.0, 1: 9.5, 2: 9.0}

    def pick(problem, calls, settings=timing.QUICK):
        picked.append(settings)
        return 1, {k: {"status": "ok", "median_us": times[k]} for k in calls}
    monkeypatch.setattr(timing, "pick_fastest", pick)
    store, p = Store(tmp_path / "s.sqlite"), Problem(512, 1024, 8192)
    dev = "NVIDIA H100 80GB HBM3"
    for old_info in ("algo=1 (best of 3/3)", "algo=1 (best of 3/3, picked in 2 ms replays)",
                     "algo=1 (best of 3/3, picked in 2 ms replays, 1% over the first)"):
        store.put_tuning(dev, p, "cuBLASLt-auto-tuning-nn", bytes([1]) * 64, old_info, 9.0)
        lt = impls.LtAutotuned("NN", store, dev)
        assert lt.choose(p) == bytes([3]) * 64  # the old choice is not kept; index 2 is fastest
    assert picked == [timing.BASELINE_PICK] * 3
    assert picked[0].target_replay_us == timing.KernelSettings().target_replay_us
    assert picked[0].protocol() == "kernel:v3:ci=0.005"  # the judge's own: paired ratios
    assert lt.pick_times == times
    assert sorted(fake.destroyed) == list(range(1, fake.plans + 1)) == list(range(1, 10))  # no plan kept
    got = store.get_tuning(dev, p, "cuBLASLt-auto-tuning-nn")
    assert bytes(got["choice"]) == bytes([3]) * 64 and got["time_us"] == 9.0
    assert got["info"] == f"algo=3 (best of 3/3, {timing.BASELINE_PICK_TAG})" == lt.describe()["choice"]
    again = impls.LtAutotuned("NN", store, dev)
    assert again.choose(p) == bytes([3]) * 64 and len(picked) == 3 and fake.heuristic_calls == 3
    assert again.describe()["choice"] == got["info"] and again.pick_times == {}
    # within 1% of the heuristic's first: the first is kept
    times.update({1: 9.95, 2: 9.92})
    fresh = impls.LtAutotuned("TN", store, dev)
    assert fresh.choose(p) == bytes([1]) * 64
    assert store.get_tuning(dev, p, "cuBLASLt-auto-tuning-tn")["info"].startswith("algo=1 (best of 3/3")
    store.close()


def test_times_beside_put_every_candidate_on_the_firsts_scale_by_its_paired_ratio():
    from gemmrl.bench.timing import pick_with_margin, times_beside

    # the medians say 1 is 5% faster than 0; in the same rounds it was 2% slower (the clock
    # stepped while they ran): the paired ratio decides
    res = {0: {"status": "ok", "median_us": 10.0, "details": {"paired": {1: 1.02, 2: 0.95}}},
           1: {"status": "ok", "median_us": 9.5, "details": {"paired": {0: 1 / 1.02}}},
           2: {"status": "ok", "median_us": 9.9, "details": {}},
           3: {"status": "wrong", "median_us": 1.0}}
    t = times_beside(res, 0)
    assert t == pytest.approx({0: 10.0, 1: 10.2, 2: 9.5})
    assert pick_with_margin(t, 0) == 2
    # without pairs (v1 records), or without the first, the medians
    plain = {k: {**r, "details": {}} for k, r in res.items()}
    assert times_beside(plain, 0) == {0: 10.0, 1: 9.5, 2: 9.9}
    assert times_beside({k: r for k, r in res.items() if k != 0}, 0) == {1: 9.5, 2: 9.9}


def test_pick_with_margin():
    from gemmrl.bench.timing import pick_with_margin

    assert pick_with_margin({0: 10.0, 1: 9.0}, 0, 0.01) == 1
    assert pick_with_margin({0: 10.0, 1: 9.91}, 0, 0.01) == 0
    assert pick_with_margin({0: 10.0, 1: 9.89}, 0, 0.01) == 1
    assert pick_with_margin({0: 10.0, 1: 9.91}, 0, 0.0) == 1
    assert pick_with_margin({1: 9.0, 2: 8.0}, 0, 0.01) == 2  # the first did not run: the fastest
    assert pick_with_margin({0: 8.0, 1: 9.0}, 0, 0.01) == 0
    with pytest.raises(ValueError):
        pick_with_margin({}, 0)
