"""Fixtures of the durable-waits suites: a migrated database on each backend (the root ``db_url`` fixture), fast
ownership timings, and the stores built on them. Real parts only: SQLite files, PostgreSQL databases, real
threads, real processes."""

from __future__ import annotations

import pytest

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database


@pytest.fixture
def fast() -> Settings:
    """Short ownership timings (heartbeat/poll 50 ms, stale after 1 s) so crash tests stay quick; pinned so a
    developer's SMTHRS_* environment cannot change the tests."""
    return load_settings(
        heartbeat_interval_s=0.05,
        stale_after_s=1.0,
        skew_allowance_s=0.1,
        heartbeat_failure_interrupt_s=0.6,
        wait_budget_s=30.0,
        wait_poll_s=0.05,
        host_id="waits-host",
    )


@pytest.fixture
def journal(db: Database) -> Journal:
    return Journal(db)


@pytest.fixture
def runs(db: Database, journal: Journal) -> RunStore:
    return RunStore(db, journal=journal)


@pytest.fixture
def waits(db: Database, journal: Journal, runs: RunStore) -> WaitStore:
    return WaitStore(db, journal=journal, runs_store=runs)
