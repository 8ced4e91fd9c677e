"""Kernel families by name. A family is a module with a frozen spec dataclass and the functions
`valid(spec, problem) -> reason | None` (the one legality statement), `render(spec, problem) -> str`
(pure .cu source following the kernel ABI) and a way to propose specs for a problem. Adding a
family is adding an entry here; nothing else changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    module: str
    spec_class: str
    generic: bool  # one build serves every shape its spec accepts (else: built per problem)

    def mod(self):
        return importlib.import_module(self.module)

    def spec_type(self):
        return getattr(self.mod(), self.spec_class)

    def valid(self, spec, problem) -> str | None:
        return self.mod().valid(spec, problem)

    def render(self, spec, problem) -> str:
        return self.mod().render(spec, problem)

    def source_variants(self, spec, problem) -> list[str]:
        """Every source the family has rendered for this very kernel: render(spec, problem) first,
        then sources that differ from it in host code only (the module's `source_variants`, e.g.
        CUTLASS's with and without the driver entry-point cache). Measurements of the product
        name a kernel by its source's hash; these let one taken before a host-only change of the
        renderer still count for the kernel it timed. A module's `source_variants` starts with
        render()'s own, so nothing is rendered twice."""
        m = self.mod()
        return m.source_variants(spec, problem) if hasattr(m, "source_variants") else [m.render(spec, problem)]

    def candidates(self, problem, layout: str, limit: int = 8) -> list:
        """Specs worth trying for a problem, best guess first, all valid for it."""
        m = self.mod()
        if hasattr(m, "heuristic_specs"):
            specs = m.heuristic_specs(problem, layout, problem.acc)
        else:
            specs = m.enumerate_specs(layout, problem.dtype, problem.acc)
        return [s for s in specs if m.valid(s, problem) is None][:limit]

    def build_kwargs(self) -> dict:
        m = self.mod()
        kw = {"extra_flags": tuple(getattr(m, "BUILD_FLAGS", ()))}
        if getattr(m, "USES_CUTLASS", False):
            from gemmrl.build.cutlass import cutlass_build_kwargs

            cut = cutlass_build_kwargs()
            kw = {"include_dirs": cut["include_dirs"], "include_keys": cut["include_keys"],
                  "extra_flags": kw["extra_flags"] + cut["extra_flags"]}
        return kw


FAMILIES = {
    "cutlass_sm90": Family("cutlass_sm90", "gemmrl.space.cutlass_sm90", "CutlassSpec", generic=True),
    "raw": Family("raw", "gemmrl.space.raw", "RawSpec", generic=False),
}


def family_of(spec) -> Family:
    for fam in FAMILIES.values():
        if type(spec).__name__ == fam.spec_class and type(spec).__module__ == fam.module:
            return fam
    raise KeyError(f"no family for spec type {type(spec).__name__}")


def get(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None
