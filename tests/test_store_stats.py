import sqlite3

import pytest

from gemmrl.bench import stats
from gemmrl.core.problem import Problem
from gemmrl.store.db import Store, StoreError

P = Problem(256, 512, 1024)
Q = Problem(64, 64, 64)


def _st(median, n=10):
    return {"median_us": median, "mean_us": median * 1.1, "min_us": median * 0.9, "p10_us": median,
            "p90_us": median * 1.2, "std_us": 0.1, "n": n, "status": "ok", "details": {"sets": 4}}


def test_store_roundtrip_and_latest_wins(tmp_path):
    s = Store(tmp_path / "a.sqlite")
    run = s.start_run("gemmrl bench", "H100", {"commit": "abc"}, {"modes": ["kernel"]})
    s.record_session(run, "s1", "H100", P, "kernel", "kernel:v1", {"torch.matmul": _st(10.0), "cuBLAS-nn": _st(9.0)})
    s.record_session(run, "s2", "H100", P, "kernel", "kernel:v1", {"torch.matmul": _st(11.0)})
    rows = s.measurements(device="H100", mode="kernel")
    by = {r["impl"]: r for r in rows}
    assert by["torch.matmul"]["median_us"] == 11.0  # the later measurement
    assert by["cuBLAS-nn"]["median_us"] == 9.0 and by["cuBLAS-nn"]["details"] == {"sets": 4}
    assert s.measured_impls("H100", P, "kernel", "kernel:v1") == {"torch.matmul", "cuBLAS-nn"}
    assert s.measured_impls("H100", P, "kernel", "kernel:v2") == set()  # other protocol: not measured
    assert s.measured_impls("H200", P, "kernel", "kernel:v1") == set()  # other GPU: not measured
    s.finish_run(run, "done")
    assert s.runs()[0]["status"] == "done" and s.runs()[0]["provenance"] == {"commit": "abc"}
    s.close()
    # reopen: everything is still there (and WAL mode)
    s2 = Store(tmp_path / "a.sqlite")
    assert len(s2.measurements()) == 2
    assert s2.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_measured_impls_after_a_run_counts_only_later_runs(tmp_path):
    s = Store(tmp_path / "a.sqlite")
    r1 = s.start_run("gemmrl bench", "H100", {}, {})
    s.record_session(r1, "s1", "H100", P, "kernel", "kernel:v1", {"torch.matmul": _st(10.0), "cuBLAS-nn": _st(9.0)})
    r2 = s.start_run("gemmrl bench", "H100", {}, {})
    s.record_session(r2, "s2", "H100", P, "kernel", "kernel:v1", {"torch.matmul": _st(11.0)})
    assert s.measured_impls("H100", P, "kernel", "kernel:v1", after_run=r1) == {"torch.matmul"}
    assert s.measured_impls("H100", P, "kernel", "kernel:v1", after_run=r2) == set()
    assert s.measured_impls("H100", P, "kernel", "kernel:v1", after_run=0) == {"torch.matmul", "cuBLAS-nn"}
    s.close()


def test_session_is_atomic(tmp_path):
    s = Store(tmp_path / "b.sqlite")
    run = s.start_run("x", "H100", {}, {})
    bad = {"ok": _st(1.0), "broken": {"median_us": object()}}  # second row cannot be stored
    with pytest.raises(sqlite3.Error):
        s.record_session(run, "s", "H100", P, "kernel", "kernel:v1", bad)
    assert s.measurements() == []  # nothing half-written


def test_verifications_tuning_peaks(tmp_path):
    s = Store(tmp_path / "c.sqlite")
    run = s.start_run("x", "H100", {}, {})
    assert s.verification("H100", P, "k") is None
    s.record_verification(run, "H100", P, "k", False, "exact test: 3 outputs differ", {"rel_err": 1.0})
    s.record_verification(run, "H100", P, "k", True, "", {"rel_err": 2e-4})
    v = s.verification("H100", P, "k")
    assert v["passed"] is True and v["details"]["rel_err"] == 2e-4
    assert [x["passed"] for x in s.verifications("H100")] == [False, True]
    s.put_tuning("H100", Q, "cuBLASLt-auto-tuning-nn", b"\x01" * 64, "algo=1", 2.5)
    s.put_tuning("H100", Q, "cuBLASLt-auto-tuning-nn", b"\x02" * 64, "algo=2", 2.0)
    t = s.get_tuning("H100", Q, "cuBLASLt-auto-tuning-nn")
    assert bytes(t["choice"]) == b"\x02" * 64 and t["info"] == "algo=2"
    assert s.get_tuning("H200", Q, "cuBLASLt-auto-tuning-nn") is None
    assert s.latest_peaks("H100") is None
    s.record_peaks(run, "H100", 700.0, 3000.0)
    assert s.latest_peaks("H100") == {"matrix_tflops": 700.0, "bandwidth_gbs": 3000.0}
    assert s.reference_peaks("H100") == {"matrix_tflops": 700.0, "bandwidth_gbs": 3000.0}


def test_reference_peaks_are_the_median_of_the_latest_readings(tmp_path, monkeypatch):
    """One low bandwidth reading (the H200's 4097 GB/s after 4248 and 4250) must not move every
    report's roofline fractions: the reports and the judge take the median of the latest ones."""
    import pytest

    from gemmrl.store import db as dbmod

    s = Store(tmp_path / "p.sqlite")
    run = s.start_run("x", "H200", {}, {})
    now = [1000.0]
    monkeypatch.setattr(dbmod.time, "time", lambda: now[0])
    assert s.reference_peaks("H200") is None
    for tf, bw in [(900.0, 9000.0), (756.1, 4247.8), (755.8, 4249.7), (717.2, 4096.5)]:
        now[0] += 10.0
        s.record_peaks(run, "H200", tf, bw)
    assert s.latest_peaks("H200") == {"matrix_tflops": 717.2, "bandwidth_gbs": 4096.5}
    assert s.reference_peaks("H200", window=3) == {"matrix_tflops": 755.8, "bandwidth_gbs": 4247.8}
    assert s.reference_peaks("H200") == pytest.approx({"matrix_tflops": (756.1 + 755.8) / 2,
                                                       "bandwidth_gbs": (4247.8 + 4249.7) / 2})
    assert s.reference_peaks("H200", window=1) == s.latest_peaks("H200")
    assert s.reference_peaks("H100") is None
    with pytest.raises(ValueError, match="window"):
        s.reference_peaks("H200", window=0)


def test_schema_version_mismatch_is_refused(tmp_path):
    s = Store(tmp_path / "d.sqlite")
    s.db.execute("UPDATE meta SET value='99' WHERE key='schema'")
    s.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(tmp_path / "d.sqlite")


def test_summarize_samples():
    st = stats.summarize_samples([4.0, 1.0, 3.0, 2.0, 100.0])
    assert st["median_us"] == 3.0 and st["min_us"] == 1.0 and st["n"] == 5
    assert st["mean_us"] == pytest.approx(22.0)
    assert st["p90_us"] == pytest.approx(4.0 + 0.6 * 96.0)
    with pytest.raises(ValueError):
        stats.summarize_samples([])
    with pytest.raises(ValueError, match="finite and positive"):
        stats.summarize_samples([1.0, float("nan")])


def test_roofline_and_tflops():
    p = Problem(8192, 8192, 8192)
    assert stats.tflops(p.flops, 1e6) == pytest.approx(p.flops / 1e12)
    floor = stats.roofline_floor_us(p.flops, p.min_bytes, 800.0, 3000.0)
    assert floor == pytest.approx(p.flops / 800e12 * 1e6)  # compute-bound
    skinny = Problem(64, 64, 16384)
    floor = stats.roofline_floor_us(skinny.flops, skinny.min_bytes, 800.0, 3000.0)
    assert floor == pytest.approx(skinny.min_bytes / 3000e9 * 1e6)  # memory-bound
    assert stats.repeat_noise(10.0, 10.1) == pytest.approx(0.01)


def test_close_folds_the_wal_into_one_file(tmp_path):
    s = Store(tmp_path / "e.sqlite")
    run = s.start_run("x", "H100", {}, {})
    s.record_session(run, "s", "H100", P, "kernel", "kernel:v1", {"k": _st(1.0)})
    s.close()
    import shutil
    only = tmp_path / "copy.sqlite"
    shutil.copy(tmp_path / "e.sqlite", only)  # the main file alone, as it travels
    assert len(Store(only).measurements()) == 1


def test_readonly_store_reads_without_writing(tmp_path):
    s = Store(tmp_path / "f.sqlite")
    run = s.start_run("x", "H100", {}, {})
    s.record_session(run, "s", "H100", P, "kernel", "kernel:v1", {"k": _st(2.0)})
    s.close()
    before = (tmp_path / "f.sqlite").read_bytes()
    ro = Store(tmp_path / "f.sqlite", readonly=True)
    assert ro.measurements()[0]["median_us"] == 2.0 and ro.quarantined("H100", P) == {}
    with pytest.raises(sqlite3.OperationalError):
        ro.start_run("y", "H100", {}, {})
    ro.close()
    assert (tmp_path / "f.sqlite").read_bytes() == before
    with pytest.raises(StoreError, match="no store at"):
        Store(tmp_path / "missing.sqlite", readonly=True)


def test_search_and_judge_rotate_inputs_through_more_than_the_l2():
    # the search's quick protocol must time candidates under the same cache conditions as the
    # judge's kernel mode, or small shapes look faster in the search than in the final timing
    pytest.importorskip("torch")
    from gemmrl.bench.timing import QUICK, KernelSettings, n_input_sets

    l2 = 60 << 20  # H200
    for shape in ((64, 256, 128), (512, 512, 512), (4096, 4096, 4096), (64, 64, 64)):
        p = Problem(*shape)
        per_set = p.min_bytes + 2 * p.K * p.N
        for s in (QUICK, KernelSettings()):
            n = n_input_sets(p, l2, s)
            assert n * per_set >= min(2 * l2, 1024 * per_set), (shape, s, n)
        assert n_input_sets(p, l2, QUICK) == n_input_sets(p, l2, KernelSettings())


def test_invalidated_measurements_are_kept_skipped_and_measured_again(tmp_path):
    s = Store(tmp_path / "i.sqlite")
    run = s.start_run("gemmrl bench", "H100", {}, {})
    s.record_session(run, "s1", "H100", P, "kernel", "kernel:v1", {"torch.compile": _st(5.0), "torch.matmul": _st(6.0)})
    s.record_session(run, "s2", "H100", Q, "kernel", "kernel:v1", {"torch.compile": _st(2.0)})
    with pytest.raises(StoreError):
        s.invalidate(run, "torch.compile", [P], " ")
    assert s.invalidate(run, "torch.compile", [P], "ran eagerly") == 1
    assert s.invalidate(run, "torch.compile", [P], "again") == 0  # already marked
    assert s.measured_impls("H100", P, "kernel", "kernel:v1") == {"torch.matmul"}  # to measure again
    assert s.measured_impls("H100", Q, "kernel", "kernel:v1") == {"torch.compile"}  # other shape untouched
    row = next(r for r in s.measurements() if r["impl"] == "torch.compile" and r["M"] == P.M)
    assert row["status"] == "invalid" and row["details"]["invalidated"] == "ran eagerly"
    assert row["median_us"] == 5.0  # kept, not deleted
    # one mode of one session, every implementation (a session whose timings were all wrong)
    s.record_session(run, "s3", "H100", Q, "offline", "offline:v1", {"torch.compile": _st(9.0), "torch.matmul": _st(8.0)})
    s.record_session(run, "s3", "H100", Q, "kernel", "kernel:v1", {"torch.matmul": _st(2.5)})
    assert s.invalidate(run, None, [Q], "session beyond the floor", mode="kernel") == 2
    assert s.measured_impls("H100", Q, "kernel", "kernel:v1") == set()
    assert s.measured_impls("H100", Q, "offline", "offline:v1") == {"torch.compile", "torch.matmul"}


def test_times_beyond_the_physical_floor_are_invalid():
    peaks = {"matrix_tflops": 700.0, "bandwidth_gbs": 3000.0}
    big = Problem(12288, 1024, 2048)  # 51.5 GFLOP: 73.6 us at 700 TFLOP/s
    floor = stats.roofline_floor_us(big.flops, big.min_bytes, 700.0, 3000.0)
    assert floor == pytest.approx(73.6, rel=0.01)
    ok = {"torch.matmul": _st(82.0), "ours": _st(78.0), "slow": {"status": "wrong", "n": 0}}
    assert stats.judge_floor(big, ok, peaks, {"torch.matmul"}) == ok  # near the floor is fine
    assert stats.judge_floor(big, {"ours": _st(1.3)}, None, set()) == {"ours": _st(1.3)}  # no peaks: unjudged
    # an untrusted kernel timed far beyond the floor: it alone is invalid, with the reason
    got = stats.judge_floor(big, {"torch.matmul": _st(82.0), "ours": _st(40.0)}, peaks, {"torch.matmul"})
    assert got["torch.matmul"]["status"] == "ok" and got["ours"]["status"] == "invalid"
    assert "faster than the physical floor" in got["ours"]["details"]["reason"]
    assert got["ours"]["details"]["was"] == "ok" and got["ours"]["median_us"] == 40.0
    # a library baseline (or its repeat) beyond the floor: the session's timings are not measurements
    got = stats.judge_floor(big, {"torch.matmul@repeat": _st(5.2), "ours": _st(80.0), "other": {"status": "wrong"}},
                            peaks, {"torch.matmul"})
    assert {n: r["status"] for n, r in got.items()} == {"torch.matmul@repeat": "invalid", "ours": "invalid",
                                                         "other": "invalid"}
    assert "session beyond the physical floor (torch.matmul@repeat)" in got["ours"]["details"]["reason"]


def test_tuning_effort_sums_finished_runs_for_one_precision(tmp_path):
    s = Store(tmp_path / "e.sqlite")
    r1 = s.start_run("gemmrl tune", "H200", {}, {})
    s.record_trial(r1, "H200", P, "cand-a", "ok", 1.1, 5.0, {})
    s.record_trial(r1, "H200", Q, "cand-b", "wrong", 0.0, None, {})
    s.finish_run(r1, "done")
    r2 = s.start_run("gemmrl tune", "H200", {}, {})  # cut: never finished
    s.record_trial(r2, "H200", P, "cand-c", "ok", 0.9, 6.0, {})
    r3 = s.start_run("gemmrl tune", "H200", {}, {})  # another precision: not counted
    s.record_trial(r3, "H200", Problem(64, 64, 64, acc="fp16"), "cand-d", "ok", 1.0, 1.0, {})
    s.put_tuning("H200", P, "gemmrl-tuned", b"{}", "", 5.0)
    s.db.execute("UPDATE runs SET started = finished - 12.5 WHERE id = ?", (r1,))
    e = s.tuning_effort("H200", "fp16", "fp32", "gemmrl-tuned")
    assert e == {"runs": [r1, r2], "wall_s": 12.5, "unfinished_runs": [r2], "candidates": 3, "shapes": 1}
    assert s.tuning_effort("H100", "fp16", "fp32", "gemmrl-tuned")["candidates"] == 0


def test_report_measurements_take_each_shapes_ratios_from_the_subjects_session(tmp_path):
    s = Store(tmp_path / "r.sqlite")
    run = s.start_run("gemmrl bench", "H200", {}, {})
    # session 1: the subject beside the baselines; session 2 (later): the baselines alone (a noise
    # study); session 3: an optional baseline in a session of its own; Q: never the subject
    s.record_session(run, "s1", "H200", P, "offline", "offline:v2",
                     {"gemmrl-tuned": _st(8.0), "torch.matmul": _st(10.0), "cuBLAS-nn": _st(9.0)})
    s.record_session(run, "s2", "H200", P, "offline", "offline:v3:ci=0.005",
                     {"torch.matmul": _st(20.0), "cuBLAS-nn": _st(19.0)})
    s.record_session(run, "s3", "H200", P, "offline", "offline:v2", {"torch.compile": _st(30.0)})
    s.record_session(run, "s4", "H200", P, "kernel", "kernel:v1", {"torch.matmul": _st(4.0)})
    s.record_session(run, "s5", "H200", Q, "offline", "offline:v2", {"torch.matmul": _st(7.0)})
    s.record_session(run, "s6", "H200", P, "offline", "offline:v2", {"cuBLASLt-heuristic-nn": {**_st(1.0), "status": "wrong"}})
    got = {(r["M"], r["mode"], r["impl"]): r["median_us"] for r in s.report_measurements("gemmrl-tuned")}
    assert got == {(P.M, "offline", "gemmrl-tuned"): 8.0, (P.M, "offline", "torch.matmul"): 10.0,
                   (P.M, "offline", "cuBLAS-nn"): 9.0,  # the subject's session, not s2's later ones
                   (P.M, "offline", "torch.compile"): 30.0,  # not in s1: its own latest
                   (P.M, "kernel", "torch.matmul"): 4.0, (Q.M, "offline", "torch.matmul"): 7.0}
    # the plain latest view pairs the subject with s2's baselines: what the report must not do
    latest = {(r["M"], r["mode"], r["impl"]): r["median_us"] for r in s.measurements() if r["status"] == "ok"}
    assert latest[(P.M, "offline", "torch.matmul")] == 20.0
    # a subject never timed: the latest of everything
    assert ({(r["M"], r["mode"], r["impl"]): r["median_us"] for r in s.report_measurements("cuda-l2")}
            == {k: v for k, v in latest.items()})


def test_a_store_committed_as_xz_is_unpacked_on_first_use_and_packed_back(tmp_path):
    import lzma
    import os

    from click.testing import CliRunner

    from gemmrl.cli import main
    from gemmrl.store.db import Store, decompress, packed_path, unpack_if_missing

    db = tmp_path / "res" / "gemmrl.sqlite"
    s = Store(db)
    rid = s.start_run("gemmrl bench", "GPU X", {"torch": "t"}, {})
    s.record_peaks(rid, "GPU X", 700.0, 4000.0)
    s.close()
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--compress"])
    assert r.exit_code == 0, r.output
    xz = packed_path(db)
    assert xz == tmp_path / "res" / "gemmrl.sqlite.xz" and "wrote" in r.output and "1 runs" in r.output
    from gemmrl.store.columns import MAGIC, content_digest

    assert lzma.decompress(xz.read_bytes()).startswith(MAGIC)  # the column form, not the file
    # --small: xz's strongest setting; the same rows, the store itself untouched
    before = db.read_bytes()
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--compress", "--small"])
    assert r.exit_code == 0 and "wrote" in r.output, r.output
    assert db.read_bytes() == before
    copy = tmp_path / "copy.sqlite"
    decompress(xz, copy)
    assert content_digest(copy) == content_digest(db)
    assert Store(copy, readonly=True).latest_peaks("GPU X")["matrix_tflops"] == 700.0
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--small"])
    assert r.exit_code == 2 and "--small goes with --compress" in r.output
    os.remove(db)  # a fresh clone: only the .xz
    msgs = []
    assert unpack_if_missing(db, msgs.append) and msgs == [f"unpacking {xz} -> {db}"]
    assert Store(db, readonly=True).latest_peaks("GPU X")["matrix_tflops"] == 700.0
    assert not unpack_if_missing(db, msgs.append)  # never over a file that exists
    os.remove(db)
    assert Store(db).runs()[0]["command"] == "gemmrl bench"  # the constructor unpacks too
    r = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output
    os.utime(xz, (db.stat().st_mtime + 100,) * 2)  # a pull brought a newer .xz: say so, keep the file
    assert not unpack_if_missing(db, msgs.append) and "is newer than" in msgs[-1]
    assert not list(tmp_path.glob("res/.*"))  # no temporary file left behind


def test_a_broken_xz_leaves_no_half_store(tmp_path):
    import lzma

    from gemmrl.store.db import packed_path, unpack_if_missing

    db = tmp_path / "gemmrl.sqlite"
    packed_path(db).write_bytes(lzma.compress(b"x" * 1000)[:-20])  # truncated
    with pytest.raises((lzma.LZMAError, EOFError)):
        unpack_if_missing(db, lambda m: None)
    assert not db.exists() and list(tmp_path.iterdir()) == [packed_path(db)]


def _run_with_rows(store, command, shape, impl, us, winner=None, created=None):
    from gemmrl.core.problem import Problem

    rid = store.start_run(command, "GPU X", {"commit": "c"}, {})
    p = Problem(*shape)
    store.record_peaks(rid, "GPU X", 700.0, 4000.0)
    store.record_verification(rid, "GPU X", p, impl, True, "", {})
    store.record_session(rid, f"s-{command}", "GPU X", p, "kernel", "kernel:v1",
                         {impl: {"status": "ok", "median_us": us, "mean_us": us, "min_us": us, "p10_us": us,
                                 "p90_us": us, "std_us": 0.0, "n": 10, "details": {}}})
    store.record_trial(rid, "GPU X", p, "cand", "ok", 1.1, us, {"x": 1})
    if winner is not None:
        store.put_tuning("GPU X", p, "gemmrl-tuned", winner, f"{winner!r}", us)
        if created is not None:
            store.db.execute("UPDATE tuning SET created=? WHERE impl='gemmrl-tuned' AND M=?", (created, shape[0]))
    store.finish_run(rid)
    return rid


def test_merge_adds_the_other_stores_new_runs_once_with_their_rows(tmp_path):
    import shutil

    from click.testing import CliRunner

    from gemmrl.cli import main
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store, StoreError, pack

    a = tmp_path / "a.sqlite"
    s = Store(a)
    _run_with_rows(s, "common", (64, 64, 64), "torch.matmul", 5.0, winner=b"old", created=100.0)
    s.close()
    b = tmp_path / "b.sqlite"
    shutil.copy(a, b)  # a device call took a copy ...
    sb = Store(b)
    _run_with_rows(sb, "on the device", (128, 64, 64), "torch.matmul", 7.0)
    sb.put_tuning("GPU X", Problem(64, 64, 64), "gemmrl-tuned", b"new", "re-tuned there", 4.0)  # newer
    sb.close()
    sa = Store(a)  # ... while this store went on
    _run_with_rows(sa, "here", (256, 64, 64), "cuBLAS-nn", 9.0)
    added = sa.merge(b)
    assert added == {"runs": 1, "peaks": 1, "verifications": 1, "measurements": 1, "trials": 1,
                     "trajectories": 0, "tuning": 1, "quarantine": 0}
    runs = sa.runs()
    assert [r["command"] for r in runs] == ["common", "here", "on the device"] and runs[-1]["id"] == 3
    got = {(m["M"], m["impl"]): (m["median_us"], m["run_id"]) for m in sa.measurements()}
    assert got == {(64, "torch.matmul"): (5.0, 1), (256, "cuBLAS-nn"): (9.0, 2), (128, "torch.matmul"): (7.0, 3)}
    assert bytes(sa.db.execute("SELECT choice FROM tuning").fetchone()[0]) == b"new"  # the newer winner
    sa.put_tuning("GPU X", Problem(64, 64, 64), "gemmrl-tuned", b"newest", "here, later", 3.0)
    assert [t["run_id"] for t in sa.db.execute("SELECT run_id FROM trials ORDER BY id")] == [1, 2, 3]
    assert sa.merge(b) == {"runs": 0, "peaks": 0, "verifications": 0, "measurements": 0, "trials": 0,
                           "trajectories": 0, "tuning": 0, "quarantine": 0}  # twice: nothing more
    assert bytes(sa.db.execute("SELECT choice FROM tuning").fetchone()[0]) == b"newest"  # an older one loses
    with pytest.raises(StoreError, match="is this store"):
        sa.merge(a)
    sa.close()
    # through the CLI, from the .xz a device call returns
    c = tmp_path / "c.sqlite"
    shutil.copy(b, c)
    sc = Store(c)
    _run_with_rows(sc, "second device call", (512, 64, 64), "torch.matmul", 3.0)
    sc.close()
    xz = pack(c)
    r = CliRunner().invoke(main, ["store", "--db", str(a), "--merge", str(xz)])
    assert r.exit_code == 0, r.output
    assert "merged" in r.output and "1 runs" in r.output and "1 measurements" in r.output
    r = CliRunner().invoke(main, ["store", "--db", str(a), "--merge", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output
    # a missing source leaves no empty store behind where there was none
    r = CliRunner().invoke(main, ["store", "--db", str(tmp_path / "new.sqlite"), "--merge", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output and str(tmp_path / "none.sqlite") in r.output
    assert not (tmp_path / "new.sqlite").exists()


def test_a_device_call_sends_back_only_its_own_runs(tmp_path):
    """store --merge FULL --since-run N into an empty store: the runs after N with their rows, and
    the winners and quarantines written since the first of them started, nothing older; merged
    into the store the call started from, it adds exactly what a merge of the full copy adds."""
    import shutil

    from click.testing import CliRunner

    from gemmrl.cli import main
    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store, pack

    home = tmp_path / "home.sqlite"
    s = Store(home)
    _run_with_rows(s, "old 1", (64, 64, 64), "torch.matmul", 5.0, winner=b"old", created=100.0)
    _run_with_rows(s, "old 2", (128, 64, 64), "torch.matmul", 6.0, winner=b"old2", created=101.0)
    s.quarantine("GPU X", Problem(64, 64, 64), "bad_kernel", "crashed")
    s.db.execute("UPDATE quarantine SET created=50.0")
    s.close()
    full = tmp_path / "device.sqlite"
    shutil.copy(home, full)  # the device call's copy
    d = Store(full)
    last = max(r["id"] for r in d.runs())
    _run_with_rows(d, "on the device", (256, 64, 64), "cuBLAS-nn", 9.0, winner=b"new")
    d.quarantine("GPU X", Problem(256, 64, 64), "worse_kernel", "hung")
    d.close()
    delta = tmp_path / "delta.sqlite"
    r = CliRunner().invoke(main, ["store", "--db", str(delta), "--merge", str(full), "--since-run", str(last)])
    assert r.exit_code == 0, r.output
    sd = Store(delta)
    assert [x["command"] for x in sd.runs()] == ["on the device"]
    assert [(m["M"], m["impl"]) for m in sd.measurements()] == [(256, "cuBLAS-nn")]
    assert [row[0] for row in sd.db.execute("SELECT M FROM tuning")] == [256]
    assert [row[0] for row in sd.db.execute("SELECT name FROM quarantine")] == ["worse_kernel"]
    sd.close()
    assert delta.stat().st_size <= full.stat().st_size
    via_delta, via_full = tmp_path / "h1.sqlite", tmp_path / "h2.sqlite"
    shutil.copy(home, via_delta)
    shutil.copy(home, via_full)
    a, b = Store(via_delta), Store(via_full)
    assert a.merge(delta) == b.merge(full)
    assert {(m["M"], m["impl"], m["median_us"]) for m in a.measurements()} == \
        {(m["M"], m["impl"], m["median_us"]) for m in b.measurements()}
    r = CliRunner().invoke(main, ["store", "--db", str(delta), "--since-run", "3"])
    assert r.exit_code == 2 and "--since-run goes with --merge" in r.output

def test_processes_started_together_on_a_packed_store_unpack_it_once(tmp_path):
    """Four processes opening a store that exists only as its .xz at the same moment (two GPUs'
    steps of one device call) must not each rename their own copy into place: one that opened
    the first copy would share the -wal file with the next, and the store came back malformed."""
    import os
    import subprocess
    import sys

    from gemmrl.core.problem import Problem
    from gemmrl.store.db import Store, pack

    db = tmp_path / "gemmrl.sqlite"
    s = Store(db)
    for i in range(400):  # incompressible rows: an unpack takes long enough for the others to start one
        s.put_tuning("GPU X", Problem(64 + i, 64, 64), "gemmrl-tuned", os.urandom(20000), "x", 1.0)
    s.close()
    pack(db)
    db.unlink()
    go = tmp_path / "go"
    code = ("import sys, time, pathlib; from gemmrl.store.db import Store, unpack_if_missing\n"
            "from gemmrl.core.problem import Problem\n"
            "while not pathlib.Path(sys.argv[3]).exists(): time.sleep(0.0005)\n"  # start together
            "did = unpack_if_missing(sys.argv[1], lambda m: None)\n"
            "s = Store(sys.argv[1]); s.put_tuning('GPU X', Problem(8, 8, int(sys.argv[2])), 'w', b'{}', '', 1.0)\n"
            "s.close(); print('unpacked' if did else 'found')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(db), str(k), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(1, 5)]
    import time

    time.sleep(3)  # every process imported and waiting
    go.touch()
    done = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-800:] for _, err in done]
    assert sorted(out.strip() for out, _ in done) == ["found"] * 3 + ["unpacked"]
    s = Store(db, readonly=True)
    assert s.db.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert s.db.execute("select count(*) from tuning").fetchone()[0] == 404  # every process's write kept
    assert not [p for p in tmp_path.glob(".*")]  # no temporary or lock file left


def test_best_baseline_is_the_fastest_latest_ok_baseline(tmp_path):
    """The search times this baseline beside its candidates: the fastest baseline by its latest
    ok measurement in the mode; gemmrl's own kernels, repeats, failed rows, other shapes, modes
    and devices do not count."""
    s = Store(tmp_path / "b.sqlite")
    run = s.start_run("x", "H100", {}, {})
    assert s.best_baseline("H100", P) is None
    s.record_session(run, "s1", "H100", P, "kernel", "kernel:v1", {
        "cuBLASLt-auto-tuning-nn": _st(9.0), "torch.matmul": _st(10.0), "gemmrl-tuned": _st(5.0),
        "torch.matmul@repeat": _st(7.0)})
    assert s.best_baseline("H100", P) == ("cuBLASLt-auto-tuning-nn", 9.0)
    # a later, slower measurement of the same baseline replaces the earlier one
    s.record_session(run, "s2", "H100", P, "kernel", "kernel:v1", {"cuBLASLt-auto-tuning-nn": _st(12.0)})
    assert s.best_baseline("H100", P) == ("torch.matmul", 10.0)
    # a failed measurement is not a time; other modes, devices and shapes are apart
    s.record_session(run, "s3", "H100", P, "kernel", "kernel:v1", {"cuBLAS-nn": {"status": "wrong", "n": 0}})
    s.record_session(run, "s4", "H100", P, "offline", "offline:v2", {"cuBLAS-tn": _st(1.0)})
    s.record_session(run, "s5", "H200", P, "kernel", "kernel:v1", {"cuBLAS-tn": _st(1.0)})
    s.record_session(run, "s6", "H100", Problem(P.M, P.N, P.K + 64), "kernel", "kernel:v1", {"cuBLAS-tn": _st(1.0)})
    assert s.best_baseline("H100", P) == ("torch.matmul", 10.0)
    assert s.best_baseline("H100", P, mode="offline") == ("cuBLAS-tn", 1.0)


def test_storing_the_same_choice_again_keeps_when_it_was_made(monkeypatch):
    """A final timing stores the winner again with its new time: the choice's `created` stays, so
    the kernel-mode sessions since the choice (runtime.pack's median rule) still count; a new
    choice restarts it."""
    import time as _time

    from gemmrl.runtime.pack import _session_speedups

    s = Store(":memory:")
    clock = [1000.0]
    monkeypatch.setattr(_time, "time", lambda: clock[0])
    s.put_tuning("H100", Q, "gemmrl-tuned", b'{"spec": 1}', "first", 5.0)

    def created():
        return s.db.execute("SELECT created FROM tuning WHERE impl='gemmrl-tuned'").fetchone()[0]

    clock[0] = 2000.0
    s.put_tuning("H100", Q, "gemmrl-tuned", b'{"spec": 1}', "timed again", 4.5)
    assert created() == 1000.0
    assert s.get_tuning("H100", Q, "gemmrl-tuned") == {"choice": b'{"spec": 1}', "info": "timed again", "time_us": 4.5}
    # two sessions timed the choice, one before the re-store: both count
    run = s.start_run("bench", "H100", {}, {})
    for sess, at in (("a", 1500.0), ("b", 2500.0)):
        clock[0] = at
        s.record_session(run, sess, "H100", Q, "kernel", "kernel:v3",
                         {"gemmrl-tuned": {"status": "ok", "n": 10, "median_us": 4.0},
                          "torch.matmul": {"status": "ok", "n": 10, "median_us": 5.0}})
    assert len(_session_speedups(s, "H100", Q.dtype, Q.acc)[(*Q.key()[:3], "gemmrl-tuned")]) == 2
    clock[0] = 3000.0
    s.put_tuning("H100", Q, "gemmrl-tuned", b'{"spec": 2}', "a new winner", 3.0)
    assert created() == 3000.0
    assert (*Q.key()[:3], "gemmrl-tuned") not in _session_speedups(s, "H100", Q.dtype, Q.acc)
    # baselines' rows (cuBLASLt algorithms) too: same algorithm, same time of choice
    s.put_tuning("H100", Q, "cuBLASLt-auto-tuning-nn", b"\x01", "algo=1", 2.5)
    clock[0] = 4000.0
    s.put_tuning("H100", Q, "cuBLASLt-auto-tuning-nn", b"\x01", "algo=1", 2.4)
    assert s.db.execute("SELECT created FROM tuning WHERE impl='cuBLASLt-auto-tuning-nn'").fetchone()[0] == 3000.0


def test_trials_of_some_problems_come_oldest_first_with_their_records(tmp_path):
    """Store.trials(device, problems) reads each problem's trials through the index: the same
    rows, in the same order (by id, across problems), as the whole device's trials filtered."""
    s = Store(tmp_path / "s.sqlite")
    a, b, c = Problem(64, 64, 64), Problem(128, 64, 64), Problem(64, 64, 64, acc="fp16")
    for i, (dev, p) in enumerate([("H200", a), ("H200", b), ("H100", a), ("H200", c), ("H200", a), ("H200", b)]):
        s.record_trial(None, dev, p, f"k{i}", "ok", 1.0 + i, 2.0 + i, {"i": i})
    every = s.trials("H200")
    assert [r["candidate"] for r in every] == ["k0", "k1", "k3", "k4", "k5"]
    got = s.trials("H200", [b, a, a])  # any order, a problem twice: each row once, by id
    assert [r["candidate"] for r in got] == ["k0", "k1", "k4", "k5"]
    assert [r["record"] for r in got] == [{"i": 0}, {"i": 1}, {"i": 4}, {"i": 5}]
    assert got == [r for r in every if (r["M"], r["N"], r["K"], r["dtype"], r["acc"]) in {a.key(), b.key()}]
    assert s.trials("H200", [c])[0]["candidate"] == "k3" and s.trials("H200", []) == []
    assert [r["candidate"] for r in s.trials("H100", iter([a]))] == ["k2"]
