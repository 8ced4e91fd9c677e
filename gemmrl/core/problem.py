"""What a GEMM problem is: sizes, element types, accumulator, and B's layout.

C[M, N] = A[M, K] @ B, all row-major. Layout "NN": B is [K, N]; layout "TN": B is given as
[N, K] (as nn.Linear stores its weight), so C = A @ B.T. The output has the input's dtype.
Pure Python: no torch, no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("fp16", "bf16")
ACCS = ("fp32", "fp16")
LAYOUTS = ("NN", "TN")
ELEMENT_BYTES = {"fp16": 2, "bf16": 2}

# CUDA-L2's names for (accumulator, input) combinations: F32F16F16F32 = fp32 accumulate on fp16.
_PRECISION_TAGS = {
    ("fp16", "fp32"): "F32F16F16F32",
    ("fp16", "fp16"): "F16F16F16F16",
    ("bf16", "fp32"): "F32BF16BF16F32",
}


class ProblemError(ValueError):
    """A problem, shape or shape set that cannot be used, with the reason in the message."""


@dataclass(frozen=True, order=True)
class Problem:
    M: int
    N: int
    K: int
    dtype: str = "fp16"
    acc: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("M", "N", "K"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProblemError(f"{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ProblemError(f"{name} must be positive, got {value}")
            if value > 2**31 - 1:
                raise ProblemError(f"{name}={value} does not fit a 32-bit int")
        if self.dtype not in DTYPES:
            raise ProblemError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if self.acc not in ACCS:
            raise ProblemError(f"unknown accumulator {self.acc!r}; known: {', '.join(ACCS)}")
        if (self.dtype, self.acc) not in _PRECISION_TAGS:
            raise ProblemError(f"{self.dtype} inputs with an {self.acc} accumulator is not supported")

    @property
    def mnk(self) -> str:
        """CUDA-L2's row key, e.g. '64_128_256'."""
        return f"{self.M}_{self.N}_{self.K}"

    @property
    def shape(self) -> str:
        return f"{self.M}x{self.N}x{self.K}"

    @property
    def precision(self) -> str:
        return _PRECISION_TAGS[(self.dtype, self.acc)]

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def min_bytes(self) -> int:
        """Fewest bytes any implementation must move: A and B read once, C written once."""
        e = ELEMENT_BYTES[self.dtype]
        return e * (self.M * self.K + self.K * self.N + self.M * self.N)

    def key(self) -> tuple:
        return (self.M, self.N, self.K, self.dtype, self.acc)


def size_bucket(flops: int) -> int:
    """FLOPs bucket by powers of 8: bucket b holds 8**b <= flops < 8**(b+1)."""
    if flops <= 0:
        raise ProblemError("flops must be positive")
    b = 0
    while 8 ** (b + 1) <= flops:
        b += 1
    return b


def bucket_label(bucket: int) -> str:
    return f"2^{3 * bucket}-2^{3 * bucket + 3}"
