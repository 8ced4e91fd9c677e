"""The experiment scripts under scripts/ run on a GPU; here they must at least load and explain
themselves (argument parsing happens before any GPU work), and the trace report must read a
trace for real."""

import csv
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("script, words", [
    ("server-noise.py", "--rounds"), ("fallback-gap.py", "pack"), ("product-gap.py", "pack"),
    ("protocol-gap.py", "--repeats"), ("launch-gap.py", "--calls"), ("cuda-l2-prebuild.py", "--shapes"),
    ("autotune-check.py", "--layouts"), ("kernel-noise.py", "--rounds"), ("lt-host-cost.py", "--bursts"),
    ("nearest-loo.py", "--no-library"), ("product-settle.py", "--min-sessions"), ("arrive-twins.py", "--splits")])
def test_gpu_scripts_load_and_show_their_arguments(script, words):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and words in r.stdout


def test_server_noise_report_reads_a_trace(tmp_path):
    path = tmp_path / "trace.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "gaps", "round", "name", "gap_us", "time_us"])
        for r in range(1600):
            for name, t in (("a", 50.0), ("b", 51.5)):  # b is 3% slower: no chunk agrees within 2%
                w.writerow(["64x64x64", "round", r, name, "900.0", t])
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "server-noise-report.py"), str(path)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| round |")]
    assert len(rows) == 5 * 4  # 5 chunk sizes x 4 statistics (median, mean, trimmed, paired)
    assert all("| 0% |" in line and "3.00%" in line for line in rows)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "server-noise-report.py")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode != 0 and "server-noise-report.py" in r.stderr


def test_kernel_noise_report_compares_only_the_copies(tmp_path):
    path = tmp_path / "kernel-noise-trace.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "gaps", "round", "name", "gap_us", "time_us"])
        for shape, slow in (("256x256x256", 1.0), ("512x512x512", 1.03)):
            for r in range(40):
                # the copies drift together round by round (the clock); on the second shape copy #2
                # is 3% slower throughout; the library beside them is 10% slower and not a copy
                drift = 1.0 + 0.05 * ((r * 7) % 11) / 10
                for name, t in (("torch.matmul", 20.0), ("torch.matmul#2", 20.0 * slow),
                                ("torch.matmul#3", 20.0), ("cuBLAS-nn", 22.0)):
                    w.writerow([shape, "kernel", r, name, "0", t * drift])
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-noise.py"), "--report", str(path),
                        "--sizes", "10,40"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 shapes;")
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line
            for line in r.stdout.splitlines() if line.startswith("| 10 |") or line.startswith("| 40 |")}
    # 3 pairs of copies a chunk (cuBLAS-nn left out), 4 chunks of 10 rounds or 1 of 40, 2 shapes
    assert set(rows) == {(str(n), s, str(p)) for n, p in ((10, 24), (40, 6))
                         for s in ("median", "mean", "trimmed", "paired")}
    for line in rows.values():  # 2 of each shape's 3 pairs hold #2: 3% apart, the rest exactly 0
        assert "| 67% |" in line and "| 3.00% |" in line
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel-noise.py")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode != 0 and "OUT_DIR is required" in r.stderr


def test_pack_build_cache_keeps_every_build_or_the_matching_ones(tmp_path):
    import tarfile

    cache = tmp_path / "cache"
    for name in ("sm90_a_nn_f16_f16-1", "sm90_b_nn_f16_f32-2", ".sm90_partial-3", "sm90_c_nn_f16_f16-4.failed"):
        (cache / "builds" / name).mkdir(parents=True)
        (cache / "builds" / name / "kernel.so").write_bytes(b"\x7fELF")
    script = str(ROOT / "scripts" / "pack-build-cache.sh")

    def members(out):
        with tarfile.open(out) as t:
            return sorted(m.name for m in t.getmembers() if m.name.endswith("kernel.so"))

    r = subprocess.run([script, str(cache), str(tmp_path / "all.tgz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert members(tmp_path / "all.tgz") == ["builds/sm90_a_nn_f16_f16-1/kernel.so",
                                            "builds/sm90_b_nn_f16_f32-2/kernel.so"]
    r = subprocess.run([script, str(cache), str(tmp_path / "f16.txz"), "_f16_f16-"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("1 builds"), r.stdout + r.stderr
    assert members(tmp_path / "f16.txz") == ["builds/sm90_a_nn_f16_f16-1/kernel.so"]
    r = subprocess.run([script, str(cache), str(tmp_path / "none.tgz"), "nothing-like-this"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no build matches" in r.stderr
    listed = tmp_path / "entries.txt"
    listed.write_text("builds/sm90_b_nn_f16_f32-2\nbuilds/sm90_not_built-9\nbuilds/sm90_b_nn_f16_f32-2\n")
    r = subprocess.run([script, str(cache), str(tmp_path / "listed.txz"), f"@{listed}"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("1 builds"), r.stdout + r.stderr
    assert "1 listed builds not in" in r.stderr  # planned but never built: named, not fatal
    assert members(tmp_path / "listed.txz") == ["builds/sm90_b_nn_f16_f32-2/kernel.so"]
    listed.write_text("builds/sm90_not_built-9\n")
    r = subprocess.run([script, str(cache), str(tmp_path / "none.txz"), f"@{listed}"], capture_output=True, text=True)
    assert r.returncode != 0 and "none of the builds listed" in r.stderr


def test_cutlass_headers_pack_and_unpack_to_the_same_build_key(tmp_path):
    """scripts/pack-cutlass-headers.sh packs only the two include trees gemmrl compiles against
    (not the wheel's examples and tools), and device-common.sh's install_cutlass unpacks the
    tarball and points GEMMRL_CUTLASS_DIR at it: the kernels' build keys there are the ones made
    here, so carried caches are found."""
    import tarfile

    src = tmp_path / "wheel" / "source"
    for d in ("include/cutlass", "include/cute", "tools/util/include/cutlass/util", "examples/00", "tools/profiler"):
        (src / d).mkdir(parents=True)
    (src / "include/cutlass/cutlass.h").write_text("// cutlass\n")
    (src / "include/cutlass/version.h").write_text(
        "#define CUTLASS_MAJOR 9\n#define CUTLASS_MINOR 8\n#define CUTLASS_PATCH 7\n")
    (src / "include/cute/tensor.hpp").write_text("// cute\n")
    (src / "tools/util/include/cutlass/util/packed_stride.hpp").write_text("// util\n")
    (src / "examples/00/big.cu").write_text("x" * 1000)
    (src / "tools/profiler/p.cu").write_text("y")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("pack-cutlass-headers.sh", "device-common.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    env = {**ENV, "GEMMRL_CUTLASS_DIR": str(src), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["bash", "scripts/pack-cutlass-headers.sh"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    tarball = repo / ".ext/carry/cutlass-headers-9.8.7.txz"
    with tarfile.open(tarball) as t:
        files = {m.name for m in t.getmembers() if m.isfile()}
    assert files == {"cutlass-9.8.7/include/cutlass/cutlass.h", "cutlass-9.8.7/include/cutlass/version.h",
                     "cutlass-9.8.7/include/cute/tensor.hpp",
                     "cutlass-9.8.7/tools/util/include/cutlass/util/packed_stride.hpp"}
    # on the device: unpacked, named by GEMMRL_CUTLASS_DIR, the same include keys as here
    unpack = tmp_path / "unpacked"
    script = (". scripts/device-common.sh; install_cutlass; echo \"$GEMMRL_CUTLASS_DIR\"; "
              "python3 -c 'from gemmrl.build.cutlass import cutlass_build_kwargs as k; print(k()[\"include_keys\"])'")
    common = (repo / "scripts/device-common.sh").read_text().replace("/tmp/cutlass-headers", str(unpack))
    (repo / "scripts/device-common.sh").write_text(common)
    env.pop("GEMMRL_CUTLASS_DIR")
    r = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    where, keys = r.stdout.strip().splitlines()
    assert where == str(unpack / "cutlass-9.8.7")
    assert (unpack / "cutlass-9.8.7/include/cute/tensor.hpp").exists()
    assert keys == "('cutlass-9.8.7/include', 'cutlass-9.8.7/tools/util/include')"
    assert f"CUTLASS headers: {unpack / 'cutlass-9.8.7' / 'include'}" in r.stderr  # said where the call shows it
    # a GEMMRL_CUTLASS_DIR from the caller that holds no headers (a warm machine's, named in a call that
    # found the machine fresh) is said and dropped, and the carried headers are used (2026-12-01)
    r = subprocess.run(["bash", "-c", script], cwd=repo, env={**env, "GEMMRL_CUTLASS_DIR": str(tmp_path / "gone")},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[0] == str(unpack / "cutlass-9.8.7")
    assert f"GEMMRL_CUTLASS_DIR={tmp_path / 'gone'} holds no CUTLASS headers" in r.stderr


def _steps_repo(tmp_path):
    """A copy of the repository's layout that scripts/device-steps.sh runs in: its scripts, an
    empty results/."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "results").mkdir()
    for name in ("device-steps.sh", "device-common.sh", "pack-build-cache.sh", "device-store.py"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts")
    return repo


def test_device_steps_merges_carried_deltas_before_the_steps(tmp_path):
    """.ext/carry/delta*.sqlite[.xz] (earlier calls' runs, not yet in the committed store) are
    merged into the call's store before any step reads it, once however often carried, and the
    call sends back only its own runs."""
    import shutil
    import sqlite3

    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    (repo / ".ext" / "carry").mkdir(parents=True)
    store = Store(repo / "results" / "gemmrl.sqlite")
    store.start_run("gemmrl bench (committed)", "Fake GPU", {}, {})
    store.close()
    delta = Store(repo / ".ext" / "carry" / "delta-1.sqlite")
    delta.start_run("gemmrl tune (an earlier call)", "Fake GPU", {}, {})
    delta.close()
    shutil.copy(repo / ".ext" / "carry" / "delta-1.sqlite", repo / ".ext" / "carry" / "delta-2.sqlite")  # the same, twice
    # the step sees the merged store: it records what the store's runs are
    (repo / "scripts" / "runs.py").write_text(
        "import os, sqlite3\ndb = sqlite3.connect('results/gemmrl.sqlite')\n"
        "open(os.environ['OUT'] + '/runs.txt', 'w').write('\\n'.join(r[0] for r in "
        "db.execute('SELECT command FROM runs ORDER BY id')))\n")
    out = tmp_path / "out"
    env = {**ENV, "STEPS": "scripts/runs.py", "TOTAL_S": "300", "GEMMRL_CACHE": str(tmp_path / "cache"),
           "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merged .ext/carry/delta-1.sqlite" in r.stdout and "merged .ext/carry/delta-2.sqlite" in r.stdout
    assert (out / "runs.txt").read_text().splitlines() == ["gemmrl bench (committed)", "gemmrl tune (an earlier call)"]
    # what comes back is the call's own work: no run (the step made none), not the carried one
    back = tmp_path / "back.sqlite"
    m = subprocess.run([sys.executable, "-m", "gemmrl.cli", "store", "--db", str(back), "--merge",
                        str(out / "gemmrl-delta.sqlite.xz")], capture_output=True, text=True, env=ENV, timeout=300)
    assert m.returncode == 0, m.stdout + m.stderr
    assert sqlite3.connect(back).execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_device_steps_runs_each_step_in_turn_with_its_cap_and_returns_the_store(tmp_path):
    """scripts/device-steps.sh on a copy of the repository's layout with a small store: each step
    gets --db, a step with @N is cut after N seconds, one that fails does not stop the next, a
    BG job runs beside them and is waited for, and the call's own runs come back compressed
    beside the logs (the whole store with FULL_STORE=1)."""
    import tarfile

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    store = Store(repo / "results" / "gemmrl.sqlite")
    store.put_tuning("Fake GPU", Problem(64, 64, 64), "gemmrl-tuned", b"{}", "x", 1.0)
    store.close()
    out = tmp_path / "out"
    (repo / "scripts" / "hello.py").write_text(
        "import os, sys\nopen(os.environ['OUT'] + '/hello.txt', 'w').write(' '.join(sys.argv[1:]))\n")
    env = {**ENV, "STEPS": "store ; @1 verify --impl nope ; store ; scripts/hello.py a b", "TOTAL_S": "300",
           "GEMMRL_CACHE": str(tmp_path / "cache"), "PATH": os.environ["PATH"],
           "BG": "sleep 2; echo built > $OUT/bg.txt"}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== step 0: gemmrl store" in r.stdout and "== step 2: gemmrl store" in r.stdout
    assert "(timeout 1 s)" in r.stdout  # the cap
    assert (out / "gemmrl-delta.sqlite.xz").exists() and not (out / "gemmrl.sqlite.xz").exists()
    assert not (repo / "results" / "gemmrl.sqlite.xz").exists()
    assert (out / "bg.txt").read_text() == "built\n"
    with tarfile.open(out / "logs.tgz") as t:
        names = set(t.getnames())
    assert {"logs/steps.txt", "logs/step-0-store.log", "logs/step-1-verify.log", "logs/step-2-store.log"} <= names
    with tarfile.open(out / "logs.tgz") as t:
        steps = t.extractfile("logs/steps.txt").read().decode()
    assert "background: exit 0" in steps
    # the set-up's seconds and what they left the steps, before the first step
    setup = steps.splitlines()[0]
    assert setup.startswith("set-up took ") and "of TOTAL_S=300" in setup, setup
    took = int(setup.split()[2])
    assert f"the steps have {300 - took - 60} s" in setup
    steps = "\n".join(line for line in steps.splitlines() if not line.startswith(("background", "set-up")))
    assert steps.count("exit 0") == 3 and "exit 0" not in steps.splitlines()[3]  # the bad step failed
    # a diagnostic script's step: run with python3, its arguments as given (no --db), OUT in its env
    assert "== step 3: python3 scripts/hello.py a b" in steps and (out / "hello.txt").read_text() == "a b"
    # two lanes (GPUs): STEPS_1 runs beside STEPS; a lane for a GPU the machine lacks is named
    out2 = tmp_path / "out2"
    # a step with --gpus N (N > 1) sees every GPU of the machine; another sees its lane's alone
    (repo / "scripts" / "vis.py").write_text(
        "import os, sys\nopen(os.environ['OUT'] + '/vis-' + sys.argv[1] + '.txt', 'w')"
        ".write(os.environ['CUDA_VISIBLE_DEVICES'])\n")
    env2 = {**env, "STEPS": "store; scripts/vis.py all --gpus 2",
            "STEPS_1": "store --db-missing-option; scripts/vis.py lane; scripts/vis.py one --gpus 1", "STEPS_2": "store",
            "STEPS_GPUS": "2", "FULL_STORE": "1", "BG": "", "PRE": "scripts/hello.py pre; store",
            "CACHE_BACK": str(tmp_path / "entries.txt")}
    # CACHE_BACK: the builds a step listed come back packed, and only those
    for key in ("builds/k1", "builds/k2"):
        (tmp_path / "cache" / key).mkdir(parents=True)
        (tmp_path / "cache" / key / "lib.so").write_text(key)
    (tmp_path / "entries.txt").write_text("builds/k1\n")
    (repo / "results" / "gemmrl.sqlite").unlink()  # a fresh store for the second call
    store = Store(repo / "results" / "gemmrl.sqlite")
    store.close()
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out2)], capture_output=True,
                       text=True, env=env2, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== step 0: gemmrl store" in r.stdout and "== step 1.0: gemmrl store --db-missing-option" in r.stdout
    assert "STEPS_2 is set but this machine has 2 GPU(s)" in r.stdout
    with tarfile.open(out2 / "logs.tgz") as t:
        assert {"logs/step-0-store.log", "logs/step-1.0-store.log", "logs/step-pre.0-hello.log",
                "logs/step-pre.1-store.log"} <= set(t.getnames())
    # PRE ran alone, before either lane started
    lines = r.stdout.splitlines()
    first_lane = min(i for i, l in enumerate(lines) if l.startswith("== step 0:") or l.startswith("== step 1.0:"))
    assert max(i for i, l in enumerate(lines) if "(step pre.1)" in l) < first_lane
    assert (out2 / "hello.txt").read_text() == "pre"
    assert (out2 / "vis-all.txt").read_text() == "0,1" and (out2 / "vis-lane.txt").read_text() == "1"
    # --gpus 1 keeps its lane's GPU (two lanes' --gpus 1 steps both ran on GPU 0, runs 551-556)
    assert (out2 / "vis-one.txt").read_text() == "1"
    assert (out2 / "gemmrl.sqlite.xz").exists() and not (out2 / "gemmrl-delta.sqlite.xz").exists()
    with tarfile.open(out2 / "gcache-back.txz") as t:
        assert set(t.getnames()) == {"builds/k1", "builds/k1/lib.so"}


def test_device_steps_gives_a_tune_step_a_finish_inside_its_timeout(tmp_path):
    """A tune step that bounds itself with neither --wall-s, --finish-s nor --search-only gets
    --finish-s 20 s under its timeout (2026-11-30f: a capped tune with no --wall-s lost its final
    timing to the cap); one that does, and any other verb, is left as written. The tunes fail here
    (no GPU): what is checked is the command each was given."""
    repo = _steps_repo(tmp_path)
    out = tmp_path / "out"
    steps = ("@100 tune --shapes 64x64x64; @100 tune --shapes 64x64x64 --wall-s 30; "
             "@100 tune --shapes 64x64x64 --finish-s=50; @40 tune --shapes 64x64x64 --search-only; "
             "@40 tune --shapes 64x64x64; @100 store")
    env = {**ENV, "STEPS": steps, "TOTAL_S": "400", "GEMMRL_CACHE": str(tmp_path / "cache"),
           "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith("== step")]
    assert heads == [
        "== step 0: gemmrl tune --shapes 64x64x64 (timeout 100 s; --finish-s 80)",
        "== step 1: gemmrl tune --shapes 64x64x64 --wall-s 30 (timeout 100 s)",
        "== step 2: gemmrl tune --shapes 64x64x64 --finish-s=50 (timeout 100 s)",
        "== step 3: gemmrl tune --shapes 64x64x64 --search-only (timeout 40 s)",
        "== step 4: gemmrl tune --shapes 64x64x64 (timeout 40 s; --finish-s 30)",
        "== step 5: gemmrl store (timeout 100 s)"], heads
    # each tune got as far as the GPU check: the --finish-s given was a valid option, never beside a
    # --wall-s or --search-only (a usage error says "give one")
    import tarfile

    with tarfile.open(out / "logs.tgz") as t:
        for i in range(5):
            log = t.extractfile(f"logs/step-{i}-tune.log").read().decode()
            assert "no CUDA GPU is visible" in log and "Usage:" not in log, (i, log)


def test_device_steps_sends_back_what_finished_when_the_call_is_killed(tmp_path):
    """A call killed from outside before its end (the device tool's limit was below TOTAL_S:
    2026-11-28, a settle's five runs lost) still leaves the runs of the steps that finished in
    OUT/gemmrl-delta.sqlite.xz, a whole file, never the carried store's runs."""
    import signal
    import sqlite3
    import time

    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    store = Store(repo / "results" / "gemmrl.sqlite")
    store.start_run("gemmrl bench (committed)", "Fake GPU", {}, {})
    store.close()
    (repo / "scripts" / "addrun.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nfrom gemmrl.store.db import Store\n"
        "s = Store('results/gemmrl.sqlite'); s.start_run('gemmrl tune (finished)', 'Fake GPU', {}, {}); s.close()\n"
        % str(ROOT))
    (repo / "scripts" / "hang.py").write_text("import time\ntime.sleep(120)\n")
    out = tmp_path / "out"
    env = {**ENV, "STEPS": "scripts/addrun.py; scripts/hang.py", "TOTAL_S": "300", "SNAP_S": "600",
           "GEMMRL_CACHE": str(tmp_path / "cache"), "PATH": os.environ["PATH"]}
    p = subprocess.Popen(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env, cwd=repo, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the second step has begun: the first one's snapshot is written
            steps = out / "logs" / "steps.txt"
            if steps.exists() and "== step 1:" in steps.read_text() and (out / "gemmrl-delta.sqlite.xz").exists():
                break
            time.sleep(0.5)
        else:
            pytest.fail("no snapshot after the first step")
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # as the tool kills a call at its limit
        p.wait(timeout=60)
    assert not list(out.glob(".gemmrl-delta*"))
    back = tmp_path / "back.sqlite"
    m = subprocess.run([sys.executable, "-m", "gemmrl.cli", "store", "--db", str(back), "--merge",
                        str(out / "gemmrl-delta.sqlite.xz")], capture_output=True, text=True, env=ENV, timeout=300)
    assert m.returncode == 0, m.stdout + m.stderr
    assert [r[0] for r in sqlite3.connect(back).execute("SELECT command FROM runs")] == ["gemmrl tune (finished)"]


def test_sample_efficiency_run_searches_each_policy_in_its_own_copy_of_the_baselines(tmp_path):
    """scripts/sample-efficiency-run.sh: the sweep and the model-free policy, each a --search-only
    tune on every GPU in a fresh copy of BASE (so each store holds its own trials alone), come
    back compressed with their logs; a missing BASE stops it before anything runs."""
    import json
    import lzma
    import shutil
    import sqlite3

    repo = _steps_repo(tmp_path)
    shutil.copy(ROOT / "scripts" / "sample-efficiency-run.sh", repo / "scripts")
    # a fake gemmrl.cli that records its argv in the store it is given, and a fake two-GPU nvidia-smi
    (repo / "gemmrl").mkdir()
    (repo / "gemmrl" / "__init__.py").write_text("")
    (repo / "gemmrl" / "cli.py").write_text(
        "import json, sqlite3, sys\nargv = sys.argv[1:]\ndb = sqlite3.connect(argv[argv.index('--db') + 1])\n"
        "db.execute('CREATE TABLE IF NOT EXISTS calls (argv TEXT)')\n"
        "db.execute('INSERT INTO calls VALUES (?)', (json.dumps(argv),)); db.commit()\n"
        "print('[gpu0] tuned 50 shapes with 7 new candidates'); print('[gpu1] tuned 50 shapes with 9 new candidates')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake'; echo 'GPU 1: Fake'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    base = repo / "base.sqlite"
    con = sqlite3.connect(base)
    con.execute("CREATE TABLE calls (argv TEXT)")
    con.execute("INSERT INTO calls VALUES ('baselines')")
    con.commit()
    con.close()
    out = tmp_path / "out"
    env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GEMMRL_CACHE": str(tmp_path / "cache"), "MF_N": "8"}
    script = str(repo / "scripts" / "sample-efficiency-run.sh")
    r = subprocess.run(["bash", script, str(out)], capture_output=True, text=True, env={**env, "BASE": "nope.sqlite"},
                       cwd=repo, timeout=120)
    assert r.returncode == 2 and "no baselines store at nope.sqlite" in r.stderr and not (out / "study.txt").exists()
    r = subprocess.run(["bash", script, str(out)], capture_output=True, text=True, env={**env, "BASE": str(base)},
                       cwd=repo, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {}
    for name in ("sweep", "mf"):
        db = tmp_path / f"{name}.sqlite"
        db.write_bytes(lzma.decompress((out / f"{name}.sqlite.xz").read_bytes()))
        got[name] = [row[0] for row in sqlite3.connect(db).execute("SELECT argv FROM calls")]
    assert got["sweep"][0] == "baselines" and got["mf"][0] == "baselines" and len(got["sweep"]) == len(got["mf"]) == 2
    sweep, mf = json.loads(got["sweep"][1]), json.loads(got["mf"][1])
    for argv in (sweep, mf):
        assert argv[:2] == ["tune", "--shapes"] and {"--built-only", "--search-only"} <= set(argv)
        assert argv[argv.index("--gpus") + 1] == "2"
    assert sweep[sweep.index("--policy") + 1] == "exhaustive" and mf[mf.index("--policy") + 1] == "model-free"
    assert mf[mf.index("--candidates") + 1] == "8"
    study = (out / "study.txt").read_text()
    assert "[gpu0] tuned 50 shapes with 7 new candidates [gpu1] tuned 50 shapes with 9" in study
    assert (out / "sweep.log").exists() and (out / "mf.log").exists()


def test_device_steps_splits_a_steps_words_as_a_shell_would(tmp_path):
    """Quotes group a step's words (pytest -k 'a or b' was split at its spaces and pytest stopped
    with a usage error, 2026-11-27); nothing is expanded; a step whose quotes do not balance is
    skipped, saying so, and the next one runs."""
    import json

    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    Store(repo / "results" / "gemmrl.sqlite").close()
    (repo / "scripts" / "argv.py").write_text(
        "import json, os, sys\nopen(os.environ['OUT'] + '/argv-' + sys.argv[1] + '.json', 'w')"
        ".write(json.dumps(sys.argv[2:]))\n")
    out = tmp_path / "out"
    env = {**ENV, "STEPS": "scripts/argv.py one -k 'x or y' \"a b\" $HOME * ; scripts/argv.py two 'open ; "
                           "scripts/argv.py three plain",
           "TOTAL_S": "300", "GEMMRL_CACHE": str(tmp_path / "cache"), "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "argv-one.json").read_text()) == ["-k", "x or y", "a b", "$HOME", "*"]
    assert not (out / "argv-two.json").exists()
    assert "its words do not split (an unbalanced quote?), skipped: " in r.stdout
    assert json.loads((out / "argv-three.json").read_text()) == ["plain"]


def test_device_steps_runs_a_shell_script_step_with_out_in_its_environment(tmp_path):
    """A step "scripts/NAME.sh ARGS" runs under bash with its words as arguments, OUT and the
    carried CUTLASS headers' GEMMRL_CUTLASS_DIR in its environment, its output in its step log
    (how scripts/gpu-tests.sh runs on the device with the headers and caches the call carried)."""
    import tarfile

    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    Store(repo / "results" / "gemmrl.sqlite").close()
    (repo / "scripts" / "args.sh").write_text(
        'printf "%s|" "$@" > "$OUT/args.txt"\necho "headers at ${GEMMRL_CUTLASS_DIR:-none}"\n')
    out = tmp_path / "out"
    headers = tmp_path / "x" / "cutlass"
    (headers / "include" / "cutlass").mkdir(parents=True)
    (headers / "include" / "cutlass" / "cutlass.h").write_text("// cutlass\n")
    env = {**ENV, "STEPS": "scripts/args.sh one 'two three'", "TOTAL_S": "300",
           "GEMMRL_CACHE": str(tmp_path / "cache"), "PATH": os.environ["PATH"], "GEMMRL_CUTLASS_DIR": str(headers)}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "args.txt").read_text() == "one|two three|"
    assert "== step 0: bash scripts/args.sh one two three" in r.stdout
    with tarfile.open(out / "logs.tgz") as t:
        assert t.extractfile("logs/step-0-args.log").read().decode() == f"headers at {headers}\n"


def test_device_steps_wait_holds_a_lane_until_the_others_reach_it(tmp_path):
    """A step "wait" is a barrier: the lane goes on once every other lane has reached its own wait
    of the same number or run out of steps (the fiftieth session's call 5: lane 0's pack exported
    the store while lane 1's tune still ran); "@N wait" gives up after N s, saying so; PRE's wait
    has no lane beside it and is skipped."""
    import tarfile

    from gemmrl.store.db import Store

    repo = _steps_repo(tmp_path)
    Store(repo / "results" / "gemmrl.sqlite").close()
    # a step that takes SECONDS, then leaves NAME in OUT; and one that records which names it finds
    (repo / "scripts" / "slow.py").write_text(
        "import os, sys, time\ntime.sleep(float(sys.argv[2]))\n"
        "open(os.path.join(os.environ['OUT'], sys.argv[1]), 'w').write('x')\n")
    (repo / "scripts" / "seen.py").write_text(
        "import os, sys\nfound = [n for n in sys.argv[2:] if os.path.exists(os.path.join(os.environ['OUT'], n))]\n"
        "open(os.path.join(os.environ['OUT'], 'seen-' + sys.argv[1]), 'w').write(' '.join(found))\n")
    out = tmp_path / "out"
    env = {**ENV, "TOTAL_S": "300", "GEMMRL_CACHE": str(tmp_path / "cache"), "PATH": os.environ["PATH"],
           "STEPS_GPUS": "3", "PRE": "wait",
           # lane 0 waits twice: for lane 1's slow step, then for lane 2, which has one wait only
           "STEPS": "wait; scripts/seen.py first one two; wait; scripts/seen.py second one two three",
           "STEPS_1": "scripts/slow.py one 3; wait; scripts/slow.py three 2",
           "STEPS_2": "scripts/slow.py two 1"}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out)], capture_output=True,
                       text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "seen-first").read_text() == "one two"  # after lane 1's 3 s step and lane 2's end
    assert (out / "seen-second").read_text() == "one two three"  # lane 1's second wait, then its step
    assert "wait (step of pre): no lanes run beside it, skipped" in r.stdout
    assert "== lane 0: wait 1 for lanes 0 1 2" in r.stdout and "lane 0: wait 2 over after" in r.stdout
    with tarfile.open(out / "logs.tgz") as t:
        steps = t.extractfile("logs/steps.txt").read().decode()
    assert "gave up" not in steps
    # a capped wait gives up and its lane goes on
    out2 = tmp_path / "out2"
    env2 = {**env, "PRE": "", "STEPS": "@1 wait; scripts/seen.py capped one", "STEPS_1": "scripts/slow.py one 4",
            "STEPS_2": "", "STEPS_GPUS": "2"}
    r = subprocess.run(["bash", str(repo / "scripts" / "device-steps.sh"), str(out2)], capture_output=True,
                       text=True, env=env2, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lane 0: wait 1 gave up after 1 s (lanes 1 still running)" in r.stdout
    assert (out2 / "seen-capped").read_text() == ""
    assert (out2 / "one").exists()  # the call still waited for lane 1 to end


def test_trial_final_gap_reads_the_store(tmp_path):
    """scripts/trial-final-gap.py: each winner's latest kernel-mode time over its stored search
    time, per shape and per FLOPs bucket, from a store alone."""
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    store = Store(db)
    run = store.start_run("x", "GPU X", {}, {})
    small, large = Problem(64, 64, 64), Problem(4096, 4096, 1024)
    for p, search_us, finals in ((small, 2.0, (2.5, 2.1)), (large, 50.0, (60.0,))):
        store.put_tuning("GPU X", p, "gemmrl-tuned", b"{}", "kern_a (reward 1.2)", search_us)
        for i, us in enumerate(finals):  # the latest measurement counts
            store.record_session(run, f"s{i}", "GPU X", p, "kernel", "kernel:v1", {
                "gemmrl-tuned": {"median_us": us, "n": 10, "status": "ok"}})
    store.put_tuning("GPU X", Problem(128, 64, 64), "gemmrl-tuned", b"{}", "never timed", 1.0)  # left out
    store.close()
    out = tmp_path / "gap.csv"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "trial-final-gap.py"), "--db", str(db),
                        "--device", "GPU X", "--csv", str(out)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    assert [(row["M"], row["ratio"], row["kernel"]) for row in rows] == [("64", "1.05", "kern_a"), ("4096", "1.2", "kern_a")]
    assert "2 shapes; median final/search 1.125; 1 above 1.10" in r.stdout
    assert "2^18-2^21:    1 shapes, median 1.050, above 1.10: 0" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "trial-final-gap.py"), "--db", str(db),
                        "--device", "GPU Y"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "no tuned fp32 shape" in r.stderr


def _script(filename: str):
    """A script of scripts/ loaded as a module, for its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(filename.removesuffix(".py").replace("-", "_"),
                                                  ROOT / "scripts" / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_launch_gap_splits_a_trace_into_durations_and_gaps():
    mod = _script("launch-gap.py")
    # four calls of 5 us, 1 us apart (end to start), given out of order
    ev = [("k", 12.0, 5.0), ("k", 0.0, 5.0), ("k", 6.0, 5.0), ("k", 18.0, 5.0)]
    r = mod.split_trace(ev)
    assert r["kernels"] == 4 and r["median_duration_us"] == 5.0 and r["median_interval_us"] == 6.0
    assert r["median_gap_us"] == 1.0 and r["overlaps"] == 0 and r["gaps"] == 3
    # programmatic dependent launches: each starts 0.5 us before the previous one ends
    r = mod.split_trace([("k", 4.5 * i, 5.0) for i in range(5)])
    assert r["median_gap_us"] == -0.5 and r["overlaps"] == 4
    with pytest.raises(ValueError):
        mod.split_trace([("k", 0.0, 1.0)])


def test_launch_gap_refuses_unknown_variant_fields_and_kernel_names_before_any_gpu_work():
    for args, words in ((["--variants", "tile_m"], "--variants: fields are"),
                        (["--kernels", "sm90_nope"], "not a cutlass_sm90 kernel name")):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch-gap.py"), "--out", "x.json", *args,
                            "64x64x64"], capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 2 and words in r.stderr, r.stderr


def test_lt_host_cost_picks_the_clustered_entries_or_the_named_ones(tmp_path):
    mod = _script("lt-host-cost.py")

    def ent(m, layout, cluster):
        return {"M": m, "N": 64, "K": 64, "layout": layout, "algo": "00",
                "info": f"algo=66 tile=15 stages=35 splitk=1 cluster={cluster} (best of 8/8, ...)"}

    man = {"lt_algos": [ent(128, "NN", 3), ent(64, "TN", 2), ent(256, "TN", 5), ent(64, "NN", 3), ent(32, "NN", 0),
                        {"M": 1, "N": 1, "K": 1, "layout": "NN", "algo": "00"}]}
    got = [(e["M"], e["layout"]) for e in mod.select(man)]
    assert got == [(256, "TN"), (64, "NN"), (128, "NN")]  # 1x2x1 (5) first; 1x1x1 (2), auto (0), none: out
    assert [(e["M"], e["layout"]) for e in mod.select(man, limit=1)] == [(256, "TN")]
    named = mod.parse_shapes("64x64x64:TN, 128x64x64:NN")
    assert named == [(64, 64, 64, "TN"), (128, 64, 64, "NN")]
    assert [(e["M"], e["layout"]) for e in mod.select(man, named)] == [(64, "TN"), (128, "NN")]
    with pytest.raises(ValueError, match="no lt_algos entry in the pack for 16x64x64:NN"):
        mod.select(man, [(16, 64, 64, "NN")])
    with pytest.raises(ValueError, match="expected MxNxK:NN"):
        mod.parse_shapes("64x64x64")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(man))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-host-cost.py"), "--pack", str(tmp_path / "p"),
                        "--out", str(tmp_path / "o.json"), "--shapes", "9x9x9:NN"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "no lt_algos entry in the pack for 9x9x9:NN" in r.stderr, r.stderr


def test_nearest_loo_summarizes_by_distance_bucket():
    mod = _script("nearest-loo.py")
    rows = [{"distance": 0.2, "x": 1.10}, {"distance": 0.5, "x": 0.94}, {"distance": 0.7, "x": 0.98},
            {"distance": 1.0, "x": 1.02}, {"distance": 1.0, "x": None}, {"distance": 2.5, "x": 0.5}]
    got = mod.summarize(rows, [0, 0.5, 1.0], "x")
    assert got == [  # [0, 0.5) then [0.5, 1.0], the last bucket closed; 2.5 and None left out
        {"distance": [0, 0.5], "count": 1, "median": 1.1, "below_0.99": 0, "below_0.95": 0},
        {"distance": [0.5, 1.0], "count": 3, "median": 0.98, "below_0.99": 2, "below_0.95": 1}]


def test_transfer_report_reads_a_store(tmp_path):
    """scripts/transfer-report.py on a store with a source GPU's winners and a target's trials."""
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    s = Store(db)
    rid = s.start_run("tune", "GPU T", {}, {})
    p1, p2 = Problem(64, 64, 64), Problem(4096, 4096, 4096)
    for p, src_win, tgt_win, times in ((p1, "a", "a", {"a": 2.0, "b": 2.5}), (p2, "c", "d", {"c": 110.0, "d": 100.0})):
        s.put_tuning("GPU S", p, "gemmrl-tuned", b"{}", f"{src_win} (reward 1.0)", 1.0)
        s.put_tuning("GPU T", p, "gemmrl-tuned", b"{}", f"{tgt_win} (reward 1.0)", 1.0)
        for cand, t in times.items():
            s.record_trial(rid, "GPU T", p, cand, "ok", 1.0, t, {})
    s.record_trial(rid, "GPU T", p2, "e", "rejected", 0.0, None, {})
    s.close()
    out = tmp_path / "t.csv"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "transfer-report.py"), "--db", str(db),
                        "--source", "GPU S", "--target", "GPU T", "--csv", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 shapes tuned on GPU T" in r.stdout and "4 candidates timed" in r.stdout
    assert "winner timed there: 2; the target's final winner too: 1" in r.stdout
    assert "geomean 1.049" in r.stdout and "over 5% on 1" in r.stdout
    got = list(csv.DictReader(open(out)))
    assert [(g["M"], g["same"], g["source_winner_over_fastest"]) for g in got] == [("64", "1", "1.0"), ("4096", "0", "1.1")]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "transfer-report.py"), "--db", str(db),
                        "--source", "GPU S", "--target", "GPU T", "--run", str(rid + 1)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 1 and "no fp32 trials" in r.stderr  # another run's trials only: none


def test_product_report_splits_served_and_fallback_calls_per_session(tmp_path):
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    st = Store(tmp_path / "s.sqlite")
    run = st.start_run("gemmrl bench", "GPU X", {"driver": "1", "cuda": "13.0", "torch": "2", "commit": "abc"}, {})
    served, fallback = Problem(64, 64, 64), Problem(128, 64, 64)
    for p, ours in ((served, 8.0), (fallback, 11.0)):  # torch 10: served 1.25x, fallback 0.909x
        for mode in ("kernel", "offline"):
            st.record_session(run, f"{p.mnk}-{mode}", "GPU X", p, mode, "v3", {
                "gemmrl.matmul-nn": {"median_us": ours, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5},
                "torch.matmul@repeat": {"median_us": 10.1, "n": 5}})
    # a kernel v3 session: the paired ratios decide (1.5 and a repeat 0.2% off), not the medians
    paired = Problem(256, 64, 64)
    st.record_session(run, "p-kernel", "GPU X", paired, "kernel", "kernel:v3:ci=0.005", {
        "gemmrl.matmul-nn": {"median_us": 5.0, "n": 5, "details": {"paired": {"torch.matmul": 1.5}}},
        "torch.matmul": {"median_us": 10.0, "n": 5, "details": {"paired": {"gemmrl.matmul-nn": 1 / 1.5}}},
        "torch.matmul@repeat": {"median_us": 12.0, "n": 5, "details": {"paired": {"torch.matmul": 1 / 1.002}}}})
    # an unseen shape the run served with a neighbour's kernel (its verification says so)
    near = Problem(512, 64, 64)
    st.record_session(run, "n-kernel", "GPU X", near, "kernel", "v3", {
        "gemmrl.matmul-nn": {"median_us": 9.0, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5}})
    st.record_verification(run, "GPU X", near, "gemmrl.matmul-nn", True, "ok",
                           {"impl": {"served": {"shape": "256x64x64", "exact": False, "source_sha256": "cc"}}})
    st.record_verification(run, "GPU X", served, "gemmrl.matmul-nn", True, "ok",
                           {"impl": {"served": {"shape": "64x64x64", "exact": True, "source_sha256": "aa"}}})
    # a pack entry whose kernel failed to build in the run: the call fell back, so a fallback
    broken = Problem(1024, 64, 64)
    st.record_session(run, "b-kernel", "GPU X", broken, "kernel", "v3", {
        "gemmrl.matmul-nn": {"median_us": 10.0, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5}})
    st.record_verification(run, "GPU X", broken, "gemmrl.matmul-nn", True, "ok",
                           {"impl": {"served": {"shape": "1024x64x64", "exact": True, "source_sha256": "bb"},
                                     "failures": {"bb": "FileNotFoundError: CUTLASS headers not found"}}})
    st.close()
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"entries": [{"M": 64, "N": 64, "K": 64, "layout": "NN"},
                                                                            {"M": 256, "N": 64, "K": 64, "layout": "NN"},
                                                                            {"M": 1024, "N": 64, "K": 64, "layout": "NN"}]}))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", str(run), "--pack",
                        str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite"), "--json", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["modes"]
    assert set(res) == {"kernel", "offline"}
    k = res["kernel"]
    assert k["NN served"]["shapes"] == 2 and abs(k["NN served"]["geomean"] - (1.25 * 1.5) ** 0.5) < 1e-9
    assert k["noise"]["max |1 - r|"] < 0.011  # the paired repeat (0.2%); its median would say 20%
    assert abs(k["NN fallback"]["geomean"] - (10 / 11) ** 0.5) < 1e-9 and k["NN fallback"]["slower_than_0.99"] == 1
    assert k["NN fallback"]["min_shape"] == "128x64x64" and k["NN fallback"]["median_diff_us"] == 0.5
    assert abs(res["offline"]["NN fallback"]["geomean"] - 10 / 11) < 1e-9
    # each (shape, layout) slower than torch.matmul beyond its session's noise, in each mode
    for mode in ("kernel", "offline"):
        assert res[mode]["beyond_noise"] == [{"shape": "128x64x64", "layout": "NN", "call": "fallback",
                                              "ratio": 0.9091, "noise": 0.0099, "disputed": False}]
    assert "offline: 128x64x64 NN (fallback) at 0.9091 of torch.matmul, slower beyond the noise" in r.stdout
    assert "| kernel | NN served | torch.matmul | 2 | 1.369 |" in r.stdout
    assert k["NN neighbour"]["shapes"] == 1 and abs(k["NN neighbour"]["geomean"] - 10 / 9) < 1e-9
    assert k["NN fallback"]["shapes"] == 2  # 128x64x64 and the failed kernel's 1024x64x64; not the neighbour's
    assert "| kernel | NN neighbour | torch.matmul | 1 | 1.111 |" in r.stdout
    # each neighbour-served shape listed with what served it, at what distance, and its ratio
    (row,) = json.loads(out.read_text())["neighbours"]
    assert row["shape"] == "512x64x64" and row["neighbour"] == "256x64x64" and row["distance"] == 1.0
    assert abs(row["vs_torch"] - 10 / 9) < 1e-9 and row["layout"] == "NN" and row["mode"] == "kernel"
    assert json.loads(out.read_text())["nearest"] is None
    from gemmrl.runtime.pack import serving_digest  # what `gemmrl targets` checks the pack here against
    assert json.loads(out.read_text())["pack_digest"] == serving_digest(
        json.loads((tmp_path / "pack" / "manifest.json").read_text()))
    r2 = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", str(run), "--pack",
                         f"{tmp_path / 'pack'}@nearest=2", "--db", str(tmp_path / "s.sqlite"), "--json", str(out)],
                        capture_output=True, text=True, env=ENV, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(out.read_text())["nearest"] == 2.0 and "neighbours within 2" in r2.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", "99", "--pack",
                          str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite")],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "run 99 is not in" in bad.stderr


def test_product_report_lists_apart_pairs_timed_with_another_serving(tmp_path):
    """A pack exported again after the run: a pair the run served with a kernel the pack no longer
    serves (or with the library where the pack now has a cuBLASLt algorithm) is listed as stale,
    not judged slower beyond the noise; pairs served as the pack serves them are judged."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    st = Store(tmp_path / "s.sqlite")
    run = st.start_run("gemmrl bench", "GPU X", {"driver": "1", "cuda": "13.0", "torch": "2", "commit": "abc"}, {})
    old_kernel, lib_then, same, old_rec = Problem(64, 64, 64), Problem(128, 64, 64), Problem(256, 64, 64), Problem(512, 64, 64)
    for p in (old_kernel, lib_then, same, old_rec):  # all 0.8 of torch.matmul, far beyond the 1% noise
        st.record_session(run, f"{p.mnk}", "GPU X", p, "kernel", "v3", {
            "gemmrl.matmul-tn": {"median_us": 12.5, "n": 5}, "torch.matmul-tn": {"median_us": 10.0, "n": 5},
            "torch.matmul": {"median_us": 10.0, "n": 5}, "torch.matmul@repeat": {"median_us": 10.1, "n": 5}})
    kern = {"served": {"shape": "64x64x64", "exact": True, "source_sha256": "aa"}, "served_lt": None}
    st.record_verification(run, "GPU X", old_kernel, "gemmrl.matmul-tn", True, "ok", {"impl": kern})
    st.record_verification(run, "GPU X", lib_then, "gemmrl.matmul-tn", True, "ok",
                           {"impl": {"served": None, "served_lt": None}})
    st.record_verification(run, "GPU X", same, "gemmrl.matmul-tn", True, "ok",
                           {"impl": {"served": None, "served_lt": "42AB"}})
    st.record_verification(run, "GPU X", old_rec, "gemmrl.matmul-tn", True, "ok",
                           {"impl": {"served": None}})  # a record from before served_lt: it cannot say
    st.close()
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"entries": [], "lt_algos": [
        {"M": m, "N": 64, "K": 64, "layout": "TN", "algo": "42ab"} for m in (64, 128, 256, 512)]}))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", str(run), "--pack",
                        str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite"), "--json", str(out),
                        "--stale-shapes", str(tmp_path / "stale.txt")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    from gemmrl.core.shapes import parse_shape_file
    assert [p.shape for p in parse_shape_file(tmp_path / "stale.txt")] == ["64x64x64", "128x64x64"]
    k = json.loads(out.read_text())["modes"]["kernel"]
    assert [(b["shape"], b["timed"], b["pack"]) for b in k["stale"]] == [
        ("64x64x64", "kernel aa", "cuBLASLt algorithm 42ab"), ("128x64x64", "the library", "cuBLASLt algorithm 42ab")]
    assert {b["shape"] for b in k["beyond_noise"]} == {"256x64x64", "512x64x64"}
    # the algorithm the pack keeps, one session of it slower: disputed; 512x64x64's record cannot say what served
    assert {b["shape"]: b["disputed"] for b in k["beyond_noise"]} == {"256x64x64": True, "512x64x64": False}
    assert "256x64x64 TN (fallback) at 0.8000 of torch.matmul, slower beyond the noise" in r.stdout
    assert "; disputed: the pack keeps it on fewer than three sessions of it" in r.stdout
    assert k["TN fallback"]["shapes"] == 4  # measured ratios all stay in the stats
    assert "kernel: 64x64x64 TN timed with kernel aa (at 0.8000 of torch.matmul); the pack now serves" in r.stdout


def test_product_report_latest_prefers_the_last_session_that_served_as_the_pack_does():
    """--latest: a pair timed in its present serving by run 1, then otherwise by run 2 (a pack
    exported between the calls), is judged by run 1; a pair never timed as the pack serves it
    keeps its last session and is stale; a record that cannot say counts as served."""
    mod = _script("product-report.py")
    lib = {"torch.matmul": (10.0, {}, 0), "torch.matmul-tn": (10.0, {}, 0)}

    def t(run, nn, tn):
        return lib | {"gemmrl.matmul-nn": (nn, {}, run), "gemmrl.matmul-tn": (tn, {}, run)}
    times = {("kernel", "s1", 64, 64, 64): t(1, 8.0, 9.0), ("kernel", "s2", 64, 64, 64): t(2, 12.0, 9.5)}
    timed_by = {(1, 64, 64, 64, "NN"): ("kernel", "aa"), (2, 64, 64, 64, "NN"): ("library", None),
                (1, 64, 64, 64, "TN"): ("library", None), (2, 64, 64, 64, "TN"): ("library", None)}
    serving = {(64, 64, 64, "NN"): ("kernel", "aa"), (64, 64, 64, "TN"): ("lt", "42ab")}
    got, stale = mod.latest_as_served(times, timed_by, serving)
    assert got[("kernel", "s1", 64, 64, 64)]["gemmrl.matmul-nn"][0] == 8.0  # run 1: the kernel the pack serves
    assert "gemmrl.matmul-tn" not in got[("kernel", "s1", 64, 64, 64)]
    assert got[("kernel", "s2", 64, 64, 64)]["gemmrl.matmul-tn"][0] == 9.5  # neither served 42ab: the last
    assert "gemmrl.matmul-nn" not in got[("kernel", "s2", 64, 64, 64)]
    assert stale == {("kernel", 64, 64, 64, "TN"): (("library", None), ("lt", "42ab"))}
    got, stale = mod.latest_as_served(times, {}, serving)  # records that cannot say: the last run's
    assert stale == {} and set(got) == {("kernel", "s2", 64, 64, 64)}
    assert mod.differs(("kernel", "aa"), ("kernel", None)) is False and mod.differs(("kernel", "aa"), ("kernel", "bb"))
    assert mod.differs(("lt", "42ab"), ("library", None)) and not mod.differs(("library", None), ("library", None))


def test_product_report_takes_one_calls_lanes_together(tmp_path):
    """--run A,B: the runs of one call's lanes (a share of the shapes each) reported as one, with
    each lane's verification records; runs of two GPU models, or a bad list, refused."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    st = Store(tmp_path / "s.sqlite")
    prov = {"driver": "1", "cuda": "13.0", "torch": "2", "commit": "abc"}
    lanes = [st.start_run("gemmrl bench", "GPU X", prov, {}) for _ in range(2)]
    other = st.start_run("gemmrl bench", "GPU Y", prov, {})
    for run, p, ours in ((lanes[0], Problem(64, 64, 64), 8.0), (lanes[1], Problem(128, 64, 64), 5.0),
                         (lanes[1], Problem(256, 64, 64), 11.0)):
        st.record_session(run, f"{p.mnk}-{run}", "GPU X", p, "kernel", "v3", {
            "gemmrl.matmul-nn": {"median_us": ours, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5}})
    st.record_session(other, "y", "GPU Y", Problem(64, 64, 64), "kernel", "v3", {
        "gemmrl.matmul-nn": {"median_us": 1.0, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5}})
    # lane 1's 256x64x64 entry failed to build there: that call fell back
    st.record_verification(lanes[1], "GPU X", Problem(256, 64, 64), "gemmrl.matmul-nn", True, "ok",
                           {"impl": {"served": {"shape": "256x64x64", "exact": True, "source_sha256": "bb"},
                                     "failures": {"bb": "no build"}}})
    st.close()
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"entries": [
        {"M": m, "N": 64, "K": 64, "layout": "NN"} for m in (64, 128, 256)]}))

    def report(runs, out=None):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", runs, "--pack",
                               str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite")]
                              + (["--json", str(out)] if out else []),
                              capture_output=True, text=True, env=ENV, timeout=300)

    out = tmp_path / "r.json"
    r = report(f"{lanes[0]},{lanes[1]}", out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["run"] == lanes and f"runs {lanes[0]},{lanes[1]} on GPU X" in r.stdout
    k = d["modes"]["kernel"]
    assert k["NN served"]["shapes"] == 2 and abs(k["NN served"]["geomean"] - (1.25 * 2.0) ** 0.5) < 1e-9
    assert k["NN fallback"]["shapes"] == 1 and k["NN fallback"]["min_shape"] == "256x64x64"
    one = report(str(lanes[0]), out)
    assert one.returncode == 0 and json.loads(out.read_text())["run"] == lanes[0]
    assert json.loads(out.read_text())["modes"]["kernel"]["NN served"]["shapes"] == 1
    mixed = report(f"{lanes[0]},{other}")
    assert mixed.returncode == 2 and "different GPUs" in mixed.stderr
    assert report("1,x").returncode == 2 and "comma-separated" in report("1,x").stderr


def test_product_report_latest_keeps_the_last_run_of_each_shape(tmp_path):
    """--latest: a shape timed again by a later run (a pack exported again) counts once, at its
    last run's ratio; without it every session counts."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    st = Store(tmp_path / "s.sqlite")
    prov = {"driver": "1", "cuda": "13.0", "torch": "2", "commit": "abc", "date": "2026-11-01"}
    first, second = (st.start_run("gemmrl bench", "GPU X", prov | {"commit": c, "date": f"2026-11-0{i}"}, {})
                     for i, c in ((1, "abc"), (2, "def")))
    again, once = Problem(64, 64, 64), Problem(128, 64, 64)
    for run, p, ours in ((first, again, 12.5), (first, once, 8.0), (second, again, 9.0)):
        for mode in ("kernel", "offline"):
            st.record_session(run, f"{p.mnk}-{run}-{mode}", "GPU X", p, mode, "v3", {
                "gemmrl.matmul-nn": {"median_us": ours, "n": 5}, "torch.matmul": {"median_us": 10.0, "n": 5}})
    st.close()
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({"entries": []}))
    out = tmp_path / "r.json"

    def report(*extra):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", f"{second},{first}",
                            "--pack", str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite"), "--json", str(out),
                            *extra], capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(out.read_text())
    every = report()["modes"]["kernel"]["NN fallback"]
    assert every["shapes"] == 3 and every["slower_than_0.99"] == 1 and every["min"] == 0.8
    d = report("--latest")
    assert d["latest"] is True
    for mode in ("kernel", "offline"):
        last = d["modes"][mode]["NN fallback"]
        assert last["shapes"] == 2 and last["slower_than_0.99"] == 0  # 64x64x64 at run 2's 10/9, not run 1's 0.8
        assert abs(last["geomean"] - (10 / 9 * 10 / 8) ** 0.5) < 1e-9 and last["min_shape"] == "64x64x64"
    # the newest run's provenance, whatever the order of --run (gemmrl targets ranks reports by its date)
    assert d["provenance"]["commit"] == "def" and d["provenance"]["date"] == "2026-11-02"
    assert d["first_run_date"] == "2026-11-01"
    # --mode: one mode's grid report, the other mode's sessions of the same runs left out
    only = report("--latest", "--mode", "offline")
    assert list(only["modes"]) == ["offline"] and only["modes"]["offline"]["NN fallback"]["shapes"] == 2
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-report.py"), "--run", str(first),
                          "--pack", str(tmp_path / "pack"), "--db", str(tmp_path / "s.sqlite"), "--mode", "offline,fast"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "--mode takes" in bad.stderr


def test_autotune_check_summarizes_choices_against_the_heuristic_in_the_independent_session(tmp_path):
    """The summary is read from the CSV the GPU run writes: each choice's time over the heuristic's
    first suggestion in the independent session (geomean, worst, how many beyond 2%), picking
    rules with a margin scored from the two sessions' per-candidate times, and how often the
    picks differ."""
    import json

    path = tmp_path / "check.csv"
    rows = [  # M, N, K, layout, n, old, quick, judge, heuristic, old, quick, judge, pick_us, again_us
        (512, 1024, 8192, "NN", 5, 2, 2, 0, 100.0, 114.0, 114.0, 100.5, "0:100 1:99.5 2:98.5", "0:100 1:101 2:114"),
        (64, 64, 64, "TN", 3, 0, 0, 0, 2.0, 2.0, 2.0, 2.0, "0:2 1:3", "0:2 1:3"),
        (4096, 4096, 4096, "NN", 8, 1, 3, 1, 200.0, 190.0, 206.0, 190.0, "0:200 1:190 3:195", "0:200 1:190 3:206"),
        (128, 128, 128, "NN", 4, "", 1, 1, 3.0, "", 3.0, 3.0, "", ""),  # no stored choice, no per-candidate times
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["M", "N", "K", "layout", "n_algos", "old_index", "quick_index", "judge_index",
                    "heuristic_us", "old_us", "quick_us", "judge_us", "pick_us", "again_us", "old_info", "judge_info"])
        for r in rows:
            w.writerow([*r, "", ""])
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "autotune-check.py"), "--report", str(path)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["pairs"] == 4
    assert s["old"]["n"] == 3 and s["old"]["slower_than_1.02"] == 1 and s["old"]["faster_than_0.98"] == 1
    assert s["old"]["worst"] == {"ratio": 1.14, "shape": "512x1024x8192", "layout": "NN"}
    assert s["quick"]["slower_than_1.02"] == 2 and s["quick"]["worst"]["ratio"] == 1.14
    assert s["judge"]["slower_than_1.02"] == 0 and s["judge"]["worst"]["ratio"] == 1.005
    assert abs(s["judge"]["geomean_vs_heuristic"] - (1.005 * 0.95) ** 0.25) < 1e-4
    assert s["quick_and_judge_differ"] == 2 and s["old_and_judge_differ"] == 2
    # no margin: 512x1024x8192 takes candidate 2 (98 < 100), 1.14 in the second session
    assert s["margin:0.0"]["n"] == 3 and s["margin:0.0"]["worst"]["ratio"] == 1.14
    assert s["margin:0.0"]["not_the_first"] == 2
    # 2%: 2 is 1.5% faster: the first stays; 4096^3 takes 1 (5% faster), 0.95
    assert s["margin:0.02"]["worst"]["ratio"] == 1.0 and s["margin:0.02"]["not_the_first"] == 1
    assert s["margin:0.02"]["faster_than_0.98"] == 1
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "autotune-check.py"), "--layouts", "NT",
                          "--out", str(tmp_path / "x.csv")], capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "--layouts" in bad.stderr


def test_replay_cost_reads_repeat_pairs_from_a_store(tmp_path):
    import subprocess
    import sys

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    run = st.start_run("gemmrl bench", "GPU X", {"commit": "c0ffee"}, {})
    for i, (n1, n2) in enumerate([(8, 56), (56, 8), (12, 84), (20, 20)]):
        t = 5.0 + i

        def rec(n, extra):
            return {"median_us": t + extra, "mean_us": t + extra, "min_us": t, "p10_us": t, "p90_us": t,
                    "std_us": 0.0, "n": 40, "status": "ok", "details": {"calls_per_replay": n}}

        st.record_session(run, f"s{i}", "GPU X", Problem(128, 64 * (i + 1), 512), "kernel", "kernel:v1",
                          {"torch.matmul": rec(n1, 4.0 / n1), "torch.matmul@repeat": rec(n2, 4.0 / n2)})
    st.finish_run(run)
    st.close()
    out = tmp_path / "rc.json"
    r = subprocess.run([sys.executable, "scripts/replay-cost.py", "--db", str(db), "--json", str(out)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert "GPU X: 4 repeat pairs, fitted on 3: fixed cost 4.00 us a replay" in r.stdout
    res = json.loads(out.read_text())["GPU X"]
    assert res["beyond_tolerance"] == 3 and res["beyond_tolerance_without_it"] == 0


def test_race_bands_compares_the_race_with_the_session_before(tmp_path):
    """scripts/race-bands.py: per shape, cuBLASLt autotuned (the faster layout) over the winner in
    the race's session and in the latest earlier one, the kernels chosen in each, by FLOPs band."""
    import json as _json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    store = Store(db)
    old_run, other, race = (store.start_run("x", "GPU X", {}, {}) for _ in range(3))
    a, b = Problem(1024, 1024, 1024), Problem(4096, 4096, 128)  # 2^31 and 2^32 FLOPs

    def timed(run, p, ours, nn, tn):
        store.record_session(run, f"s{run}", "GPU X", p, "kernel", "kernel:v1", {
            "gemmrl-tuned": {"median_us": ours, "n": 10}, "cuBLASLt-auto-tuning-nn": {"median_us": nn, "n": 10},
            "cuBLASLt-auto-tuning-tn": {"median_us": tn, "n": 10}})

    def picked(run, p, name, epi):
        store.record_verification(run, "GPU X", p, "gemmrl-tuned", True, "", {
            "impl": {"chosen": {"family": "f", "name": name, "spec": {"epi_n": epi}}}})

    timed(old_run, a, 10.0, 9.0, 9.5)   # 0.90 before
    timed(other, a, 11.0, 9.9, 9.9)     # 0.90, the latest earlier session: it counts
    timed(race, a, 9.0, 9.9, 9.0)       # 1.00 now
    picked(old_run, a, "k_auto", 0)
    picked(race, a, "k_e96", 96)
    timed(old_run, b, 20.0, 19.0, 18.0)  # 0.90 before
    timed(race, b, 19.0, 19.0, 19.0)     # 1.00 now, same kernel
    picked(old_run, b, "k2", 0)
    picked(race, b, "k2", 0)
    timed(old_run, Problem(64, 64, 64), 2.0, 2.0, 2.0)  # not in the race: left out
    store.close()
    out = tmp_path / "bands.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "race-bands.py"), "--db", str(db), "--device", "gpu x",
                        "--runs", str(race), "--field", "epi_n", "--json", str(out)],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    got = _json.loads(out.read_text())
    rows = {(s["M"], s["K"]): s for s in got["shapes"]}
    assert set(rows) == {(1024, 1024), (4096, 128)}
    ra = rows[(1024, 1024)]
    assert round(ra["now"], 6) == 1.0 and round(ra["before"], 6) == 0.9 and ra["before_run"] == other
    assert (ra["kernel_before"], ra["kernel"], ra["changed"], ra["won_by_field"]) == ("k_auto", "k_e96", True, True)
    rb = rows[(4096, 128)]
    assert (rb["changed"], rb["won_by_field"]) == (False, False) and round(rb["before"], 6) == 0.9
    total = got["bands"][-1]
    assert (total["flops"], total["shapes"], total["changed"], total["won_by_field"], total["at_or_above_1"]) == \
        ("all", 2, 1, 1, 2)
    assert [b["flops"] for b in got["bands"]] == ["2^31", "2^32", "all"]
    assert "| 2^31 | 1 | 1 | 1 | 1.000 | 0.900 | 1 |" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "race-bands.py"), "--db", str(db), "--device", "GPU X",
                        "--runs", "99"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "timed no gemmrl-tuned" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "race-bands.py"), "--db", str(db), "--device", "GPU X",
                        "--runs", "a,b"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "--runs takes run ids" in r.stderr


def test_epi_price_fit_recovers_the_prices_a_race_log_was_made_with(tmp_path):
    """scripts/epi-price-fit.py: race log lines whose wider twins were timed with known per-store,
    per-stage and fixed prices give those prices back; the prior picks the twin only where it
    pays, a held-out log is fitted apart, and a log with no epi race says so."""
    from dataclasses import replace

    from gemmrl.core.problem import Problem
    from gemmrl.space import cutlass_sm90 as cs

    store_us, stage_us, fixed_us = 0.05, 0.3, 0.7
    base = cs.CutlassSpec(128, 192, 64, 2, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "TN", "fp16", "fp32")
    small = cs.CutlassSpec(64, 256, 64, 1, 1, "pingpong", "persistent", 1, 0, "heuristic", 1, "NN", "fp16", "fp32")

    def line(p, spec, widths, t0=50.0):
        w = -(-p.M // spec.tile_m) * -(-p.N // spec.tile_n)
        w = -(-w // (cs.SMS - cs.SMS % (spec.cluster_m * spec.cluster_n)))
        items = [f"{spec.name}={t0:.3f}"]
        for e in widths:
            s = replace(spec, epi_n=e)
            saved = (store_us * w * (cs.epilogue_stores(spec) - cs.epilogue_stores(s))
                     - stage_us * w * (cs.pipeline_stages(spec) - cs.pipeline_stages(s)) - fixed_us)
            items.append(f"{s.name}={t0 - saved:.3f}")
        return f"{p.shape} candidates (median us): " + ", ".join(items) + "\n"

    shapes = [Problem(16384, 8192, 64), Problem(8192, 8192, 128), Problem(1024, 2048, 256),
              Problem(16384, 16384, 256), Problem(4096, 4096, 512), Problem(2048, 1024, 128)]
    log = tmp_path / "race.log"
    log.write_text("run 1: noise\n" + "".join(line(p, base, (64, 96, 192)) for p in shapes)
                   + "".join(line(p, small, (64, 128)) for p in shapes[:3])
                   + "64x64x64 candidates (median us): raw_nn_fp16_16x32x128_w1x2_s4_k1=3.0\n")
    held = tmp_path / "held.log"
    held.write_text("".join(line(p, base, (96,)) for p in (Problem(12288, 8192, 64), Problem(512, 512, 128))))
    out = tmp_path / "fit.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "epi-price-fit.py"), str(log),
                        "--holdout-from", str(held), "--json", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["pairs"] == 6 * 3 + 3 * 2 + 2 and d["shapes"] == 8
    assert d["fit"] == pytest.approx({"store_us": store_us, "stage_us": stage_us, "fixed_us": fixed_us}, abs=2e-3)
    assert d["pick_fit"]["saved_us"] == pytest.approx(d["pick_fit"]["best_us"], abs=0.1)  # exact prices pick the best
    assert 0 < d["pick_fit"]["twin_taken"] < 8  # one-wave shapes keep the automatic subtile
    assert d["holdout"]["fit_on_first"]["store_us"] == pytest.approx(store_us, abs=2e-3)
    assert d["module"]["store_us"] == cs.EPI_STORE_US
    empty = tmp_path / "none.log"
    empty.write_text("nothing raced\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "epi-price-fit.py"), str(empty)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 1 and "no epi race lines" in r.stderr


def test_stale_shapes_lists_what_a_retime_should_take(tmp_path):
    """scripts/stale-shapes.py: a shape is stale in a mode where its latest session of the winner
    timed another kernel, ran under an older protocol than asked, predates a winner stored
    without a verification to compare, or does not exist; fresh ones are left out; --lanes
    splits every Nth by FLOPs."""
    import sqlite3
    import time as _time

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    same, changed, old_proto, unverified, never = (Problem(m, 64, 64) for m in (64, 128, 256, 512, 1024))
    for p in (same, changed, old_proto, unverified, never):
        st.put_tuning(dev, p, "gemmrl-tuned", b"{}", f"k_{p.M} (best of 2/2)", 1.0)
    run = st.start_run("gemmrl bench", dev, {}, {})
    for p, proto, timed in ((same, "offline:v3:ci=0.005", "k_64"), (changed, "offline:v3:ci=0.005", "k_old"),
                            (old_proto, "offline:v2", "k_256")):
        st.record_session(run, f"s{p.M}", dev, p, "offline", proto, {"gemmrl-tuned": {"median_us": 5.0, "n": 5}})
        st.record_verification(run, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": {"name": timed}}})
    st.record_session(run, "s512", dev, unverified, "offline", "offline:v3", {"gemmrl-tuned": {"median_us": 5.0, "n": 5}})
    st.finish_run(run)
    _time.sleep(0.01)
    st.put_tuning(dev, unverified, "gemmrl-tuned", b'{"k": "512b"}', "k_512b (best of 2/2)", 1.0)  # a new winner since
    st.close()
    c = sqlite3.connect(db)  # the run took 8 s over its 4 shapes: 2 s a shape
    c.execute("UPDATE runs SET finished = started + 8 WHERE id=?", (run,))
    c.commit()
    c.close()

    def stale(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db),
                               "--device", "H200", "--mode", "offline", *args],
                              capture_output=True, text=True, env=ENV, timeout=300)

    out = tmp_path / "lists" / "r.txt"  # a directory not made yet: made
    r = stale("--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "3 stale shapes" in r.stdout and "at the 2.0 s a shape" in r.stdout
    assert [l for l in out.read_text().splitlines() if not l.startswith("#")] == ["128x64x64", "512x64x64", "1024x64x64"]
    r = stale("--protocol", "offline:v3", "--out", str(out), "--lanes", "2")
    assert r.returncode == 0, r.stderr
    assert "4 stale shapes" in r.stdout and "1 protocol offline:v2" in r.stdout and "1 winner changed" in r.stdout
    lanes = [[l for l in (out.parent / f"r-l{i}.txt").read_text().splitlines() if not l.startswith("#")] for i in (0, 1)]
    assert lanes == [["128x64x64", "512x64x64"], ["256x64x64", "1024x64x64"]]
    assert [l for l in out.read_text().splitlines() if not l.startswith("#")] == [
        "128x64x64", "256x64x64", "512x64x64", "1024x64x64"]  # all of them too: the build step's list
    assert stale("--protocol", "server:v5").returncode == 2
    # nothing stale (no fp16 winners): the lists an earlier call left at OUT go, so that a bench after it
    # cannot time them again (2026-11-30: `stale-shapes --out F; bench --shapes F` in one device call)
    keep = out.parent / "r-keep.txt"
    keep.write_text("64x64x64\n")
    r = stale("--acc", "fp16", "--out", str(out), "--lanes", "2")
    assert r.returncode == 0, r.stderr
    assert "0 stale shapes" in r.stdout and "removed the earlier lists" in r.stdout
    assert not out.exists() and not list(out.parent.glob("r-l*.txt")) and keep.exists()
    r = stale("--acc", "fp16", "--out", str(out))
    assert r.returncode == 0 and f"nothing to write to {out}\n" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db),
                        "--device", "H200", "--mode", "server"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and "5 stale shapes (no finished run timed server mode alone" in r.stdout


def _stale_offline(db, *args):
    """scripts/stale-shapes.py on the H200's offline sessions in store `db`."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db),
                           "--device", "H200", "--mode", "offline", *args],
                          capture_output=True, text=True, env=ENV, timeout=300)


def _listed(path):
    """A shape file's shapes, its comment lines left out."""
    return [l for l in path.read_text().splitlines() if not l.startswith("#")]


def _three_winner_specs():
    """A persistent CUTLASS TN spec, a persistent CUTLASS NN spec and a raw TN spec: the winners
    the stale-shapes tests store."""
    from gemmrl.core.problem import Problem
    from gemmrl.space import cutlass_sm90, raw

    persistent = [next(s for s in cutlass_sm90.heuristic_specs(Problem(256, 1024, 512), lay) if s.scheduler == "persistent")
                  for lay in ("TN", "NN")]
    return persistent[0], persistent[1], raw.heuristic_specs(Problem(64, 1024, 4096), "TN")[0]


def _skip_without_build_keys():
    """Skip where a CUTLASS build key cannot be computed here: it names the headers and nvcc."""
    try:
        from gemmrl.build.cutlass import cutlass_include_dirs
        cutlass_include_dirs()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no CUTLASS headers: {e}")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")


def _store_timed_runs(db, runs):
    """A store at `db` with one finished H200 run per (command, acc, mode, protocol, shapes, seconds):
    a session of gemmrl-tuned (and its tuning) on each of `shapes` shapes (64*i x 64 x 64), the run
    `seconds` long."""
    import sqlite3

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    st = Store(db)
    dev = "NVIDIA H200"
    made = []
    for command, acc, mode, proto, shapes, secs in runs:
        run = st.start_run(command, dev, {}, {})
        for i in range(shapes):
            p = Problem(64 * (i + 1), 64, 64, acc=acc)
            st.put_tuning(dev, p, "gemmrl-tuned", b"{}", f"k_{i}", 1.0)
            st.record_session(run, f"s{run}-{i}", dev, p, mode, proto, {"gemmrl-tuned": {"median_us": 5.0, "n": 5}})
        st.finish_run(run)
        made.append((run, secs))
    st.close()
    c = sqlite3.connect(db)
    for run, secs in made:
        c.execute("UPDATE runs SET finished = started + ? WHERE id=?", (secs, run))
    c.commit()
    c.close()


def test_stale_shapes_prices_a_retime_from_runs_of_its_accumulator_and_protocol(tmp_path):
    """The cost estimate takes the seconds a shape of recent runs of the same accumulator and
    protocol where there are any (H200, 2026-11-30: fp16 offline ran 6.0 s a shape, the fp32 runs
    the estimate read 4.2; old precision-target server runs 13 s, --quick ones 1.5), else of any."""
    db = tmp_path / "s.sqlite"
    _store_timed_runs(db, [("gemmrl bench", acc, mode, proto, 4, secs)  # 4 shapes: secs / 4 a shape
                           for acc, mode, proto, secs in (
                               ("fp32", "offline", "offline:v3:ci=0.005", 8), ("fp16", "offline", "offline:v3:ci=0.005", 24),
                               ("fp16", "server", "server:v5:ci=0.005:qps=1000", 52),
                               ("fp16", "server", "server:v2:qps=1000:gaps=round", 4))])

    def cost(*args):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db),
                            "--device", "H200", *args], capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "at the 2.0 s a shape" in cost("--mode", "offline", "--protocol", "offline:v4")  # fp32; v4: none of its own
    assert "at the 6.0 s a shape" in cost("--mode", "offline", "--acc", "fp16")
    assert "at the 1.0 s a shape" in cost("--mode", "server", "--acc", "fp16", "--protocol", "server:v2")
    assert "at the 7.0 s a shape" in cost("--mode", "server", "--acc", "fp16")  # both protocols: their median
    assert "at the 7.0 s a shape" in cost("--mode", "server")  # no fp32 server run: any accumulator's


def test_stale_shapes_prices_a_retime_as_a_start_plus_seconds_a_shape(tmp_path):
    """Runs of different sizes: the line through (shapes, seconds) gives a start and seconds a
    shape, where a median of each run's seconds a shape would read the small runs' start as
    per-shape time (2026-11-30: 14.8 s a shape for 392 fp16 kernel-mode shapes, from 3-6 shape
    settles, where a 253-shape bench had run 1.3 s a shape); tune runs, whose wall time holds a
    search, do not count."""
    db = tmp_path / "s.sqlite"
    _store_timed_runs(db, [(command, "fp32", "kernel", "kernel:v3:ci=0.005", shapes, secs) for command, shapes, secs in (
        ("gemmrl bench", 100, 150), ("gemmrl bench", 2, 30), ("gemmrl bench", 2, 30), ("gemmrl tune", 10, 900))])
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db), "--device", "H200",
                        "--mode", "kernel", "--protocol", "kernel:v4"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    # slope 7840 / 6402.7 = 1.22 s a shape, start 70 - 1.2245 * 34.67 = 27.5 s; 100 stale shapes: 150 s
    assert "100 stale shapes, about 2.5 GPU-minutes at the 1.2 s a shape and 28 s to start" in r.stdout, r.stdout


def test_stale_shapes_builds_finds_sessions_of_another_build_of_the_winner(tmp_path, monkeypatch):
    """scripts/stale-shapes.py --builds: a session whose run verified the winner under another
    build key than its source makes now is stale ("another build"), e.g. a plain CUTLASS build
    timed before the entry-point cache became the default; GEMMRL_CUTLASS_ENTRY_CACHE=0 turns the
    verdict round. Without --builds, or where the verification recorded no key, it is not."""
    import json

    from gemmrl.build.ahead import job_for
    from gemmrl.build.nvcc import cache_entry
    from gemmrl.core.problem import Problem
    from gemmrl.space import cutlass_sm90
    from gemmrl.store.db import Store

    _skip_without_build_keys()

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    shapes = {"plain": Problem(256, 1024, 512), "cached": Problem(512, 1024, 512), "unkeyed": Problem(1024, 1024, 512)}
    spec = next(s for s in cutlass_sm90.heuristic_specs(shapes["plain"], "TN") if s.scheduler == "persistent")

    def key(p, entry_cache):
        monkeypatch.setenv(cutlass_sm90.ENTRY_CACHE_ENV, "1" if entry_cache else "0")
        job = job_for(spec, p)
        monkeypatch.delenv(cutlass_sm90.ENTRY_CACHE_ENV)
        return cache_entry(job.source, name=job.name, **job.kwargs).name.rsplit("-", 1)[1]

    run = st.start_run("gemmrl bench", dev, {}, {})
    for what, p in shapes.items():
        st.put_tuning(dev, p, "gemmrl-tuned", json.dumps({"family": "cutlass_sm90", "spec": dict(spec.__dict__)}).encode(),
                      f"{spec.name} (best of 2/2)", 1.0)
        st.record_session(run, f"s{p.M}", dev, p, "offline", "offline:v3", {"gemmrl-tuned": {"median_us": 5.0, "n": 5}})
        chosen = {"name": spec.name}
        if what != "unkeyed":
            chosen["build"] = {"key": key(p, what == "cached")}
        st.record_verification(run, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": chosen}})
    st.finish_run(run)
    st.close()
    assert key(shapes["plain"], False) != key(shapes["plain"], True)

    def stale(*args, plain=False):
        env = {**ENV, cutlass_sm90.ENTRY_CACHE_ENV: "0"} if plain else {
            k: v for k, v in ENV.items() if k != cutlass_sm90.ENTRY_CACHE_ENV}
        out = tmp_path / "r.txt"
        out.unlink(missing_ok=True)
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stale-shapes.py"), "--db", str(db),
                            "--device", "H200", "--mode", "offline", "--out", str(out), *args],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout, [l for l in out.read_text().splitlines() if not l.startswith("#")] if out.exists() else []

    text, listed = stale()
    assert "0 stale shapes" in text and listed == []
    text, listed = stale("--builds")
    assert "1 stale shapes" in text and "1 another build" in text and listed == ["256x1024x512"]
    text, listed = stale("--builds", plain=True)
    assert "1 another build" in text and listed == ["512x1024x512"]


def test_stale_shapes_top_kernels_keeps_the_shapes_one_build_wave_serves(tmp_path):
    """scripts/stale-shapes.py --top-kernels K: OUT (and its lanes) keeps the stale shapes whose
    winner's build is one of the K builds serving the most of them; the rest go to OUT's stem
    -rest. A generic CUTLASS spec is one build for all its shapes; a raw kernel is one a shape."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    common, other, rw = _three_winner_specs()

    def win(p, fam, spec):
        st.put_tuning(dev, p, "gemmrl-tuned", json.dumps({"family": fam, "spec": dict(spec.__dict__)}).encode(),
                      f"{spec.name} (best of 2/2)", 1.0)
    for m in (256, 512, 1024):  # three shapes, one build
        win(Problem(m, 1024, 512), "cutlass_sm90", common)
    win(Problem(2048, 1024, 512), "cutlass_sm90", other)
    win(Problem(64, 1024, 4096), "raw", rw)
    win(Problem(128, 1024, 4096), "raw", rw)  # the same raw spec, another shape: another build
    st.close()

    def stale(*args):
        return _stale_offline(db, *args)

    shapes = _listed
    out = tmp_path / "r.txt"
    r = stale("--out", str(out), "--top-kernels", "1", "--lanes", "2")
    assert r.returncode == 0, r.stderr
    assert "the 1 builds serving the most of them (of 4) serve 3; 3 left for later" in r.stdout
    assert shapes(out) == ["256x1024x512", "512x1024x512", "1024x1024x512"]
    assert shapes(tmp_path / "r-l0.txt") == ["256x1024x512", "1024x1024x512"]
    assert sorted(shapes(tmp_path / "r-rest.txt")) == ["128x1024x4096", "2048x1024x512", "64x1024x4096"]
    r = stale("--out", str(out), "--top-kernels", "9")
    assert r.returncode == 0 and "(of 4) serve 6; 0 left" in r.stdout and len(shapes(out)) == 6
    assert not (tmp_path / "r-rest.txt").exists()  # the first split's rest is gone
    assert stale("--top-kernels", "2").returncode == 2  # needs --out


def test_stale_shapes_built_in_keeps_the_shapes_a_carried_cache_serves(tmp_path):
    """scripts/stale-shapes.py --built-in CACHE: OUT (and its lanes) keeps the stale shapes, smallest
    first, whose winner's build is finished in CACHE (a cache root or a tarball of one); OUT's
    stem -unbuilt lists the rest. A build directory without its kernel.so (a compile cut short)
    does not count; nor does another build of the same spec (another shape's raw kernel)."""
    import json
    import tarfile

    from gemmrl.build.ahead import entries, job_for
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    _skip_without_build_keys()

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    tn, nn, rw = _three_winner_specs()
    wins = [(Problem(1024, 1024, 512), "cutlass_sm90", tn), (Problem(256, 1024, 512), "cutlass_sm90", tn),
            (Problem(2048, 1024, 512), "cutlass_sm90", nn), (Problem(64, 1024, 4096), "raw", rw),
            (Problem(128, 1024, 4096), "raw", rw)]
    for p, fam, spec in wins:
        st.put_tuning(dev, p, "gemmrl-tuned", json.dumps({"family": fam, "spec": dict(spec.__dict__)}).encode(),
                      f"{spec.name} (best of 2/2)", 1.0)
    st.close()
    entry = {(p.M, p.N, p.K): entries([job_for(spec, p)])[0] for p, _, spec in wins}
    cache = tmp_path / "cache"
    for shape, done in (((256, 1024, 512), True), ((64, 1024, 4096), True), ((2048, 1024, 512), False)):
        d = cache / entry[shape]
        d.mkdir(parents=True)
        (d / ("kernel.so" if done else "build.log")).write_text("x")
    (cache / "builds" / ".tmp-half").mkdir()
    tarball = tmp_path / "back.txz"
    with tarfile.open(tarball, "w:xz") as t:
        t.add(cache / "builds", arcname="builds")

    def stale(*args):
        return _stale_offline(db, *args)

    shapes = _listed
    out = tmp_path / "r.txt"
    for where in (cache, tarball):
        r = stale("--out", str(out), "--built-in", str(where), "--lanes", "2")
        assert r.returncode == 0, r.stderr
        assert f"3 of them have their winner's build in {where} (2 builds); 2 do not" in r.stdout, r.stdout
        # the TN spec serves 256x1024x512 and 1024x1024x512 with one build; the raw build is 64x1024x4096's alone
        assert shapes(out) == ["256x1024x512", "64x1024x4096", "1024x1024x512"]  # by FLOPs
        assert shapes(tmp_path / "r-l1.txt") == ["64x1024x4096"]
        assert shapes(tmp_path / "r-unbuilt.txt") == ["128x1024x4096", "2048x1024x512"]
    # every build there: nothing unbuilt, and the earlier split's -unbuilt file is gone
    for shape in ((2048, 1024, 512), (128, 1024, 4096)):
        (cache / entry[shape]).mkdir(parents=True, exist_ok=True)
        (cache / entry[shape] / "kernel.so").write_text("x")
    r = stale("--out", str(out), "--built-in", str(cache))
    assert r.returncode == 0 and "5 of them have their winner's build" in r.stdout and len(shapes(out)) == 5
    assert not (tmp_path / "r-unbuilt.txt").exists()
    for bad in (["--built-in", str(cache)],  # needs --out
                ["--out", str(out), "--built-in", str(cache / "builds")],  # not the cache's root
                ["--out", str(out), "--built-in", str(tmp_path / "none.txz")],
                ["--out", str(out), "--built-in", str(db)],  # not a tarball
                ["--out", str(out), "--built-in", str(cache), "--top-kernels", "1"]):
        r = stale(*bad)
        assert r.returncode == 2, (bad, r.stdout)


def test_lt_tiles_turns_cublaslt_choices_into_our_orientation_and_checks_the_pool(tmp_path):
    """scripts/lt-tiles.py: cuBLAS's m x n tile lies n along our M and m along our N; its twin is
    our swapped kernel of tile m x n. Groups the losing shapes' choices by that output tile."""
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    lt = _script("lt-tiles.py")
    c = lt.parse_info("algo=66 tile=29 stages=35 splitk=1 reduction=0 swizzle=0 custom=1 inner=0 cluster=3 (best of 8/8)")
    assert c == {"tile": (128, 160), "tile_id": 29, "splitk": 1, "cluster": (2, 1)}
    pool = lt.pool_tiles("NN")
    # 128x160 over (N, M): the swapped 128x160 kernel and the plain 160-row one (not a wgmma tile)
    assert lt.ours(c, pool) == {"over_mn": "160x128", "swapped": True, "plain": False}
    assert lt.ours(lt.parse_info("tile=20 splitk=2 cluster=5"), pool)["plain"] is True
    assert lt.ours(lt.parse_info("tile=201 splitk=1 cluster=5"), pool) == {"over_mn": "tile 201", "swapped": None,
                                                                          "plain": None}
    assert lt.parse_info("heuristic") is None

    st = Store(tmp_path / "s.sqlite")
    dev = "NVIDIA H100 80GB HBM3"
    big, small, fine = Problem(16384, 4096, 2048), Problem(1024, 64, 8192), Problem(4096, 4096, 4096)
    for p, nn, tn in ((big, "tile=29 splitk=1 cluster=3", "tile=197 splitk=1 cluster=5"),
                      (small, "tile=13 splitk=4 cluster=3", "tile=13 splitk=4 cluster=3"),
                      (fine, "tile=20 splitk=1 cluster=3", "tile=20 splitk=1 cluster=3")):
        st.put_tuning(dev, p, "cuBLASLt-auto-tuning-nn", b"\0" * 64, "algo=66 " + nn, 10.0)
        st.put_tuning(dev, p, "cuBLASLt-auto-tuning-tn", b"\0" * 64, "algo=66 " + tn, 10.0)
    st.close()
    rows = [{"mnk": "16384_4096_2048", "cuBLASLt-auto-tuning-max": "0.893"},
            {"mnk": "1024_64_8192", "cuBLASLt-auto-tuning-max": "0.955"},
            {"mnk": "4096_4096_4096", "cuBLASLt-auto-tuning-max": "1.010"},
            {"mnk": "64_64_64", "cuBLASLt-auto-tuning-max": ""}]
    with open(tmp_path / "k.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["mnk", "cuBLASLt-auto-tuning-max"])
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "r.json"
    # the tile numbers past CUDA 11's 35 come from cublasLt.h (--header; by default where the
    # cuBLAS baseline's build finds it)
    header = tmp_path / "cublasLt.h"
    header.write_text("  CUBLASLT_MATMUL_TILE_64x32 = 13,\n  CUBLASLT_MATMUL_TILE_168x128 = 197,\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-tiles.py"), "--csv", str(tmp_path / "k.csv"),
                        "--device", "H100", "--db", str(tmp_path / "s.sqlite"), "--json", str(out),
                        "--header", str(header)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 shapes below 0.98" in r.stdout and "4 (shape, layout) autotuned choices" in r.stdout
    assert f"tiles from {header}" in r.stdout
    got = json.loads(out.read_text())["rows"]
    assert [(x["shape"], x["layout"], x["over_mn"], x["plain"]) for x in got] == [
        ("16384x4096x2048", "NN", "160x128", False), ("16384x4096x2048", "TN", "128x168", False),
        ("1024x64x8192", "NN", "32x64", False), ("1024x64x8192", "TN", "32x64", False)]
    for bad_header, why in ((tmp_path / "none.h", "no such file"), (tmp_path / "k.csv", "not cublasLt.h")):
        refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-tiles.py"), "--csv",
                                  str(tmp_path / "k.csv"), "--device", "H100", "--db", str(tmp_path / "s.sqlite"),
                                  "--header", str(bad_header)], capture_output=True, text=True, env=ENV, timeout=300)
        assert refused.returncode == 2 and why in refused.stderr
    # the most frequent group first: 32x64 over (M, N) with split-K 4, twice
    assert r.stdout.splitlines()[3].startswith("| 32x64 | 4 | 2 |")
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-tiles.py"), "--csv", str(tmp_path / "nope.csv"),
                          "--device", "H100", "--db", str(tmp_path / "s.sqlite")],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_protocol_gap_names_kernels_companies_and_neighbours():
    mod = _script("protocol-gap.py")
    name = "sm90_pp_128x144x64_c2x1_persist_s0_rh_sw1_tn_f16_f32"
    spec = mod.kernel_spec(name)
    assert spec.name == name and spec.layout == "TN"
    for bad in ("not_a_kernel", name + "_x"):
        with pytest.raises(ValueError):
            mod.kernel_spec(bad)
    fns = {name: 1, "other": 2, "cuBLASLt-auto-tuning-nn": 3, "cuBLASLt-auto-tuning-tn": 4, "cuBLAS-nn": 5}
    assert set(mod.company_calls(fns, [name, "other"], "alone")) == {name, "other"}
    assert set(mod.company_calls(fns, [name], "with-lt")) == {name, "cuBLASLt-auto-tuning-nn",
                                                             "cuBLASLt-auto-tuning-tn"}
    assert set(mod.company_calls(fns, [name], "with-all")) == set(fns)
    # each replay with the one before it in its round; a round's first has none
    trace = [(0, "a", 10.0), (0, "b", 11.0), (0, "c", 12.0), (1, "c", 12.5), (1, "a", 10.5)]
    assert mod.neighbours(trace) == [(0, "a", 10.0, None), (0, "b", 11.0, "a"), (0, "c", 12.0, "b"),
                                     (1, "c", 12.5, None), (1, "a", 10.5, "c")]


def test_protocol_gap_samples_the_clock_while_a_timing_runs():
    """ClockSampler reads (SM clock, power) on a thread until the with-block ends; the summary
    is the clock's median, lowest and highest and the median power in watts, unreadable samples
    (pynvml missing) left out; a reader that raises gives no sample and stops nothing."""
    import time as _time

    mod = _script("protocol-gap.py")
    assert mod.clock_summary([(1980, 690000), (1500, 700000), (1700, "n/a")]) == {
        "samples": 3, "sm_mhz_median": 1700, "sm_mhz_min": 1500, "sm_mhz_max": 1980, "power_w_median": 695.0}
    assert mod.clock_summary([]) == {"samples": 0}
    readings = iter([(1980, 650000), (1400, 700000)] + [(1600, 690000)] * 10000)
    with mod.ClockSampler(period_s=0.001, read=lambda: next(readings)) as c:
        _time.sleep(0.05)
    n = len(c.samples)
    assert n >= 3 and c.samples[:2] == [(1980, 650000), (1400, 700000)]
    _time.sleep(0.02)
    assert len(c.samples) == n  # stopped with the block
    assert c.summary()["sm_mhz_min"] == 1400 and c.summary()["sm_mhz_max"] == 1980

    def broken():
        raise RuntimeError("no NVML")

    with mod.ClockSampler(period_s=0.001, read=broken) as c:
        _time.sleep(0.01)
    assert c.summary() == {"samples": 0}
    # the host modes are protocols too, timed with time_host rather than time_kernel
    assert {"offline", "server"} <= set(mod.PROTOCOLS) and set(mod.HOST_PROTOCOLS) == {"offline", "server"}


def test_protocol_gap_refuses_bad_arguments_before_any_gpu_work():
    script = str(ROOT / "scripts" / "protocol-gap.py")
    for extra in (["--protocols", "v9"], ["--companies", "crowd"], ["--kernel", "sm90_nonsense"],
                  ["--repeats", "0"]):
        r = subprocess.run([sys.executable, script, "--out", "x.json", *extra, "256x256x256"],
                           capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 2, (extra, r.stderr)
        assert extra[1] in r.stderr or "repeats" in r.stderr


def test_protocol_gap_report_reads_the_traces(tmp_path):
    mod = _script("protocol-gap.py")

    def rec(impl, times, company="alone"):
        return {"shape": "64x64x64", "acc": "fp32", "repeat": 0, "protocol": "v3", "company": company,
                "impl": impl, "trace": [[i, impl, t, None] for i, t in enumerate(times)]}

    ref = "sm90_pp_128x160x64_c1x1_persist_s0_rh_sw2_tn_f16_f32"
    # the 144 kernel runs 3% ahead of the reference, then 20% behind it in the last 3 of 5 rounds
    records = [rec(ref, [100.0] * 5), rec("k144", [97.0, 97.0, 120.0, 120.0, 120.0]),
               rec(ref, [50.0] * 2, "with-all"), rec("cuBLAS-nn", [49.0, 49.0], "with-all")]
    rows = mod.ratio_rows(records, "128x160x64_c1x1_persist_s0_rh_sw2")
    assert [(r["company"], r["impl"], r["rounds"]) for r in rows] == [("alone", "k144", 5), ("with-all", "cuBLAS-nn", 2)]
    assert rows[0]["median_ratio"] == pytest.approx(1.2) and rows[0]["share_slow"] == pytest.approx(0.6)
    assert rows[1]["median_ratio"] == pytest.approx(0.98) and rows[1]["share_slow"] == 0
    with pytest.raises(ValueError, match="0 implementations match"):
        mod.ratio_rows(records, "nothing-like-it")
    path = tmp_path / "gap.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"records": records}, f)
    script = str(ROOT / "scripts" / "protocol-gap.py")
    r = subprocess.run([sys.executable, script, "--report", str(path), "--ref", "c1x1_persist_s0_rh_sw2"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 64x64x64 | 0 | v3 | alone | k144 | 5 | 1.200 | 60% |" in r.stdout
    for extra in (["--report", str(path)], ["--report", str(path), "--ref", "absent"], []):
        r = subprocess.run([sys.executable, script, *extra], capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 2, (extra, r.stderr)


def test_product_untimed_lists_the_grid_shapes_a_cut_run_left(tmp_path):
    """scripts/product-untimed.py: a shape is timed in a mode when both product layouts have an ok
    session there in a run after --after on the device; the rest are written in the file's order.
    A failed layout, another mode, another device and older runs do not count."""
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    both = {"gemmrl.matmul-nn": {"median_us": 5.0, "n": 5}, "gemmrl.matmul-tn": {"median_us": 5.0, "n": 5}}
    old = st.start_run("gemmrl bench", h200, {}, {})
    st.record_session(old, "a", h200, Problem(64, 64, 64), "server", "server:v5", both)  # before --after
    st.finish_run(old)
    run = st.start_run("gemmrl bench", h200, {}, {})
    st.record_session(run, "b", h200, Problem(128, 64, 64), "server", "server:v5", both)
    st.record_session(run, "c", h200, Problem(256, 64, 64), "server", "server:v5",
                      {"gemmrl.matmul-nn": both["gemmrl.matmul-nn"],
                       "gemmrl.matmul-tn": {"median_us": None, "n": 0, "status": "failed"}})
    st.record_session(run, "d", h200, Problem(512, 64, 64), "offline", "offline:v2", both)
    st.finish_run(run)
    other = st.start_run("gemmrl bench", h100, {}, {})
    st.record_session(other, "e", h100, Problem(1024, 64, 64), "server", "server:v5", both)
    st.finish_run(other)
    st.close()
    shapes = tmp_path / "g.txt"
    shapes.write_text("# grid\n1024x64x64\n64x64x64\n128x64x64\n256x64x64\n512x64x64\n")
    out = tmp_path / "left.txt"

    def left(*args):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-untimed.py"), "--db", str(db),
                            "--shapes", str(shapes), "--out", str(out), *args],
                           capture_output=True, text=True, env=ENV, timeout=300)
        return r, [l for l in out.read_text().splitlines() if not l.startswith("#")] if out.exists() else None

    r, got = left("--device", "H200", "--mode", "server", "--after", str(old))
    assert r.returncode == 0, r.stderr
    assert got == ["1024x64x64", "64x64x64", "256x64x64", "512x64x64"] and "4 of 5 shapes left" in r.stdout
    r, got = left("--device", "H200", "--mode", "server")  # every run counts
    assert got == ["1024x64x64", "256x64x64", "512x64x64"]
    r, got = left("--device", "H200", "--mode", "offline", "--after", str(old))
    assert got == ["1024x64x64", "64x64x64", "128x64x64", "256x64x64"]
    r, got = left("--device", "H100", "--mode", "server")
    assert got == ["64x64x64", "128x64x64", "256x64x64", "512x64x64"]
    r, _ = left("--device", "NVIDIA", "--mode", "server")
    assert r.returncode != 0 and "several GPUs" in r.stderr
    shapes.write_text("64x64\n")
    r, _ = left("--device", "H200", "--mode", "server")
    assert r.returncode != 0 and "not an MxNxK shape" in r.stderr


def test_mode_transfer_gives_each_pairs_medians_by_bucket_and_mode(tmp_path):
    """scripts/mode-transfer.py: from the speedup CSVs of one GPU's reports, the median of each
    pair's ratio per FLOPs bucket and mode (a baseline over another: the quotient of gemmrl-tuned's
    speedups over them), and of each shape's host-mode ratio over its kernel-mode one; a shape a
    mode lacks is left out there."""
    d = tmp_path / "results" / "h200"
    d.mkdir(parents=True)
    cols = ["mnk", "cuBLASLt-auto-tuning-max", "cuBLASLt-auto-tuning-nn", "cuBLASLt-heuristic-nn",
            "cuBLASLt-auto-tuning-tn", "cuBLASLt-heuristic-tn"]
    # gemmrl-tuned over each baseline; autotuned NN over heuristic NN = heur / auto
    rows = {"kernel": [["8192_8192_8192", "0.99", "0.99", "1.0296", "1.0", "1.0"],   # 2^40: auto 1.04x heur
                       ["4096_8192_8192", "0.97", "0.97", "1.0088", "1.0", "1.0"],   # 2^39: 1.04
                       ["64_64_64", "1.3", "1.3", "1.3", "1.3", "1.3"]],             # 2^19
            "server": [["8192_8192_8192", "0.95", "1.0", "1.01", "1.0", "1.0"],      # auto 1.01x heur
                       ["64_64_64", "1.2", "1.2", "1.2", "1.2", "1.2"]]}
    for mode, rs in rows.items():
        with open(d / f"gemmrl-tuned_h200_F32F16F16F32_speedup_{mode}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            w.writerows(rs)
    (d / "gemmrl-tuned_h200_F32F16F16F32_summary.json").write_text(json.dumps(
        {"provenance": {"device": "NVIDIA H200", "driver": "580", "cuda": "13.0", "torch": "2.11", "commit": "abc",
                        "date": "2026-11-27", "runs": [1, 2]}}))
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mode-transfer.py"), "--device", "H200", "--results",
                        str(tmp_path / "results"), "--json", str(out)], capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["provenance"] == {"device": "NVIDIA H200", "driver": "580", "cuda": "13.0", "torch": "2.11",
                                 "commit": "abc", "date": "2026-11-27"}  # the reports', without their run list
    assert doc["command"].startswith("python3 scripts/mode-transfer.py --device H200")
    res = doc["pairs"]
    ours, lt = res["gemmrl-tuned / cuBLASLt-auto-tuning-max"], res["cuBLASLt-auto-tuning-nn / cuBLASLt-heuristic-nn"]
    assert set(ours) == {"2^18-2^21", "2^39-2^42"}
    big = ours["2^39-2^42"]
    assert big["shapes"] == 2 and big["kernel"] == pytest.approx(0.98) and big["server"] == 0.95
    assert big["offline"] is None and big["server/kernel"] == pytest.approx(0.95 / 0.99, abs=1e-4)
    assert lt["2^39-2^42"]["kernel"] == pytest.approx(1.04, abs=1e-4) and lt["2^39-2^42"]["server"] == 1.01
    assert ours["2^18-2^21"]["server/kernel"] == pytest.approx(1.2 / 1.3, abs=1e-4)
    assert "| 2^39-2^42 | 2 | 0.980 |  | 0.950 |  | 0.960 |" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mode-transfer.py"), "--device", "H100", "--results",
                        str(tmp_path / "results")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode != 0 and "no kernel-mode report" in r.stderr


def test_protocol_gap_clock_report_compares_speeds_per_protocol(tmp_path):
    """--report --clocks: per shape and protocol the SM clock and power while timed, and each
    implementation's speed relative to the reference, the median over the repeats of ratios taken
    within each repeat (server mode by the means)."""
    mod = _script("protocol-gap.py")

    def rec(impl, protocol, repeat, median, mean=None, mhz=1410, watts=650.0):
        return {"shape": "8192x8192x8192", "acc": "fp32", "repeat": repeat, "protocol": protocol,
                "company": "with-all", "impl": impl, "median_us": median, "mean_us": mean or median,
                "gpu_during": {"sm_mhz_median": mhz, "power_w_median": watts}}

    records = [rec("torch.matmul", "v3", 0, 1700.0), rec("gemmrl-tuned", "v3", 0, 1600.0),
               rec("torch.matmul", "v3", 1, 1710.0, mhz=1420), rec("gemmrl-tuned", "v3", 1, 1650.0, mhz=1420),
               # server mode by the means: ours 2% behind at a higher clock
               rec("torch.matmul", "server", 0, 1400.0, 1500.0, mhz=1900),
               rec("gemmrl-tuned", "server", 0, 1390.0, 1530.0, mhz=1900)]
    rows = {r["protocol"]: r for r in mod.clock_rows(records, "torch.matmul")}
    assert rows["v3"]["sm_mhz"] == 1415 and rows["v3"]["repeats"] == 2
    assert rows["v3"]["speed"]["gemmrl-tuned"] == pytest.approx(statistics.median([1700 / 1600, 1710 / 1650]))
    assert rows["server"]["speed"]["gemmrl-tuned"] == pytest.approx(1500 / 1530)
    assert rows["server"]["sm_mhz"] == 1900 and rows["server"]["power_w"] == 650.0
    with pytest.raises(ValueError, match="0 implementations match"):
        mod.clock_rows(records, "cuBLAS")
    path = tmp_path / "modes.json"
    path.write_text(json.dumps({"records": records}))
    script = str(ROOT / "scripts" / "protocol-gap.py")
    r = subprocess.run([sys.executable, script, "--report", str(path), "--ref", "torch.matmul", "--clocks"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 8192x8192x8192:fp32 | server | with-all | 1900 | 650 | 0.980 |" in r.stdout


class _FakeGemmrl:
    """Stands in for `python3 -m gemmrl.cli`: each `pack --changed-shapes F` writes the next of
    the scripted change lists to F; every command is recorded."""

    def __init__(self, changes, fail=None):
        self.changes, self.calls, self.fail = list(changes), [], fail or {}

    def __call__(self, argv, label):
        self.calls.append((label, argv))
        if argv[0] == "pack":
            shapes = self.changes.pop(0)
            path = Path(argv[argv.index("--changed-shapes") + 1])
            path.write_text("# changed\n" + "".join(s + "\n" for s in shapes))
        return self.fail.get(label, 0)


def test_product_settle_times_the_changed_shapes_until_an_export_changes_nothing(tmp_path):
    """scripts/product-settle.py: export, time the changed shapes through gemmrl.matmul in every
    mode (--quick in the host modes, --gpus when asked), export again; settled when an export
    changes nothing."""
    mod = _script("product-settle.py")
    fake = _FakeGemmrl([["64x64x64", "128x64x4096"], ["128x64x4096"], []])
    got = mod.settle(fake, device="H200", acc="fp16", pack="packs/p", db="s.sqlite", work=str(tmp_path), gpus=4,
                     log=lambda *_: None)
    assert got["settled"] and got["stopped"] is None
    assert [r["shapes"] for r in got["rounds"]] == [["64x64x64", "128x64x4096"], ["128x64x4096"]]
    assert [label for label, _ in fake.calls] == [
        "export 0", "build 0", "bench 0 kernel", "bench 0 offline", "bench 0 server",
        "export 1", "build 1", "bench 1 kernel", "bench 1 offline", "bench 1 server", "export 2"]
    export = dict(fake.calls)["export 0"]
    assert export[:7] == ["pack", "--device", "H200", "--acc", "fp16", "--out", "packs/p"]
    kernel, server = dict(fake.calls)["bench 1 kernel"], dict(fake.calls)["bench 1 server"]
    assert kernel[kernel.index("--shapes") + 1] == str(tmp_path / "changed-1.txt")
    # each round compiles only the kernels serving its shapes, not the whole pack's
    assert dict(fake.calls)["build 1"] == ["build", "--pack", "packs/p", "--shapes", str(tmp_path / "changed-1.txt")]
    for argv in (kernel, server):
        assert {"--impl", "torch.matmul", "pack:packs/p", "--retime", "--subject", "gemmrl.matmul-nn"} <= set(argv)
        assert argv[argv.index("--gpus") + 1] == "4" and argv[argv.index("--acc") + 1] == "fp16"
    assert "--quick" in server and "--quick" not in kernel


def test_product_settle_of_a_bf16_pack_exports_and_times_bf16(tmp_path):
    """--dtype bf16 (the first bf16 pack, 2026-12-01): the export and every bench name the input type,
    the fp16 commands stay as they were, the runs are read back for that type alone, and a pack of
    another input type or accumulator than asked is refused before any GPU work."""
    import sqlite3

    mod = _script("product-settle.py")
    fake = _FakeGemmrl([["64x64x64"], []])
    got = mod.settle(fake, device="H200", acc="fp32", pack="packs/b", db="s.sqlite", work=str(tmp_path),
                     log=lambda *_: None, dtype="bf16")
    assert got["settled"]
    calls = dict(fake.calls)
    for label in ("export 0", "bench 0 kernel", "bench 0 server", "export 1"):
        argv = calls[label]
        assert argv[argv.index("--dtype") + 1] == "bf16", (label, argv)
    assert "--dtype" not in mod.bench_argv("f", "kernel", "fp32", "p", "s", "o")  # fp16: as before
    db = tmp_path / "s.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE measurements (run_id INT, mode TEXT, acc TEXT, dtype TEXT, impl TEXT)")
    con.executemany("INSERT INTO measurements VALUES (?, ?, ?, ?, ?)", [
        (5, "kernel", "fp32", "fp16", "gemmrl.matmul-nn"), (6, "kernel", "fp32", "bf16", "gemmrl.matmul-nn"),
        (7, "offline", "fp32", "bf16", "gemmrl.matmul-tn"), (8, "kernel", "fp32", "bf16", "torch.matmul")])
    con.commit()
    con.close()
    assert mod.runs_by_mode(str(db), 0, "fp32", "bf16") == {"kernel": [6], "offline": [7]}
    assert mod.runs_by_mode(str(db), 0, "fp32") == {"kernel": [5]}
    pack = tmp_path / "pk"
    pack.mkdir()
    (pack / "manifest.json").write_text(json.dumps({"dtype": "bf16", "acc": "fp32", "entries": []}))
    for args, bad in ((["--acc", "fp32"], "not --dtype fp16 --acc fp32"),
                      (["--acc", "fp16", "--dtype", "bf16"], "not --dtype bf16 --acc fp16")):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "product-settle.py"), "--device", "H200", "--db",
                            str(db), "--pack", str(pack), *args], capture_output=True, text=True)
        assert r.returncode == 2 and "a pack of bf16 inputs with an fp32 accumulator" in r.stderr and bad in r.stderr, \
            r.stderr


def test_product_settle_keeps_each_packs_shape_files_apart(tmp_path):
    """Two settles side by side (one lane per accumulator) must not share a changed-shapes file: with
    one settle-logs/ the fp32 export overwrote the fp16 round's list between its kernel and offline
    benches (2026-11-30, sixtieth session). Under a device call's OUT the logs go to OUT/logs."""
    mod = _script("product-settle.py")
    a = mod.logs_dir("packs/h200-fp16-F32F16F16F32")
    b = mod.logs_dir("packs/h200-fp16-F16F16F16F16/")
    assert a != b and a.parent == b.parent == Path("settle-logs")
    assert mod.logs_dir("packs/x", str(tmp_path)) == tmp_path / "logs" / "settle-x"
    # the rounds of two packs write their files each in its own directory
    for pack in ("packs/p32", "packs/p16"):
        fake = _FakeGemmrl([["64x64x64"], []])
        mod.logs_dir(pack, str(tmp_path)).mkdir(parents=True)  # made by the Runner outside the test
        mod.settle(fake, device="H200", acc="fp16", pack=pack, db="s", work=str(mod.logs_dir(pack, str(tmp_path))),
                   log=lambda *_: None)
        kernel = dict(fake.calls)["bench 0 kernel"]
        assert kernel[kernel.index("--shapes") + 1] == str(tmp_path / "logs" / f"settle-{pack[6:]}" / "changed-0.txt")


def test_product_settle_leaves_out_changed_shapes_already_timed_as_served(tmp_path):
    """An export compares with the pack in the working tree (the committed one); shapes a carried
    delta's settle already timed as the new pack serves them are not timed again: the round times
    the rest from a file of its own, and a round left with none goes on to the next export."""
    mod = _script("product-settle.py")
    asked = []

    def already(shapes, modes):
        asked.append((list(shapes), list(modes)))
        return {"64x64x64", "128x64x4096"} & set(shapes)

    fake = _FakeGemmrl([["64x64x64", "128x64x4096", "256x64x4096"], ["128x64x4096"], []])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), modes=("kernel", "server"),
                     log=lambda *_: None, already=already)
    assert got["settled"] and [r["shapes"] for r in got["rounds"]] == [["256x64x4096"]]
    assert asked == [(["64x64x64", "128x64x4096", "256x64x4096"], ["kernel", "server"]), (["128x64x4096"], ["kernel", "server"])]
    assert [label for label, _ in fake.calls] == ["export 0", "build 0", "bench 0 kernel", "bench 0 server",
                                                  "export 1", "export 2"]
    kernel = dict(fake.calls)["bench 0 kernel"]
    left = Path(kernel[kernel.index("--shapes") + 1])
    assert left.name == "changed-0-untimed.txt" and left.read_text() == "256x64x4096\n"
    assert dict(fake.calls)["build 0"][-1] == str(left)
    # the given shapes of round 0 are timed as given, and the disputed rounds are not filtered
    given = tmp_path / "given.txt"
    given.write_text("64x64x64\n")
    fake = _FakeGemmrl([[]])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), shapes=str(given),
                     modes=("kernel",), log=lambda *_: None, already=lambda *a: {"64x64x64"})
    assert got["settled"] and got["rounds"][0]["shapes"] == ["64x64x64"]
    # the last round's changes all timed already: said, not called settled without an export
    fake = _FakeGemmrl([["64x64x64"], ["64x64x64"]])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), rounds=1,
                     modes=("kernel",), log=lambda *_: None, already=lambda sh, m: set(sh))
    assert not got["settled"] and got["stopped"] == "1 rounds timed; the last export's changes were timed already"
    assert [label for label, _ in fake.calls] == ["export 0", "export 1"]


def test_timed_as_served_reads_what_served_each_product_session(tmp_path):
    """timed_as_served: a shape counts once every asked mode has, for both layouts, an ok product
    session on the device whose verification says it served as the pack does now (its kernel's
    source, its cuBLASLt algorithm, or the library); another kernel, a record that cannot say,
    another device, accumulator or a missing layout leave it to be timed."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    mod = _script("product-settle.py")
    st = Store(tmp_path / "s.sqlite")
    prov = {"driver": "1", "cuda": "13.0", "torch": "2", "commit": "abc"}
    run = st.start_run("gemmrl bench", "GPU X", prov, {})
    other = st.start_run("gemmrl bench", "GPU Y", prov, {})
    shapes = {n: Problem(n, 64, 4096, acc="fp16") for n in (64, 128, 256, 512, 1024)}

    def session(r, p, mode, layouts=("NN", "TN"), device="GPU X"):
        calls = {"torch.matmul": {"median_us": 10.0, "n": 5}, "torch.matmul-tn": {"median_us": 10.0, "n": 5}}
        calls.update({f"gemmrl.matmul-{lay.lower()}": {"median_us": 9.0, "n": 5} for lay in layouts})
        st.record_session(r, f"{p.mnk}-{mode}-{r}", device, p, mode, "v3", calls)

    def served(r, p, impl, sha=None, lt=None, device="GPU X", say=True):
        d = {"served": {"shape": p.shape, "exact": True, "source_sha256": sha} if sha else None}
        if say:
            d["served_lt"] = lt
        elif not sha:
            d = {"served": None}
        st.record_verification(r, device, p, impl, True, "ok", {"impl": d})

    for mode in ("kernel", "server"):
        for n in (64, 128, 256, 512):
            session(run, shapes[n], mode, layouts=("NN",) if n == 512 else ("NN", "TN"))
        session(other, shapes[1024], mode, device="GPU Y")
    served(run, shapes[64], "gemmrl.matmul-nn", sha="aa")             # the pack's kernel
    served(run, shapes[64], "gemmrl.matmul-tn", lt="42AB")            # its algorithm (case aside)
    served(run, shapes[128], "gemmrl.matmul-nn", sha="old")           # a kernel the pack no longer ships
    served(run, shapes[128], "gemmrl.matmul-tn", lt=None)
    served(run, shapes[256], "gemmrl.matmul-nn", say=False)           # cannot say what served
    served(run, shapes[256], "gemmrl.matmul-tn", lt=None)
    served(run, shapes[512], "gemmrl.matmul-nn", lt=None)             # TN never timed
    served(other, shapes[1024], "gemmrl.matmul-nn", lt=None, device="GPU Y")
    served(other, shapes[1024], "gemmrl.matmul-tn", lt=None, device="GPU Y")
    later = st.start_run("gemmrl bench", "GPU X", prov, {})  # a later run that served 64x64x4096 otherwise
    session(later, shapes[64], "kernel")
    served(later, shapes[64], "gemmrl.matmul-nn", sha="old")
    served(later, shapes[64], "gemmrl.matmul-tn", lt=None)
    st.close()
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "manifest.json").write_text(json.dumps({
        "entries": [{"M": n, "N": 64, "K": 4096, "layout": "NN", "source_sha256": "aa"} for n in (64, 128)],
        "lt_algos": [{"M": 64, "N": 64, "K": 4096, "layout": "TN", "algo": "42ab"}]}))
    names = [p.shape for p in shapes.values()]
    db = str(tmp_path / "s.sqlite")
    used = set()
    assert mod.timed_as_served(db, str(pack), "GPU X", "fp16", "fp16", names, ("kernel", "server"), used) == {"64x64x4096"}
    assert used == {run}  # the run whose sessions stand for it (not the later one), for the report's run list
    assert mod.timed_as_served(db, str(pack), "GPU X", "fp16", "fp16", names, ("kernel", "offline")) == set()
    assert mod.timed_as_served(db, str(pack), "GPU X", "fp32", "fp16", names, ("kernel",)) == set()
    assert mod.timed_as_served(db, str(pack), "GPU Y", "fp16", "fp16", names, ("kernel",)) == {"1024x64x4096"}


def test_product_settle_starts_from_given_shapes_and_stops_at_rounds_deadline_or_failure(tmp_path):
    mod = _script("product-settle.py")
    given = tmp_path / "given.txt"
    given.write_text("# from an export elsewhere\n256x256x256\n")
    fake = _FakeGemmrl([["64x64x64"], ["64x64x64"]])
    got = mod.settle(fake, device="H200", acc="fp32", pack="p", db="s", work=str(tmp_path), shapes=str(given),
                     rounds=2, modes=("kernel",), log=lambda *_: None)
    # round 0 times the given shapes without an export; after two rounds the third export still changed one
    assert [label for label, _ in fake.calls] == ["build 0", "bench 0 kernel", "export 1", "build 1",
                                                  "bench 1 kernel", "export 2"]
    assert not got["settled"] and got["stopped"].startswith("2 rounds timed; the last export changed 1")
    assert got["rounds"][0]["shapes"] == ["256x256x256"] and got["rounds"][-1]["benches"] == {}

    now = [0.0]

    def clock():
        now[0] += 50.0  # every look at the clock: 50 s later
        return now[0]

    fake = _FakeGemmrl([["64x64x64"], []])
    got = mod.settle(fake, device="H200", acc="fp32", pack="p", db="s", work=str(tmp_path), deadline_s=120,
                     bench_s=300, clock=clock, log=lambda *_: None)
    assert not got["settled"] and got["stopped"].startswith("deadline")
    benches = [argv for label, argv in fake.calls if label.startswith("bench")]
    assert all(float(a[a.index("--budget-s") + 1]) <= 110 for a in benches)  # never past the deadline

    fake = _FakeGemmrl([["64x64x64"]], fail={"bench 0 offline": 1})
    got = mod.settle(fake, device="H200", acc="fp32", pack="p", db="s", work=str(tmp_path), log=lambda *_: None)
    assert got["stopped"].startswith("a bench of round 0 failed") and not got["settled"]


def test_product_settle_times_disputed_shapes_again_before_it_calls_the_pack_settled(tmp_path):
    """When an export changes nothing but the pack still serves a kernel whose newest product
    session ran slower than torch.matmul beyond the noise, that shape is timed again, in the
    disputed mode only, before the pack counts as settled (H200, 2026-11-27: 512x512x4096 TN)."""
    mod = _script("product-settle.py")
    asked = []
    answers = [[(512, 512, 4096, "TN", "kernel"), (64, 64, 64, "NN", "kernel")], []]

    def disputes():
        asked.append(1)
        return answers.pop(0)

    fake = _FakeGemmrl([["128x64x4096"], [], []])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), log=lambda *_: None,
                     disputes=disputes)
    assert got["settled"] and len(asked) == 2
    assert [label for label, _ in fake.calls] == [
        "export 0", "build 0", "bench 0 kernel", "bench 0 offline", "bench 0 server",
        "export 1", "build 1", "bench 1 kernel", "export 2"]
    assert got["rounds"][1] == {"shapes": ["64x64x64", "512x512x4096"], "file": str(tmp_path / "disputed-1.txt"),
                                "benches": {"kernel": 0}, "disputed": True}
    assert (tmp_path / "disputed-1.txt").read_text() == "64x64x64\n512x512x4096\n"
    # disputes that outlast the rounds: not settled, and said so
    fake = _FakeGemmrl([[], []])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), rounds=1,
                     log=lambda *_: None, disputes=lambda: [(512, 512, 4096, "TN", "server")])
    assert not got["settled"] and got["stopped"] == "1 rounds timed; the last export left disputed 1 shapes"
    assert [label for label, _ in fake.calls] == ["export 0", "build 0", "bench 0 server", "export 1"]


def test_product_settle_by_default_times_the_fallback_of_a_disputed_kernel_the_export_dropped(tmp_path):
    """The fifty-seventh session's settle, as it ran (H200, runs 760-767): the given shapes timed,
    an export that changed two, a disputed kernel timed a third time, an export that dropped it;
    with the old default of three rounds the loop stopped there, the fallback untimed, with half its
    deadline left. The default rounds now reach the export that finds the pack settled."""
    mod = _script("product-settle.py")
    given = tmp_path / "given.txt"
    given.write_text("128x512x4096\n1024x256x4096\n")
    answers = [[(128, 512, 4096, "TN", "kernel")], []]
    fake = _FakeGemmrl([["128x512x4096", "1024x256x4096"], [], ["128x512x4096"], []])
    got = mod.settle(fake, device="H200", acc="fp16", pack="p", db="s", work=str(tmp_path), shapes=str(given),
                     log=lambda *_: None, disputes=lambda: answers.pop(0))
    assert got["settled"] and got["stopped"] is None
    assert [r["shapes"] for r in got["rounds"]] == [
        ["128x512x4096", "1024x256x4096"], ["128x512x4096", "1024x256x4096"], ["128x512x4096"], ["128x512x4096"]]
    assert [r.get("disputed", False) for r in got["rounds"]] == [False, False, True, False]
    assert [label for label, _ in fake.calls][-5:] == [
        "build 3", "bench 3 kernel", "bench 3 offline", "bench 3 server", "export 4"]


def test_product_settle_names_the_runs_of_each_mode_and_refuses_bad_arguments(tmp_path):
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    mod = _script("product-settle.py")
    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    both = {"gemmrl.matmul-nn": {"median_us": 5.0, "n": 5}, "gemmrl.matmul-tn": {"median_us": 5.0, "n": 5},
            "torch.matmul": {"median_us": 5.0, "n": 5}}
    ids = []
    for mode in ("kernel", "server", "kernel"):
        run = st.start_run("gemmrl bench", dev, {}, {})
        st.record_session(run, f"s{run}", dev, Problem(64, 64, 64, "fp16", "fp16"), mode, f"{mode}:v2", both)
        st.finish_run(run)
        ids.append(run)
    base = st.start_run("gemmrl bench", dev, {}, {})  # baselines only: not a product run
    st.record_session(base, "b", dev, Problem(64, 64, 64, "fp16", "fp16"), "kernel", "kernel:v3",
                      {"torch.matmul": {"median_us": 5.0, "n": 5}})
    st.finish_run(base)
    st.close()
    assert mod.runs_by_mode(str(db), ids[0], "fp16") == {"server": [ids[1]], "kernel": [ids[2]]}
    assert mod.runs_by_mode(str(db), 0, "fp32") == {}
    # the disputes a settle asks for: none here (no session says which kernel served), by a part of the name
    manifest = tmp_path / "m"
    manifest.mkdir()
    (manifest / "manifest.json").write_text(json.dumps({"dtype": "fp16", "acc": "fp16", "entries": [
        {"M": 64, "N": 64, "K": 64, "layout": "NN", "source_sha256": "x"}], "lt_algos": []}))
    assert mod.pack_disputes(str(db), str(manifest), "h200", 3) == []
    pack = tmp_path / "pack"
    pack.mkdir()
    script = str(ROOT / "scripts" / "product-settle.py")
    for extra in (["--pack", str(pack)],  # no manifest.json
                  ["--pack", str(ROOT / "packs" / "h200-fp16-F32F16F16F32"), "--modes", "kernel,warm"],
                  ["--pack", str(ROOT / "packs" / "h200-fp16-F32F16F16F32"), "--rounds", "0"]):
        r = subprocess.run([sys.executable, script, "--device", "H200", "--db", str(db), *extra],
                           capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode == 2, (extra, r.stderr)


def test_sample_efficiency_curves_and_the_exact_random_expectation():
    import itertools

    mod = _script("sample-efficiency.py")
    assert mod.best_so_far([0.5, 0.9, 0.7], 5) == [0.5, 0.9, 0.9, 0.9, 0.9]
    assert mod.to_reach([0.5, 0.9, 0.95], 0.95) == 3 and mod.to_reach([0.5], 0.95) is None
    vals = [0.2, 0.0, 1.1, 0.7, 0.9]
    for n in range(1, 6):  # the exact expectation against every order of the pool
        brute = statistics.fmean(max(p[:n]) for p in itertools.permutations(vals))
        assert mod.random_expected_best(vals, 5)[n - 1] == pytest.approx(brute)
    assert mod.random_expected_best(vals, 7)[-1] == pytest.approx(1.1)  # past the pool: its best
    a, b, c = (64, 64, 64, "fp16", "fp32"), (128, 128, 128, "fp16", "fp32"), (256, 256, 256, "fp16", "fp32")
    sweep = {a: [0.5, 1.0, 0.8, 0.0], b: [0.9, 1.2], c: [0.0, 0.0]}  # c: nothing passed, left out
    mf = {a: [1.0, 0.5], b: [0.6, 1.32], c: [0.1]}
    got = mod.study(sweep, {"model-free": mf})
    assert got["shapes"] == 2 and got["n_max"] == 2
    rows = {(r["policy"], r["candidates"]): r for r in got["rows"]}
    assert rows[("model-free", 1)]["mean_fraction"] == pytest.approx((1.0 + 0.5) / 2)
    assert rows[("model-free", 2)]["mean_fraction"] == pytest.approx((1.0 + 1.1) / 2)  # b beyond the sweep
    assert rows[("model-free", 2)]["within_1pct"] == 1.0 and rows[("model-free", 1)]["within_5pct"] == 0.5
    assert rows[("random (expected)", 1)]["mean_fraction"] == pytest.approx(
        (statistics.fmean(sweep[a]) / 1.0 + statistics.fmean(sweep[b]) / 1.2) / 2)
    assert got["reach"]["model-free"]["to_95pct"] == {"median": 1.5, "shapes_reached": 2, "shapes": 2}
    assert got["policies"]["model-free"] == {"candidates_total": 4, "beyond_sweep": 1}
    assert got["sweep"]["candidates_mean"] == 3.0
    with pytest.raises(ValueError, match="no shape"):
        mod.study({c: [0.0]}, {"model-free": mf})


def test_sample_efficiency_keeps_apart_the_kernels_the_sweep_never_timed():
    """A --built-only policy run where more kernels were built than the sweep's: its trials of
    those are counted and left out of its sweep's-kernels-only curve; the same kernel timed by
    both gives the two sessions' noise."""
    mod = _script("sample-efficiency.py")
    a, b = (64, 64, 64, "fp16", "fp32"), (128, 128, 128, "fp16", "fp32")
    sweep = {a: [("k1", 0.5), ("k2", 1.0)], b: [("k1", 0.8), ("k3", 0.0)]}
    mf = {a: [("k2", 1.1), ("x", 1.3), ("k1", 0.5)], b: [("k3", 0.9), ("k1", 0.8)]}
    kept, outside = mod.within_sweep(sweep, mf)
    assert outside == 1 and kept == {a: [1.1, 0.5], b: [0.9, 0.8]}
    noise = mod.session_noise(sweep, mf)  # k3 failed in the sweep: no ratio from it
    assert noise["pairs"] == 3 and noise["median"] == pytest.approx(1.0)
    assert mod.session_noise(sweep, {a: [("x", 1.0)]}) is None
    assert mod.within_sweep(sweep, {b: [("k1", 0.7)]}) == ({b: [0.7]}, 0)


def test_sample_efficiency_reads_the_study_stores_and_writes_its_files(tmp_path):
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    dev = "NVIDIA H200"
    p = Problem(256, 256, 1024)

    def store(path, rewards):
        st = Store(path)
        run = st.start_run("gemmrl tune", dev, {}, {})
        st.record_session(run, "b", dev, p, "kernel", "kernel:v3", {"torch.matmul": {"median_us": 5.0, "n": 5}})
        for i, r in enumerate(rewards):
            st.record_trial(run, dev, p, f"k{i}", "ok" if r is not None else "wrong", r or 0.0,
                            5.0 / r if r else None, {})
        st.finish_run(run)
        st.close()

    store(tmp_path / "sweep.sqlite", [0.8, None, 1.25, 1.0])
    store(tmp_path / "mf.sqlite", [1.0, 1.25, None, None, 1.5])  # k4: a kernel the sweep never timed
    out = tmp_path / "o"
    out.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sample-efficiency.py"), "--sweep",
                        str(tmp_path / "sweep.sqlite"), "--policy", f"model-free={tmp_path / 'mf.sqlite'}",
                        "--device", "h200", "--csv", str(out / "e.csv"), "--json", str(out / "e.json"),
                        "--png", str(out / "e.png")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "model-free: 95% of the sweep's best after 2 candidates" in r.stdout
    assert "model-free: 1 of 5 trials timed kernels the sweep did not" in r.stdout
    lines = (out / "e.csv").read_text().splitlines()
    assert lines[0] == "policy,candidates,mean_fraction,within_1pct,within_5pct"
    assert "model-free,1,0.8,0.0,0.0" in lines and "model-free,2,1.0,1.0,1.0" in lines
    assert "model-free,5,1.2,1.0,1.0" in lines  # k4, past the sweep's best
    # over the sweep's kernels only (k0-k3): k0 0.8, k1 1.0, then two failures
    assert "model-free (sweep's kernels only),4,1.0,1.0,1.0" in lines
    doc = json.loads((out / "e.json").read_text())
    assert doc["device"] == dev and doc["shapes"] == 1 and doc["sweep"]["candidates_total"] == 4
    mf = doc["policies"]["model-free"]
    assert mf["outside_sweep_trials"] == 1 and mf["beyond_sweep"] == 1
    # k0 1.0 / 0.8; k1 failed in the sweep, k2 and k3 in the policy's store: one pair
    assert mf["same_kernel_vs_sweep"] == {"pairs": 1, "median": 1.25, "p10": 1.25, "p90": 1.25}
    assert doc["provenance"]["sweep"][0]["device"] == dev and "model-free" in doc["provenance"]
    assert (out / "e.png").stat().st_size > 1000
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sample-efficiency.py"), "--sweep",
                        str(tmp_path / "sweep.sqlite"), "--policy", "model-free", "--device", "h200"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "NAME=DB" in r.stderr


def test_burst_only_lists_shapes_whose_burst_only_kernel_reads_over_the_final_ratio(tmp_path):
    """scripts/burst-only.py: shapes below the ratio whose burst-only kernel (never timed beside
    the baseline) read more than the margin over the final ratio, largest gap first."""
    from gemmrl.core.problem import Problem
    from gemmrl.search.policy import Candidate, Trial
    from gemmrl.space import cutlass_sm90
    from gemmrl.store.db import Store

    pick = _script("burst-only.py").pick
    bursts = {"1_1_1": 1.10, "2_2_2": 0.93, "3_3_3": 1.30}
    rows = [("1_1_1", 0.90, 0.92), ("2_2_2", 0.90, 0.91), ("3_3_3", 1.01, 1.0), ("4_4_4", 0.8, 0.8),
            ("5_5_5", None, None)]
    assert pick(rows, bursts.get, 1.0, 0.03) == [("1_1_1", 0.90, 0.92, 1.10)]  # 2: too little; 3: not below
    assert [r[0] for r in pick(rows, bursts.get, 1.05, 0.03)] == ["3_3_3", "1_1_1"]  # 0.30 over, then 0.18
    assert pick(rows, bursts.get, 1.0, 0.2) == []

    db = tmp_path / "s.sqlite"
    store = Store(db)
    dev = "NVIDIA H100 80GB HBM3"
    run = store.start_run("x", dev, {}, {})
    p, q = Problem(4096, 4096, 1024), Problem(2048, 2048, 512)
    specs = cutlass_sm90.heuristic_specs(p, "NN")[:3]
    ref = {"reference": {"impl": "cuBLASLt-auto-tuning-nn", "session_us": 100.0}}
    for prob, i, reward, details in ((p, 0, 1.2, {}), (p, 1, 0.95, ref), (q, 2, 1.3, {})):  # q: no trial beside
        t = Trial(prob, Candidate("cutlass_sm90", specs[i]), "ok", 10.0, reward, dict(details))
        store.record_trial(run, dev, prob, t.candidate.name, t.status, t.reward, t.time_us, t.to_dict())
    store.put_tuning(dev, p, "gemmrl-tuned", b"{}", specs[1].name, 10.0)
    store.close()
    report = tmp_path / "k.csv"
    report.write_text("mnk,cuBLASLt-auto-tuning-max,best-baseline\n4096_4096_1024,0.95,0.95\n2048_2048_512,0.9,0.9\n")
    out = tmp_path / "shapes.txt"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "burst-only.py"), "--db", str(db), "--device", "H100",
                        "--csv", str(report), "--out", str(out)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# NVIDIA H100 80GB HBM3 fp32: 1 shapes below 1.0") and lines[1:] == ["4096x4096x1024"]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "burst-only.py"), "--db", str(db), "--device", "H200",
                        "--csv", str(report)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "no tuned shapes on 'H200'" in r.stderr
    # without --csv: the report of the GPU's slug under --results ('NVIDIA H100 80GB HBM3' -> h100/)
    (tmp_path / "res" / "h100").mkdir(parents=True)
    report.rename(tmp_path / "res" / "h100" / "gemmrl-tuned_h100_F32F16F16F32_speedup_kernel.csv")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "burst-only.py"), "--db", str(db), "--device", "H100",
                        "--results", str(tmp_path / "res")], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and "1 shapes" in r.stdout, r.stderr


def test_lt_untried_lists_the_shapes_in_a_ratio_band_whose_seeds_are_not_all_tried(tmp_path):
    """scripts/lt-untried.py: a shape is listed where its report ratio lies in [low, high) and one of
    its cuBLASLt-tile seeds has no trial on the device; lowest ratio first; --parts slices it."""
    from gemmrl.core.problem import Problem
    from gemmrl.runtime.pack import LT_IMPL
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    info = "algo=66 tile=29 stages=35 splitk=1 reduction=0 swizzle=0 custom=1 inner=0 cluster=3"
    shapes = {"open": Problem(16384, 4096, 4096), "half": Problem(8192, 4096, 4096),
              "done": Problem(4096, 4096, 4096), "above": Problem(2048, 4096, 4096),
              "no_choice": Problem(1024, 4096, 4096)}
    for name, p in shapes.items():
        if name != "no_choice":
            st.put_tuning(dev, p, LT_IMPL.format("tn"), b"\x01" * 64, info, 800.0)
    lt = _script("lt-untried.py")
    from gemmrl.baselines.cublas import lt_enum_tables
    tiles, clusters, _src = lt_enum_tables()
    seeds = lt.untried(st, dev, [shapes["done"]], tiles, clusters)[shapes["done"]]
    assert len(seeds) == 2  # the cooperative and ping-pong kernels of the one tile
    run = st.start_run("gemmrl tune", dev, {}, {})
    for name in seeds:
        st.record_trial(run, dev, shapes["done"], name, "ok", 0.9, 10.0, {})
    st.record_trial(run, dev, shapes["half"], seeds[0], "ok", 0.9, 10.0, {})
    st.record_trial(run, dev, shapes["half"], seeds[0], "ok", 0.9, 10.0, {})  # twice: still one name
    st.finish_run(run)

    report = tmp_path / "speedup_kernel.csv"
    ratios = {"open": 0.97, "half": 0.95, "done": 0.90, "above": 0.99, "no_choice": 0.93}
    report.write_text("mnk,torch.matmul,cuBLASLt-auto-tuning-max\n" + "".join(
        f"{shapes[n].M}_{shapes[n].N}_{shapes[n].K},1.0,{r}\n" for n, r in ratios.items()) + "64_64_64,1.0,\n")
    out = tmp_path / "list.txt"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-untried.py"), "--db", str(db), "--device", "H200",
                        "--report", str(report), "--high", "0.98", "--out", str(out), "--parts", "2"],
                       capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# NVIDIA H200 fp16 acc fp32: the 2 shapes at 0-0.98")
    assert lines[1:] == ["8192x4096x4096", "16384x4096x4096"]  # 0.95 before 0.97; 'done' and the others left out
    assert "4 shapes at 0-0.98; 2 with untried seeds; the first 3 untried of each: 2 distinct kernels" in r.stderr
    assert (tmp_path / "list-a.txt").read_text().splitlines()[1:] == ["8192x4096x4096"]
    assert (tmp_path / "list-b.txt").read_text().splitlines()[1:] == ["16384x4096x4096"]
    assert lt.split(list(range(234)), 4)[3] == list(range(177, 234))
    # --min-flops-log2: 16384x4096x4096 is 2^39 FLOPs, 8192x4096x4096 2^38
    big = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-untried.py"), "--db", str(db), "--device", "H200",
                          "--report", str(report), "--high", "0.98", "--min-flops-log2", "39", "--out", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert big.returncode == 0, big.stderr
    assert out.read_text().splitlines()[1:] == ["16384x4096x4096"]
    assert "the 1 shapes at 0-0.98 of 2^39 FLOPs or more of cuBLASLt" in out.read_text()
    assert "1 shapes at 0-0.98 of 2^39 FLOPs or more; 1 with untried seeds" in big.stderr

    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-untried.py"), "--db", str(db), "--device", "H200",
                          "--report", str(report), "--low", "1.0", "--high", "0.98", "--out", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "--low 1.0 must be below --high 0.98" in bad.stderr
    none = subprocess.run([sys.executable, str(ROOT / "scripts" / "lt-untried.py"), "--db", str(db), "--device", "H100",
                           "--report", str(report), "--out", str(out)], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert none.returncode == 2 and "no cuBLASLt autotuned choice stored on 'H100'" in none.stderr
    assert "it has them on NVIDIA H200" in none.stderr


def test_lt_untried_with_a_transfer_lists_the_shapes_whose_twins_of_that_tunings_winners_are_untried(tmp_path):
    """scripts/lt-untried.py --transfer-from h200:fp16: the seeds are the fp16 tuning's first --top
    suggestions as fp32 twins; a shape is listed while one of them has no fp32 trial on the device."""
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.search.run import TUNED
    from gemmrl.space.raw import RawSpec
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    fields = {"acc": "fp16", "block_k": 128, "block_m": 16, "block_n": 32, "layout": "NN", "split_k": 1, "stages": 4,
              "swap_ab": False, "warps_m": 1, "warps_n": 2}
    open_, done, none = (256, 256, 4096), (512, 256, 4096), (1024, 256, 4096)
    for mnk in (open_, done):
        st.put_tuning(dev, Problem(*mnk, acc="fp16"), TUNED, json.dumps({"family": "raw", "spec": fields}).encode(),
                      "the fp16 search's", 5.0)
    twin = RawSpec(**(fields | {"acc": "fp32"})).name
    run = st.start_run("gemmrl tune", dev, {}, {})
    st.record_trial(run, dev, Problem(*done, acc="fp32"), twin, "ok", 0.9, 10.0, {})
    st.record_trial(run, dev, Problem(*open_, acc="fp32"), "raw_something_else", "ok", 0.9, 10.0, {})
    st.finish_run(run)
    st.close()
    report = tmp_path / "speedup_kernel.csv"
    report.write_text("mnk,cuBLASLt-auto-tuning-max\n" + "".join(f"{m}_{n}_{k},0.9\n" for m, n, k in (open_, done, none)))
    out = tmp_path / "list.txt"
    argv = [sys.executable, str(ROOT / "scripts" / "lt-untried.py"), "--db", str(db), "--device", "H200", "--report",
            str(report), "--out", str(out), "--acc", "fp32", "--more", "2"]
    r = subprocess.run(argv + ["--transfer-from", "h200:fp16"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[1:] == ["256x256x4096"], lines
    assert "the first 2 suggestions of the NVIDIA H200 fp16 acc fp16 tuning not all tried" in lines[0]
    assert lines[0].endswith("tune --transfer-from h200:fp16 --more 2")
    assert "3 shapes at 0-1; 1 with untried seeds; the first 2 untried of each: 1 distinct kernels" in r.stderr
    bad = subprocess.run(argv + ["--transfer-from", "h100:fp16"], capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "--transfer-from h100:fp16" in bad.stderr, bad.stderr


def test_first_batches_lists_what_tune_proposes_first_and_leaves_the_store_alone(tmp_path):
    """scripts/first-batches.py: tune's own policy on a copy of the store, each shape's first batch
    of --more; a transfer's winner twin leads it; the store is not written; --entries lists a
    cache directory per kernel to build; bad arguments are refused before anything runs."""
    import hashlib
    import json

    from gemmrl.core.problem import Problem
    from gemmrl.search.run import TUNED
    from gemmrl.space.raw import RawSpec
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    fields = {"acc": "fp16", "block_k": 128, "block_m": 16, "block_n": 32, "layout": "NN", "split_k": 1, "stages": 4,
              "swap_ab": False, "warps_m": 1, "warps_n": 2}
    st.put_tuning(dev, Problem(256, 256, 4096, acc="fp16"), TUNED,
                  json.dumps({"family": "raw", "spec": fields}).encode(), "the fp16 search's", 5.0)
    st.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    entries = tmp_path / "entries.txt"
    argv = [sys.executable, str(ROOT / "scripts" / "first-batches.py"), "--db", str(db), "--device", "H200",
            "--acc", "fp32", "--family", "raw", "--shapes", "256x256x4096,512x256x4096"]
    r = subprocess.run(argv + ["--transfer-from", "h200:fp16", "--more", "3", "--entries", str(entries)],
                       capture_output=True, text=True, env=ENV | {"GEMMRL_CACHE": str(tmp_path / "cache")},
                       timeout=600)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    twin = RawSpec(**(fields | {"acc": "fp32"})).name
    first = rows["256x256x4096"].split()
    assert len(first) == 3 and first[0] == f"{twin}(prior)", first
    assert len(rows["512x256x4096"].split()) == 3
    assert "2 of 2 shapes, 6 candidates" in r.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # the simulated trials went to a copy
    listed = entries.read_text().splitlines()
    assert 1 <= len(listed) <= 6 and all(e.startswith("builds/") for e in listed), listed
    assert f"{len(listed)} kernels to build for them; 0 in the cache already" in r.stderr
    for extra, msg in ((["--more", "0"], "--more and --max-shapes"), (["--family", "nope"], "unknown kernel family"),
                       (["--transfer-from", "h100:fp16"], "no 'h100'"), (["--db", str(tmp_path / "none.sqlite")], "no store")):
        bad = subprocess.run(argv + extra, capture_output=True, text=True, env=ENV, timeout=300)
        assert bad.returncode == 2 and msg in bad.stderr, (extra, bad.stderr)


def test_session_bias_compares_a_calls_ratios_with_the_same_kernels_elsewhere(tmp_path):
    """scripts/session-bias.py: the ratio over the baseline in the named runs over that of the same
    kernel's nearest session outside them, by kernel class; the shapes whose latest session is the
    runs' (what the report reads), written for a retime with --out and --kind."""
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    sr, plain, later = Problem(256, 1024, 8192), Problem(4096, 4096, 4096), Problem(512, 512, 8192)
    names = {sr: "sm90_coop_128x128x64_c1x1_splitk8sr_s0_rh_sw1_nn_f16_f32",
             plain: "sm90_pp_128x128x64_c1x1_persist_s0_rh_sw1_nn_f16_f32",
             later: "sm90_pp_64x128x64_c1x1_splitk16sr_s0_rh_sw1_nn_f16_f32"}
    # (run, tuned us, cuBLASLt autotuned nn us, tn us): run 2 is the call under suspicion
    plan = {sr: [(1, 10.0, 9.0, 9.5), (2, 10.0, 9.9, 10.2)],
            plain: [(1, 50.0, 50.0, 51.0), (2, 50.0, 50.5, 51.0), (3, 50.0, 51.0, 52.0)],
            later: [(2, 8.0, 8.64, 9.0), (3, 8.0, 8.0, 8.2)]}
    for run in (1, 2, 3):
        rid = st.start_run("gemmrl bench", dev, {}, {})
        assert rid == run
        for p, rows in plan.items():
            for r, t, nn, tn in rows:
                if r != run:
                    continue
                st.record_session(rid, f"s{run}{p.M}", dev, p, "kernel", "kernel:v3",
                                  {"gemmrl-tuned": {"median_us": t, "n": 5},
                                   "cuBLASLt-auto-tuning-nn": {"median_us": nn, "n": 5},
                                   "cuBLASLt-auto-tuning-tn": {"median_us": tn, "n": 5}})
                st.record_verification(rid, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": {"name": names[p]}}})
        st.finish_run(rid)
    out = tmp_path / "retime.txt"
    cmd = [sys.executable, str(ROOT / "scripts" / "session-bias.py"), "--db", str(db), "--device", "H200"]
    r = subprocess.run(cmd + ["--runs", "2", "--out", str(out), "--kind", "splitk-sr"], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    # the faster of NN and TN over the tuned time: sr 0.99 in run 2 against 0.90 in run 1 (1.100), later 1.08
    # against 1.00 in run 3 (1.080); plain 1.01 against the median of run 1's 1.00 and run 3's 1.02
    assert "| splitk-sr | 2 | 1.100 | 1.080 | 1.100 | 1 |" in r.stdout
    assert "| cutlass | 1 | 1.000 | 1.000 | 1.000 | 0 |" in r.stdout
    assert out.read_text().splitlines()[1:] == ["256x1024x8192"]  # 512x512x8192's latest session is run 3's

    bad = subprocess.run(cmd + ["--runs", "5-4"], capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "5-4 runs backwards" in bad.stderr
    none = subprocess.run(cmd + ["--runs", "9"], capture_output=True, text=True, env=ENV, timeout=300)
    assert none.returncode == 2 and "runs 9 timed no verified gemmrl-tuned winner" in none.stderr


def test_session_bias_takes_the_slow_library_runs_and_lists_the_rows_resting_on_them(tmp_path):
    """scripts/session-bias.py --slow-runs SHARE: the runs are those whose small-shape library sessions
    ran slow in SHARE or more of them (report.bias.slow_runs, as library-state.py --min-slow lists
    them), and --out lists the shapes whose latest tuned session is one of theirs (2026-11-30: run
    161's baselines read 8.1 us where other runs read 7.1, and its report row read 1.144 for 0.954)."""
    from gemmrl.core.problem import Problem
    from gemmrl.report.bias import format_runs, parse_runs, slow_runs
    from gemmrl.store.db import Store

    assert format_runs({300, 288, 289, 290, 291, 5}) == "5,288-291,300"
    assert parse_runs(format_runs({1, 2, 4, 7, 8})) == {1, 2, 4, 7, 8}
    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    small = [Problem(64, 1024, 4096), Problem(128, 512, 4096), Problem(512, 256, 4096)]
    name = "sm90_ws_64x16x128_c1x2_tile_s0_rh_sw1_tn_f16_f32"
    # run 2 reads every library kernel 14% slow; the tuned rows of shapes 0 and 1 end on run 2, shape 2's on run 3
    for run, factor, tuned in ((1, 1.0, (0, 1, 2)), (2, 1.14, (0, 1)), (3, 1.0, (2,))):
        rid = st.start_run("gemmrl bench", dev, {"cublas": "13.1"}, {})
        assert rid == run
        for i, p in enumerate(small):
            res = {"torch.matmul": {"median_us": 7.0 * factor, "n": 5}, "cuBLAS-tn": {"median_us": 7.4 * factor, "n": 5}}
            if i in tuned:
                res.update({"gemmrl-tuned": {"median_us": 7.0, "n": 5},
                            "cuBLASLt-auto-tuning-nn": {"median_us": 7.2 * factor, "n": 5},
                            "cuBLASLt-auto-tuning-tn": {"median_us": 7.3 * factor, "n": 5}})
                st.record_verification(rid, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": {"name": name}}})
            st.record_session(rid, f"s{run}{i}", dev, p, "kernel", "kernel:v3", res)
        st.finish_run(rid)
    assert slow_runs(st.db, dev, 0.5, min_sessions=3) == {2}
    assert slow_runs(st.db, dev, 0.5, min_sessions=7) == set()  # run 2 holds 6 library sessions
    st.close()
    out = tmp_path / "rows.txt"
    cmd = [sys.executable, str(ROOT / "scripts" / "session-bias.py"), "--db", str(db), "--device", "H200"]
    r = subprocess.run(cmd + ["--slow-runs", "0.5", "--min-sessions", "3", "--out", str(out)], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "slow library sessions: 2\n" in r.stdout
    # the two rows ending on run 2 read 7.2 * 1.14 / 7.0 = 1.173 against 1.029 in run 1: a factor of 1.14
    assert "| cutlass | 2 | 1.140 | 1.140 | 1.140 | 2 |" in r.stdout
    assert out.read_text().splitlines()[1:] == ["64x1024x4096", "128x512x4096"]
    none = subprocess.run(cmd + ["--slow-runs", "0.5"], capture_output=True, text=True, env=ENV, timeout=300)
    assert none.returncode == 2 and "10 or more small-shape library sessions" in none.stderr
    both = subprocess.run(cmd + ["--slow-runs", "0.5", "--runs", "2"], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert both.returncode == 2 and "not allowed with" in both.stderr
    bad = subprocess.run(cmd + ["--slow-runs", "5"], capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "at most 1" in bad.stderr


def test_library_state_names_the_runs_that_timed_the_libraries_slow(tmp_path):
    """scripts/library-state.py (report.bias.library_state): per run, the share of its library
    sessions (torch.matmul, cuBLAS, cuBLASLt heuristic; small shapes, one cuBLAS version, three
    sessions or more) more than --above over the fastest, with the GPU state its sessions stored."""
    from gemmrl.core.problem import Problem
    from gemmrl.report.bias import library_state
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    shapes = [Problem(64, 1024, 4096), Problem(128, 512, 4096), Problem(512, 256, 4096)]
    hot = {"temp_c": 71, "mem_temp_c": 80, "sm_mhz": 1410, "power_w": 690.0, "clock_events": ["sw_power_cap"]}
    # run 2 times every library kernel 12% slower, its sessions with a GPU state; run 4 is another cuBLAS
    for run, factor, cublas, state in ((1, 1.0, "13.1", None), (2, 1.12, "13.1", hot), (3, 1.01, "13.1", None),
                                       (4, 1.3, "12.9", None)):
        rid = st.start_run("gemmrl bench", dev, {"cublas": cublas}, {})
        assert rid == run
        for i, p in enumerate(shapes):
            res = {"torch.matmul": {"median_us": 7.0 * factor, "n": 5}, "cuBLAS-tn": {"median_us": 7.5 * factor, "n": 5},
                   "gemmrl-tuned": {"median_us": 7.2, "n": 5}}
            if state:
                res = {k: {**v, "details": {"gpu_state": {**state, "temp_c": state["temp_c"] + i}}} for k, v in res.items()}
            st.record_session(rid, f"s{run}{i}", dev, p, "kernel", "kernel:v3", res)
        big = Problem(8192, 8192, 8192)  # over --under-us: not counted
        st.record_session(rid, f"b{run}", dev, big, "kernel", "kernel:v3", {"torch.matmul": {"median_us": 900.0 * factor, "n": 5}})
        st.finish_run(rid)
    got = library_state(st.db, dev)
    assert got[1] == {"sessions": 6, "slow": 0.0, "state": {"sessions": 0}}
    assert got[2]["slow"] == 1.0 and got[3]["slow"] == 0.0 and 4 not in got  # run 4: one session per cuBLAS version
    assert got[2]["state"] == {"sessions": 3, "temp_c": 72, "mem_temp_c": 80, "sm_mhz": 1410, "power_w": 690.0,
                               "clock_events": {"sw_power_cap": 3}}
    assert library_state(st.db, dev, above=1.2)[2]["slow"] == 0.0
    assert set(library_state(st.db, dev, runs={2})) == {2}
    st.close()
    cmd = [sys.executable, str(ROOT / "scripts" / "library-state.py"), "--db", str(db), "--device", "H200",
           "--min-sessions", "3"]
    r = subprocess.run(cmd + ["--json", str(tmp_path / "s.json")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {ln.split(" | ")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()}
    assert set(rows) == {"| 1", "| 2", "| 3"}
    assert rows["| 2"].endswith("| 6 | 100.0% | 3 | 72 | 80 | 1410 | 690 | sw_power_cap 3 |")
    assert rows["| 1"].endswith("| 6 | 0.0% | 0 | - | - | - | - | - |")
    assert json.loads((tmp_path / "s.json").read_text())["runs"]["2"]["slow"] == 1.0
    r = subprocess.run(cmd + ["--min-slow", "0.5"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and [ln[:4] for ln in r.stdout.splitlines() if ln[:3] == "| " + ln[2:3] and ln[2:3].isdigit()] == ["| 2 "]
    bad = subprocess.run(cmd + ["--above", "0.9"], capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "more than 1" in bad.stderr
    none = subprocess.run(cmd + ["--runs", "9"], capture_output=True, text=True, env=ENV, timeout=300)
    assert none.returncode == 2 and "in runs 9" in none.stderr


LT_PROFILE_CSV = '''fp32 run: done
==PROF== Connected to process 77 (/usr/bin/python3)
==PROF== Profiling "sm90_xmma_gemm_f16f16_f32f32": 0%....50%....100% - 12 passes
==PROF== Profiling "splitKreduce_kernel": 0%....50%....100% - 12 passes
LT-PROFILE-DESCRIBE {"impl": "cuBLASLt-auto-tuning-nn", "device": "NVIDIA H200", "max_rel_err": 0.001}
==PROF== Disconnected from process 77
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","dram__bytes_read.sum","gpu__time_duration.sum","launch__cluster_dim_x","launch__grid_size"
"","","","","","","","byte","nsecond","","block"
"1","77","python3","h","splitKreduce_kernel","1","7","1,048,576","2,304","1","64"
"0","77","python3","h","sm90_xmma_gemm_f16f16_f32f32","1","7","34,603,008","12,288","2","132"
'''



def test_library_state_lists_the_pack_entries_that_rest_on_the_slow_runs(tmp_path):
    """scripts/library-state.py --pack DIR --changed-shapes FILE: DIR exported again without the
    runs it lists (report.bias.pack_without_runs); FILE names the shapes whose entries only those
    runs' slow library sessions kept."""
    from gemmrl.core.problem import Problem
    from gemmrl.runtime.pack import export_pack
    from gemmrl.space import cutlass_sm90
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    prov = {"device": dev, "gpu": "h200", "cuda": "13.0", "capability": "9.0", "sm_count": 132, "cublas": "13.1"}
    p = Problem(128, 512, 4096)
    spec = cutlass_sm90.heuristic_specs(p, "TN")[0]
    choice = json.dumps({"family": "cutlass_sm90", "spec": dict(spec.__dict__)}, sort_keys=True).encode()
    st.put_tuning(dev, p, "gemmrl-tuned", choice, spec.name, 7.2)
    # runs 2 and 4 time cuBLAS 12% slow: ours at 7.2 us reads 0.972, 1.089, 0.982, 1.089 of it
    for run, factor in ((1, 1.0), (2, 1.12), (3, 1.01), (4, 1.12)):
        rid = st.start_run("gemmrl bench", dev, prov, {})
        assert rid == run
        st.record_verification(rid, dev, p, "gemmrl-tuned", True, "ok", {})
        st.record_session(rid, f"s{run}", dev, p, "kernel", "kernel:v3", {
            "gemmrl-tuned": {"median_us": 7.2, "n": 5}, "cuBLAS-tn": {"median_us": 7.0 * factor, "n": 5}})
        st.finish_run(rid)
    pack = export_pack(st, dev, tmp_path / "pack", "fp16", "fp32")
    assert [(e["M"], e["layout"]) for e in json.loads((pack / "manifest.json").read_text())["entries"]] == [(128, "TN")]
    st.close()
    cmd = [sys.executable, str(ROOT / "scripts" / "library-state.py"), "--db", str(db), "--device", "H200",
           "--min-sessions", "1", "--pack", str(pack), "--changed-shapes", str(tmp_path / "again.txt")]
    r = subprocess.run(cmd + ["--min-slow", "0.5"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "again.txt").read_text().splitlines()
    assert lines[0].startswith("# NVIDIA H200: the 1 shapes whose entries") and "runs 2,4 (2:" in lines[0]
    assert lines[1:] == ["128x512x4096"] and "128x512x4096 TN" in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "--min-slow above 0" in r.stderr
    r = subprocess.run(cmd[:-2] + ["--min-slow", "0.5"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "go together" in r.stderr

def test_lt_profile_reads_every_kernel_in_launch_order_and_tables_them():
    m = _script("lt-profile.py")
    rows = m.parse_rows(LT_PROFILE_CSV)
    # both kernels, in launch (ID) order, the units row and the target's own lines skipped
    assert [r["name"] for r in rows] == ["sm90_xmma_gemm_f16f16_f32f32", "splitKreduce_kernel"]
    assert rows[0]["dram__bytes_read.sum"] == 34603008.0 and rows[1]["gpu__time_duration.sum"] == 2304.0
    assert rows[0]["launch__cluster_dim_x"] == 2.0
    assert m.described(LT_PROFILE_CSV)["impl"] == "cuBLASLt-auto-tuning-nn"
    assert m.parse_rows("==PROF== nothing profiled\n") == []
    text = m.table({"64x2048x8192": {"cuBLASLt-auto-tuning-nn": {"kernels": rows},
                                     "tuned": {"error": "ncu exit 1: no counters"}}})
    body = text.splitlines()[2:]
    assert len(body) == 3
    # grid, cluster, cold microseconds and DRAM megabytes of the GEMM kernel; metrics not profiled show '-'
    assert "| 132 | 2x- |" in body[0] and "| 12.29 |" in body[0] and "| 34.6/- |" in body[0]
    assert "error: ncu exit 1" in body[2]


def test_lt_profile_refuses_no_shapes_and_says_when_there_is_no_ncu(tmp_path, monkeypatch, capsys):
    m = _script("lt-profile.py")
    db = tmp_path / "s.sqlite"
    db.write_bytes(b"")
    with pytest.raises(SystemExit):
        m.main(["--db", str(db)])
    assert "no shapes" in capsys.readouterr().err
    monkeypatch.setattr("gemmrl.llm.ncu.ncu_path", lambda: None)
    assert m.main(["--db", str(db), "--shape", "64x64x64", "--out", str(tmp_path)]) == 2
    assert "no ncu" in capsys.readouterr().err


def test_lt_profile_runs_ncu_per_shape_and_impl_and_writes_what_it_read(tmp_path, monkeypatch, capsys):
    """The parent loop with a stand-in ncu (a script printing a recorded profile): one ncu
    process per (shape, implementation), with the clocks left alone and the cache control asked
    for, and the JSON holding every kernel and the child's provenance."""
    m = _script("lt-profile.py")
    fake = tmp_path / "ncu"
    calls = tmp_path / "calls.txt"
    csv_text = LT_PROFILE_CSV.replace('"max_rel_err": 0.001}', '"max_rel_err": 0.001, "provenance": {"device": "NVIDIA H200"}}')
    (tmp_path / "out.txt").write_text(csv_text)
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\ncat {tmp_path / 'out.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GEMMRL_NCU_PATH", str(fake))
    db = tmp_path / "s.sqlite"
    db.write_bytes(b"")
    out = tmp_path / "o"
    assert m.main(["--db", str(db), "--shape", "64x2048x8192", "--shape", "256x512x4096", "--impl", "tuned",
                   "--impl", "cuBLASLt-auto-tuning-nn", "--cache-control", "none", "--out", str(out)]) == 0
    lines = calls.read_text().splitlines()
    assert len(lines) == 4  # 2 shapes x 2 implementations
    assert all("--clock-control none" in ln and "--cache-control none" in ln for ln in lines)
    assert lines[0].endswith("--child tuned 64x2048x8192") and lines[3].endswith("--child cuBLASLt-auto-tuning-nn 256x512x4096")
    doc = json.loads((out / "lt-profile.json").read_text())
    assert doc["provenance"] == {"device": "NVIDIA H200"} and doc["cache_control"] == "none"
    got = doc["results"]["256x512x4096"]["tuned"]
    assert [k["name"] for k in got["kernels"]] == ["sm90_xmma_gemm_f16f16_f32f32", "splitKreduce_kernel"]
    assert "| 64x2048x8192 | tuned | `sm90_xmma_gemm_f16f16_f32f32` |" in capsys.readouterr().out


def test_session_diff_compares_lists_before_and_after(tmp_path):
    """scripts/session-diff.py: per list and over the grid, the ratio over cuBLASLt autotuned
    before and after (speedup CSVs), the winners that changed (tuning tables) and which spec
    fields they changed."""
    import sqlite3

    def speedups(path, rows):
        path.write_text("mnk,torch.matmul,cuBLASLt-auto-tuning-max\n"
                        + "".join(f"{m.replace('x', '_')},1.0,{r}\n" for m, r in rows.items()))

    def store(path, winners):
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE tuning (device TEXT, M INTEGER, N INTEGER, K INTEGER, dtype TEXT, acc TEXT, "
                    "impl TEXT, choice BLOB, info TEXT, time_us REAL, created REAL)")
        for shape, name in winners.items():
            m, n, k = map(int, shape.split("x"))
            con.execute("INSERT INTO tuning VALUES ('NVIDIA H200', ?, ?, ?, 'fp16', 'fp32', 'gemmrl-tuned', '', ?, 1, 0)",
                        (m, n, k, f"{name} (best of 3/3)"))
            con.execute("INSERT INTO tuning VALUES ('NVIDIA H200', ?, ?, ?, 'fp16', 'fp16', 'gemmrl-tuned', '', "
                        "'other_acc', 1, 0)", (m, n, k))
        con.commit()
        con.close()

    pp = "sm90_pp_64x128x64_c2x1_persist_s0_rh_sw1_tn_f16_f32"
    resident = "sm90_ws_64x128x64_c2x1_tile_s2_rh_sw1_tn_f16_f32"
    speedups(tmp_path / "before.csv", {"128x12288x128": 0.85, "512x512x512": 1.0, "64x64x64": 0.9})
    speedups(tmp_path / "after.csv", {"128x12288x128": 1.02, "512x512x512": 0.99, "64x64x64": 0.9})
    store(tmp_path / "before.sqlite", {"128x12288x128": pp, "512x512x512": "raw_a", "64x64x64": "raw_b"})
    store(tmp_path / "after.sqlite", {"128x12288x128": resident, "512x512x512": "raw_a", "64x64x64": "raw_c"})
    lst = tmp_path / "small.txt"
    lst.write_text("# a list\n128x12288x128\n512x512x512 note\n\n4096x4096x4096\n")
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "session-diff.py"), "--device", "h200", "--acc", "fp32",
           "--before-csv", str(tmp_path / "before.csv"), "--before-db", str(tmp_path / "before.sqlite"),
           "--csv", str(tmp_path / "after.csv"), "--db", str(tmp_path / "after.sqlite")]
    r = subprocess.run(cmd + ["--list", str(lst), "--json", str(out)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    small = rows["small"]
    assert (small["shapes"], small["missing"], small["winners_changed"], small["up"], small["down"]) == (2, 1, 1, 1, 1)
    assert small["changed_after_over_before"] == pytest.approx(1.02 / 0.85)
    assert small["kept_after_over_before"] == pytest.approx(0.99)
    assert (small["at_threshold_before"], small["at_threshold_after"]) == (1, 2)
    assert small["largest_drops"] == [{"shape": "512x512x512", "before": 1.0, "after": 0.99}]
    assert small["fields"] == {"schedule+scheduler+stages": 1}
    every = rows["all"]
    assert (every["shapes"], every["winners_changed"]) == (3, 2)
    assert every["fields"] == {"schedule+scheduler+stages": 1, "family": 1}
    assert "below 0.98: 2 -> 1; winners changed 2" in r.stdout
    # a device the store does not hold, and the before side given twice or half
    r = subprocess.run(cmd[:2] + ["--device", "H100"] + cmd[4:], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "names 0 of the store's devices" in r.stderr
    r = subprocess.run(cmd + ["--before-rev", "HEAD"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "give --before-rev, or" in r.stderr
    r = subprocess.run(cmd[:8] + cmd[10:], capture_output=True, text=True, env=ENV)  # no --before-db
    assert r.returncode == 2 and "go together" in r.stderr
    # a GPU without a results folder: the CSVs must be named
    r = subprocess.run(cmd[:2] + ["--device", "B200", "--before-rev", "HEAD"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "no results/<gpu> folder" in r.stderr


def test_race_final_gap_pairs_each_race_with_its_final_timing(tmp_path):
    """scripts/race-final-gap.py: a race line's fastest contender against the same run's final
    gemmrl-tuned time, grouped by the slowest contender's lag; a tune log named LOG:RUN."""
    import sqlite3

    db = tmp_path / "s.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, device TEXT)")
    con.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, run_id INTEGER, device TEXT, M INTEGER, "
                "N INTEGER, K INTEGER, impl TEXT, mode TEXT, status TEXT, median_us REAL)")
    con.executemany("INSERT INTO runs VALUES (?, 'NVIDIA H200')", [(7,), (8,)])
    finals = [(7, 1024, 1024, 16384, 61.47), (7, 512, 512, 512, 5.0), (8, 64, 64, 64, 2.02),
              (7, 64, 64, 64, 9.9)]  # the last: another run's shape, not this race's
    con.executemany("INSERT INTO measurements (run_id, device, M, N, K, impl, mode, status, median_us) "
                    "VALUES (?, 'NVIDIA H200', ?, ?, ?, 'gemmrl-tuned', 'kernel', 'ok', ?)", finals)
    con.commit()
    con.close()
    bench = tmp_path / "bench.log"
    bench.write_text(
        "run 7: 3 shapes x 8 implementations x 1 modes on NVIDIA H200\n"
        "1024x1024x16384 candidates (median us, beside 7 baselines, by paired ratios): a=52.90, b=54.30, "
        "c=130.47, d=failed\n"
        "512x512x512 candidates (median us, beside 7 baselines, by paired ratios): e=5.00, f=5.50, "
        "g=pruned (9.00, 1.80x)\n"
        "2048x2048x2048 candidates (median us, beside 7 baselines, by paired ratios): h=30.0\n")  # no final
    tune = tmp_path / "tune.log"
    tune.write_text("[1/1] 64x64x64\n64x64x64 candidates (median us, beside 7 baselines, by paired ratios): "
                    "i=2.00, j=2.80\n")
    mod = _script("race-final-gap.py")
    run, rows = mod.parse_log(bench.read_text())
    assert run == 7 and [(r["winner"], r["race_us"], r["timed"]) for r in rows] == [
        ("a", 52.90, 3), ("e", 5.0, 2), ("h", 30.0, 1)]
    assert rows[0]["spread"] == pytest.approx(130.47 / 52.90) and rows[1]["spread"] == pytest.approx(1.1)
    out = tmp_path / "gap.csv"
    cmd = [sys.executable, str(ROOT / "scripts" / "race-final-gap.py"), "--db", str(db), "--device", "h200"]
    r = subprocess.run(cmd + [str(bench), f"{tune}:8", "--csv", str(out)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "3 races with a final timing" in r.stdout
    assert "| within 1.3x | 1 | 1.000 | 0 |" in r.stdout  # 512x512x512: 5.00 and 5.00
    assert "| 1.3-2x | 1 | 1.010 | 0 |" in r.stdout  # 64x64x64 in run 8: 2.02 / 2.00
    assert "| 2x or slower | 1 | 1.162 | 1 |" in r.stdout  # 61.47 / 52.90
    assert len(out.read_text().splitlines()) == 4
    # the tune log without its run is left out, with the reason
    r = subprocess.run(cmd + [str(bench), str(tune)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and "2 races" in r.stdout and "name it as" in r.stderr
    r = subprocess.run(cmd + [str(tmp_path / "none.log")], capture_output=True, text=True, env=ENV)
    assert r.returncode != 0 and "no such log" in r.stderr


def _gpu_tests_repo(tmp_path, with_headers):
    """A copy of scripts/gpu-tests.sh and device-common.sh (unpacking into tmp_path/unpacked), a
    fake cutlass_library without sources (so the installed wheel does not count), and, if asked,
    a carried headers tarball."""
    import tarfile

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu-tests.sh").write_text((ROOT / "scripts" / "gpu-tests.sh").read_text())
    common = (ROOT / "scripts" / "device-common.sh").read_text()
    (repo / "scripts" / "device-common.sh").write_text(common.replace("/tmp/cutlass-headers",
                                                                      str(tmp_path / "unpacked")))
    fake = tmp_path / "fake" / "cutlass_library"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    if with_headers:
        src = tmp_path / "h" / "cutlass-9.8.7"
        for d in ("include/cutlass", "tools/util/include"):
            (src / d).mkdir(parents=True)
        (src / "include/cutlass/cutlass.h").write_text("// cutlass\n")
        (repo / ".ext" / "carry").mkdir(parents=True)
        with tarfile.open(repo / ".ext/carry/cutlass-headers-9.8.7.txz", "w:xz") as t:
            t.add(src, arcname="cutlass-9.8.7")
    env = {k: v for k, v in ENV.items() if k != "GEMMRL_CUTLASS_DIR"}
    env.update(PYTHONPATH=f"{tmp_path / 'fake'}:{ROOT}", PATH=os.environ["PATH"])
    return repo, env


def test_gpu_tests_refuses_to_run_without_cutlass_headers(tmp_path):
    """Without headers most GPU tests would skip (and one fail) and the run would prove little:
    scripts/gpu-tests.sh says so and runs no test."""
    repo, env = _gpu_tests_repo(tmp_path, with_headers=False)
    logs = tmp_path / "logs"
    r = subprocess.run(["bash", "scripts/gpu-tests.sh", str(logs)], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUTLASS headers" in r.stderr
    assert not (logs / "gpu-tests.log").exists()


def test_gpu_tests_unpacks_the_carried_headers(tmp_path):
    """Run in the device call's outer command (outside device-steps.sh, which sets GEMMRL_CUTLASS_DIR
    for its steps), scripts/gpu-tests.sh finds the carried headers itself."""
    repo, env = _gpu_tests_repo(tmp_path, with_headers=True)
    # as a device-steps.sh step: no log directory given, OUT in the environment
    r = subprocess.run(["bash", "scripts/gpu-tests.sh"], cwd=repo, env={**env, "OUT": str(tmp_path / "out")},
                       capture_output=True, text=True, timeout=300)
    assert f"CUTLASS headers: {tmp_path / 'unpacked' / 'cutlass-9.8.7' / 'include'}" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "out" / "logs" / "gpu-tests" / "gpu-tests.log").exists()


def _twins_store(tmp_path):
    """scripts/arrive-twins.py loaded, and a store with an open tune run on an H200 for its trials:
    (module, store path, Store, device, run)."""
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H200"
    return _script("arrive-twins.py"), db, st, dev, st.start_run("gemmrl tune", dev, {"device": dev}, {})


def test_epi_twins_pair_each_shapes_fastest_raw_spec_with_its_shared_memory_epilogue(tmp_path):
    """scripts/arrive-twins.py --twin epi: the fastest stored raw spec of any split (an unsplit one
    here) beside its epi='smem' twin, the fetch-add kept where it splits K; the report names the
    columns by the epilogue and reads the smem twin's paired speedup."""
    from gemmrl.core.problem import Problem
    from gemmrl.space import raw

    mod, db, st, dev, run = _twins_store(tmp_path)
    p = Problem(4096, 64, 64)
    fast = raw.RawSpec(16, 32, 128, 1, 2, 4, 1, False, "TN", "fp32")
    for spec, t in ((fast, 3.2), (raw.RawSpec(32, 32, 64, 2, 2, 3, 2, False, "TN", "fp32", "add"), 3.9)):
        st.record_trial(run, dev, p, spec.name, "ok", 1.0, t, {"family": "raw", "spec": dict(spec.__dict__)})
    assert mod.base_spec(st.db, dev, p, split=False) == fast
    split = raw.RawSpec(16, 32, 128, 1, 2, 4, 4, False, "TN", "fp32", "add")
    assert [(a.epi, b.epi, b.arrive) for a, b in mod.twins(split, Problem(64, 128, 2048), (), "epi")] == \
        [("direct", "smem", "add")]
    assert mod.twins(fast, Problem(4096, 68, 64), (), "epi") == []  # N % 8: no staged epilogue
    entries = mod.plan([p], st.db, dev, (), tmp_path / "w", "epi")
    (direct, smem, one), = entries[0]["pairs"]
    assert one == 1 and Path(smem).name == "raw_tn_fp32_16x32x128_w1x2_s4_k1_se_4096x64x64.cu"
    assert "copy16_to_global" in Path(smem).read_text() and "copy16_to_global" not in Path(direct).read_text()
    brun = st.start_run("gemmrl bench", dev, {"device": dev, "commit": "abc123"}, {})
    a, b = f"kernel:{Path(direct).stem}", f"kernel:{Path(smem).stem}"
    st.record_session(brun, "k1", dev, p, "kernel", "kernel:v3", {
        "torch.matmul": {"median_us": 3.0, "n": 50}, a: {"median_us": 3.3, "n": 50},
        b: {"median_us": 3.0, "n": 50, "details": {"paired": {a: 1.1}}}})
    rows = mod.ratios(st.db, [brun], entries, mod.TWINS["epi"])
    assert rows == [{"shape": "4096x64x64", "split": 1, "direct": Path(direct).stem, "timed": True,
                     "direct_us": 3.3, "smem_us": 3.0, "smem_speedup": pytest.approx(1.1), "torch_us": 3.0}]
    st.close()
    cmd = [sys.executable, str(ROOT / "scripts" / "arrive-twins.py"), "--db", str(db), "--device", "H200",
           "--shapes", "4096x64x64", "--twin", "epi"]
    r = subprocess.run(cmd + ["--report-runs", str(brun), "--work", str(tmp_path / "w2")], capture_output=True,
                       text=True, env={**ENV, "OUT": str(tmp_path / "out")}, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "out" / "logs" / "epi-twins.json").read_text())  # a device call's result file
    assert got["twin"] == "epi" and got["rows"][0]["smem_speedup"] == pytest.approx(1.1) and got["runs"] == [brun]
    assert got["provenance"]["commit"] == "abc123"
    assert "| shape | split | direct twin | direct us | smem-epilogue us | smem-epilogue speedup |" in r.stdout
    assert "| 4096x64x64 | 1 | raw_tn_fp32_16x32x128_w1x2_s4_k1_4096x64x64 | 3.30 | 3.00 | 1.100 | 3.00 |" in r.stdout
    r = subprocess.run(cmd + ["--splits", "0", "--plan"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "1.." in r.stderr


def test_arrive_twins_renders_each_split_kernels_fetch_add_twin_and_reads_their_sessions(tmp_path):
    """scripts/arrive-twins.py: for each shape, the split-K raw spec of its fastest stored trial (else
    the heuristic's), at each --split valid() accepts, rendered as its CAS and fetch-add twins;
    --plan lists one kernel-mode bench a shape timing them together; the report takes the fetch-add
    twin's speedup from the session's paired ratio."""
    import dataclasses

    from gemmrl.core.problem import Problem
    from gemmrl.space import raw

    mod, db, st, dev, run = _twins_store(tmp_path)
    p = Problem(128, 64, 8192)
    fast = raw.RawSpec(16, 32, 128, 1, 2, 3, 8, False, "TN", "fp32")
    # the heuristic's split-K specs arrive with the fetch-add now: the twins of one are the same pair
    heur = next(s for s in raw.heuristic_specs(p, "TN", "fp32") if s.split_k > 1)
    assert heur.arrive == "add" and [(c.arrive, a.arrive) for c, a in mod.twins(heur, p, ())] == [("cas", "add")]
    plain = dataclasses.replace(fast, split_k=1)
    for spec, t in ((plain, 6.0), (fast, 9.5), (dataclasses.replace(fast, stages=4), 9.9)):
        st.record_trial(run, dev, p, spec.name, "ok", 1.0, t, {"family": "raw", "spec": dict(spec.__dict__)})
    # the fastest split-K trial is the base, not the faster unsplit one
    assert mod.base_spec(st.db, dev, p) == fast
    other = Problem(64, 64, 2048)  # nothing stored: the heuristic's best split-K spec
    assert mod.base_spec(st.db, dev, other).split_k > 1
    assert [(c.split_k, c.arrive, a.arrive) for c, a in mod.twins(fast, p, (4, 16, 128))] == \
        [(4, "cas", "add"), (16, "cas", "add")]  # split 128 would leave splits empty
    entries = mod.plan([p], st.db, dev, (4, 16), tmp_path / "w")
    assert [e["shape"] for e in entries] == ["128x64x8192"]
    (cas4, add4, s4), (cas16, add16, s16) = entries[0]["pairs"]
    assert (s4, s16) == (4, 16) and Path(add16).name == "raw_tn_fp32_16x32x128_w1x2_s3_k16_fa_128x64x8192.cu"
    assert "arrive_is_last_add" in Path(add16).read_text() and "arrive_is_last_add" not in Path(cas16).read_text()
    argv = mod.bench_argv(entries[0], "store.sqlite")
    assert argv[argv.index("--shapes") + 1] == "128x64x8192" and argv[argv.index("--mode") + 1] == "kernel"
    assert [a for a in argv if a.startswith("kernel:")] == [f"kernel:{f}" for f in (cas4, add4, cas16, add16)]

    # a bench run's session: the fetch-add twin 25% faster at split 16 by its paired ratio (20% by the
    # medians, which the paired ratio outranks); split 4 untimed
    brun = st.start_run("gemmrl bench", dev, {"device": dev, "driver": "580.159.04", "cuda": "13.0",
                                             "torch": "2.11.0+cu130", "commit": "abc123"}, {})
    a, b = f"kernel:{Path(cas16).stem}", f"kernel:{Path(add16).stem}"
    st.record_session(brun, "k1", dev, p, "kernel", "kernel:v3", {
        "torch.matmul": {"median_us": 9.0, "n": 50}, a: {"median_us": 12.0, "n": 50},
        b: {"median_us": 10.0, "n": 50, "details": {"paired": {a: 1.25}}}})
    rows = mod.ratios(st.db, [brun], entries)
    assert rows[0] == {"shape": "128x64x8192", "split": 4, "cas": Path(cas4).stem, "timed": False}
    assert rows[1]["timed"] and rows[1]["add_speedup"] == pytest.approx(1.25) and rows[1]["torch_us"] == 9.0
    st.close()

    cmd = [sys.executable, str(ROOT / "scripts" / "arrive-twins.py"), "--db", str(db), "--device", "H200",
           "--shapes", "128x64x8192"]
    r = subprocess.run(cmd + ["--splits", "4,16", "--report-runs", str(brun), "--json", str(tmp_path / "t.json"),
                              "--work", str(tmp_path / "w2")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 128x64x8192 | 16 | raw_tn_fp32_16x32x128_w1x2_s3_k16_128x64x8192 | 12.00 | 10.00 | 1.250 | 9.00 |" \
        in r.stdout
    got = json.loads((tmp_path / "t.json").read_text())
    assert got["runs"] == [brun]
    prov = got["provenance"]  # what a result file must name of where its numbers came from
    assert (prov["device"], prov["driver"], prov["cuda"], prov["torch"], prov["commit"]) == \
        (dev, "580.159.04", "13.0", "2.11.0+cu130", "abc123") and prov["first_date"] == prov["last_date"]
    r = subprocess.run(cmd + ["--splits", "1,4", "--plan"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "--splits" in r.stderr


def test_device_slim_hides_what_the_device_does_not_read_and_puts_it_back(tmp_path):
    """scripts/device-slim.sh: the other GPU's packs and reports, the logs and the sample-efficiency
    studies leave the working tree (the device tool sends at most 64 MiB), the store, this GPU's packs
    and reports stay; restore gives back the same bytes from git; a change git does not hold is never
    thrown away."""
    repo = tmp_path / "repo"
    files = {"scripts/device-slim.sh": (ROOT / "scripts/device-slim.sh").read_text(),
             "results/gemmrl.sqlite.xz": "store", "results/h200/report.csv": "h200",
             "results/h200/sample-efficiency/sweep.sqlite.xz": "s1",
             "results/h200/sample-efficiency-top2/sweep.sqlite.xz": "s2",
             "results/h100/report.csv": "h100", "results/logs/run.log": "log" * 10000,
             "results/shapes/a.txt": "64x64x64\n",
             "packs/h200-fp16-F32F16F16F32/manifest.json": "{}", "packs/h100-fp16-F32F16F16F32/manifest.json": "{1}",
             "packs/h100-fp16-F16F16F16F16/kernels/k.cu": "// k"}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    slim = ["bash", str(repo / "scripts/device-slim.sh")]

    def run(*args):
        return subprocess.run(slim + list(args), capture_output=True, text=True, timeout=60)

    assert run("hide", "a100").returncode == 2  # not a GPU it knows: nothing hidden
    assert not (repo / ".git/device-slim-hidden").exists()
    (repo / "results/h100/report.csv").write_text("changed, not committed")
    r = run("hide", "H200")
    assert r.returncode == 1 and "results/h100/report.csv" in r.stderr
    assert all((repo / n).exists() for n in files)  # refused: nothing taken out
    subprocess.run(git + ["checkout", "--", "results/h100/report.csv"], check=True)

    r = run("hide", "H200")
    assert r.returncode == 0, r.stderr
    gone = {n for n in files if not (repo / n).exists()}
    assert gone == {"results/h100/report.csv", "results/logs/run.log",
                    "results/h200/sample-efficiency/sweep.sqlite.xz",
                    "results/h200/sample-efficiency-top2/sweep.sqlite.xz",
                    "packs/h100-fp16-F32F16F16F32/manifest.json", "packs/h100-fp16-F16F16F16F16/kernels/k.cu"}
    assert run("hide", "h200").returncode == 2  # twice would lose the list of what to put back
    size = run("size")
    assert size.returncode == 0 and float(size.stdout.split()[0]) < 0.01  # the 30,000-byte log is gone
    r = run("restore")
    assert r.returncode == 0, r.stderr
    assert {n: (repo / n).read_text() for n in files} == files
    st = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True, check=True)
    assert st.stdout == ""
    assert run("restore").returncode == 0 and "nothing hidden" in run("restore").stdout


def test_device_store_is_the_committed_store_and_the_carried_deltas_only(tmp_path):
    """scripts/device-store.py (device-steps.sh's first step on the store): a warm machine's store is
    kept while every run it holds beyond the committed ones is in a carried delta; one holding a run
    of an earlier call that is not carried now (2026-12-01: calls run without CUTLASS headers, whose
    deltas were dropped), or unpacked from another commit's .xz, is unpacked again."""
    from gemmrl.store.db import Store, pack

    mod = _script("device-store.py")
    db = tmp_path / "results" / "gemmrl.sqlite"
    db.parent.mkdir()
    s = Store(db)
    s.start_run("gemmrl bench (committed)", "Fake GPU", {}, {})
    s.close()
    pack(db)
    db.unlink()
    lines = []
    assert mod.prepare(db, db.with_name("gemmrl.sqlite.xz"), [], lines.append) is True  # unpacked: none here
    assert mod.max_run(db) == 1 and json.loads(mod.base_path(db).read_text())["max_run"] == 1
    assert mod.prepare(db, db.with_name("gemmrl.sqlite.xz"), [], lines.append) is False  # nothing to add: kept
    # an earlier call's run, as device-steps.sh merges a carried delta
    delta = tmp_path / "delta1.sqlite"
    d = Store(delta)
    d.start_run("gemmrl tune (call 1)", "Fake GPU", {}, {})
    d.close()
    s = Store(db)
    s.merge(delta)
    s.close()
    assert mod.max_run(db) == 2
    assert mod.prepare(db, db.with_name("gemmrl.sqlite.xz"), [delta], lines.append) is False  # carried again: kept
    assert mod.max_run(db) == 2
    assert mod.prepare(db, db.with_name("gemmrl.sqlite.xz"), [], lines.append) is True  # not carried: dropped
    assert mod.max_run(db) == 1
    assert "1 of its 1 runs after the committed ones are in no carried delta" in lines[-1]
    # another commit's store
    s = Store(db)
    s.start_run("gemmrl bench (a later commit)", "Fake GPU", {}, {})
    s.close()
    pack(db)
    s = Store(db)
    s.start_run("stray", "Fake GPU", {}, {})
    s.close()
    lines.clear()
    s = Store(db)  # the base still names the first .xz: the one beside it now is another commit's
    s.close()
    assert mod.prepare(db, db.with_name("gemmrl.sqlite.xz"), [], lines.append) is True
    assert "changed since" in lines[-1] and mod.max_run(db) == 2
    # from the command line: a delta that is not there is refused; no .xz: the local store as it is
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device-store.py"), str(db), str(tmp_path / "nope")],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and "no such delta" in r.stderr
    db.with_name("gemmrl.sqlite.xz").unlink()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device-store.py"), str(db)],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and "used as it is" in r.stdout
