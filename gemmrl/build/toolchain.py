"""What gemmrl compiles with (nvcc, the CUTLASS headers), as the machine's problem rather than
a kernel's. A kernel that does not compile is a rejected candidate with its log, and the search
never proposes it again; a machine without the headers fails every CUTLASS kernel the same way,
and recording those as the kernels' failures poisons the store for every later run (H200,
2026-12-01: a device call that lost its headers recorded 211 CUTLASS candidates as rejected in
three calls, and its final timing failed the tuned kernels' verification). So a missing tool is
`ToolchainMissing`: a tune checks for it before it starts (`require`), and one raised later stops
the run, through the timing worker (bench.worker marks it) instead of becoming a record.
Needs no GPU.
"""

from __future__ import annotations


class ToolchainMissing(RuntimeError):
    """A compiler or header set gemmrl builds with is not on this machine: nothing about the
    kernel that was being built. Never stored as a candidate's or an implementation's failure."""


def missing(families) -> list[str]:
    """What each kernel family of `families` (registry names) would lack to build here: nvcc,
    and the CUTLASS headers for a family built on them; [] when everything is found. Pure
    apart from looking at the file system and the environment."""
    from gemmrl.build.nvcc import nvcc_path
    from gemmrl.space import registry

    out = []
    try:
        nvcc_path()
    except ToolchainMissing as e:
        out.append(str(e))
    for name in dict.fromkeys(families):
        try:
            registry.get(name).build_kwargs()
        except ToolchainMissing as e:
            out.append(f"{name}: {e}")
    return out


def require(families, what: str = "this run") -> None:
    """Raise ToolchainMissing, naming every missing piece, unless each of `families` can build."""
    lacks = missing(families)
    if lacks:
        raise ToolchainMissing(f"{what} cannot build its kernels here: " + "; ".join(lacks))
