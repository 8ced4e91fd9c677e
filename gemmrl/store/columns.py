"""The store's committed form: its tables written column by column, one JSON value a line, then
xz-compressed (what `pack` writes as results/gemmrl.sqlite.xz and `decompress` reads back).

Why not the SQLite file itself, xz-compressed: git keeps the store, and every device call carries
the whole working tree within 64 MiB. Compressed as a file, the 305 MB store of 2026-11-27 took
29.7 MB (a VACUUMed copy at xz -9e), and each session added about 2 MB. Written column by
column, like values sit together (a column of medians, one of JSON details, one of device names),
which xz compresses far better than the pages of a b-tree where they interleave: 24.4 MB for the
same store at the same setting (12.6 MB once the store kept its measured floats to 7
significant digits: db.measured). Nothing is rounded or dropped here: every value comes back as it was
(floats through their shortest exact repr, blobs as hex), each table's rows in rowid order and
with their rowids, with the schema's own CREATE statements (`content_digest` compares two
stores; the tests check the round trip).

Stream (inside the xz):
  MAGIC                                   one line
  manifest                                one JSON line: {"schema": [[type, name, sql], ...],
                                          "tables": [{"name", "columns", "rows"}, ...]}
  for each table, for each of its columns (rowid first, unless an INTEGER PRIMARY KEY is the
  rowid): "rows" lines, the column's values in rowid order: null, an integer, a float, a
  string, or {"b": HEX} for a blob
  END                                     one line (a stream cut short is refused, not half read)
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
from pathlib import Path

MAGIC = b"gemmrl-store-columns 1\n"
END = b"end of gemmrl-store-columns\n"
CHUNK = 20000  # rows a load inserts at a time


class ColumnsError(RuntimeError):
    """A column stream that is cut short or malformed."""


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # JSON reader's spelling


def _encode(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bytes):
        return '{"b":"' + v.hex() + '"}'
    if isinstance(v, str):
        return json.dumps(v)
    s = repr(v)  # int, or float: the shortest repr that reads back to the same double
    return _NONFINITE.get(s, s)


def _tables(conn: sqlite3.Connection):
    """[(name, columns to write, whether the rowid is written)] and the schema statements, in the
    order sqlite_master keeps them."""
    schema = conn.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                          "AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall()
    tables = []
    for kind, name, sql in schema:
        if kind != "table":
            continue
        info = conn.execute(f"PRAGMA table_info({_q(name)})").fetchall()
        cols = [r[1] for r in info]
        pk = [r for r in info if r[5]]
        without_rowid = "WITHOUT ROWID" in sql.upper()
        # a lone INTEGER PRIMARY KEY is the rowid itself: written once, as that column
        alias = len(pk) == 1 and pk[0][2].upper() == "INTEGER"
        if not (alias or without_rowid):
            if "rowid" in (c.lower() for c in cols):
                raise ColumnsError(f"table {name} has a column named rowid: its rowids cannot be kept")
            cols = ["rowid"] + cols
        tables.append((name, cols, without_rowid))
    return [list(s) for s in schema], tables


def dump(conn: sqlite3.Connection, out) -> None:
    """Write the store `conn` holds to the binary stream `out` in the column form, from one read
    snapshot (other processes may go on writing)."""
    conn.execute("BEGIN")
    try:
        schema, tables = _tables(conn)
        manifest = {"schema": schema, "tables": []}
        for name, cols, without_rowid in tables:
            rows = conn.execute(f"SELECT COUNT(*) FROM {_q(name)}").fetchone()[0]
            manifest["tables"].append({"name": name, "columns": cols, "rows": rows})
        out.write(MAGIC)
        out.write(json.dumps(manifest).encode() + b"\n")
        for (name, cols, without_rowid), t in zip(tables, manifest["tables"]):
            order = "" if without_rowid else " ORDER BY rowid"
            for col in cols:
                cur = conn.execute(f"SELECT {'rowid' if col == 'rowid' else _q(col)} FROM {_q(name)}{order}")
                n = 0
                while True:
                    batch = cur.fetchmany(CHUNK)
                    if not batch:
                        break
                    n += len(batch)
                    out.write(("\n".join(_encode(v) for (v,) in batch) + "\n").encode())
                if n != t["rows"]:  # cannot happen inside one snapshot; say so if it does
                    raise ColumnsError(f"{name}.{col}: {n} rows where the count said {t['rows']}")
        out.write(END)
    finally:
        conn.execute("ROLLBACK")


def _decode_lines(lines: list[bytes], where: str) -> list:
    try:
        values = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError as e:
        raise ColumnsError(f"{where}: not a column of JSON values ({e})") from None
    for i, v in enumerate(values):
        if isinstance(v, dict):
            values[i] = bytes.fromhex(v["b"])
    return values


def load(src, path: str | Path) -> Path:
    """Write the store the column stream `src` (binary, positioned after MAGIC) holds to `path`, a
    new SQLite file, through a temporary file renamed into place. ColumnsError if the stream is
    cut short or malformed: then nothing is left at `path`."""
    path = Path(path)
    try:
        manifest = json.loads(src.readline())
        schema, tables = manifest["schema"], manifest["tables"]
    except (ValueError, KeyError, TypeError) as e:
        raise ColumnsError(f"no column manifest ({e})") from None
    tmp = path.with_name(f".{path.name}.loading-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(str(tmp), isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("BEGIN")
        for kind, name, sql in schema:
            if kind == "table":
                conn.execute(sql)
        with tempfile.TemporaryDirectory(dir=path.parent) as spill:
            for t in tables:
                _load_table(conn, src, t, Path(spill))
        if src.readline() != END:
            raise ColumnsError("the stream does not end where its manifest says: cut short or malformed")
        for kind, name, sql in schema:  # indexes (and any view or trigger) once the rows are in
            if kind != "table":
                conn.execute(sql)
        conn.execute("COMMIT")
        conn.close()
        os.replace(tmp, path)
    except BaseException:
        conn.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def _load_table(conn, src, t: dict, spill: Path) -> None:
    """One table: its columns arrive one after another, so each is spilled to a file, and the rows
    are then read back from all of them in step (memory stays at a chunk of rows)."""
    name, cols, rows = t["name"], t["columns"], t["rows"]
    files = []
    for j, col in enumerate(cols):
        f = spill / f"{j}"
        with open(f, "wb") as dst:
            for _ in range(rows):
                line = src.readline()
                if not line.endswith(b"\n"):
                    raise ColumnsError(f"{name}.{col}: the stream ends before its {rows} rows")
                dst.write(line)
        files.append(f)
    insert = (f"INSERT INTO {_q(name)} ({', '.join('rowid' if c == 'rowid' else _q(c) for c in cols)}) "
              f"VALUES ({', '.join('?' * len(cols))})")
    handles = [open(f, "rb") for f in files]
    try:
        done = 0
        while done < rows:
            n = min(CHUNK, rows - done)
            columns = [_decode_lines([h.readline().rstrip(b"\n") for _ in range(n)], f"{name}.{c}")
                       for h, c in zip(handles, cols)]
            conn.executemany(insert, zip(*columns))
            done += n
    finally:
        for h in handles:
            h.close()
        for f in files:
            f.unlink()


def content_digest(path: str | Path) -> str:
    """A hash of everything a store holds: the schema statements (in any order) and every table's
    rows with their rowids, in rowid order (two stores with the same digest hold the same data, whatever their
    page layout)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        h = hashlib.sha256()
        schema, tables = _tables(conn)
        h.update(json.dumps(sorted(schema)).encode())  # a load creates the indexes last: order aside
        for name, cols, without_rowid in tables:
            sel = ", ".join("rowid" if c == "rowid" else _q(c) for c in cols)
            order = "" if without_rowid else " ORDER BY rowid"
            for row in conn.execute(f"SELECT {sel} FROM {_q(name)}{order}"):
                h.update(repr(row).encode())
        return h.hexdigest()
    finally:
        conn.close()
