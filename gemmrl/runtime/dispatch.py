"""Shape -> kernel dispatch for a pack.

`DispatchTable` is the pure part (no torch, no CUDA; tested on the CPU): a dict from
(M, N, K, layout, dtype) to a pack entry, and `lookup`, which for a shape without an entry picks
the nearest tuned entry whose spec serves that shape natively: its family is generic (one build
serves every shape its spec accepts; raw kernels have their shape compiled in, so they serve
only their own) and `family.valid(spec, problem)` is None, the same predicate the search used.
A shape the pack lists under `library` (tuned on the GPU, where no kernel of ours beat the
libraries in that layout) gets no nearest entry: torch.matmul serves it, and so does an unseen
shape at least as near to a listed one as to any entry that serves it (the nearest tuned shape
decides). Nothing is padded or copied. Nearest = smallest sum of |log2| ratios of M, N and K, and no
farther than `max_distance` (default 0.5: one size about 1.41x off; see NEAREST_MAX_DISTANCE): a
kernel tuned for 512x12288x12288 is no evidence about a decode-sized 8x4096x4096, and on the H200
grid a neighbour one or two sizes away ran slower than torch.matmul as often as not, so such a
shape goes to the fallback instead of a kernel that may well be slower there.

`Dispatcher` adds the loading: each kernel source is built (build_shared, cached by content) and
loaded on the first use of an entry, under a lock with a double check, from any thread. A small
index under $GEMMRL_CACHE/runtime maps a source hash to its built .so, so a production process
started with `never_compile=True` loads prebuilt kernels without nvcc, and raises
NeverCompileError instead of compiling. Workspace is allocated once per (kernel, shape, device,
stream) and kept: a split-K workspace must not be shared by launches that may overlap.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import warnings
from pathlib import Path

from gemmrl.core.problem import Problem
from gemmrl.space import registry

NEAREST_CACHE_LIMIT = 1 << 16
# sum of |log2| size ratios; 0: exact shapes only. 0.5 (was 2.0): left out of the pack, a shape
# the H200 grid's kernels served from a neighbour ran a median 1.07x torch.matmul within 0.5, 1.04x
# at 0.5-1, 1.01x at 1-1.5 (44% of them below 0.99) and 0.96x at 1.5-2 (60% below 0.99)
# (scripts/nearest-loo.py, results/h200/nearest-loo-h200.json); beyond it, the fallback.
NEAREST_MAX_DISTANCE = 0.5


class NeverCompileError(RuntimeError):
    """never_compile mode met a kernel that is not built yet."""


def distance(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    return sum(abs(math.log2(x / y)) for x, y in zip(a, b))


class DispatchTable:
    """(M, N, K, layout, dtype) -> entry; nearest generic entry that serves an unseen shape."""

    def __init__(self, entries, acc: str, max_distance: float = NEAREST_MAX_DISTANCE, library=()):
        if not max_distance >= 0:  # also refuses NaN
            raise ValueError(f"max_distance must be >= 0 (math.inf: any distance), got {max_distance!r}")
        self.acc = acc
        # (M, N, K, layout, dtype) measured where the libraries win: no nearest kernel there, nor
        # on a shape nearer to one of them than to any entry that serves it
        self.library = frozenset(library)
        self._library_by: dict[tuple[str, str], list] = {}
        for M, N, K, layout, dtype in self.library:
            self._library_by.setdefault((layout, dtype), []).append((M, N, K))
        self.max_distance = float(max_distance)
        self.exact = {e.key: e for e in entries}
        # per (layout, dtype): the generic entries, the only ones that can serve other shapes
        self.generic: dict[tuple[str, str], list] = {}
        for e in entries:
            if registry.get(e.family).generic:
                self.generic.setdefault((e.layout, e.problem.dtype), []).append(e)
        self._nearest: dict = {}

    def __len__(self) -> int:
        return len(self.exact)

    def lookup(self, M: int, N: int, K: int, layout: str, dtype: str):
        """The exact entry; None where the pack says the libraries serve the shape better; else
        the nearest generic entry that serves the shape, else None."""
        key = (M, N, K, layout, dtype)
        e = self.exact.get(key)
        if e is not None:
            return e
        if key in self.library:
            return None
        try:
            return self._nearest[key]
        except KeyError:
            pass
        found = self._find_nearest(M, N, K, layout, dtype)
        if len(self._nearest) >= NEAREST_CACHE_LIMIT:
            self._nearest.clear()
        self._nearest[key] = found
        return found

    def _find_nearest(self, M, N, K, layout, dtype):
        cands = self.generic.get((layout, dtype))
        if not cands or min(M, N, K) <= 0:
            return None
        try:
            problem = Problem(M, N, K, dtype, self.acc)
        except ValueError:
            return None
        best, best_rank = None, None
        verdicts: dict = {}  # entries sharing a spec share a verdict
        for e in cands:
            ok = verdicts.get(e.spec)
            if ok is None:
                ok = verdicts[e.spec] = registry.get(e.family).valid(e.spec, problem) is None
            if not ok:
                continue
            p = e.problem
            rank = (distance((M, N, K), (p.M, p.N, p.K)), p.M, p.N, p.K)
            if rank[0] > self.max_distance:
                continue
            if best_rank is None or rank < best_rank:
                best, best_rank = e, rank
        if best is not None:  # the nearest tuned shape decides: the libraries won there, so here too
            lib = self._library_by.get((layout, dtype), ())
            if any(distance((M, N, K), shape) <= best_rank[0] for shape in lib):
                return None
        return best


def _index_dir() -> Path:
    from gemmrl.build.nvcc import cache_root

    return cache_root() / "runtime"


class _Call:
    """One (kernel, shape, device, stream): what the hot path needs, resolved once. `run` is
    the ctypes call, `fn_ptr` the address of the same gemmrl_run (for the C++ fast path)."""
    __slots__ = ("run", "ws_ptr", "ldb", "ws", "entry", "fn_ptr")

    def __init__(self, run, ws_ptr: int, ldb: int, ws, entry, fn_ptr: int = 0):
        self.run, self.ws_ptr, self.ldb, self.ws, self.entry = run, ws_ptr, ldb, ws, entry
        self.fn_ptr = fn_ptr


class Dispatcher:
    def __init__(self, pack, *, never_compile: bool = False, arch: str | None = None,
                 force: bool = False, nearest: float = NEAREST_MAX_DISTANCE):
        self.pack = pack
        self.force = force
        self.table = DispatchTable(pack.entries, pack.acc, max_distance=nearest,
                                   library={(*k, pack.dtype) for k in pack.library})
        self.never_compile = never_compile
        self.arch = arch or pack.arch
        self._lock = threading.RLock()
        self._kernels: dict[str, object] = {}  # source sha -> AbiKernel
        self._calls: dict[tuple, _Call | None] = {}
        self.failures: dict[str, str] = {}  # source sha -> why it cannot be used here
        self._refused: set[tuple] = set()  # (M, N, K, layout, dtype) a kernel refused at run time
        self._device_ok: dict[int, bool] = {}

    def lookup(self, M: int, N: int, K: int, layout: str, dtype: str):
        return self.table.lookup(M, N, K, layout, dtype)

    # ----------------------------------------------------------------------- building / loading
    def _index_file(self, sha: str) -> Path:
        return _index_dir() / f"{sha}-{self.arch}.json"

    def built_path(self, entry) -> str | None:
        """The built .so of an entry's source, when this machine's cache has it."""
        f = self._index_file(entry.source_sha256)
        try:
            so = json.loads(f.read_text())["so"]
        except (OSError, ValueError, KeyError):
            return None
        return so if os.path.exists(so) else None

    def _remember(self, sha: str, so: str) -> None:
        d = _index_dir()
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{sha[:16]}-", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"so": so}, fh)
        os.replace(tmp, self._index_file(sha))

    def _build(self, entry) -> str:
        from gemmrl.build.ahead import pack_job
        from gemmrl.build.nvcc import build_shared

        job = pack_job(self.pack, entry, self.arch)
        res = build_shared(job.source, name=job.name, **job.kwargs)
        if not res.ok:
            raise RuntimeError(f"{entry.file} failed to build:\n{res.log[-2000:]}")
        self._remember(entry.source_sha256, res.path)
        return res.path

    def kernel(self, entry):
        """The loaded AbiKernel of an entry (built on first use unless never_compile)."""
        sha = entry.source_sha256
        k = self._kernels.get(sha)
        if k is not None:
            return k
        with self._lock:
            k = self._kernels.get(sha)
            if k is not None:
                return k
            from gemmrl.runtime.abi import AbiKernel

            so = self.built_path(entry)
            if so is None:
                if self.never_compile:
                    raise NeverCompileError(
                        f"{entry.file} ({entry.spec_name}) is not built on this machine and "
                        f"never_compile is set: build the pack first (Dispatcher.build_all or "
                        f"gemmrl.warmup)")
                so = self._build(entry)
            k = AbiKernel(so)
            if (k.meta.layout, k.meta.dtype, k.meta.acc) != (entry.layout, entry.problem.dtype, entry.problem.acc):
                raise RuntimeError(f"{entry.file}: the kernel says {k.meta}, the manifest says "
                                   f"{entry.layout}/{entry.problem.dtype}/{entry.problem.acc}")
            self._kernels[sha] = k
            return k

    def build_all(self, workers: int | None = None, log=None) -> dict[str, str]:
        """Compile every kernel source of the pack not built yet, in parallel; returns
        {file: why} for those that failed (also kept in self.failures)."""
        from gemmrl.build.ahead import pack_job
        from gemmrl.build.pool import build_many

        todo, seen = [], set()
        for e in self.pack.entries:
            if e.source_sha256 in seen or self.built_path(e) is not None:
                continue
            seen.add(e.source_sha256)
            todo.append((e, pack_job(self.pack, e, self.arch).as_tuple()))
        if log and todo:
            log(f"building {len(todo)} kernels of {self.pack.path}")
        failed = {}
        for (e, _), res in zip(todo, build_many([j for _, j in todo], workers=workers)):
            if res.ok:
                self._remember(e.source_sha256, res.path)
            else:
                failed[e.file] = self.failures[e.source_sha256] = res.log[-2000:]
        return failed

    # ------------------------------------------------------------------------------- calling
    def call_for(self, M: int, N: int, K: int, layout: str, dtype: str, device: int, stream: int):
        """The resolved call for a shape on (device, stream), or None to fall back. Cached, so
        the hot path is one dict lookup after the first call."""
        key = (M, N, K, layout, dtype, device, stream)
        try:
            return self._calls[key]
        except KeyError:
            pass
        with self._lock:
            if key in self._calls:
                return self._calls[key]
            call = self._resolve(M, N, K, layout, dtype, device)
            self._calls[key] = call
            return call

    def device_ok(self, device: int) -> bool:
        """Whether the pack's stamp accepts CUDA device `device` (checked once, warned once)."""
        ok = self._device_ok.get(device)
        if ok is None:
            import torch

            from gemmrl.runtime.pack import StampError

            try:
                self.pack.check_stamp(torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                                      force=self.force)
                ok = True
            except StampError as e:
                warnings.warn(f"gemmrl: device {device}: {e}; using torch.matmul there",
                              RuntimeWarning, stacklevel=4)
                ok = False
            self._device_ok[device] = ok
        return ok

    def _resolve(self, M, N, K, layout, dtype, device):
        if (M, N, K, layout, dtype) in self._refused or not self.device_ok(device):
            return None
        entry = self.table.lookup(M, N, K, layout, dtype)
        if entry is None or entry.source_sha256 in self.failures:
            return None
        try:
            k = self.kernel(entry)
        except NeverCompileError:
            raise
        except Exception as e:  # a kernel that does not build or load here: fall back, say so once
            self.failures[entry.source_sha256] = f"{type(e).__name__}: {e}"
            warnings.warn(f"gemmrl: {entry.file} cannot be used, falling back to torch.matmul: "
                          f"{type(e).__name__}: {str(e)[:500]}", RuntimeWarning, stacklevel=3)
            return None
        import torch

        nbytes = k.workspace_bytes(M, N, K)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}") if nbytes else None
        return _Call(k.run, ws.data_ptr() if ws is not None else 0, K if layout == "TN" else N, ws, entry,
                     k.run_ptr)

    def disable(self, M, N, K, layout, dtype, device, stream, why: str) -> None:
        """A kernel refused a call the table said it serves: never use it for this shape again."""
        with self._lock:
            call = self._calls.get((M, N, K, layout, dtype, device, stream))
            self._refused.add((M, N, K, layout, dtype))
            for key in [k for k in self._calls if k[:5] == (M, N, K, layout, dtype)]:
                self._calls[key] = None
        name = call.entry.file if call is not None else "?"
        warnings.warn(f"gemmrl: {name} refused {M}x{N}x{K} {layout} {dtype} ({why}); "
                      f"falling back to torch.matmul for it", RuntimeWarning, stacklevel=3)

    def describe(self) -> dict:
        return {"pack": str(self.pack.path), "device": self.pack.stamp.get("device"),
                "entries": len(self.table), "loaded": len(self._kernels),
                "never_compile": self.never_compile, "failures": dict(self.failures),
                "refused": sorted(self._refused)}
