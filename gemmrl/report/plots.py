"""Report figures (PNG): speedup against FLOPs, speedup distribution, TFLOP/s against FLOPs.

Inputs are the tables of gemmrl.report.export: `rows_by_mode` maps a mode to the (columns, rows)
of speedup_rows (or of times_rows for plot_tflops). Each function writes one PNG atomically and
returns its path. Matplotlib runs headless (Agg backend, set before pyplot is imported).
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from gemmrl.report.export import BEST_BASELINE, atomic_write, is_baseline, is_repeat  # noqa: E402

Table = tuple[list[str], list[list]]

# Single-impl families have no '-max' column: their own column is their best layout.
_SINGLE_FAMILIES = ("torch.matmul", "torch.compile")


def _flops(mnk: str) -> int:
    M, N, K = (int(x) for x in mnk.split("_"))
    return 2 * M * N * K


def _title(what: str, subject: str | None, device: str | None) -> str:
    parts = [what]
    if subject:
        parts.append(f"{subject}")
    if device:
        parts.append(f"on {device}")
    return " ".join(parts)


def palette_png(png: bytes) -> bytes:
    """A PNG re-encoded with a 256-colour palette: a scatter plot's few marker colours and their
    antialiased edges survive it unchanged to the eye, at about a fifth of the RGBA file (the
    reports are committed, and every tracked file travels with each device call)."""
    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(png)) as im:
        im.convert("RGBA").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(
            out, format="png", optimize=True)
    return out.getvalue()


def _save(fig, out_path: str | os.PathLike) -> Path:
    try:
        raw = io.BytesIO()
        fig.savefig(raw, format="png", dpi=110, bbox_inches="tight")
        data = palette_png(raw.getvalue())
        return atomic_write(out_path, lambda f: f.write(data), binary=True)
    finally:
        plt.close(fig)


def _panels(n: int, nrows: int = 1, width: float = 5.5, height: float = 4.2):
    n = max(n, 1)
    fig, axes = plt.subplots(nrows, n, figsize=(width * n, height * nrows), squeeze=False)
    return fig, axes


def _no_data(ax, mode: str) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(mode)


def _speedup_columns(columns: list[str]) -> list[str]:
    return [c for c in columns
            if c.endswith("-max") or c in _SINGLE_FAMILIES or c == BEST_BASELINE]


def _column(table: Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flops, speedups) of the non-empty cells of one column."""
    columns, rows = table
    j = columns.index(name)
    pts = [(_flops(r[0]), r[j]) for r in rows if r[j] is not None and r[j] > 0]
    if not pts:
        return np.empty(0), np.empty(0)
    x, y = zip(*pts)
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float)


_PLAIN = FuncFormatter(lambda v, _pos: f"{v:g}")  # 0.5, 1, 2 rather than 2^-1, 2^0, 2^1
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "h")


def _log2_y(ax) -> None:
    """Log2 speedup axis labelled 0.5, 1, 2; over a narrow range also 0.75, 1.5, 3 (call after
    the data are drawn, so the limits are known)."""
    ax.set_yscale("log", base=2)
    lo, hi = ax.get_ylim()
    lo_e, hi_e = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    subs = (1.0, 1.5) if hi_e - lo_e <= 3 else (1.0,)
    ticks = [m * 2.0 ** e for e in range(lo_e, hi_e + 1) for m in subs if lo <= m * 2.0 ** e <= hi]
    ax.set_yticks(ticks)
    ax.yaxis.set_major_formatter(_PLAIN)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    ax.set_ylim(lo, hi)


def _geomean(v: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(v))))


def plot_speedup_vs_flops(rows_by_mode: Mapping[str, Table], out_path: str | os.PathLike,
                          subject: str | None = None, device: str | None = None) -> Path:
    """A panel per mode: speedup (log2) against FLOPs (log) for every '-max' column, torch.matmul,
    torch.compile and best-baseline; a line at 1."""
    modes = list(rows_by_mode)
    fig, axes = _panels(len(modes))
    for ax, mode in zip(axes[0], modes or ["(none)"]):
        table = rows_by_mode.get(mode) if modes else None
        plotted = False
        if table is not None:
            for name in _speedup_columns(table[0]):
                x, y = _column(table, name)
                if x.size == 0:
                    continue
                best = name == BEST_BASELINE
                ax.scatter(x, y, s=14 if best else 7, alpha=0.9 if best else 0.45,
                           color="black" if best else None, zorder=3 if best else 2,
                           label=f"vs {name} (geomean {_geomean(y):.3f})")
                plotted = True
        if not plotted:
            _no_data(ax, mode)
            continue
        ax.set_xscale("log")
        ax.axhline(1.0, color="red", linewidth=1, linestyle="--")
        _log2_y(ax)
        ax.set_xlabel("FLOPs (2MNK)")
        ax.set_ylabel("speedup (baseline time / subject time)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(_title("Speedup of", subject, device))
    return _save(fig, out_path)


def plot_distribution(rows_by_mode: Mapping[str, Table], out_path: str | os.PathLike,
                      subject: str | None = None, device: str | None = None,
                      column: str = BEST_BASELINE) -> Path:
    """Per mode: a histogram of log2 speedups (top) and the sorted speedup curve (bottom)
    against `column` (best-baseline by default), with the geometric mean marked and written."""
    modes = list(rows_by_mode)
    fig, axes = _panels(len(modes), nrows=2, height=3.6)
    for i, mode in enumerate(modes or ["(none)"]):
        hist_ax, curve_ax = axes[0][i], axes[1][i]
        table = rows_by_mode.get(mode) if modes else None
        y = np.empty(0)
        if table is not None and column in table[0]:
            _, y = _column(table, column)
        if y.size == 0:
            _no_data(hist_ax, mode)
            _no_data(curve_ax, mode)
            continue
        g = _geomean(y)
        slower = float(np.mean(y < 1.0))
        logs = np.log2(y)
        lo, hi = math.floor(logs.min() * 8) / 8, math.ceil(logs.max() * 8) / 8
        bins = np.arange(lo, hi + 0.125, 0.125) if hi > lo else 10
        hist_ax.hist(logs, bins=bins, color="tab:blue", alpha=0.8)
        hist_ax.axvline(0.0, color="red", linestyle="--", linewidth=1)
        hist_ax.axvline(math.log2(g), color="black", linewidth=1.5)
        hist_ax.set_xlabel(f"log2 speedup vs {column}")
        hist_ax.set_ylabel("shapes")
        hist_ax.set_title(f"{mode}: geomean {g:.3f}x, {slower:.0%} slower, n={y.size}")

        ys = np.sort(y)
        frac = (np.arange(ys.size) + 0.5) / ys.size
        curve_ax.plot(frac, ys, color="tab:blue")
        curve_ax.axhline(1.0, color="red", linestyle="--", linewidth=1)
        curve_ax.axhline(g, color="black", linewidth=1.2)
        _log2_y(curve_ax)
        curve_ax.annotate(f"geomean {g:.3f}x", xy=(0.02, g), xycoords=("axes fraction", "data"),
                          xytext=(0, 4), textcoords="offset points", fontsize=8)
        curve_ax.set_xlabel("fraction of shapes (sorted)")
        curve_ax.set_ylabel(f"speedup vs {column}")
        curve_ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(_title("Speedup distribution of", subject, device))
    return _save(fig, out_path)


def plot_tflops(times_by_mode: Mapping[str, Table], out_path: str | os.PathLike,
                device: str | None = None, peaks: Mapping[str, float] | None = None) -> Path:
    """A panel per mode: TFLOP/s (from the median) against FLOPs, one series per impl (repeat
    timings left out); the measured matrix peak as a dashed line when peaks are given."""
    modes = list(times_by_mode)
    fig, axes = _panels(len(modes))
    for ax, mode in zip(axes[0], modes or ["(none)"]):
        table = times_by_mode.get(mode) if modes else None
        series: dict[str, list[tuple[int, float]]] = {}
        if table is not None:
            columns, rows = table
            ji, jm, jt = columns.index("impl"), columns.index("mnk"), columns.index("tflops")
            for r in rows:
                if r[jt] is None or r[jt] <= 0 or is_repeat(r[ji]):
                    continue
                series.setdefault(r[ji], []).append((_flops(r[jm]), r[jt]))
        if not series:
            _no_data(ax, mode)
            continue
        for k, (impl, pts) in enumerate(series.items()):
            pts.sort()
            x, y = zip(*pts)
            candidate = not is_baseline(impl)  # candidates drawn larger, edged in black
            ax.plot(x, y, marker=_MARKERS[k % len(_MARKERS)], markersize=6 if candidate else 3.5,
                    markeredgecolor="black" if candidate else "none", linewidth=0,
                    alpha=0.9 if candidate else 0.6, label=impl, zorder=3 if candidate else 2)
        if peaks and peaks.get("matrix_tflops"):
            ax.axhline(float(peaks["matrix_tflops"]), color="red", linestyle="--", linewidth=1,
                       label=f"measured peak {float(peaks['matrix_tflops']):.0f} TFLOP/s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOPs (2MNK)")
        ax.set_ylabel("TFLOP/s (median time)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(_title("Throughput", None, device))
    return _save(fig, out_path)
