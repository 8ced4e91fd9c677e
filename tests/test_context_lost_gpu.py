"""A sticky CUDA error on a real GPU: the implementation that caused it is rejected and
quarantined, the others of its problem are measured in a fresh process, none of them blamed."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

KERNEL = Path(__file__).resolve().parent / "kernels" / "crash" / "illegal_address.cu"


def test_a_device_side_assert_ends_the_worker_and_the_next_task_has_cuda():
    from gemmrl.bench.worker import Worker
    import worker_tasks as t

    with Worker() as w:
        pid, total = w.run(t.cuda_sum).value
        assert total == 4.0
        r = w.run(t.lose_cuda_context)
        assert r.status == "error" and r.details.get("context_lost"), r
        pid2, total2 = w.run(t.cuda_sum).value
        assert pid2 != pid and total2 == 4.0 and w.restarts == 1


def test_an_illegal_address_costs_only_its_own_kernel(tmp_path):
    import torch

    from gemmrl.bench import runner, timing
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    dev = torch.cuda.get_device_name()
    db = tmp_path / "s.sqlite"
    store = Store(db)
    run = store.start_run("test", dev, {"device": dev}, {})
    problems = [Problem(256, 384, 1024), Problem(128, 256, 512)]
    logs = []
    cfg = runner.RunConfig(modes=("kernel",), kernel=timing.QUICK, repeat_impl=None)
    counts = runner.run_isolated(problems, [f"kernel:{KERNEL}", "torch.matmul", "cuBLAS-nn"], store, cfg,
                                 device=dev, run_id=run, db_path=str(db), log=logs.append)
    assert counts["sessions"] == 2 and counts["errors"] == 0 and counts["quarantined"] == 2, (counts, logs)
    for p in problems:
        bad = store.quarantined(dev, p)
        assert list(bad) == ["kernel:illegal_address"] and "lost its CUDA context" in bad["kernel:illegal_address"]
        assert store.verification(dev, p, "kernel:illegal_address")["passed"] is False
        for name in ("torch.matmul", "cuBLAS-nn"):
            assert store.verification(dev, p, name)["passed"] is True
    measured = {(r["M"], r["impl"]) for r in store.measurements(device=dev) if r["status"] == "ok"}
    assert measured == {(p.M, n) for p in problems for n in ("torch.matmul", "cuBLAS-nn")}
    store.close()


def test_gemmrl_verify_stops_at_a_kernel_that_lost_the_context():
    """In a process of its own (a lost context would poison this test process): the kernel's
    check fails, and the command stops there with the reason instead of failing every check
    after it."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gemmrl.cli", "verify", "--impl", f"kernel:{KERNEL}",
                        "--impl", "torch.matmul", "--shapes", "256x384x1024"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(d["impl"], d["passed"]) for d in lines] == [("kernel:illegal_address", False)]
    assert "left the CUDA context unusable" in r.stderr and "the checks after it were not run" in r.stderr
