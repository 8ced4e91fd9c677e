"""Where the CUTLASS/CuTe headers are, and which CUTLASS they are (part of every build key)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from gemmrl.build.toolchain import ToolchainMissing


class CutlassHeadersMissing(ToolchainMissing, FileNotFoundError):
    """No CUTLASS headers at $GEMMRL_CUTLASS_DIR nor in the nvidia-cutlass wheel."""


def cutlass_include_dirs() -> list[str]:
    """$GEMMRL_CUTLASS_DIR (a CUTLASS checkout or the wheel's source dir), else the installed
    `nvidia-cutlass` wheel's cutlass_library/source."""
    roots = []
    if os.environ.get("GEMMRL_CUTLASS_DIR"):
        roots.append(Path(os.environ["GEMMRL_CUTLASS_DIR"]))
    try:
        import cutlass_library

        roots.append(Path(cutlass_library.__file__).parent / "source")
    except ImportError:
        pass
    for root in roots:
        if (root / "include" / "cutlass" / "cutlass.h").exists():
            return [str(root / "include"), str(root / "tools" / "util" / "include")]
    where = (f" ($GEMMRL_CUTLASS_DIR={os.environ['GEMMRL_CUTLASS_DIR']} holds no include/cutlass/cutlass.h)"
             if os.environ.get("GEMMRL_CUTLASS_DIR") else "")
    raise CutlassHeadersMissing(f"CUTLASS headers not found{where}: pip install nvidia-cutlass, or set "
                                "GEMMRL_CUTLASS_DIR to a directory holding include/cutlass/cutlass.h")


@functools.lru_cache(maxsize=None)
def cutlass_version(include_dir: str) -> str:
    """'4.2.0' from cutlass/version.h: headers are included with angle brackets, so the build
    key carries the version instead of their text."""
    text = (Path(include_dir) / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def cutlass_build_kwargs() -> dict:
    """The build arguments of a CUTLASS kernel. The headers are named in the cache key by their
    version and place in the CUTLASS tree, not by where they are installed: a cache built where
    the wheel is in a virtual environment serves a GPU machine where it is in /tmp/site."""
    inc = cutlass_include_dirs()
    version = cutlass_version(inc[0])
    root = Path(inc[0]).parent
    return {"include_dirs": tuple(inc),
            "include_keys": tuple(f"cutlass-{version}/{Path(d).relative_to(root)}" for d in inc),
            "extra_flags": (f"-DGEMMRL_CUTLASS_VERSION=\"{version}\"",)}
