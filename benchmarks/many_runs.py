"""Many coordinators on one database: N processes (N = 1, 2, 4, 8), each driving its own run of a no-op plan
through the public API, against one SQLite file and against one PostgreSQL database — beside the same N processes
doing raw single-row commits on that database, measured side by side in one run.

    python benchmarks/many_runs.py [--quick] [--plans K] [--nodes M] [--commits C] [--n 1,2,4,8]

Per backend: one database (SQLite: a new file; PostgreSQL: a scratch database created beside
``SMTHRS_BENCH_POSTGRES_URL``, else ``SMTHRS_TEST_POSTGRES_URL``, dropped afterwards; skipped with a note when
neither is set) and max(N) worker processes, started once: each opens its runtime and settles a 10-node warm-up
run. Then per N, the first N workers run three phases, each released at once from a start line (every worker
ready, its plans compiled) and timed from it to the last worker's end (a system-wide monotonic clock):
  raw     C single-row transactions per process, each on its own row of one table in the same database: SQLite
          ``BEGIN IMMEDIATE``/``UPDATE``/``COMMIT`` at WAL + ``synchronous=FULL`` (as shipped); PostgreSQL an
          ``UPDATE`` + ``COMMIT`` at the server's defaults (READ COMMITTED, its durability)
  nodes   K plans (runs) of M independent no-op nodes per process: ``rt.scheduler(run_id).run(plan, executor)``
          on ``sp.open_runtime(...)`` with its defaults (local thread host, the real cache dispatch seam: keys,
          attempt rows, journal, cache rows, the sandbox root)
  raw     again; the figure printed is the mean of both raw phases, so both sides see the same load
Printed per backend and N: settled nodes/s and raw commits/s (totals over the N processes), their ratio (nodes
per raw commit), and how many runs completed — a run the store gave up on (e.g. PostgreSQL serialization
conflicts beyond the retry budget) is counted and its error printed, not hidden. Node bodies name their run: no
node is served from another run's cache entry. Anchors first: cores, Python, one process's raw commit on a fresh
SQLite file (and PostgreSQL when set). A measurement, not a test; the machine is shared, so compare figures
within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sqlite3
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import smthrs_plugin as sp
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.stores.database import open_database

RAW_TABLE = "bench_many_raw"
WARMUP_NODES = 10


def noop(_: Any) -> None:
    return None


def make_plan(run_id: str, nodes: int) -> sp.plan.Plan:
    return sp.plan.compile_plan(
        f"many-{run_id}",
        "bench",
        [sp.plan.node(f"n{i}", body=f"{run_id}/{i}") for i in range(nodes)],
        maximum_plan_nodes=nodes + 10,
    )


# ------------------------------------------------------------------------------------------------ raw commits


class RawSqlite:
    """Single-row commits on this process's own row, at WAL + ``synchronous=FULL``."""

    def __init__(self, path: str, row: int) -> None:
        self.con = sqlite3.connect(path, isolation_level=None, timeout=60)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=FULL")
        self.row = row

    def commit(self) -> None:
        self.con.execute("BEGIN IMMEDIATE")
        self.con.execute(f"UPDATE {RAW_TABLE} SET v = v + 1 WHERE id = ?", (self.row,))
        self.con.execute("COMMIT")

    def close(self) -> None:
        self.con.close()


class RawPostgres:
    """Single-row commits on this process's own row at the server's defaults (READ COMMITTED, its durability).

    Not SERIALIZABLE: on a table this small the UPDATE scans it whole, so SERIALIZABLE would lock it whole and make
    every concurrent commit a serialization failure — the baseline would measure retries, not commits."""

    def __init__(self, url: str, row: int) -> None:
        import psycopg

        self.con = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        self.row = row

    def commit(self) -> None:
        self.con.execute(f"UPDATE {RAW_TABLE} SET v = v + 1 WHERE id = %s", (self.row,), prepare=True)
        self.con.commit()

    def close(self) -> None:
        self.con.close()


def raw_committer(url: str, row: int) -> RawSqlite | RawPostgres:
    if url.startswith("sqlite:///"):
        return RawSqlite(url[len("sqlite:///") :], row)
    return RawPostgres(url, row)


def create_raw_table(url: str, rows: int) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql(f"CREATE TABLE {RAW_TABLE} (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)")
        for i in range(rows):
            c.exec_driver_sql(f"INSERT INTO {RAW_TABLE} VALUES ({i}, 0)")
    engine.dispose()


def anchor_ms(url: str | None, n: int) -> float:
    """One process's raw commit (ms) on a fresh SQLite file (``url`` None) or the given PostgreSQL database."""
    with tempfile.TemporaryDirectory(prefix="smthrs-bench-anchor-") as tmp:
        target = url or f"sqlite:///{os.path.join(tmp, 'raw.db')}"
        if url is None:
            sqlite3.connect(target[len("sqlite:///") :]).execute("PRAGMA journal_mode=WAL").close()
        create_raw_table(target, 1)
        raw = raw_committer(target, 0)
        for _ in range(20):
            raw.commit()
        t0 = time.perf_counter()
        for _ in range(n):
            raw.commit()
        dt = time.perf_counter() - t0
        raw.close()
        if url is not None:
            import sqlalchemy as sa

            engine = sa.create_engine(url)
            with engine.begin() as c:
                c.exec_driver_sql(f"DROP TABLE {RAW_TABLE}")
            engine.dispose()
    return dt / n * 1000


# ----------------------------------------------------------------------------------------------- the workers


def worker(index: int, url: str, workspace: str, commands: Any, results: Any, go: Any) -> None:
    """One coordinator process: a runtime on the shared database, then phases on command (see the docstring)."""
    try:
        with sp.open_runtime(workspace=Path(workspace), db=url) as rt:
            rt.scheduler(f"warm-{index}").run(make_plan(f"warm-{index}", WARMUP_NODES), noop)
            raw = raw_committer(url, index)
            while (cmd := commands.get()) is not None:
                kind, arg, nodes = cmd
                plans = [make_plan(run_id, nodes) for run_id in arg] if kind == "nodes" else []
                results.put(("ready", index, None))
                go.wait()
                built, failed = 0, []
                if kind == "raw":
                    for _ in range(arg):
                        raw.commit()
                else:
                    for run_id, plan in zip(arg, plans, strict=True):
                        try:
                            report = rt.scheduler(run_id).run(plan, noop)
                        except SmthrsError as exc:
                            # A run the store gave up on is a result of this benchmark: counted and printed.
                            failed.append(f"{type(exc).__name__}({exc.code}): {exc.message}")
                            continue
                        built += sum(1 for s in report.settlements if s.outcome == "built")
                results.put(("done", index, (time.monotonic(), built, failed)))
            raw.close()
    except BaseException as exc:
        results.put(("error", index, repr(exc)))
        raise


class Pool:
    """Worker processes on one database, driven phase by phase; a phase uses the first N of them."""

    def __init__(self, n: int, url: str, tmp: str) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        #: The start line: set once every worker of the phase said it is ready (its plans compiled).
        self.go = ctx.Event()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=worker,
                args=(i, url, os.path.join(tmp, f"ws-{i}"), self.commands[i], self.results, self.go),
            )
            for i in range(n)
        ]
        for p in self.procs:
            p.start()

    def _collect(self, kind: str, n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            tag, index, value = self.results.get(timeout=600)
            if tag == "error":
                raise RuntimeError(f"worker {index} failed: {value}")
            assert tag == kind, (tag, kind)
            out.append(value)
        return out

    def phase(self, cmds: list[tuple[str, Any, int]]) -> tuple[float, int, list[str]]:
        """Run one phase (one command each for the first ``len(cmds)`` workers) from the start line;
        (seconds from it to the last worker's end, nodes built, errors of the runs that failed)."""
        for q, cmd in zip(self.commands, cmds, strict=False):
            q.put(cmd)
        self._collect("ready", len(cmds))
        t0 = time.monotonic()
        self.go.set()
        done = self._collect("done", len(cmds))
        self.go.clear()  # every worker of the phase is past the line (it reported its end)
        return (
            max(end for end, _, _ in done) - t0,
            sum(built for _, built, _ in done),
            [e for _, _, errors in done for e in errors],
        )

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"worker exited with {p.exitcode}")


# --------------------------------------------------------------------------------------------------- backends


def fresh_postgres(base_url: str) -> tuple[str, Any]:
    import sqlalchemy as sa

    name = "bench_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return base_url.rsplit("/", 1)[0] + "/" + name, drop


def measure(backend: str, base: str | None, counts: list[int], args: argparse.Namespace) -> None:
    """Print one row per N: settled nodes/s and raw commits/s (totals over N processes), on one database."""
    with tempfile.TemporaryDirectory(prefix="smthrs-bench-many-") as tmp:
        if backend == "sqlite":
            url, drop = f"sqlite:///{os.path.join(tmp, 'state.db')}", None
        else:
            assert base is not None
            url, drop = fresh_postgres(base)
        try:
            open_database(url).close()  # migrate once, before the workers open it
            create_raw_table(url, max(counts))
            pool = Pool(max(counts), url, tmp)
            try:
                first: float | None = None
                for n in counts:
                    raw_cmd = [("raw", args.commits, 0)] * n
                    nodes_cmd = [
                        ("nodes", [f"n{n}-p{i}-r{j}" for j in range(args.plans)], args.nodes)
                        for i in range(n)
                    ]
                    raw1, _, _ = pool.phase(raw_cmd)
                    nodes_s, built, failed = pool.phase(nodes_cmd)
                    raw2, _, _ = pool.phase(raw_cmd)
                    rate = built / nodes_s
                    raw = statistics.mean([n * args.commits / raw1, n * args.commits / raw2])
                    first = first or rate
                    runs = n * args.plans
                    print(
                        f"{backend:<10} {n:>2} {rate:9.0f} {rate / first:6.2f}x {raw:14.0f} {rate / raw:12.3f}x"
                        f" {runs - len(failed):>4}/{runs}",
                        flush=True,
                    )
                    for error in sorted(set(failed)):
                        print(f"  {failed.count(error)} run(s) failed: {error}")
            finally:
                pool.close()
        finally:
            if drop is not None:
                drop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller: 50-node plans, 50 commits per process")
    ap.add_argument("--plans", type=int, default=1, help="plans (runs) per process")
    ap.add_argument("--nodes", type=int, default=200, help="no-op nodes per plan")
    ap.add_argument("--commits", type=int, default=100, help="raw commits per process per raw phase")
    ap.add_argument("--n", default="1,2,4,8", help="process counts")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.commits = 50, 50
    counts = [int(x) for x in args.n.split(",")]
    pg = os.environ.get("SMTHRS_BENCH_POSTGRES_URL") or os.environ.get("SMTHRS_TEST_POSTGRES_URL")

    print(f"anchors: {os.cpu_count()} cores, Python {platform.python_version()} ({platform.machine()})")
    sqlite_ms = anchor_ms(None, 200)
    print(
        f"  one process, raw SQLite commit (WAL, synchronous=FULL): {sqlite_ms:.3f} ms = {1000 / sqlite_ms:,.0f}/s"
    )
    if pg:
        pg_url, drop = fresh_postgres(pg)
        try:
            pg_ms = anchor_ms(pg_url, 200)
        finally:
            drop()
        print(
            f"  one process, raw PostgreSQL commit (server defaults): {pg_ms:.3f} ms = {1000 / pg_ms:,.0f}/s"
        )
    print()
    print(
        f"N processes x {args.plans} plan(s) x {args.nodes} no-op nodes; raw: {args.commits} single-row commits "
        "per process (mean of the phases before and after)"
    )
    print(
        f"{'backend':<10} {'N':>2} {'nodes/s':>9} {'vs N=1':>7} {'raw commits/s':>14} {'nodes/commit':>13}"
        f" {'runs ok':>9}"
    )
    backends: list[tuple[str, str | None]] = [("sqlite", None)] + ([("postgresql", pg)] if pg else [])
    for backend, base in backends:
        measure(backend, base, counts, args)
    if not pg:
        print("postgresql skipped: set SMTHRS_BENCH_POSTGRES_URL or SMTHRS_TEST_POSTGRES_URL")


if __name__ == "__main__":
    main()
