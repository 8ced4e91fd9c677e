"""Build untrusted source in a worker process that holds no secrets: its environment is scrubbed
of API keys and tokens, it runs in a fresh scratch directory, and resource limits (CPU time,
address space, file size, process count) apply to it and to nvcc's children. The GPU run of a
candidate goes through the same scrubbed environment (bench/worker on the device machine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.I)
_SECRET_PREFIX = ("OPENAI", "ANTHROPIC", "AWS_", "HF_", "HUGGING", "GEMMRL_LLM_")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def scrubbed_env(env=None) -> dict:
    """A copy of the environment without anything that looks like a credential: names with
    KEY/TOKEN/SECRET/PASSWORD/CREDENTIAL/AUTH, OPENAI*/AWS_*/HF_* and all GEMMRL_LLM_* names,
    and any variable whose value equals the LLM API key."""
    env = dict(os.environ if env is None else env)
    key = env.get("GEMMRL_LLM_API_KEY", "")
    out = {}
    for name, value in env.items():
        if _SECRET_NAME.search(name) or name.upper().startswith(_SECRET_PREFIX):
            continue
        if key and key in value:
            continue
        out[name] = value
    out["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


def _limits(cpu_s: int, as_bytes: int, fsize_bytes: int, nproc: int):
    def apply():
        import resource

        os.setsid()  # its own process group, so a timeout kills nvcc's children too
        for lim, val in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, as_bytes),
                         (resource.RLIMIT_FSIZE, fsize_bytes), (resource.RLIMIT_CORE, 0)):
            if val is not None:
                resource.setrlimit(lim, (val, val))
        if nproc is not None and hasattr(resource, "RLIMIT_NPROC"):
            soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
            want = nproc if hard == resource.RLIM_INFINITY else min(nproc, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NPROC, (want, hard))
            except (ValueError, OSError):
                pass
    return apply


_CHILD = r"""
import json, os, sys
req = json.loads(sys.stdin.read())
from gemmrl.build.nvcc import build_shared
res = build_shared(req["source"], name=req["name"], arch=req["arch"], cache_dir=req["cache_dir"],
                   timeout_s=req["timeout_s"])
print(json.dumps({"ok": res.ok, "path": res.path, "log": res.log, "key": res.key,
                  "seconds": res.seconds, "cached": res.cached,
                  "resources": [r.__dict__ for r in res.resources],
                  "env_names": sorted(os.environ), "cwd": os.getcwd()}))
"""


def sandboxed_build(source: str, *, name: str = "llm_kernel", arch: str = "sm_90a",
                    cache_dir: str | Path | None = None, timeout_s: float = 600,
                    cpu_s: int = 900, as_bytes: int | None = 32 << 30,
                    fsize_bytes: int = 256 << 20, nproc: int | None = 4096) -> dict:
    """Compile `source` with build_shared in a scrubbed, rlimited child in a fresh temp dir.
    Returns {ok, path, log, resources, seconds, cached, env_names, cwd}; a child that dies or
    times out is ok=False with the reason in log."""
    from gemmrl.build.nvcc import cache_root

    cache_dir = str(Path(cache_dir) if cache_dir else cache_root() / "llm-builds")
    scratch = tempfile.mkdtemp(prefix="gemmrl-sandbox-")
    env = scrubbed_env()
    env.update(HOME=scratch, TMPDIR=scratch)
    req = json.dumps({"source": source, "name": name, "arch": arch, "cache_dir": cache_dir,
                      "timeout_s": timeout_s})
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=req, capture_output=True,
                              text=True, cwd=scratch, env=env, timeout=timeout_s + 30,
                              preexec_fn=_limits(cpu_s, as_bytes, fsize_bytes, nproc))
    except subprocess.TimeoutExpired:
        return {"ok": False, "path": None, "log": f"sandboxed build timed out after {timeout_s:.0f} s",
                "resources": []}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"ok": False, "path": None, "resources": [],
                "log": f"build worker exited with {proc.returncode}:\n{proc.stderr[-3000:]}"}
    return json.loads(lines[-1])
