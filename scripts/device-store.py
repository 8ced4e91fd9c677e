#!/usr/bin/env python3
"""The store a device call starts from: exactly the committed store (results/gemmrl.sqlite.xz) and
the deltas the call carries (.ext/carry/delta*.sqlite[.xz]), nothing else. A warm machine keeps the
unpacked store between calls (it is an ignored file), with every earlier call's runs merged in.
That is what a session wants while it carries those calls' deltas, and wrong when it does not:
on 2026-12-01 three calls ran without the CUTLASS headers, their deltas were dropped, and the next
warm call still searched on their 211 wrongly rejected candidates. A changed .xz (another commit's
store) was kept too: `unpack_if_missing` leaves a local file alone.

    python3 scripts/device-store.py results/gemmrl.sqlite .ext/carry/delta1.sqlite.xz ...

Unpacks the store where it is missing, and unpacks it again (saying why) where the .xz is not the one
it was unpacked from or where it holds a run that is neither in that .xz nor in a carried delta.
What it was unpacked from is kept beside it (DB.base: the .xz's SHA-256 and its last run id). It
merges nothing: device-steps.sh merges the deltas after it. Exit 0, or 2 on a bad argument."""

from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_keys(db: Path, after: int = 0) -> set[tuple]:
    """(started, command, device) of the runs of `db` with an id above `after`: how Store.merge
    tells one run from another across stores."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {tuple(r) for r in con.execute("SELECT started, command, device FROM runs WHERE id > ?", (after,))}
    finally:
        con.close()


def delta_keys(path: Path) -> set[tuple]:
    """The runs of a carried delta, .sqlite or .sqlite.xz (unpacked to a temporary file)."""
    if path.suffix != ".xz":
        return run_keys(path)
    from gemmrl.store.db import decompress

    with tempfile.TemporaryDirectory() as d:
        plain = decompress(path, Path(d) / "delta.sqlite")
        return run_keys(plain)


def remove_store(db: Path) -> None:
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), base_path(db)):
        p.unlink(missing_ok=True)


def base_path(db: Path) -> Path:
    return db.with_name(db.name + ".base")


def max_run(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0])
    finally:
        con.close()


def why_stale(db: Path, packed: Path, deltas: list[Path]) -> str | None:
    """Why the unpacked store at `db` is not the committed one plus `deltas` (None: it is)."""
    base = base_path(db)
    if not base.exists():
        return f"{base.name} is missing: what {db.name} was unpacked from is not known"
    try:
        info = json.loads(base.read_text())
        digest, last = info["sha256"], int(info["max_run"])
    except (ValueError, KeyError, TypeError):
        return f"{base.name} is unreadable"
    if digest != sha256(packed):
        return f"{packed.name} changed since {db.name} was unpacked (another commit's store)"
    extra = run_keys(db, last)
    carried = set()
    for d in deltas:
        try:
            carried |= delta_keys(d)
        except Exception as e:  # noqa: BLE001 - unreadable: its runs count as not carried
            print(f"device-store.py: could not read {d} ({type(e).__name__}: {e})", file=sys.stderr)
    lost = extra - carried
    if lost:
        return (f"{len(lost)} of its {len(extra)} runs after the committed ones are in no carried delta "
                f"(an earlier call's, not carried now)")
    return None


def prepare(db: Path, packed: Path, deltas: list[Path], log=print) -> bool:
    """Make `db` the committed store plus what `deltas` will add; True if it (re)unpacked."""
    from gemmrl.store.db import decompress

    if db.exists():
        why = why_stale(db, packed, deltas)
        if why is None:
            log(f"{db}: the committed store and carried deltas only; kept")
            return False
        log(f"{db}: unpacked again: {why}")
        remove_store(db)
    else:
        log(f"unpacking {packed} -> {db}")
    decompress(packed, db)
    base_path(db).write_text(json.dumps({"sha256": sha256(packed), "max_run": max_run(db)}) + "\n")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db", type=Path, help="the unpacked store (results/gemmrl.sqlite); its .xz lies beside it")
    ap.add_argument("deltas", type=Path, nargs="*", help="the deltas this call carries")
    a = ap.parse_args(argv)
    packed = a.db.with_name(a.db.name + ".xz")
    if not packed.exists():
        if a.db.exists():  # nothing committed to compare with (a store made on the machine): used as it is
            print(f"{a.db}: no {packed.name} beside it; used as it is")
            return 0
        print(f"device-store.py: no {packed} and no {a.db}", file=sys.stderr)
        return 2
    missing = [str(d) for d in a.deltas if not d.exists()]
    if missing:
        print(f"device-store.py: no such delta: {', '.join(missing)}", file=sys.stderr)
        return 2
    prepare(a.db, packed, list(a.deltas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
