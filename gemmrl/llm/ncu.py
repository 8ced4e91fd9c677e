"""Nsight Compute metrics of one kernel call, for the LLM's prompt: memory throughput, SM
throughput, occupancy, cache hit rates and tensor-pipe activity. Runs `ncu` on a child Python
process (gemmrl.llm.ncu_target) that loads the kernel's shared object and calls it once inside
a cudaProfilerStart/Stop range. Optional: without ncu, or when it fails, there are no metrics
(None) and the loop goes on. Parsing is pure and tested on recorded output."""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# metric -> what the prompt calls it
METRICS = {
    "gpu__time_duration.sum": "duration (ns)",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput (% of peak)",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM throughput (% of peak)",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy (% of peak warps)",
    "lts__t_sector_hit_rate.pct": "L2 hit rate (%)",
    "l1tex__t_sector_hit_rate.pct": "L1 hit rate (%)",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe, mma.sync (% active)",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe, wgmma (% active)",
    "launch__registers_per_thread": "registers per thread",
}


def ncu_path() -> str | None:
    found = os.environ.get("GEMMRL_NCU_PATH") or shutil.which("ncu")
    if found:
        return found
    for p in ("/usr/local/cuda/bin/ncu",):
        if Path(p).exists():
            return p
    return None


def _number(text: str) -> float | None:
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def parse_csv(text: str, metrics=tuple(METRICS)) -> dict[str, float]:
    """{metric: value} from `ncu --csv --page raw` output (its own '==PROF==' lines allowed). With
    several kernels in the range, the longest one's values (the GEMM, not a reduction)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return {}
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, data = rows[0], [r for r in rows[1:] if r and r[0].strip()]  # the units row has no ID
    if not data:
        return {}
    col = {name: i for i, name in enumerate(header)}
    dur = col.get("gpu__time_duration.sum")
    if dur is not None:
        data.sort(key=lambda r: _number(r[dur]) or 0.0, reverse=True)
    out = {}
    for m in metrics:
        if m in col and col[m] < len(data[0]):
            v = _number(data[0][col[m]])
            if v is not None:
                out[m] = v
    return out


_UNKNOWN = re.compile(r"(?:Failed to find metric|Unknown metric|invalid metric)[^A-Za-z_]*([A-Za-z0-9_.]+)", re.I)


def command(ncu: str, metrics, target: list[str], *extra: str) -> list[str]:
    """The ncu command line that profiles `target` (a Python argv after the interpreter) between
    its cudaProfilerStart and Stop, for `metrics`, as CSV. --clock-control none: ncu otherwise
    locks the clocks at base, and the machines' measuring method (shared/, the device's
    METHOD.md) leaves them as the timing harness sees them."""
    return [ncu, "--csv", "--page", "raw", "--profile-from-start", "off", "--clock-control", "none", *extra,
            "--target-processes", "all", "--metrics", ",".join(metrics), sys.executable, *target]


def run_dropping_unknown(cmd_for, metrics, parse, *, timeout_s: float, tries: int, run=subprocess.run):
    """Run ncu (`cmd_for(metrics)` -> argv) until `parse(stdout, metrics)` gives something; a metric this
    ncu does not know is dropped and the run retried, `tries` times at most. Returns (what parse
    gave or None, the metrics asked for last, the last process or None where it timed out or
    could not start)."""
    wanted, p = list(metrics), None
    for _ in range(tries):
        try:
            p = run(cmd_for(wanted), capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.TimeoutExpired, OSError):
            return None, wanted, None
        got = parse(p.stdout, wanted)
        if got:
            return got, wanted, p
        bad = set(_UNKNOWN.findall(p.stdout + p.stderr)) & set(wanted)
        if not bad:
            break
        wanted = [m for m in wanted if m not in bad]
        if not wanted:
            break
    return None, wanted, p


def profile(so_path: str, M: int, N: int, K: int, *, timeout_s: float = 180.0,
            metrics=tuple(METRICS), run=subprocess.run) -> dict[str, float] | None:
    """Metrics of one call of the ABI kernel in `so_path` at (M, N, K), or None without ncu or
    on failure. A metric this ncu does not know is dropped and the run retried."""
    ncu = ncu_path()
    if ncu is None:
        return None
    target = ["-m", "gemmrl.llm.ncu_target", str(so_path), str(M), str(N), str(K)]
    got, _wanted, _p = run_dropping_unknown(lambda w: command(ncu, w, target), metrics, parse_csv,
                                            timeout_s=timeout_s, tries=4, run=run)
    return got


def describe(metrics: dict[str, float]) -> dict[str, str]:
    """Prompt-ready names and values."""
    return {METRICS.get(k, k): (f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}") for k, v in metrics.items()}
