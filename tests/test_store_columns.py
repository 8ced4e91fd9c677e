"""The store's committed column form (gemmrl/store/columns.py): every value, rowid and schema
statement comes back; a cut stream is refused; the older form (the SQLite file, xz-compressed)
still unpacks."""

import json
import lzma
import sqlite3

import pytest

from gemmrl.core.problem import Problem
from gemmrl.store import columns
from gemmrl.store.db import Store, StoreError, decompress, pack, packed_path


def _store_with_awkward_values(path):
    s = Store(path)
    rid = s.start_run("gemmrl bench --shapes 'a\nb'", "GPU X", {"torch": "2.x", "note": "é ü \u2603 \"q\""}, {})
    s.record_peaks(rid, "GPU X", 700.0, 4000.0)
    p = Problem(256, 512, 1024)
    s.record_verification(rid, "GPU X", p, "gemmrl-tuned", True, "",
                          {"rel_err": 0.00020747633393928646, "names": ["_ZN7cutlass\\x", "tab\there"]})
    s.record_session(rid, "sess-1", "GPU X", p, "kernel", "kernel:v3",
                     {"torch.matmul": {"status": "ok", "median_us": 12.345678901234567, "mean_us": 1e-300,
                                       "min_us": 3.0, "p10_us": float("inf"), "p90_us": 0.1 + 0.2, "std_us": None,
                                       "n": 10, "details": {"paired": {"x": 1.0015664169050813}}}})
    s.put_tuning("GPU X", p, "cuBLASLt-auto-tuning-nn", b"\x00\x01B\xff" * 8, "algo=66", 11.0)
    s.put_tuning("GPU X", Problem(64, 64, 64), "gemmrl-tuned", b"{\"spec\": 1}", "w", 2.0)
    s.put_tuning("GPU X", Problem(128, 64, 64), "gemmrl-tuned", b"{\"spec\": 2}", "w", 3.0)
    s.finish_run(rid)
    # rowid gaps in a table whose rowid is not a column of its own: the rowids must survive
    s.db.execute("DELETE FROM tuning WHERE M=64")
    s.db.execute("CREATE TABLE extra (a, b BLOB, c TEXT)")
    s.db.executemany("INSERT INTO extra (rowid, a, b, c) VALUES (?, ?, ?, ?)",
                     [(7, 2**62, None, ""), (3, -1.5, b"", "line\nbreak"), (1000, None, b"\n", "null")])
    s.close()
    return path


def test_the_column_form_gives_back_every_value_rowid_and_index(tmp_path):
    db = _store_with_awkward_values(tmp_path / "gemmrl.sqlite")
    xz = pack(db)
    assert lzma.decompress(xz.read_bytes()).startswith(columns.MAGIC)
    back = decompress(xz, tmp_path / "back.sqlite")
    assert columns.content_digest(back) == columns.content_digest(db)
    c = sqlite3.connect(back)
    assert c.execute("SELECT rowid, a, b, c FROM extra ORDER BY rowid").fetchall() == [
        (3, -1.5, b"", "line\nbreak"), (7, 2**62, None, ""), (1000, None, b"\n", "null")]
    assert c.execute("SELECT typeof(b) FROM extra WHERE rowid=7").fetchone() == ("null",)
    assert c.execute("SELECT choice FROM tuning WHERE impl LIKE 'cuBLASLt%'").fetchone()[0] == b"\x00\x01B\xff" * 8
    indexes = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"verif_key", "meas_key", "trials_key"} <= indexes
    c.close()
    s = Store(back, readonly=True)  # and it reads as a store
    assert s.latest_peaks("GPU X")["matrix_tflops"] == 700.0
    s.close()
    # the digest sees a change of one value (so the equality above means something)
    c = sqlite3.connect(back)
    c.execute("UPDATE measurements SET median_us = median_us * (1 + 1e-15)")
    c.commit()
    c.close()
    assert columns.content_digest(back) != columns.content_digest(db)


def test_a_cut_column_stream_is_refused_and_leaves_nothing(tmp_path):
    db = _store_with_awkward_values(tmp_path / "gemmrl.sqlite")
    raw = lzma.decompress(pack(db).read_bytes())
    target = tmp_path / "out" / "back.sqlite"
    for cut in (raw[: len(raw) // 2], raw[: -len(columns.END)], raw[: len(columns.MAGIC) + 5]):
        bad = tmp_path / "bad.xz"
        bad.write_bytes(lzma.compress(cut))
        with pytest.raises(StoreError):
            decompress(bad, target)
        assert not target.exists() and not list(target.parent.iterdir())  # no temporary file or spill left


def test_a_malformed_value_is_refused(tmp_path):
    db = _store_with_awkward_values(tmp_path / "gemmrl.sqlite")
    raw = lzma.decompress(pack(db).read_bytes())
    head, manifest, rest = raw.split(b"\n", 2)
    rest = rest.replace(b"null", b"nul!", 1)
    (tmp_path / "bad.xz").write_bytes(lzma.compress(head + b"\n" + manifest + b"\n" + rest))
    with pytest.raises(StoreError, match="not a column of JSON values"):
        decompress(tmp_path / "bad.xz", tmp_path / "back.sqlite")
    assert json.loads(manifest)["tables"][0]["name"] == "meta"


def test_the_older_form_still_unpacks(tmp_path):
    db = _store_with_awkward_values(tmp_path / "gemmrl.sqlite")
    old = tmp_path / "old.sqlite.xz"
    old.write_bytes(lzma.compress(db.read_bytes()))  # what pack wrote before the column form
    back = decompress(old, tmp_path / "back.sqlite")
    assert back.read_bytes() == db.read_bytes()


def test_a_table_with_a_column_named_rowid_is_refused(tmp_path):
    db = tmp_path / "x.sqlite"
    c = sqlite3.connect(db)
    c.execute("CREATE TABLE t (rowid INTEGER, v)")
    c.execute("INSERT INTO t VALUES (5, 'x')")
    c.commit()
    c.close()
    with pytest.raises(StoreError, match="column named rowid"):
        pack(db)
    assert not packed_path(db).exists() and not list(tmp_path.glob(".*"))


def _round_store_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "round-store.py"
    spec = importlib.util.spec_from_file_location("round_store", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measured_floats_are_stored_to_seven_digits_and_older_rows_rewritten_once(tmp_path):
    from gemmrl.store.db import measured

    assert measured(12.345678901234567) == 12.34568 and measured(0.1 + 0.2) == 0.3
    # exact: integral floats (a FLOP count), timestamps, non-floats, inf
    for x in (549755813888.0, 1795754102.3048828, 3.0, 7, None, "1.23456789", float("inf"), True):
        assert measured(x) is x
    db = tmp_path / "gemmrl.sqlite"
    s = Store(db)
    rid = s.start_run("gemmrl bench", "GPU X", {}, {})
    p = Problem(256, 512, 1024)
    details = {"paired": {"x": 1.0015664169050813}, "flops": 549755813888.0, "t": 1795754102.3048828,
               "rounds": [0.30000000000000004, 2]}
    s.record_session(rid, "s1", "GPU X", p, "kernel", "kernel:v3",
                     {"torch.matmul": {"status": "ok", "median_us": 12.345678901234567, "mean_us": 12.0,
                                       "min_us": None, "p10_us": 1 / 3, "p90_us": 13.5, "std_us": 0.0,
                                       "n": 5, "details": details}})
    s.record_trial(rid, "GPU X", p, "cand", "ok", 1.0123456789, 10 / 3, {"timing": {"median_us": 10 / 3}})
    row = s.db.execute("SELECT median_us, mean_us, min_us, p10_us, details FROM measurements").fetchone()
    assert tuple(row)[:4] == (12.34568, 12.0, None, 0.3333333)
    assert json.loads(row[4]) == {"paired": {"x": 1.001566}, "flops": 549755813888.0, "t": 1795754102.3048828,
                                  "rounds": [0.3, 2]}
    assert tuple(s.db.execute("SELECT reward, time_us, record FROM trials").fetchone()) == (
        1.012346, 3.333333, '{"timing": {"median_us": 3.333333}}')
    # a row written before the store rounded (raw digits, keys in another order)
    s.db.execute("INSERT INTO trials (run_id, device, M, N, K, dtype, acc, candidate, status, reward, time_us, "
                 "record, created) VALUES (?, 'GPU X', 1, 2, 3, 'fp16', 'fp32', 'old', 'ok', ?, ?, ?, ?)",
                 (rid, 1.0123456789, 2 / 3, '{"z": 0.1234567891, "a": 1}', 1795754102.3048828))
    s.close()
    mod = _round_store_script()
    changed = mod.round_store(db)
    assert changed["trials.reward"] == 1 and changed["trials.time_us"] == 1 and changed["trials.record"] == 1
    assert sum(changed.values()) == 3  # the rows the store wrote itself were already as it keeps them
    c = sqlite3.connect(db)
    assert c.execute("SELECT reward, time_us, record, created FROM trials WHERE candidate='old'").fetchone() == (
        1.012346, 0.6666667, '{"a": 1, "z": 0.1234568}', 1795754102.3048828)
    c.close()
    assert sum(mod.round_store(db).values()) == 0  # once only
    assert mod.main(["--db", str(tmp_path / "none.sqlite")]) == 1
