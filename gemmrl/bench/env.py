"""Provenance of a measurement and the device's own ceilings, read on the device."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

import gemmrl


def git_commit() -> str:
    if os.environ.get("GEMMRL_COMMIT"):
        return os.environ["GEMMRL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(gemmrl.__file__).parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(gemmrl.__file__).parent,
                               timeout=10).stdout.strip()
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'NVIDIA H200' -> 'h200'."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper().replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", device_name.lower())).lower()


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


GPU_FIELDS = {"pci.bus_id": "pci_bus_id", "power.limit": "power_limit_w", "clocks.max.sm": "max_sm_mhz",
              "clocks.max.mem": "max_mem_mhz", "clocks.applications.graphics": "app_sm_mhz", "vbios_version": "vbios"}


def parse_gpu_query(uuid: str, text: str) -> dict:
    """nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits output for one GPU ->
    {'uuid': ..., 'pci_bus_id': ..., 'power_limit_w': 700.0, ...}: numbers as numbers, a field
    nvidia-smi cannot read ('[N/A]', 'N/A', '[Not Supported]') left out. Pure."""
    out: dict = {"uuid": uuid} if uuid else {}
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) != 1:
        return out
    values = [v.strip() for v in lines[0].split(",")]
    if len(values) != len(GPU_FIELDS):
        return out
    for key, value in zip(GPU_FIELDS.values(), values):
        if not value or "N/A" in value or "Not Supported" in value:
            continue
        try:
            out[key] = float(value) if key.endswith(("_w", "_mhz")) else value
        except ValueError:
            out[key] = value
    return out


def gpu_identity(props=None) -> dict:
    """Which physical GPU a run timed on, and the limits its speed depends on: its UUID (torch's),
    PCI bus id, power limit, maximum and application clocks, VBIOS (nvidia-smi, asked by UUID, so
    CUDA_VISIBLE_DEVICES does not matter). A lent machine may be another GPU from call to call; the
    same kernels' ratios over cuBLASLt moved by up to 7% between two calls of one session
    (2026-11-28, runs 601 and 604), with nothing recorded to tell the GPUs apart. Never raises:
    what cannot be read is left out."""
    try:
        if props is None:
            import torch

            props = torch.cuda.get_device_properties(torch.cuda.current_device())
        uuid = str(getattr(props, "uuid", "") or "")
    except Exception:  # no GPU, an old torch: nothing to say
        return {}
    if not uuid:
        return {}
    smi_id = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    try:
        r = subprocess.run(["nvidia-smi", f"--id={smi_id}", f"--query-gpu={','.join(GPU_FIELDS)}",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        text = r.stdout if r.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return parse_gpu_query(smi_id, text)


def use_harness_settings() -> dict:
    """Set torch's matmul flags the way every gemmrl measurement runs them and return them: no
    reduced-precision reduction in fp16 or bf16 (torch.matmul then accumulates as the fp32
    baselines do; shared/measuring.md). Called by each command before it records its run's
    provenance and by each worker before it times, so the provenance states what was timed (tune
    runs before 2026-11-28 recorded torch's default, True, though their workers timed with False)."""
    import torch

    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return {"allow_fp16_reduced_precision_reduction": False, "allow_bf16_reduced_precision_reduction": False}


def codegen_settings() -> dict:
    """The settings of the process that change the kernels' generated source (and so what a run
    timed) without changing the commit: recorded in every run's provenance. No GPU needed; reads
    the environment."""
    from gemmrl.space.cutlass_sm90 import entry_cache_default

    return {"cutlass_entry_cache": entry_cache_default()}


def provenance(cublas_version: str = "") -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": torch.cuda.get_device_name(),
        "gpu": gpu_slug(torch.cuda.get_device_name()),
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "driver": driver_version(),
        "cuda": torch.version.cuda,
        "cublas": cublas_version,
        "torch": torch.__version__,
        "gemmrl": gemmrl.__version__,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu_identity": gpu_identity(props),
        "python": platform.python_version(),
        "torch_settings": {
            "allow_fp16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "allow_bf16_reduced_precision_reduction":
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        },
        "codegen": codegen_settings(),
    }


def measure_peaks(matrix_n: int = 8192, copy_bytes: int = 2 << 30) -> dict:
    """The device's matrix rate (fp16, fp32 accumulate, the best of cuBLAS on an n^3 product)
    and copy bandwidth (bytes read + written), measured now with CUDA events."""
    import torch

    from gemmrl.bench.stats import summarize_samples

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        xs = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            xs.append(e0.elapsed_time(e1) * 1e3)
        return summarize_samples(xs)

    n = matrix_n
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    mm = timed(lambda: torch.matmul(a, b, out=c), 20)
    del a, b, c
    src = torch.randn(copy_bytes // 2, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    cp = timed(lambda: dst.copy_(src), 20)
    del dst
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    rd = timed(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=acc), 20)
    del src
    torch.cuda.empty_cache()
    copy_gbs = 2 * copy_bytes / (cp["min_us"] * 1e-6) / 1e9
    read_gbs = copy_bytes / (rd["min_us"] * 1e-6) / 1e9
    # GEMMs mostly read: a skinny GEMM streams its large operand faster than a copy moves bytes,
    # so the bandwidth ceiling is the faster of the two
    return {"matrix_tflops": 2 * n ** 3 / (mm["min_us"] * 1e-6) / 1e12,
            "bandwidth_gbs": max(copy_gbs, read_gbs), "copy_gbs": copy_gbs, "read_gbs": read_gbs}
