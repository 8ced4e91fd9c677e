"""The LLM loop against a local fake OpenAI-compatible server (127.0.0.1 only): correct kernels
build and are rewarded, compile errors go back to the model, cheats are refused before any
build, garbage is a parse error, 429s are retried, and the token budget stops the loop. Builds
are real (nvcc, sm_90a); times are made up (no GPU)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gemmrl.core.problem import Problem
from gemmrl.llm.client import BudgetExceeded, LLMClient, LLMError
from gemmrl.llm.loop import export_trajectories, refine
from gemmrl.llm.parse import ParseError, extract_kernel
from gemmrl.llm.prompt import build_messages
from gemmrl.llm.retrieve import similar_examples
from gemmrl.llm.sandbox import sandboxed_build, scrubbed_env
from gemmrl.llm.static_check import check_source
from gemmrl.search.reward import reward
from gemmrl.store.db import Store

KERNELS = Path(__file__).parent / "kernels"
FAKE_KEY = "sk-FAKE-gemmrl-test-key-7f3a9c"
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def inlined(name: str) -> str:
    return (KERNELS / name).read_text().replace('#include "common.cuh"', (KERNELS / "common.cuh").read_text())


HONEST = inlined("honest_nn.cu")
BROKEN = HONEST.replace("return launch_gemm<", "return launch_gemm_undefined_xyz<")
THREAD_CHEAT = inlined("cheats/background_thread.cu")


def fenced(src: str) -> str:
    return f"Here is the kernel.\n\n```cuda\n{src}```\nIt should be fast."


class FakeServer:
    """Serves prepared (status, body) replies in sequence to POST /chat/completions."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})
                status, payload = outer.replies.pop(0) if outer.replies else (500, {"error": "none left"})
                data = json.dumps(payload).encode()
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(texts, total_tokens=100):
    return (200, {"id": "x", "object": "chat.completion", "model": "fake",
                  "choices": [{"index": i, "message": {"role": "assistant", "content": t},
                               "finish_reason": "stop"} for i, t in enumerate(texts)],
                  "usage": {"prompt_tokens": total_tokens // 2, "completion_tokens": total_tokens // 2,
                            "total_tokens": total_tokens}})


# ---------------------------------------------------------------------------------------------
# static check, parse, client, retrieval: no nvcc

def test_static_check_accepts_honest_kernel():
    assert check_source(HONEST) == []
    assert check_source(inlined("honest_tn.cu")) == []


@pytest.mark.parametrize("snippet,expect", [
    ("#include <stdio.h>\n", "stdio.h"),
    ('#include "../secret.h"\n', "secret.h"),
    ('void f(){ FILE* p = fopen("x", "r"); }', "file I/O"),
    ('void f(){ int fd = open("/etc/passwd", 0); }', "file system call"),
    ('void f(){ system("ls"); }', "process control"),
    ('void f(){ popen("ls", "r"); }', "process control"),
    ('void f(){ execve("/bin/sh", 0, 0); }', "process control"),
    ("void f(){ fork(); }", "process control"),
    ("void f(){ int s = socket(2, 1, 0); connect(s, 0, 0); }", "network"),
    ('void f(){ dlopen("libx.so", 1); dlsym(0, "y"); }', "dynamic loading"),
    ('void f(){ getenv("GEMMRL_LLM_API_KEY"); }', "environment"),
    ("void f(){ std::thread t([]{}); }", "host threads"),
    ("void f(){ pthread_create(0, 0, 0, 0); }", "host threads"),
    ("void f(){ cudaStream_t s; cudaStreamCreate(&s); }", "stream creation"),
    ("void f(){ void* p; cudaMalloc(&p, 4); cudaFree(p); }", "allocation"),
    ("void f(){ cudaDeviceSynchronize(); }", "synchronisation"),
    ("void f(){ cudaStreamSynchronize(0); }", "synchronisation"),
    ("void f(){ cublasHandle_t h; }", "cuBLAS"),
    ("void f(){ curandGenerator_t g; }", "cuRAND"),
    ("__attribute__((constructor)) static void init(){}", "constructor"),
    ("#define CAT(a,b) a##b\n", "token pasting"),
    ('int host_fn(){ asm volatile("nop"); return 0; }', "inline assembly"),
    ('#define NOP() asm volatile("nop")\nint host_fn(){ NOP(); return 0; }', "inline assembly"),
    ("void f(cudaLaunchAttribute* a){ a->id = cudaLaunchAttributeProgrammaticStreamSerialization; }",
     "programmatic dependent launch"),
    ("void f(cudaLaunchAttribute* a){ a->val.programmaticStreamSerializationAllowed = 1; }",
     "programmatic dependent launch"),
    ('__device__ void w(){ asm volatile("griddepcontrol.wait;" ::: "memory"); }', "programmatic dependent launch"),
    ("__global__ void k3(){ cudaGridDependencySynchronize(); }", "programmatic dependent launch"),
    ("#define CUTLASS_ENABLE_GDC_FOR_SM90 1\n", "programmatic dependent launch"),
])
def test_static_check_rules_fire(snippet, expect):
    problems = check_source(HONEST + "\n" + snippet + "\n")
    assert problems, snippet
    assert any(expect in p for p in problems), problems


def test_static_check_ignores_comments_strings_and_device_asm():
    src = HONEST + '''
// fopen(), system("rm -rf /"), cudaMalloc, std::thread, dlopen: only a comment
/* getenv("X"); #include <stdio.h> */
static const char* kDoc = "this string mentions popen( and cublasGemmEx and asm";
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;\\n" ::)
__device__ __forceinline__ unsigned lane_id() { unsigned r; asm volatile("mov.u32 %0, %%laneid;" : "=r"(r)); return r; }
__global__ void k2(int* p) { if (p) { CP_ASYNC_COMMIT(); p[0] = lane_id(); } }
struct S { static __device__ int g() { int x; asm("mov.u32 %0, 1;" : "=r"(x)); return x; } };
'''
    assert check_source(src) == []


def test_static_check_requires_abi_symbols():
    problems = check_source("#include <cuda_runtime.h>\n__global__ void k() {}\n")
    assert sum("ABI symbol" in p and "not defined" in p for p in problems) == 3


def test_parse():
    assert "gemmrl_run" in extract_kernel(fenced(HONEST))
    two = f"```cpp\nint x;\n```\nfirst:\n```cuda\n// v1\n{HONEST}```\nbetter:\n```\n// v2\n{HONEST}```"
    assert extract_kernel(two).startswith("// v2")
    for bad in ("no code at all", "```python\nprint('gemmrl_run')\n```", "```cuda\nint x;\n```", ""):
        with pytest.raises(ParseError):
            extract_kernel(bad)


def test_client_config_redaction_retry_and_budget(monkeypatch, caplog):
    srv = FakeServer([(503, {"error": f"echo {FAKE_KEY}"}), completion(["a", "b"], 60),
                      completion(["c"], 60), (401, {"error": f"bad key {FAKE_KEY}"})])
    try:
        monkeypatch.setenv("GEMMRL_LLM_BASE_URL", srv.url)
        monkeypatch.setenv("GEMMRL_LLM_MODEL", "fake-model")
        monkeypatch.setenv("GEMMRL_LLM_API_KEY", FAKE_KEY)
        c = LLMClient.from_env(backoff_s=0.01, token_budget=100, min_interval_s=0.05)
        assert FAKE_KEY not in repr(c) and FAKE_KEY not in str(c)
        with caplog.at_level(logging.DEBUG):
            r = c.chat([{"role": "user", "content": "hi"}], n=2)
        assert r.texts == ["a", "b"] and r.attempts == 2 and c.tokens_used == 60
        assert srv.requests[1]["body"]["n"] == 2 and srv.requests[1]["auth"] == f"Bearer {FAKE_KEY}"
        assert srv.requests[1]["path"] == "/v1/chat/completions"
        c.chat([{"role": "user", "content": "again"}])  # 120 > 100: the budget is now spent
        with pytest.raises(BudgetExceeded):
            c.chat([{"role": "user", "content": "more"}])
        assert len(srv.requests) == 3  # refused without calling
        c.token_budget = None
        with pytest.raises(LLMError) as e:
            c.chat([{"role": "user", "content": "401"}])
        assert "401" in str(e.value) and FAKE_KEY not in str(e.value)
        assert FAKE_KEY not in caplog.text
    finally:
        srv.close()
    with pytest.raises(LLMError):
        LLMClient.from_env(env={})


def test_retrieval_finds_similar_shapes(tmp_path):
    store = Store(tmp_path / "s.db")
    for (M, N, K), t in (((4096, 4096, 4096), 100.0), ((4096, 4096, 2048), 60.0),
                         ((64, 8192, 128), 5.0), ((128, 128, 8192), 7.0)):
        store.put_tuning("dev", Problem(M, N, K), "tuned",
                         json.dumps({"family": "raw", "spec": {"bm": 128, "bn": 128}}).encode(),
                         "raw_128x128", t)
    store.record_trial(None, "dev", Problem(4096, 4096, 8192), "cand_a", "ok", 1.2, 150.0,
                       {"family": "cutlass_sm90", "spec": {"tile_m": 128, "tile_n": 256}})
    store.record_trial(None, "dev", Problem(8, 8, 8), "cand_b", "rejected", 0.0, None, {})
    ex = similar_examples(store, "dev", Problem(4096, 4096, 4096), k=2)
    assert len(ex) == 2
    assert {e.problem.K for e in ex} <= {2048, 8192} and all(e.problem.M == 4096 for e in ex)
    assert all(e.problem != Problem(4096, 4096, 4096) for e in ex)
    msgs = build_messages(Problem(4096, 4096, 4096), "NN", examples=ex, baselines={"cublas": 90.0})
    assert "gemmrl_run" in msgs[0]["content"] and "cublas: 90.00 us" in msgs[1]["content"]
    assert "similar shape M=4096" in msgs[1]["content"]


def test_scrubbed_env_drops_secrets():
    env = scrubbed_env({"PATH": "/bin", "GEMMRL_LLM_API_KEY": FAKE_KEY, "OPENAI_API_KEY": "x",
                        "GITHUB_TOKEN": "t", "MY_SECRET": "s", "OTHER": f"has {FAKE_KEY}",
                        "GEMMRL_CACHE": "/c"})
    assert set(env) == {"PATH", "GEMMRL_CACHE", "PYTHONPATH"}


# ---------------------------------------------------------------------------------------------
# the loop, with real nvcc builds in the sandbox

@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_sandbox_child_does_not_see_key(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMRL_LLM_API_KEY", FAKE_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    monkeypatch.setenv("SOME_ACCESS_TOKEN", "tok")
    res = sandboxed_build(BROKEN, cache_dir=tmp_path / "b")
    assert not res["ok"] and "launch_gemm_undefined_xyz" in res["log"]
    names = set(res["env_names"])
    assert not names & {"GEMMRL_LLM_API_KEY", "OPENAI_API_KEY", "SOME_ACCESS_TOKEN"}
    assert res["cwd"].split("/")[-1].startswith("gemmrl-sandbox-")
    assert FAKE_KEY not in json.dumps(res)


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_refine_loop_end_to_end(monkeypatch, tmp_path, caplog, capfd):
    monkeypatch.setenv("GEMMRL_LLM_API_KEY", FAKE_KEY)
    garbage = "I think you should use tensor cores. Sorry, no code today."
    srv = FakeServer([
        completion([fenced(HONEST), fenced(BROKEN)], 100),           # turn 0: (a), (b)
        (429, {"error": {"message": "rate limited"}}),                # turn 1: (e) then
        completion([fenced(THREAD_CHEAT), garbage], 100),             #   (c), (d)
        completion([fenced(HONEST)], 5000),                           # turn 2: (f) past budget
        completion(["should never be requested"], 10),
    ])
    builds = []

    def evaluate_source(problem, source):
        builds.append(source)
        res = sandboxed_build(source, cache_dir=tmp_path / "builds")
        if not res["ok"]:
            return {"status": "compile_error", "reason": "nvcc failed", "build_log": res["log"]}
        t = 10.0  # made up: no GPU here
        return {"status": "ok", "reason": "", "time_us": t, "build_log": res["log"],
                "resources": res["resources"],
                "reward": reward(12.0, t, True, source_len=len(source))}

    store = Store(tmp_path / "store.db")
    problem = Problem(256, 256, 256)
    client = LLMClient(srv.url, "fake-model", FAKE_KEY, backoff_s=0.01, token_budget=1000)
    try:
        with caplog.at_level(logging.DEBUG):
            res = refine(problem, client, evaluate_source, turns=4, samples=2, store=store,
                         device="cpu-test", run_id=None, baselines={"cublas": 12.0})
    finally:
        srv.close()

    st = [(o.turn, o.sample, o.status) for o in res.outcomes]
    assert st == [(0, 0, "ok"), (0, 1, "compile_error"), (1, 0, "refused"), (1, 1, "parse_error"),
                  (2, 0, "ok")]
    a, b, c, d, f = res.outcomes
    assert a.reward > 1.0 and res.best is not None and res.best.reward == a.reward
    assert "launch_gemm_undefined_xyz" in b.build_log
    assert "host threads" in c.reason and "<thread>" in c.reason
    assert "code block" in d.reason
    assert res.stopped == "budget" and "budget" in res.message and res.turns_done == 3
    assert len(builds) == 3  # (a), (b), (f): never the cheat or the garbage
    assert THREAD_CHEAT not in builds
    # (e): the 429 was retried; turn 1's prompt carries the nvcc log of (b) and the best kernel
    assert len(srv.requests) == 4 and srv.replies and srv.replies[0][1]["choices"]
    turn1 = srv.requests[2]["body"]["messages"][1]["content"]
    assert srv.requests[1]["body"] == srv.requests[2]["body"]
    assert "compile_error" in turn1 and "launch_gemm_undefined_xyz" in turn1
    assert "current best kernel" in turn1 and "registers" in turn1
    turn2 = srv.requests[3]["body"]["messages"][1]["content"]
    assert "refused" in turn2 and "parse_error" in turn2

    rows = store.trajectories("cpu-test")
    assert [(r["turn"], r["sample"], r["status"]) for r in rows] == st
    assert rows[0]["kernel_sha256"] and rows[3]["kernel_sha256"] is None
    out = tmp_path / "traj.jsonl"
    assert export_trajectories(store, out) == 5
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and lines[0]["prompt"][0]["role"] == "system"
    assert {k for k in ("prompt", "reply", "kernel_sha256", "status", "reason", "time_us", "reward")} <= set(lines[0])
    store.close()
    captured = capfd.readouterr()
    for text in (out.read_text(), (tmp_path / "store.db").read_bytes().decode("latin-1"),
                 caplog.text, captured.out, captured.err):
        assert FAKE_KEY not in text


# ---------------------------------------------------------------------------------------------
# Nsight Compute metrics: parsing and retry on recorded output (ncu itself runs on the GPU)

NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "splitk_reduce": 0%....50%....100% - 1 pass
==PROF== Profiling "gemm_kernel": 0%....50%....100% - 9 passes
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","lts__t_sector_hit_rate.pct","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","%","ns","%","%"
"0","4242","python3","h","splitk_reduce","1","7","12.5","2,112","40.1","30.2"
"1","4242","python3","h","gemm_kernel","1","7","71.25","41,856","88.9","12.4"
'''


def test_ncu_csv_takes_the_longest_kernel():
    from gemmrl.llm.ncu import describe, parse_csv

    got = parse_csv(NCU_CSV)
    assert got == {"gpu__time_duration.sum": 41856.0,
                   "dram__throughput.avg.pct_of_peak_sustained_elapsed": 71.25,
                   "lts__t_sector_hit_rate.pct": 88.9,
                   "sm__warps_active.avg.pct_of_peak_sustained_active": 12.4}
    assert parse_csv("==PROF== No kernels were profiled.\n") == {}
    d = describe(got)
    assert d["DRAM throughput (% of peak)"] == "71.2" and d["duration (ns)"] == "41856"
    best = {"source": HONEST, "time_us": 10.0, "resources": [], "reward": 1.1}
    msgs = build_messages(Problem(256, 256, 256), "NN", best=best, ncu=d)
    assert "Nsight Compute metrics" in msgs[1]["content"] and "L2 hit rate (%): 88.9" in msgs[1]["content"]


def test_ncu_drops_unknown_metrics_and_retries(monkeypatch):
    import subprocess

    from gemmrl.llm import ncu

    monkeypatch.setenv("GEMMRL_NCU_PATH", "/opt/fake/ncu")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        wanted = cmd[cmd.index("--metrics") + 1].split(",")
        if "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active" in wanted:
            return subprocess.CompletedProcess(cmd, 1, "", "==ERROR== Failed to find metric "
                                               "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active\n")
        return subprocess.CompletedProcess(cmd, 0, NCU_CSV, "")

    got = ncu.profile("/x/kernel.so", 256, 384, 512, run=run)
    assert got["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 71.25
    assert len(calls) == 2 and calls[0][0] == "/opt/fake/ncu"
    assert calls[0][-5:] == ["gemmrl.llm.ncu_target", "/x/kernel.so", "256", "384", "512"]
    assert calls[0][calls[0].index("--clock-control") + 1] == "none"  # the clocks are left as timing sees them
    assert "--profile-from-start" in calls[0] and "sm__pipe_tensor_op_gmma" not in calls[1][calls[1].index("--metrics") + 1]
    # a failure that names no metric gives no metrics, not an endless retry
    assert ncu.profile("/x/kernel.so", 1, 1, 1, run=lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "==ERROR== profiling is not supported")) is None
    monkeypatch.setenv("GEMMRL_NCU_PATH", "")
    monkeypatch.setattr(ncu.shutil, "which", lambda name: None)
    monkeypatch.setattr(ncu.Path, "exists", lambda self: False)
    assert ncu.profile("/x/kernel.so", 1, 1, 1, run=run) is None  # no ncu: no metrics
