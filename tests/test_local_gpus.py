"""gemmrl tune --gpus N (distributed/local.py): the split of shapes, the children's command lines
(parsed back by the real CLI), and the supervision of the children, with stand-in processes."""

import sys

import pytest

from gemmrl.cli import main
from gemmrl.core.problem import Problem
from gemmrl.core.shapes import resolve
from gemmrl.distributed import local


TUNE = main.commands["tune"]


def _args(**kw):
    """A parent tune's options as click parsed them: these defaults, then `kw` (by parameter
    name; families= is --family)."""
    base = TUNE.make_context("tune", ["--candidates", "8", "--batch", "4", "--db", "s.sqlite", "--out", "res"]).params
    if "families" in kw:
        kw["family_opts"] = kw.pop("families")
    return {**base, **kw}


def _child(args, shapes_file, n, python=sys.executable):
    return local.child_command("tune", TUNE, args, shapes_file, n, python=python)


def test_split_puts_every_shape_in_exactly_one_shard_and_balances_the_work():
    grid = resolve("grid")
    shards = local.split_shapes(grid, 4)
    flat = [p for s in shards for p in s]
    assert sorted(flat) == sorted(grid) and len(flat) == len(set(flat))
    loads = [sum(local.shape_cost(p) for p in s) for s in shards]
    biggest = max(local.shape_cost(p) for p in grid)
    assert max(loads) - min(loads) <= biggest  # LPT: within one shape of each other
    assert max(loads) / min(loads) < 1.05
    pos = {p: i for i, p in enumerate(grid)}
    for s in shards:  # the caller's order is kept inside each shard
        assert [pos[p] for p in s] == sorted(pos[p] for p in s)
    assert local.split_shapes(grid, 4) == shards  # deterministic


def test_split_weighs_finished_shapes_as_almost_nothing():
    big = Problem(8192, 8192, 8192)
    done = [Problem(m, 64, 64) for m in range(64, 64 * 41, 64)]
    shards = local.split_shapes(done + [big], 2, frozenset(done))
    # 40 finished shapes weigh less than one shape to search: they all go beside it, not split 20/20
    assert shards == [[big], done]
    assert sorted(len(s) for s in local.split_shapes(done + [big], 2)) == [20, 21]  # as unfinished: even
    with pytest.raises(ValueError):
        local.split_shapes(done, 0)


def test_more_gpus_than_shapes_leaves_shards_empty():
    shards = local.split_shapes([Problem(64, 64, 64)], 3)
    assert [len(s) for s in shards] == [1, 0, 0]


def test_visible_gpus_follow_the_parents_list():
    assert local.visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "2, 3,5"}) == ["2", "3"]
    assert local.visible_gpus(3, {}) == ["0", "1", "2"]
    assert local.visible_gpus(2, {"CUDA_VISIBLE_DEVICES": ""}) == ["0", "1"]


def test_child_command_is_a_tune_the_cli_parses_with_the_parents_options(tmp_path):
    shard = local.write_shard([Problem(64, 128, 256), Problem(512, 512, 512)], tmp_path / "shard0.txt")
    assert shard.read_text() == "64x128x256\n512x512x512\n"
    args = _args(budget_s=600.0, wall_s=300.0, built_only=True, families=("cutlass_sm90",),
                 match="splitk[0-9]+sr", acc="fp16", reuse_baselines=True)
    cmd = _child(args, str(shard), 4, python="py")
    assert cmd[:4] == ["py", "-m", "gemmrl.cli", "tune"]
    ctx = main.commands["tune"].make_context("tune", cmd[4:])
    p = ctx.params
    assert p["shape_spec"] == str(shard) and p["acc"] == "fp16" and p["candidates"] == 8 and p["batch"] == 4
    assert p["budget_s"] == 150.0 and p["wall_s"] == 300.0  # the device budget is shared, the wall clock is not
    assert p["built_only"] and p["no_report"] and p["reuse_baselines"]
    assert p["family_opts"] == ("cutlass_sm90",) and p["match"] == "splitk[0-9]+sr"
    assert p["gpus"] == 1 and p["ray_address"] is None  # a child never fans out again
    assert resolve(p["shape_spec"]) == [Problem(64, 128, 256), Problem(512, 512, 512)]
    raced = main.commands["tune"].make_context("tune", _child(_args(race=3), "x.txt", 2)[4:]).params
    assert raced["race"] == 3
    plain = main.commands["tune"].make_context("tune", _child(_args(), "x.txt", 2)[4:]).params
    assert plain["race"] == 1
    assert plain["budget_s"] is None and plain["wall_s"] is None and not plain["built_only"]
    assert plain["family_opts"] == ("cutlass_sm90", "raw") and plain["match"] is None
    # tune --build-ahead defaults to the cores: each of n children gets a share, unless it was given
    from gemmrl.build.pool import default_jobs

    assert plain["build_ahead_n"] == max(1, default_jobs() // 2)
    given = main.commands["tune"].make_context("tune", _child(_args(build_ahead_n=0), "x.txt", 2)[4:]).params
    assert given["build_ahead_n"] == 0
    many = main.commands["tune"].make_context("tune", _child(_args(), "x.txt", 4 * default_jobs())[4:]).params
    assert many["build_ahead_n"] == 1


def test_children_each_see_their_gpu_and_their_output_is_prefixed():
    code = ("import os, sys; print('gpu', os.environ['CUDA_VISIBLE_DEVICES']); "
            "print('err', file=sys.stderr); sys.exit(int(os.environ['CUDA_VISIBLE_DEVICES']) % 2)")
    lines = []
    codes = local.run_children([[sys.executable, "-c", code]] * 3, ["4", "5", "6"], lines.append)
    assert codes == [0, 1, 0]
    for g in ("4", "5", "6"):
        assert f"[gpu{g}] gpu {g}" in lines and f"[gpu{g}] err" in lines
    with pytest.raises(ValueError):
        local.run_children([[sys.executable, "-c", "pass"]], ["0", "1"], lines.append)


def test_an_interrupted_parent_stops_its_children():
    import os
    import signal
    import time

    lines = []

    def log(m):  # the first line a child prints: Ctrl-C reaches the parent while it waits
        lines.append(m)
        if len(lines) == 1:  # once: a second Ctrl-C, from the other child's line, could land in a later test
            os.kill(os.getpid(), signal.SIGINT)

    code = "import time; print('up', flush=True); time.sleep(60)"
    t0 = time.monotonic()
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job
    # starts with SIGINT ignored, and then the signal never arrives)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            local.run_children([[sys.executable, "-c", code]] * 2, ["0", "1"], log)
    finally:
        signal.signal(signal.SIGINT, before)
    assert time.monotonic() - t0 < 30  # the sleeping children were terminated, not waited for
    assert "[gpu0] up" in lines or "[gpu1] up" in lines


def _fake_gpus(monkeypatch, names):
    import torch

    from gemmrl.bench import runner

    monkeypatch.setattr(runner, "require_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])


def test_tune_gpus_starts_one_real_child_per_gpu_and_reports_their_failure(monkeypatch, tmp_path):
    """The children are real `gemmrl tune` processes; on this GPU-less machine each refuses to run,
    which the parent must show (prefixed by GPU) and turn into a failure naming both GPUs."""
    from click.testing import CliRunner

    _fake_gpus(monkeypatch, ["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = CliRunner().invoke(main, ["tune", "--gpus", "2", "--shapes", "64x64x64,4096x4096x4096,128x64x8192",
                                  "--db", str(tmp_path / "s.sqlite"), "--no-report"])
    assert r.exit_code == 1, r.output
    assert "tuning 3 shapes (0 already searched) on 2 GPUs" in r.output
    assert "1 shapes" in r.output and "2 shapes" in r.output
    assert "[gpu0]" in r.output and "[gpu1]" in r.output and "GPU" in r.output.split("[gpu0]", 1)[1]
    assert "tune failed on GPU 0 (exit 2), GPU 1 (exit 2)" in r.output


def test_tune_gpus_refuses_more_gpus_than_present_mixed_models_and_ray(monkeypatch, tmp_path):
    from click.testing import CliRunner

    db = str(tmp_path / "s.sqlite")
    _fake_gpus(monkeypatch, ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
    r = CliRunner().invoke(main, ["tune", "--gpus", "3", "--shapes", "64x64x64", "--db", db])
    assert r.exit_code == 2 and "this machine shows 2 GPU(s)" in r.output
    r = CliRunner().invoke(main, ["tune", "--gpus", "2", "--shapes", "64x64x64", "--db", db])
    assert r.exit_code == 2 and "different models" in r.output
    r = CliRunner().invoke(main, ["tune", "--gpus", "2", "--ray", "auto", "--shapes", "64x64x64", "--db", db])
    assert r.exit_code == 2 and "choose one" in r.output


def test_a_terminated_parent_stops_its_children(tmp_path):
    """`timeout` ends a tune with SIGTERM: the children must not outlive it (they would go on
    writing the store while it is copied)."""
    import os
    import signal
    import subprocess
    import time

    pidfile = tmp_path / "pids"
    parent = (
        "import sys; from gemmrl.distributed import local\n"
        "child = 'import os, time; open(%r, \"a\").write(str(os.getpid()) + \"\\\\n\"); print(\"up\", flush=True); "
        "time.sleep(120)' % sys.argv[1]\n"
        "local.run_children([[sys.executable, '-c', child]] * 2, ['0', '1'], print)\n")
    p = subprocess.Popen([sys.executable, "-c", parent, str(pidfile)], stdout=subprocess.PIPE, text=True)
    seen = 0
    while seen < 2:
        assert "up" in p.stdout.readline()
        seen += 1
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    for pid in map(int, pidfile.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_cli_args_give_back_the_options_a_command_was_given():
    cmd = main.commands["bench"]
    given = ["--shapes", "grid", "--mode", "offline,server", "--impl", "baselines", "--impl", "tuned",
             "--acc", "fp16", "--host-ci", "0.01", "--host-max-s", "3", "--server-gaps", "each",
             "--budget-s", "500", "--retime", "--no-isolate", "--gpus", "4", "--db", "x.sqlite"]
    params = cmd.make_context("bench", list(given)).params
    args = local.cli_args(cmd, params)
    assert cmd.make_context("bench", list(args)).params == params  # the same options, parsed again (a copy:
    # click consumes the list it parses)
    assert "--no-isolate" in args and "--retime" in args and "--no-verify" not in args
    assert args.count("--impl") == 2 and "--subject" not in args  # None: left to its default
    child = cmd.make_context("bench", local.cli_args(cmd, {**params, "shape_spec": "s.txt", "gpus": 1,
                                                            "no_report": True})).params
    assert child == {**params, "shape_spec": "s.txt", "gpus": 1, "no_report": True}
    plain = cmd.make_context("bench", []).params
    assert cmd.make_context("bench", local.cli_args(cmd, plain)).params == plain


def test_bench_gpus_starts_one_real_child_per_gpu_and_reports_their_failure(monkeypatch, tmp_path):
    """Real `gemmrl bench` children, which refuse this GPU-less machine: the parent shows their
    output by GPU and fails naming both, and the empty store's report does not hide that."""
    from click.testing import CliRunner

    _fake_gpus(monkeypatch, ["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = CliRunner().invoke(main, ["bench", "--gpus", "2", "--shapes", "64x64x64,4096x4096x4096,128x64x8192",
                                  "--mode", "offline", "--impl", "tuned", "--db", str(tmp_path / "s.sqlite"),
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert "measuring 3 shapes on 2 GPUs (NVIDIA H200; CUDA_VISIBLE_DEVICES 0,1): 1 shapes, 2 shapes" in r.output
    assert "[gpu0]" in r.output and "[gpu1]" in r.output and "no CUDA GPU" in r.output
    assert "bench failed on GPU 0 (exit 2), GPU 1 (exit 2)" in r.output
    r = CliRunner().invoke(main, ["bench", "--gpus", "3", "--shapes", "64x64x64", "--db", str(tmp_path / "s.sqlite")])
    assert r.exit_code == 2 and "this machine shows 2 GPU(s)" in r.output


def test_sigterm_runs_the_commands_finally_blocks(tmp_path):
    """A child stopped by SIGTERM (its parent's Ctrl-C, `timeout`) must still run its finally
    blocks, where runs are recorded as partial and the store is closed: before this, runs cut
    that way stayed 'running' in the store."""
    import signal
    import subprocess
    import time

    mark = tmp_path / "finally-ran"
    code = ("import sys, time; from gemmrl.cli import stop_cleanly_on_sigterm; stop_cleanly_on_sigterm()\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(60)\nfinally:\n"
            f"    open({str(mark)!r}, 'w').write('yes')\n")  # 'ready' inside the try: no race
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 30 and mark.read_text() == "yes"
