from pathlib import Path

import pytest

from gemmrl.build.nvcc import build_shared
from gemmrl.runtime.abi import AbiError, AbiKernel, KernelMeta, kernel_names
from gemmrl.verify.trace import base_name

KERNELS = Path(__file__).resolve().parent / "kernels"


def test_kernel_names_are_the_demangled_names_the_profiler_reports(tmp_path):
    r = build_shared((KERNELS / "honest_tn.cu").read_text(), name="honest_tn", include_dirs=(KERNELS,),
                     cache_dir=tmp_path)
    assert r.ok, r.log
    names = kernel_names(r.path)
    # the demangled form, and the mangled one (kineto reports long CUTLASS names mangled)
    (name,) = {n for n in names if not n.startswith("_Z")}
    (mangled,) = {n for n in names if n.startswith("_Z")}
    assert mangled.startswith("_Z23gemmrl_test_gemm_kernel")
    # the form kineto prints: return type, template arguments, parameter list
    assert name.startswith("void gemmrl_test_gemm_kernel<(gemmrl_test::Layout)1,") and name.endswith(")")
    assert base_name(name) == "gemmrl_test_gemm_kernel"
    assert AbiKernel(r.path).meta.layout == "TN"


def test_extern_c_kernel_name(tmp_path):
    src = ('#include <cuda_runtime.h>\nextern "C" __global__ void plain_kernel(float* x) { x[0] = 1; }\n'
           'extern "C" void go(float* x, cudaStream_t s) { plain_kernel<<<1, 1, 0, s>>>(x); }\n')
    r = build_shared(src, name="plain", cache_dir=tmp_path)
    assert r.ok, r.log
    # nvcc mangles the stub's name even for C linkage, so the name carries a parameter list;
    # the trace check matches such names by their base name
    assert {base_name(n) for n in kernel_names(r.path) if not n.startswith("_Z")} == {"plain_kernel"}


def test_meta_validation():
    assert KernelMeta.parse('{"layout": "NN"}') == KernelMeta("NN", "fp16", "fp32", "kernel")
    with pytest.raises(AbiError, match="layout must be"):
        KernelMeta.parse('{"layout": "NT"}')
    with pytest.raises(AbiError, match="not JSON"):
        KernelMeta.parse("layout=NN")
    with pytest.raises(AbiError, match="acc must be"):
        KernelMeta.parse('{"layout": "TN", "acc": "fp64"}')


def test_missing_abi_symbols_are_named(tmp_path):
    r = build_shared('extern "C" int gemmrl_run() { return 0; }\n', name="partial", cache_dir=tmp_path)
    assert r.ok, r.log
    with pytest.raises(AbiError, match="gemmrl_meta, gemmrl_workspace_bytes"):
        AbiKernel(r.path)
