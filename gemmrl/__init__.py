"""gemmrl: writes, verifies and times HGEMM kernels per shape and keeps the fastest.

The runtime API is exported lazily, so `import gemmrl` stays light (no torch import):
`gemmrl.matmul`, `gemmrl.use_pack`, `gemmrl.patch`, `gemmrl.unpatch`, `gemmrl.warmup`,
`gemmrl.explain`, `gemmrl.set_fallback` (gemmrl/runtime/ops.py) and `gemmrl.load_pack`, `gemmrl.export_pack`
(gemmrl/runtime/pack.py).
"""

__version__ = "0.1.0"

_LAZY = {
    "matmul": "gemmrl.runtime.ops", "use_pack": "gemmrl.runtime.ops", "patch": "gemmrl.runtime.ops",
    "unpatch": "gemmrl.runtime.ops", "warmup": "gemmrl.runtime.ops", "explain": "gemmrl.runtime.ops",
    "set_fallback": "gemmrl.runtime.ops",
    "load_pack": "gemmrl.runtime.pack", "export_pack": "gemmrl.runtime.pack",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(_LAZY[name])
        # matmul: the C++ fast path's own function where it loads (built once, on first use)
        value = mod.public_matmul() if name == "matmul" else getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gemmrl' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
