"""Profiler-trace check of one call: which GPU work ran, on which stream, from whose code.

A spin kernel is launched on the caller's stream before and after the call as a marker: its
stream id in the trace is the caller's stream. Pure parsing (`judge`) is separate from the
GPU part (`check_call`) so it can be tested on recorded traces.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time

MARKER = "spin_kernel"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Kernels of NVIDIA's libraries and of torch: a candidate that launches these did not do the work.
VENDOR_PATTERNS = re.compile(r"nvjet|xmma|cublas|gemmSN|gemv|splitKreduce|cutlass_80|ampere_|"
                             r"sm80_|sm90_xmma|at::native|at::cuda|elementwise_kernel|"
                             r"reduce_kernel|Kernel2", re.I)


def base_name(name: str) -> str:
    """'void ns::foo<128, 2>(int, float*)' -> 'ns::foo': no return type, template args, params."""
    name = re.sub(r"^(void|__global__)\s+", "", name.strip())
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()


def _norm(name: str) -> str:
    return re.sub(r"\s+", "", re.sub(r"^void\s+", "", name))


def judge(events: list[dict], own: set[str] | None) -> dict:
    """Decide from the trace's GPU events (each with 'cat', 'name', 'args': {'stream': id})."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    markers = [e for e in gpu if e.get("cat") == "kernel" and MARKER in e.get("name", "")]
    work = [e for e in gpu if e not in markers]
    summary = {"kernels": sorted({e["name"] for e in work if e.get("cat") == "kernel"}),
               "copies": sum(1 for e in work if e.get("cat") != "kernel"), "problem": ""}
    if len(markers) < 2:
        summary["problem"] = "marker kernels missing from the trace (profiler did not record)"
        return summary
    stream = markers[0].get("args", {}).get("stream")
    kernels = [e for e in work if e.get("cat") == "kernel"]
    if not kernels:
        summary["problem"] = "no kernel of its own ran during the call" + \
            (" (only copies: a cached result?)" if work else "")
        return summary
    other = sorted({str(e.get("args", {}).get("stream")) for e in work
                    if e.get("args", {}).get("stream") != stream})
    if other:
        summary["problem"] = f"work ran on stream(s) {', '.join(other)}, not the caller's stream {stream}"
        return summary
    if own is not None:
        own_norm = {_norm(k) for k in own}
        own_base = {base_name(k) for k in own}
        foreign = []
        for e in kernels:
            n = e["name"]
            if VENDOR_PATTERNS.search(n) and _norm(n) not in own_norm:
                foreign.append(n)
            elif _norm(n) not in own_norm and base_name(n) not in own_base:
                foreign.append(n)
        if foreign:
            summary["problem"] = "kernels that are not the implementation's own ran: " + \
                "; ".join(sorted(set(foreign))[:3])
    return summary


def check_call(fn, a, b_nn, b_tn, c, own: set[str] | None, settle_s: float = 0.02) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        torch.cuda._sleep(1000)
        fn(a, b_nn, b_tn, c)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        time.sleep(settle_s)  # let late work (threads, deferred launches) show up in the trace
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return judge(events, own)
