"""One coordinator process for ``test_many_coordinators.py``: drives its runs (wide plans of no-op nodes) through
the public API against a shared database and reports every settlement it saw commit.

    _many_worker.py DB_URL WORKSPACE REPORT NODES RUN_ID...

``REPORT`` gets ``owner <nonce>`` first, then ``<run_id> <node_id> <attempt>`` per node this process built,
appended only AFTER the dispatch seam returned, i.e. after the transaction holding the settlement committed (so
a line can only name a durable settlement; a SIGKILL may lose the last line, never add one). ``attempt`` is the
attempt row number, read inside that same transaction. A run still held by a killed owner is claimed again until
its lease lapses (``SMTHRS_STALE_AFTER_S``), within a 120 s deadline.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.errors import FenceLost
from smthrs_plugin.stores.schema import attempts

CLAIM_DEADLINE_S = 120.0


def make_plan(run_id: str, nodes: int) -> sp.plan.Plan:
    """The run's plan: ``nodes`` independent no-op nodes whose bodies name the run (no cache hit across runs)."""
    return sp.plan.compile_plan(
        f"many-{run_id}",
        "many",
        [sp.plan.node(f"n{i}", body=f"{run_id}/{i}") for i in range(nodes)],
        maximum_plan_nodes=nodes + 10,
    )


def noop(_: Any) -> None:
    return None


class Reporting:
    """The runtime's dispatch seam, plus a report line once a built node's settlement committed."""

    def __init__(self, inner: Any, fd: int, nonce: str) -> None:
        self.inner = inner
        self.fd = fd
        self.nonce = nonce

    def dispatch(self, request: Any, execute: Any) -> Any:
        settle = request.on_settled
        row: list[int] = []
        digest = key_digest(request.key)

        def on_settled(conn: sa.Connection, result: Any) -> None:
            settle(conn, result)
            # The row this settlement completed, in its own transaction (a retried group commit runs it again:
            # the last value is the committed one). Read here with SQL of our own, so the rows a group commit
            # defers (Database.deferred) are written first, as the attempts owner does before its own reads.
            self.inner.db.flush_deferred()
            row[:] = [
                conn.execute(
                    sa.select(sa.func.max(attempts.c.attempt)).where(
                        attempts.c.run_id == request.run_id,
                        attempts.c.key_digest == digest,
                        attempts.c.owner_nonce == self.nonce,
                        attempts.c.state == "completed",
                    )
                ).scalar_one()
            ]

        result = self.inner.dispatch(replace(request, on_settled=on_settled), execute)
        if result.outcome == "built" and row and row[0] is not None:
            os.write(self.fd, f"{request.run_id} {request.node_id} {row[0]}\n".encode())
        return result


def drive(rt: Any, run_id: str, nodes: int) -> None:
    plan = make_plan(run_id, nodes)
    deadline = time.monotonic() + CLAIM_DEADLINE_S
    while True:
        try:
            report = rt.scheduler(run_id).run(plan, noop)
            break
        except FenceLost:
            # Held by a killed owner whose lease has not lapsed yet: claim again until it has.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    failed = [s for s in report.settlements if s.outcome not in ("built", "clean")]
    if failed:
        raise SystemExit(f"run {run_id}: nodes did not succeed: {failed}")


def main() -> None:
    db_url, workspace, report_path, nodes = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with sp.open_runtime(workspace=workspace, db=db_url) as rt:
        os.write(fd, f"owner {rt.owner.nonce}\n".encode())
        rt.dispatcher = Reporting(rt.dispatcher, fd, rt.owner.nonce)  # type: ignore[assignment]
        for run_id in sys.argv[5:]:
            drive(rt, run_id, nodes)
    os.close(fd)


if __name__ == "__main__":
    main()
