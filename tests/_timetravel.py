"""Time passing without waiting, for tests that drive real processes (imported by name: the root conftest puts
this directory on sys.path).

A test whose outcome depends on a command finishing before a short real-time deadline flakes on a busy machine.
So the processes under test get deadlines and leases far longer than any command (an hour), and the
test moves the stored instant into the past in the database when it wants the time to have passed. A process
that re-armed a fresh deadline instead of keeping the stored one would then wait for hours, and the test fails —
so moving the stored value is also the stronger check.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.schema import runs as runs_table
from smthrs_plugin.stores.wait_tables import clock_deadlines

__all__ = ["let_the_deadline_pass", "expire_lease"]


def let_the_deadline_pass(db: Database, run_id: str, clock: str) -> int:
    """Move the stored deadline of ``run_id``'s clock ``clock`` (and the parked run's wake time, if it has one) to
    one second ago. Returns the new deadline (epoch ms)."""
    past = int(time.time() * 1000) - 1000
    k, r = clock_deadlines.c, runs_table.c

    def tx(c: sa.Connection) -> None:
        moved = c.execute(
            sa.update(clock_deadlines).where(k.execution_id == run_id, k.name == clock).values(due_at_ms=past)
        ).rowcount
        assert moved == 1, f"run {run_id!r} has no clock {clock!r}"
        c.execute(
            sa.update(runs_table).where(r.run_id == run_id, r.wake_at_ms.is_not(None)).values(wake_at_ms=past)
        )

    db.write(tx)
    return past


def expire_lease(db: Database, run_id: str) -> None:
    """Move a (dead) owner's last heartbeat an hour back, so its lease has expired: a takeover is only ever
    considered for an expired lease, however dead the owner's pid is."""
    r = runs_table.c
    db.write(
        lambda c: c.execute(
            sa.update(runs_table)
            .where(r.run_id == run_id, r.heartbeat_at_ms.is_not(None))
            .values(heartbeat_at_ms=r.heartbeat_at_ms - 3_600_000)
        )
    )
