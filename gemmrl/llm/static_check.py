"""A static check of untrusted kernel source, before anything builds it.

`check_source(src)` returns the reasons the source is refused (empty: acceptable). It is a cheap
first gate, not the security boundary (the build and run happen in a scrubbed, rlimited worker,
and verify() still applies every cheat check): it refuses headers outside an allowlist, host
code that reaches outside the kernel ABI (files, processes, network, dynamic loading, threads,
other libraries, allocation or synchronisation), programmatic dependent launch (an overlap
of consecutive calls that the kernel-mode timing would credit), load-time constructors, token pasting (which
could assemble a refused name), inline assembly outside __device__ / __global__ functions, and
sources that do not define the three ABI symbols. Comments and string literals are removed
first, so neither triggers a refusal.
"""

from __future__ import annotations

import re

from gemmrl.runtime.abi import REQUIRED_SYMBOLS

ALLOWED_HEADERS = frozenset({
    "cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "cuda.h", "mma.h", "cuda/barrier",
    "cstdint", "stdint.h", "cstddef", "stddef.h",
})
ALLOWED_HEADER_PREFIXES = ("cute/", "cutlass/")

# programmatic dependent launch lets a call start while the previous one drains: the judge's
# kernel mode, a graph of back-to-back calls, would credit that overlap, which a model's graph
# (other kernels between the GEMMs) does not deliver (results/README.md, eleventh session)
PDL_REASON = "programmatic dependent launch: overlaps consecutive calls, which kernel-mode timing would credit"
_GDC_ASM_RE = re.compile(r"\bgriddepcontrol\b")

# (pattern over code without comments and strings, what it reaches)
FORBIDDEN = [
    (r"\b(fopen|freopen|fdopen|fwrite|fread|fprintf|fputs|fscanf|ifstream|ofstream|fstream|filebuf)\b", "file I/O"),
    (r"\b(open|openat|creat|unlink|remove|rename|mkdir|rmdir|truncate|ftruncate|mmap|ioctl|chmod)\s*\(", "file system call"),
    (r"\b(system|popen|exec[lv]p?e?|execvpe|posix_spawnp?|fork|vfork|clone|kill|syscall)\s*\(", "process control"),
    (r"\b(socket|connect|getaddrinfo|gethostbyname|sendto|recvfrom)\s*\(", "network"),
    (r"\b(dlopen|dlsym|dlclose|dlmopen|LoadLibrary\w*|GetProcAddress|cudaGetDriverEntryPoint\w*|cuGetProcAddress\w*)\b", "dynamic loading"),
    (r"\b(getenv|secure_getenv|setenv|putenv|environ)\b", "environment access"),
    (r"\bstd\s*::\s*(thread|jthread|async)\b|\bpthread_\w+", "host threads"),
    (r"\bcudaStreamCreate\w*|\bcudaStreamDestroy\b", "stream creation (use the given stream)"),
    (r"\bcudaMalloc\w*|\bcudaFree\w*|\bcudaHostAlloc\b|\bcudaHostRegister\b|\bmalloc\s*\(|\bcalloc\s*\(|\brealloc\s*\(", "memory allocation (use the workspace)"),
    (r"\bcudaDeviceSynchronize\b|\bcudaStreamSynchronize\b|\bcudaEventSynchronize\b|\bcudaStreamQuery\b|\bcudaThreadSynchronize\b", "host synchronisation"),
    (r"\bcudaMemcpy(ToSymbol|FromSymbol)?\s*\(|\bcudaMemset\s*\(|\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b", "host round trip"),
    (r"\bcudaDeviceReset\b|\bcudaSetDevice\b|\bcudaDeviceSetLimit\b|\bcudaProfiler\w*", "device state change"),
    (r"\bcublas\w*|\bcublasLt\w*", "cuBLAS"),
    (r"\bcurand\w*", "cuRAND"),
    (r"\b(cudnn|cusparse|cufft|cusolver|nccl)\w*", "another library"),
    (r"__attribute__\s*\(\(\s*(constructor|destructor)", "load-time constructor/destructor"),
    (r"\binit_priority\b|\.init_array|\.fini_array", "load-time code"),
    (r"##", "token pasting (can hide names from this check)"),
    (r"\bcudaLaunchAttributeProgrammatic\w*|\bCU_LAUNCH_ATTRIBUTE_PROGRAMMATIC\w*|\bprogrammaticStreamSerialization\w*"
     r"|\bcudaGridDependencySynchronize\b|\bcudaTriggerProgrammaticLaunchCompletion\b|\bCUTLASS_ENABLE_GDC_FOR_SM\d+\b",
     PDL_REASON),
    (r"\b_Pragma\b|#\s*pragma\s+(push_macro|pop_macro)", "preprocessor indirection"),
]
_FORBIDDEN_RE = [(re.compile(p), what) for p, what in FORBIDDEN]
_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*(include\w*|import|embed)[ \t]*(.*)$", re.M)
_ASM_RE = re.compile(r"\b(asm|__asm__|__asm)\b")
_DEFINE_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(.*)$", re.M)


def strip_comments_and_strings(src: str, keep_strings: bool = False) -> str:
    """Comments become spaces (newlines kept); string and char literals become "" / '' unless
    keep_strings (so #include "x" can still be read). Handles raw strings R"d(...)d"."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
            out.append(" ")
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(" " + "\n" * src.count("\n", i, j))
            i = j
        elif c == "R" and i + 1 < n and src[i + 1] == '"' and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'R"([^()\\\s]{0,16})\(', src[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = src.find(")" + m.group(1) + '"', i + m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            out.append(src[i:end] if keep_strings else '""' + "\n" * src.count("\n", i, end))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(src[i:j] if keep_strings else c + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _join_continuations(code: str) -> str:
    return re.sub(r"\\\r?\n", " ", code)


def _check_includes(code_with_strings: str) -> list[str]:
    problems = []
    for m in _INCLUDE_RE.finditer(_join_continuations(code_with_strings)):
        directive, rest = m.group(1), m.group(2).strip()
        if directive != "include":
            problems.append(f"#{directive} is not allowed")
            continue
        hm = re.match(r'[<"]([^>"]+)[>"]', rest)
        if not hm:
            problems.append(f"#include of a computed header ({rest[:60]}) is not allowed")
            continue
        name = hm.group(1).strip()
        shown = hm.group(0)
        if ".." in name or name.startswith("/"):
            problems.append(f"#include {shown}: paths outside the include directories are not allowed")
        elif name not in ALLOWED_HEADERS and not name.startswith(ALLOWED_HEADER_PREFIXES):
            problems.append(f"#include {shown} is not on the allowed list "
                            f"({', '.join(sorted(ALLOWED_HEADERS))}, cute/*, cutlass/*)")
    return problems


def _asm_macros(code: str) -> set[str]:
    """Names of macros whose expansion contains inline assembly (transitively)."""
    defs = {m.group(1): m.group(2) for m in _DEFINE_RE.finditer(code)}
    found = {name for name, body in defs.items() if _ASM_RE.search(body)}
    changed = True
    while changed:
        changed = False
        for name, body in defs.items():
            if name not in found and any(re.search(rf"\b{re.escape(f)}\b", body) for f in found):
                found.add(name)
                changed = True
    return found


def _check_asm(code: str) -> list[str]:
    """Inline assembly only inside __device__ / __global__ function bodies: a brace-depth scan
    in which a block is device code when the text that opens it names __device__/__global__."""
    code = _join_continuations(code)
    macros = _asm_macros(code)
    # preprocessor lines are not code here (a macro's asm is checked where the macro is used)
    lines = [("" if re.match(r"[ \t]*#", ln) else ln) for ln in code.split("\n")]
    body = "\n".join(lines)
    names = [r"\basm\b", r"\b__asm__\b", r"\b__asm\b"] + [rf"\b{re.escape(m)}\b" for m in macros]
    asm_re = re.compile("|".join(names))
    events = sorted([(m.start(), "asm", m.group(0)) for m in asm_re.finditer(body)] +
                    [(i, ch, ch) for i, ch in enumerate(body) if ch in "{};"])
    stack: list[bool] = []
    header_start = 0
    problems = []
    for pos, kind, text in events:
        if kind == "{":
            header = body[header_start:pos]
            stack.append(bool(re.search(r"\b__device__\b|\b__global__\b", header)))
            header_start = pos + 1
        elif kind == "}":
            if stack:
                stack.pop()
            header_start = pos + 1
        elif kind == ";":
            header_start = pos + 1
        elif not any(stack):
            line = body.count("\n", 0, pos) + 1
            problems.append(f"inline assembly ({text}) outside a __device__/__global__ function, line {line}")
    return problems


def check_source(src: str) -> list[str]:
    """Why `src` is refused; an empty list when it may be built."""
    if not isinstance(src, str) or not src.strip():
        return ["empty source"]
    with_strings = strip_comments_and_strings(src, keep_strings=True)
    problems = _check_includes(with_strings)
    if _GDC_ASM_RE.search(with_strings):  # the PTX instruction lives in an asm string
        problems.append(f"refused ({PDL_REASON}): griddepcontrol")
    code = strip_comments_and_strings(src)
    for rx, what in _FORBIDDEN_RE:
        hits = sorted({m.group(0).strip() for m in rx.finditer(code)})
        if hits:
            problems.append(f"refused ({what}): {', '.join(hits[:5])}")
    problems += _check_asm(code)
    for sym in REQUIRED_SYMBOLS:
        if not re.search(rf"\b{sym}\s*\(", code):
            problems.append(f"the ABI symbol {sym}() is not defined")
    if not re.search(r'\bextern\s*""', code):
        problems.append('the ABI symbols must be extern "C"')
    return problems
