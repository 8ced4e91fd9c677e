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


# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*), by name
CLOCK_EVENTS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                0x100: "display_clocks"}
NVML_FI_DEV_MEMORY_TEMP = 82  # nvml.h: the memory (HBM) temperature, a field value
STATE_ENV = "GEMMRL_GPU_STATE"  # "0": record no GPU state with the sessions


def clock_event_names(mask: int) -> list[str]:
    """NVML's clock-event reason bitmask -> the reasons' names, lowest bit first; an unknown bit
    as its hex value. Pure."""
    out = [name for bit, name in CLOCK_EVENTS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENTS)
    return out + ([hex(rest)] if rest else [])


def _field_number(fv):
    """One nvmlFieldValue_t's value as a number, by its valueType; None where NVML did not read it."""
    if getattr(fv, "nvmlReturn", 1) != 0:
        return None
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
            6: "usVal"}.get(getattr(fv, "valueType", -1))
    return getattr(fv.value, attr, None) if attr else None


_NVML: dict = {}  # (NVML module, GPU UUID) -> handle; ("init", module): NVML initialized there


def _nvml_handle(nvml, uuid: str):
    """NVML's handle of the GPU with this UUID, NVML initialized once per process (tried once)."""
    key = (nvml, uuid)
    if key not in _NVML:
        if ("init", nvml) not in _NVML:
            _NVML[("init", nvml)] = False  # a failed init (no driver) is not tried again
            nvml.nvmlInit()
            _NVML[("init", nvml)] = True
        if not _NVML[("init", nvml)]:
            raise RuntimeError("NVML did not initialize in this process")
        try:
            _NVML[key] = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except TypeError:  # an nvidia-ml-py that takes bytes only
            _NVML[key] = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
    return _NVML[key]


def gpu_state(uuid: str | None = None, nvml=None) -> dict:
    """The GPU's state now, for a session's record: temperatures (the GPU's, and the memory's where
    NVML reports it), SM and memory clocks, power draw and the active clock-event (throttle)
    reasons, read through NVML (nvidia-ml-py's pynvml; `nvml` stands in for it in tests). The same
    stored cuBLASLt algorithm ran 7-12% slower on small shapes in some runs than in others
    (2026-11-26/27 against 2026-11-28 on, results/README.md), and nothing recorded told those
    sessions' GPUs apart. Microseconds, so read once per (shape, mode) session. `uuid`: the GPU
    (default torch's current device's). Never raises: what cannot be read is left out; {} without
    NVML or with GEMMRL_GPU_STATE=0."""
    if os.environ.get(STATE_ENV, "1") == "0" or (nvml is None and _NVML.get("missing")):
        return {}
    try:
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError:
                _NVML["missing"] = True  # not looked for again in this process
                raise
        if uuid is None:
            import torch

            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        h = _nvml_handle(nvml, uuid)
    except Exception:  # no NVML, no GPU, another GPU than NVML knows: nothing to say
        return {}
    out: dict = {}
    reads = {
        "temp_c": lambda: nvml.nvmlDeviceGetTemperature(h, 0),  # NVML_TEMPERATURE_GPU
        "mem_temp_c": lambda: _field_number(nvml.nvmlDeviceGetFieldValues(
            h, [getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", NVML_FI_DEV_MEMORY_TEMP)])[0]),
        "sm_mhz": lambda: nvml.nvmlDeviceGetClockInfo(h, 1),  # NVML_CLOCK_SM
        "mem_mhz": lambda: nvml.nvmlDeviceGetClockInfo(h, 2),  # NVML_CLOCK_MEM
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
    }
    for key, read in reads.items():
        try:
            v = read()
        except Exception:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = round(float(v), 1) if key == "power_w" else int(v)
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            out["clock_events"] = clock_event_names(int(fn(h)))
            break
        except Exception:
            continue
    return out


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
