"""An implementation is anything the harness can verify and time: a baseline or a candidate.

`prepare(problem)` does the slow one-off work (build, plan, autotune, workspace) and returns a
callable `fn(a, b_nn, b_tn, c)`: A [M,K]; B as [K,N] (b_nn) and the same values as [N,K]
(b_tn); C [M,N], all row-major contiguous CUDA tensors of the problem's dtype. The call writes
C on torch's current stream and returns nothing; the implementation reads whichever B layout it
declares. The harness gives every implementation the same inputs, so baselines and candidates
are judged alike.
"""

from __future__ import annotations

from typing import Callable

Call = Callable[..., None]


class Impl:
    name: str = "impl"
    layout: str = "NN"  # which B the implementation reads: "NN" (b_nn), "TN" (b_tn), "both"
    trusted: bool = False  # baselines from NVIDIA's libraries: skip the own-kernel trace check

    def supports(self, problem) -> bool:
        return True

    def prepare(self, problem) -> Call:
        raise NotImplementedError

    def own_kernels(self) -> set[str] | None:
        """Demangled names of the GPU kernels this implementation may launch; None: not known."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, "layout": self.layout}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class UnsupportedProblem(RuntimeError):
    """prepare() refuses a problem it cannot serve (a record, not a failure of the run)."""
