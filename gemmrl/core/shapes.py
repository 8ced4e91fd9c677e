"""Shape sets: CUDA-L2's 1000-grid, a stratified 100-shape subset, shape files, `MxNxK` text.

Every parser raises ProblemError with a message that names what is wrong and where.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

from gemmrl.core.problem import Problem, ProblemError

GRID_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384)

_SHAPE_RE = re.compile(r"^\s*(-?\d+)\s*[xX,_ ]\s*(-?\d+)\s*[xX,_ ]\s*(-?\d+)\s*$")


def grid(dtype: str = "fp16", acc: str = "fp32") -> list[Problem]:
    """The 1000 shapes: M, N, K each in GRID_SIZES, in M-major order as CUDA-L2 lists them."""
    return [Problem(m, n, k, dtype, acc) for m, n, k in itertools.product(GRID_SIZES, repeat=3)]


def subset(count: int = 100, dtype: str = "fp16", acc: str = "fp32", seed: int = 0) -> list[Problem]:
    """A stratified sample of the grid: sort by FLOPs, cut into `count` equal strata, one shape
    from each (seeded, so the subset is the same everywhere). Covers tiny to huge evenly."""
    full = grid(dtype, acc)
    if not 1 <= count <= len(full):
        raise ProblemError(f"subset size must be between 1 and {len(full)}, got {count}")
    ordered = sorted(full, key=lambda p: (p.flops, p.M, p.N, p.K))
    rng = random.Random(seed)
    picked = []
    for i in range(count):
        lo = i * len(ordered) // count
        hi = (i + 1) * len(ordered) // count
        picked.append(ordered[rng.randrange(lo, hi)])
    return sorted(picked, key=lambda p: (p.M, p.N, p.K))


def parse_shape(text: str, dtype: str = "fp16", acc: str = "fp32") -> Problem:
    """'4096x4096x1024' (also '4096_4096_1024', '4096,4096,1024') -> Problem."""
    m = _SHAPE_RE.match(text)
    if not m:
        raise ProblemError(f"cannot parse shape {text!r}: expected MxNxK, e.g. 4096x4096x1024")
    M, N, K = (int(g) for g in m.groups())
    try:
        return Problem(M, N, K, dtype, acc)
    except ProblemError as e:
        raise ProblemError(f"shape {text.strip()!r}: {e}") from None


def parse_shape_file(path: str | Path, dtype: str = "fp16", acc: str = "fp32") -> list[Problem]:
    """One shape per line (MxNxK, M_N_K or M,N,K); '#' starts a comment; blank lines skipped.
    A CSV with an 'mnk' header (CUDA-L2's result files) works too: its first column is read."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ProblemError(f"cannot read shape file {path}: {e.strerror or e}") from None
    problems = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if lineno == 1 and line.lower().startswith("mnk"):
            continue  # CSV header
        first = line.split(",", 1)[0]
        if "," in line and re.search(r"\d[xX_]\d", first):
            line = first  # a CSV row: its first column is the shape
        try:
            problems.append(parse_shape(line, dtype, acc))
        except ProblemError as e:
            raise ProblemError(f"{path}:{lineno}: {e}") from None
    if not problems:
        raise ProblemError(f"shape file {path} holds no shapes")
    return problems


def write_shape_file(path: str | Path, shapes, comment: str) -> None:
    """The file parse_shape_file reads: `comment` as its first line ('# ...'), then one MxNxK a
    line for each (M, N, K) of `shapes`; parent directories made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {comment}\n" + "".join(f"{m}x{n}x{k}\n" for m, n, k in shapes))


def resolve(spec: str, dtype: str = "fp16", acc: str = "fp32") -> list[Problem]:
    """The CLI's --shapes: 'grid', 'subset', 'subset:N', 'preset:MODEL[@tokens=1,64][@fused]'
    (an LLM's projections, gemmrl/core/presets.py), a file path, or comma/space separated
    MxNxK shapes. Duplicates are dropped, order kept."""
    spec = spec.strip()
    if spec.startswith("preset:"):
        from gemmrl.core.presets import parse_spec, preset

        out = [p for p, _layout, _label in preset(**parse_spec(spec), dtype=dtype, acc=acc)]
    elif spec == "grid":
        out = grid(dtype, acc)
    elif spec == "subset":
        out = subset(100, dtype, acc)
    elif spec.startswith("subset:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ProblemError(f"bad subset size in {spec!r}: expected subset:N") from None
        out = subset(n, dtype, acc)
    elif Path(spec).is_file():
        out = parse_shape_file(spec, dtype, acc)
    elif re.search(r"\d", spec) and not re.search(r"[/\\]", spec):
        out = [parse_shape(s, dtype, acc) for s in re.split(r"[;\s]+|,(?=\s*\d+\s*[xX])", spec) if s.strip()]
    else:
        raise ProblemError(f"--shapes {spec!r}: not 'grid', 'subset', an existing file, or MxNxK")
    seen, unique = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


def shapes_below(path: str | Path, column: str, threshold: float, dtype: str = "fp16",
                 acc: str = "fp32") -> list[Problem]:
    """The shapes of a speedup CSV (the report's '<prefix>_speedup_<mode>.csv') whose `column`
    is below `threshold`, worst first: where to search again. Empty cells are skipped."""
    import csv

    path = Path(path)
    try:
        rows = list(csv.DictReader(path.read_text().splitlines()))
    except OSError as e:
        raise ProblemError(f"cannot read {path}: {e.strerror or e}") from None
    if not rows or "mnk" not in rows[0]:
        raise ProblemError(f"{path} is not a speedup CSV (no 'mnk' column)")
    if column not in rows[0]:
        cols = ", ".join(c for c in rows[0] if c != "mnk")
        raise ProblemError(f"{path} has no column {column!r}; it has: {cols}")
    picked = []
    for row in rows:
        cell = (row.get(column) or "").strip()
        if not cell:
            continue
        try:
            v = float(cell)
        except ValueError:
            raise ProblemError(f"{path}: {row['mnk']}: {column} is not a number: {cell!r}") from None
        if v < threshold:
            picked.append((v, parse_shape(row["mnk"], dtype, acc)))
    picked.sort(key=lambda t: t[0])
    return [p for _, p in picked]
