#!/usr/bin/env python3
"""Rewrite a store's measured floats as the store now writes them (gemmrl.store.db.measured: 7
significant digits; integral floats, timestamps and anything of 1e9 or more left exact), for the
rows written before it rounded them: the measured REAL columns (db.MEASURED_COLUMNS) and the floats
inside the JSON columns (db.MEASURED_JSON), each JSON text written again exactly as the store
writes it (sorted keys). One transaction; run it again and it changes nothing. Prints what it
changed. No GPU needed.

    python3 scripts/round-store.py [--db results/gemmrl.sqlite]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def round_store(db_path) -> dict[str, int]:
    """{"table.column": rows changed}."""
    from gemmrl.store.db import MEASURED_COLUMNS, MEASURED_JSON, Store, measured, measured_tree

    store = Store(db_path)
    changed = {}
    store.db.create_function("gemmrl_measured", 1, measured, deterministic=True)
    with store.tx():
        for table, cols in MEASURED_COLUMNS.items():
            for col in cols:
                cur = store.db.execute(
                    f"UPDATE {table} SET {col} = gemmrl_measured({col}) "
                    f"WHERE typeof({col}) = 'real' AND {col} != gemmrl_measured({col})")
                changed[f"{table}.{col}"] = cur.rowcount
        for table, col in MEASURED_JSON.items():
            updates = []
            for rowid, text in store.db.execute(f"SELECT rowid, {col} FROM {table}"):
                new = json.dumps(measured_tree(json.loads(text)), sort_keys=True)
                if new != text:
                    updates.append((new, rowid))
            store.db.executemany(f"UPDATE {table} SET {col} = ? WHERE rowid = ?", updates)
            changed[f"{table}.{col}"] = len(updates)
    store.close()
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="results/gemmrl.sqlite")
    a = ap.parse_args(argv)
    from gemmrl.store.db import unpack_if_missing

    unpack_if_missing(a.db)
    if not Path(a.db).exists():
        print(f"no store at {a.db}", file=sys.stderr)
        return 1
    changed = round_store(a.db)
    for k, n in changed.items():
        print(f"{k}: {n} rows rewritten")
    print(f"{sum(changed.values())} values or texts rewritten in all; `gemmrl store --compress --small` packs it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
