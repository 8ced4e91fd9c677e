"""The messages for one turn: a system message (role, the kernel ABI taken from
gemmrl.runtime.abi's docstring, the rules) and a user message (problem, layout, accumulator,
the current best kernel with its times against each baseline and its ptxas resources, Nsight
Compute metrics when given, the previous turn's feedback, and retrieved examples)."""

from __future__ import annotations

from gemmrl.core.problem import Problem
from gemmrl.runtime import abi

LOG_TAIL_CHARS = 3000
EXAMPLE_CHARS = 6000

RULES = """Rules:
- Reply with the complete .cu file in ONE fenced ```cuda block; it must define the three ABI
  symbols with extern "C" linkage. Only the last code block that defines gemmrl_run is used.
- gemmrl_run only enqueues work on the given `stream`: no cudaMalloc/cudaFree (use the workspace
  you ask for via gemmrl_workspace_bytes), no synchronisation, no host round trip, no other
  streams, no threads, no cuBLAS or other libraries. It must be capturable in a CUDA graph.
- Allowed headers: cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, cuda.h, mma.h, cuda/barrier,
  cstdint, stdint.h, cstddef, and CUTLASS/CuTe (cute/..., cutlass/...). Inline PTX only inside
  __device__/__global__ functions. No file, process, network, environment or dynamic-loading
  calls; no load-time constructors; no ## token pasting.
- The result must be exact to fp32-accumulate precision, for any leading dimensions given, on
  fresh inputs every call (no caching of results or pointers). Return nonzero without launching
  anything for shapes you do not support.
- Target: NVIDIA Hopper (sm_90a; wgmma, TMA and clusters are available). Faster is better."""


def system_message() -> dict:
    doc = (abi.__doc__ or "").strip()
    return {"role": "system", "content":
            "You write high-performance HGEMM CUDA kernels for NVIDIA Hopper (H100/H200), one "
            "problem shape at a time. Each kernel is verified against a reference with hostile "
            "checks and then timed; your reward is its speedup over the best baseline.\n\n"
            f"The kernel ABI:\n{doc}\n\n{RULES}"}


def _fmt_us(t) -> str:
    return "n/a" if t is None else f"{float(t):.2f} us"


def _resources(res) -> str:
    if not res:
        return "  (no ptxas report)"
    lines = []
    for r in res:
        d = r if isinstance(r, dict) else getattr(r, "__dict__", {})
        lines.append(f"  {d.get('name', '?')}: {d.get('registers', '?')} registers, "
                     f"{d.get('spill_stores', 0)} B spill stores, {d.get('spill_loads', 0)} B spill loads, "
                     f"{d.get('stack_bytes', 0)} B stack, {d.get('smem_bytes', 0)} B static smem")
    return "\n".join(lines)


def describe_problem(problem: Problem, layout: str) -> str:
    b = "[K,N] (row-major)" if layout == "NN" else "[N,K] (row-major; C = A @ B^T)"
    return (f"Problem: C[M,N] = A[M,K] @ B with M={problem.M}, N={problem.N}, K={problem.K}; "
            f"inputs {problem.dtype}, accumulate in {problem.acc}, output {problem.dtype}.\n"
            f"Layout {layout}: A is [M,K] row-major, B is {b}. gemmrl_meta() must report "
            f'"layout": "{layout}", "dtype": "{problem.dtype}", "acc": "{problem.acc}".')


def build_messages(problem: Problem, layout: str = "NN", *, best: dict | None = None,
                   baselines: dict | None = None, feedback: list[dict] | None = None,
                   examples: list | None = None, ncu: dict | None = None) -> list[dict]:
    """best: {source, time_us, resources, reward}; baselines: {name: time_us}; feedback: the
    previous turn's outcomes [{status, reason, build_log, time_us, reward}]; examples:
    retrieve.Example list; ncu: {metric: value} for the best kernel when ncu ran."""
    parts = [describe_problem(problem, layout)]
    if baselines:
        parts.append("Baselines (median kernel time on this GPU):\n" +
                     "\n".join(f"  {n}: {_fmt_us(t)}" for n, t in sorted(baselines.items())))
    if best and best.get("source"):
        t = best.get("time_us")
        vs = ""
        if baselines and t:
            vs = "\n".join(f"  vs {n}: {float(bt) / float(t):.3f}x" for n, bt in sorted(baselines.items()) if bt)
        parts.append(f"The current best kernel for this shape ({_fmt_us(t)}, reward "
                     f"{best.get('reward', 0.0):.3f}):\n{vs}\nptxas report:\n{_resources(best.get('resources'))}\n"
                     f"```cuda\n{best['source'].rstrip()}\n```")
        if ncu:
            parts.append("Nsight Compute metrics of the best kernel:\n" +
                         "\n".join(f"  {k}: {v}" for k, v in sorted(ncu.items())))
    else:
        parts.append("There is no verified kernel for this shape yet.")
    for i, fb in enumerate(feedback or []):
        st = fb.get("status", "?")
        text = f"Your previous attempt #{i + 1}: {st}."
        if fb.get("reason"):
            text += f"\nReason: {fb['reason']}"
        if st == "compile_error" and fb.get("build_log"):
            text += f"\nnvcc output (tail):\n```\n{fb['build_log'][-LOG_TAIL_CHARS:]}\n```"
        if st == "ok":
            text += f" Time {_fmt_us(fb.get('time_us'))}, reward {float(fb.get('reward') or 0):.3f}."
            if fb.get("resources"):
                text += f"\nptxas report:\n{_resources(fb['resources'])}"
        parts.append(text)
    for ex in examples or []:
        p = ex.problem
        text = ex.text if len(ex.text) <= EXAMPLE_CHARS else ex.text[:EXAMPLE_CHARS] + "\n// ... (truncated)"
        fence = "cuda" if ex.origin == "trajectory" else "json"
        parts.append(f"Example: the best kernel found for the similar shape M={p.M}, N={p.N}, K={p.K} "
                     f"({p.dtype}, acc {p.acc}): {ex.name}, {_fmt_us(ex.time_us)}\n```{fence}\n{text.rstrip()}\n```")
    parts.append("Write a faster correct kernel for this problem. Reply with the whole .cu file in one "
                 "```cuda block.")
    return [system_message(), {"role": "user", "content": "\n\n".join(parts)}]
