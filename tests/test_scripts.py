"""The experiment scripts under scripts/ run on a GPU; here they must at least load and explain
themselves (argument parsing happens before any GPU work), and the trace report must read a
trace for real."""

import csv
import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("script, words", [
    ("server-noise.py", "--rounds"), ("fallback-gap.py", "pack"), ("product-gap.py", "pack")])
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
