"""Run catalog pages with and without the catalog's indexes, and the cost of a watch snapshot, on SQLite.

Run: ``python benchmarks/observe.py [--runs 100000] [--pages 30]``.

One database of ``--runs`` run rows (bulk-inserted: statuses mostly ``completed``, a rare ``failed``, 40 flows,
a parent for 30% of the runs) is copied; the copy loses the six indexes of migration ``0004_run_catalog``. The
same first pages (limit 100) and the same deep pages (after a cursor in the middle of history) are read from both,
side by side; figures are per-page milliseconds (median) measured in this one run. Without the indexes the
planner must walk or sort the history for a rare value; with them it seeks. ``watch`` rows: a finite snapshot of
one 2,000-entry run partition, and of the whole journal (unscoped: partitions eight at a time). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa  # noqa: E402

from smthrs_plugin.observe.catalog import RunFilters, list_runs  # noqa: E402
from smthrs_plugin.observe.watch import watch  # noqa: E402
from smthrs_plugin.records.journal import Journal  # noqa: E402
from smthrs_plugin.stores.catalog_indexes import CATALOG_INDEXES  # noqa: E402
from smthrs_plugin.stores.database import Database, open_database  # noqa: E402
from smthrs_plugin.stores.schema import run_parents, runs  # noqa: E402


def fill(db: Database, n: int) -> None:
    rnd = random.Random(1)
    rows, edges = [], []
    for i in range(n):
        status = "failed" if rnd.random() < 0.002 else rnd.choice(["completed"] * 8 + ["pending", "running"])
        parent = f"r{rnd.randrange(i):07d}" if i and rnd.random() < 0.3 else None
        running = status == "running"
        rows.append(
            {
                "run_id": f"r{i:07d}",
                "flow": f"flow/{rnd.randrange(40)}",
                "status": status,
                "parent_run_id": parent,
                "lineage_id": f"r{i:07d}",
                "round_ordinal": 0,
                "created_at_ms": 1_700_000_000_000 + i * 10,
                "updated_at_ms": 1,
                "revision": i + 1,
                "owner_host": "h" if running else None,
                "owner_pid": 1 if running else None,
                "owner_nonce": "n" if running else None,
            }
        )
        if parent:
            edges.append({"child_id": f"r{i:07d}", "parent_id": parent, "seq": i + 1, "created_at_ms": 1})

    def insert(conn: sa.Connection) -> None:
        for k in range(0, len(rows), 5000):
            conn.execute(sa.insert(runs), rows[k : k + 5000])
        for k in range(0, len(edges), 5000):
            conn.execute(sa.insert(run_parents), edges[k : k + 5000])

    db.write(insert)
    db.write(lambda c: c.exec_driver_sql("ANALYZE"))
    journal = Journal(db)
    for p in range(40):
        db.write(lambda c, p=p: [journal.append_in(c, f"r{p:07d}", "step", {"i": i}) for i in range(50)])
    db.write(lambda c: [journal.append_in(c, "r0000100", "step", {"i": i}) for i in range(2000)])


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--pages", type=int, default=30)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="smthrs-bench-observe-"))
    try:
        indexed = open_database(f"sqlite:///{tmp / 'indexed.db'}")
        fill(indexed, args.runs)
        indexed.close()
        shutil.copy(tmp / "indexed.db", tmp / "bare.db")
        bare = open_database(f"sqlite:///{tmp / 'bare.db'}")
        for name in CATALOG_INDEXES:
            bare.write(lambda c, name=name: c.exec_driver_sql(f"DROP INDEX {name}"))
        indexed = open_database(f"sqlite:///{tmp / 'indexed.db'}")
        middle = f"r{args.runs // 2:07d}"
        cases = {
            "no filter": RunFilters(),
            "status=completed (80%)": RunFilters(status="completed"),
            "status=pending (10%)": RunFilters(status="pending"),
            "status=failed (0.2%)": RunFilters(status="failed"),
            "flow=flow/7": RunFilters(flow="flow/7"),
            "status+flow": RunFilters(status="completed", flow="flow/7"),
            "parent=r0000010": RunFilters(parent_run_id="r0000010"),
            "lineage": RunFilters(lineage_id=middle),
            "waiting=timer (none)": RunFilters(waiting_reason="timer"),
        }
        print(f"SQLite, {args.runs} runs, limit 100, median of {args.pages} pages (ms)")
        print(f"{'filter':<24} {'indexed':>9} {'no 0004':>9} {'ratio':>7}")
        for name, f in cases.items():
            a = median_ms(lambda f=f: list_runs(indexed, f, limit=100), args.pages)
            b = median_ms(lambda f=f: list_runs(bare, f, limit=100), args.pages)
            print(f"{name:<24} {a:9.2f} {b:9.2f} {b / a:6.1f}x")
        events = median_ms(lambda: list(watch(indexed, "r0000100", follow=False)), 5)
        print(
            f"watch snapshot, one run of 2,000 entries: {events:.1f} ms ({events / 2000 * 1000:.1f} us/event)"
        )
        whole = median_ms(lambda: list(watch(indexed, follow=False)), 3)
        print(f"watch snapshot, unscoped (41 partitions, 4,000 entries): {whole:.1f} ms")
        indexed.close()
        bare.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
