"""The product as a user calls it, as a harness implementation: `gemmrl.matmul(a, b, out=c)` with
a pack active, fallback to torch.matmul included (`bench --impl pack:DIR`).

Two implementations, one per B layout ('gemmrl.matmul-nn' reads [K, N], 'gemmrl.matmul-tn' the
[N, K] weight), so that each is timed against torch.matmul and cuBLAS on equal terms: the result
written into the harness's C (out=), as the torch.matmul baseline does. They are trusted like the
baselines (a shape without a kernel runs cuBLAS by design: cuBLASLt from the fast path, or
torch.matmul), so the harness does not hold them to launching only their own kernels; every
correctness check still applies.
"""

from __future__ import annotations

from pathlib import Path

from gemmrl.core.impl import Impl, UnsupportedProblem


class PackMatmul(Impl):
    trusted = True

    def __init__(self, pack_dir: str | Path, layout: str, nearest: float | None = None):
        if layout not in ("NN", "TN"):
            raise ValueError(f"layout must be NN or TN, got {layout!r}")
        self.pack_dir = Path(pack_dir)
        if not (self.pack_dir / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.pack_dir} is not a pack (no manifest.json)")
        self.layout = layout
        self.name = f"gemmrl.matmul-{layout.lower()}"
        self.nearest = nearest
        self._dispatcher = None
        self._served = None  # the pack entry that serves the last prepared problem (describe)
        self._served_lt = None  # or the pack's cuBLASLt algorithm (hex) that serves it

    def _activate(self):
        from gemmrl.runtime import ops

        if self._dispatcher is None or ops.active() is not self._dispatcher:
            kw = {} if self.nearest is None else {"nearest": self.nearest}
            self._dispatcher = ops.use_pack(str(self.pack_dir), **kw)
        return self._dispatcher

    def supports(self, problem) -> bool:
        return problem.dtype in ("fp16", "bf16")

    def prepare(self, problem):
        from gemmrl.runtime import ops

        d = self._activate()
        if problem.acc != d.pack.acc:
            raise UnsupportedProblem(f"{self.name}: the pack accumulates in {d.pack.acc}, the problem in {problem.acc}")
        e = d.lookup(problem.M, problem.N, problem.K, self.layout, problem.dtype)
        # which kernel serves the shape (None: the libraries): the verification record keeps it,
        # so that the pack's median rule can count this session for that kernel (runtime.pack)
        self._served = None if e is None else {
            "shape": e.problem.shape, "spec_name": e.spec_name, "source_sha256": e.source_sha256,
            "exact": (e.problem.M, e.problem.N, e.problem.K) == (problem.M, problem.N, problem.K)}
        # no kernel: the fallback runs the pack's autotuned cuBLASLt algorithm where one was
        # installed for the shape on this device, so that the pack's lt_algos rule can count it
        self._served_lt = None if e is not None else _installed_lt(d.pack, problem.M, problem.N, problem.K,
                                                                   self.layout)
        matmul = ops.public_matmul()  # gemmrl.matmul, as a user calls it
        if self.layout == "TN":
            def call(a, b_nn, b_tn, c):
                matmul(a, b_tn, b_layout="TN", out=c)
        else:
            def call(a, b_nn, b_tn, c):
                matmul(a, b_nn, out=c)
        return call

    def describe(self) -> dict:
        d = {"name": self.name, "layout": self.layout, "pack": str(self.pack_dir)}
        if self.nearest is not None:  # a neighbour distance other than use_pack's default
            d["nearest"] = self.nearest
        if self._dispatcher is not None:
            e = self._dispatcher.describe()
            d.update(entries=e["entries"], failures=e["failures"], served=self._served,
                     served_lt=self._served_lt)
            from gemmrl.runtime import ops

            fast = ops._FAST if ops._FAST is not ops._UNSET else None
            d["fallback"] = {"lt_algos": ops.lt_status(),
                             "fast_path": None if fast is None else fast.stats().get("lt")}
        return d


def _installed_lt(pack, M: int, N: int, K: int, layout: str) -> str | None:
    """The pack's cuBLASLt algorithm for the shape in hex, where the fallback installed it on
    the current device (ops._install_lt), else None."""
    import torch

    from gemmrl.runtime import ops

    key = (M, N, K, layout)
    if key not in pack.lt_algos or not torch.cuda.is_available() or ops._fallback_choice() == "torch":
        return None
    # the fast path loads on a process's first call, and installs the active pack's algorithms
    # then: before it, the table is empty, and the first shape a bench process prepared was
    # recorded as served by the heuristic (H200, runs 539-555: a disputed pair timed six times
    # that never counted, and product pairs listed as stale)
    ops._fast()
    if key not in ops._LT["installed"].get(torch.cuda.current_device(), ()):
        return None
    return pack.lt_algos[key].hex()


def served_lt(impl_details: dict | None) -> str | None:
    """The pack's cuBLASLt algorithm (hex) that served a shape in a bench run, from
    gemmrl.matmul's verification details; None where a kernel or the heuristic's plan served
    it, or where the record predates `served_lt`."""
    got = (impl_details or {}).get("served_lt")
    return got if isinstance(got, str) and got else None


def served_kernel(impl_details: dict | None) -> dict | None:
    """The pack entry that served a shape in a bench run, from gemmrl.matmul's verification
    details ('impl': describe()): {'shape', 'spec_name', 'source_sha256', 'exact'}; None where
    the libraries served it, where the record predates `served`, or where that kernel failed in
    the run (it could not be built or loaded: the call fell back, so the run timed the fallback,
    not the kernel)."""
    d = impl_details or {}
    got = d.get("served")
    if not isinstance(got, dict) or not got.get("source_sha256"):
        return None
    if got["source_sha256"] in (d.get("failures") or {}):
        return None
    return got

