"""A machine without nvcc or the CUTLASS headers is the machine's problem: it is found before a
tune starts, and one found mid-run stops the run instead of being stored as the kernels' failure
(2026-12-01: three device calls without the headers stored 211 CUTLASS candidates as rejected,
and failed the tuned kernels' verification). No GPU: the evaluators run with fakes."""

import sys
from types import SimpleNamespace

import pytest

from gemmrl.build import nvcc, toolchain
from gemmrl.build.cutlass import CutlassHeadersMissing
from gemmrl.build.toolchain import ToolchainMissing
from gemmrl.core.problem import Problem


@pytest.fixture
def no_headers(monkeypatch, tmp_path):
    """No CUTLASS headers anywhere: GEMMRL_CUTLASS_DIR names an empty directory, the wheel is hidden."""
    monkeypatch.setenv("GEMMRL_CUTLASS_DIR", str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # `import cutlass_library` fails
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: "/usr/bin/nvcc")


def test_missing_names_the_headers_for_cutlass_families_only(no_headers, tmp_path):
    assert toolchain.missing(["raw"]) == []
    lacks = toolchain.missing(["raw", "cutlass_sm90", "cutlass_sm90"])
    assert len(lacks) == 1 and lacks[0].startswith("cutlass_sm90: CUTLASS headers not found")
    assert str(tmp_path / "empty") in lacks[0]  # says which GEMMRL_CUTLASS_DIR was looked at
    with pytest.raises(ToolchainMissing, match="tune cannot build its kernels here: cutlass_sm90"):
        toolchain.require(["cutlass_sm90"], "tune")
    toolchain.require(["raw"], "tune")


def test_headers_found_is_nothing_missing(monkeypatch, tmp_path):
    root = tmp_path / "cutlass"
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// cutlass\n")
    (root / "include" / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    monkeypatch.setenv("GEMMRL_CUTLASS_DIR", str(root))
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: "/usr/bin/nvcc")
    assert toolchain.missing(["cutlass_sm90", "raw"]) == []


def test_no_nvcc_is_missing_for_every_family(monkeypatch):
    def none():
        raise nvcc.NvccNotFound("nvcc not found: install the CUDA toolkit or set GEMMRL_NVCC")
    monkeypatch.setattr(nvcc, "nvcc_path", none)
    assert toolchain.missing(["raw"]) == ["nvcc not found: install the CUDA toolkit or set GEMMRL_NVCC"]


def test_headers_missing_is_still_a_file_not_found_error():
    """Callers that caught FileNotFoundError for it (the CLI's build planning) still do."""
    assert issubclass(CutlassHeadersMissing, FileNotFoundError)
    assert issubclass(CutlassHeadersMissing, ToolchainMissing) and issubclass(nvcc.NvccNotFound, ToolchainMissing)


def test_the_worker_marks_a_missing_toolchain_and_the_caller_raises_it():
    import worker_tasks as t

    from gemmrl.bench.worker import Worker

    w = Worker()
    try:
        r = w.run(t.no_headers)
        assert r.status == "error" and r.details.get("toolchain_missing") is True
        with pytest.raises(ToolchainMissing, match="CUTLASS headers not found"):
            r.raise_if_toolchain_missing()
        other = w.run(t.boom)  # a kernel's own error is not marked, and raises nothing here
        assert other.status == "error" and "toolchain_missing" not in other.details
        other.raise_if_toolchain_missing()
    finally:
        w.close()


def test_run_batch_records_no_trial_for_a_missing_toolchain(tmp_path):
    from gemmrl.bench.worker import TaskResult
    from gemmrl.search.policy import Candidate
    from gemmrl.search.run import run_batch

    class FakeWorker:
        def run(self, *a, **k):
            return TaskResult("error", reason="CutlassHeadersMissing: CUTLASS headers not found",
                              details={"toolchain_missing": True})

    hb = tmp_path / "hb"
    hb.write_text("candidate:a")
    quarantined, logged = [], []
    cands = [Candidate("cutlass_sm90", SimpleNamespace(name=n)) for n in ("a", "b")]
    with pytest.raises(ToolchainMissing, match="CUTLASS headers not found"):
        run_batch(FakeWorker(), str(hb), Problem(64, 64, 64), cands, "dev", str(tmp_path / "s.db"), 10.0,
                  timeout_s=5, task=None, log=logged.append, quarantine=lambda *a: quarantined.append(a))
    assert quarantined == []


def test_gpu_evaluate_stops_without_recording_a_candidate(tmp_path, monkeypatch):
    from gemmrl.bench import worker
    from gemmrl.runtime import spec_impl
    from gemmrl.search.policy import Candidate
    from gemmrl.search.tune import gpu_evaluate
    from gemmrl.store.db import Store

    class NoHeadersSpecImpl:
        def __init__(self, spec):
            self.spec = spec

        def source(self, problem):
            raise CutlassHeadersMissing("CUTLASS headers not found")

    monkeypatch.setattr(spec_impl, "SpecImpl", NoHeadersSpecImpl)
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    store = Store(tmp_path / "store.db")
    run = store.start_run("x", "test-device", {}, {})
    evaluate = gpu_evaluate(store, "test-device", lambda problem: 20.0, run_id=run, build_workers=1)
    cands = [Candidate("cutlass_sm90", SimpleNamespace(name="k1"))]
    with pytest.raises(ToolchainMissing):
        evaluate(Problem(64, 64, 64), cands)
    assert store.verification("test-device", Problem(64, 64, 64), "k1") is None
    store.close()


def test_the_runner_stops_at_an_implementation_it_cannot_build(tmp_path, monkeypatch):
    """The final timing's gemmrl-tuned, without the headers, was stored as failing its verification
    ('prepare failed: FileNotFoundError'): now nothing is recorded and the bench stops."""
    from gemmrl.bench import runner, worker
    from gemmrl.core.impl import Impl
    from gemmrl.store.db import Store
    from gemmrl.verify.checks import CheckResult

    class Unbuildable(Impl):
        layout = "NN"
        name = "gemmrl-tuned"

        def prepare(self, problem):
            raise CutlassHeadersMissing("CUTLASS headers not found")

    monkeypatch.setattr(runner, "verify", lambda impl, problem, **kw: CheckResult(True, ""))
    monkeypatch.setattr(runner.timing, "time_kernel", lambda *a, **k: {})
    monkeypatch.delenv(worker.HEARTBEAT_ENV, raising=False)
    store = Store(tmp_path / "s.sqlite")
    run = store.start_run("test", "cpu", {}, {})
    p = Problem(64, 64, 64)
    counts = {"sessions": 0, "skipped": 0, "rejected": 0}
    with pytest.raises(ToolchainMissing):
        runner._one_problem(p, [Unbuildable()], store, runner.RunConfig(repeat_impl=None), "cpu", run, 0, counts,
                            lambda m: None)
    assert store.verification("cpu", p, "gemmrl-tuned") is None and counts["rejected"] == 0
    store.close()


def test_tune_refuses_to_start_without_the_headers(no_headers, tmp_path):
    from click.testing import CliRunner

    from gemmrl.cli import main

    db = tmp_path / "store.sqlite"
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--family", "cutlass_sm90", "--db", str(db)])
    assert r.exit_code == 1, r.output
    assert "tune cannot build its kernels here: cutlass_sm90: CUTLASS headers not found" in r.output
    assert "nothing was recorded" in r.output and not db.exists()
