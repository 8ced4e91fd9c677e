"""The process Nsight Compute profiles: `python -m gemmrl.llm.ncu_target SO M N K`. Loads an ABI
kernel, makes random inputs, calls it once to warm up, then once between cudaProfilerStart and
cudaProfilerStop (ncu runs with --profile-from-start off, so only that call is measured)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import torch

    from gemmrl.core.problem import Problem
    from gemmrl.runtime.abi import AbiKernel, abi_call

    so, M, N, K = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    k = AbiKernel(so)
    problem = Problem(M, N, K, k.meta.dtype, k.meta.acc)
    dt = torch.float16 if k.meta.dtype == "fp16" else torch.bfloat16
    a = torch.randn(M, K, device="cuda", dtype=dt)
    b_nn = torch.randn(K, N, device="cuda", dtype=dt)
    b_tn = b_nn.t().contiguous()
    c = torch.empty(M, N, device="cuda", dtype=dt)
    call = abi_call(k, problem, "ncu-target")
    call(a, b_nn, b_tn, c)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call(a, b_nn, b_tn, c)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
