"""The harness on a GPU: honest kernels accepted, every cheat kernel rejected for its reason,
baselines verified, and the three timing modes giving sane, re-checked numbers."""

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "tests" / "kernels"
SHAPE = "256x384x1024"

# cheat -> phrases of which one must be in the rejection (shared/measuring.md's defences)
CHEATS = {
    "calls_cublas": ("not the implementation's own",),
    "side_stream": ("never written", "stream(s)"),
    "background_thread": ("never written", "stream(s)"),
    "pointer_cache": ("random test 1",),
    "shape_cache": ("random test 1", "no kernel of its own"),
    "lazy_deferred": ("exact test", "never written"),
    "precision_downgrade": ("relative error",),
    "fp16_accumulate": ("relative error",),
    "oob_write": ("guard band around C",),
    "partial_write": ("never written",),
    "clobbers_input": ("input A was modified",),
    "uninit_read": ("random test", "exact test"),
}


def cli_verify(path: Path, shape: str = SHAPE, residues: bool = False) -> list[dict]:
    """Each verification in its own process: a cheat that corrupts the CUDA context takes down
    only that process."""
    cmd = [sys.executable, "-m", "gemmrl.cli", "verify", "--impl", f"kernel:{path}", "--shapes", shape,
           "--include", str(KERNELS)] + (["--residues"] if residues else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert rows, f"no verdict from {path.name}: rc={p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    return rows


@pytest.mark.parametrize("name", ["honest_nn", "honest_tn"])
def test_honest_kernels_pass_every_check_including_residues(name):
    rows = cli_verify(KERNELS / f"{name}.cu", residues=True)
    assert len(rows) == 5
    for r in rows:
        assert r["passed"], r
        assert r["rel_err"] < 1e-3


def test_every_cheat_is_rejected_for_its_reason():
    with ThreadPoolExecutor(4) as ex:
        verdicts = dict(zip(CHEATS, ex.map(lambda c: cli_verify(KERNELS / "cheats" / f"{c}.cu")[0], CHEATS)))
    report = {c: v["reason"][:200] for c, v in verdicts.items()}
    print(json.dumps(report, indent=1))
    for cheat, v in verdicts.items():
        assert not v["passed"], f"{cheat} was accepted"
        assert any(w in v["reason"] for w in CHEATS[cheat]), f"{cheat}: {v['reason']}"


def test_python_level_cheats_on_gpu():
    import time

    import torch

    from gemmrl.core.impl import Impl
    from gemmrl.core.problem import Problem
    from gemmrl.verify.checks import verify

    class Py(Impl):
        def __init__(self, fn):
            self.fn, self.name = fn, fn.__name__

        def prepare(self, problem):
            return self.fn

        def own_kernels(self):
            return set()

    def via_torch(a, b_nn, b_tn, c):  # "calling torch inside the kernel"
        torch.matmul(a, b_nn, out=c)

    orig = time.perf_counter

    def patch_timer(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)
        time.perf_counter = lambda: 0.0

    p = Problem(256, 384, 1024)
    r = verify(Py(via_torch), p)
    assert not r.passed and "not the implementation's own" in r.reason
    try:
        r = verify(Py(patch_timer), p)
    finally:
        time.perf_counter = orig
    assert not r.passed and "timer patching" in r.reason


@pytest.mark.parametrize("shape", [(256, 384, 512), (64, 4096, 1024), (1000, 72, 264)])
def test_baselines_pass_verification(shape):
    from gemmrl.baselines.impls import baseline_impls
    from gemmrl.core.problem import Problem
    from gemmrl.verify.checks import verify

    p = Problem(*shape)
    for impl in baseline_impls(exhaustive=True):
        r = verify(impl, p)
        assert r.passed, f"{impl.name} {p.shape}: {r.reason}"
        assert r.details["rel_err"] < 5e-4


def test_fp16_accumulate_baselines_verify():
    from gemmrl.bench.runner import _fp16_acc_reference
    from gemmrl.baselines.impls import CublasGemm, LtHeuristic
    from gemmrl.core.problem import Problem
    from gemmrl.verify.checks import verify

    p = Problem(256, 256, 2048, "fp16", "fp16")
    for impl in (CublasGemm("NN"), LtHeuristic("TN")):
        r = verify(impl, p, ref_fn=_fp16_acc_reference())
        assert r.passed, f"{impl.name}: {r.reason}"


@pytest.mark.timing
def test_timing_modes_agree_and_catch_wrong_outputs():
    import torch

    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem

    p = Problem(1024, 1024, 1024)

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    def wrong(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)
        c.mul_(1.5)

    calls = {"mm": mm, "mm2": mm, "wrong": wrong}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    k = timing.time_kernel(p, calls, l2_bytes=l2)
    assert k["mm"]["status"] == "ok" and k["wrong"]["status"] == "wrong"
    assert k["mm"]["details"]["sets"] >= 2 and k["mm"]["details"]["graph"] is True
    assert abs(k["mm"]["median_us"] / k["mm2"]["median_us"] - 1) < 0.05
    for mode in ("offline", "server"):
        h = timing.time_host(p, calls, settings=timing.HostSettings(mode=mode, min_rounds=20, qps=2000))
        assert h["mm"]["status"] == "ok" and h["wrong"]["status"] == "wrong"
        assert h["mm"]["n"] >= 20
        # the host clock includes launch and sync: never below the kernel time
        assert h["mm"]["median_us"] > 0.9 * k["mm"]["median_us"]
    # server mode's paired ratios (protocol v5): two copies of one call agree, the failed
    # implementation is in no pair, and the precision target stops the sampling
    # (the target: the pair's median ratio known to 0.5%; a copy 2.4% off was seen at a 2% target)
    v5 = timing.HostSettings(mode="server", min_rounds=30, qps=2000, gaps="round", stat="paired",
                             target_ci=0.005, max_rounds=4000, max_s=20.0)
    h = timing.time_host(p, calls, settings=v5)
    assert h["wrong"]["status"] == "wrong"
    pair = h["mm"]["details"]["paired"]
    assert set(pair) == {"mm2"} and abs(pair["mm2"] - 1) < 0.03, pair
    assert h["mm2"]["details"]["paired"]["mm"] == pytest.approx(1 / pair["mm2"])
    # it stops at the target or says it did not reach it: with the GPU shared by the suite's
    # other workers, 0.5% took more than the 4000 rounds on an H200 (2026-11-26)
    assert 30 <= h["mm"]["n"] <= 4000
    assert isinstance(h["mm"]["details"]["ci_reached"], bool)
    # a target that any GPU reaches well inside the rounds: the sampling stops there
    loose = timing.HostSettings(mode="server", min_rounds=30, qps=2000, gaps="round", stat="paired",
                                target_ci=0.05, max_rounds=4000, max_s=20.0)
    h = timing.time_host(p, calls, settings=loose)
    assert 30 <= h["mm"]["n"] < 4000 and h["mm"]["details"]["ci_reached"] is True


@pytest.mark.timing
def test_graphs_are_sized_to_the_target_replay_for_every_implementation():
    """Each replay carries a fixed cost of a few microseconds, divided by its calls: a graph sized
    from one cold call held too few (replays of 44-1000 us instead of 2 ms), differently for each
    implementation and for one implementation timed twice. Sized from a burst, one length for the
    whole session, every replay of a small GEMM comes near the target."""
    import torch

    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem

    p = Problem(128, 4096, 512)  # about 5 us a call: the fixed cost mattered most here

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    s = timing.KernelSettings()
    trace: list = []
    k = timing.time_kernel(p, {"mm": mm, "mm2": mm, "mm3": mm}, l2_bytes=l2, settings=s, trace=trace)
    # the trace holds every timed replay's per-call time: n rounds of all three, medians as stored
    assert len(trace) == 3 * k["mm"]["n"] and {r for r, _, _ in trace} == set(range(k["mm"]["n"]))
    for name in ("mm", "mm2", "mm3"):
        mine = sorted(t for _, n, t in trace if n == name)
        assert abs(statistics.median(mine) - k[name]["median_us"]) < 1e-9 * k[name]["median_us"]
    for name in ("mm", "mm2", "mm3"):
        d = k[name]["details"]
        assert 0.5 * s.target_replay_us <= d["replay_us"] <= 3 * s.target_replay_us, (name, d)
    calls = {k[n]["details"]["calls_per_replay"] for n in ("mm", "mm2", "mm3")}
    assert len(calls) == 1, calls  # one graph length for the whole session
    assert max(k[n]["median_us"] for n in k) <= 1.02 * min(k[n]["median_us"] for n in k)


def test_kernel_v3_times_to_the_paired_target_and_records_the_ratios():
    """bench's kernel protocol (v3): rounds until every pair's within-round ratio is known to
    0.5%; each record carries its ratios to the others, which the reports compare. Two copies
    of one call come out at 1 within the target, a call doing twice the work near 2."""
    import torch

    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem

    p = Problem(1024, 1024, 1024)

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    def mm_twice(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)
        torch.matmul(a, b_nn, out=c)

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    s = timing.KernelSettings(target_ci=0.005, max_rounds=400, max_s=3.0, stat="paired")
    k = timing.time_kernel(p, {"mm": mm, "mm2": mm, "twice": mm_twice}, l2_bytes=l2, settings=s)
    for name in ("mm", "mm2", "twice"):
        d = k[name]["details"]
        assert k[name]["status"] == "ok" and d["target_ci"] == 0.005 and isinstance(d["ci_reached"], bool)
        assert set(d["paired"]) == {"mm", "mm2", "twice"} - {name}
    assert k["mm"]["n"] >= 10 and k["mm"]["n"] == k["twice"]["n"]
    assert abs(k["mm"]["details"]["paired"]["mm2"] - 1) < 0.01
    # twice as much work, though not quite twice the time: the L2 is flushed before each call,
    # and the second matmul of `twice` finds A and B in it (1.88 on an H200, 2026-11-26)
    assert 1.6 < k["mm"]["details"]["paired"]["twice"] < 2.1
    assert k["twice"]["details"]["paired"]["mm"] == pytest.approx(1 / k["mm"]["details"]["paired"]["twice"])


@pytest.mark.timing
def test_a_call_that_fails_inside_its_capture_leaves_the_others_timed_right():
    """An implementation that synchronizes the device inside each call (CUDA-L2's 12288x1024x2048
    kernel does) cannot be captured; torch.cuda.graph then leaves its capture stream current, and
    on an H100 every other implementation of that session was timed at 13-52x under the physical
    floor (their graphs replayed on that stream while the events timed the caller's). The timer
    puts the stream back: the others time as they do without it, the caller's stream is current
    afterwards, and the synchronizing one is timed eagerly, saying why."""
    import torch

    from gemmrl.bench import timing
    from gemmrl.bench.stats import roofline_floor_us
    from gemmrl.core.problem import Problem

    p = Problem(4096, 1024, 2048)

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    def syncs(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)
        torch.cuda.synchronize()  # fails while capturing

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    before = torch.cuda.current_stream()
    alone = timing.time_kernel(p, {"mm": mm}, l2_bytes=l2)["mm"]["median_us"]
    k = timing.time_kernel(p, {"syncs": syncs, "mm": mm}, l2_bytes=l2)
    assert torch.cuda.current_stream() == before
    assert k["syncs"]["status"] == "ok" and k["syncs"]["details"]["graph"] is False
    assert "capture_error" in k["syncs"]["details"]
    assert k["mm"]["status"] == "ok" and k["mm"]["details"]["graph"] is True
    floor = roofline_floor_us(p.flops, p.min_bytes, 1000.0, 4000.0)  # above any Hopper's peaks
    assert k["mm"]["median_us"] > floor and abs(k["mm"]["median_us"] / alone - 1) < 0.25, (k["mm"], alone)


@pytest.mark.timing
def test_a_graph_that_captured_only_the_copies_is_not_timed():
    """CUDA-L2's padded calls: torch copies the inputs into padded buffers and the result out on
    the caller's stream, and their GEMM launches on the legacy default stream, so a capture holds
    the copies alone. Its replays wrote C (a stale result), so the old check passed: the H200
    timed 4096x2048x16384 at 1.7x under the physical floor and two other shapes' outputs wrong.
    The capture check now makes the replay follow new inputs: this call is timed eagerly, with
    the GEMM, and its output is right."""
    import torch

    from gemmrl.bench import timing
    from gemmrl.bench.stats import roofline_floor_us
    from gemmrl.core.problem import Problem

    p = Problem(1024, 1024, 4096)
    buf = torch.empty(p.M, p.N, dtype=torch.float16, device="cuda")

    def copies_only_when_captured(a, b_nn, b_tn, c):
        if not torch.cuda.is_current_stream_capturing():  # stands in for work outside the capture
            torch.matmul(a, b_nn, out=buf)
        c.copy_(buf)

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    k = timing.time_kernel(p, {"padded": copies_only_when_captured, "mm": mm}, l2_bytes=l2)
    assert k["mm"]["status"] == "ok" and k["mm"]["details"]["graph"] is True
    got = k["padded"]
    assert got["status"] == "ok", got
    assert got["details"]["graph"] is False
    assert "does not compute it from the inputs" in got["details"]["capture_error"]
    floor = roofline_floor_us(p.flops, p.min_bytes, 1000.0, 4000.0)
    assert got["median_us"] > floor and got["median_us"] > 0.8 * k["mm"]["median_us"], (got, k["mm"])


def test_a_copies_only_graph_captured_after_another_capture_is_caught_too():
    """Every capture of a session changes the one shared first input set before its check. When
    that change was a negation, two captures put A back as it was, and a stale result computed
    before them passed the check of the call captured second (H200, run 481: four padded CUDA-L2
    calls timed as graphs and then failed the re-check after timing with error 2)."""
    import torch

    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem

    p = Problem(512, 512, 2048)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    sets = timing.make_sets(p, 1, gen)
    buf = torch.empty(p.M, p.N, dtype=torch.float16, device="cuda")

    def copies_only_when_captured(a, b_nn, b_tn, c):
        if not torch.cuda.is_current_stream_capturing():
            torch.matmul(a, b_nn, out=buf)
        c.copy_(buf)

    def mm(a, b_nn, b_tn, c):
        torch.matmul(a, b_nn, out=c)

    copies_only_when_captured(*sets[0])  # its stale result, from A as it is now
    timing._capture_writing(mm, sets, 1)  # another call captured and checked first: A negated
    # twice (that check, then this one) was A as the stale result saw it
    with pytest.raises(RuntimeError, match="does not compute it from the inputs"):
        timing._capture_writing(copies_only_when_captured, sets, 1)
    torch.cuda.synchronize()


@pytest.mark.skipif(not os.environ.get("GEMMRL_CUDA_L2_DIR"), reason="set GEMMRL_CUDA_L2_DIR to CUDA-L2's kernels/h100_F32F16F16F32")
def test_cuda_l2_kernel_loads_verifies_and_times():
    import torch

    from gemmrl.baselines.cuda_l2 import CudaL2Impl
    from gemmrl.bench import timing
    from gemmrl.core.problem import Problem
    from gemmrl.verify.checks import verify

    impl = CudaL2Impl(os.environ["GEMMRL_CUDA_L2_DIR"])
    p = Problem(64, 64, 64)
    assert impl.supports(p)
    fn = impl.prepare(p)
    r = verify(impl, p, fn=fn)
    print("cuda-l2 64x64x64:", r.passed, r.reason, r.details.get("rel_err"))
    assert r.details.get("exact") is True  # the {0,1} test passes whatever the precision verdict
    res = timing.time_kernel(p, {"cuda-l2": fn}, l2_bytes=torch.cuda.get_device_properties(0).L2_cache_size)
    print("cuda-l2 kernel time:", res["cuda-l2"])
    assert res["cuda-l2"]["status"] == "ok"
    # their kernels launch on the legacy default stream: not capturable, timed eagerly, said so
    if not res["cuda-l2"]["details"]["graph"]:
        assert "outside the caller's stream" in res["cuda-l2"]["details"]["capture_error"]


def test_an_old_autotuned_choice_is_made_again_and_verified_with_its_new_algorithm(tmp_path):
    """A stored cuBLASLt-autotuned choice picked in the old 0.5 ms bursts (no tag in its info) is
    picked again with the judge's protocol when a bench times it, the new algorithm is verified
    (not the old verification reused), and a second run keeps the new choice."""
    import torch

    from gemmrl.baselines import impls
    from gemmrl.bench import runner, timing
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    dev = torch.cuda.get_device_name()
    p = Problem(512, 1024, 2048)
    store = Store(tmp_path / "s.sqlite")
    run = store.start_run("test", dev, {"device": dev}, {})
    lib = impls.cublas_lib()
    algos = lib.heuristic("NN", "fp16", "fp32", p.M, p.N, p.K, requested=100)
    old = algos[-1]
    store.put_tuning(dev, p, "cuBLASLt-auto-tuning-nn", old, "old (best of 1/1)", 1.0)
    store.record_verification(run, dev, p, "cuBLASLt-auto-tuning-nn", True, "ok",
                              {"impl": {"name": "cuBLASLt-auto-tuning-nn", "choice": "old (best of 1/1)"}})
    cfg = runner.RunConfig(modes=("kernel",), kernel=timing.QUICK, repeat_impl=None)
    lt = impls.LtAutotuned("NN", store, dev)
    counts = runner.run([p], [impls.LtHeuristic("NN"), lt], store, cfg, device=dev, run_id=run, log=lambda m: None)
    assert counts["sessions"] == 1 and counts["rejected"] == 0
    got = store.get_tuning(dev, p, "cuBLASLt-auto-tuning-nn")
    assert timing.BASELINE_PICK_TAG in got["info"] and f"/{len(algos)}," in got["info"]
    ver = store.verification(dev, p, "cuBLASLt-auto-tuning-nn")
    assert ver["passed"] and ver["details"]["impl"]["choice"] == got["info"] and ver["run_id"] == run
    n_ver = len(store.verifications(dev))
    again = impls.LtAutotuned("NN", store, dev)
    runner.run([p], [again], store, runner.RunConfig(modes=("kernel",), kernel=timing.QUICK, repeat_impl=None,
                                                       retime=True, do_verify=False),
               device=dev, run_id=run, log=lambda m: None)
    assert again.choice_info == got["info"] and len(store.verifications(dev)) == n_ver
    store.close()


def test_a_bench_records_the_gpu_state_after_each_session(tmp_path):
    """env.gpu_state on the GPU: NVML (nvidia-ml-py, in the device image) finds the GPU torch
    times on and reads plausible values, and a bench stores them with every record of a session."""
    pytest.importorskip("pynvml")
    from gemmrl.bench import env

    got = env.gpu_state()
    assert 5 <= got["temp_c"] <= 110 and got["sm_mhz"] > 0 and got["mem_mhz"] > 0, got
    assert 10 <= got["power_w"] <= 2000 and isinstance(got.get("clock_events", []), list), got
    db = tmp_path / "s.sqlite"
    r = subprocess.run([sys.executable, "-m", "gemmrl.cli", "bench", "--shapes", "256x256x512", "--mode", "kernel",
                        "--impl", "torch.matmul", "--db", str(db), "--out", str(tmp_path / "out"), "--no-report"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    from gemmrl.store.db import Store

    store = Store(db, readonly=True)
    rows = store.db.execute("SELECT impl, details FROM measurements WHERE status='ok'").fetchall()
    assert rows
    for impl, details in rows:
        state = json.loads(details)["gpu_state"]
        assert 5 <= state["temp_c"] <= 110 and state["sm_mhz"] > 0, (impl, state)
