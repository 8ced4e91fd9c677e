"""Extract the kernel from a model reply: the last fenced code block (```cuda, ```cpp, ```c++,
```cu or a bare ```) that contains gemmrl_run. Anything else is refused with a reason."""

from __future__ import annotations

import re

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
CODE_LANGS = ("", "cuda", "cu", "cpp", "c++", "cxx", "c", "cuh", "hpp")


class ParseError(ValueError):
    pass


def extract_kernel(reply: str) -> str:
    if not isinstance(reply, str) or not reply.strip():
        raise ParseError("empty reply")
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(reply)]
    if not blocks:
        raise ParseError("no fenced code block in the reply: put the whole .cu file in one ```cuda block")
    code = [body for lang, body in blocks if lang in CODE_LANGS and "gemmrl_run" in body]
    if not code:
        raise ParseError(f"none of the {len(blocks)} code block(s) defines gemmrl_run: "
                         "the reply must contain the whole .cu file in one ```cuda block")
    return code[-1].strip("\n") + "\n"
