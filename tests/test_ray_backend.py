"""The Ray backend on the CPU: Ray in local mode, actors without GPUs, worker processes that
really segfault or hang. A batch is split across actors; a crashing or hanging candidate is
quarantined and the rest of its batch still comes back; actors of another GPU model are not
used; run_tune over the Ray evaluator resumes from the store."""

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

try:
    import ray
except ImportError:  # the CLI test still runs; the others are skipped
    ray = None

from gemmrl.cli import main
from gemmrl.core.problem import Problem
from gemmrl.distributed import ray_backend
from gemmrl.search.policy import ModelFreePolicy
from gemmrl.search.run import run_tune
from gemmrl.store.db import Store
import worker_tasks

P1 = Problem(512, 768, 1024)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def local_ray():
    if ray is None:
        pytest.skip("Ray is not installed (pip install 'gemmrl[distributed]')")
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def _evaluator(tmp_path, store, *, actors=2, env=None, task=worker_tasks.fake_evaluate_task, **kw):
    logs = []
    kw.setdefault("compile_tasks", False)  # the fake tasks build nothing
    ev, close = ray_backend.ray_evaluator(None, store, "cpu", str(tmp_path / "s.sqlite"), lambda p: 5.0,
                                          actors=actors, num_gpus=0, num_cpus=0, worker_env=env or {},
                                          task=task, name_task=worker_tasks.fake_gpu_name, log=logs.append, **kw)
    return ev, close, logs


def test_a_batch_is_split_and_a_segfault_is_quarantined(local_ray, tmp_path):
    store = Store(tmp_path / "s.sqlite")
    cands = ModelFreePolicy(layouts=("TN",), seed=0).propose(P1, 4)
    ev, close, logs = _evaluator(tmp_path, store, env={"GEMMRL_TEST_BAD": cands[2].name})
    try:
        trials = ev(P1, cands)
    finally:
        close()
    assert [t.candidate.name for t in trials] == [c.name for c in cands]
    by = {t.candidate.name: t for t in trials}
    assert by[cands[2].name].status == "crashed" and "SIGSEGV" in by[cands[2].name].details["reason"]
    assert all(by[c.name].status == "ok" and by[c.name].time_us == 4.0 for c in cands if c is not cands[2])
    assert len({t.details["worker"] for t in trials}) == 2  # both actors served the batch
    assert cands[2].name in store.quarantined("cpu", P1)
    assert any("quarantined" in m for m in logs)


def test_a_hang_times_out_and_is_quarantined(local_ray, tmp_path):
    store = Store(tmp_path / "s.sqlite")
    cands = ModelFreePolicy(layouts=("TN",), seed=0).propose(P1, 3)
    ev, close, _ = _evaluator(tmp_path, store, actors=1, env={"GEMMRL_TEST_HANG": cands[0].name},
                              task=worker_tasks.fake_hang_or_evaluate_task, timeout_s=10)  # slack for a loaded CI machine
    try:
        trials = ev(P1, cands)
    finally:
        close()
    by = {t.candidate.name: t for t in trials}
    assert by[cands[0].name].status == "crashed" and "timeout" in by[cands[0].name].details["reason"]
    assert by[cands[1].name].status == by[cands[2].name].status == "ok", \
        {n: (t.status, t.details.get("reason")) for n, t in by.items()}
    assert "timeout" in store.quarantined("cpu", P1)[cands[0].name]


def test_actors_of_another_gpu_model_are_not_used(local_ray, tmp_path):
    store = Store(tmp_path / "s.sqlite")
    cands = ModelFreePolicy(layouts=("TN",), seed=0).propose(P1, 4)
    ev, close, logs = _evaluator(tmp_path, store, env={"GEMMRL_TEST_GPU_NAMES": "cpu,NVIDIA A100"})
    try:
        trials = ev(P1, cands)
    finally:
        close()
    assert all(t.status == "ok" for t in trials) and len(trials) == 4
    assert len({t.details["worker"] for t in trials}) == 1
    assert any("NVIDIA A100" in m and "not used" in m for m in logs)
    with pytest.raises(RuntimeError, match="no Ray actor"):
        _evaluator(tmp_path, store, actors=1, env={"GEMMRL_TEST_GPU_NAMES": "NVIDIA A100"})


def test_run_tune_on_ray_resumes_without_evaluating_twice(local_ray, tmp_path):
    store = Store(tmp_path / "s.sqlite")
    pol = lambda seed: ModelFreePolicy(layouts=("TN",), seed=seed)  # noqa: E731
    bad = pol(0).propose(P1, 1)[0].name
    ev, close, _ = _evaluator(tmp_path, store, env={"GEMMRL_TEST_BAD": bad})
    try:
        res = run_tune([P1], store, "cpu", ev, candidates=4, batch=4, layouts=("TN",), policy=pol(0))
        assert len(res.trials) == 4 and len(store.trials("cpu")) == 4
        # a new driver (the first one was killed): nothing left to do at the same budget
        res = run_tune([P1], store, "cpu", ev, candidates=4, batch=4, layouts=("TN",), policy=pol(1))
        assert len(res.trials) == 0
        res = run_tune([P1], store, "cpu", ev, candidates=7, batch=4, layouts=("TN",), policy=pol(1))
        assert len(res.trials) == 3
    finally:
        close()
    names = [r["candidate"] for r in store.trials("cpu")]
    assert len(names) == len(set(names)) == 7
    assert bad in store.quarantined("cpu", P1)


def test_prebuild_runs_build_tasks_in_order(local_ray, tmp_path):
    jobs = [(f"k{i}", "this is not CUDA", {"cache_dir": str(tmp_path / f"c{i}"), "timeout_s": 30}) for i in range(2)]
    out = ray_backend.ray_prebuild(jobs, num_cpus=0)
    assert len(out) == 2 and all(not r.ok and r.log for r in out)


def test_tune_with_ray_but_without_ray_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert not ray_backend.available()
    r = CliRunner().invoke(main, ["tune", "--shapes", "256x384x512", "--ray", "auto"])
    assert r.exit_code != 0 and "pip install 'gemmrl[distributed]'" in r.output


def test_kernels_are_compiled_by_ray_tasks_and_installed_where_the_actor_runs(local_ray, tmp_path):
    # build tasks compile into one cache (standing for another node's disk); the actors' workers
    # use another; the actor installs what the tasks built before its worker looks for it
    from gemmrl.build.nvcc import is_built
    from gemmrl.search.policy import Candidate
    from gemmrl.space import registry

    task_cache, actor_cache = tmp_path / "task-node", tmp_path / "actor-node"
    raw = registry.get("raw")
    p = Problem(64, 256, 128)
    cands = [Candidate("raw", s) for s in raw.candidates(p, "TN", 3)]

    def jobs_fn(problem, cs):
        return [(j[0], j[1], {**j[2], "cache_dir": str(task_cache / "builds")})
                for j in ray_backend.candidate_jobs(problem, cs)]
    store = Store(tmp_path / "s.sqlite")
    ev, close, logs = _evaluator(tmp_path, store, env={"GEMMRL_CACHE": str(actor_cache)},
                                 task=worker_tasks.fake_evaluate_task, compile_tasks=True, jobs_fn=jobs_fn,
                                 build_cpus=0)
    try:
        trials = ev(p, cands)
    finally:
        close()
    assert [t.candidate.name for t in trials] == [c.name for c in cands]
    assert any("kernels compiled by Ray CPU tasks" in m for m in logs)
    assert sum("installed" in m for m in logs) == 2  # one message per actor
    for c in cands:
        job = ray_backend.candidate_jobs(p, [c])[0]
        assert is_built(job[1], name=job[0], cache_dir=task_cache / "builds", **job[2])
        assert is_built(job[1], name=job[0], cache_dir=actor_cache / "builds", **job[2])
