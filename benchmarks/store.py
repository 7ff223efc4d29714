"""Fenced run transitions per second vs a raw conditional-UPDATE loop on the same database (P6).

    python benchmarks/store.py [--n 3000] [--rounds 9] [--pg postgresql+psycopg://user@host:port/db]

PostgreSQL runs only with --pg or SMTHRS_TEST_POSTGRES_URL (a scratch database is created beside the given one and
dropped afterwards); SQLite uses a file in the temporary directory (``synchronous=FULL``, as shipped). Each
measurement alternates ours and raw in ``--rounds`` short rounds so both see the same machine load (the CPU and
the disk are shared): the rates printed are the medians per side, the ratio is the median of the per-round ratios
(ours over the raw round run right after it).

- heartbeat: ``Ownership.heartbeat``: a fenced compare-and-set on the owner columns plus the global revision bump,
  one serializable transaction (one statement: ``UPDATE runs ... WHERE fenced RETURNING`` with the revision bump
  riding in it; on PostgreSQL sent alone, so it is its own SERIALIZABLE transaction).
- park/resume: ``RunStore.suspend`` + ``Ownership.claim`` (claim, then activate): three fenced transitions, each
  with its revision bump and (suspend, activate) its journal record with the execution fact, in the same
  transaction, counted as 3 transitions. SQLite: three ``BEGIN IMMEDIATE`` transactions of 2-4 statements;
  PostgreSQL: three single statements (the journaled ones carry their record in a data-modifying CTE; the
  activation also checks in it that the control plane did not admit the run).
- engine park/resume: what a flow's wait does: ``WaitStore.park`` (``auto``: a timer wait if the run has a pending
  clock, else an event wait), ``WaitStore.wake``, ``Ownership.claim``: four transitions (park, wake, claim,
  activate), three of them journaled. SQLite: four transactions (the park also reads the earliest pending clock);
  PostgreSQL: four single statements (the park's "no pending clock" is a condition of its statement).

Raw baselines (same table, same row, a raw DBAPI connection):
- "raw tx": ``UPDATE runs ... WHERE run_id AND owner|status`` in its own transaction (SQLite ``BEGIN IMMEDIATE`` /
  ``COMMIT`` at ``synchronous=FULL``; PostgreSQL SERIALIZABLE ``BEGIN``/``COMMIT``): the rawest durable CAS at our
  isolation level. No revision counter, no journal.
- PostgreSQL also "raw autocommit": the same UPDATE as a single autocommitted statement (1 round trip instead of
  3): the floor for a one-statement transition.
Each park/resume baseline runs as many raw transactions as ours runs transitions (3, engine: 4).

Goal (P6): ours >= 0.5x raw tx, on SQLite and PostgreSQL, for every line. The run ends with one ``GOAL`` line per
line measured (ratio, met or NOT met, and the raw anchor). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.wait_rows import Parked, Woken
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.stores.database import Database, open_database

Op = Callable[[], None]

RAW_HB = (
    "UPDATE runs SET heartbeat_at_ms = {p}, revision = revision + 1 "
    "WHERE run_id = {p} AND status = 'running' AND owner_nonce = {p}"
)
RAW_STATUS = "UPDATE runs SET status = {p}, revision = revision + 1 WHERE run_id = {p} AND status = {p}"


def rate(n: int, op: Op) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        op()
    return n / (time.perf_counter() - t0)


GOAL = 0.5


def side_by_side(n: int, rounds: int, sides: dict[str, Op]) -> tuple[dict[str, float], dict[str, float]]:
    """(median rate per side, median per-round ratio of "ours" to every other side)."""
    for op in sides.values():
        for _ in range(20):
            op()  # warm up: pools, compiled statement caches, psycopg's server-side prepared statements
    samples: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for k, op in sides.items():
            samples[k].append(rate(max(1, n // rounds), op))
    rates = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {
        k: statistics.median(o / r for o, r in zip(samples["ours"], v, strict=True))
        for k, v in samples.items()
        if k != "ours"
    }
    return rates, ratios


def ours(db: Database, run_id: str) -> tuple[Op, Op, Op, str]:
    runs = RunStore(db)
    own = Ownership(db, journal=runs.journal)
    waits = WaitStore(db, journal=runs.journal, runs_store=runs)
    runs.create(run_id, "bench/flow")
    assert isinstance(own.claim(run_id), Activated)

    def heartbeat() -> None:
        own.heartbeat(run_id)

    def park_resume() -> None:
        runs.suspend(run_id, own.owner, "event")
        if not isinstance(own.claim(run_id), Activated):
            raise AssertionError("claim after suspend did not activate")

    def engine_park_resume() -> None:
        if not isinstance(waits.park(run_id, own.owner), Parked):
            raise AssertionError("park did not park")
        if not isinstance(waits.wake(run_id), Woken):
            raise AssertionError("wake did not wake")
        if not isinstance(own.claim(run_id), Activated):
            raise AssertionError("claim after wake did not activate")

    return heartbeat, park_resume, engine_park_resume, own.owner.nonce


def raw_ops(
    execute: Callable[[str, tuple[Any, ...]], int], begin: Op, commit: Op, p: str, run_id: str, nonce: str
) -> tuple[Op, Op, Op]:
    hb_sql, st_sql = RAW_HB.format(p=p), RAW_STATUS.format(p=p)

    def cas(sql: str, args: tuple[Any, ...]) -> None:
        begin()
        if execute(sql, args) != 1:
            raise AssertionError("raw CAS missed")
        commit()

    def heartbeat() -> None:
        cas(hb_sql, (time.time_ns() // 10**6, run_id, nonce))

    def park_resume() -> None:
        cas(st_sql, ("suspended", run_id, "running"))
        cas(st_sql, ("pending", run_id, "suspended"))
        cas(st_sql, ("running", run_id, "pending"))

    def engine_park_resume() -> None:
        cas(st_sql, ("suspended", run_id, "running"))
        cas(st_sql, ("pending", run_id, "suspended"))
        cas(st_sql, ("pending", run_id, "pending"))
        cas(st_sql, ("running", run_id, "pending"))

    return heartbeat, park_resume, engine_park_resume


Measured = tuple[dict[str, float], dict[str, float]]
#: (database, line, ratio to raw tx, raw tx rate in transitions/s), in the order measured: the GOAL lines.
RESULTS: list[tuple[str, str, float, float]] = []


def report(name: str, label: str, measured: Measured, per_op: int = 1) -> None:
    rates, ratios = measured
    parts = [f"ours {rates['ours'] * per_op:7.0f}/s"]
    for k, ratio in ratios.items():
        mark = f"  (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'})" if k == "raw tx" else ""
        parts.append(f"{k} {rates[k] * per_op:7.0f}/s -> {ratio:4.2f}x{mark}")
    print(f"{name:<10} {label:<19} " + "   ".join(parts))
    RESULTS.append((name, label, ratios["raw tx"], rates["raw tx"] * per_op))


def goal_lines() -> None:
    """One line per goal, last: ``GOAL <database> <line>: <ratio> (goal >= 0.50) met|NOT met`` and the anchor."""
    for name, label, ratio, raw_rate in RESULTS:
        verdict = "met" if ratio >= GOAL else "NOT met"
        print(
            f"GOAL {name} {label}: {ratio:.2f}x (goal >= {GOAL:.2f}) {verdict}  "
            f"[anchor: raw tx {raw_rate:.0f} transitions/s on this machine now]"
        )


def bench_sqlite(n: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.db")
        db = open_database(f"sqlite:///{path}")
        hb_ours, pr_ours, en_ours, _ = ours(db, "ours")
        _, _, _, nonce = ours(db, "raw")
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        conn.execute("PRAGMA synchronous = FULL")  # what ours runs with (also SQLite's default)
        hb_raw, pr_raw, en_raw = raw_ops(
            lambda sql, args: conn.execute(sql, args).rowcount,
            lambda: conn.execute("BEGIN IMMEDIATE") and None,
            lambda: conn.execute("COMMIT") and None,
            "?",
            "raw",
            nonce,
        )
        hb = side_by_side(n, rounds, {"ours": hb_ours, "raw tx": hb_raw})
        pr = side_by_side(max(1, n // 3), rounds, {"ours": pr_ours, "raw tx": pr_raw})
        en = side_by_side(max(1, n // 4), rounds, {"ours": en_ours, "raw tx": en_raw})
        conn.close()
        db.close()
    report("sqlite", "heartbeat", hb)
    report("sqlite", "park/resume", pr, per_op=3)
    report("sqlite", "engine park/resume", en, per_op=4)


def bench_postgres(base_url: str, n: int, rounds: int) -> None:
    import psycopg
    import sqlalchemy as sa

    name = "bench_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base_url.rsplit("/", 1)[0] + "/" + name
    try:
        db = open_database(url)
        hb_ours, pr_ours, en_ours, _ = ours(db, "ours")
        _, _, _, nonce = ours(db, "raw")
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        tx = psycopg.connect(dsn)
        tx.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        auto = psycopg.connect(dsn, autocommit=True)
        hb_tx, pr_tx, en_tx = raw_ops(
            lambda sql, args: tx.execute(sql, args, prepare=True).rowcount,
            lambda: None,
            tx.commit,
            "%s",
            "raw",
            nonce,
        )
        hb_auto, pr_auto, en_auto = raw_ops(
            lambda sql, args: auto.execute(sql, args, prepare=True).rowcount,
            lambda: None,
            lambda: None,
            "%s",
            "raw",
            nonce,
        )
        hb = side_by_side(n, rounds, {"ours": hb_ours, "raw tx": hb_tx, "raw autocommit": hb_auto})
        pr = side_by_side(
            max(1, n // 3), rounds, {"ours": pr_ours, "raw tx": pr_tx, "raw autocommit": pr_auto}
        )
        en = side_by_side(
            max(1, n // 4), rounds, {"ours": en_ours, "raw tx": en_tx, "raw autocommit": en_auto}
        )
        tx.close()
        auto.close()
        db.close()
        report("postgresql", "heartbeat", hb)
        report("postgresql", "park/resume", pr, per_op=3)
        report("postgresql", "engine park/resume", en, per_op=4)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="heartbeats per side (park/resume runs n/3 cycles)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds per side (medians reported)")
    ap.add_argument("--pg", default=os.environ.get("SMTHRS_TEST_POSTGRES_URL"), help="PostgreSQL URL")
    args = ap.parse_args()
    print(f"transitions per second (median of alternating rounds); goal (P6): ours >= {GOAL}x raw tx")
    bench_sqlite(args.n, args.rounds)
    if args.pg:
        bench_postgres(args.pg, args.n, args.rounds)
    else:
        print("postgresql skipped: pass --pg URL or set SMTHRS_TEST_POSTGRES_URL")
    goal_lines()


if __name__ == "__main__":
    main()
