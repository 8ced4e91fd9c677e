"""nvcc builds with a content-hash cache. Needs no GPU and never initialises CUDA.

A build is described by its source text, flags, arch and the nvcc version; their hash is the
cache key. A failed compile is a BuildResult with ok=False and the log, never an exception:
the log is feedback for whoever wrote the source.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GENERATOR_VERSION = "1"  # bump when the way sources are built changes


from gemmrl.build.toolchain import ToolchainMissing


class NvccNotFound(ToolchainMissing):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("GEMMRL_CACHE", Path.home() / ".cache" / "gemmrl")).expanduser().absolute()


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str:
    found = os.environ.get("GEMMRL_NVCC") or shutil.which("nvcc")
    if not found:
        for cand in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"):
            if os.path.exists(cand):
                found = cand
                break
    if not found:
        raise NvccNotFound("nvcc not found: install the CUDA toolkit or set GEMMRL_NVCC")
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def gencode(arch: str) -> list[str]:
    """-gencode flags: 'sm_90a' -> compute_90a/sm_90a (wgmma needs the 'a' target)."""
    m = re.fullmatch(r"sm_(\d+a?)", arch)
    if not m:
        raise ValueError(f"arch must look like sm_90a or sm_80, got {arch!r}")
    return [f"-gencode=arch=compute_{m.group(1)},code=sm_{m.group(1)}"]


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int


@dataclass(frozen=True)
class BuildResult:
    ok: bool
    key: str
    path: str | None  # the shared object, when ok
    log: str
    seconds: float
    cached: bool
    resources: tuple[KernelResources, ...] = field(default=())

    @property
    def spills(self) -> int:
        return sum(r.spill_stores + r.spill_loads for r in self.resources)


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)'")
_REG_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> tuple[KernelResources, ...]:
    """Per-kernel registers, spills, stack and static shared memory from `-Xptxas -v` output."""
    out, name, stack = [], None, (0, 0, 0)
    for line in log.splitlines():
        if (m := _FUNC_RE.search(line)):
            name, stack = m.group(1), (0, 0, 0)
        elif name and (m := _SPILL_RE.search(line)):
            stack = tuple(int(g) for g in m.groups())
        elif name and (m := _REG_RE.search(line)):
            sm = _SMEM_RE.search(line)
            out.append(KernelResources(name, int(m.group(1)), stack[1], stack[2], stack[0],
                                       int(sm.group(1)) if sm else 0))
            name = None
    return tuple(out)


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def local_headers(source: str, include_dirs: tuple[str, ...], limit: int = 64) -> list[tuple[str, str]]:
    """(name, text) of the headers a source pulls in with #include "..." from include_dirs,
    recursively: they belong in the cache key. Angle-bracket includes (CUDA, CUTLASS) do not."""
    found, todo, seen = [], [source], set()
    while todo and len(found) < limit:
        for name in _QUOTED_INCLUDE.findall(todo.pop()):
            if name in seen:
                continue
            seen.add(name)
            for d in include_dirs:
                f = Path(d) / name
                if f.is_file():
                    text = f.read_text(errors="replace")
                    found.append((name, text))
                    todo.append(text)
                    break
    return found


def build_key(source: str, flags: list[str], headers: list[tuple[str, str]] = ()) -> str:
    h = hashlib.sha256()
    parts = [GENERATOR_VERSION, nvcc_version(), "\0".join(flags), source]
    parts += [f"{n}\0{t}" for n, t in headers]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()[:24]


def _flags(arch: str, include_dirs: tuple[str, ...], libraries: tuple[str, ...],
           library_dirs: tuple[str, ...], extra_flags: tuple[str, ...], object_only: bool):
    flags = ["-O3", "-std=c++17", "-DNDEBUG", "-Xptxas", "-v", "-Xcompiler", "-fPIC",
             "--expt-relaxed-constexpr", *gencode(arch)]
    include_dirs = tuple(str(Path(d).resolve()) for d in include_dirs)  # nvcc runs elsewhere
    library_dirs = tuple(str(Path(d).resolve()) for d in library_dirs)
    flags += [f"-I{d}" for d in include_dirs] + list(extra_flags)
    if object_only:
        flags += ["-c"]
    else:
        flags += ["-shared"] + [f"-L{d}" for d in library_dirs]
        flags += [f"-Xlinker=-rpath={d}" for d in library_dirs] + [f"-l{lib}" for lib in libraries]
    return flags, include_dirs


def _key_flags(flags: list[str], include_dirs: tuple[str, ...], include_keys: tuple[str, ...]) -> list[str]:
    """The flags as the cache key sees them: an include directory that has a key (a name for its
    contents, such as 'cutlass-4.2.0/include') is named by it, not by where it lies, so a cache
    built on one machine is found on another whose headers are installed elsewhere."""
    if not include_keys:
        return flags
    if len(include_keys) != len(include_dirs):
        raise ValueError(f"{len(include_keys)} include_keys for {len(include_dirs)} include_dirs")
    named = {f"-I{d}": f"-I<{k}>" for d, k in zip(include_dirs, include_keys)}
    return [named.get(f, f) for f in flags]


def _artifact(source: str, name: str, flags: list[str], include_dirs: tuple[str, ...],
              cache_dir, object_only: bool, include_keys: tuple[str, ...] = ()):
    key = build_key(source, _key_flags(flags, include_dirs, include_keys), local_headers(source, include_dirs))
    # absolute: nvcc runs in the build's own directory, where a relative path would not resolve
    root = (Path(cache_dir) if cache_dir else cache_root() / "builds").expanduser().absolute()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60]
    final_dir = root / f"{safe}-{key}"
    return key, root, safe, final_dir, final_dir / ("kernel.o" if object_only else "kernel.so")


def is_built(source: str, *, name: str = "kernel", arch: str = "sm_90a",
             include_dirs: tuple[str, ...] = (), libraries: tuple[str, ...] = (),
             library_dirs: tuple[str, ...] = (), extra_flags: tuple[str, ...] = (),
             include_keys: tuple[str, ...] = (),
             cache_dir: str | Path | None = None, object_only: bool = False) -> bool:
    """Whether build_shared with these arguments would find its result in the cache (no nvcc
    run beyond `nvcc --version`, once)."""
    flags, include_dirs = _flags(arch, include_dirs, libraries, library_dirs, extra_flags, object_only)
    return _artifact(source, name, flags, include_dirs, cache_dir, object_only, include_keys)[4].exists()


def cache_entry(source: str, *, name: str = "kernel", arch: str = "sm_90a",
                include_dirs: tuple[str, ...] = (), libraries: tuple[str, ...] = (),
                library_dirs: tuple[str, ...] = (), extra_flags: tuple[str, ...] = (),
                include_keys: tuple[str, ...] = (),
                cache_dir: str | Path | None = None, object_only: bool = False, **_ignored) -> Path:
    """The cache directory build_shared would use for these arguments (it may not exist)."""
    flags, include_dirs = _flags(arch, include_dirs, libraries, library_dirs, extra_flags, object_only)
    return _artifact(source, name, flags, include_dirs, cache_dir, object_only, include_keys)[3]


def install_built(entry: str | Path, files: dict[str, bytes]) -> bool:
    """Put a build made elsewhere (same nvcc, same flags: its files, e.g. {'kernel.so': ...,
    'build.log': ...}) into this machine's cache at `entry` (from cache_entry), atomically.
    False if the entry was there already."""
    entry = Path(entry)
    if entry.exists():
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.name[:60]}-", dir=entry.parent))
    for fname, data in files.items():
        if "/" in fname or fname.startswith("."):
            raise ValueError(f"bad file name in a build: {fname!r}")
        (work / fname).write_bytes(data)
    try:
        os.replace(work, entry)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)  # another process installed it first
        return False
    return True


def build_shared(source: str, *, name: str = "kernel", arch: str = "sm_90a",
                 include_dirs: tuple[str, ...] = (), libraries: tuple[str, ...] = (),
                 library_dirs: tuple[str, ...] = (), extra_flags: tuple[str, ...] = (),
                 include_keys: tuple[str, ...] = (),
                 cache_dir: str | Path | None = None, timeout_s: float = 900,
                 object_only: bool = False) -> BuildResult:
    """Compile one .cu source into a shared object (or an object file), cached by content."""
    flags, include_dirs = _flags(arch, include_dirs, libraries, library_dirs, extra_flags, object_only)
    key, root, safe, final_dir, artifact = _artifact(source, name, flags, include_dirs, cache_dir,
                                                     object_only, include_keys)
    if artifact.exists():
        log = (final_dir / "build.log").read_text() if (final_dir / "build.log").exists() else ""
        return BuildResult(True, key, str(artifact), log, 0.0, True, parse_ptxas(log))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{safe}-", dir=root))
    src = work / "kernel.cu"
    src.write_text(source)
    cmd = [nvcc_path(), *flags, str(src), "-o", str(work / artifact.name)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=work)
        log = " ".join(cmd) + "\n" + proc.stdout + proc.stderr
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired as e:
        log = " ".join(cmd) + f"\nbuild timed out after {timeout_s:.0f} s\n" + str(e.stderr or "")
        ok = False
    seconds = time.monotonic() - t0
    (work / "build.log").write_text(log)
    if not ok:
        failed = root / f"{safe}-{key}.failed"
        shutil.rmtree(failed, ignore_errors=True)
        os.replace(work, failed)
        return BuildResult(False, key, None, log, seconds, False, parse_ptxas(log))
    try:
        os.replace(work, final_dir)  # atomic: a reader sees all of the build or none
    except OSError:
        shutil.rmtree(work, ignore_errors=True)  # another process won the race; use theirs
    return BuildResult(True, key, str(artifact), log, seconds, False, parse_ptxas(log))
