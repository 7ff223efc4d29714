"""Fixtures of the store suites: a migrated database on each backend (via the root ``db_url`` fixture), a manual
clock, and the engine stores built on them."""

from __future__ import annotations

import pytest

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database


@pytest.fixture
def settings() -> Settings:
    # The ownership constants, pinned so a developer's SMTHRS_* environment cannot change the tests.
    return load_settings(
        stale_after_s=30.0, skew_allowance_s=10.0, heartbeat_interval_s=1.0, host_id="host-a"
    )


@pytest.fixture
def runs(db: Database, journal: Journal, clock: ManualClock) -> RunStore:
    return RunStore(db, journal=journal, clock=clock)
