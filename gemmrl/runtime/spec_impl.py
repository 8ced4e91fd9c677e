"""A kernel spec of any family as a harness implementation: render, build (cached), load, call."""

from __future__ import annotations

from gemmrl.build.nvcc import build_shared, is_built
from gemmrl.core.impl import Impl, UnsupportedProblem
from gemmrl.runtime.abi import AbiError, AbiKernel, abi_call, kernel_names
from gemmrl.space.registry import family_of


class SpecImpl(Impl):
    trusted = False

    def __init__(self, spec, name: str | None = None, arch: str = "sm_90a"):
        self.spec = spec
        self.family = family_of(spec)
        self.name = name or spec.name
        self.layout = spec.layout
        self.arch = arch
        self.kernel: AbiKernel | None = None
        self.build = None

    def supports(self, problem) -> bool:
        return self.family.valid(self.spec, problem) is None

    def source(self, problem) -> str:
        return self.family.render(self.spec, problem)

    def is_built(self, problem) -> bool:
        """Whether this spec's build for the problem is already in the cache."""
        return is_built(self.source(problem), name=self.name, arch=self.arch, **self.family.build_kwargs())

    def prepare(self, problem):
        why = self.family.valid(self.spec, problem)
        if why is not None:
            raise UnsupportedProblem(f"{self.name}: {why}")
        self.build = build_shared(self.source(problem), name=self.name, arch=self.arch,
                                  **self.family.build_kwargs())
        if not self.build.ok:
            raise AbiError(f"{self.name} failed to build:\n{self.build.log[-3000:]}")
        self.kernel = AbiKernel(self.build.path)
        return abi_call(self.kernel, problem, self.name)

    def own_kernels(self):
        return kernel_names(self.kernel.path) if self.kernel is not None else None

    def describe(self) -> dict:
        d = {"name": self.name, "family": self.family.name, "layout": self.layout,
             "spec": dict(self.spec.__dict__)}
        if self.build is not None:
            d["build"] = {"key": self.build.key, "seconds": round(self.build.seconds, 1),
                          "resources": [r.__dict__ for r in self.build.resources]}
        return d
